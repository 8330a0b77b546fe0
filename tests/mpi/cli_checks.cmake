# Checks shared by the CLI scripts under tests/mpi (run with cmake -P, included by each).
# fail(WHAT): stops the test with WHAT, prefixed by ${_fail_context} when the script sets it,
# and the last command's ${_out} and ${_err}.
macro(fail _what)
  message(FATAL_ERROR "${_fail_context}${_what}\n--- stdout:\n${_out}\n--- stderr:\n${_err}")
endmacro()
# require_in(TEXT PART WHAT): fail(WHAT) unless PART occurs in TEXT.
macro(require_in _text _part _what)
  string(FIND "${_text}" "${_part}" _at)
  if(_at EQUAL -1)
    fail("${_what}")
  endif()
endmacro()
# read_losses(FILE PREFIX): the "loss" of each step of a metrics file (JSON lines; the last line
# of a step wins) as ${PREFIX}_<step> in the caller's scope.
function(read_losses _file _prefix)
  file(STRINGS ${_file} _lines)
  foreach(_line IN LISTS _lines)
    string(JSON _step GET "${_line}" step)
    string(JSON _loss GET "${_line}" loss)
    set(${_prefix}_${_step} "${_loss}" PARENT_SCOPE)
  endforeach()
endfunction()
