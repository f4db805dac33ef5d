#!/usr/bin/env bash
# GPU compile checks for CI (no GPU needed): installs NVRTC (PyPI wheel, into a venv) and ROCm's
# hipcc (Debian), then runs tests/gpu_compile.rs with both compilers REQUIRED, so a missing
# compiler fails the job instead of skipping, and builds the library with `--features hip` (the HIP
# arm against those packages). Call from .ci/run after the main test suite:
#   .ci/gpu-compile.sh
# Measured on the dev machine (Debian 12, 2 cores): pip install ~36 s, 217 MB in the venv;
# apt-get install ~60 s, 69 MB download, 368 MB installed (29 packages).
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
PATH="$HOME/.cargo/bin:$PATH" cargo test --release --test gpu_compile -- --test-threads=1
# The HIP arm itself (hip-sys bindings to libamdhip64 from Debian's ROCm packages) must build too.
PATH="$HOME/.cargo/bin:$PATH" cargo build --release --features hip --lib
