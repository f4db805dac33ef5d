//! Running a layer's loops on the widest vector unit the CPU has.
//!
//! The crate is built for the x86-64 baseline (SSE2), so a binary runs on any node; the layers'
//! inner loops (axpys, element-wise maps) are written so the compiler vectorises them, but at
//! the baseline that means four floats per instruction on CPUs that take sixteen. [`widest`]
//! runs a closure inside a function compiled for AVX-512 or AVX2 when the CPU has them (asked
//! once), so everything inlined into it, the kernel bodies marked `#[inline(always)]`, is
//! compiled again for that unit.
//!
//! Invariant: the wider copy does exactly the same floating-point operations in the same order
//! (Rust never contracts a multiply and an add into an FMA, nor reassociates a sum), so results
//! are bitwise those of the baseline code; only more elements go through each instruction.
//! `MESHTRAIN_CPU_SIMD=baseline|avx2|avx512` caps the level (for comparisons; a level the CPU
//! lacks is never used).
//!
//! `unsafe` here: calling a `#[target_feature]` function is unsafe because it would fault on a
//! CPU without those instructions; the one call site checks the detected features first.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

pub use crate::env::SimdLevel as Level;

/// The cap set by [`set_cap`]: 0 none, else 1 + the level.
static CAP: AtomicU8 = AtomicU8::new(0);

/// Caps the level at `cap` (`MESHTRAIN_CPU_SIMD`; `None`: the widest the CPU has). Call before
/// the first layer runs: the level is decided once.
pub fn set_cap(cap: Option<Level>) {
    CAP.store(cap.map_or(0, |l| 1 + l as u8), Ordering::Relaxed);
}

/// The level in use: the best the CPU has, capped by [`set_cap`]; decided at the first call and
/// logged once (at debug).
pub fn level() -> Level {
    static LEVEL: OnceLock<Level> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let cap = match CAP.load(Ordering::Relaxed) {
            0 => Level::Avx512,
            1 => Level::Baseline,
            2 => Level::Avx2,
            _ => Level::Avx512,
        };
        let level = detected().min(cap);
        log::debug!("cpu layers: {} vectors (the CPU has {})", level.name(), detected().name());
        level
    })
}

/// The best level this CPU supports.
pub fn detected() -> Level {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx512f") && has!("avx512bw") && has!("avx512dq") && has!("avx512vl") && has!("avx2") && has!("fma") {
            return Level::Avx512;
        }
        if has!("avx2") && has!("fma") {
            return Level::Avx2;
        }
    }
    Level::Baseline
}

/// Runs `f` compiled for [`level`]: what `f` inlines (its `#[inline(always)]` callees, iterator
/// adapters) is vectorised for that unit.
#[inline(always)]
pub fn widest<R>(f: impl FnOnce() -> R) -> R {
    run_at(level(), f)
}

/// Runs `f` compiled for `level` if the CPU has it, else for the baseline (tests compare levels).
#[inline(always)]
pub(crate) fn run_at<R>(level: Level, f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    match level.min(detected()) {
        // SAFETY: capped by `detected`, which returns these only when the CPU reports every
        // feature enabled below.
        Level::Avx512 => return unsafe { avx512(f) },
        // SAFETY: as above, AVX2 and FMA were detected.
        Level::Avx2 => return unsafe { avx2(f) },
        Level::Baseline => {}
    }
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")]
fn avx512<R>(f: impl FnOnce() -> R) -> R {
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}
