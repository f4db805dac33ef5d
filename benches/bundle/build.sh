#!/usr/bin/env bash
# Builds the self-contained GPU bundle (`make gpu-bundle`): one directory to copy onto a GPU node
# that has an NVIDIA driver and CUDA 12 or 13 user-space libraries but no Rust, no MPI, no HDF5,
# no libfabric and no OpenBLAS, and to run there with one command (`bash run.sh`).
#
#   bash benches/bundle/build.sh [DIR]      (default DIR: target/gpu-bundle/meshtrain-gpu)
#
# What goes in, all from this machine's build and its Debian packages:
# - stripped release `meshtrain` and the stripped GPU test programs (`cargo test --no-run`);
# - every shared library they load except glibc and the NVIDIA driver (ldd closure), OpenMPI's
#   mpirun/orted with the MCA plugins a single node needs, PMIx and both help-file trees,
#   relocated at run time through OPAL_* / PMIX_* variables (env.sh);
# - the kernel sources, jobs/d12_gpu.toml and jobs/demo.toml, benches/torch_gpt2.py, run.sh
#   and env.sh.
# Binaries and libraries travel as one gzip'd tar (payload.tar.gz; OpenBLAS alone is 36 MiB
# unpacked) that run.sh unpacks next to itself on its first run; gzip and tar are on every Linux.
# The directory must stay under BUNDLE_LIMIT_MIB (48): the build fails past it.
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
dest=${1:-target/gpu-bundle/meshtrain-gpu}
limit_mib=${BUNDLE_LIMIT_MIB:-48}
export HDF5_DIR=${HDF5_DIR:-/usr/lib/x86_64-linux-gnu/hdf5/serial}
export PATH="$HOME/.cargo/bin:$PATH"
# The test programs the bundle runs (tests/<name>.rs).
tests=(gpu_compile gpu_kernels gpu_model gpu_collectives device_oneshot gpu_layouts)
mpi_libdir=/usr/lib/x86_64-linux-gnu/openmpi/lib/openmpi3
pmix_root=/usr/lib/x86_64-linux-gnu/pmix2

die() { echo "gpu-bundle: $*" >&2; exit 1; }
for tool in strip objdump ldd gzip tar python3 cargo; do
  command -v "$tool" >/dev/null || die "needs \`$tool\` on PATH"
done
for path in /usr/bin/orterun /usr/bin/orted "$mpi_libdir" "$pmix_root/lib/libpmix.so.2" /usr/share/openmpi; do
  [ -e "$path" ] || die "$path is missing: install openmpi-bin and libopenmpi-dev (make deps)"
done

echo "gpu-bundle: building release meshtrain and the test programs"
cargo build --release --bins
test_args=()
for t in "${tests[@]}"; do test_args+=(--test "$t"); done
json=$(mktemp)
trap 'rm -f "$json"' EXIT
cargo test --release --no-run --message-format=json "${test_args[@]}" > "$json"

stage=$(mktemp -d "${TMPDIR:-/tmp}/mt-bundle.XXXXXX")
trap 'rm -f "$json"; rm -rf "$stage"' EXIT
root=$stage/root
mkdir -p "$root/bin/tests" "$root/lib/openmpi3" "$root/lib/pmix" "$root/share/openmpi" "$root/share/pmix" "$root/etc"

strip -o "$root/bin/meshtrain" target/release/meshtrain
python3 - "$json" "${tests[@]}" > "$stage/tests.txt" <<'PY'
import json, sys
want = set(sys.argv[2:])
found = {}
for line in open(sys.argv[1]):
    msg = json.loads(line)
    t = msg.get("target", {})
    if msg.get("reason") == "compiler-artifact" and "test" in t.get("kind", []) and t.get("name") in want and msg.get("executable"):
        found[t["name"]] = msg["executable"]
missing = want - set(found)
if missing:
    sys.exit(f"gpu-bundle: cargo built no test program for {sorted(missing)}")
for name in sorted(found):
    print(name, found[name])
PY
while read -r name exe; do
  strip -o "$root/bin/tests/$name" "$exe"
done < "$stage/tests.txt"

