# `brigade train --verify drop --inject ...` under `mpirun -np 2` on stories260K: the seeded
# injector corrupts the same activations as on threads, the receiving rank flags them, every
# process drops the same micro-batches, so every step's loss, dropped micro-batches and counts
# equal the in-process run's; then --verify stop under mpirun stops naming the ranks and kind.
#   cmake -DMPIEXEC=mpirun -DNP_FLAG=-n -DCLI=build/examples/brigade -DDATA_DIR=models
#         -DWORK_DIR=/tmp/x -P tests/mpi/verify.cmake
foreach(_v MPIEXEC NP_FLAG CLI DATA_DIR WORK_DIR)
  if(NOT DEFINED ${_v})
    message(FATAL_ERROR "verify.cmake needs -D${_v}=...")
  endif()
endforeach()
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
set(_train train --model ${DATA_DIR}/stories260K.bin --tokenizer ${DATA_DIR}/tok512.bin
    --microbatches 4 --tokens-per-microbatch 64 --steps 30 --warmup 2 --timeout 20
    --inject bitflip:1:0.1:rank=0:seed=3)

macro(fail _what)
  message(FATAL_ERROR "${_what}\n--- stdout:\n${_out}\n--- stderr:\n${_err}")
endmacro()

execute_process(COMMAND ${MPIEXEC} ${NP_FLAG} 2 ${CLI} ${_train} --verify drop
                        --metrics ${WORK_DIR}/mpi.jsonl
                OUTPUT_VARIABLE _out ERROR_VARIABLE _err RESULT_VARIABLE _rc TIMEOUT 150)
if(NOT _rc EQUAL 0)
  fail("mpirun --verify drop: exit code ${_rc}")
endif()
execute_process(COMMAND ${CLI} ${_train} --stages 2 --verify drop --metrics ${WORK_DIR}/threads.jsonl
                OUTPUT_VARIABLE _out ERROR_VARIABLE _err RESULT_VARIABLE _rc TIMEOUT 150)
if(NOT _rc EQUAL 0)
  fail("threads --verify drop: exit code ${_rc}")
endif()
file(STRINGS ${WORK_DIR}/mpi.jsonl _mpi)
file(STRINGS ${WORK_DIR}/threads.jsonl _threads)
list(LENGTH _mpi _n)
if(NOT _n EQUAL 30)
  fail("${_n} metrics lines under MPI, expected 30")
endif()
set(_dropped 0)
foreach(_i RANGE 29)
  list(GET _mpi ${_i} _a)
  list(GET _threads ${_i} _b)
  foreach(_field loss checked flagged injected injected_flagged dropped_microbatches)
    string(JSON _x GET "${_a}" ${_field})
    string(JSON _y GET "${_b}" ${_field})
    if(NOT "${_x}" STREQUAL "${_y}")
      fail("step ${_i}: ${_field} ${_x} under MPI, ${_y} on threads")
    endif()
  endforeach()
  string(JSON _d LENGTH "${_a}" dropped_microbatches)
  math(EXPR _dropped "${_dropped} + ${_d}")
endforeach()
if(_dropped EQUAL 0)
  fail("no micro-batch was dropped: the injection did not reach the checks")
endif()

execute_process(COMMAND ${CMAKE_COMMAND} -E env OMPI_MCA_orte_abort_on_non_zero_status=0
                        ${MPIEXEC} ${NP_FLAG} 2 ${CLI} ${_train} --verify stop
                OUTPUT_VARIABLE _out ERROR_VARIABLE _err RESULT_VARIABLE _rc TIMEOUT 150)
if(NOT _err MATCHES "rank 1: rejected the activation message from rank 0 for micro-batch [0-9]+")
  fail("--verify stop under mpirun did not name the ranks and the kind")
endif()
message(STATUS "MPI verify: the same ${_dropped} micro-batches dropped as on threads, equal losses")
