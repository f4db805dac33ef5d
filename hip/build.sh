#!/usr/bin/env bash
# Compiles each kernels/*.cu into a raw AMD GPU code object for inspection by hand (the runtime
# compiles the same sources itself at open time, see src/device/hipcc.rs) and lists its kernels
# and their register / scratch use.
#   hip/build.sh [arch] [out_dir]      (defaults: gfx90a, target/hip)
# Needs ROCm's hipcc (Debian: apt-get install libamdhip64-dev hipcc) and llvm-readelf.
set -euo pipefail
cd "$(dirname "$0")/.."
arch=${1:-gfx90a}
out=${2:-target/hip}
mkdir -p "$out"
for src in kernels/*.cu; do
  co="$out/$(basename "$src" .cu).$arch.co"
  hipcc -x hip --offload-arch="$arch" --genco --no-gpu-bundle-output -O3 -std=c++17 -Ikernels -o "$co" "$src"
  echo "== $co"
  llvm-readelf --notes "$co" | grep -E '^\s+\.(name|vgpr_count|sgpr_count|private_segment_fixed_size|group_segment_fixed_size):' \
    | paste - - - - - || true
done
