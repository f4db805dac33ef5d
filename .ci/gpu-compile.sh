#!/usr/bin/env bash
# GPU compile checks for CI (no GPU needed): installs NVRTC 12 and NVRTC 13 (PyPI wheels
# nvidia-cuda-nvrtc-cu12 and nvidia-cuda-nvrtc, one venv each) and ROCm's hipcc (Debian), then runs
# tests/gpu_compile.rs with the compilers REQUIRED, so a missing compiler fails the job instead of
# skipping: every kernel for sm_90 with NVRTC 12, again with NVRTC 13 found and linked the way the
# GPU bundle's env.sh does it on a node (the wheel's nvidia/cu13/lib, through `python3`), and the
# error for an unlinked libnvrtc.so.13; then builds the library with `--features hip` (the HIP
# arm against those packages). Call from .ci/run after the main test suite:
#   .ci/gpu-compile.sh
# Measured on the dev machine (Debian 12, 2 cores): pip install ~36 s per wheel, 217 MB (12) and
# 160 MB (13) in the venvs; apt-get install ~60 s, 69 MB download, 368 MB installed (29 packages).
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive

venv=${NVRTC_VENV:-/opt/nvrtc-venv}
if [ ! -x "$venv/bin/pip" ]; then
  apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
  python3 -m venv "$venv"
fi
"$venv/bin/pip" install -q nvidia-cuda-nvrtc-cu12
nvrtc_lib=$("$venv/bin/python" -c 'import nvidia.cuda_nvrtc, os; print(os.path.join(nvidia.cuda_nvrtc.__path__[0], "lib"))')
export LD_LIBRARY_PATH="$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

if ! command -v hipcc >/dev/null; then
  apt-get install -y -qq --no-install-recommends libamdhip64-dev hipcc >/dev/null
fi

export MESHTRAIN_REQUIRE_NVRTC=1 MESHTRAIN_REQUIRE_HIPCC=1
MESHTRAIN_EXPECT_NVRTC_MAJOR=12 PATH="$HOME/.cargo/bin:$PATH" cargo test --release --test gpu_compile -- --test-threads=1 --nocapture

# NVRTC 13: the wheel puts libnvrtc.so.13 in nvidia/cu13/lib, a name cudarc's CUDA 12 list lacks.
venv13=${NVRTC13_VENV:-/opt/nvrtc13-venv}
[ -x "$venv13/bin/pip" ] || python3 -m venv "$venv13"
# Pinned to the CUDA 13.0 user space of the GPU nodes the bundle targets (13.5 compiles too).
"$venv13/bin/pip" install -q "${NVRTC13_SPEC:-nvidia-cuda-nvrtc==13.0.*}"
nvrtc13_lib=$("$venv13/bin/python" -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13", "lib"))')
[ -e "$nvrtc13_lib/libnvrtc.so.13" ] || { echo "no libnvrtc.so.13 in $nvrtc13_lib" >&2; exit 1; }
test_bin=$(PATH="$HOME/.cargo/bin:$PATH" cargo test --release --test gpu_compile --no-run --message-format=json |
  python3 -c 'import json, sys; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("executable") and m["target"]["name"] == "gpu_compile"][0])')
# Unlinked, it must not load, and the error must say what to do.
env LD_LIBRARY_PATH="$nvrtc13_lib" MESHTRAIN_NVRTC13_UNLINKED=1 "$test_bin" --test-threads=1 --nocapture an_unlinked_cuda13
# Found by the bundle's env.sh through the venv's python3 (no LD_LIBRARY_PATH), then linked.
links=$(mktemp -d)
nvrtc13_path=$(
  # shellcheck source=../benches/bundle/env.sh
  source benches/bundle/env.sh
  MT_ROOT=$links MT_ORIG_LD_LIBRARY_PATH="" PATH="$venv13/bin:$PATH" LD_LIBRARY_PATH=""
  mt_find_cuda
  printf '%s' "$MT_CUDA_LOG" >&2
  echo "$MT_ROOT/cuda-links:$MT_CUDA_DIRS"
)
env LD_LIBRARY_PATH="$nvrtc13_path" MESHTRAIN_EXPECT_NVRTC_MAJOR=13 "$test_bin" --test-threads=1 --nocapture nvrtc
rm -rf "$links"
# The HIP arm itself (hip-sys bindings to libamdhip64 from Debian's ROCm packages) must build too.
PATH="$HOME/.cargo/bin:$PATH" cargo build --release --features hip --lib
