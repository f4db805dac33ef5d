//! FFI to the system OpenBLAS `cblas_sgemm` / `cblas_dgemm` (row-major), behind a safe shape.
//!
//! The only `unsafe` of the model: the BLAS call itself. Callers ([`super::matmul::matmul`]) have
//! checked that every operand slice holds its whole matrix, so BLAS never reads or writes out
//! of bounds. Threads: OpenBLAS uses `OPENBLAS_NUM_THREADS` (default: all cores) for every
//! GEMM; [`set_gemm_threads`] changes it at run time (e.g. one process per GPU sharing a node).
//! Results are bitwise reproducible for a fixed thread count, but a different thread count may
//! block some GEMMs differently and change the last bits (observed on 1 vs 3 threads).
//!
//! Idle workers: OpenBLAS's pthreads server lets its worker threads spin in `sched_yield` for
//! 2^28 cycles (~0.1 s) after every GEMM before they sleep. The training step alternates GEMMs
//! with meshtrain's own threaded layers, so the spinning workers took the cores those layers
//! need (~245 CPU-ms per d12 step). The spin bound (`OPENBLAS_THREAD_TIMEOUT`, a power of two
//! of cycles) is read once, when the library is loaded, before `main`; so before the first GEMM
//! or thread-count change of the process, [`prepare`] sets it to 2^16 cycles (unless
//! the user set it), has OpenBLAS re-read its environment and restarts its workers with the new
//! bound; from then on they sleep ~25 µs after each GEMM and are woken by the next one (a condition-variable signal, microseconds per GEMM). Which thread
//! computes which block does not change, so the results stay bitwise the same.
//!
//! Kernels: a DYNAMIC_ARCH OpenBLAS (Debian's, most distributions') picks its kernels by the CPU
//! model when it loads. A model newer than the library (Debian 12's 0.3.21 on an Emerald Rapids
//! VM here) gets the SSE-only `Prescott` kernels: d12's GEMMs ran at 34-42 GFLOP/s on 2 cores
//! instead of 150-180 with AVX-512 ones. In the same first-call step, when the user did not set
//! `OPENBLAS_CORETYPE` and the library runs SSE-only kernels on a CPU with AVX or better,
//! [`prepare`] has it select again with `OPENBLAS_CORETYPE` set to the best core the CPU's
//! instruction sets run (`SkylakeX`, `Haswell` or `Sandybridge`); the reselection entry points
//! are looked up at run time, so a library built for one CPU (without them) still links.
//! [`describe`] names the library and its kernels for the benchmark headers.

use std::ffi::CStr;
use std::os::raw::{c_char, c_int};

const CBLAS_ROW_MAJOR: c_int = 101;
const CBLAS_NO_TRANS: c_int = 111;
const CBLAS_TRANS: c_int = 112;

#[link(name = "openblas")]
extern "C" {
    fn cblas_sgemm(
        order: c_int,
        trans_a: c_int,
        trans_b: c_int,
        m: c_int,
        n: c_int,
        k: c_int,
        alpha: f32,
        a: *const f32,
        lda: c_int,
        b: *const f32,
        ldb: c_int,
        beta: f32,
        c: *mut f32,
        ldc: c_int,
    );
    fn cblas_dgemm(
        order: c_int,
        trans_a: c_int,
        trans_b: c_int,
        m: c_int,
        n: c_int,
        k: c_int,
        alpha: f64,
        a: *const f64,
        lda: c_int,
        b: *const f64,
        ldb: c_int,
        beta: f64,
        c: *mut f64,
        ldc: c_int,
    );
    fn openblas_set_num_threads(n: c_int);
    fn openblas_read_env();
    fn openblas_get_corename() -> *const c_char;
    fn openblas_get_config() -> *const c_char;
    fn blas_thread_shutdown_() -> c_int;
    fn blas_thread_init() -> c_int;
}

/// The environment variable bounding how long OpenBLAS's idle workers spin (log2 of cycles).
const TIMEOUT_VAR: &str = "OPENBLAS_THREAD_TIMEOUT";

