#!/usr/bin/env bash
# meshtrain on one GPU node, from the bundle alone (no Rust, MPI, HDF5 or BLAS needed there):
#
#   bash run.sh [STEP|GROUP ...]        (default: all; OUT=./out, RUN_BUDGET_S=460)
#
# Steps, most important and quickest first; each is time-boxed with `timeout`, and none starts
# once the run's budget (RUN_BUDGET_S seconds; with the set-up and a last step's 10 s to
# die, the run ends within 8 minutes) is spent:
#   cpu group:  mpi_selftest     2 ranks, CPU arm, through the bundled mpirun
#               cpu_train        the demo job on 8 CPU ranks (TP2 x PP2 x DP2, OpenBLAS), an
#                                HDF5 checkpoint and its verification
#               compile_check    every kernel through the NVRTC found (sm_90 PTX and CUBIN);
#                                without NVRTC only the no-GPU checks of tests/gpu_compile.rs
#   gpu group:  gpu_kernels      every kernel and the device model against the CPU arm
#               gpu_collectives  device collectives, 2, 3 and 4 ranks sharing the GPU
#               gpu_oneshot      the stream-ordered path on 2, 3 and 4 ranks
#               bench_device     all-reduce latency per path, 2 ranks sharing the GPU
#               gpu_layouts      TP2 + SP, PP2, DP2 at ZeRO 0 and 3 against the CPU arm
#               meshtrain_d12    d12 bf16 training at T=1024 (tokens/s, TFLOP/s, MFU)
#               torch_d12        the PyTorch eager baseline on the same model
#   cpu group:  cpu_collectives  device selftests on the CPU arm across processes
#   emu group:  emu_kernels, emu_collectives, emu_layouts (the kernels on the host via g++)
# Without a GPU the gpu steps say "no GPU" and are skipped; without g++ the emu steps say so.
# Every step's log is OUT/<step>.log; OUT/summary.txt gets one line per step and the numbers.
# Exit status: 0 when no step failed (skipped steps are not failures), 1 otherwise.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-./out}
mkdir -p "$out" && out=$(cd "$out" && pwd) || { echo "run.sh: cannot create OUT=$out" >&2; exit 2; }
summary=$out/summary.txt
budget=${RUN_BUDGET_S:-460}
start=$SECONDS
failed=0

all_steps=(mpi_selftest cpu_train compile_check gpu_kernels gpu_collectives gpu_oneshot bench_device gpu_layouts
  meshtrain_d12 torch_d12 cpu_collectives emu_kernels emu_collectives emu_layouts)
declare -A group=([mpi_selftest]=cpu [cpu_train]=cpu [compile_check]=cpu [cpu_collectives]=cpu
  [gpu_kernels]=gpu [gpu_collectives]=gpu [gpu_oneshot]=gpu [bench_device]=gpu [gpu_layouts]=gpu
  [meshtrain_d12]=gpu [torch_d12]=gpu [emu_kernels]=emu [emu_collectives]=emu [emu_layouts]=emu)
# Seconds each step may take at most (less when the budget is nearly spent).
declare -A limit=([mpi_selftest]=30 [cpu_train]=60 [compile_check]=90 [gpu_kernels]=120 [gpu_collectives]=90
  [gpu_oneshot]=60 [bench_device]=45 [gpu_layouts]=120 [meshtrain_d12]=150 [torch_d12]=120
  [cpu_collectives]=90 [emu_kernels]=240 [emu_collectives]=120 [emu_layouts]=180)

selected=()
for arg in "${@:-all}"; do
  case "$arg" in
    all) selected+=("${all_steps[@]}") ;;
    cpu|gpu|emu) for s in "${all_steps[@]}"; do [ "${group[$s]}" = "$arg" ] && selected+=("$s"); done ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) [ -n "${group[$arg]:-}" ] || { echo "run.sh: unknown step or group '$arg' (see run.sh --help)" >&2; exit 2; }
       selected+=("$arg") ;;
  esac
