#!/usr/bin/env bash
# All-reduce against parameter servers across two "nodes" of the network-namespace testbed
# (tests/testbed/netns.sh): DP 4 with 2 workers per node over TCP between the nodes, the server
# (the 5th rank) on node 1, for each data-cable limit in RATES ("none" = the unshaped veth, else a
# token-bucket limit on node 2's cable in both directions: that cable is the one bottleneck link).
# ROUNDS alternating rounds of all-reduce, PS sync and PS async (staleness 1); prints the median
# over rounds of each run's median step time (steps after the first two) and tokens/s.
# Usage (root, after a release build): benches/ps_two_nodes.sh [ROUNDS] [OUT_DIR]
#   RATES="none 1gbit 200mbit" by default.    (benches/README.md, "Parameter servers")
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
out=$(readlink -f "${2:-out/ps_two_nodes}")
bin=$(readlink -f "${MESHTRAIN:-target/release/meshtrain}")
netns=tests/testbed/netns.sh
mkdir -p "$out"
trap 'bash $netns down' EXIT INT TERM
bash $netns up 2
run() { # name np sets...
  local name=$1 np=$2
  shift 2
  bash $netns mpirun "$np" "$bin" train "$PWD/benches/ps_dp4.toml" --metrics "$out/$name.jsonl" "$@" \
    >"$out/$name.log" 2>&1 || { echo "$name failed: see $out/$name.log" >&2; exit 1; }
}
for rate in ${RATES:-none 1gbit 200mbit}; do
  [ "$rate" = none ] && bash $netns shape 2 off || bash $netns shape 2 "$rate"
  for r in $(seq 1 "$rounds"); do
    run "${rate}_allreduce_$r" 4
    run "${rate}_ps_sync_$r" 5 --set parallel.dp_sync=ps
    run "${rate}_ps_async1_$r" 5 --set parallel.dp_sync=ps --set ps.mode=async --set ps.staleness=1
  done
done
python3 - "$out" "$rounds" ${RATES:-none 1gbit 200mbit} <<'PY'
import json, statistics, sys
out, rounds, rates = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
for rate in rates:
    for name in ["allreduce", "ps_sync", "ps_async1"]:
        steps, toks = [], []
        for r in range(1, rounds + 1):
            rows = [json.loads(l) for l in open(f"{out}/{rate}_{name}_{r}.jsonl")]
            rows = [x for x in rows if "step_s" in x][2:]
            steps.append(statistics.median(x["step_s"] for x in rows))
            toks.append(statistics.median(x["tokens_per_s"] for x in rows))
        print(f"{rate:8s} {name:10s} step {statistics.median(steps)*1e3:7.1f} ms "
              f"(runs {min(steps)*1e3:.1f}-{max(steps)*1e3:.1f})  tokens/s {statistics.median(toks):8.0f}")
PY