/// 2^16 cycles (~25 µs): long enough to cover the gap between back-to-back GEMMs of a small
/// model (no wake-up per GEMM), short against the milliseconds of a large model's non-GEMM layers.
const QUIET_TIMEOUT: &str = "16";

/// The variable a user sets to choose OpenBLAS's kernels.
const CORETYPE_VAR: &str = "OPENBLAS_CORETYPE";

/// Once per process, before any GEMM or thread-count change of this module: OpenBLAS's kernels
/// fitted to the CPU and its idle workers made to sleep soon after each GEMM instead of spinning
/// ~0.1 s (see the module header). A user's own `OPENBLAS_CORETYPE` / `OPENBLAS_THREAD_TIMEOUT`
/// is left in force.
pub fn prepare() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let refit = std::env::var_os(CORETYPE_VAR).is_none().then(|| better_core(&corename(), cpu_level())).flatten();
        let quiet = std::env::var_os(TIMEOUT_VAR).is_none();
        if refit.is_none() && !quiet {
            return;
        }
        // Every GEMM and thread-count change of this module waits for this `Once`, so no GEMM
        // of ours runs while the workers stop. This runs during a rank's setup (its thread count
        // is set before the model is built); the standard library serialises its own
        // environment accesses.
        if quiet {
            std::env::set_var(TIMEOUT_VAR, QUIET_TIMEOUT);
        }
        // SAFETY: no call takes arguments; `blas_thread_shutdown_` joins OpenBLAS's idle workers
        // (no GEMM is in flight, see above), `openblas_read_env` only re-reads environment
        // variables into its settings, and `blas_thread_init` starts as many workers again with
        // the new spin bound, at once rather than lazily at the next GEMM, so that a thread-count
        // change never meets a stopped pool (it would then add workers the lazy start creates
        // again).
        unsafe { blas_thread_shutdown_() };
        if let Some(core) = refit {
            refit_kernels(core);
        }
        // SAFETY: as above; the kernels (if refitted) were selected while no worker existed.
        unsafe {
            openblas_read_env();
            blas_thread_init();
        }
    });
}

/// Has a DYNAMIC_ARCH OpenBLAS select its kernels again, as `core`, with no GEMM in flight and
/// no worker running; says what it did.
fn refit_kernels(core: &str) {
    let before = corename();
    let (quit, init) = (c"gotoblas_dynamic_quit", c"gotoblas_dynamic_init");
    // SAFETY: dlsym with the default handle looks a name up among the loaded libraries; the
    // names are NUL-terminated literals.
    let (quit, init) = unsafe { (libc::dlsym(libc::RTLD_DEFAULT, quit.as_ptr()), libc::dlsym(libc::RTLD_DEFAULT, init.as_ptr())) };
    if quit.is_null() || init.is_null() {
        log::warn!(
            "blas: OpenBLAS runs its SSE-only {before} kernels on a CPU with {} and was built for one CPU, so it \
             cannot select others: GEMMs run several times slower than they could; use an OpenBLAS that knows this CPU",
            level_name(cpu_level())
        );
        return;
    }
    std::env::set_var(CORETYPE_VAR, core);
    // SAFETY: both entry points take no arguments and return nothing; `gotoblas_dynamic_quit`
    // forgets the selected kernel table, `gotoblas_dynamic_init` selects one again (reading
    // OPENBLAS_CORETYPE, set above) and sets its blocking parameters, exactly what the library
    // does when it loads. No GEMM runs and no worker exists meanwhile (see `prepare`).
    unsafe {
        let quit: extern "C" fn() = std::mem::transmute(quit);
        let init: extern "C" fn() = std::mem::transmute(init);
        quit();
        init();
    }
    // Every rank of a node does the same; the launcher's rank 0 says it, the others at `-v`.
    let level = if crate::bootstrap::rank_hint().unwrap_or(0) == 0 { log::Level::Info } else { log::Level::Debug };
    log::log!(
        level,
        "blas: OpenBLAS chose its SSE-only {before} kernels for this CPU (a model it does not know); the CPU has {}, \
         so it now runs {} kernels (OPENBLAS_CORETYPE={core}; set it yourself to choose)",
        level_name(cpu_level()),
        corename()
    );
}

