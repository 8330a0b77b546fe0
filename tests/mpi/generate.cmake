# `brigade generate` on stories260K under `mpirun -np NP`, one process per stage: stdout must be
# byte-identical to llama2.c's run.c (DATA_DIR/reference/stories260K_greedy.json, "stdout"), only
# rank 0 prints, and rank 0's --trace holds every stage's row (the gathered Timeline).
#   cmake -DMPIEXEC=mpirun -DNP_FLAG=-n -DNP=3 -DCLI=build/examples/brigade -DDATA_DIR=models
#         -DWORK_DIR=/tmp/x -P tests/mpi/generate.cmake
foreach(_v MPIEXEC NP_FLAG NP CLI DATA_DIR WORK_DIR)
  if(NOT DEFINED ${_v})
    message(FATAL_ERROR "generate.cmake needs -D${_v}=...")
  endif()
endforeach()
file(READ ${DATA_DIR}/reference/stories260K_greedy.json _ref)
string(JSON _once_upon GET "${_ref}" cases 1 stdout)   # "Once upon a time", 64 steps
string(JSON _empty_256 GET "${_ref}" cases 0 stdout)   # empty prompt, 256 steps
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
set(_model --model ${DATA_DIR}/stories260K.bin --tokenizer ${DATA_DIR}/tok512.bin)

# Runs the CLI under mpirun; sets _out, _err, _rc.
macro(run_cli)
  execute_process(COMMAND ${MPIEXEC} ${NP_FLAG} ${NP} ${CLI} generate ${_model} ${ARGN}
                  OUTPUT_VARIABLE _out ERROR_VARIABLE _err RESULT_VARIABLE _rc TIMEOUT 150)
endmacro()
set(_fail_context "np ${NP}: ")
include(${CMAKE_CURRENT_LIST_DIR}/cli_checks.cmake)

# 1. Two sequences in flight, 64 steps, default --stages (= the number of processes).
run_cli(--temperature 0 --steps 64 --prompt "Once upon a time" --prompt "Once upon a time"
        --metrics ${WORK_DIR}/metrics.json --trace ${WORK_DIR}/trace.json)
if(NOT _rc EQUAL 0)
  fail("exit code ${_rc}")
endif()
if(NOT "${_out}" STREQUAL "${_once_upon}${_once_upon}")
  fail("stdout differs from run.c's (the 64-step case, twice)")
endif()
string(REGEX MATCHALL "tokens/s" _summaries "${_err}")
list(LENGTH _summaries _n)
if(NOT _n EQUAL 1)
  fail("${_n} summaries on stderr, expected 1 (rank 0 only)")
endif()
require_in("${_err}" "transport: MPI, ${NP} processes" "no MPI transport line")
file(READ ${WORK_DIR}/metrics.json _metrics)
string(JSON _stages GET "${_metrics}" stages)
string(JSON _generated GET "${_metrics}" generated_tokens)
if(NOT _stages EQUAL NP OR NOT _generated EQUAL 120)
  fail("metrics: stages = ${_stages} (expected ${NP}), generated_tokens = ${_generated} (expected 120)")
endif()
file(READ ${WORK_DIR}/trace.json _trace)
string(REGEX MATCHALL "\"ph\":\"M\"" _rows "${_trace}")
list(LENGTH _rows _nrows)
if(NOT _nrows EQUAL NP)
  fail("trace: ${_nrows} stage rows, expected ${NP}")
endif()
math(EXPR _last "${NP} - 1")
foreach(_stage RANGE 0 ${_last})
  require_in("${_trace}" "\"ph\":\"X\",\"pid\":0,\"tid\":${_stage}," "trace: no interval of stage ${_stage}")
endforeach()

# 2. The empty prompt, 256 steps, uniform partition, --stages given explicitly.
run_cli(--temperature 0 --partition uniform --stages ${NP})
if(NOT _rc EQUAL 0)
  fail("exit code ${_rc}")
endif()
if(NOT "${_out}" STREQUAL "${_empty_256}")
  fail("stdout differs from run.c's (the empty prompt, 256 steps)")
endif()

# 3. --stages that contradicts the number of processes is refused on every rank.
math(EXPR _wrong "${NP} + 1")
run_cli(--stages ${_wrong})
if(_rc EQUAL 0)
  fail("--stages ${_wrong} under ${NP} processes was accepted")
endif()
require_in("${_err}" "--stages ${_wrong} but mpirun started ${NP} processes" "no clear --stages error")

# 4. Ring windows: each process holds two non-contiguous layer ranges and the token walks the
#    ring of processes twice per position; still run.c's text (stories260K has 5 decoder
#    layers: 2 processes x 2 windows).
if(NP EQUAL 2)
run_cli(--temperature 0 --ring 2 --windows 2,1,1,1 --steps 64 --prompt "Once upon a time")
if(NOT _rc EQUAL 0)
  fail("--ring 2: exit code ${_rc}")
endif()
if(NOT "${_out}" STREQUAL "${_once_upon}")
  fail("--ring 2: stdout differs from run.c's (the 64-step case)")
endif()
require_in("${_err}" "transport: MPI, ${NP} processes (2 ring windows each)" "--ring 2: no MPI ring line")
endif()
message(STATUS "np ${NP}: token-exact, one summary, ${_nrows} trace rows")