# OpenMPI 4.1: mpirun (orterun), orted, ompi_info (to inspect the relocation), the MCA plugins a
# single node needs (no UCX, OpenSHMEM, MPI-IO, monitoring, verbs or libfabric components: the
# ranks bootstrap with MPI and talk over meshtrain's own transports), and the help texts.
cp /usr/bin/orterun "$root/bin/mpirun"
cp /usr/bin/orted "$root/bin/orted"
[ -x /usr/bin/ompi_info ] && cp /usr/bin/ompi_info "$root/bin/ompi_info"
for plugin in "$mpi_libdir"/mca_*.so; do
  base=$(basename "$plugin" .so)
  case "$base" in
    *ucx*|*monitoring*|*openib*|*_ofi|mca_atomic_*|mca_memheap_*|mca_scoll_*|mca_spml_*|mca_sshmem_*|mca_io_*|mca_fcoll_*|mca_fbtl_*|mca_fs_*|mca_sharedfp_*|mca_vprotocol_*) continue ;;
  esac
  cp "$plugin" "$root/lib/openmpi3/"
done
cp /usr/share/openmpi/help-*.txt "$root/share/openmpi/"
cp "$pmix_root"/lib/pmix/*.so "$root/lib/pmix/"
cp "$pmix_root"/share/pmix/help-*.txt "$root/share/pmix/"
cp "$repo/benches/bundle/openmpi-mca-params.conf" "$root/etc/"
: > "$root/etc/openmpi-default-hostfile"

# The shared libraries of every ELF file above, transitively, except glibc's and the driver's.
is_system_lib() {
  case "$1" in
    linux-vdso.so.*|ld-linux*.so.*|libc.so.*|libm.so.*|libmvec.so.*|libpthread.so.*|libdl.so.*|librt.so.*|libresolv.so.*|libutil.so.*|libanl.so.*|libnss_*|libthread_db.so.*|libBrokenLocale.so.*|libcuda.so*|libnvidia-*) return 0 ;;
  esac
  return 1
}
elves=$(find "$root/bin" "$root/lib" -type f \( -perm -u+x -o -name '*.so' \))
missing=""
for elf in $elves; do
  while read -r name arrow path _; do
    [ "$arrow" = "=>" ] || continue
    is_system_lib "$name" && continue
    if [ "$path" = "not" ]; then missing="$missing $name (needed by ${elf#"$root/"})"; continue; fi
    [ -e "$root/lib/$name" ] || cp -L "$path" "$root/lib/$name"
  done < <(ldd "$elf" 2>/dev/null)
done
[ -z "$missing" ] || die "libraries not found on this machine:$missing"
strip --strip-unneeded "$root"/lib/*.so* "$root"/lib/openmpi3/*.so "$root"/lib/pmix/*.so 2>/dev/null || true

# The newest glibc symbol version anything here needs: the node's glibc must be at least that.
glibc_needed=$(find "$root" -type f \( -name '*.so*' -o -perm -u+x \) -exec objdump -T {} + 2>/dev/null |
  grep -o 'GLIBC_2\.[0-9]*' | sort -t. -k2 -n -u | tail -1)
[ -n "$glibc_needed" ] || die "objdump found no glibc symbol versions (binutils missing?)"

# What was bundled, with sizes.
{
  echo "meshtrain GPU bundle, built $(date -u +%Y-%m-%dT%H:%M:%SZ) from $(git -C "$repo" describe --always --dirty 2>/dev/null || echo '?')"
  echo "builder: $(. /etc/os-release && echo "$PRETTY_NAME"), glibc $(ldd --version | head -1 | awk '{print $NF}'); needs glibc >= ${glibc_needed#GLIBC_}"
  (cd "$root" && find . -type f -printf '%s %P\n' | sort -k2)
} > "$stage/MANIFEST.txt"

rm -rf "$dest"
mkdir -p "$dest"
tar -C "$root" -cf - . | gzip -9 > "$dest/payload.tar.gz"
cp "$stage/MANIFEST.txt" "$dest/"
cp "$repo/benches/bundle/run.sh" "$repo/benches/bundle/env.sh" "$dest/"
chmod +x "$dest/run.sh"
mkdir -p "$dest/kernels" "$dest/jobs" "$dest/benches"
cp "$repo"/kernels/* "$dest/kernels/"
cp "$repo/jobs/d12_gpu.toml" "$repo/jobs/demo.toml" "$dest/jobs/"
cp "$repo/benches/torch_gpt2.py" "$dest/benches/"
(cd "$dest" && sha256sum payload.tar.gz > payload.sha256)
echo "${glibc_needed#GLIBC_}" > "$dest/GLIBC_REQUIRED"

unpacked=$(du -sb "$root" | cut -f1)
total=$(du -sb "$dest" | cut -f1)
echo "gpu-bundle: $dest: $((total / 1024)) KiB ($((unpacked / 1048576)) MiB unpacked, $(find "$root/lib" -name '*.so*' | wc -l) libraries)"
[ "$total" -le $((limit_mib * 1048576)) ] || die "$dest is $((total / 1048576)) MiB, over the $limit_mib MiB limit"
