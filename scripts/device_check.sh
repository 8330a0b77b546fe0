#!/usr/bin/env bash
# The GPU checks of brigade::cuda (issue 6) in one call on a lent GPU machine: build, the `cuda`
# tests, stories260K token-exact on the GPU in float32, and an 8B-shaped decoder layer's bf16
# prefill timed against the cuBLAS bf16 GEMM peak measured in the same run.
#
# Two steps, because the GPU machine receives only the repository and reaches no network:
#
#   1. Here (the machine without a GPU), once per checkout:
#        scripts/device_check.sh --prepare [SHARED_DATA_DIR]       # default ../shared/data
#      copies stories260K.bin, tok512.bin and reference/ into .device/data, downloads the Debian
#      packages the build needs (Eigen, fmt, nlohmann-json, CLI11, doctest, Google Benchmark,
#      OpenBLAS; about 15 MB) into .device/debs with `apt-get download`, and adds /.device/ to
#      .git/info/exclude so the folder is ignored (it is carried, not committed).
#
#   2. On the GPU machine, in one `run` call that carries .device:
#        run(command="bash scripts/device_check.sh .device/data", carry=[".device"],
#            timeout_s=600)
#      Usage there: scripts/device_check.sh [DATA_DIR] [LOG_DIR]
#        DATA_DIR defaults to .device/data (or $BRIGADE_DATA_DIR); LOG_DIR to $OUT (the device
#        tool's folder that comes back), else build-device/. The log is LOG_DIR/device_check.log,
#        the benchmark's JSON LOG_DIR/bench_cuda.json. Set BRIGADE_SANITIZE=1 to also run the
#        kernel tests under compute-sanitizer (memcheck; about a minute more).
#      Packages in .device/debs are unpacked into /tmp/brigade-deps (never into /) and put first
#      on CMake's and the loader's search paths; without them the machine's own must do.
#
# Exit status: 0 when every step passed; 1 when one failed (the summary at the end names it);
# 77 when nothing failed but the GPU steps were skipped (no usable GPU on this machine).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 1

debs=(libeigen3-dev libfmt-dev libfmt9 nlohmann-json3-dev libcli11-dev doctest-dev
      libbenchmark-dev libbenchmark1debian libopenblas-dev libopenblas0 libopenblas0-pthread
      libopenblas-pthread-dev libgfortran5 libquadmath0)

