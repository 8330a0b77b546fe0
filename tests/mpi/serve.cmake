# `brigade serve` under `mpirun -np NP`, one process per stage: a small Mooncake-format trace on
# stories260K with --rebalance even,dynamic and a layer move forced every 3 rounds. Only rank 0
# reports (one summary line per policy), the metrics say the transport was MPI and hold the moves
# and every stage's measured rounds, and the dynamic run's Timeline has a row per process.
#   cmake -DMPIEXEC=mpirun -DNP_FLAG=-n -DNP=2 -DCLI=build/examples/brigade -DDATA_DIR=models
#         -DWORK_DIR=/tmp/x -P tests/mpi/serve.cmake
foreach(_v MPIEXEC NP_FLAG NP CLI DATA_DIR WORK_DIR)
  if(NOT DEFINED ${_v})
    message(FATAL_ERROR "serve.cmake needs -D${_v}=...")
  endif()
endforeach()
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
set(_trace ${WORK_DIR}/trace.jsonl)
file(WRITE ${_trace} "")
foreach(_i RANGE 0 7)
  math(EXPR _ms "${_i} * 15")
  math(EXPR _in "5 + 3 * ${_i}")
  file(APPEND ${_trace} "{\"timestamp\": ${_ms}, \"input_length\": ${_in}, \"output_length\": 30}\n")
endforeach()

execute_process(
  COMMAND ${MPIEXEC} ${NP_FLAG} ${NP} ${CLI} serve --trace ${_trace}
          --model ${DATA_DIR}/stories260K.bin --tokenizer ${DATA_DIR}/tok512.bin
          --rebalance even,dynamic --force-move-every 3 --migration-part-mib 0.01 --timeout 60
          --metrics ${WORK_DIR}/m.json --timeline ${WORK_DIR}/tl.json
  OUTPUT_VARIABLE _out ERROR_VARIABLE _err RESULT_VARIABLE _rc TIMEOUT 150)
set(_fail_context "np ${NP}: ")
include(${CMAKE_CURRENT_LIST_DIR}/cli_checks.cmake)
if(NOT _rc EQUAL 0)
  fail("exit code ${_rc}")
endif()
string(FIND "${_err}" "transport: MPI, ${NP} processes (one stage each)" _at)
if(_at EQUAL -1)
  fail("no MPI transport line")
endif()
foreach(_policy even dynamic)
  string(REGEX MATCHALL "serve: ${_policy} +layers per stage" _lines "${_err}")
  list(LENGTH _lines _n)
  if(NOT _n EQUAL 1)
    fail("${_n} summaries of ${_policy} on stderr, expected 1 (rank 0 only)")
  endif()
endforeach()
file(READ ${WORK_DIR}/m.json _m)
string(JSON _transport GET "${_m}" transport)
string(JSON _stages GET "${_m}" stages)
string(JSON _gen0 GET "${_m}" runs 0 generated_tokens)
string(JSON _gen1 GET "${_m}" runs 1 generated_tokens)
string(JSON _moves LENGTH "${_m}" runs 1 moves)
string(JSON _measured LENGTH "${_m}" runs 1 measured_rounds_per_stage)
string(JSON _rounds GET "${_m}" runs 1 measured_rounds_per_stage 0)
if(NOT _transport STREQUAL "mpi" OR NOT _stages EQUAL NP OR NOT _gen0 EQUAL 240 OR
   NOT _gen1 EQUAL 240 OR _moves LESS 1 OR NOT _measured EQUAL NP OR _rounds LESS 1)
  fail("metrics: transport ${_transport}, stages ${_stages}, generated ${_gen0} / ${_gen1} "
       "(expected 240), ${_moves} moves, measured rounds of ${_measured} stages (${_rounds})")
endif()
file(READ ${WORK_DIR}/tl.dynamic.json _trace_json)
math(EXPR _last "${NP} - 1")
foreach(_stage RANGE 0 ${_last})
  string(FIND "${_trace_json}" "\"ph\":\"X\",\"pid\":0,\"tid\":${_stage}," _at)
  if(_at EQUAL -1)
    fail("timeline: no interval of stage ${_stage}")
  endif()
endforeach()
message(STATUS "np ${NP}: serve under MPI, ${_moves} moves, ${_rounds} measured rounds")
