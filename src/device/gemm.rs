//! Matrix products on a device: cuBLAS on CUDA (through cudarc, loaded at run time), rocBLAS on
//! HIP (`librocblas.so`, loaded at run time), and the CPU gemm of `cpu::matmul` on the CPU device.
//!
//! Everything here speaks row-major, like the rest of meshtrain: `c (M, N) = op(a) · op(b)`, with
//! `a` stored (M, K) or, transposed, (K, M), and `b` stored (K, N) or (N, K). Column-major BLAS
//! libraries get the same product as `cᵀ = op(b)ᵀ · op(a)ᵀ`, which swaps the operands and keeps
//! the transposition flags (see [`col_major`]).
//!
//! A strided-batched product ([`Gemm::matmul_batched`], `cublasGemmStridedBatchedEx` /
//! `rocblas_gemm_strided_batched_ex`) runs `count` such products in one call, the i-th reading and
//! writing its matrices a fixed stride after the previous one's ([`Batch`]); attention's per-head
//! products are one call each. [`Gemm::matmul`] is the batch of one.
//!
//! Operands are f32, bf16 or IEEE half (fp16); the product is accumulated in f32 and written as
//! f32 (cuBLAS `CUBLAS_COMPUTE_32F` with `CUDA_R_16BF` / `CUDA_R_16F` inputs, rocBLAS `f32_r`
//! compute with `bf16_r` / `f16_r` inputs). The CPU arm widens 16-bit operands to f32 (exactly:
//! both formats are subsets of f32) and multiplies in f32, so it computes the same rounded inputs'
//! product up to the order of the f32 additions: the reference for the GPU arms, and how bf16 and
//! fp16 training are checked on machines without a GPU. [`GemmInput::cast_from_f32`] rounds f32
//! values into an operand type (round to nearest even; fp16 overflows to infinity).

use std::borrow::Cow;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use half::{bf16, f16};

use super::ops::{host, host_mut};
use super::{Device, DeviceBuffer};
use crate::device::cpu::matmul::{matmul, Mat};
use crate::error::{Error, Result};

/// Element type of a GEMM operand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmInput {
    /// IEEE single precision.
    F32,
    /// bfloat16 (bit patterns, as written by `ops::cast_f32_to_bf16`).
    Bf16,
    /// IEEE binary16 (bit patterns, as written by `ops::cast_f32_to_f16`).
    F16,
}

impl GemmInput {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            GemmInput::F32 => 4,
            GemmInput::Bf16 | GemmInput::F16 => 2,
        }
    }

    /// out (N) in this type = inp (N) f32, rounded to nearest even (the 16-bit copy of f32
    /// values a product reads); an error for f32, which products read in place.
    pub fn cast_from_f32(self, dev: &Device, out: &mut DeviceBuffer, inp: &DeviceBuffer, n: usize) -> Result<()> {
        match self {
            GemmInput::Bf16 => super::ops::cast_f32_to_bf16(dev, out, inp, n),
            GemmInput::F16 => super::ops::cast_f32_to_f16(dev, out, inp, n),
            GemmInput::F32 => Err(Error::Check("an f32 operand needs no 16-bit copy".into())),
        }
    }
}

/// One operand of a product: a buffer, its element type, and whether it is stored transposed.
#[derive(Clone, Copy)]
pub struct Operand<'a> {
    /// The elements, row-major.
    pub buf: &'a DeviceBuffer,
    /// Element type.
    pub dtype: GemmInput,
    /// Stored as the transpose of the operand the product uses.
    pub transposed: bool,
}

impl<'a> Operand<'a> {
    /// `buf` used as stored.
    pub fn plain(buf: &'a DeviceBuffer, dtype: GemmInput) -> Self {
        Operand { buf, dtype, transposed: false }
    }

    /// `buf` used transposed.
    pub fn t(buf: &'a DeviceBuffer, dtype: GemmInput) -> Self {
        Operand { buf, dtype, transposed: true }
    }
}