done

note() { echo "$*" | tee -a "$summary"; }

: > "$summary"
# shellcheck source=env.sh
source "$here/env.sh"
if ! mt_setup; then
  note "setup: FAIL: $MT_ENV_ERROR"
  exit 1
fi
note "meshtrain GPU bundle: $(head -1 "$here/MANIFEST.txt" 2>/dev/null)"
note "host: $(uname -srm), $(nproc) cores; unpacked and set up in $((SECONDS - start)) s"
printf '%s' "$MT_CUDA_LOG" > "$out/cuda-libs.txt"
sed 's/^/cuda libs: /' "$out/cuda-libs.txt" | tee -a "$summary"

gpu=""
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi > "$out/nvidia-smi.txt" 2>&1; then
  gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)
fi
if [ -z "$gpu" ] && ls /dev/nvidia[0-9]* >/dev/null 2>&1; then gpu="NVIDIA device files present (no nvidia-smi)"; fi
note "gpu: ${gpu:-none}"
cxx=${MESHTRAIN_EMU_CXX:-g++}
have_cxx=""; command -v "$cxx" >/dev/null 2>&1 && have_cxx=1

# A bundled test program with a filter; a filter that matches no test is a failure, and so is,
# in a GPU step (MT_FORBID_SKIPS=1), a test that skips itself (e.g. for want of libcuda).
t() {
  local seen rc
  seen=$(mktemp)
  "$MT_ROOT/bin/tests/$1" "${@:2}" --test-threads=1 --nocapture 2>&1 | tee "$seen"
  rc=${PIPESTATUS[0]}
  if [ "$rc" = 0 ] && grep -q "^running 0 tests" "$seen"; then
    echo "run.sh: no test of $1 matches: ${*:2}"
    rc=1
  elif [ "$rc" = 0 ] && [ "${MT_FORBID_SKIPS:-}" = 1 ] && grep -qE '(^|\.\.\. )SKIP' "$seen"; then
    echo "run.sh: a test of $1 skipped itself in a GPU step:"
    grep -E '(^|\.\.\. )SKIP' "$seen"
    rc=1
  fi
  rm -f "$seen"
  return "$rc"
}
mpirun_np() { mpirun --oversubscribe --bind-to none -np "$1" "${@:2}"; }

run_step() { # name
  local name=$1 why="" left rc t0 cap
  case "${group[$name]}" in
    gpu) [ -n "$gpu" ] || why="no GPU" ;;
    emu) [ -n "$have_cxx" ] || why="no $cxx: the emu arm compiles the kernels with the host's C++ compiler (set MESHTRAIN_EMU_CXX or install g++)" ;;
  esac
  if [ "$name" = torch_d12 ] && [ -z "$why" ] && ! env LD_LIBRARY_PATH="$MT_ORIG_LD_LIBRARY_PATH" python3 -c 'import torch' >/dev/null 2>&1; then
    why="no python3 with torch"
  fi
  left=$((budget - (SECONDS - start)))
  [ -z "$why" ] && [ "$left" -lt 10 ] && why="out of time (RUN_BUDGET_S=$budget)"
  if [ -n "$why" ]; then
    note "$name: SKIP ($why)"
    return
  fi
  cap=${limit[$name]}
  [ "$cap" -gt "$left" ] && cap=$left
  t0=$SECONDS
  MT_FORBID_SKIPS=$([ "${group[$name]}" = gpu ] && echo 1) timeout --kill-after=10 "$cap" bash -c "$(declare -f t mpirun_np step_$name); step_$name" > "$out/$name.log" 2>&1
  rc=$?
  local verdict=PASS
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then verdict="FAIL (timed out after $cap s)"; failed=1
  elif [ "$rc" -ne 0 ]; then verdict="FAIL (rc=$rc, see $name.log)"; failed=1; fi
  note "$name: $verdict ($((SECONDS - t0)) s)"
}

