//! The `emu` arm: every GPU kernel runs on the host, compiled as C++ by the system g++ against
//! `kernels/emu.h` (grid, blocks, threads as fibers, `__syncthreads`, warp shuffles and votes,
//! shared memory, atomics; the header describes the model) and launched through the same
//! [`Device::launch`](super::Device::launch) call, with the same grid, block, shared-memory
//! size and argument list, as on CUDA and HIP. Matrix products go to the CPU gemm.
//!
//! Like NVRTC and hipcc, the kernels are compiled when the device opens: the translation unit
//! (`kernels::emu_source`) is built once into a shared object cached under the system temp
//! directory (`MESHTRAIN_EMU_CACHE` overrides it), named by a hash of the source, the compiler's
//! version and the flags, written under a temporary name and renamed (ranks compiling at once
//! cannot see a half-written file), then loaded once per process and never unloaded (its worker
//! threads live as long as the process). `MESHTRAIN_EMU_CXX` picks another compiler.
//!
//! What a launch checks, each failure an [`Error::Device`] naming the kernel, grid and block:
//! - the argument list against the kernel's C parameter types (a mismatch on a GPU would pass
//!   garbage silently);
//! - the launch shape (x a multiple of 64, at most 1024 threads, at most 48 KiB dynamic
//!   shared memory, no empty grid), the rules CUDA and HIP both accept;
//! - memory: buffers sit between guard pages (`emu_memory.rs`); a fault names the argument, the
//!   byte offset and whether it was a read or a write, and a write into the padding next to a
//!   buffer is found by its canary after the launch;
//! - barriers and warp operations that not every thread reaches (deadlock) or that the lanes of
//!   a warp reach at different operations (divergence).
//!
//! [`EmuDevice::set_reverse_order`] runs blocks and threads in reverse order, so a test can run
//! a launch both ways and compare: a result that depends on the order has a race.

use std::collections::HashMap;
use std::ffi::{c_char, c_void, CStr};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

use sha2::{Digest, Sha256};

use super::kernels::{emu_source, entry_points};
use super::{DeviceBuffer, KernelArg, LaunchDims, RawArg};
use crate::error::{Error, Result};

/// Flags of the emu compile (part of the cache key). `-fno-strict-aliasing`: kernels view
/// 16-byte vectors (`uint4`) as arrays of their element type, which the GPU compilers accept and
/// g++'s type-based alias analysis would miscompile.
const CXX_FLAGS: [&str; 9] = ["-std=c++17", "-O2", "-fno-strict-aliasing", "-fPIC", "-shared", "-pthread", "-w", "-x", "c++"];

/// Dynamic shared memory CUDA gives a launch without opting in.
const MAX_DYNAMIC_SHARED: u32 = 48 << 10;

/// The report `mt_emu_launch` fills (`Report` in kernels/emu_runtime.cpp).
#[repr(C)]
struct Report {
    code: i32,
    fault_write: i32,
    fault_addr: u64,
    block: [u32; 3],
    thread: [u32; 3],
    message: [c_char; 480],
}

type Thunk = unsafe extern "C" fn(*mut *mut c_void);
type LaunchFn = unsafe extern "C" fn(Thunk, *mut *mut c_void, *const u32, *mut Report) -> i32;
type SignatureFn = unsafe extern "C" fn() -> *const c_char;

/// A loaded kernel module: the launcher and, per kernel, its thunk and parameter types.
struct Module {
    launch: LaunchFn,
    kernels: HashMap<String, (Thunk, String)>,
}

/// The emulated device: a loaded module and the scheduling order of its launches.
pub struct EmuDevice {
    module: &'static Module,
    reverse: AtomicBool,
}

impl EmuDevice {
    /// Compiles (or finds in the cache) and loads the kernels of `kernels/*.cu`.
    pub fn open() -> Result<EmuDevice> {
        Self::with_kernels("", &[])
    }

    /// The device with `extra` kernel source (which may include "compat.h") compiled after the
    /// project's kernels and its `extra_entries` launchable too: test kernels go through the
    /// same compile and launch path.
    pub fn with_kernels(extra: &str, extra_entries: &[&str]) -> Result<EmuDevice> {
        let mut entries = entry_points();
        entries.extend(extra_entries.iter().map(|s| s.to_string()));
        let module = module(&emu_source(extra, &entries), &entries)?;
        Ok(EmuDevice { module, reverse: AtomicBool::new(false) })
    }

    /// Another handle to the same loaded kernels (launches from several threads take turns).
    pub fn lane(&self) -> EmuDevice {
        EmuDevice { module: self.module, reverse: AtomicBool::new(self.reverse.load(Ordering::Relaxed)) }
    }

    /// Runs the blocks of later launches, and the threads of each block, in reverse order.
    pub fn set_reverse_order(&self, reverse: bool) {
        self.reverse.store(reverse, Ordering::Relaxed);
    }

