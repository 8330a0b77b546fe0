# `brigade train` under `mpirun -np 2` (one process per pipeline rank) on stories260K:
#   1. 6 steps straight; the per-step losses equal the in-process run's (--stages 2, threads);
#      the checkpoint loads in `brigade generate`.
#   2. interrupted after 3 steps, then --resume to 6: every step's loss equals the straight run's.
#   3. rank 1 killed at the start of step 4 (--fail-rank 1 --fail-after-steps 3, checkpoint every
#      2 steps): rank 0 fails with an error naming rank 1 within the deadline; --resume from the
#      step-2 checkpoint then gives steps 3-6 with the straight run's losses.
#   cmake -DMPIEXEC=mpirun -DNP_FLAG=-n -DCLI=build/examples/brigade -DDATA_DIR=models
#         -DWORK_DIR=/tmp/x -P tests/mpi/train.cmake
foreach(_v MPIEXEC NP_FLAG CLI DATA_DIR WORK_DIR)
  if(NOT DEFINED ${_v})
    message(FATAL_ERROR "train.cmake needs -D${_v}=...")
  endif()
endforeach()
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
set(_timeout 3)
set(_train train --model ${DATA_DIR}/stories260K.bin --tokenizer ${DATA_DIR}/tok512.bin
    --microbatches 4 --tokens-per-microbatch 64 --steps 6 --warmup 2 --timeout ${_timeout})

include(${CMAKE_CURRENT_LIST_DIR}/cli_checks.cmake)
macro(run_mpi)
  execute_process(COMMAND ${MPIEXEC} ${NP_FLAG} 2 ${CLI} ${_train} ${ARGN}
                  OUTPUT_VARIABLE _out ERROR_VARIABLE _err RESULT_VARIABLE _rc TIMEOUT 120)
endmacro()
macro(same_losses _a _b _first)
  foreach(_s RANGE ${_first} 6)
    if(NOT DEFINED ${_a}_${_s} OR NOT "${${_a}_${_s}}" STREQUAL "${${_b}_${_s}}")
      fail("step ${_s}: loss ${${_a}_${_s}} (${_a}) != ${${_b}_${_s}} (${_b})")
    endif()
  endforeach()
endmacro()

# 1. Straight, under MPI and on threads.
run_mpi(--checkpoint-dir ${WORK_DIR}/straight --metrics ${WORK_DIR}/straight.jsonl)
if(NOT _rc EQUAL 0)
  fail("straight run: exit code ${_rc}")
endif()
string(REGEX MATCHALL "bubble ratio measured" _summaries "${_err}")
list(LENGTH _summaries _n)
if(NOT _n EQUAL 1)
  fail("${_n} summaries on stderr, expected 1 (rank 0 only)")
endif()
if(NOT _err MATCHES "bubble ratio measured [0-9.]+, simulated [0-9.]+")
  fail("no measured-vs-simulated bubble summary")
endif()
read_losses(${WORK_DIR}/straight.jsonl straight)
execute_process(COMMAND ${CLI} ${_train} --stages 2 --metrics ${WORK_DIR}/threads.jsonl
                OUTPUT_VARIABLE _out ERROR_VARIABLE _err RESULT_VARIABLE _rc TIMEOUT 120)
if(NOT _rc EQUAL 0)
  fail("in-process run: exit code ${_rc}")
endif()
read_losses(${WORK_DIR}/threads.jsonl threads)
same_losses(straight threads 1)
execute_process(COMMAND ${CLI} generate --model ${WORK_DIR}/straight/model.bin
                        --tokenizer ${DATA_DIR}/tok512.bin --temperature 0 --steps 16
                        --prompt "Once upon a time"
                OUTPUT_VARIABLE _out ERROR_VARIABLE _err RESULT_VARIABLE _rc TIMEOUT 60)
if(NOT _rc EQUAL 0 OR NOT _out MATCHES "^Once upon a time")
  fail("brigade generate did not load the checkpoint written under MPI")
endif()

# 2. Interrupted after 3 steps (rank 0 exits at the start of step 4; mpirun ends the job), then
#    --resume from the step-3 checkpoint to 6.
run_mpi(--checkpoint-dir ${WORK_DIR}/resume --checkpoint-every 3 --metrics ${WORK_DIR}/resume.jsonl
        --fail-rank 0 --fail-after-steps 3)
if(_rc EQUAL 0 OR NOT EXISTS ${WORK_DIR}/resume/optimizer.bin)
  fail("the interrupted run: exit code ${_rc}, or no checkpoint")
endif()
run_mpi(--checkpoint-dir ${WORK_DIR}/resume --resume --metrics ${WORK_DIR}/resume.jsonl)
if(NOT _rc EQUAL 0)
  fail("resumed run: exit code ${_rc}")
endif()
read_losses(${WORK_DIR}/resume.jsonl resume)
same_losses(resume straight 1)

# 3. A killed rank: the survivor names it; the resumed run loses nothing.
string(TIMESTAMP _t0 "%s")
execute_process(COMMAND ${CMAKE_COMMAND} -E env OMPI_MCA_orte_abort_on_non_zero_status=0
                        ${MPIEXEC} ${NP_FLAG} 2 ${CLI} ${_train} --checkpoint-dir ${WORK_DIR}/killed
                        --checkpoint-every 2 --metrics ${WORK_DIR}/killed.jsonl
                        --fail-rank 1 --fail-after-steps 3
                OUTPUT_VARIABLE _out ERROR_VARIABLE _err RESULT_VARIABLE _rc TIMEOUT 120)
string(TIMESTAMP _t1 "%s")
math(EXPR _took "${_t1} - ${_t0}")
# (with abort_on_non_zero_status=0, mpirun's own exit code does not tell)
if(NOT _err MATCHES "fault injection: rank 1 exits")
  fail("the fault was not injected")
endif()
if(NOT _err MATCHES "brigade: error \\([A-Za-z]+\\): [^\n]*rank 1 stopped answering")
  fail("rank 0 did not report that rank 1 stopped answering")
endif()
math(EXPR _limit "${_timeout} * 5 / 4 + 10")
if(_took GREATER _limit)
  fail("the survivor took ${_took} s, more than ${_limit} s")
endif()
execute_process(COMMAND ${MPIEXEC} ${NP_FLAG} 2 ${CLI} ${_train} --checkpoint-dir ${WORK_DIR}/killed
                        --resume --metrics ${WORK_DIR}/killed.jsonl
                OUTPUT_VARIABLE _out ERROR_VARIABLE _err RESULT_VARIABLE _rc TIMEOUT 120)
if(NOT _rc EQUAL 0)
  fail("resume after the kill: exit code ${_rc}")
endif()
read_losses(${WORK_DIR}/killed.jsonl killed)
same_losses(killed straight 1)
message(STATUS "MPI train: losses equal threads', resume exact, killed rank named after ${_took} s")