if [[ "${1:-}" == "--prepare" ]]; then
  set -e
  src=${2:-$root/../shared/data}
  mkdir -p .device/data/reference .device/debs
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")"
  grep -qxF '/.device/' "$exclude" 2>/dev/null || echo '/.device/' >>"$exclude"
  cp "$src/stories260K.bin" "$src/tok512.bin" .device/data/
  cp "$src"/reference/* .device/data/reference/
  if ! ls .device/debs/*.deb >/dev/null 2>&1; then
    (cd .device/debs && apt-get download "${debs[@]}")
  fi
  du -sh .device/data .device/debs
  echo "prepared: run(command=\"bash scripts/device_check.sh .device/data\", carry=[\".device\"], timeout_s=600)"
  exit 0
fi

data=${1:-${BRIGADE_DATA_DIR:-$root/.device/data}}
[[ -d "$data" ]] && data=$(cd "$data" && pwd)   # compiled into the tests: must be absolute
logdir=${2:-${OUT:-$root/build-device}}
mkdir -p "$logdir"
log="$logdir/device_check.log"
build="$root/build-device"
steps="$build/steps"   # per-step output (not under $OUT: the device tool returns at most 8 files)
mkdir -p "$steps"
jobs=$(nproc 2>/dev/null || echo 8)

run_checks() {
  local status=0 n=0
  local -a names=() results=()

  # Runs one step with a time limit; its output also goes to $steps/step<n>.txt. Records PASS,
  # FAIL or SKIP (exit 77, or a ctest run whose tests were all skipped); returns the exit status.
  step() {
    local name=$1 limit=$2
    shift 2
    n=$((n + 1))
    echo
    echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*"
    local t0=$SECONDS rc
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$steps/step$n.txt"
    rc=${PIPESTATUS[0]}
    local verdict=PASS
    if [[ $rc -eq 0 ]] && grep -q '\*\*\*Skipped' "$steps/step$n.txt" &&
       ! grep -q ' Passed ' "$steps/step$n.txt"; then
      verdict="SKIP (every test skipped)"
    elif [[ $rc -eq 77 ]]; then
      verdict=SKIP
    elif [[ $rc -ne 0 ]]; then
      verdict="FAIL (exit $rc)"
      status=1
    fi
    names+=("$name")
    results+=("$verdict, $((SECONDS - t0)) s")
    echo "=== $name: $verdict"
    return "$rc"
  }

  echo "brigade device check, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (+ uncommitted changes)')"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || true
  command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
  nvcc --version 2>&1 | tail -2
  cmake --version | head -1
  "${CXX:-g++}" --version 2>&1 | head -1
  ldd --version 2>&1 | head -1
  echo "data: $data; log: $log; cores: $jobs"
  if [[ ! -f "$data/stories260K.bin" ]]; then
    echo "no stories260K.bin in $data: run scripts/device_check.sh --prepare here and carry .device"
    status=1
  fi

  # Carried Debian packages, unpacked under /tmp (dpkg-deb -x, or ar + tar without dpkg).
  local deps=/tmp/brigade-deps
  local -a cmake_extra=()
  if ls "$root"/.device/debs/*.deb >/dev/null 2>&1; then
    mkdir -p "$deps"
    local f
    for f in "$root"/.device/debs/*.deb; do
      if command -v dpkg-deb >/dev/null; then
        dpkg-deb -x "$f" "$deps"
      else
        (tmp=$(mktemp -d) && cd "$tmp" && ar x "$f" && tar -xf data.tar.* -C "$deps" && rm -rf "$tmp")
      fi
    done
    local arch_lib="$deps/usr/lib/x86_64-linux-gnu"
    export LD_LIBRARY_PATH="$arch_lib:$arch_lib/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export LIBRARY_PATH="$arch_lib:$arch_lib/openblas-pthread${LIBRARY_PATH:+:$LIBRARY_PATH}"
    cmake_extra+=("-DCMAKE_PREFIX_PATH=$deps/usr"
                  "-DCMAKE_LIBRARY_PATH=$arch_lib/openblas-pthread;$arch_lib"
                  "-DCMAKE_INCLUDE_PATH=$deps/usr/include")
    echo "unpacked $(ls "$root"/.device/debs/*.deb | wc -l) carried packages into $deps"
  fi

  step configure 240 cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DBRIGADE_ENABLE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DBRIGADE_ENABLE_MPI=OFF -DBRIGADE_NATIVE=ON \
    -DBRIGADE_BUILD_TESTS=ON -DBRIGADE_BUILD_EXAMPLES=ON -DBRIGADE_BUILD_BENCHMARKS=ON \
    "-DBRIGADE_DATA_DIR=$data" "${cmake_extra[@]}" &&
    step build 420 cmake --build "$build" -j "$jobs" --target brigade_cuda_tests cuda_generate \
      bench_cuda

  if [[ -x "$build/tests/cuda/brigade_cuda_tests" ]]; then
    export BRIGADE_DATA_DIR="$data"
    step "cuda tests (ctest -L cuda)" 300 ctest --test-dir "$build" -L cuda --timeout 240 -V
    if [[ "${BRIGADE_SANITIZE:-0}" == 1 ]] && command -v compute-sanitizer >/dev/null; then
      step "kernel tests under compute-sanitizer" 240 compute-sanitizer --tool memcheck \
        --error-exitcode 9 "$build/tests/cuda/brigade_cuda_tests" --test-suite=kernels
    fi
  fi
  if [[ -x "$build/examples/cuda_generate" ]]; then
    step "stories260K f32 token-exact on the engine (cuda_generate --check)" 120 \
      "$build/examples/cuda_generate" --data "$data" --check
    step "stories260K token-exact, 2 pipeline stages on the GPU (cuda_generate --check --stages 2)" \
      120 "$build/examples/cuda_generate" --data "$data" --check --stages 2
  fi
  if [[ -x "$build/bench/bench_cuda" ]]; then
    step "bench_cuda (GEMM peak, 8B layer prefill and decode)" 240 "$build/bench/bench_cuda" \
      --benchmark_min_time=0.3 "--benchmark_out=$logdir/bench_cuda.json" \
      --benchmark_out_format=json
  fi

  echo
  echo "=== summary ($(date -u +%Y-%m-%dT%H:%M:%SZ))"
  nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sed 's/^/GPU: /'
  local i
  for i in "${!names[@]}"; do printf '%-60s %s\n' "${names[$i]}" "${results[$i]}"; done
  cat "$steps"/step*.txt 2>/dev/null | grep -E '^summary:|^stories260K on the GPU|^\[doctest\] test cases' || true
  if [[ $status -eq 0 ]] && printf '%s\n' "${results[@]}" | grep -q '^SKIP'; then
    echo "overall: SKIPPED (no usable GPU: nothing was checked on a device)"
    return 77
  fi
  echo "overall: $([[ $status -eq 0 ]] && echo PASS || echo FAIL)"
  return "$status"
}

rm -f "$steps"/step*.txt
run_checks 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
