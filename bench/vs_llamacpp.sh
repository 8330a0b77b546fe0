#!/usr/bin/env bash
# brigade beside llama.cpp on the 42M Llama shape, back to back in each repetition so both
# engines see the same load (the machine's load and the host's steal vary from minute to minute).
#   bench/vs_llamacpp.sh LLAMA_CPP_BIN_DIR MODEL.gguf [REPETITIONS]
#     docs/benchmarks.md, "Decode and prefill beside llama.cpp": each llama.cpp measurement
#     directly followed by brigade's of the same work, so that the pair sees the same minute of
#     the host (whose speed drifts by tens of percent over a few minutes): llama-bench pp512 /
#     BM_Llama42M_Prefill, then tg64 / BM_Llama42M_Decode (F32) beside BM_TriadCeiling, at 1 and
#     2 threads; llama-batched-bench (8 and 32 sequences, 48 decode tokens) / BM_Decode's one-
#     stage rows at 1 thread and BM_PlannedDecode (the planner's pick against every plan) at 2.
#     Default 3 repetitions. bench/vs_llamacpp_summary.py turns the log into ratios.
#   bench/vs_llamacpp.sh --dtypes LLAMA_CPP_BIN_DIR A.gguf [B.gguf ...] [REPETITIONS]
#     docs/benchmarks.md, "Weights kept in F16, BF16 and Q8_0": single-sequence decode per weight
#     dtype: llama-bench tg64 (-p 0 -n 64 -r 2) on each GGUF (the same model in the dtypes to
#     compare, e.g. F32, F16, Q8_0), then bench_pipeline's BM_Llama42M_Decode for every dtype and
#     the triad ceiling. THREADS (default 1; a list such as 1,2) sets the threads of both.
#     Default 2 repetitions.
# KERNEL_ISAS (e.g. "avx512 avx2") runs brigade once per small-M kernel (BRIGADE_KERNEL_ISA) in
# each repetition; default: the widest this CPU has. OpenBLAS's kernels follow
# OPENBLAS_CORETYPE as set (the context's gemm_library names them). The avx2 kernel on a CPU
# with AVX-512 runs as on an AVX2-only CPU: products of up to 16 rows take the small-M kernel,
# more go to SGEMM (BRIGADE_SMALL_M_MAX_ROWS=16; the limit follows the CPU, 32 rows with
# AVX-512, so that the kernel choice never changes the bits), unless the caller sets
# BRIGADE_SMALL_M_MAX_ROWS.
# The GGUFs: brigade's synthetic 42M as a llama2.c checkpoint converted by llama.cpp's
# llama-convert-llama2c-to-ggml, and llama-quantize's F16 and Q8_0 copies (docs/benchmarks.md
# gives the commands).
set -euo pipefail
mode=all
if [[ "${1:-}" == "--dtypes" ]]; then
  mode=dtypes
  shift
fi
bin=${1:?llama.cpp bin directory}
shift
models=()
while (($#)) && [[ "$1" == *.gguf ]]; do
  models+=("$1")
  shift
done
((${#models[@]})) || { echo "vs_llamacpp.sh: no GGUF model given" >&2; exit 2; }
[[ $mode == dtypes || ${#models[@]} -eq 1 ]] || {
  echo "vs_llamacpp.sh: one model without --dtypes" >&2
  exit 2
}
reps=${1:-$([[ $mode == dtypes ]] && echo 2 || echo 3)}
threads=${THREADS:-1}
root=$(cd "$(dirname "$0")/.." && pwd)
build="${BRIGADE_BUILD_DIR:-$root/build}"
lscpu | grep -E "^Model name|^CPU\(s\)"
echo "ISA: $(grep -m1 -o -w -E 'avx512f|avx2|fma|f16c' /proc/cpuinfo | sort -u | tr '\n' ' ')"

# brigade's benchmarks matching FILTER, with every kernel of KERNEL_ISAS.
brigade() {
  local filter=$1
  for isa in ${KERNEL_ISAS:-default}; do
    local vars=()
    [[ $isa == default ]] || vars+=("BRIGADE_KERNEL_ISA=$isa")
    if [[ $isa == avx2 && -z "${BRIGADE_SMALL_M_MAX_ROWS:-}" ]] && grep -q -w avx512f /proc/cpuinfo; then
      vars+=("BRIGADE_SMALL_M_MAX_ROWS=16")
    fi
    echo "brigade, kernel $isa ${vars[*]}"
    env "${vars[@]}" "$build/bench/bench_pipeline" --benchmark_filter="$filter" 2>&1 |
      grep -E '^BM_|cpu_model|kernel_isa|gemm_library|ceiling_|warning'
  done
}

run_all() {
  for t in 1 2; do
    "$bin/llama-bench" -m "${models[0]}" -p 512 -n 0 -t "$t" -r 1 2>/dev/null | grep -E '^\|'
    brigade "BM_Llama42M_Prefill/threads:$t/"
    "$bin/llama-bench" -m "${models[0]}" -p 0 -n 64 -t "$t" -r 1 2>/dev/null | grep -E '^\|'
    brigade "BM_Llama42M_Decode/threads:$t/dtype:0/|BM_TriadCeiling/threads:$t/|BM_GemmCeiling/threads:$t/"
  done
  for t in 1 2; do
    echo "llama-batched-bench -t $t"
    "$bin/llama-batched-bench" -m "${models[0]}" -c 4096 -b 2048 -ub 512 -npp 1 -ntg 48 \
      -npl 8,32 -t "$t" 2>/dev/null | grep -E '^\|'
    if ((t == 1)); then
      brigade "BM_Decode/stages:1/threads:1/seqs:(8|32)/"
    else
      brigade "BM_PlannedDecode"
    fi
  done
}

run_dtypes() {
  local m=() t
  for f in "${models[@]}"; do m+=(-m "$f"); done
  "$bin/llama-bench" "${m[@]}" -p 0 -n 64 -t "$threads" -r 2 2>/dev/null | grep -E '^\|'
  for t in ${threads//,/ }; do
    brigade "BM_TriadCeiling/threads:$t(/|\$)|BM_Llama42M_Decode/threads:$t/"
  done
}

for r in $(seq "$reps"); do
  echo "== repetition $r: $(uptime)"
  if [[ $mode == dtypes ]]; then run_dtypes; else run_all; fi
done
echo "== end: $(uptime)"