    /// Runs kernel `name` to completion; `raw` are `args` resolved to addresses.
    pub(crate) fn launch(&self, name: &str, dims: LaunchDims, args: &[KernelArg], raw: &[RawArg]) -> Result<()> {
        let fail = |what: String| Error::Device(format!("emu: kernel {name} (grid {:?}, block {:?}): {what}", dims.grid, dims.block));
        let (thunk, signature) = self
            .module
            .kernels
            .get(name)
            .ok_or_else(|| fail("not an entry point of the compiled kernels".into()))?;
        check_arguments(signature, raw).map_err(fail)?;
        check_shape(&dims).map_err(fail)?;
        // Each argument's value in a word of its own, little-endian from the word's first byte,
        // the way cuLaunchKernel reads its `void **` list.
        let mut words: Vec<u64> = raw
            .iter()
            .map(|a| match *a {
                RawArg::Ptr(p) => p,
                RawArg::I32(v) => v as u32 as u64,
                RawArg::I64(v) => v as u64,
                RawArg::U64(v) => v,
                RawArg::F32(v) => v.to_bits() as u64,
            })
            .collect();
        let mut pointers: Vec<*mut c_void> = words.iter_mut().map(|w| (w as *mut u64).cast()).collect();
        let order = u32::from(self.reverse.load(Ordering::Relaxed));
        let (g, b) = (dims.grid, dims.block);
        let packed = [g.0, g.1, g.2, b.0, b.1, b.2, dims.shared_bytes, order];
        let mut report = Report { code: 0, fault_write: -1, fault_addr: 0, block: [0; 3], thread: [0; 3], message: [0; 480] };
        // SAFETY: the thunk belongs to this module and its parameter types match the argument
        // words (checked above); every pointer argument is an emu buffer address whose bounds
        // the caller checked, and the buffers outlive this call, which returns when the launch
        // has finished; `packed` and `report` match the C side's layout.
        let code = unsafe { (self.module.launch)(*thunk, pointers.as_mut_ptr(), packed.as_ptr(), &mut report) };
        if code != 0 {
            // SAFETY: the C side always NUL-terminates the message (snprintf).
            let message = unsafe { CStr::from_ptr(report.message.as_ptr()) }.to_string_lossy();
            let at = format!("block {:?} thread {:?}", report.block, report.thread);
            return Err(fail(if code == 1 {
                format!("{at}: {}", describe_fault(args, report.fault_addr, report.fault_write))
            } else {
                format!("{at}: {message}")
            }));
        }
        for (i, arg) in args.iter().enumerate() {
            if let KernelArg::Buf(DeviceBuffer::Emu(h)) | KernelArg::BufAt(DeviceBuffer::Emu(h), _) = arg {
                if let Some(off) = h.guard().and_then(|g| g.take_damage()) {
                    return Err(fail(format!(
                        "wrote out of bounds: byte {off} of argument {i}, a {}-byte buffer",
                        h.bytes().len()
                    )));
                }
            }
        }
        Ok(())
    }
}

fn check_arguments(signature: &str, raw: &[RawArg]) -> std::result::Result<(), String> {
    let code = |a: &RawArg| match a {
        RawArg::Ptr(_) => 'p',
        RawArg::I32(_) => 'i',
        RawArg::I64(_) => 'l',
        RawArg::U64(_) => 'u',
        RawArg::F32(_) => 'f',
    };
    let given: String = raw.iter().map(code).collect();
    if given != signature {
        return Err(format!(
            "arguments `{given}` do not match the parameters `{signature}` (p pointer, i int, l long long, \
             u unsigned long long, f float)"
        ));
    }
    Ok(())
}

fn check_shape(d: &LaunchDims) -> std::result::Result<(), String> {
    let (g, b) = (d.grid, d.block);
    let threads = b.0 as u64 * b.1 as u64 * b.2 as u64;
    if g.0 == 0 || g.1 == 0 || g.2 == 0 {
        return Err("empty grid (a launch error on a GPU)".into());
    }
    if b.0 % 64 != 0 || threads == 0 || threads > 1024 {
        return Err("block x must be a multiple of 64 (warp and wavefront) and a block at most 1024 threads".into());
    }
    if d.shared_bytes > MAX_DYNAMIC_SHARED {
        return Err(format!("{} bytes of dynamic shared memory (at most {MAX_DYNAMIC_SHARED})", d.shared_bytes));
    }
    Ok(())
}

