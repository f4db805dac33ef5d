# Environment of the GPU bundle; run.sh sources it, and so can a shell that wants to run the
# bundled programs by hand:   source env.sh && mpirun -np 2 meshtrain selftest --device cuda
#
# 0. Checks that this system's glibc is at least the one the bundle needs (GLIBC_REQUIRED).
# 1. Unpacks payload.tar.gz into root/ beside this file (once per payload: a checksum stamp).
# 2. Points PATH, LD_LIBRARY_PATH and OpenMPI/PMIx at root/ (OPAL_* and PMIX_* name every
#    install directory, so the Debian-built OpenMPI inside runs from wherever the bundle lies).
# 3. Finds the CUDA libraries (NVRTC, cuBLAS, cuBLASLt) of CUDA 12 or 13 wherever they are:
#    LD_LIBRARY_PATH, $CUDA_HOME / $CUDA_PATH, /usr/local/cuda*, the lib/ folders of Python's
#    nvidia-* wheels (CUDA 12: nvidia/cuda_nvrtc/lib, nvidia/cublas/lib; CUDA 13: nvidia/cu13/lib)
#    and the ld.so cache, and links each chosen file under its bare name in root/cuda-links/:
#    meshtrain's cudarc bindings open libnvrtc.so / libcublas.so / libcublasLt.so first (their
#    numbered list stops at .so.12), so the link is what makes a CUDA 13 library load. A library
#    newer than the driver's CUDA version (nvidia-smi) is passed over. MT_CUDA_LOG gets one line
#    per library: the file chosen, its real file and its version.
# Nothing here exits the calling shell: failures set MT_ENV_ERROR and return non-zero.

MT_BUNDLE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MT_ROOT=$MT_BUNDLE/root
MT_ENV_ERROR=""

mt_unpack() {
  local stamp=$MT_ROOT/.payload.sha256
  if [ -f "$stamp" ] && cmp -s "$stamp" "$MT_BUNDLE/payload.sha256"; then
    return 0
  fi
  if ! (cd "$MT_BUNDLE" && sha256sum -c --quiet payload.sha256); then
    MT_ENV_ERROR="payload.tar.gz does not match payload.sha256 (copied incompletely?)"
    return 1
  fi
  rm -rf "$MT_ROOT" && mkdir -p "$MT_ROOT" || { MT_ENV_ERROR="cannot create $MT_ROOT"; return 1; }
  if ! gzip -dc "$MT_BUNDLE/payload.tar.gz" | tar -C "$MT_ROOT" -xf -; then
    MT_ENV_ERROR="unpacking payload.tar.gz into $MT_ROOT failed (disk full?)"
    return 1
  fi
  cp "$MT_BUNDLE/payload.sha256" "$stamp"
}

# The CUDA major version the driver supports ("CUDA Version: 13.0" in nvidia-smi), or empty.
mt_driver_cuda_major() {
  command -v nvidia-smi >/dev/null 2>&1 || return 0
  nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\)\..*/\1/p' | head -1
}

