# Installs the build at BUILD_DIR into WORK_DIR/prefix, then configures, builds and runs the
# consumer in SOURCE_DIR against it with find_package(brigade CONFIG REQUIRED).
file(REMOVE_RECURSE ${WORK_DIR})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${WORK_DIR}/prefix
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "install failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR}/build -G ${GENERATOR}
                -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_BUILD_TYPE=Release
                -DCMAKE_EXPORT_COMPILE_COMMANDS=ON
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "consumer configure failed: ${rc}\n${out}\n${err}")
endif()
# The package leaks no build choice into the consumer. Its scope (the consumer prints what
# find_package added and which build choices it changed): no choice changed or defined, and
# every new variable a result of brigade or of a dependency's own find module, none of
# brigade's temporaries. Its cache: no choice of brigade's. Its compile commands: no OpenMP or
# -march flag.
if(NOT out MATCHES "consumer changed choices: \\[\\]")
  message(FATAL_ERROR "find_package(brigade) changed build choices in the consumer's scope:\n${out}")
endif()
if(NOT out MATCHES "consumer new variables: \\[([^]]*)\\]")
  message(FATAL_ERROR "the consumer did not print its new variables:\n${out}")
endif()
string(REPLACE " " ";" _new "${CMAKE_MATCH_1}")
set(_allowed "^(brigade_(FOUND|DIR|CONFIG|CONSIDERED_.*|VERSION.*|[a-z]+_FOUND)|BLAS_|Eigen3_|EIGEN3_|fmt_|nlohmann_json_|NLOHMANN_JSON_|Threads_|THREADS_|CMAKE_THREAD_LIBS_INIT|CMAKE_USE_PTHREADS_INIT|CMAKE_HAVE_LIBC_PTHREAD|PTHREAD_C_CXX_TEST_SOURCE|FIND_PACKAGE_MESSAGE_DETAILS_|PACKAGE_PREFIX_DIR|MPI_|MPIEXEC|_MPI|CBC_|pkgcfg_lib_CBC_|PKG_CONFIG|PKGCONFIG_FOUND|PkgConfig_|_pkg|__pkg_config|_PKG_CONFIG|pkg_count|prefix_result|_imp_target|_no_cmake|CUDAToolkit_|CUDA_|cuda_driver_LIBRARY|NCCL_)")
foreach(_v IN LISTS _new)
  if(_v MATCHES "^(BLA_VENDOR|MPI_CXX_SKIP_MPICXX)$" OR NOT _v MATCHES "${_allowed}")
    message(FATAL_ERROR "find_package(brigade) left '${_v}' in the consumer's scope:\n${out}")
  endif()
endforeach()
file(STRINGS ${WORK_DIR}/build/CMakeCache.txt _cache)
foreach(_line IN LISTS _cache)
  if(_line MATCHES "^(BLA_VENDOR|MPI_CXX_SKIP_MPICXX|_brigade)[:=]" OR _line MATCHES "-fopenmp|-march=")
    message(FATAL_ERROR "the consumer's cache holds a choice of brigade's build: ${_line}")
  endif()
endforeach()
file(READ ${WORK_DIR}/build/compile_commands.json _commands)
foreach(_flag -fopenmp -march= -mavx -mfma)
  string(FIND "${_commands}" "${_flag}" _at)
  if(NOT _at EQUAL -1)
    message(FATAL_ERROR "the consumer compiles with ${_flag}, a choice of brigade's build:\n${_commands}")
  endif()
endforeach()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR}/build RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "consumer build failed: ${rc}")
endif()
# The consumer generates run.c's greedy story ("Once upon a time", stories260K) through its own
# decorator and partition policy, and trains under its own schedule generator.
set(_args)
if(MODEL_DIR)
  file(READ ${MODEL_DIR}/reference/stories260K_greedy.json _ref)
  string(JSON _steps GET "${_ref}" cases 1 steps)
  string(JSON _np LENGTH "${_ref}" cases 1 prompt_ids)
  string(JSON _ng LENGTH "${_ref}" cases 1 generated_ids)
  set(_ids)
  math(EXPR _last "${_np} - 1")
  foreach(_i RANGE ${_last})
    string(JSON _id GET "${_ref}" cases 1 prompt_ids ${_i})
    list(APPEND _ids ${_id})
  endforeach()
  math(EXPR _last "${_ng} - 1")
  foreach(_i RANGE ${_last})
    string(JSON _id GET "${_ref}" cases 1 generated_ids ${_i})
    if(NOT _id EQUAL 1)  # a terminating BOS is not a position's token
      list(APPEND _ids ${_id})
    endif()
  endforeach()
  string(REPLACE ";" "," _ids "${_ids}")
  set(_args ${MODEL_DIR} ${_steps} ${_np} ${_ids})
endif()
execute_process(COMMAND ${WORK_DIR}/build/consumer ${_args} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                ERROR_VARIABLE err)
message(STATUS "consumer printed: ${out}")
if(NOT rc EQUAL 0 OR NOT out MATCHES "brigade ok")
  message(FATAL_ERROR "consumer failed: rc=${rc}\n${out}\n${err}")
endif()
# A component that was not built must fail find_package with a message naming it.
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR}/build-missing -G ${GENERATOR}
                -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCONSUMER_COMPONENTS=nosuchcomponent
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT "${out}${err}" MATCHES "nosuchcomponent")
  message(FATAL_ERROR "find_package with a missing component did not fail clearly: ${out}${err}")
endif()