/// Where the matrices of a batched product lie, in elements of each buffer's type: product `i`
/// reads `a` from element `a.0 + i * a.1`, `b` from `b.0 + i * b.1`, and writes `c` from
/// `c.0 + i * c.1` (each `(offset, stride)`).
#[derive(Debug, Clone, Copy)]
pub struct Batch {
    /// Number of products.
    pub count: usize,
    /// (offset, stride) of the results.
    pub c: (usize, usize),
    /// (offset, stride) of the first operands.
    pub a: (usize, usize),
    /// (offset, stride) of the second operands.
    pub b: (usize, usize),
}

impl Batch {
    /// One product of matrices stored from the start of each buffer.
    pub const ONE: Batch = Batch { count: 1, c: (0, 0), a: (0, 0), b: (0, 0) };
}

/// A BLAS handle for one device (freed on drop).
pub struct Gemm {
    imp: Imp,
}

enum Imp {
    Cpu,
    Cuda(cudarc::cublas::CudaBlas),
    Hip(rocblas::RocBlas),
}

/// The column-major BLAS call computing the row-major `c (M, N) = op(a) · op(b)`: it computes
/// `cᵀ (N, M) = op(b)ᵀ · op(a)ᵀ`, so its first operand is `b`'s storage and its second `a`'s,
/// each with the transposition flag of the row-major operand.
#[derive(Debug)]
pub(crate) struct ColMajor {
    /// Rows and columns of the column-major result, and the summed dimension.
    pub m: i32,
    pub n: i32,
    pub k: i32,
    /// Transpose the first (`b`) / second (`a`) operand.
    pub t_first: bool,
    pub t_second: bool,
    /// Leading dimensions of the first operand, the second, and the result.
    pub ld_first: i32,
    pub ld_second: i32,
    pub ldc: i32,
    /// Element types of the first and second operand.
    pub ty_first: GemmInput,
    pub ty_second: GemmInput,
    /// 1 to accumulate into the result, 0 to overwrite it.
    pub beta: f32,
    /// Elements between consecutive products' first operands, second operands and results.
    pub stride_first: i64,
    pub stride_second: i64,
    pub stride_c: i64,
    /// Number of products.
    pub count: i32,
}

impl ColMajor {
    /// The call for checked dimensions (each fits `i32`, strides `i64`).
    pub(crate) fn new(a: &Operand, b: &Operand, (m, n, k): (usize, usize, usize), batch: &Batch, accumulate: bool) -> Self {
        ColMajor {
            m: n as i32,
            n: m as i32,
            k: k as i32,
            t_first: b.transposed,
            t_second: a.transposed,
            ld_first: if b.transposed { k } else { n } as i32,
            ld_second: if a.transposed { m } else { k } as i32,
            ldc: n as i32,
            ty_first: b.dtype,
            ty_second: a.dtype,
            beta: if accumulate { 1.0 } else { 0.0 },
            stride_first: batch.b.1 as i64,
            stride_second: batch.a.1 as i64,
            stride_c: batch.c.1 as i64,
            count: batch.count as i32,
        }
    }
}

impl Gemm {
    /// A handle on `dev`: a clean error when the device's BLAS library is missing.
    pub fn new(dev: &Device) -> Result<Self> {
        let imp = match dev {
            Device::Cpu | Device::Emu(_) => Imp::Cpu,
            Device::Cuda(d) => {
                // SAFETY: only tries to dlopen the library names cudarc knows.
                if !unsafe { cudarc::cublas::sys::is_culib_present() } {
                    return Err(Error::Device("cuda: libcublas.so not found (install the CUDA toolkit's cuBLAS)".into()));
                }
                let blas = cudarc::cublas::CudaBlas::new(d.stream().clone())
                    .map_err(|e| Error::Device(format!("cuda: cuBLAS handle: {e:?}")))?;
                Imp::Cuda(blas)
            }
            Device::Hip(_) => Imp::Hip(rocblas::RocBlas::open()?),
        };
        Ok(Gemm { imp })
    }