# Directories that may hold CUDA libraries, most preferred first, one per line.
mt_cuda_dirs() {
  local d py
  local IFS=:
  for d in ${MT_ORIG_LD_LIBRARY_PATH:-}; do [ -n "$d" ] && echo "$d"; done
  unset IFS
  for d in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda; do
    [ -n "$d" ] && echo "$d/lib64" && echo "$d/targets/x86_64-linux/lib"
  done
  ls -d /usr/local/cuda-[0-9]*/lib64 2>/dev/null | sort -t- -k2 -V -r
  # Python's nvidia-* wheels: ask each Python for the namespace package, then the usual folders.
  for py in python3 python; do
    command -v "$py" >/dev/null 2>&1 || continue
    "$py" - 2>/dev/null <<'PY'
import glob, os
try:
    import nvidia
    roots = list(nvidia.__path__)
except Exception:
    roots = []
for root in roots:
    for lib in sorted(glob.glob(os.path.join(root, "*", "lib"))):
        print(lib)
PY
  done
  ls -d /usr/local/lib/python3*/*-packages/nvidia/*/lib /usr/lib/python3*/*-packages/nvidia/*/lib \
    "$HOME"/.local/lib/python3*/site-packages/nvidia/*/lib 2>/dev/null
  # The ld.so cache (e.g. Debian's nvidia-cuda-toolkit in /usr/lib/x86_64-linux-gnu).
  ldconfig -p 2>/dev/null | sed -n 's/.*\(libnvrtc\|libcublas\)\.so.* => \(.*\)\/[^/]*$/\2/p'
}

# The version of a library file: its real file name's numbers (libcublas.so.13.0.2.14), else the
# Python wheel's version (nvidia_cuda_nvrtc-13.0.88.dist-info), else the numbered name.
mt_lib_version() {
  local path=$1 real base site meta
  real=$(readlink -f "$path")
  base=$(basename "$real")
  case "$base" in
    *.so.*.*) echo "${base#*.so.}"; return ;;
  esac
  site=$(dirname "$(dirname "$(dirname "$(dirname "$real")")")")
  for meta in "$site"/nvidia_*.dist-info/RECORD; do
    [ -f "$meta" ] || continue
    if grep -q "/$base," "$meta"; then
      meta=$(basename "$(dirname "$meta")" .dist-info)
      echo "${meta##*-} (wheel ${meta%-*})"
      return
    fi
  done
  echo "${base#*.so.}"
}

# Chooses one file for library NAME (libnvrtc, libcublas, libcublasLt) among majors 13 and 12.
mt_find_cuda_lib() {
  local name=$1 driver=$2 dir major file
  while read -r dir; do
    [ -d "$dir" ] || continue
    for major in 13 12; do
      file=$dir/$name.so.$major
      [ -e "$file" ] || continue
      if [ -n "$driver" ] && [ "$major" -gt "$driver" ]; then
        echo "$name: skipping $file: CUDA $major is newer than the driver's CUDA $driver" >&2
        continue
      fi
      echo "$file"
      return 0
    done
  done < <(mt_cuda_dirs | awk '!seen[$0]++')
  return 1
}

mt_find_cuda() {
  local links=$MT_ROOT/cuda-links driver name file dirs="" log=""
  rm -rf "$links" && mkdir -p "$links"
  driver=$(mt_driver_cuda_major)
  if [ -n "$driver" ]; then log="driver: CUDA $driver (nvidia-smi)"$'\n'; else log="driver: CUDA version unknown (no nvidia-smi)"$'\n'; fi
  for name in libnvrtc libcublas libcublasLt; do
    if ! file=$(mt_find_cuda_lib "$name" "$driver" 2>>"$links/skipped.txt"); then
      log+="$name: not found (searched LD_LIBRARY_PATH, CUDA_HOME, /usr/local/cuda*, Python nvidia-* wheels, ld.so cache)"$'\n'
      continue
    fi
    ln -sf "$file" "$links/$name.so"
    # NVRTC loads its builtins library from its own folder.
    [ "$name" = libnvrtc ] && for f in "$(dirname "$file")"/libnvrtc-builtins*.so*; do
      [ -e "$f" ] && ln -sf "$f" "$links/$(basename "$f")"
    done
    case ":$dirs:" in *":$(dirname "$file"):"*) ;; *) dirs="$dirs:$(dirname "$file")" ;; esac
    log+="$name: $file -> $(readlink -f "$file") (version $(mt_lib_version "$file"))"$'\n'
  done
  [ -s "$links/skipped.txt" ] && log+=$(cat "$links/skipped.txt")$'\n'
  MT_CUDA_DIRS=${dirs#:}
  MT_CUDA_LOG=$log
}

# The bundle's programs need the glibc version in GLIBC_REQUIRED (that of the build machine's
# Debian packages) or newer.
mt_check_glibc() {
  local need have
  need=$(cat "$MT_BUNDLE/GLIBC_REQUIRED" 2>/dev/null) || { MT_ENV_ERROR="GLIBC_REQUIRED is missing"; return 1; }
  have=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')
  [ -n "$have" ] || { MT_ENV_ERROR="cannot tell this system's glibc version (getconf GNU_LIBC_VERSION)"; return 1; }
  if [ "$(printf '%s\n%s\n' "$need" "$have" | sort -V | head -1)" != "$need" ]; then
    MT_ENV_ERROR="this system's glibc $have is older than glibc $need, which the bundled programs need (build the bundle on an older distribution)"
    return 1
  fi
}

mt_setup() {
  mt_check_glibc || return 1
  mt_unpack || return 1
  MT_ORIG_LD_LIBRARY_PATH=${MT_ORIG_LD_LIBRARY_PATH-${LD_LIBRARY_PATH:-}}
  mt_find_cuda
  export PATH="$MT_ROOT/bin:$PATH"
  export LD_LIBRARY_PATH="$MT_ROOT/lib:$MT_ROOT/cuda-links${MT_CUDA_DIRS:+:$MT_CUDA_DIRS}${MT_ORIG_LD_LIBRARY_PATH:+:$MT_ORIG_LD_LIBRARY_PATH}"
  export MT_MESHTRAIN_BIN="$MT_ROOT/bin/meshtrain"
  # OpenMPI 4.1 and PMIx as built by Debian, relocated into root/.
  export OPAL_PREFIX="$MT_ROOT" OPAL_EXEC_PREFIX="$MT_ROOT" OPAL_BINDIR="$MT_ROOT/bin" OPAL_SBINDIR="$MT_ROOT/bin"
  export OPAL_LIBDIR="$MT_ROOT/lib" OPAL_PKGLIBDIR="$MT_ROOT/lib/openmpi3" OPAL_LIBEXECDIR="$MT_ROOT/bin"
  export OPAL_DATAROOTDIR="$MT_ROOT/share" OPAL_DATADIR="$MT_ROOT/share" OPAL_PKGDATADIR="$MT_ROOT/share/openmpi"
  export OPAL_SYSCONFDIR="$MT_ROOT/etc" OPAL_INCLUDEDIR="$MT_ROOT/include" OPAL_PKGINCLUDEDIR="$MT_ROOT/include"
  export PMIX_PREFIX="$MT_ROOT" PMIX_EXEC_PREFIX="$MT_ROOT" PMIX_BINDIR="$MT_ROOT/bin" PMIX_LIBDIR="$MT_ROOT/lib"
  export PMIX_PKGLIBDIR="$MT_ROOT/lib/pmix" PMIX_DATAROOTDIR="$MT_ROOT/share" PMIX_DATADIR="$MT_ROOT/share"
  export PMIX_PKGDATADIR="$MT_ROOT/share/pmix" PMIX_SYSCONFDIR="$MT_ROOT/etc"
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
}
