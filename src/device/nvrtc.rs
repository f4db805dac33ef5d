//! Run-time compilation of the CUDA kernels with NVRTC, loaded dynamically.
//!
//! cudarc panics when it cannot load libnvrtc; [`nvrtc_available`] checks first, and the compile
//! itself runs under `catch_unwind` (a library without a symbol cudarc expects also panics), so
//! callers always get an [`Error::Device`]. NVRTC needs no GPU: CI compiles every kernel for
//! sm_90 with the PyPI wheel `nvidia-cuda-nvrtc-cu12` on `LD_LIBRARY_PATH`.

use std::panic::{catch_unwind, AssertUnwindSafe};

pub use cudarc::nvrtc::Ptx;
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};

use super::kernels::kernel_source;
use crate::error::{Error, Result};

/// True when a libnvrtc shared library can be loaded (cudarc's own search list).
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen the library names cudarc knows and drops the handles.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compiles every kernel of `kernels/*.cu` into one PTX module for `arch` (e.g. `sm_90`).
pub fn compile_cuda_kernels(arch: &str) -> Result<Ptx> {
    if !nvrtc_available() {
        return Err(Error::Device(format!(
            "compiling kernels for {arch}: no NVRTC library (libnvrtc.so) found; install the CUDA \
             toolkit or `pip install nvidia-cuda-nvrtc-cu12` and put its lib/ on LD_LIBRARY_PATH"
        )));
    }
    let opts = CompileOptions {
        // IEEE-rounded division and square root (NVRTC's defaults, pinned here) so that results
        // track the CPU reference.
        prec_div: Some(true),
        prec_sqrt: Some(true),
        options: vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()],
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
