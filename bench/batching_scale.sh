#!/usr/bin/env bash
# Issue 15 (DynaPipe training) at the paper's scale, simulated: a 2.7B Llama-shaped GPT on 8 and
# 16 uniform stages with H100 datasheet layer times (profiles/nvidia_h100_sxm.json), one global
# batch of 65,536 tokens, the four batchers of `brigade plan-batches`, swept over the maximum
# sequence length L (2,048, 4,096, 8,192) as DynaPipe's evaluation sweeps it (sec. 7): samples
# are cut to L, Megatron packing fills rows of L tokens (8,192 / L rows per micro-batch), offsets
# packs 8,192-token micro-batches, padding 16 samples, and dynamic's DP keeps each micro-batch
# within one 8,192-token sequence's activations. Lengths: the seeded log-normal stand-in for
# FLANv2 (median 128 tokens, sigma 1, seed 15; FLANv2's own statistics are not published, see
# docs/batching.md). Deterministic: the same figures on every machine.
#
#   bench/batching_scale.sh OUT_DIR      # about 11 s on 2 cores
#
# Prints one line per (stages, L, batcher): micro-batches, padding, the schedule order_adaptive
# chose, the simulated iteration and useful tokens/s, and dynamic's gain over each batcher.
# OUT_DIR/<stages>_<L>_<batcher>.log keeps each plan. BRIGADE (default build/examples/brigade).
set -euo pipefail
out=${1:?usage: bench/batching_scale.sh OUT_DIR}
brigade=${BRIGADE:-build/examples/brigade}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
for L in 2048 4096 8192; do
  python3 - "$L" "$out/lengths_$L.txt" <<'EOF'
import math, random, sys
cap, path = int(sys.argv[1]), sys.argv[2]
r = random.Random(15); total = 0; out = []
while total < 65536:
    n = int(min(cap, max(8, round(math.exp(math.log(128) + r.gauss(0, 1))))))
    n = min(n, 65536 - total); out.append(n); total += n
open(path, "w").write("\n".join(map(str, out)) + "\n")
EOF
  echo "{\"dim\": 2560, \"hidden_dim\": 6912, \"n_layers\": 32, \"n_heads\": 32, \"vocab_size\": 32000, \"seq_len\": $L}" \
    > "$out/gpt2p7b_$L.json"
done
printf '%-6s %-5s %-8s %6s %8s %-9s %12s %12s %9s\n' stages L batcher mbs padding schedule \
  "iteration_s" "useful_tok/s" "dyn_gain"
for S in 8 16; do
  # The schedule's per-rank limit: a little over stages x the DP's limit (docs/batching.md).
  rank=$([[ $S == 8 ]] && echo 5.3e10 || echo 6.2e10)
  for L in 2048 4096 8192; do
    declare -A it=()
    for b in dynamic offsets packing padding; do
      log="$out/${S}_${L}_$b.log"
      "$brigade" plan-batches "$out/lengths_$L.txt" --model "$out/gpt2p7b_$L.json" --stages "$S" \
        --profile "$root/profiles/nvidia_h100_sxm.json" --batching "$b" --token-budget 8192 \
        --row-tokens "$L" --samples-per-microbatch 16 --rank-memory "$rank" > "$log" 2>&1 || {
        # A batcher whose micro-batches do not fit the rank's memory under any order: named.
        printf '%-6s %-5s %-8s %s\n' "$S" "$L" "$b" "does not fit: $(grep -m1 error "$log")"
        continue
      }
      it[$b]=$(sed -nE 's/^schedule by .*: ([a-z0-9]+) in the order .*; simulated iteration ([0-9.e+-]+) s.*/\2/p' "$log")
      gen=$(sed -nE 's/^schedule by .*: ([a-z0-9]+) in the order .*/\1/p' "$log")
      mbs=$(sed -nE 's/^micro-batches ([0-9]+); .*/\1/p' "$log")
      pad=$(sed -nE 's/^micro-batches [0-9]+; .*, ([0-9.]+)%\).*/\1/p' "$log")
      printf '%-6s %-5s %-8s %6s %7s%% %-9s %12.6g %12.1f %9s\n' "$S" "$L" "$b" "$mbs" "$pad" "$gen" \
        "${it[$b]}" "$(python3 -c "print(65536 / ${it[$b]})")" \
        "$([[ -n ${it[dynamic]:-} ]] && python3 -c "print(f'{${it[$b]} / ${it[dynamic]}:.2f}x')" || echo -)"
    done
    unset it
  done
done
