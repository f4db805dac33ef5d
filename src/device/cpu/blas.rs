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
//! or thread-count change of the process, [`quiet_idle_workers`] sets it to 2^16 cycles (unless
//! the user set it), has OpenBLAS re-read its environment and restarts its workers with the new
//! bound; from then on they sleep ~25 µs after each GEMM and are woken by the next one (a condition-variable signal, microseconds per GEMM). Which thread
//! computes which block does not change, so the results stay bitwise the same.

use std::os::raw::c_int;

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
    fn blas_thread_shutdown_() -> c_int;
    fn blas_thread_init() -> c_int;
}

/// The environment variable bounding how long OpenBLAS's idle workers spin (log2 of cycles).
const TIMEOUT_VAR: &str = "OPENBLAS_THREAD_TIMEOUT";

/// 2^16 cycles (~25 µs): long enough to cover the gap between back-to-back GEMMs of a small
/// model (no wake-up per GEMM), short against the milliseconds of a large model's non-GEMM layers.
const QUIET_TIMEOUT: &str = "16";

/// Makes OpenBLAS's idle workers sleep soon after each GEMM instead of spinning ~0.1 s (see the
/// module header), once per process, before any GEMM or thread-count change of this module.
/// A user's own `OPENBLAS_THREAD_TIMEOUT` is left in force.
pub fn quiet_idle_workers() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if std::env::var_os(TIMEOUT_VAR).is_some() {
            return;
        }
        // Every GEMM and thread-count change of this module waits for this `Once`, so no GEMM
        // of ours runs while the workers stop. This runs during a rank's setup (its thread count
        // is set before the model is built); the standard library serialises its own
        // environment accesses.
        std::env::set_var(TIMEOUT_VAR, QUIET_TIMEOUT);
        // SAFETY: no call takes arguments; `openblas_read_env` only re-reads environment
        // variables into OpenBLAS's settings, `blas_thread_shutdown_` joins its idle workers (no
        // GEMM is in flight, see above) and `blas_thread_init` starts as many again with the new
        // spin bound, at once rather than lazily at the next GEMM, so that a thread-count change
        // never meets a stopped pool (it would then add workers the lazy start creates again).
        unsafe {
            openblas_read_env();
            blas_thread_shutdown_();
            blas_thread_init();
        }
    });
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
            quiet_idle_workers();
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
    quiet_idle_workers();
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
