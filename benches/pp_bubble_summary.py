#!/usr/bin/env python3
"""Summarizes pipeline-bubble runs of benches/pp_bubble.toml (README, Benchmarks).

Usage: pp_bubble_summary.py M=FILE.jsonl [M=FILE.jsonl ...]  (M = parallel.microbatches of the run)

For each run, over the steps after the first two (warm-up): the measured bubble of pipeline rank 0
(sum of bubble_s over sum of pipeline_s), the bubble the schedule gives with the measured per-stage
compute times and free transfers (bubble_sim_s over pipeline_sim_s), the theory for equal stages
((p-1)/(m+p-1), 1F1B), and the last stage's compute over the first's.
"""
import json
import sys


def summarize(m, path):
    steps = [json.loads(line) for line in open(path)][2:]
    total = lambda key: sum(s[key] for s in steps)
    p = len(steps[0]["stage_forward_s"])
    compute = [sum(s["stage_forward_s"][r] + s["stage_backward_s"][r] for s in steps) for r in range(p)]
    measured = total("bubble_s") / total("pipeline_s")
    sim = total("bubble_sim_s") / total("pipeline_sim_s")
    theory = (p - 1) / (m + p - 1)
    return (m, theory, sim, measured, measured / theory, compute[-1] / compute[0])


def main():
    print("| m | theory | with measured stage times | measured | measured / theory | last / first stage compute |")
    print("|---|---|---|---|---|---|")
    for arg in sys.argv[1:]:
        m, path = arg.split("=", 1)
        m, theory, sim, measured, ratio, imbalance = summarize(int(m), path)
        print(f"| {m} | {theory:.1%} | {sim:.1%} | {measured:.1%} | {ratio:.2f} | {imbalance:.3f} |")


if __name__ == "__main__":
    main()
