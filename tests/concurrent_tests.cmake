# Included by ctest after the discovered doctest cases (tests/CMakeLists.txt): the cases that
# check that two ranks compute at the same moment (wall-clock overlap of their intervals) run
# alone, so another test on the second core cannot serialize the ranks' threads.
set_tests_properties(
  "model.engine.generate: two stages compute at the same time (15M synthetic model, two micro-batches in flight)"
  "model.engine.generate: the inference Timeline holds F, SAMPLE, SEND and RECV of every round, and the two stages compute at the same time"
  PROPERTIES RUN_SERIAL TRUE)