# The steps (each runs in its own bash under `timeout`, with env.sh's environment).
step_mpi_selftest() { mpirun_np 2 meshtrain selftest; }
step_cpu_train() {
  rm -rf "$OUT_DIR/cpu_ckpt"
  mpirun_np 8 meshtrain train "$MT_BUNDLE/jobs/demo.toml" --set train.steps=20 --set train.eval_every=10 \
    --set checkpoint.dir="$OUT_DIR/cpu_ckpt" --set checkpoint.every=20 &&
    meshtrain inspect "$OUT_DIR/cpu_ckpt/step_00000020" --verify
}
step_compile_check() {
  if [ -e "$MT_ROOT/cuda-links/libnvrtc.so" ]; then export MESHTRAIN_REQUIRE_NVRTC=1; fi
  t gpu_compile --skip hipcc
}
step_gpu_kernels() { t gpu_kernels --ignored gpu && t gpu_model --ignored gpu; }
step_gpu_collectives() { t gpu_collectives --ignored gpu_coll_; }
step_gpu_oneshot() { t device_oneshot --ignored gpu_coll_; }
step_bench_device() { mpirun_np 2 meshtrain bench device --device cuda --min 4 --max 4M --factor 4 --iters 50; }
step_gpu_layouts() { t gpu_layouts --ignored gpu; }
step_meshtrain_d12() { meshtrain train "$MT_BUNDLE/jobs/d12_gpu.toml" --metrics "$OUT_DIR/meshtrain_d12.jsonl"; }
step_torch_d12() {
  # PyTorch runs with the caller's own library path, not the bundle's.
  env LD_LIBRARY_PATH="$MT_ORIG_LD_LIBRARY_PATH" python3 "$MT_BUNDLE/benches/torch_gpt2.py" \
    --size d12 --batch 8 --seq-len 1024 --steps 30 --peak-tflops 989
}
step_cpu_collectives() { t gpu_collectives cpu; }
step_emu_kernels() { t gpu_kernels emu:: && t gpu_model emu::; }
step_emu_collectives() { t gpu_collectives emu_arm && t device_oneshot --skip gpu_coll_; }
step_emu_layouts() { t gpu_layouts emu::; }

export OUT_DIR=$out MT_BUNDLE MT_ROOT MT_ORIG_LD_LIBRARY_PATH
for s in "${selected[@]}"; do run_step "$s"; done

# The numbers, from the logs of the steps that ran.
{
  if [ -s "$out/gpu_kernels.log" ]; then
    echo "--- reduction bandwidth (gpu_kernels.log)"
    grep -i "GB/s" "$out/gpu_kernels.log" | tail -20
  fi
  if [ -s "$out/bench_device.log" ]; then
    echo "--- device all-reduce per path, 2 ranks sharing the GPU (bench_device.log)"
    grep -E "^ *[0-9]+ |bytes" "$out/bench_device.log"
  fi
  if [ -s "$out/meshtrain_d12.jsonl" ] && command -v python3 >/dev/null; then
    echo "--- meshtrain d12 bf16 (mean of the last 20 steps)"
    env LD_LIBRARY_PATH="$MT_ORIG_LD_LIBRARY_PATH" python3 - "$out/meshtrain_d12.jsonl" <<'PY'
import json, sys
steps = [json.loads(l) for l in open(sys.argv[1]) if l.strip()][-20:]
mean = lambda k: sum(s.get(k) or 0 for s in steps) / max(len(steps), 1)
print(f"tokens/s {mean('tokens_per_s'):.0f}  TFLOP/s {mean('model_tflops'):.1f}  MFU {mean('mfu'):.1%}")
PY
  fi
  if [ -s "$out/torch_d12.log" ]; then
    echo "--- PyTorch eager d12 bf16"
    tail -1 "$out/torch_d12.log"
  fi
  echo "total: $((SECONDS - start)) s; $([ "$failed" = 0 ] && echo "no step failed" || echo "a step FAILED")"
} >> "$summary" 2>&1
echo "summary: $summary"
exit "$failed"
