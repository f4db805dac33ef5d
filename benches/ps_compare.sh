#!/usr/bin/env bash
# Step time and tokens/s of all-reduce, sync PS (1 server rank, and colocated: a server in each
# worker process), async PS (staleness 1) at DP 4, and all-reduce vs sync PS at TP 2 x DP 2, on
# this machine, ROUNDS alternating rounds; prints the median over rounds of each run's median step.
# Usage: benches/ps_compare.sh [ROUNDS] [OUT_DIR]   (benches/README.md, "Parameter servers")
set -euo pipefail
rounds=${1:-3}
out=${2:-out/ps_compare}
bin=${MESHTRAIN:-target/release/meshtrain}
mkdir -p "$out"
run() { # name np sets...
    local name=$1 np=$2; shift 2
    mpirun --oversubscribe --bind-to none -np "$np" "$bin" train benches/ps_dp4.toml --metrics "$out/$name.jsonl" "$@" > "$out/$name.log" 2>&1
}
for r in $(seq 1 "$rounds"); do
    run "allreduce_$r" 4
    run "ps_sync_$r" 5 --set parallel.dp_sync=ps
    run "ps_async1_$r" 5 --set parallel.dp_sync=ps --set ps.mode=async --set ps.staleness=1
    run "ps_colocated_$r" 4 --set parallel.dp_sync=ps --set ps.colocate=true
    run "allreduce_tp2dp2_$r" 4 --set parallel.tp=2 --set parallel.dp=2
    run "ps_sync_tp2dp2_$r" 5 --set parallel.tp=2 --set parallel.dp=2 --set parallel.dp_sync=ps
done
python3 - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
for name in ["allreduce", "ps_sync", "ps_async1", "ps_colocated", "allreduce_tp2dp2", "ps_sync_tp2dp2"]:
    steps, toks = [], []
    for r in range(1, rounds + 1):
        rows = [json.loads(l) for l in open(f"{out}/{name}_{r}.jsonl")][2:]
        steps.append(statistics.median(x["step_s"] for x in rows))
        toks.append(statistics.median(x["tokens_per_s"] for x in rows))
    print(f"{name:16s} step {statistics.median(steps)*1e3:7.1f} ms (runs {min(steps)*1e3:.1f}-{max(steps)*1e3:.1f})  "
          f"tokens/s {statistics.median(toks):8.0f}")
PY
