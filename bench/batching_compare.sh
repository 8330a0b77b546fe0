#!/usr/bin/env bash
# Issue 15 (DynaPipe training): the four batchers of `brigade train --batching` on the Debian
# multi-task corpus, 2 pipeline ranks, 40 steps, in both orders (forward, then reversed) and
# REPEATS times, with the loose cap (one 511-token sequence's activations per micro-batch) and
# then the tight one (--memory-limit 3.6e6 --rank-memory 7.3e6). docs/batching.md.
#
#   bench/batching_compare.sh OUT_DIR            # REPEATS=3 (about 7 minutes on 2 cores)
#
# Each run prints its table and "dynamic / X: A measured, B predicted"; OUT_DIR/<run>.log and
# OUT_DIR/<run>.jsonl keep them. BRIGADE (default build/examples/brigade) is the binary.
set -euo pipefail
out=${1:?usage: bench/batching_compare.sh OUT_DIR}
repeats=${REPEATS:-3}
brigade=${BRIGADE:-build/examples/brigade}
mkdir -p "$out"
run() {
  "$brigade" train --model models/stories260K.bin --tokenizer models/tok512.bin --data debian \
    --stages 2 --steps 40 --microbatches 8 --tokens-per-microbatch 511 --seed 42 \
    --batching "$1" --metrics "$out/$2.jsonl" ${3:-} > "$out/$2.log" 2>&1
  echo "== $2 ($1 ${3:-})"
  grep -E '^dynamic / ' "$out/$2.log"
}
for r in $(seq 1 "$repeats"); do
  run padding,packing,offsets,dynamic "loose_fwd$r"
  run dynamic,offsets,packing,padding "loose_rev$r"
done
for r in $(seq 1 "$repeats"); do
  run packing,offsets,dynamic "tight_fwd$r" "--memory-limit 3.6e6 --rank-memory 7.3e6"
  run dynamic,offsets,packing "tight_rev$r" "--memory-limit 3.6e6 --rank-memory 7.3e6"
done
