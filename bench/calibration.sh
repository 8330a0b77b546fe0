#!/bin/bash
# Issue 13's measurements (docs/benchmarks.md, "The calibrated cost model"): a device profile of
# this machine, the 2-stage generate split with the profile and with the roofline, one stage for
# comparison, then the held-out prediction, decode and training benchmarks, one after the other.
# Usage: bench/calibration.sh OUTDIR   (BRIGADE_BUILD_DIR defaults to build/)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
B="${BRIGADE_BUILD_DIR:-$root/build}"
O="${1:?usage: bench/calibration.sh OUTDIR}"
mkdir -p "$O"
lscpu | grep -E "Model name|^CPU\(s\)" > "$O/lscpu.txt"
uptime > "$O/uptime_start.txt"
export XDG_CACHE_HOME="$O/cache"   # --profile auto reads the profile measured here
rm -rf "$O/cache"
"$B/examples/brigade" profile --cores 2 --out "$O/profile.json" 2> "$O/profile.txt"
mkdir -p "$O/cache/brigade" && cp "$O/profile.json" "$O/cache/brigade/profile-2c-v4.json"
for i in $(seq 0 31); do echo "Once upon a time $i"; done > "$O/prompts32.txt"
gen=(generate --synthetic 42M --prompt-file "$O/prompts32.txt" --steps 64 --temperature 0)
for split in auto none; do
  "$B/examples/brigade" "${gen[@]}" --stages 2 --profile $split > /dev/null 2> "$O/gen2_$split.txt"
done
"$B/examples/brigade" "${gen[@]}" --stages 1 > /dev/null 2> "$O/gen1.txt"
"$B/bench/bench_pipeline" --benchmark_filter='BM_CalibratedPrediction|BM_Decode/stages:1/threads:1/seqs:32|BM_Decode/stages:2/threads:1/seqs:32/mb:2' > "$O/bench_pipeline.txt" 2>&1
"$B/bench/bench_training" --benchmark_filter='BM_CalibratedTrainingOps|BM_Train/|BM_TrainSpeedup' > "$O/bench_training.txt" 2>&1
uptime > "$O/uptime_end.txt"
grep -hE "partition|throughput|busy" "$O"/gen*.txt
grep -hE "^BM_" "$O/bench_pipeline.txt" "$O/bench_training.txt"
