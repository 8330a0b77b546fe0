# A rank killed mid-run (`--fail-rank 1 --fail-after-steps 5`: rank 1 calls std::_Exit(3) after 5
# micro-batches) must not hang the others.
#   1. OpenMPI's default: mpirun sees the exit and ends the job at once, naming the process.
#   2. With OMPI_MCA_orte_abort_on_non_zero_status=0, mpirun lets the other ranks run on: brigade
#      itself must stop them, each with an error naming rank 1, within ~1.25 x --timeout.
foreach(_v MPIEXEC NP_FLAG CLI DATA_DIR)
  if(NOT DEFINED ${_v})
    message(FATAL_ERROR "killed_rank.cmake needs -D${_v}=...")
  endif()
endforeach()
set(_timeout 3)
set(_args generate --model ${DATA_DIR}/stories260K.bin --tokenizer ${DATA_DIR}/tok512.bin
          --temperature 0 --steps 200 --prompt "Once upon a time" --prompt "One day"
          --timeout ${_timeout} --fail-rank 1 --fail-after-steps 5)
include(${CMAKE_CURRENT_LIST_DIR}/cli_checks.cmake)

# 1. Default: the job fails fast.
string(TIMESTAMP _t0 "%s")
execute_process(COMMAND ${MPIEXEC} ${NP_FLAG} 3 ${CLI} ${_args}
                OUTPUT_VARIABLE _out ERROR_VARIABLE _err RESULT_VARIABLE _rc TIMEOUT 120)
string(TIMESTAMP _t1 "%s")
math(EXPR _took "${_t1} - ${_t0}")
if(_rc EQUAL 0)
  fail("mpirun exited 0 although rank 1 died")
endif()
require_in("${_err}" "fault injection: rank 1 exits" "the fault was not injected")
if(_took GREATER 30)
  fail("took ${_took} s")
endif()
message(STATUS "default: mpirun exit ${_rc} after ${_took} s")

# 2. The survivors detect it themselves.
string(TIMESTAMP _t0 "%s")
execute_process(COMMAND ${CMAKE_COMMAND} -E env OMPI_MCA_orte_abort_on_non_zero_status=0
                        ${MPIEXEC} ${NP_FLAG} 3 ${CLI} ${_args}
                OUTPUT_VARIABLE _out ERROR_VARIABLE _err RESULT_VARIABLE _rc TIMEOUT 120)
string(TIMESTAMP _t1 "%s")
math(EXPR _took "${_t1} - ${_t0}")
require_in("${_err}" "fault injection: rank 1 exits" "the fault was not injected")
foreach(_survivor 0 2)
  if(NOT _err MATCHES "brigade: error \\([A-Za-z]+\\): rank ${_survivor}:[^\n]*rank 1 stopped answering")
    fail("rank ${_survivor} did not report that rank 1 stopped answering")
  endif()
endforeach()
if(NOT "${_out}" STREQUAL "")
  fail("text was printed although the run failed")
endif()
# Start-up (~1-2 s on 2 cores) + the deadline + the grace (a quarter of it) + slack.
math(EXPR _limit "${_timeout} * 5 / 4 + 8")
if(_took GREATER _limit)
  fail("the survivors took ${_took} s, more than ${_limit} s")
endif()
message(STATUS "survivors: both named rank 1 after ${_took} s (limit ${_limit} s)")