    /// `c (M, N) = op(a) · op(b)` (`accumulate`: `c +=`), summed over `k`, queued on `dev`.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        &self,
        dev: &Device,
        c: &mut DeviceBuffer,
        a: Operand,
        b: Operand,
        m: usize,
        n: usize,
        k: usize,
        accumulate: bool,
    ) -> Result<()> {
        self.matmul_batched(dev, c, a, b, (m, n, k), &Batch::ONE, accumulate)
    }

    /// `batch.count` products `c_i (M, N) = op(a_i) · op(b_i)` (`accumulate`: `c_i +=`), the
    /// matrices placed as `batch` says, queued on `dev` as one BLAS call. `dims` = (M, N, K).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_batched(
        &self,
        dev: &Device,
        c: &mut DeviceBuffer,
        a: Operand,
        b: Operand,
        (m, n, k): (usize, usize, usize),
        batch: &Batch,
        accumulate: bool,
    ) -> Result<()> {
        let shape = || format!("{} x ({m}x{k} by {k}x{n})", batch.count);
        for (what, buf, elems, size, (offset, stride)) in [
            ("c", &*c, m * n, 4, batch.c),
            ("a", a.buf, m * k, a.dtype.size(), batch.a),
            ("b", b.buf, k * n, b.dtype.size(), batch.b),
        ] {
            let need = if batch.count == 0 { 0 } else { (offset + (batch.count - 1) * stride + elems) * size };
            if buf.len() < need {
                return Err(Error::InvalidArgument(format!(
                    "gemm ({}): `{what}` holds {} bytes, the shape needs {need}",
                    shape(),
                    buf.len()
                )));
            }
        }
        if batch.count == 0 || m == 0 || n == 0 {
            return Ok(());
        }
        if k == 0 {
            // An empty sum: BLAS rejects a leading dimension of 0, and the product is zero.
            return match (accumulate, batch.count, batch.c.0) {
                (true, _, _) => Ok(()),
                (false, 1, 0) => super::ops::fill_zero(dev, c, m * n),
                _ => Err(Error::InvalidArgument(format!("gemm ({}): a batched product with K = 0", shape()))),
            };
        }
        let dims = [m, n, k, batch.count];
        if dims.iter().any(|&d| i32::try_from(d).is_err()) {
            return Err(Error::InvalidArgument(format!("gemm: dimensions {dims:?} exceed i32")));
        }
        // A BLAS library's call: the result, then b's storage first and a's second.
        let blas_call = |c: &DeviceBuffer| -> Result<((u64, u64, u64), ColMajor)> {
            let ptr = |buf: &DeviceBuffer, elems: usize, size: usize| buf.device_address(dev, "gemm", elems * size);
            let ptrs = (ptr(c, batch.c.0, 4)?, ptr(b.buf, batch.b.0, b.dtype.size())?, ptr(a.buf, batch.a.0, a.dtype.size())?);
            Ok((ptrs, ColMajor::new(&a, &b, (m, n, k), batch, accumulate)))
        };
        match &self.imp {
            Imp::Cpu => cpu_matmul(c, a, b, (m, n, k), batch, accumulate),
            Imp::Cuda(blas) => {
                let (ptrs, call) = blas_call(c)?;
                cublas_gemm(blas, ptrs, &call, shape)
            }
            Imp::Hip(blas) => {
                let (ptrs, call) = blas_call(c)?;
                blas.gemm(ptrs, &call, shape)
            }
        }
    }
}

/// `elems` values of the operand from element `offset`, as f32: an f32 operand in place (a copy
/// of the tied embedding would hold another 154 MB for d12), bf16 and fp16 widened exactly into a copy.
fn widen<'a>(op: &Operand<'a>, offset: usize, elems: usize) -> Result<Cow<'a, [f32]>> {
    let h = host("gemm", op.buf)?;
    Ok(match op.dtype {
        GemmInput::F32 => Cow::Borrowed(&h.view::<f32>(offset + elems)[offset..]),
        GemmInput::Bf16 => Cow::Owned(h.view::<bf16>(offset + elems)[offset..].iter().map(|x| x.to_f32()).collect()),
        GemmInput::F16 => Cow::Owned(h.view::<f16>(offset + elems)[offset..].iter().map(|x| x.to_f32()).collect()),
    })
}

/// Nanoseconds the CPU device has spent in products since the process started (16-bit
/// operands' widening included): `bench step` splits a step into its GEMMs and the rest by it.
static CPU_GEMM_NANOS: AtomicU64 = AtomicU64::new(0);

