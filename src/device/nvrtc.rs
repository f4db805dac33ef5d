//! Run-time compilation of the CUDA kernels with NVRTC, loaded dynamically.
//!
//! A device loads a CUBIN ([`compile_cuda_cubin`]): machine code for its exact architecture,
//! which the driver loads without a JIT, so an NVRTC newer than the driver still works (PTX from
//! a newer NVRTC fails to load with `CUDA_ERROR_UNSUPPORTED_PTX_VERSION`, common on clusters whose
//! drivers lag). PTX ([`compile_cuda_kernels`]) is what the compile tests read.
//!
//! cudarc panics when it cannot load libnvrtc; [`nvrtc_available`] checks first, and the compile
//! itself runs under `catch_unwind` (a library without a symbol cudarc expects also panics), so
//! callers always get an [`Error::Device`]. NVRTC needs no GPU: CI compiles every kernel for
//! sm_90 with the PyPI wheels `nvidia-cuda-nvrtc-cu12` (NVRTC 12) and `nvidia-cuda-nvrtc`
//! (NVRTC 13).
//!
//! Library names: cudarc (built for CUDA 12) opens `libnvrtc.so` first, then numbered names up to
//! `libnvrtc.so.12`, never `libnvrtc.so.13`. A CUDA 13 NVRTC therefore loads through a
//! `libnvrtc.so` link to it on the library path (a toolkit's `lib64/` has one; the GPU bundle's
//! `env.sh` makes one for the Python wheels); the no-library error says so when it finds only
//! the `.so.13`. The API calls made here are the same in NVRTC 12 and 13.

use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

pub use cudarc::nvrtc::Ptx;
use cudarc::nvrtc::{compile_ptx_with_opts, result, sys, CompileOptions};

use super::kernels::kernel_source;
use crate::error::{Error, Result};

/// True when a libnvrtc shared library can be loaded (cudarc's own search list).
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen the library names cudarc knows and drops the handles.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

fn check_available(arch: &str) -> Result<()> {
    if nvrtc_available() {
        return Ok(());
    }
    // SAFETY: dlopen of NVRTC, which runs no code of ours; the handle is dropped at once.
    let cuda13 = unsafe { libloading::Library::new("libnvrtc.so.13") }.is_ok();
    Err(Error::Device(if cuda13 {
        format!(
            "compiling kernels for {arch}: only libnvrtc.so.13 (CUDA 13) was found, and this \
             build opens libnvrtc.so or libnvrtc.so.12: put a link named libnvrtc.so to it on \
             LD_LIBRARY_PATH (the GPU bundle's env.sh makes one)"
        )
    } else {
        format!(
            "compiling kernels for {arch}: no NVRTC library (libnvrtc.so, libnvrtc.so.12) found; \
             install the CUDA toolkit or `pip install nvidia-cuda-nvrtc-cu12` and put its lib/ on \
             LD_LIBRARY_PATH"
        )
    }))
}

/// The file of a loaded shared library whose name starts with `stem` (`libnvrtc.so`), read from
/// `/proc/self/maps` (so links are resolved); `None` when this process has not loaded it.
pub(crate) fn loaded_library(stem: &str) -> Option<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .find(|path| path.rsplit('/').next().is_some_and(|file| file.starts_with(stem)))
        .map(str::to_string)
}

/// The version the loaded NVRTC reports (`nvrtcVersion`), e.g. `(13, 0)`.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    check_available("(version query)")?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: nvrtcVersion writes two ints through pointers to locals that outlive the call.
    let status = catch_unwind(AssertUnwindSafe(|| unsafe { sys::nvrtcVersion(&mut major, &mut minor) }.result()));
    match status {
        Ok(Ok(())) => Ok((major, minor)),
        Ok(Err(e)) => Err(Error::Device(format!("nvrtcVersion: {e:?}"))),
        Err(_) => Err(Error::Device("the NVRTC library lacks nvrtcVersion".into())),
    }
}

