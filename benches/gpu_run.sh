#!/usr/bin/env bash
# Everything GPU-side in one command, on a machine with an NVIDIA GPU, its driver, CUDA 12 or 13
# libraries (NVRTC, cuBLAS) and optionally PyTorch, and this repository's build tools: builds the
# GPU bundle (`make gpu-bundle`, benches/README.md) and runs its run.sh, which leaves logs and
# results in OUT (default: $OUT, else out/gpu):
#   bash benches/gpu_run.sh [OUT]
# On a GPU node without Rust or MPI, copy the bundle there and run `bash run.sh` instead.
# The steps, each time-boxed, the whole run within 8 minutes (RUN_BUDGET_S):
# 1. the bundled MPI on CPU ranks, a CPU training run with an HDF5 checkpoint, every kernel
#    compiled by the NVRTC found;
# 2. kernels, cuBLAS products and the device model against the CPU (tests/gpu_kernels.rs,
#    tests/gpu_model.rs: the `gpu::` instances; their `emu::` twins run in CI), with the
#    reduction-bandwidth report;
# 3. device collectives among 2, 3 and 4 ranks sharing the GPU (tests/gpu_collectives.rs), the
#    stream-ordered path (tests/device_oneshot.rs) and its latency against the IPC and staged
#    paths (`meshtrain bench device`), the device model's layouts (TP2 + SP, PP2, DP2 at ZeRO 0
#    and 3) on 2 ranks sharing it against the CPU arm (tests/gpu_layouts.rs);
# 4. d12 bf16 training at T=1024 (jobs/d12_gpu.toml) and the PyTorch eager baseline on the same
#    model (benches/torch_gpt2.py): tokens/s, TFLOP/s and MFU of both in summary.txt;
# 5. the CPU-arm and emu tests, if time is left.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-out/gpu}}
bundle=${GPU_BUNDLE:-target/gpu-bundle/meshtrain-gpu}
make gpu-bundle GPU_BUNDLE="$bundle"
OUT="$out" exec bash "$bundle/run.sh"