/// The kernels OpenBLAS runs (its core name, e.g. `SkylakeX`).
pub fn corename() -> String {
    // SAFETY: returns a pointer to a static NUL-terminated string (or null).
    text(unsafe { openblas_get_corename() })
}

/// The BLAS library and its kernels, for benchmark headers.
pub fn describe() -> String {
    // SAFETY: returns a pointer to a static NUL-terminated string (or null).
    let config = text(unsafe { openblas_get_config() });
    format!("BLAS {} (kernels {})", config.trim(), corename())
}

fn text(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: OpenBLAS's getters return static NUL-terminated strings.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Instruction-set level an OpenBLAS x86-64 core's kernels need: 0 SSE, 1 AVX, 2 AVX2 + FMA,
/// 3 AVX-512; `None` for names of other architectures or unknown to this table.
fn core_level(name: &str) -> Option<u8> {
    match name.to_ascii_lowercase().as_str() {
        "katmai" | "coppermine" | "northwood" | "prescott" | "banias" | "atom" | "core2" | "penryn" | "dunnington"
        | "nehalem" | "opteron" | "opteron_sse3" | "barcelona" | "bobcat" | "athlon" => Some(0),
        "sandybridge" | "bulldozer" | "piledriver" | "steamroller" | "excavator" => Some(1),
        "haswell" | "zen" => Some(2),
        "skylakex" | "cooperlake" | "sapphirerapids" => Some(3),
        _ => None,
    }
}

/// This CPU's level on [`core_level`]'s scale (0 on other architectures: nothing to refit).
fn cpu_level() -> u8 {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx512f") && has!("avx512bw") && has!("avx512dq") && has!("avx512vl") && has!("avx512cd") {
            return 3;
        }
        if has!("avx2") && has!("fma") {
            return 2;
        }
        if has!("avx") {
            return 1;
        }
    }
    0
}

fn level_name(level: u8) -> &'static str {
    ["SSE", "AVX", "AVX2", "AVX-512"][level.min(3) as usize]
}

/// The core to select instead of `library`'s when it runs SSE-only kernels (what a DYNAMIC_ARCH
/// OpenBLAS falls back to for a CPU model it does not know) on a CPU of level `cpu`; `None`
/// when its choice stands (including every choice of AVX kernels or better, which it made on
/// purpose).
fn better_core(library: &str, cpu: u8) -> Option<&'static str> {
    if core_level(library) != Some(0) {
        return None;
    }
    match cpu {
        3.. => Some("SkylakeX"),
        2 => Some("Haswell"),
        1 => Some("Sandybridge"),
        0 => None,
    }
}

/// One row-major GEMM operand as BLAS sees it: storage, leading dimension, transposed or not.
#[derive(Clone, Copy)]
pub struct Operand<'a, F> {
    /// Row-major storage of the stored matrix.
    pub data: &'a [F],
    /// Leading dimension (stored column count).
    pub ld: usize,
    /// Whether the product uses the transpose.
    pub trans: bool,
}

/// `c(m, n) = a · b + beta · c` for one precision; `c` is dense row-major (ld = n).
pub type Gemm<F> =
    fn(m: usize, n: usize, k: usize, a: Operand<'_, F>, b: Operand<'_, F>, beta: F, c: &mut [F]);

fn flag(trans: bool) -> c_int {
    if trans {
        CBLAS_TRANS
    } else {
        CBLAS_NO_TRANS
    }
}

/// Converts a dimension to BLAS's `int`; GEMM dimensions of a model beyond 2³¹ are a broken
/// invariant (layer shapes are bounded by the config validation long before that).
fn dim(x: usize) -> c_int {
    c_int::try_from(x).expect("GEMM dimension exceeds the BLAS int range")
}

