#!/usr/bin/env python3
"""Summary of bench/serve_compare.sh's metrics: one row per workload, stage count and policy,
each figure the mean over the repeats (the per-repeat values of the improvement over the even
split are listed), with the load averages seen. Usage: bench/serve_summary.py OUTDIR"""
import glob
import json
import os
import re
import sys
from collections import defaultdict

out = sys.argv[1]
rows = defaultdict(list)  # (workload, stages, policy) -> [(repeat, run, improvement)]
for path in sorted(glob.glob(os.path.join(out, "*_s*_r*.json"))):
    m = re.match(r"(.+)_s(\d+)_r(\d+)\.json$", os.path.basename(path))
    if not m:
        continue
    workload, stages, rep = m.group(1), int(m.group(2)), int(m.group(3))
    with open(path) as f:
        runs = json.load(f)["runs"]
    even = next((r for r in runs if r["rebalance"] == "even"), None)
    for r in runs:
        imp = None
        if even is not None and r["rebalance"] != "even":
            imp = 1.0 - r["e2e_s"]["mean"] / even["e2e_s"]["mean"]
        rows[(workload, stages, r["rebalance"])].append((rep, r, imp))


def get(d, *path):
    for p in path:
        d = d[p]
    return d


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


order = {"even": 0, "static": 1, "dynamic": 2}
print("| workload | stages | split | e2e mean / p50 / p99 (s) | TTFT mean / p99 (s) | "
      "TPOT mean / p99 (s) | tokens/s | mean e2e vs even (each repeat) | moves | "
      "held-out MAPE per stage | migration rounds vs neighbours: mean / a migration's slowest (median), and in windows without one | "
      "load average |")
print("| --- | ---: | --- | --- | --- | --- | ---: | --- | ---: | --- | --- | --- |")
for key in sorted(rows, key=lambda k: (k[0], k[1], order.get(k[2], 9))):
    workload, stages, policy = key
    items = sorted(rows[key], key=lambda t: t[0])
    runs = [r for _, r, _ in items]

    def g(*path):
        return mean([get(r, *path) for r in runs])

    imps = [i for _, _, i in items if i is not None]
    imp_text = ("" if not imps else
                f"{-100 * mean(imps):+.1f}% ({', '.join(f'{-100 * i:+.1f}%' for i in imps)})")
    moves = mean([len(r["moves"]) for r in runs])
    mape = []
    for v in range(stages):
        mape.append(mean([r["predictor"][v]["heldout_mape"] for r in runs
                          if len(r["predictor"]) > v]))
    migs = [r["migration"] for r in runs if "migration" in r
            and "mean_round_ratio_vs_neighbours" in r["migration"]]
    mig_text = ("" if not migs else
                f"{mean([m['mean_round_ratio_vs_neighbours'] for m in migs]):.2f}x / "
                f"{mean([m['median_max_round_ratio_vs_neighbours'] for m in migs]):.2f}x "
                f"(without: {mean([m['baseline_mean_round_ratio'] for m in migs]):.2f}x / "
                f"{mean([m['baseline_max_round_ratio'] for m in migs]):.2f}x)")
    loads = [x for r in runs for x in r.get("load_average_1min", [])]
    print(f"| {workload} | {stages} | {policy} | "
          f"{g('e2e_s', 'mean'):.2f} / {g('e2e_s', 'p50'):.2f} / {g('e2e_s', 'p99'):.2f} | "
          f"{g('ttft_s', 'mean'):.2f} / {g('ttft_s', 'p99'):.2f} | "
          f"{g('tpot_s', 'mean'):.3f} / {g('tpot_s', 'p99'):.3f} | "
          f"{g('throughput_tokens_per_s'):.1f} | {imp_text} | {moves:.1f} | "
          f"{' / '.join(f'{100 * x:.0f}%' for x in mape)} | "
          f"{mig_text} | "
          f"{(f'{min(loads):.1f}-{max(loads):.1f}' if loads else '')} |")
