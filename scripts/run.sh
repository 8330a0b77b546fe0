#!/usr/bin/env bash
# The main job: build brigade and generate text with a Llama split into pipeline stages.
# With no arguments: a synthetic 42M-parameter Llama (dim 512, 8 layers, vocab 32000) in 2 stages,
# 8 sequences in flight. Any arguments are passed to `brigade generate` instead, e.g.
#   scripts/run.sh --model ../shared/data/stories260K.bin --tokenizer ../shared/data/tok512.bin \
#                  --prompt "Once upon a time" --temperature 0 --stages 3
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/deps.sh"
build="${BRIGADE_BUILD_DIR:-$root/build}"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBRIGADE_BUILD_TESTS=OFF \
      -DBRIGADE_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build "$build" --target brigade_cli -j"$(nproc)" >&2   # stdout is the text only
if (($# == 0)); then
  set -- --synthetic 42M --stages 2 --steps 64 --temperature 0.8 \
         --prompt "Once upon a time" --prompt "The little dog" --prompt "One day" \
         --prompt "Lily and Ben" --prompt "The sun was" --prompt "A big red ball" \
         --prompt "In the park" --prompt "Tom had a" \
         --trace "$build/generate_trace.json" --metrics "$build/generate_metrics.json"
fi
exec "$build/examples/brigade" generate "$@"
