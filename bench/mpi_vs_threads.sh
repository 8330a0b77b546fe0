#!/usr/bin/env bash
# The "MPI transport" section of docs/benchmarks.md: MpiTransport (2 processes) against the
# in-process transport (2 threads), measured in the same run.
#   1. bench_transport under `mpirun -np 2`: ping-pong of 4 KiB .. 64 MiB, both transports (and
#      bare MPI calls, the floor under MpiTransport) in one run; medians of REPS repetitions;
#      ratio = MPI / in-process.
#   2. `brigade generate --synthetic 42M`, 2 stages, 8 sequences in flight: 2 threads vs
#      `mpirun -np 2` (one process per stage), RUNS alternating runs each, best tokens/s of each;
#      the two texts must be identical (greedy).
# Usage: bench/mpi_vs_threads.sh [build dir]   (default: build; needs brigade::mpi built)
# Env: REPS (default 5), MIN_TIME (default 0.2, seconds per benchmark), RUNS (default 3).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-${BRIGADE_BUILD_DIR:-$root/build}}
reps=${REPS:-5}
min_time=${MIN_TIME:-0.2}
runs=${RUNS:-3}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; load before: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "## ping-pong (median of $reps, --benchmark_min_time=$min_time)"
mpirun -np 2 "$build/bench/bench_transport" --benchmark_min_time="$min_time" \
  --benchmark_repetitions="$reps" --benchmark_report_aggregates_only=true \
  --benchmark_format=csv 2>/dev/null >"$tmp/pingpong.csv"
awk -F, '
  /_median"/ {
    name = $1; gsub(/"/, "", name)
    split(name, p, "/"); kind = p[2]; sub(/bytes:/, "", p[3]); bytes = p[3]
    bw[kind, bytes] = $11; lat[kind, bytes] = $12
    if (!(bytes in seen)) { seen[bytes] = 1; order[n++] = bytes }
  }
  function human(b) { b += 0; return b >= 1048576 ? b / 1048576 " MiB" : b / 1024 " KiB" }
  END {
    print "| message | in-process one-way | MpiTransport one-way | bare MPI one-way | MpiTransport / in-process latency | in-process GiB/s | MpiTransport GiB/s | bare MPI GiB/s | MpiTransport / in-process bandwidth |"
    print "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    for (i = 0; i < n; ++i) {
      b = order[i]
      printf "| %s | %.1f us | %.1f us | %.1f us | %.2f | %.2f | %.2f | %.2f | %.2f |\n", human(b),
             lat["in_process", b] * 1e6, lat["mpi", b] * 1e6, lat["raw_mpi", b] * 1e6,
             lat["mpi", b] / lat["in_process", b], bw["in_process", b] / 2^30,
             bw["mpi", b] / 2^30, bw["raw_mpi", b] / 2^30, bw["mpi", b] / bw["in_process", b]
    }
  }' "$tmp/pingpong.csv"

echo
echo "## brigade generate --synthetic 42M, 2 stages, 8 sequences, 64 steps, greedy (best of $runs)"
args=(generate --synthetic 42M --steps 64 --temperature 0
      --prompt "Once upon a time" --prompt "The little dog" --prompt "One day"
      --prompt "Lily and Ben" --prompt "The sun was" --prompt "A big red ball"
      --prompt "In the park" --prompt "Tom had a")
tps() { sed -n 's/.*"tokens_per_s": *\([0-9.eE+-]*\).*/\1/p' "$1"; }
best_threads=0
best_mpi=0
for ((i = 0; i < runs; ++i)); do
  "$build/examples/brigade" "${args[@]}" --stages 2 --metrics "$tmp/threads.json" \
    >"$tmp/threads.txt" 2>/dev/null
  mpirun -np 2 "$build/examples/brigade" "${args[@]}" --metrics "$tmp/mpi.json" \
    >"$tmp/mpi.txt" 2>/dev/null
  cmp -s "$tmp/threads.txt" "$tmp/mpi.txt" || { echo "the texts differ" >&2; exit 1; }
  best_threads=$(awk -v a="$best_threads" -v b="$(tps "$tmp/threads.json")" 'BEGIN { print (b > a ? b : a) }')
  best_mpi=$(awk -v a="$best_mpi" -v b="$(tps "$tmp/mpi.json")" 'BEGIN { print (b > a ? b : a) }')
done
echo "| run | tokens/s | ratio to 2 threads |"
echo "| --- | --- | --- |"
awk -v t="$best_threads" -v m="$best_mpi" 'BEGIN {
  printf "| 2 threads (InProcessTransport) | %.1f | 1.00 |\n", t
  printf "| 2 processes (mpirun -np 2, MpiTransport) | %.1f | %.2f |\n", m, m / t
}'
echo
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
