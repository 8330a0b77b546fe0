#!/usr/bin/env bash
# brigade beside llama.cpp on the 42M Llama shape (docs/benchmarks.md, "Decode and prefill beside
# llama.cpp"): each repetition runs llama-bench (pp512, tg64 at 1 and 2 threads),
# llama-batched-bench (8 and 32 sequences, 48 decode tokens, 1 and 2 threads) and then
# bench_pipeline (ceilings, decode, planner, prefill) back to back, so both see the same load.
#   bench/vs_llamacpp.sh LLAMA_CPP_BIN_DIR MODEL.gguf [REPETITIONS]
# MODEL.gguf: brigade's synthetic 42M as a llama2.c checkpoint converted by llama.cpp's
# llama-convert-llama2c-to-ggml (docs/benchmarks.md gives the commands).
set -euo pipefail
bin=${1:?llama.cpp bin directory}
model=${2:?GGUF model}
reps=${3:-3}
root=$(cd "$(dirname "$0")/.." && pwd)
build="${BRIGADE_BUILD_DIR:-$root/build}"
lscpu | grep -E "^Model name|^CPU\(s\)"
echo "ISA: $(grep -m1 -o -w -E 'avx512f|avx2|fma' /proc/cpuinfo | sort -u | tr '\n' ' ')"
for r in $(seq "$reps"); do
  echo "== repetition $r: $(uptime)"
  "$bin/llama-bench" -m "$model" -p 512 -n 64 -t 1,2 -r 1 2>/dev/null | grep -E '^\|'
  for t in 1 2; do
    echo "llama-batched-bench -t $t"
    "$bin/llama-batched-bench" -m "$model" -c 4096 -b 2048 -ub 512 -npp 1 -ntg 48 -npl 8,32 \
      -t "$t" 2>/dev/null | grep -E '^\|'
  done
  "$build/bench/bench_pipeline" \
    --benchmark_filter='Triad|GemmCeiling|Llama42M|BM_Decode|PlannedDecode' 2>&1 |
    grep -E '^BM_|cpu_model|kernel_isa|ceiling_'
done
echo "== end: $(uptime)"
