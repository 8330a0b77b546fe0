# `brigade generate --tp 2` on stories260K under `mpirun -np NP`: the processes are the grid
# TP 2 x PP NP/2 (TP fastest), and stdout must be byte-identical to llama2.c's run.c
# (DATA_DIR/reference/stories260K_greedy.json, "stdout"), printed once. A grid the processes do
# not divide is refused on every rank before anything runs.
#   cmake -DMPIEXEC=mpirun -DNP_FLAG=-n -DNP=4 -DCLI=build/examples/brigade -DDATA_DIR=models
#         -DWORK_DIR=/tmp/x -P tests/mpi/generate_tp.cmake
foreach(_v MPIEXEC NP_FLAG NP CLI DATA_DIR WORK_DIR)
  if(NOT DEFINED ${_v})
    message(FATAL_ERROR "generate_tp.cmake needs -D${_v}=...")
  endif()
endforeach()
file(READ ${DATA_DIR}/reference/stories260K_greedy.json _ref)
string(JSON _once_upon GET "${_ref}" cases 1 stdout)   # "Once upon a time", 64 steps
string(JSON _empty_256 GET "${_ref}" cases 0 stdout)   # empty prompt, 256 steps
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
set(_model --model ${DATA_DIR}/stories260K.bin --tokenizer ${DATA_DIR}/tok512.bin)
math(EXPR _pp "${NP} / 2")

macro(run_cli _np)
  execute_process(COMMAND ${MPIEXEC} ${NP_FLAG} ${_np} ${CLI} generate ${_model} ${ARGN}
                  OUTPUT_VARIABLE _out ERROR_VARIABLE _err RESULT_VARIABLE _rc TIMEOUT 150)
endmacro()
set(_fail_context "np ${NP} --tp 2: ")
include(${CMAKE_CURRENT_LIST_DIR}/cli_checks.cmake)

# 1. Two sequences in flight, 64 steps.
run_cli(${NP} --tp 2 --temperature 0 --steps 64 --prompt "Once upon a time"
        --prompt "Once upon a time" --metrics ${WORK_DIR}/metrics.json)
if(NOT _rc EQUAL 0)
  fail("exit code ${_rc}")
endif()
if(NOT "${_out}" STREQUAL "${_once_upon}${_once_upon}")
  fail("stdout differs from run.c's (the 64-step case, twice)")
endif()
string(REGEX MATCHALL "tokens/s" _summaries "${_err}")
list(LENGTH _summaries _n)
if(NOT _n EQUAL 1)
  fail("${_n} summaries on stderr, expected 1 (world rank 0 only)")
endif()
require_in("${_err}" "transport: MPI, ${NP} processes (one TP rank of a stage; grid TP 2 x PP ${_pp} each)"
           "no MPI grid line")
file(READ ${WORK_DIR}/metrics.json _metrics)
string(JSON _stages GET "${_metrics}" stages)
string(JSON _tp GET "${_metrics}" tp)
if(NOT _stages EQUAL _pp OR NOT _tp EQUAL 2)
  fail("metrics: stages = ${_stages} (expected ${_pp}), tp = ${_tp} (expected 2)")
endif()

# 2. The empty prompt, 256 steps, --stages given explicitly.
run_cli(${NP} --tp 2 --temperature 0 --partition uniform --stages ${_pp})
if(NOT _rc EQUAL 0)
  fail("exit code ${_rc}")
endif()
if(NOT "${_out}" STREQUAL "${_empty_256}")
  fail("stdout differs from run.c's (the empty prompt, 256 steps)")
endif()

# 3. Grids that do not cover the processes, and a TP degree the model's heads refuse.
math(EXPR _odd "${NP} + 1")
run_cli(${_odd} --tp 2 --steps 8)
if(_rc EQUAL 0)
  fail("--tp 2 on ${_odd} processes was accepted")
endif()
require_in("${_err}" "--tp 2 does not divide the ${_odd} processes mpirun started" "no grid error")
math(EXPR _more "${_pp} + 1")
run_cli(${NP} --tp 2 --stages ${_more} --steps 8)
if(_rc EQUAL 0)
  fail("--stages ${_more} --tp 2 on ${NP} processes was accepted")
endif()
math(EXPR _ranks "${_more} * 2")
require_in("${_err}" "grid TP 2 x PP ${_more} = ${_ranks} ranks does not match the ${NP} processes mpirun started"
           "no grid size error")
message(STATUS "np ${NP} --tp 2: token-exact, one summary, grids refused")