/// Seconds the CPU device has spent in products so far (see [`CPU_GEMM_NANOS`]).
pub fn cpu_gemm_seconds() -> f64 {
    CPU_GEMM_NANOS.load(Ordering::Relaxed) as f64 * 1e-9
}

/// The batch as a loop of CPU products (sizes checked by the caller), its time counted.
fn cpu_matmul(c: &mut DeviceBuffer, a: Operand, b: Operand, shape: (usize, usize, usize), batch: &Batch, accumulate: bool) -> Result<()> {
    let start = Instant::now();
    let done = cpu_products(c, a, b, shape, batch, accumulate);
    CPU_GEMM_NANOS.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
    done
}

fn cpu_products(c: &mut DeviceBuffer, a: Operand, b: Operand, (m, n, k): (usize, usize, usize), batch: &Batch, accumulate: bool) -> Result<()> {
    let c_len = batch.c.0 + (batch.count - 1) * batch.c.1 + m * n;
    let cv = host_mut("gemm", c)?.view_mut::<f32>(c_len);
    for i in 0..batch.count {
        let av = widen(&a, batch.a.0 + i * batch.a.1, m * k)?;
        let bv = widen(&b, batch.b.0 + i * batch.b.1, k * n)?;
        let am = if a.transposed { Mat::t(&av, k, m) } else { Mat::new(&av, m, k) };
        let bm = if b.transposed { Mat::t(&bv, n, k) } else { Mat::new(&bv, k, n) };
        let ci = batch.c.0 + i * batch.c.1;
        matmul(&mut cv[ci..ci + m * n], am, bm, accumulate);
    }
    Ok(())
}

