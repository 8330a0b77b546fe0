#!/usr/bin/env bash
# Builds brigade with its tests and runs the whole suite through ctest.
#   scripts/test.sh               the full suite (Release; -Werror when CI is set)
#   scripts/test.sh --tsan        the pipeline and transport tests under ThreadSanitizer (build-tsan/)
#   scripts/test.sh --asan        the whole CPU suite under AddressSanitizer and
#                                 UndefinedBehaviorSanitizer (build-asan/; no CUDA, no MPI)
#   scripts/test.sh --fuzz [S [T...]]  builds the libFuzzer targets of the parsers (build-fuzz/,
#                                 clang) and runs each (or the targets T: checkpoint, tokenizer,
#                                 schedule, gguf, safetensors) for S seconds (default 600), one after another with
#                                 one job each; docs/testing.md records a run
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
jobs=$(nproc)
mode=${1:-}
if [[ "$mode" == "--fuzz" ]]; then
  "$root/scripts/deps.sh" clang-14 libclang-rt-14-dev
  seconds=${2:-600}
  targets=("${@:3}")
  ((${#targets[@]})) || targets=(checkpoint tokenizer schedule gguf safetensors)
  build="$root/build-fuzz"
  CXX=clang++-14 cmake -S "$root/fuzz" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build "$build" -j"$jobs"
  status=0
  for t in "${targets[@]}"; do
    mkdir -p "$build/corpus/$t" "$build/artifacts"
    echo "fuzz_$t: ${seconds} s" >&2
    # The seeds are read, new inputs go to build-fuzz/corpus/ (kept between runs); a finding is
    # written to build-fuzz/artifacts/ and ends the run with a non-zero status.
    if ! "$build/fuzz_$t" -max_total_time="$seconds" -timeout=20 -rss_limit_mb=2048 \
         -print_final_stats=1 -artifact_prefix="$build/artifacts/$t-" \
         "$build/corpus/$t" "$root/fuzz/seeds/$t" 2>"$build/fuzz_$t.log"; then
      status=1
      echo "fuzz_$t: FINDING, see $build/fuzz_$t.log and $build/artifacts/" >&2
    fi
    grep -E "^(Done|stat::number_of_executed_units|stat::peak_rss_mb)|^#[0-9]+ *DONE" \
      "$build/fuzz_$t.log" >&2 || true
  done
  exit $status
fi
"$root/scripts/deps.sh"
if [[ "$mode" == "--tsan" ]]; then
  build="$root/build-tsan"
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DBRIGADE_TSAN=ON \
        -DBRIGADE_BUILD_BENCHMARKS=OFF -DBRIGADE_ENABLE_CUDA=OFF -DBRIGADE_ENABLE_MPI=OFF >/dev/null
  cmake --build "$build" -j"$jobs" --target brigade_unit_tests brigade_model_tests
  cd "$build"
  # One GEMM thread per stage: the OpenMP and OpenBLAS runtimes are not instrumented, so keep
  # their thread pools out of the run (OpenMPI is not either: MPI tests run in the normal build).
  export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" OMP_NUM_THREADS=1
  exec ctest --output-on-failure -j"$jobs" -R 'pipeline|transport|training.gradients'
fi
if [[ "$mode" == "--asan" ]]; then
  build="$root/build-asan"
  # -O1: sanitizer builds of the template-heavy sources take minutes per file at -O2.
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-g -O1" \
        -DBRIGADE_ASAN=ON \
        -DBRIGADE_BUILD_BENCHMARKS=OFF -DBRIGADE_ENABLE_CUDA=OFF -DBRIGADE_ENABLE_MPI=OFF >/dev/null
  cmake --build "$build" -j"$jobs" --target brigade_unit_tests brigade_model_tests brigade_cli
  cd "$build"
  # Any report fails the test; leaks too. The CLI tests run the instrumented binary.
  export ASAN_OPTIONS="detect_leaks=1 abort_on_error=1 strict_string_checks=1"
  export UBSAN_OPTIONS="halt_on_error=1 print_stacktrace=1"
  exec ctest --output-on-failure -j"$jobs" -L 'unit|model'
fi
build="${BRIGADE_BUILD_DIR:-$root/build}"
werror=OFF
[[ -n "${CI:-}" ]] && werror=ON
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBRIGADE_WERROR=$werror -DBRIGADE_NATIVE=ON \
      -DBRIGADE_BUILD_TESTS=ON -DBRIGADE_BUILD_BENCHMARKS=ON >/dev/null
cmake --build "$build" -j"$jobs"
cd "$build"
exec ctest --output-on-failure -j"$jobs"
