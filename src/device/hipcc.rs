//! Compilation of the kernels for AMD GPUs with `hipcc` (a subprocess; no GPU needed), and
//! listing the kernels of a compiled code object with `llvm-readelf`.
//!
//! The same translation unit as for NVRTC ([`kernel_source`]) is written to a directory and
//! compiled into one raw code object (`--genco --no-gpu-bundle-output`) that `hipModuleLoadData`
//! loads. `hip/build.sh` does the same per file for inspection by hand.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::kernels::kernel_source;
use crate::error::{Error, Result};

/// True when `hipcc` runs.
pub fn hipcc_available() -> bool {
    Command::new("hipcc")
        .arg("--help")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Compiles every kernel for `arch` (e.g. `gfx90a`) into `dir/meshtrain_kernels.co`.
pub fn compile_hip_kernels(arch: &str, dir: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
    let src = dir.join("meshtrain_kernels.hip");
    std::fs::write(&src, kernel_source()).map_err(|e| Error::io(format!("write {}", src.display()), e))?;
    let out = dir.join("meshtrain_kernels.co");
    let run = Command::new("hipcc")
        .arg(format!("--offload-arch={arch}"))
        .args(["--genco", "--no-gpu-bundle-output", "-O3", "-std=c++17", "-o"])
        .arg(&out)
        .arg(&src)
        .output()
        .map_err(|e| {
            Error::Device(format!(
                "hipcc for {arch}: cannot run hipcc (install ROCm's hipcc): {e}"
            ))
        })?;
    if !run.status.success() || !out.is_file() {
        return Err(Error::Device(format!(
            "hipcc for {arch} failed ({}): {}",
            run.status,
            String::from_utf8_lossy(&run.stderr)
        )));
    }
    Ok(out)
}

/// Names of the kernels a code object defines (its global function symbols).
pub fn code_object_kernels(code_object: &Path) -> Result<Vec<String>> {
    let tool = ["llvm-readelf", "/opt/rocm/llvm/bin/llvm-readelf"]
        .into_iter()
        .find(|t| Command::new(t).arg("--version").output().is_ok())
        .ok_or_else(|| Error::Device("no llvm-readelf on PATH or in /opt/rocm/llvm/bin".into()))?;
    let run = Command::new(tool)
        .arg("--syms")
        .arg(code_object)
        .output()
        .map_err(|e| Error::io(format!("{tool} --syms {}", code_object.display()), e))?;
    if !run.status.success() {
        return Err(Error::file(
            code_object,
            None,
            String::from_utf8_lossy(&run.stderr),
        ));
    }
    // Symbol table rows: Num: Value Size Type Bind Vis Ndx Name.
    let text = String::from_utf8_lossy(&run.stdout);
    Ok(text
        .lines()
        .filter_map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            (cols.len() >= 8 && cols[3] == "FUNC" && cols[4] == "GLOBAL").then(|| cols[7].to_string())
        })
        .collect())
}