/// Runs `call` on cuBLAS; `ptrs` = (result, first operand, second operand).
fn cublas_gemm(
    blas: &cudarc::cublas::CudaBlas,
    (pc, p1, p2): (u64, u64, u64),
    call: &ColMajor,
    shape: impl Fn() -> String,
) -> Result<()> {
    use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
    let op = |t: bool| if t { cublasOperation_t::CUBLAS_OP_T } else { cublasOperation_t::CUBLAS_OP_N };
    let ty = |d: GemmInput| match d {
        GemmInput::F32 => cudaDataType::CUDA_R_32F,
        GemmInput::Bf16 => cudaDataType::CUDA_R_16BF,
        GemmInput::F16 => cudaDataType::CUDA_R_16F,
    };
    let alpha = 1.0f32;
    // SAFETY: Gemm::matmul_batched checked that the three buffers hold the elements the shapes
    // and batch strides index;
    // all pointers are device memory of this handle's context; alpha and beta are host f32 (the
    // handle's default pointer mode); the call is queued on the device's only stream.
    unsafe {
        cudarc::cublas::result::gemm_strided_batched_ex(
            *blas.handle(),
            op(call.t_first),
            op(call.t_second),
            call.m,
            call.n,
            call.k,
            (&alpha as *const f32).cast::<c_void>(),
            p1 as *const c_void,
            ty(call.ty_first),
            call.ld_first,
            call.stride_first,
            p2 as *const c_void,
            ty(call.ty_second),
            call.ld_second,
            call.stride_second,
            (&call.beta as *const f32).cast::<c_void>(),
            pc as *mut c_void,
            cudaDataType::CUDA_R_32F,
            call.ldc,
            call.stride_c,
            call.count,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| Error::Device(format!("cuda: cublasGemmStridedBatchedEx ({}): {e:?}", shape())))
}

/// rocBLAS, loaded at run time (ROCm >= 4 `rocblas_gemm_strided_batched_ex` signature) on the null stream, which
/// is the stream every HIP launch of meshtrain uses.
mod rocblas {
    use std::ffi::c_void;

    use libloading::Library;

    use super::{ColMajor, GemmInput};
    use crate::error::{Error, Result};

    type Handle = *mut c_void;
    const OP_NONE: i32 = 111;
    const OP_TRANSPOSE: i32 = 112;
    const F32_R: i32 = 151;
    const BF16_R: i32 = 168;
    const F16_R: i32 = 150;
    const ALGO_STANDARD: i32 = 0;

    type CreateFn = unsafe extern "C" fn(*mut Handle) -> i32;
    type DestroyFn = unsafe extern "C" fn(Handle) -> i32;
    #[allow(clippy::type_complexity)]
    type GemmStridedBatchedExFn = unsafe extern "C" fn(
        Handle, i32, i32, i32, i32, i32,
        *const c_void, *const c_void, i32, i32, i64,
        *const c_void, i32, i32, i64,
        *const c_void, *mut c_void, i32, i32, i64,
        *mut c_void, i32, i32, i64,
        i32, i32, i32, i32, u32,
    ) -> i32;

    pub(super) struct RocBlas {
        handle: Handle,
        gemm: GemmStridedBatchedExFn,
        destroy: DestroyFn,
    }

    /// rocBLAS, loaded once and never unloaded (unloading ROCm libraries at exit has crashed
    /// processes): the development symlink, the runtime names of ROCm 6 and 5, then the same
    /// under `$ROCM_PATH/lib` (default `/opt/rocm/lib`), which is often not on the loader path.
    fn load() -> Result<&'static Library> {
        static LIB: std::sync::OnceLock<std::result::Result<Library, String>> = std::sync::OnceLock::new();
        let lib = LIB.get_or_init(|| {
            let root = std::env::var("ROCM_PATH").unwrap_or_else(|_| "/opt/rocm".into());
            let names = ["librocblas.so", "librocblas.so.4", "librocblas.so.0"];
            let candidates = names.iter().map(|n| n.to_string()).chain(names.iter().map(|n| format!("{root}/lib/{n}")));
            let mut tried = Vec::new();
            for path in candidates {
                // SAFETY: loading rocBLAS runs its initializers, which only set up the library.
                match unsafe { Library::new(&path) } {
                    Ok(l) => return Ok(l),
                    Err(e) => tried.push(format!("{path}: {e}")),
                }
            }
            Err(tried.join("; "))
        });
        lib.as_ref().map_err(|e| lib_err("not found (install ROCm's rocBLAS)", e))
    }

    fn lib_err(what: &str, e: impl std::fmt::Display) -> Error {
        Error::Device(format!("hip: rocBLAS {what}: {e}"))
    }

    impl RocBlas {
        pub(super) fn open() -> Result<Self> {
            let lib = load()?;
            // SAFETY: the symbol types are those of rocblas.h (ROCm >= 4).
            let (create, destroy, gemm) = unsafe {
                (
                    *lib.get::<CreateFn>(b"rocblas_create_handle\0").map_err(|e| lib_err("symbol", e))?,
                    *lib.get::<DestroyFn>(b"rocblas_destroy_handle\0").map_err(|e| lib_err("symbol", e))?,
                    *lib.get::<GemmStridedBatchedExFn>(b"rocblas_gemm_strided_batched_ex\0").map_err(|e| lib_err("symbol", e))?,
                )
            };
            let mut handle: Handle = std::ptr::null_mut();
            // SAFETY: `handle` is a valid out-pointer.
            let status = unsafe { create(&mut handle) };
            if status != 0 {
                return Err(lib_err("create handle", format!("status {status}")));
            }
            Ok(RocBlas { handle, gemm, destroy })
        }

        /// Runs `call`; `ptrs` = (result, first operand, second operand).
        pub(super) fn gemm(&self, (pc, p1, p2): (u64, u64, u64), call: &ColMajor, shape: impl Fn() -> String) -> Result<()> {
            let op = |t: bool| if t { OP_TRANSPOSE } else { OP_NONE };
            let ty = |d: GemmInput| match d {
                GemmInput::F32 => F32_R,
                GemmInput::Bf16 => BF16_R,
                GemmInput::F16 => F16_R,
            };
            let alpha = 1.0f32;
            let c = pc as *mut c_void;
            // SAFETY: Gemm::matmul_batched checked the buffer sizes for the strides; C and D are the same buffer, which
            // rocBLAS allows when their types and leading dimensions agree; alpha and beta are
            // host f32 (the default pointer mode).
            let status = unsafe {
                (self.gemm)(
                    self.handle, op(call.t_first), op(call.t_second), call.m, call.n, call.k,
                    (&alpha as *const f32).cast(), p1 as *const c_void, ty(call.ty_first), call.ld_first, call.stride_first,
                    p2 as *const c_void, ty(call.ty_second), call.ld_second, call.stride_second,
                    (&call.beta as *const f32).cast(), c, F32_R, call.ldc, call.stride_c,
                    c, F32_R, call.ldc, call.stride_c,
                    call.count, F32_R, ALGO_STANDARD, 0, 0,
                )
            };
            if status != 0 {
                return Err(lib_err(&format!("rocblas_gemm_strided_batched_ex ({})", shape()), format!("status {status}")));
            }
            Ok(())
        }
    }

    impl Drop for RocBlas {
        fn drop(&mut self) {
            // SAFETY: the handle came from rocblas_create_handle and is destroyed once.
            unsafe { (self.destroy)(self.handle) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Row-major product of small integer matrices (exact in f32, bf16 and fp16).
    fn reference(a: &[f32], b: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
        let mut c = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
            }
        }
        c
    }

    fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        let mut t = vec![0f32; x.len()];
        for r in 0..rows {
            for c in 0..cols {
                t[c * rows + r] = x[r * cols + c];
            }
        }
        t
    }

    fn upload(dev: &Device, x: &[f32], dtype: GemmInput) -> DeviceBuffer {
        match dtype {
            GemmInput::F32 => dev.upload(x).unwrap(),
            GemmInput::Bf16 => dev.upload(&x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>()).unwrap(),
            GemmInput::F16 => dev.upload(&x.iter().map(|&v| f16::from_f32(v)).collect::<Vec<_>>()).unwrap(),
        }
    }

    #[test]
    fn every_transposition_and_type_on_the_cpu_arm() {
        let dev = Device::Cpu;
        let gemm = Gemm::new(&dev).unwrap();
        let (m, n, k) = (5, 3, 7);
        let a: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 - 3.0).collect(); // (M, K)
        let b: Vec<f32> = (0..k * n).map(|i| (i % 5) as f32 - 2.0).collect(); // (K, N)
        let want = reference(&a, &b, m, n, k);
        for dtype in [GemmInput::F32, GemmInput::Bf16, GemmInput::F16] {
            for (a_t, b_t) in [(false, false), (true, false), (false, true), (true, true)] {
                let a_store = if a_t { transpose(&a, m, k) } else { a.clone() };
                let b_store = if b_t { transpose(&b, k, n) } else { b.clone() };
                let (ab, bb) = (upload(&dev, &a_store, dtype), upload(&dev, &b_store, dtype));
                let mut c = dev.upload(&vec![1f32; m * n]).unwrap();
                let op = |buf, t| Operand { buf, dtype, transposed: t };
                gemm.matmul(&dev, &mut c, op(&ab, a_t), op(&bb, b_t), m, n, k, true).unwrap();
                let mut got = vec![0f32; m * n];
                dev.copy_to_host(&c, &mut got).unwrap();
                let plus_one: Vec<f32> = want.iter().map(|x| x + 1.0).collect();
                assert_eq!(got, plus_one, "{dtype:?} a_t={a_t} b_t={b_t}");
            }
        }
    }

    #[test]
    fn column_major_arguments_follow_the_transpose_identity() {
        let (x, y) = (DeviceBuffer::Host(crate::device::HostBytes::zeroed(0)), DeviceBuffer::Host(crate::device::HostBytes::zeroed(0)));
        // c (2, 3) = a (2, 4) · b (4, 3): cᵀ (3, 2) = bᵀ · aᵀ with leading dimensions 3 and 4.
        let call = ColMajor::new(&Operand::plain(&x, GemmInput::F32), &Operand::plain(&y, GemmInput::Bf16), (2, 3, 4), &Batch::ONE, false);
        assert_eq!((call.m, call.n, call.k, call.ld_first, call.ld_second, call.ldc), (3, 2, 4, 3, 4, 3));
        assert_eq!((call.ty_first, call.ty_second, call.beta), (GemmInput::Bf16, GemmInput::F32, 0.0));
        // a stored (4, 2), b stored (3, 4).
        let batch = Batch { count: 5, c: (1, 7), a: (2, 11), b: (3, 13) };
        let call = ColMajor::new(&Operand::t(&x, GemmInput::F32), &Operand::t(&y, GemmInput::F32), (2, 3, 4), &batch, true);
        assert_eq!((call.t_first, call.t_second, call.ld_first, call.ld_second, call.beta), (true, true, 4, 2, 1.0));
        // The first operand is b's storage: its stride is b's; the second's is a's.
        assert_eq!((call.stride_first, call.stride_second, call.stride_c, call.count), (13, 11, 7, 5));
    }

    /// Every transposition and type of a strided batch with offsets and gaps between the
    /// matrices, against the naive product of each batch item; the gaps and the head before the
    /// first result stay untouched.
    #[test]
    fn strided_batches_match_a_loop_of_naive_products() {
        let dev = Device::Cpu;
        let gemm = Gemm::new(&dev).unwrap();
        let (m, n, k, count) = (4, 3, 5, 3);
        let batch = Batch { count, c: (2, m * n + 1), a: (3, m * k + 2), b: (1, k * n + 4) };
        let len = |(offset, stride): (usize, usize), elems| offset + (count - 1) * stride + elems;
        let pattern = |n: usize, p: usize| (0..n).map(|i| ((i * 7 + p) % 9) as f32 - 4.0).collect::<Vec<f32>>();
        let (a_all, b_all) = (pattern(len(batch.a, m * k), 1), pattern(len(batch.b, k * n), 2)); // stored
        for dtype in [GemmInput::F32, GemmInput::Bf16, GemmInput::F16] {
            for (a_t, b_t) in [(false, false), (true, false), (false, true), (true, true)] {
                let c0 = pattern(len(batch.c, m * n), 3);
                let mut want = c0.clone();
                for i in 0..count {
                    let a_i = &a_all[batch.a.0 + i * batch.a.1..][..m * k];
                    let b_i = &b_all[batch.b.0 + i * batch.b.1..][..k * n];
                    let a_i = if a_t { transpose(a_i, k, m) } else { a_i.to_vec() }; // (M, K)
                    let b_i = if b_t { transpose(b_i, n, k) } else { b_i.to_vec() }; // (K, N)
                    let prod = reference(&a_i, &b_i, m, n, k);
                    let c_i = &mut want[batch.c.0 + i * batch.c.1..][..m * n];
                    c_i.iter_mut().zip(&prod).for_each(|(c, p)| *c += p);
                }
                let (ab, bb) = (upload(&dev, &a_all, dtype), upload(&dev, &b_all, dtype));
                let mut c = dev.upload(&c0).unwrap();
                let op = |buf, t| Operand { buf, dtype, transposed: t };
                gemm.matmul_batched(&dev, &mut c, op(&ab, a_t), op(&bb, b_t), (m, n, k), &batch, true).unwrap();
                let mut got = vec![0f32; c0.len()];
                dev.copy_to_host(&c, &mut got).unwrap();
                assert_eq!(got, want, "{dtype:?} a_t={a_t} b_t={b_t}");
            }
        }
        let short = Batch { c: (3, m * n + 1), ..batch };
        let (ab, bb) = (upload(&dev, &a_all, GemmInput::F32), upload(&dev, &b_all, GemmInput::F32));
        let mut c = dev.upload(&pattern(len(batch.c, m * n), 3)).unwrap();
        let err = gemm
            .matmul_batched(&dev, &mut c, Operand::plain(&ab, GemmInput::F32), Operand::plain(&bb, GemmInput::F32), (m, n, k), &short, false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("`c`"), "{err}");
    }

    #[test]
    fn short_buffers_are_rejected_with_the_operand_named() {
        let dev = Device::Cpu;
        let gemm = Gemm::new(&dev).unwrap();
        let (a, b) = (dev.alloc(4 * 6).unwrap(), dev.alloc(4 * 5).unwrap());
        let mut c = dev.alloc(4 * 4).unwrap();
        let err = gemm
            .matmul(&dev, &mut c, Operand::plain(&a, GemmInput::F32), Operand::plain(&b, GemmInput::F32), 2, 2, 3, false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("`b`"), "{err}");
    }
}
