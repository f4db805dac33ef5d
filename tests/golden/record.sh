#!/usr/bin/env bash
# Records the golden results of a meshtrain binary: for each layout below, 5 steps of a small GPT
# on the synthetic data, every training loss (as the f64 bits serde_json round-trips) and the
# SHA-256 of every tensor of the final checkpoint (exported to one HDF5 file, read with h5py).
#   bash tests/golden/record.sh BIN OUTDIR        # writes OUTDIR/golden.json and OUTDIR/<case>.h5
# Compare two recordings with tests/golden/compare.py OLD NEW.
set -euo pipefail
bin=$(realpath "$1"); out=$(realpath -m "$2")
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
# Each case: name ranks settings... (`--set` keys of the job file jobs/demo.toml).
cases=(
  "single 1 parallel.tp=1 parallel.pp=1 parallel.dp=1 parallel.zero=0"
  "dp4_z0 4 parallel.tp=1 parallel.pp=1 parallel.dp=4 parallel.zero=0"
  "dp4_z1 4 parallel.tp=1 parallel.pp=1 parallel.dp=4 parallel.zero=1"
  "dp4_z2 4 parallel.tp=1 parallel.pp=1 parallel.dp=4 parallel.zero=2"
  "dp4_z3 4 parallel.tp=1 parallel.pp=1 parallel.dp=4 parallel.zero=3"
  "tp2_sp 2 parallel.tp=2 parallel.pp=1 parallel.dp=1 parallel.zero=0 parallel.sequence_parallel=true"
  "pp2dp2_gpipe 4 parallel.tp=1 parallel.pp=2 parallel.dp=2 parallel.zero=1 parallel.schedule=gpipe parallel.microbatches=4"
  "pp2dp2_1f1b 4 parallel.tp=1 parallel.pp=2 parallel.dp=2 parallel.zero=1 parallel.schedule=1f1b parallel.microbatches=4"
  "pp2dp2_interleaved 4 model.n_layer=4 parallel.tp=1 parallel.pp=2 parallel.dp=2 parallel.zero=1 parallel.schedule=interleaved parallel.virtual_stages=2 parallel.microbatches=4"
  "tp2pp2dp2_z3 8 parallel.tp=2 parallel.pp=2 parallel.dp=2 parallel.zero=3 parallel.schedule=1f1b parallel.microbatches=2"
)
common="train.steps=5 optim.warmup_steps=2 train.eval_every=0 train.log_every=1 checkpoint.every=0"
run_case() { # name precision ranks settings...
  local name=$1 prec=$2 ranks=$3; shift 3
  local dir="$out/run/$name"
  rm -rf "$dir"; mkdir -p "$dir"
  local sets=()
  for kv in $common "$@" "precision=$prec" "checkpoint.dir=$dir/ckpt"; do sets+=(--set "$kv"); done
  if ! mpirun --bind-to none -np "$ranks" "$bin" train "$here/../../jobs/demo.toml" "${sets[@]}" \
       --metrics "$dir/metrics.jsonl" > "$dir/log.txt" 2>&1; then
    echo "$name: FAILED (see $dir/log.txt)"; tail -5 "$dir/log.txt"; return 1
  fi
  "$bin" export "$dir/ckpt" "$out/$name.h5" > /dev/null
  echo "$name: ok"
}
for prec in fp32 bf16; do
  for c in "${cases[@]}"; do
    set -- $c
    name=$1; ranks=$2; shift 2
    run_case "${name}_$prec" "$prec" "$ranks" "$@"
  done
done
"${PYTHON:-/usr/bin/python3}" - "$out" <<'PY'
import glob, hashlib, json, os, struct, sys
import h5py, numpy as np
out = sys.argv[1]
golden = {}
for h5 in sorted(glob.glob(os.path.join(out, "*.h5"))):
    name = os.path.basename(h5)[:-3]
    rows = [json.loads(l) for l in open(os.path.join(out, "run", name, "metrics.jsonl"))]
    losses = [r["loss"] for r in rows if "loss" in r and "step" in r]
    tensors = {}
    with h5py.File(h5, "r") as f:
        def visit(key, obj):
            if isinstance(obj, h5py.Dataset):
                a = np.ascontiguousarray(obj[()], dtype="<f4")
                tensors[key] = hashlib.sha256(a.tobytes()).hexdigest()
        f.visititems(visit)
    golden[name] = {
        "losses": [struct.pack("<d", x).hex() for x in losses],
        "loss_values": losses,
        "tensors": tensors,
    }
json.dump(golden, open(os.path.join(out, "golden.json"), "w"), indent=1, sort_keys=True)
print(f"{len(golden)} cases -> {out}/golden.json")
PY
