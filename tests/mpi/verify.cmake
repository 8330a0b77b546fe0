# `brigade train --verify drop --inject ...` under `mpirun -np 2` on stories260K: rank 0's
# corrupted activations are flagged by rank 1's process and dropped by both, every step's loss
# stays finite and the counts reach rank 0's metrics; then --verify stop under mpirun stops
# naming the ranks and the kind. (Not compared with threads: under mpirun the held-out
# evaluation's activations also cross the transport, so the monitors see more traffic.)
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

include(${CMAKE_CURRENT_LIST_DIR}/cli_checks.cmake)

execute_process(COMMAND ${MPIEXEC} ${NP_FLAG} 2 ${CLI} ${_train} --verify drop
                        --metrics ${WORK_DIR}/mpi.jsonl
                OUTPUT_VARIABLE _out ERROR_VARIABLE _err RESULT_VARIABLE _rc TIMEOUT 150)
if(NOT _rc EQUAL 0)
  fail("mpirun --verify drop: exit code ${_rc}")
endif()
file(STRINGS ${WORK_DIR}/mpi.jsonl _mpi)
list(LENGTH _mpi _n)
if(NOT _n EQUAL 30)
  fail("${_n} metrics lines under MPI, expected 30")
endif()
# Every step: a finite loss; the corrupted activations flagged by the receiving process are
# counted (kFlagInjected travels with the message), and a flagged activation drops its
# micro-batch on both processes (the step's agreement), never the whole update.
set(_dropped 0)
set(_injected 0)
set(_caught 0)
foreach(_line IN LISTS _mpi)
  string(JSON _loss GET "${_line}" loss)
  if(NOT _loss MATCHES "^[0-9]+\\.[0-9]+")
    fail("a step's loss is ${_loss}")
  endif()
  string(JSON _skipped GET "${_line}" update_skipped)
  if(_skipped)
    fail("an update was skipped: only activations were corrupted")
  endif()
  string(JSON _d LENGTH "${_line}" dropped_microbatches)
  string(JSON _i GET "${_line}" injected)
  string(JSON _c GET "${_line}" injected_flagged)
  math(EXPR _dropped "${_dropped} + ${_d}")
  math(EXPR _injected "${_injected} + ${_i}")
  math(EXPR _caught "${_caught} + ${_c}")
endforeach()
if(_injected LESS 5 OR _caught LESS 3 OR _dropped LESS _caught)
  fail("${_injected} corrupted, ${_caught} of them flagged, ${_dropped} micro-batches dropped")
endif()
if(NOT _err MATCHES "integrity: [0-9]+ messages checked, [0-9]+ flagged; ${_dropped} micro-batches dropped")
  fail("no integrity summary with the ${_dropped} dropped micro-batches")
endif()

execute_process(COMMAND ${CMAKE_COMMAND} -E env OMPI_MCA_orte_abort_on_non_zero_status=0
                        ${MPIEXEC} ${NP_FLAG} 2 ${CLI} ${_train} --verify stop
                OUTPUT_VARIABLE _out ERROR_VARIABLE _err RESULT_VARIABLE _rc TIMEOUT 150)
if(NOT _err MATCHES "rank 1: rejected the activation message from rank 0 for micro-batch [0-9]+")
  fail("--verify stop under mpirun did not name the ranks and the kind")
endif()
message(STATUS "MPI verify: ${_caught} of ${_injected} corrupted activations flagged, ${_dropped} micro-batches dropped")
