//! [`DeviceBuffer`]: untyped device memory of one arm, freed when dropped.
//!
//! A buffer remembers its arm; using it with a device of another arm is an error, never a wild
//! pointer. Sizes are in bytes. The CPU arm's bytes are 8-byte aligned ([`HostBytes`]), so the
//! CPU versions of the kernels (`ops.rs`) view them as `f32`, `u32` or `u16` slices in place. The
//! emu arm's buffers are host bytes too, between guard pages (`emu_memory.rs`), so the CPU code
//! paths that only move or multiply bytes (the gemm, staging copies) serve both arms.

use bytemuck::Pod;

use super::emu_memory::GuardedBytes;
use super::{CudaBuffer, Device, HipBuffer};
use crate::error::{Error, Result};

/// Zeroed host bytes, at least 8-byte aligned: `u64` words, or guarded pages for the emu arm.
pub struct HostBytes {
    memory: HostMemory,
    len: usize,
}

enum HostMemory {
    Words(Vec<u64>),
    Guarded(GuardedBytes),
}

impl HostBytes {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> Self {
        HostBytes { memory: HostMemory::Words(vec![0; len.div_ceil(8)]), len }
    }

    /// `len` zero bytes between guard pages (the emu arm's buffers).
    pub(crate) fn guarded(len: usize) -> Result<Self> {
        Ok(HostBytes { memory: HostMemory::Guarded(GuardedBytes::zeroed(len)?), len })
    }

    /// `len` zero bytes between guard pages that other processes can map (emu IPC).
    pub(crate) fn guarded_shared(len: usize) -> Result<Self> {
        Ok(HostBytes { memory: HostMemory::Guarded(GuardedBytes::shared(len)?), len })
    }

    /// Guarded memory owned elsewhere (a peer's mapping, or part of a buffer) as host bytes;
    /// frees nothing.
    pub(crate) fn from_guarded(g: GuardedBytes) -> Self {
        let len = g.bytes().len();
        HostBytes { memory: HostMemory::Guarded(g), len }
    }

    /// The guarded memory, for the emu arm's address and bounds checks.
    pub(crate) fn guard(&self) -> Option<&GuardedBytes> {
        match &self.memory {
            HostMemory::Guarded(g) => Some(g),
            HostMemory::Words(_) => None,
        }
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        match &self.memory {
            HostMemory::Words(w) => &bytemuck::cast_slice(w)[..self.len],
            HostMemory::Guarded(g) => g.bytes(),
        }
    }

    /// The bytes, mutable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        match &mut self.memory {
            HostMemory::Words(w) => &mut bytemuck::cast_slice_mut(w)[..self.len],
            HostMemory::Guarded(g) => g.bytes_mut(),
        }
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
    /// Guarded host memory of the emu arm.
    Emu(HostBytes),
}

impl DeviceBuffer {
    /// Size in bytes.
    pub fn len(&self) -> usize {
        match self {
            DeviceBuffer::Host(v) | DeviceBuffer::Emu(v) => v.len,
            DeviceBuffer::Cuda(b) => b.len(),
            DeviceBuffer::Hip(b) => b.len(),
        }
    }

    /// True for a buffer of zero bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The arm the buffer belongs to ("cpu", "cuda", "hip", "emu").
    pub(crate) fn arm(&self) -> &'static str {
        match self {
            DeviceBuffer::Host(_) => "cpu",
            DeviceBuffer::Cuda(_) => "cuda",
            DeviceBuffer::Hip(_) => "hip",
            DeviceBuffer::Emu(_) => "emu",
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
            (Device::Emu(_), DeviceBuffer::Emu(b)) => match b.guard() {
                Some(g) => Ok(g.address() + offset as u64),
                None => Err(wrong_device(kernel, dev, self)),
            },
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
    Error::InvalidArgument(format!("{op}: a {} buffer used with the {} device", buf.arm(), dev.arm()))
}
