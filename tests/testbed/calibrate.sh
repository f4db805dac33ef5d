#!/usr/bin/env bash
# `meshtrain plan calibrate` across two network-namespace nodes (netns.sh): the profile it writes
# must carry a measured inter-node tier, not a copy of the intra-node one. Run as root from the
# repository root after a release build:
#   bash tests/testbed/calibrate.sh [target/release/meshtrain]
# Checks:
#   inter      4 ranks, 2 per node: the profile has `inter` fits of all_reduce for the ring and the
#              direct schedule over 2 ranks (one per node), `intra` fits over 2 ranks, an `[inter]`
#              link different from `[intra]`, `cores_per_node`, and a description that says the
#              inter-node links were measured;
#   uneven     3 ranks on 2 nodes: every rank refuses with an error naming `ranks`, nothing written.
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=$(readlink -f "${1:-target/release/meshtrain}")
NETNS=tests/testbed/netns.sh
OUT=$(mktemp -d)
chmod 755 "$OUT"
trap 'bash $NETNS down; rm -rf "$OUT"' EXIT INT TERM
failed=0

bash $NETNS up 2 || exit 1
timeout 240 bash $NETNS mpirun 4 "$BIN" plan calibrate --out "$OUT/two.toml" --max-bytes 2M >"$OUT/two.log" 2>&1
if python3 - "$OUT/two.toml" <<'EOF'; then echo "ok    inter"; else echo "FAIL  inter"; tail -20 "$OUT/two.log" | sed 's/^/      | /'; failed=1; fi
import sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))
fits = {(f["coll"], f["algo"], f["tier"]): f for f in p["collectives"]}
for algo in ("ring", "direct"):
    assert fits[("all_reduce", algo, "inter")]["ranks"] == 2, fits
    assert fits[("all_reduce", algo, "intra")]["ranks"] == 2, fits
assert (p["inter"]["latency_us"], p["inter"]["nic_bandwidth_gbs"]) != (p["intra"]["latency_us"], p["intra"]["bandwidth_gbs"]), p
assert p["cores_per_node"] > 0 and p["devices_per_node"] == 2, p
assert "inter-node links measured between 2 nodes" in p["description"], p["description"]
EOF

timeout 120 bash $NETNS mpirun 3 "$BIN" plan calibrate --out "$OUT/uneven.toml" >"$OUT/uneven.log" 2>&1
if [ "$(grep -c '`ranks`: calibrate needs the same number of ranks on every node' "$OUT/uneven.log")" -eq 3 ] && [ ! -e "$OUT/uneven.toml" ]; then
  echo "ok    uneven"
else
  echo "FAIL  uneven: expected every rank to name \`ranks\` and no profile"
  tail -20 "$OUT/uneven.log" | sed 's/^/      | /'
  failed=1
fi
exit $failed
