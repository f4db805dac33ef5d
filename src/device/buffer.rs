//! [`DeviceBuffer`]: untyped device memory of one arm, freed when dropped.
//!
//! A buffer remembers its arm; using it with a device of another arm is an error, never a wild
//! pointer. Sizes are in bytes. The CPU arm's bytes are 8-byte aligned ([`HostBytes`]), so the
//! CPU versions of the kernels (`ops.rs`) view them as `f32`, `u32` or `u16` slices in place.

use bytemuck::Pod;

use super::{CudaBuffer, Device, HipBuffer};
use crate::error::{Error, Result};

/// Zeroed host bytes, 8-byte aligned (backed by `u64` words).
pub struct HostBytes {
    words: Vec<u64>,
    len: usize,
}

impl HostBytes {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> Self {
        HostBytes { words: vec![0; len.div_ceil(8)], len }
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }

    /// The bytes, mutable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.len]
    }

    /// The first `n` elements viewed as `T` (alignment holds for any `T` of at most 8 bytes).
    pub(crate) fn view<T: Pod>(&self, n: usize) -> &[T] {
        &bytemuck::cast_slice(&self.bytes()[..n * std::mem::size_of::<T>()])[..n]
    }

    /// The first `n` elements viewed as `T`, mutable.
    pub(crate) fn view_mut<T: Pod>(&mut self, n: usize) -> &mut [T] {
        &mut bytemuck::cast_slice_mut(&mut self.bytes_mut()[..n * std::mem::size_of::<T>()])[..n]
    }
}

/// Bytes owned by one device.
pub enum DeviceBuffer {
    /// Host memory of the CPU device.
    Host(HostBytes),
    /// CUDA device memory.
    Cuda(CudaBuffer),
    /// HIP device memory.
    Hip(HipBuffer),
}

impl DeviceBuffer {
    /// Size in bytes.
    pub fn len(&self) -> usize {
        match self {
            DeviceBuffer::Host(v) => v.len,
            DeviceBuffer::Cuda(b) => b.len(),
            DeviceBuffer::Hip(b) => b.len(),
        }
    }

    /// True for a buffer of zero bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn arm(&self) -> &'static str {
        match self {
            DeviceBuffer::Host(_) => "cpu",
            DeviceBuffer::Cuda(_) => "cuda",
            DeviceBuffer::Hip(_) => "hip",
        }
    }

    /// The device address `offset` bytes in, for a kernel argument on `dev`.
    pub(crate) fn device_address(&self, dev: &Device, kernel: &str, offset: usize) -> Result<u64> {
        if offset > self.len() {
            return Err(Error::InvalidArgument(format!(
                "kernel {kernel}: offset {offset} past the end of a {}-byte buffer",
                self.len()
            )));
        }
        match (dev, self) {
            (Device::Cuda(_), DeviceBuffer::Cuda(b)) => Ok(b.address() + offset as u64),
            (Device::Hip(_), DeviceBuffer::Hip(b)) => Ok(b.address() + offset as u64),
            _ => Err(wrong_device(kernel, dev, self)),
        }
    }
}

/// Error for a copy of `want` bytes that does not fit a `have`-byte buffer.
pub(crate) fn check_len(op: &str, have: usize, want: usize) -> Result<()> {
    if want > have {
        return Err(Error::InvalidArgument(format!(
            "{op}: {want} bytes do not fit a {have}-byte buffer"
        )));
    }
    Ok(())
}

/// Error for a buffer used with a device of another arm.
pub(crate) fn wrong_device(op: &str, dev: &Device, buf: &DeviceBuffer) -> Error {
    let dev = match dev {
        Device::Cpu => "cpu",
        Device::Cuda(_) => "cuda",
        Device::Hip(_) => "hip",
    };
    Error::InvalidArgument(format!("{op}: a {} buffer used with the {dev} device", buf.arm()))
}