/// Which NVRTC compiles the kernels: `NVRTC 13.0 (/path/libnvrtc.so.13)`.
pub fn nvrtc_description() -> Result<String> {
    let (major, minor) = nvrtc_version()?;
    let file = loaded_library("libnvrtc.so").unwrap_or_else(|| "file not in /proc/self/maps".into());
    Ok(format!("NVRTC {major}.{minor} ({file})"))
}

/// Options of both compiles: IEEE-rounded division and square root (NVRTC's defaults, pinned
/// here) so that results track the CPU reference.
fn options(arch: &str) -> Vec<String> {
    vec![format!("--gpu-architecture={arch}"), "--std=c++17".into(), "--prec-div=true".into(), "--prec-sqrt=true".into()]
}

/// Compiles every kernel of `kernels/*.cu` into one CUBIN for the real architecture `arch`
/// (e.g. `sm_90`): what [`super::CudaDevice`] loads.
pub fn compile_cuda_cubin(arch: &str) -> Result<Vec<u8>> {
    check_available(arch)?;
    log::info!("compiling the kernels for {arch} with {}", nvrtc_description()?);
    let src = CString::new(kernel_source()).map_err(|_| Error::Device("kernel source holds a NUL byte".into()))?;
    let compiled = catch_unwind(AssertUnwindSafe(|| -> Result<Vec<u8>> {
        let prog = result::create_program(&src, Some(c"meshtrain_kernels.cu"))
            .map_err(|e| Error::Device(format!("NVRTC create program: {e:?}")))?;
        // SAFETY: `prog` was just created from `src`, which outlives it, and is destroyed once
        // below; the CUBIN buffer is sized by nvrtcGetCUBINSize before nvrtcGetCUBIN fills it.
        let out = unsafe {
            match result::compile_program(prog, &options(arch)) {
                Err(_) => {
                    let log = result::get_program_log(prog).unwrap_or_default();
                    let log: Vec<u8> = log.iter().map(|&c| c as u8).take_while(|&c| c != 0).collect();
                    Err(Error::Device(format!(
                        "NVRTC compile for {arch} failed: {}",
                        String::from_utf8_lossy(&log)
                    )))
                }
                Ok(()) => {
                    let mut size = 0usize;
                    sys::nvrtcGetCUBINSize(prog, &mut size).result().and_then(|_| {
                        let mut cubin = vec![0u8; size];
                        sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut c_char).result().map(|_| cubin)
                    })
                    .map_err(|e| Error::Device(format!("NVRTC CUBIN for {arch}: {e:?}")))
                }
            }
        };
        // SAFETY: created above and not destroyed before.
        let _ = unsafe { result::destroy_program(prog) };
        out
    }));
    match compiled {
        Ok(Ok(cubin)) if cubin.is_empty() => {
            Err(Error::Device(format!("NVRTC made no CUBIN for {arch}: name a real architecture (sm_XY)")))
        }
        Ok(result) => result,
        Err(_) => Err(Error::Device(format!(
            "NVRTC compile for {arch}: the NVRTC library lacks a function cudarc needs (too old?)"
        ))),
    }
}

/// Compiles every kernel of `kernels/*.cu` into one PTX module for `arch` (e.g. `sm_90`).
pub fn compile_cuda_kernels(arch: &str) -> Result<Ptx> {
    check_available(arch)?;
    let opts = CompileOptions {
        options: options(arch),
        name: Some("meshtrain_kernels.cu".into()),
        ..Default::default()
    };
    let src = kernel_source();
    match catch_unwind(AssertUnwindSafe(|| compile_ptx_with_opts(src, opts))) {
        Ok(Ok(ptx)) => Ok(ptx),
        Ok(Err(e)) => Err(Error::Device(format!(
            "NVRTC compile for {arch} failed: {}",
            describe(&e)
        ))),
        Err(_) => Err(Error::Device(format!(
            "NVRTC compile for {arch}: the NVRTC library lacks a function cudarc needs (too old?)"
        ))),
    }
}

/// The compiler log of a failed compile, or the error code.
fn describe(e: &cudarc::nvrtc::CompileError) -> String {
    match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
        other => format!("{other:?}"),
    }
}
