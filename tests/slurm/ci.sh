#!/usr/bin/env bash
# Slurm checks run by .ci/run (root, after `cargo build --release`): a throw-away cluster of two
# slurmd "nodes" on this machine (tests/slurm/start.sh); a strong and a weak sweep of the tiny model
# over 1, 2 and 4 ranks as srun steps of one allocation (2 ranks per node), whose CSV and plots are
# checked; then the SIGUSR1 requeue test (tests/slurm/requeue.sh). The cluster is stopped on exit.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=$PWD/target/release/meshtrain
WORK=$(mktemp -d /tmp/meshtrain-slurm-ci.XXXXXX)
trap 'tests/slurm/stop.sh' EXIT
cluster_env=$(tests/slurm/start.sh | tail -n 1)   # exits here if the cluster does not come up
eval "$cluster_env"
export SLURM_CONF OMPI_MCA_btl

cat > "$WORK/tiny.toml" <<JOB
device = "cpu"
[model]
size = "tiny"
[data]
source = "synthetic"
seed = 3
[train]
steps = 12
micro_batch = 4
seq_len = 64
log_every = 100
JOB
sweep="$BIN sweep run $WORK/tiny.toml --ranks 1,2,4 --ranks-per-node 2 --out $WORK/sweep"
salloc -N 2 --ntasks-per-node=2 bash -c "$sweep --mode strong && $sweep --mode weak" > "$WORK/sweep.log" 2>&1 \
  || { tail -n 40 "$WORK/sweep.log"; exit 1; }
csv=$WORK/sweep/sweep.csv
cat "$csv"
python3 - "$WORK/sweep" <<'PY'
import csv, json, struct, sys, zlib, xml.dom.minidom, pathlib
d = pathlib.Path(sys.argv[1])
rows = list(csv.DictReader(open(d / "sweep.csv")))
got = [(r["mode"], int(r["nodes"]), int(r["ranks"])) for r in rows]
want = [(m, n, r) for m in ("strong", "weak") for (n, r) in ((1, 1), (1, 2), (2, 4))]
assert got == want, got
for r in rows:
    for k in ("step_median_s", "tokens_per_s", "tokens_per_s_per_rank", "tflops_per_rank", "compute_s", "efficiency"):
        assert float(r[k]) > 0, (r["mode"], r["ranks"], k, r[k])
    assert float(r["step_p10_s"]) <= float(r["step_median_s"]) <= float(r["step_p90_s"]), r
    assert r["job_id"] and r["nodelist"] == "n[1-2]", r
strong = [r for r in rows if r["mode"] == "strong"]
assert len({r["tokens_per_step"] for r in strong}) == 1, "strong scaling keeps the global batch"
weak = [r for r in rows if r["mode"] == "weak"]
assert [int(r["tokens_per_step"]) for r in weak] == [256, 512, 1024], "weak scaling grows it with the ranks"
for group in (strong, weak):
    assert float(group[0]["efficiency"]) == 1.0
side = json.load(open(d / "sweep.json"))
assert len(side["points"]) == 6 and side["mpi_library"] and side["job_ids"], side.keys()
for f in sorted((d / "plots").iterdir()):
    b = f.read_bytes()
    if f.suffix == ".png":
        assert b[:8] == b"\x89PNG\r\n\x1a\n", f
        w, h = struct.unpack(">II", b[16:24])
        assert (w, h) == (900, 540), (f, w, h)
        pos, idat = 8, b""
        while pos < len(b):
            n, kind = struct.unpack(">I", b[pos:pos + 4])[0], b[pos + 4:pos + 8]
            idat += b[pos + 8:pos + 8 + n] if kind == b"IDAT" else b""
            pos += 12 + n
        assert len(zlib.decompress(idat)) == h * (1 + 3 * w), f   # RGB rows, each with a filter byte
    else:
        assert xml.dom.minidom.parseString(b).documentElement.tagName == "svg", f
print("slurm sweep: OK,", len(list((d / "plots").iterdir())), "plot files decoded")
PY
# A rank that dies before MPI_Init ends its whole step at once (srun --kill-on-bad-exit in
# slurm/requeue.sh), long before the start-up deadline (600 s here) would.
cat > "$WORK/dies.sh" <<'SH'
#!/bin/sh
[ "$SLURM_PROCID" = 1 ] && kill -9 $$
exec "$REAL_BIN" "$@"
SH
chmod +x "$WORK/dies.sh"
started=$SECONDS
dies=$(REAL_BIN=$BIN BIN=$WORK/dies.sh JOB=$WORK/tiny.toml STEPS=12 DP=2 OUT=$WORK/dies MESHTRAIN_BOOTSTRAP_TIMEOUT=600 \
  sbatch --parsable -J dies -N 2 --ntasks-per-node=1 -o "$WORK/dies.out" slurm/train-cpu.sbatch)
while [ -n "$(squeue -h -j "$dies" -o %T 2>/dev/null)" ]; do
  if (( SECONDS - started > 90 )); then
    scancel "$dies"; cat "$WORK/dies.out"; echo "slurm: a step with a dead rank was not ended in 90 s" >&2; exit 1
  fi
  sleep 1
done
grep -q "requeue: srun failed" "$WORK/dies.out" || { cat "$WORK/dies.out"; echo "slurm: no srun failure reported" >&2; exit 1; }
echo "slurm: a rank dead at start-up ended its step in $((SECONDS - started)) s"

BIN=$BIN tests/slurm/requeue.sh
