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
//! sm_90 with the PyPI wheel `nvidia-cuda-nvrtc-cu12` on `LD_LIBRARY_PATH`.

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
    Err(Error::Device(format!(
        "compiling kernels for {arch}: no NVRTC library (libnvrtc.so) found; install the CUDA \
         toolkit or `pip install nvidia-cuda-nvrtc-cu12` and put its lib/ on LD_LIBRARY_PATH"
    )))
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
