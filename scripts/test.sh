#!/usr/bin/env bash
# Builds brigade with its tests and runs the whole suite through ctest.
#   scripts/test.sh          the full suite (Release; -Werror when CI is set)
#   scripts/test.sh --tsan   the pipeline and transport tests under ThreadSanitizer (build-tsan/)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/deps.sh"
jobs=$(nproc)
if [[ "${1:-}" == "--tsan" ]]; then
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
build="${BRIGADE_BUILD_DIR:-$root/build}"
werror=OFF
[[ -n "${CI:-}" ]] && werror=ON
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBRIGADE_WERROR=$werror \
      -DBRIGADE_BUILD_TESTS=ON -DBRIGADE_BUILD_BENCHMARKS=ON >/dev/null
cmake --build "$build" -j"$jobs"
cd "$build"
exec ctest --output-on-failure -j"$jobs"
