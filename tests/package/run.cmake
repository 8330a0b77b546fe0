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
# The package leaks no build choice into the consumer: no variable set in its scope (the
# consumer prints them after find_package), no OpenMP or -march flag in its compile commands.
if(NOT out MATCHES "consumer scope: BLA_VENDOR=\\[\\] MPI_CXX_SKIP_MPICXX=\\[\\]")
  message(FATAL_ERROR "find_package(brigade) set variables in the consumer's scope:\n${out}")
endif()
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
execute_process(COMMAND ${WORK_DIR}/build/consumer RESULT_VARIABLE rc OUTPUT_VARIABLE out)
message(STATUS "consumer printed: ${out}")
if(NOT rc EQUAL 0 OR NOT out MATCHES "brigade ok")
  message(FATAL_ERROR "consumer failed: rc=${rc}")
endif()
# A component that was not built must fail find_package with a message naming it.
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR}/build-missing -G ${GENERATOR}
                -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCONSUMER_COMPONENTS=nosuchcomponent
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT "${out}${err}" MATCHES "nosuchcomponent")
  message(FATAL_ERROR "find_package with a missing component did not fail clearly: ${out}${err}")
endif()
