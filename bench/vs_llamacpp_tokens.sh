#!/usr/bin/env bash
# Greedy tokens of brigade and llama.cpp on the same GGUF file, compared id by id (issue 14:
# "a model converted to GGUF by llama.cpp's own converter generates the same greedy tokens in
# brigade as in llama.cpp for the first 32 positions").
#   bench/vs_llamacpp_tokens.sh LLAMA_BIN MODEL.gguf [NEW_TOKENS [PROMPT...]]
# LLAMA_BIN is llama.cpp's build/bin (libllama.so and friends); llama.h is read from
# LLAMA_BIN/../../include unless LLAMA_CPP_SRC names the checkout. bench/llamacpp_greedy.cpp is
# compiled against it (greedy sampling, one thread). brigade runs `brigade generate
# --temperature 0` at one stage and prints its ids through --metrics. The prompt ids are compared
# too (brigade's GGUF tokenizer against llama.cpp's); --steps counts positions, prompt included, and
# the token sampled at the last position, so it is prompt + NEW_TOKENS - 1. Exits 1 on a difference.
# Not run by CI: it needs a llama.cpp build and a GGUF file (docs/formats.md records a run).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=$(cd "$1" && pwd)
model=$2
new_tokens=${3:-32}
shift $(($# < 3 ? $# : 3))
prompts=("$@")
((${#prompts[@]})) || prompts=("Once upon a time" "The little dog" "")
src=${LLAMA_CPP_SRC:-$bin/../..}
brigade=${BRIGADE:-$root/build/examples/brigade}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
g++ -O1 -std=c++17 -I"$src/include" -I"$src/ggml/include" "$root/bench/llamacpp_greedy.cpp" \
    -L"$bin" -lllama -lggml -lggml-base -Wl,-rpath,"$bin" -o "$tmp/llamacpp_greedy"
status=0
for p in "${prompts[@]}"; do
  "$tmp/llamacpp_greedy" "$model" "$new_tokens" "$p" 2>/dev/null >"$tmp/llama.txt"
  llama_prompt=$(sed -n 's/^prompt: //p' "$tmp/llama.txt")
  llama_gen=$(sed -n 's/^generated: //p' "$tmp/llama.txt")
  n_prompt=$(wc -w <<<"$llama_prompt")
  "$brigade" generate --model "$model" --temperature 0 --prompt "$p" --stages 1 --threads 1 \
      --profile none --steps $((n_prompt + new_tokens - 1)) --metrics "$tmp/m.json" >/dev/null 2>&1
  ids=$(python3 -c 'import json,sys; print(" ".join(map(str, json.load(open(sys.argv[1]))["sequences"][0]["tokens"])))' "$tmp/m.json")
  brigade_prompt=$(cut -d' ' -f1-"$n_prompt" <<<"$ids")
  brigade_gen=$(cut -d' ' -f$((n_prompt + 1))- <<<"$ids")
  echo "prompt \"$p\": llama.cpp prompt ids: $llama_prompt"
  echo "  llama.cpp: $llama_gen"
  echo "  brigade:   $brigade_gen"
  if [[ "$llama_prompt" == "$brigade_prompt" && "$llama_gen" == "$brigade_gen" ]]; then
    echo "  identical ($new_tokens generated tokens)"
  else
    echo "  DIFFERENT (brigade prompt ids: $brigade_prompt)"
    status=1
  fi
done
exit $status
