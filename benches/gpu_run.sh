#!/usr/bin/env bash
# Everything GPU-side in one command, for a machine with an NVIDIA GPU, driver, CUDA 12 libraries
# (NVRTC, cuBLAS) and optionally PyTorch: builds, runs every GPU test, then the GPU benchmarks,
# and leaves logs and results in OUT (default: $OUT, else out/gpu):
#   bash benches/gpu_run.sh [OUT]
# 1. kernels, cuBLAS products and the device model against the CPU (tests/gpu_kernels.rs,
#    tests/gpu_model.rs: the `gpu::` instances; their `emu::` twins run in CI), with the
#    reduction-bandwidth report (reduce kernels vs a D2D copy);
# 2. device collectives among 2, 3 and 4 ranks sharing the GPU (tests/gpu_collectives.rs), and
#    the device model's layouts (TP2 + SP, PP2, DP2 at ZeRO 0 and 3) on 2 ranks sharing it
#    against the CPU arm (tests/gpu_layouts.rs); the stream-ordered path (tests/device_oneshot.rs)
#    and its latency against the IPC and staged paths (`meshtrain bench device`);
# 3. d12 bf16 training at T=1024 (jobs/d12_gpu.toml) and the PyTorch eager baseline on the same
#    model (benches/torch_gpt2.py): tokens/s, TFLOP/s and MFU of both in summary.txt.
# Steps run even when an earlier one fails; each one's exit code is in summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-out/gpu}}
mkdir -p "$out"
export HDF5_DIR=${HDF5_DIR:-/usr/lib/x86_64-linux-gnu/hdf5/serial}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
summary="$out/summary.txt"
: > "$summary"
step() { # name, command...
  local name=$1; shift
  local t0=$SECONDS
  "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc ($((SECONDS - t0)) s)" | tee -a "$summary"
}
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
step build cargo build --release --tests --bins
step gpu_tests cargo test --release --test gpu_kernels --test gpu_model -- --ignored gpu --test-threads=1 --nocapture
step gpu_collectives cargo test --release --test gpu_collectives -- --ignored gpu_coll_ --test-threads=1 --nocapture
step gpu_oneshot cargo test --release --test device_oneshot -- --ignored gpu_coll_ --test-threads=1 --nocapture
step bench_device mpirun --oversubscribe --bind-to none -np 2 target/release/meshtrain bench device --device cuda --min 4 --max 4M --factor 4 --iters 50
step gpu_layouts cargo test --release --test gpu_layouts -- --ignored gpu --test-threads=1 --nocapture
step meshtrain_d12 target/release/meshtrain train jobs/d12_gpu.toml --metrics "$out/meshtrain_d12.jsonl"
step torch_d12 python3 benches/torch_gpt2.py --size d12 --batch 8 --seq-len 1024 --steps 30 --peak-tflops 989
{
  echo "--- reduction bandwidth (gpu_tests.log)"
  grep -i "GB/s" "$out/gpu_tests.log" | tail -20
  echo "--- device all-reduce per path, 2 ranks sharing the GPU (bench_device.log)"
  grep -E "^ *[0-9]+ |bytes" "$out/bench_device.log"
  echo "--- meshtrain d12 bf16 (mean of the last 20 steps)"
  python3 - "$out/meshtrain_d12.jsonl" <<'PY'
import json, sys
steps = [json.loads(l) for l in open(sys.argv[1])][-20:]
mean = lambda k: sum(s.get(k) or 0 for s in steps) / max(len(steps), 1)
print(f"tokens/s {mean('tokens_per_s'):.0f}  TFLOP/s {mean('model_tflops'):.1f}  MFU {mean('mfu'):.1%}")
PY
  echo "--- PyTorch eager d12 bf16"
  tail -1 "$out/torch_d12.log"
} >> "$summary" 2>&1
cat "$summary"
