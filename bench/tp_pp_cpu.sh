#!/bin/bash
# Issue 19's small-scale trade-off (docs/tp_pp.md, "Measured on this machine"): the 42M synthetic
# model on 1 rank, TP 2 (one stage, two tensor-parallel threads) and PP 2 (two stages), one
# intra-op thread per rank, at batch 1 (latency) and batch 8 (throughput), each measured REPS
# times (median; the six runs interleaved within each repetition) by `brigade generate --metrics`, beside `brigade plan`'s prediction of the same
# (TP, PP, batch) from a device profile of this machine measured first (link: in-process).
# Usage: bench/tp_pp_cpu.sh OUTDIR [REPS]   (BRIGADE_BUILD_DIR defaults to build/)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
B="${BRIGADE_BUILD_DIR:-$root/build}/examples/brigade"
O="${1:?usage: bench/tp_pp_cpu.sh OUTDIR [REPS]}"
reps="${2:-3}"
mkdir -p "$O"
lscpu | grep -E "Model name|^CPU\(s\)|Flags" | sed -E 's/^(Flags:).*/\1 (avx2: '"$(grep -c avx2 /proc/cpuinfo)"' cpus, avx512f: '"$(grep -c avx512f /proc/cpuinfo)"' cpus)/' > "$O/lscpu.txt"
uptime > "$O/uptime_start.txt"
"$B" profile --cores 2 --out "$O/profile.json" 2> "$O/profile.txt"
prompt="Once upon a time there was a little girl"  # 31 tokens (BOS included) with the synthetic tokenizer
input=31 output=128
steps=$((input + output - 1))  # the last prompt position samples the first output token
configs=("1 1" "2 1" "1 2")
for batch in 1 8; do
  for i in $(seq 1 $batch); do echo "$prompt"; done > "$O/prompts$batch.txt"
  for cfg in "${configs[@]}"; do
    set -- $cfg
    tp=$1 pp=$2
    "$B" plan --model 42M --gpus $((tp * pp)) --gpu "$O/profile.json" --link in-process \
      --tp $tp --pp $pp --batch $batch --input-len $input --output-len $output \
      --json "$O/plan_tp${tp}_pp${pp}_b$batch.json" > /dev/null
  done
done
# Interleaved: each repetition runs every (batch, grid) once, in turn (1 rank, TP2, PP2, ...), so
# the machine's load falls on all of them alike; the load average is recorded per repetition.
: > "$O/uptime_reps.txt"
for r in $(seq 1 "$reps"); do
  uptime >> "$O/uptime_reps.txt"
  for batch in 1 8; do
    for cfg in "${configs[@]}"; do
      set -- $cfg
      tp=$1 pp=$2
      "$B" generate --synthetic 42M --prompt-file "$O/prompts$batch.txt" --steps $steps \
        --temperature 0 --stages $pp --tp $tp --threads 1 --profile "$O/profile.json" \
        --metrics "$O/gen_tp${tp}_pp${pp}_b${batch}_$r.json" > /dev/null 2> "$O/gen_tp${tp}_pp${pp}_b${batch}_$r.txt"
    done
  done
done
uptime > "$O/uptime_end.txt"
# The same profile with the memory bandwidth shared by the two ranks (both stream at once under
# TP): what the planner predicts for TP 2 when told this machine's memory is one channel.
python3 - "$O" <<'PY'
import json, sys
p = json.load(open(f"{sys.argv[1]}/profile.json"))
p["memory_bytes_per_s"] /= 2
p["name"] += " (bandwidth shared by 2 ranks)"
json.dump(p, open(f"{sys.argv[1]}/profile_shared.json", "w"))
PY
for batch in 1 8; do
  "$B" plan --model 42M --gpus 2 --gpu "$O/profile_shared.json" --link in-process --tp 2 --pp 1 \
    --batch $batch --input-len $input --output-len $output --json "$O/shared_tp2_pp1_b$batch.json" > /dev/null
done
python3 - "$O" "$reps" <<'PY'
import json, statistics, sys
o, reps = sys.argv[1], int(sys.argv[2])
print("| grid | batch | TTFT ms measured / predicted | TPOT ms measured / predicted | tokens/s measured / predicted |")
print("| --- | --- | --- | --- | --- |")
for batch in (1, 8):
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        runs = [json.load(open(f"{o}/gen_tp{tp}_pp{pp}_b{batch}_{r}.json")) for r in range(1, reps + 1)]
        med = lambda k: statistics.median(m[k] for m in runs)
        p = json.load(open(f"{o}/plan_tp{tp}_pp{pp}_b{batch}.json"))["plans"][0]
        print(f"| TP{tp} x PP{pp} | {batch} | {med('ttft_s_mean')*1e3:.1f} / {p['ttft_s']*1e3:.1f} "
              f"| {med('tpot_s_mean')*1e3:.2f} / {p['tpot_s']*1e3:.2f} "
              f"| {med('tokens_per_s'):.1f} / {p['tokens_per_s']:.1f} |")
print("spread (min-max of the runs, TTFT ms / TPOT ms / tokens/s):")
for batch in (1, 8):
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        runs = [json.load(open(f"{o}/gen_tp{tp}_pp{pp}_b{batch}_{r}.json")) for r in range(1, reps + 1)]
        rng = lambda k, s: f"{min(m[k] for m in runs)*s:.1f}-{max(m[k] for m in runs)*s:.1f}"
        print(f"  TP{tp} x PP{pp} b{batch}: {rng('ttft_s_mean', 1e3)} / {rng('tpot_s_mean', 1e3)} / "
              f"{rng('tokens_per_s', 1)}")
print("load average per repetition and at the end:")
for line in open(f"{o}/uptime_reps.txt"):
    print("  " + line.strip())
print("  " + open(f"{o}/uptime_end.txt").read().strip())
for batch in (1, 8):
    p = json.load(open(f"{o}/shared_tp2_pp1_b{batch}.json"))["plans"][0]
    print(f"TP2 x PP1, batch {batch}, bandwidth shared: predicted TTFT {p['ttft_s']*1e3:.1f} ms, "
          f"TPOT {p['tpot_s']*1e3:.2f} ms, {p['tokens_per_s']:.1f} tokens/s")
PY
