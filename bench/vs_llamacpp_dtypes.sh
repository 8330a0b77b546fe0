#!/usr/bin/env bash
# Single-sequence decode with the weights kept in F32, F16 and Q8_0, brigade beside llama.cpp
# on the 42M Llama shape (docs/benchmarks.md, "Weights kept in F16, BF16 and Q8_0"): each
# repetition runs llama-bench tg64 at 1 thread on the three GGUFs, then bench_pipeline's
# BM_Llama42M_Decode/threads:1 for every dtype and the triad ceiling, back to back, so both
# engines see the same load.
#   bench/vs_llamacpp_dtypes.sh LLAMA_CPP_BIN_DIR F32.gguf F16.gguf Q8_0.gguf [REPETITIONS]
# The GGUFs: brigade's synthetic 42M converted by llama-convert-llama2c-to-ggml (F32), then
# llama-quantize ... F16 and ... Q8_0 (docs/benchmarks.md gives the commands).
set -euo pipefail
bin=${1:?llama.cpp bin directory}
f32=${2:?F32 GGUF}
f16=${3:?F16 GGUF}
q8=${4:?Q8_0 GGUF}
reps=${5:-2}
root=$(cd "$(dirname "$0")/.." && pwd)
build="${BRIGADE_BUILD_DIR:-$root/build}"
lscpu | grep -E "^Model name|^CPU\(s\)"
echo "ISA: $(grep -m1 -o -w -E 'avx512f|avx2|fma|f16c' /proc/cpuinfo | sort -u | tr '\n' ' ')"
for r in $(seq "$reps"); do
  echo "== repetition $r: $(uptime)"
  "$bin/llama-bench" -m "$f32" -m "$f16" -m "$q8" -p 0 -n 64 -t 1 -r 2 2>/dev/null | grep -E '^\|'
  "$build/bench/bench_pipeline" \
    --benchmark_filter='BM_TriadCeiling/threads:1|BM_Llama42M_Decode/threads:1/' 2>&1 |
    grep -E '^BM_|cpu_model|kernel_isa|ceiling_'
done
echo "== end: $(uptime)"