/// Which argument buffer a faulting address belongs to, and where in it.
fn describe_fault(args: &[KernelArg], addr: u64, write: i32) -> String {
    let access = match write {
        1 => "write",
        0 => "read",
        _ => "access",
    };
    for (i, arg) in args.iter().enumerate() {
        let (KernelArg::Buf(DeviceBuffer::Emu(h)) | KernelArg::BufAt(DeviceBuffer::Emu(h), _)) = arg else { continue };
        let Some(off) = h.guard().and_then(|g| g.offset_of(addr)) else { continue };
        let len = h.bytes().len() as i64;
        let place = if off < 0 {
            format!("{} bytes before its start", -off)
        } else {
            format!("{} bytes past its end", off - len)
        };
        return format!("out-of-bounds {access} at byte {off} of argument {i}, a {len}-byte buffer ({place})");
    }
    format!("{access} of address {addr:#x}, outside every argument buffer (a wild pointer or a thread's stack overflow)")
}

/// The loaded module for `source`, compiled and loaded at most once per process.
fn module(source: &str, entries: &[String]) -> Result<&'static Module> {
    static LOADED: OnceLock<Mutex<HashMap<String, &'static Module>>> = OnceLock::new();
    let cxx = crate::env::emu_cxx();
    let version = Command::new(&cxx)
        .arg("--version")
        .output()
        .map_err(|e| Error::Device(format!("emu: cannot run `{cxx}` (install g++, e.g. Debian's build-essential): {e}")))?;
    let mut hash = Sha256::new();
    for part in [source.as_bytes(), &version.stdout, CXX_FLAGS.join(" ").as_bytes()] {
        hash.update(part);
        hash.update([0]);
    }
    let key: String = hash.finalize().iter().take(12).map(|b| format!("{b:02x}")).collect();
    let mut loaded = LOADED.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    if let Some(m) = loaded.get(&key) {
        return Ok(m);
    }
    let path = compile(&cxx, source, &key)?;
    // SAFETY: loading a library this process just compiled from the kernel sources; its
    // initialisers only set up statics.
    let lib = unsafe { libloading::Library::new(&path) }
        .map_err(|e| Error::Device(format!("emu: load {}: {e}", path.display())))?;
    // Never unloaded: the module's worker threads run its code until the process exits.
    let lib: &'static libloading::Library = Box::leak(Box::new(lib));
    let symbol = |name: String| -> Result<*const c_void> {
        // SAFETY: looking up a symbol the generated source defines; its type is fixed there.
        unsafe { lib.get::<*const c_void>(name.as_bytes()) }
            .map(|s| *s)
            .map_err(|e| Error::Device(format!("emu: {} has no `{name}`: {e}", path.display())))
    };
    // SAFETY: the runtime defines mt_emu_launch with the LaunchFn signature.
    let launch: LaunchFn = unsafe { std::mem::transmute::<*const c_void, LaunchFn>(symbol("mt_emu_launch".into())?) };
    let mut kernels = HashMap::new();
    for name in entries {
        // SAFETY: MT_EMU_ENTRY defines both functions with these signatures for every entry.
        let (thunk, signature) = unsafe {
            (
                std::mem::transmute::<*const c_void, Thunk>(symbol(format!("mt_emu_thunk_{name}"))?),
                std::mem::transmute::<*const c_void, SignatureFn>(symbol(format!("mt_emu_signature_{name}"))?),
            )
        };
        // SAFETY: the signature function returns a static NUL-terminated string.
        let signature = unsafe { CStr::from_ptr(signature()) }.to_string_lossy().into_owned();
        kernels.insert(name.clone(), (thunk, signature));
    }
    let module: &'static Module = Box::leak(Box::new(Module { launch, kernels }));
    loaded.insert(key, module);
    Ok(module)
}

/// The cached shared object for `key`, compiling it first when missing.
fn compile(cxx: &str, source: &str, key: &str) -> Result<PathBuf> {
    let dir = crate::env::emu_cache();
    let lib = dir.join(format!("kernels-{key}.so"));
    if lib.is_file() {
        return Ok(lib);
    }
    std::fs::create_dir_all(&dir).map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
    let pid = std::process::id();
    let src = dir.join(format!("kernels-{key}.{pid}.cpp"));
    let tmp = dir.join(format!("kernels-{key}.{pid}.so.tmp"));
    std::fs::write(&src, source).map_err(|e| Error::io(format!("write {}", src.display()), e))?;
    let run = Command::new(cxx)
        .args(CXX_FLAGS)
        .arg(&src)
        .arg("-o")
        .arg(&tmp)
        .output()
        .map_err(|e| Error::Device(format!("emu: cannot run `{cxx}`: {e}")))?;
    if !run.status.success() {
        let stderr = String::from_utf8_lossy(&run.stderr);
        let shown: String = stderr.chars().take(4000).collect();
        return Err(Error::Device(format!("emu: {cxx} failed on {} ({}):\n{shown}", src.display(), run.status)));
    }
    let _ = std::fs::remove_file(&src);
    std::fs::rename(&tmp, &lib).map_err(|e| Error::io(format!("rename {} to {}", tmp.display(), lib.display()), e))?;
    Ok(lib)
}
