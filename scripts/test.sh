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
        -DBRIGADE_BUILD_BENCHMARKS=OFF >/dev/null
  cmake --build "$build" -j"$jobs"
  cd "$build"
  # OpenBLAS's own thread pool is not instrumented; brigade runs it with one thread per stage.
  export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1"
  # OpenMPI is not instrumented either: the mpi-labelled tests run in the normal build only.
  exec ctest --output-on-failure -j"$jobs" -R 'pipeline|transport' -LE mpi
fi
build="${BRIGADE_BUILD_DIR:-$root/build}"
werror=OFF
[[ -n "${CI:-}" ]] && werror=ON
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBRIGADE_WERROR=$werror \
      -DBRIGADE_BUILD_TESTS=ON -DBRIGADE_BUILD_BENCHMARKS=ON >/dev/null
cmake --build "$build" -j"$jobs"
cd "$build"
exec ctest --output-on-failure -j"$jobs"
