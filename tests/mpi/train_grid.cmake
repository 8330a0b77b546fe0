# `brigade train --tp/--dp` under mpirun on stories260K (the processes are the grid DP x PP x TP,
# TP fastest):
#   1. -np 4 --tp 2 --dp 2 and -np 2 --dp 2: every step's loss equals the same grid's on threads
#      (one process); the checkpoint, written once, loads in `brigade generate`;
#   2. grids the processes do not divide, and a TP degree the model's heads refuse, are named
#      errors before anything runs.
#   cmake -DMPIEXEC=mpirun -DNP_FLAG=-n -DCLI=build/examples/brigade -DDATA_DIR=models
#         -DWORK_DIR=/tmp/x -P tests/mpi/train_grid.cmake
foreach(_v MPIEXEC NP_FLAG CLI DATA_DIR WORK_DIR)
  if(NOT DEFINED ${_v})
    message(FATAL_ERROR "train_grid.cmake needs -D${_v}=...")
  endif()
endforeach()
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
set(_train train --model ${DATA_DIR}/stories260K.bin --tokenizer ${DATA_DIR}/tok512.bin
    --microbatches 2 --tokens-per-microbatch 64 --steps 3 --warmup 1 --timeout 30 --profile none)

include(${CMAKE_CURRENT_LIST_DIR}/cli_checks.cmake)
macro(run_mpi _np)
  execute_process(COMMAND ${MPIEXEC} ${NP_FLAG} ${_np} ${CLI} ${_train} ${ARGN}
                  OUTPUT_VARIABLE _out ERROR_VARIABLE _err RESULT_VARIABLE _rc TIMEOUT 150)
endmacro()
macro(run_threads)
  execute_process(COMMAND ${CLI} ${_train} ${ARGN}
                  OUTPUT_VARIABLE _out ERROR_VARIABLE _err RESULT_VARIABLE _rc TIMEOUT 150)
endmacro()

# 1. The grids under MPI against the same grids on threads.
foreach(_case "4;--tp;2;--dp;2" "2;--dp;2")
  list(GET _case 0 _np)
  list(SUBLIST _case 1 -1 _flags)
  string(REPLACE ";" "" _name "${_flags}")
  run_mpi(${_np} ${_flags} --checkpoint-dir ${WORK_DIR}/${_name} --metrics ${WORK_DIR}/${_name}_mpi.jsonl)
  if(NOT _rc EQUAL 0)
    fail("mpirun -np ${_np} ${_flags}: exit code ${_rc}")
  endif()
  string(REGEX MATCHALL "bubble ratio measured" _summaries "${_err}")
  list(LENGTH _summaries _n)
  if(NOT _n EQUAL 1)
    fail("${_n} summaries on stderr, expected 1 (world rank 0 only)")
  endif()
  require_in("${_err}" "transport: MPI, ${_np} processes (one TP rank of a stage of one replica each; grid"
             "no grid line")
  run_threads(${_flags} --stages 1 --metrics ${WORK_DIR}/${_name}_threads.jsonl)
  if(NOT _rc EQUAL 0)
    fail("threads ${_flags}: exit code ${_rc}")
  endif()
  require_in("${_err}" "tensor x pipeline x data parallel: grid" "no threads grid line")
  read_losses(${WORK_DIR}/${_name}_mpi.jsonl mpi)
  read_losses(${WORK_DIR}/${_name}_threads.jsonl threads)
  foreach(_s RANGE 1 3)
    if(NOT DEFINED mpi_${_s} OR NOT "${mpi_${_s}}" STREQUAL "${threads_${_s}}")
      fail("${_flags}: step ${_s}: loss ${mpi_${_s}} under MPI != ${threads_${_s}} on threads")
    endif()
  endforeach()
  execute_process(COMMAND ${CLI} generate --model ${WORK_DIR}/${_name}/model.bin
                          --tokenizer ${DATA_DIR}/tok512.bin --temperature 0 --steps 16
                          --prompt "Once upon a time"
                  OUTPUT_VARIABLE _out ERROR_VARIABLE _err RESULT_VARIABLE _rc TIMEOUT 60)
  if(NOT _rc EQUAL 0 OR NOT _out MATCHES "^Once upon a time")
    fail("brigade generate did not load the checkpoint of ${_flags} under MPI")
  endif()
endforeach()

# 2. Refusals before anything runs.
run_mpi(3 --tp 2)
if(_rc EQUAL 0)
  fail("--tp 2 on 3 processes was accepted")
endif()
require_in("${_err}" "--tp 2 does not divide the 3 processes mpirun started" "no grid error")
run_mpi(4 --tp 2 --dp 2 --stages 2)
if(_rc EQUAL 0)
  fail("--tp 2 --dp 2 --stages 2 on 4 processes was accepted")
endif()
require_in("${_err}" "grid TP 2 x PP 2 x DP 2 = 8 ranks does not match the 4 processes mpirun started"
           "no grid size error")
run_mpi(3 --tp 3)
if(_rc EQUAL 0)
  fail("--tp 3 was accepted")
endif()
require_in("${_err}" "TP 3: the model's 8 attention heads are not divisible by the TP degree"
           "no heads error")
message(STATUS "MPI train --tp/--dp: losses equal threads', checkpoints load, grids refused")
