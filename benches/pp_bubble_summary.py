#!/usr/bin/env python3
"""Summarizes pipeline-bubble runs of benches/pp_bubble.toml (README, Benchmarks).

Usage: pp_bubble_summary.py M[xV]=FILE.jsonl[,FILE.jsonl...] ...
  (M = parallel.microbatches, V = parallel.virtual_stages of an interleaved run, default 1)

Per file, over the steps after the first two (warm-up), with p pipeline ranks, round time T
(`pipeline_s`, pipeline rank 0 runs the first and the last compute of a round) and each rank's
compute C_r (`stage_forward_s` + `stage_backward_s`):
- measured bubble: the idle share of all ranks' time, 1 - sum(C_r) / (p * T), what the theory
  (p-1)/(v*m+p-1) describes; the same share of the median step (robust to a step that a stall of
  the machine stretched); and rank 0's alone (`bubble_s` / `pipeline_s`);
- simulated: the same share when the schedule runs with the measured C_r over buffered links with
  free transfers (`pipeline_sim_s` is that round): what the stages' imbalance alone explains;
- the last stage's compute over the first's.
Several files for one M (repetitions) are summarized by the median of each column.
"""
import json
import statistics
import sys


def one(path, m, v):
    steps = [json.loads(line) for line in open(path)][2:]
    total = lambda key: sum(s[key] for s in steps)
    p = len(steps[0]["stage_forward_s"])
    compute = [sum(s["stage_forward_s"][r] + s["stage_backward_s"][r] for s in steps) for r in range(p)]
    per_step = [
        1 - sum(s["stage_forward_s"][r] + s["stage_backward_s"][r] for r in range(p)) / (p * s["pipeline_s"])
        for s in steps
    ]
    return {
        "measured": 1 - sum(compute) / (p * total("pipeline_s")),
        "step_median": statistics.median(per_step),
        "rank0": total("bubble_s") / total("pipeline_s"),
        "sim": 1 - sum(compute) / (p * total("pipeline_sim_s")),
        "imbalance": compute[-1] / compute[0],
        "theory": (p - 1) / (v * m + p - 1),
    }


def main():
    print("| m (x v) | theory | measured, all ranks | measured / theory | median step | median step / theory | rank 0 | simulated with measured stage times | last / first stage compute |")
    print("|---|---|---|---|---|---|---|---|---|")
    for arg in sys.argv[1:]:
        key, paths = arg.split("=", 1)
        m, _, v = key.partition("x")
        runs = [one(path, int(m), int(v or 1)) for path in paths.split(",")]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(
            f"| {key} | {med['theory']:.1%} | {med['measured']:.1%} | {med['measured'] / med['theory']:.2f} | "
            f"{med['step_median']:.1%} | {med['step_median'] / med['theory']:.2f} | "
            f"{med['rank0']:.1%} | {med['sim']:.1%} | {med['imbalance']:.3f} |"
        )


if __name__ == "__main__":
    main()