/// Defines a safe GEMM over one CBLAS routine (the f32 and f64 versions differ only in it).
macro_rules! blas_gemm {
    ($(#[$doc:meta])* $name:ident, $cblas:ident, $t:ty) => {
        $(#[$doc])*
        pub fn $name(m: usize, n: usize, k: usize, a: Operand<'_, $t>, b: Operand<'_, $t>, beta: $t, c: &mut [$t]) {
            prepare();
            // SAFETY: `matmul::matmul` checked that a, b and c hold their full matrices for these
            // dimensions and leading dimensions; c is uniquely borrowed, so it aliases neither a
            // nor b.
            unsafe {
                $cblas(
                    CBLAS_ROW_MAJOR,
                    flag(a.trans),
                    flag(b.trans),
                    dim(m),
                    dim(n),
                    dim(k),
                    1.0,
                    a.data.as_ptr(),
                    dim(a.ld),
                    b.data.as_ptr(),
                    dim(b.ld),
                    beta,
                    c.as_mut_ptr(),
                    dim(n),
                )
            }
        }
    };
}

blas_gemm!(
    /// Single-precision GEMM (see [`Gemm`]).
    sgemm, cblas_sgemm, f32
);
blas_gemm!(
    /// Double-precision GEMM (see [`Gemm`]).
    dgemm, cblas_dgemm, f64
);

/// Sets the number of threads OpenBLAS uses for every following GEMM (at least 1).
pub fn set_gemm_threads(n: usize) {
    prepare();
    // SAFETY: a plain setter of OpenBLAS's global thread count; it takes no pointers.
    unsafe { openblas_set_num_threads(dim(n.max(1))) }
}

#[cfg(test)]
mod tests {
    use super::*;

    extern "C" {
        fn openblas_thread_timeout() -> c_int;
    }

    #[test]
    fn sse_kernels_on_a_newer_cpu_are_refitted_and_no_other_choice_is() {
        assert_eq!(better_core("Prescott", 3), Some("SkylakeX"));
        assert_eq!(better_core("CORE2", 2), Some("Haswell"));
        assert_eq!(better_core("Nehalem", 1), Some("Sandybridge"));
        assert_eq!(better_core("Prescott", 0), None);
        // The library's deliberate choices stand, even below what the CPU could run.
        assert_eq!(better_core("Haswell", 3), None);
        assert_eq!(better_core("Zen", 3), None);
        assert_eq!(better_core("SkylakeX", 3), None);
        assert_eq!(better_core("NEOVERSEN1", 3), None);
    }

    /// After the first GEMM the library runs kernels of at least AVX level on a CPU that has AVX
    /// (unless the user chose them): on a CPU model the system OpenBLAS does not know (this
    /// VM's), it had chosen SSE-only ones.
    #[test]
    fn first_gemm_runs_kernels_that_fit_the_cpu() {
        let (a, b, mut c) = ([1.0f32; 4], [2.0f32; 4], [0.0f32; 4]);
        let op = |data| Operand { data, ld: 2, trans: false };
        sgemm(2, 2, 2, op(&a), op(&b), 0.0, &mut c);
        assert_eq!(c, [4.0; 4]);
        let (core, cpu) = (corename(), cpu_level());
        eprintln!("{} on a CPU with {}", describe(), level_name(cpu));
        if std::env::var_os(CORETYPE_VAR).is_some_and(|v| !v.eq_ignore_ascii_case(core.as_str())) || core_level(&core).is_none() {
            eprintln!("SKIP: kernels chosen by the user or not x86-64 ({core})");
            return;
        }
        assert!(cpu == 0 || core_level(&core) >= Some(1), "OpenBLAS still runs {core} kernels on a CPU with {}", level_name(cpu));
    }

    #[test]
    fn first_gemm_leaves_openblas_with_the_quiet_spin_bound() {
        let user = std::env::var(TIMEOUT_VAR).ok();
        let (a, b, mut c) = ([1.0f32; 4], [2.0f32; 4], [0.0f32; 4]);
        let op = |data| Operand { data, ld: 2, trans: false };
        sgemm(2, 2, 2, op(&a), op(&b), 0.0, &mut c);
        assert_eq!(c, [4.0; 4]);
        // SAFETY: a getter of the setting OpenBLAS read from its environment; no arguments.
        let bound = unsafe { openblas_thread_timeout() };
        let expected = user.as_deref().unwrap_or(QUIET_TIMEOUT).trim().parse::<c_int>().unwrap_or(0);
        assert_eq!(bound, expected, "OpenBLAS's idle-worker spin bound was not re-read");
    }
}
