#!/usr/bin/env python3
"""Ratios of brigade to llama.cpp per repetition from a bench/vs_llamacpp.sh log (default mode).

    bench/vs_llamacpp_summary.py LOG

Rows (issue 10's table): prefill 512 tokens (llama-bench pp512 against BM_Llama42M_Prefill),
decode of 1 sequence (tg64 against BM_Llama42M_Decode, F32), 8 and 32 sequences (llama-batched-
bench's S_TG against the best of BM_Decode's plans at 1 thread, and the planner's pick,
BM_PlannedDecode, at 2 threads), at 1 and 2 threads; then the single-sequence weight stream
against the run's one-core triads and the planner's pick against the best plan. Each line gives
every repetition's ratio and their median.
"""
import re
import statistics
import sys


def parse(path):
    reps, cur, bt = [], None, None
    for line in open(path):
        if line.startswith("== repetition"):
            cur = {"llama": {}, "brigade": {}}
            reps.append(cur)
            continue
        if cur is None:
            continue
        m = re.match(r"\|.*\|\s+(\d+) \|\s+(pp512|tg64) \|\s+([\d.]+)", line)
        if m:
            cur["llama"][(m.group(2), int(m.group(1)))] = float(m.group(3))
            continue
        m = re.match(r"llama-batched-bench -t (\d)", line)
        if m:
            bt = int(m.group(1))
            continue
        m = re.match(r"\|\s+1 \|\s+48 \|\s+(\d+) \|(?:[^|]*\|){4}\s*([\d.]+) \|", line)
        if m and bt:
            cur["llama"][("seqs%s" % m.group(1), bt)] = float(m.group(2))
            continue
        m = re.match(r"(ceiling_triad_GBs_1core): ([\d.]+)", line)
        if m:
            cur["brigade"]["profile_triad"] = float(m.group(2))
        if not line.startswith("BM_"):
            continue
        name = line.split()[0]
        counters = dict(re.findall(r"(\w+)=([\d.]+[kMm]?)", line))

        def num(key):
            v = counters[key]
            scale = {"k": 1e3, "M": 1e6, "m": 1e-3}.get(v[-1], 1.0)
            return float(v.rstrip("kMm")) * scale

        b = cur["brigade"]
        if name.startswith("BM_Llama42M_Prefill"):
            b[("pp512", int(re.search(r"threads:(\d)", name).group(1)))] = num("prefill_tokens_per_s")
        elif name.startswith("BM_Llama42M_Decode") and "dtype:0/" in name:
            t = int(re.search(r"threads:(\d)", name).group(1))
            b[("tg64", t)] = num("decode_tokens_per_s")
            b[("stream", t)] = num("weight_GB_per_s")
        elif name.startswith("BM_TriadCeiling/threads:1"):
            b["triad1"] = num("GB_per_s")
        elif name.startswith("BM_Decode/"):
            s, t, n = (int(x) for x in re.search(r"stages:(\d)/threads:(\d)/seqs:(\d+)", name).groups())
            if s * t == 1:
                key = ("seqs%d" % n, 1)
                b[key] = max(b.get(key, 0.0), num("tokens_per_s"))
        elif name.startswith("BM_PlannedDecode"):
            n = int(re.search(r"seqs:(\d+)", name).group(1))
            b[("seqs%d" % n, 2)] = num("tokens_per_s")
            if "pick_over_best" in counters:
                b[("pick_over_best", n)] = num("pick_over_best")
    return reps


def main():
    reps = parse(sys.argv[1])
    rows = [("prefill 512 tokens", "pp512"), ("decode 1 sequence", "tg64"),
            ("decode 8 sequences", "seqs8"), ("decode 32 sequences", "seqs32")]
    print("| work | threads | brigade / llama.cpp per repetition | median |")
    print("| --- | ---: | --- | ---: |")
    for label, key in rows:
        for t in (1, 2):
            r = [x["brigade"][(key, t)] / x["llama"][(key, t)] for x in reps
                 if (key, t) in x["brigade"] and (key, t) in x["llama"]]
            if r:
                print("| %s | %d | %s | %.2fx |" % (label, t, ", ".join("%.2f" % v for v in r),
                                                   statistics.median(r)))
    for what, den in (("BM_TriadCeiling/threads:1", "triad1"), ("the profile's one-core triad", "profile_triad")):
        r = [x["brigade"][("stream", 1)] / x["brigade"][den] for x in reps
             if ("stream", 1) in x["brigade"] and den in x["brigade"]]
        if r:
            print("single-sequence weight stream / %s: %s (median %.2f)" %
                  (what, ", ".join("%.2f" % v for v in r), statistics.median(r)))
    for n in (8, 32):
        r = [x["brigade"][("pick_over_best", n)] for x in reps if ("pick_over_best", n) in x["brigade"]]
        if r:
            print("planner's pick / best plan, %d sequences: %s (median %.3f)" %
                  (n, ", ".join("%.3f" % v for v in r), statistics.median(r)))


if __name__ == "__main__":
    main()
