#!/usr/bin/env bash
# The main job: build brigade and generate stories with a real Llama split into pipeline stages.
# With no arguments: stories260K (llama2.c's 260K-parameter TinyStories Llama, committed in
# models/) in 2 pipeline stages, six prompts in flight, sampled at temperature 0.8 and top-p 0.9;
# the stories go to stdout, then a summary and where the trace and metrics went to stderr.
# Any arguments are passed to `brigade generate` instead, e.g. a synthetic model:
#   scripts/run.sh --synthetic 42M --stages 2 --steps 64 --prompt "Once upon a time"
#   scripts/run.sh --model models/stories260K.bin --tokenizer models/tok512.bin \
#                  --prompt "Once upon a time" --temperature 0 --stages 3
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/deps.sh"
build="${BRIGADE_BUILD_DIR:-$root/build}"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBRIGADE_NATIVE=ON -DBRIGADE_BUILD_TESTS=OFF \
      -DBRIGADE_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build "$build" --target brigade_cli -j"$(nproc)" >&2   # stdout is the text only
if (($# == 0)); then
  set -- --model "$root/models/stories260K.bin" --tokenizer "$root/models/tok512.bin" \
         --stages 2 --steps 200 --temperature 0.8 --top-p 0.9 --seed 42 \
         --prompt "Once upon a time" --prompt "The little dog" --prompt "One day, Lily" \
         --prompt "Tom and his mom" --prompt "The sun was" --prompt "A big red ball" \
         --trace "$build/generate_trace.json" --metrics "$build/generate_metrics.json"
fi
exec "$build/examples/brigade" generate "$@"
