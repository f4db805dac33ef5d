#!/usr/bin/env bash
# Proof that the GPU bundle is self-contained: builds it (`make gpu-bundle`), unpacks it in a
# minimal Debian chroot (debootstrap --variant=minbase: no compiler, no -dev package, no MPI, no
# HDF5, no BLAS, no cargo, no Python) and runs its CPU steps there through the bundled mpirun; the
# GPU steps must say "no GPU" and the emu steps "no g++", and run.sh must exit 0. With a fake
# nvidia-smi (a GPU but no driver library) every GPU step must fail naming libcuda. Then g++ alone
# goes into the chroot and the emu steps must pass with it. Root only (chroot, mounts). First,
# .ci/bundle-env-test.sh checks the bundle's CUDA library search on fake library trees.
#   .ci/bundle-chroot.sh     (CHROOT_BASE=dir reuses a debootstrap; MIRROR=url; CHROOT_SUITE=trixie
#                             tries a newer Debian, glibc 2.41)
# Measured on the dev machine (2 cores, tree already built): debootstrap 45 s, bundle 30 s, the
# CPU steps 20 s, the fake-GPU run 5 s, g++ install 40 s, the emu steps 45 s.
set -euo pipefail
cd "$(dirname "$0")/.."
mirror=${MIRROR:-http://deb.debian.org/debian}
suite=${CHROOT_SUITE:-bookworm}
base=${CHROOT_BASE:-/var/tmp/mt-chroot-$suite}
root=$(mktemp -d /var/tmp/mt-chroot.XXXXXX)
bundle=target/gpu-bundle/meshtrain-gpu
mounts=()
cleanup() {
  local i
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do umount -l "${mounts[$i]}" 2>/dev/null || true; done
  rm -rf --one-file-system "$root"
}
trap cleanup EXIT
fail() { echo "bundle-chroot: FAIL: $*" >&2; exit 1; }

# The CUDA library search on fake library trees (no root, no GPU needed).
bash .ci/bundle-env-test.sh

if [ ! -x "$base/bin/bash" ]; then
  command -v debootstrap >/dev/null || apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
  rm -rf "$base"
  debootstrap --variant=minbase "$suite" "$base" "$mirror" > /tmp/mt-debootstrap.log 2>&1 ||
    { tail -20 /tmp/mt-debootstrap.log; fail "debootstrap from $mirror"; }
fi
make gpu-bundle
cp -a "$base/." "$root/"
for tool in gcc g++ cc cargo rustc mpirun orterun python3 nvcc; do
  if chroot "$root" /bin/sh -c "command -v $tool" >/dev/null 2>&1; then fail "the chroot has $tool"; fi
done
mkdir -p "$root/opt/meshtrain-gpu"
cp -a "$bundle/." "$root/opt/meshtrain-gpu/"
for m in proc sys dev dev/shm; do
  mkdir -p "$root/$m"
  case "$m" in
    proc) mount -t proc proc "$root/proc" ;;
    sys) mount -t sysfs sysfs "$root/sys" ;;
    dev) mount --bind /dev "$root/dev" ;;
    dev/shm) mount -t tmpfs -o size=2g tmpfs "$root/dev/shm" ;;
  esac
  mounts+=("$root/$m")
done

# 1. No compiler: the CPU steps pass, the GPU and emu steps are skipped with their reason.
t0=$SECONDS
set +e
chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root OUT=/tmp/out \
  /bin/bash /opt/meshtrain-gpu/run.sh
rc=$?
set -e
summary=$root/tmp/out/summary.txt
echo "bundle-chroot: CPU run took $((SECONDS - t0)) s"
[ "$rc" = 0 ] || { tail -n 40 "$root"/tmp/out/*.log; fail "run.sh exited $rc in the bare chroot"; }
for step in mpi_selftest compile_check cpu_collectives; do
  grep -q "^$step: PASS" "$summary" || fail "$step did not pass"
done
for step in gpu_kernels gpu_collectives gpu_oneshot bench_device gpu_layouts meshtrain_d12 torch_d12; do
  grep -q "^$step: SKIP (no GPU)" "$summary" || fail "$step did not say 'no GPU'"
done
for step in emu_kernels emu_collectives emu_layouts; do
  grep -q "^$step: SKIP (no g++" "$summary" || fail "$step did not say 'no g++'"
done

# 2. A GPU that nvidia-smi reports but no driver library: every GPU step runs its real command
#    line and fails within its time box, naming libcuda (a test that skips itself fails too).
mkdir -p "$root/opt/fake-smi"
printf '#!/bin/sh\ncase "$*" in *query-gpu*) echo "NVIDIA H100 (fake), 580.00, 81559 MiB" ;; *) echo "CUDA Version: 13.0" ;; esac\n' \
  > "$root/opt/fake-smi/nvidia-smi"
chmod +x "$root/opt/fake-smi/nvidia-smi"
set +e
chroot "$root" /usr/bin/env -i PATH=/opt/fake-smi:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root OUT=/tmp/out-fake \
  /bin/bash /opt/meshtrain-gpu/run.sh gpu
rc=$?
set -e
[ "$rc" = 1 ] || fail "run.sh exited $rc with a GPU but no driver library (want 1)"
for step in gpu_kernels gpu_collectives gpu_oneshot bench_device gpu_layouts meshtrain_d12; do
  grep -q "^$step: FAIL (rc=" "$root/tmp/out-fake/summary.txt" || fail "$step did not fail without libcuda"
  grep -q "no CUDA driver (libcuda.so)" "$root/tmp/out-fake/$step.log" || fail "$step.log does not name libcuda"
done
grep -q "^torch_d12: SKIP (no python3 with torch)" "$root/tmp/out-fake/summary.txt" || fail "torch_d12 without python3"

# 3. With g++ (and nothing else) the emu steps run the kernels on the host.
chroot "$root" /bin/sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++ >/dev/null' ||
  fail "installing g++ in the chroot"
t0=$SECONDS
set +e
chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root OUT=/tmp/out-emu RUN_BUDGET_S=900 \
  /bin/bash /opt/meshtrain-gpu/run.sh emu
rc=$?
set -e
echo "bundle-chroot: emu run took $((SECONDS - t0)) s"
[ "$rc" = 0 ] || { tail -n 40 "$root"/tmp/out-emu/*.log; fail "the emu steps failed in the chroot (rc $rc)"; }
for step in emu_kernels emu_collectives emu_layouts; do
  grep -q "^$step: PASS" "$root/tmp/out-emu/summary.txt" || fail "$step did not pass"
done
echo "bundle-chroot: OK ($(du -sh "$bundle" | cut -f1) bundle)"
