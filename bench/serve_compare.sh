#!/bin/bash
# Issue 16's measurements (docs/serving.md "Measurements", docs/benchmarks.md "Serving"): even split
# vs static balanced vs dynamic rebalancing (DynaPipe) on the same requests and arrivals, on the
# Azure code and conversation traces and on a workload whose mix changes halfway, with the 42M
# shape (dim 512, 8 layers, vocab 32000; random weights) and top-p sampling (temperature 1,
# top-p 0.9). Each `brigade serve --rebalance even,static,dynamic` runs the three policies one
# after the other on the same arrivals; the workloads are then run again REPEATS times in the
# same order, so the policies interleave (E S D E S D ...) and every figure has a load average
# beside it (metrics "load_average_1min": before and after the run).
#
# Usage: bench/serve_compare.sh OUTDIR
#   BRIGADE_BUILD_DIR  build tree (default build/)
#   BRIGADE_DATA_DIR   the shared data (default ../shared/data beside the checkout)
#   REPEATS            passes over the workloads (default 2)
#   STAGES             pipeline stages to run, a list (default "2"; "2 3" for both)
#   WORKLOADS          any of code conv mixed (default all three)
#   POLICIES           the --rebalance list (default even,static,dynamic; e.g. dynamic alone
#                      to re-measure the migrations)
#   SERVE_ARGS         more `brigade serve` options for every run (e.g. "--rebalance-window 4")
# Prints one line per run and the summary of bench/serve_summary.py.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
B="${BRIGADE_BUILD_DIR:-$root/build}"
D="${BRIGADE_DATA_DIR:-$root/../shared/data}"
O="${1:?usage: bench/serve_compare.sh OUTDIR}"
REPEATS="${REPEATS:-2}"
STAGES="${STAGES:-2}"
WORKLOADS="${WORKLOADS:-code conv mixed}"
POLICIES="${POLICIES:-even,static,dynamic}"
mkdir -p "$O"
{ lscpu | grep -E "Model name|^CPU\(s\)"; printf "ISA:"
  grep -qw avx512f /proc/cpuinfo && printf " AVX-512"; grep -qw avx2 /proc/cpuinfo && printf " AVX2"
  grep -qw fma /proc/cpuinfo && printf " FMA"; echo; } > "$O/lscpu.txt"
uptime > "$O/uptime_start.txt"

# The workload whose mix changes halfway (docs/serving.md): 48 requests, exponential gaps of
# 2 s on average; the first 24 short prompts and long outputs, the last 24 long prompts and
# short outputs.
python3 - "$O/mixed.jsonl" <<'PY'
import json, random, sys
random.seed(5); t = 0.0
with open(sys.argv[1], "w") as f:
    for i in range(48):
        t += random.expovariate(1 / 2.0)
        inp, out = ((random.randint(16, 64), random.randint(40, 80)) if i < 24
                    else (random.randint(500, 800), random.randint(4, 12)))
        f.write(json.dumps({"timestamp": int(t * 1000), "input_length": inp,
                            "output_length": out}) + "\n")
PY

common=(--synthetic 42M --temperature 1 --top-p 0.9 --rebalance "$POLICIES")
read -r -a extra <<< "${SERVE_ARGS:-}"
args_code=(--trace "$D/traces/AzureLLMInferenceTrace_code.csv" --max-requests 100
           --prompt-scale 0.1 --output-scale 0.25 --rate-scale 2)
args_conv=(--trace "$D/traces/AzureLLMInferenceTrace_conv.csv" --max-requests 60
           --prompt-scale 0.2 --output-scale 0.25 --rate-scale 1)
args_mixed=(--trace "$O/mixed.jsonl")

for rep in $(seq 1 "$REPEATS"); do
  for s in $STAGES; do
    for w in $WORKLOADS; do
      eval "wargs=(\"\${args_${w}[@]}\")"
      tag="${w}_s${s}_r${rep}"
      echo "== $tag: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
      "$B/examples/brigade" serve "${wargs[@]}" "${common[@]}" ${extra[@]+"${extra[@]}"} --stages "$s" \
        --metrics "$O/$tag.json" > /dev/null 2> "$O/$tag.txt"
      grep -E "^serve: (even|static|dynamic) +(layers|move|migrations)" "$O/$tag.txt" >&2 || true
    done
  done
done
uptime > "$O/uptime_end.txt"
python3 "$root/bench/serve_summary.py" "$O"
