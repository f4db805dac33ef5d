#!/usr/bin/env bash
# Checks the CUDA library search of the GPU bundle (benches/bundle/env.sh) on fake library trees:
# LD_LIBRARY_PATH before $CUDA_HOME, CUDA 13 before 12 in one folder, a library newer than the
# driver's CUDA passed over, the CUDA 12 and CUDA 13 wheel layouts found through python3, and
# the bare-name links cudarc opens. Needs only bash and python3; .ci/bundle-chroot.sh runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "bundle-env-test: FAIL: $*" >&2; exit 1; }

mk() { mkdir -p "$(dirname "$1")" && : > "$1"; }
mk "$tmp/ld/libnvrtc.so.12"
for lib in libnvrtc libcublas libcublasLt; do mk "$tmp/cuda/lib64/$lib.so.13"; done
mk "$tmp/cuda/lib64/libcublas.so.12"
for lib in libcublas libcublasLt; do mk "$tmp/wheel12/nvidia/cublas/lib/$lib.so.12"; done
mk "$tmp/wheel12/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"
mk "$tmp/wheel12/nvidia/cuda_nvrtc/lib/libnvrtc-builtins.so.12.9"
for lib in libnvrtc libcublas libcublasLt; do mk "$tmp/wheel13/nvidia/cu13/lib/$lib.so.13"; done
mkdir -p "$tmp/smi12" "$tmp/nosmi"
printf '#!/bin/sh\necho "| NVIDIA-SMI 550.54   Driver Version: 550.54   CUDA Version: 12.4 |"\n' > "$tmp/smi12/nvidia-smi"
chmod +x "$tmp/smi12/nvidia-smi"

# Runs the search in a clean environment: search LD_LIBRARY_PATH CUDA_HOME PYTHONPATH SMI_DIR;
# prints the log and "name -> target" for each link made.
search() {
  env -i HOME="$tmp" PATH="$tmp/$4:/usr/bin:/bin" PYTHONPATH="$3" CUDA_HOME="$2" LD_LIBRARY_PATH="$1" \
    bash -c 'source "$0/benches/bundle/env.sh"; MT_ROOT=$1/root; mkdir -p "$MT_ROOT"
      MT_ORIG_LD_LIBRARY_PATH=$LD_LIBRARY_PATH; mt_find_cuda; printf "%s" "$MT_CUDA_LOG"
      shopt -s nullglob; for l in "$MT_ROOT"/cuda-links/*.so*; do echo "link $(basename "$l") -> $(readlink "$l")"; done
      echo "dirs $MT_CUDA_DIRS"' "$repo" "$tmp"
}
expect() { # output, pattern, what
  grep -qF -- "$2" <<< "$1" || { echo "$1" >&2; fail "$3: expected '$2'"; }
}

out=$(search "$tmp/ld" "$tmp/cuda" "" nosmi)
expect "$out" "link libnvrtc.so -> $tmp/ld/libnvrtc.so.12" "LD_LIBRARY_PATH comes first"
expect "$out" "link libcublas.so -> $tmp/cuda/lib64/libcublas.so.13" "CUDA 13 before 12 in a folder"
expect "$out" "link libcublasLt.so -> $tmp/cuda/lib64/libcublasLt.so.13" "cuBLASLt from CUDA_HOME"
expect "$out" "dirs $tmp/ld:$tmp/cuda/lib64" "the chosen folders go on the library path"

out=$(search "" "$tmp/cuda" "$tmp/wheel12" smi12)
expect "$out" "driver: CUDA 12 (nvidia-smi)" "driver version"
expect "$out" "skipping $tmp/cuda/lib64/libnvrtc.so.13: CUDA 13 is newer than the driver's CUDA 12" "newer than the driver"
expect "$out" "link libcublas.so -> $tmp/cuda/lib64/libcublas.so.12" "CUDA 12 in the same folder"
expect "$out" "link libnvrtc.so -> $tmp/wheel12/nvidia/cuda_nvrtc/lib/libnvrtc.so.12" "CUDA 12 wheel through python3"
expect "$out" "link libnvrtc-builtins.so.12.9 -> $tmp/wheel12/nvidia/cuda_nvrtc/lib/libnvrtc-builtins.so.12.9" "NVRTC builtins"

out=$(search "" "" "$tmp/wheel13" nosmi)
for lib in libnvrtc libcublas libcublasLt; do
  expect "$out" "link $lib.so -> $tmp/wheel13/nvidia/cu13/lib/$lib.so.13" "CUDA 13 wheel layout ($lib)"
done

out=$(search "" "" "" nosmi)
expect "$out" "libnvrtc: not found" "nothing to find"
grep -q "^link " <<< "$out" && fail "links made with no library found"
echo "bundle-env-test: OK"
