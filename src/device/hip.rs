//! The HIP arm (AMD GPUs), compiled only with the cargo feature `hip`; without it the types
//! exist but cannot be built, and [`HipDevice::open`] returns [`Error::NotCompiled`], so the
//! public API is the same in every build.
//!
//! With the feature: the HIP runtime picks GPU `local_rank % visible_count` for the calling
//! thread, the kernels are compiled by `hipcc` at open time for `MESHTRAIN_HIP_ARCH` (default
//! `gfx90a`, MI200) and loaded as one code object. All work runs on the null stream of the
//! thread that opened the device, in order.

use super::{LaunchDims, RawArg};
use crate::error::Result;

pub(crate) use imp::{HipEvent, HipExport, HipMapping, HipPinned};

#[cfg(not(feature = "hip"))]
mod imp {
    use super::{LaunchDims, RawArg};
    use crate::error::{Error, Result};

    /// No value of this type exists in a build without HIP.
    enum Never {}

    pub struct HipDevice(Never);
    pub struct HipBuffer(Never);

    impl HipBuffer {
        pub fn len(&self) -> usize {
            match self.0 {}
        }
        pub fn address(&self) -> u64 {
            match self.0 {}
        }
    }

    impl HipDevice {
        pub fn open(_local_rank: usize) -> Result<HipDevice> {
            Err(Error::NotCompiled("HIP"))
        }
        pub fn alloc(&self, _bytes: usize) -> Result<HipBuffer> {
            match self.0 {}
        }
        pub fn copy_to_device(&self, _dst: &mut HipBuffer, _src: &[u8]) -> Result<()> {
            match self.0 {}
        }
        pub fn copy_to_host(&self, _src: &HipBuffer, _dst: &mut [u8]) -> Result<()> {
            match self.0 {}
        }
        pub fn copy_on_device(&self, _dst: &mut HipBuffer, _src: &HipBuffer) -> Result<()> {
            match self.0 {}
        }
        pub fn launch(&self, _name: &str, _dims: LaunchDims, _args: &[RawArg]) -> Result<()> {
            match self.0 {}
        }
        pub fn synchronize(&self) -> Result<()> {
            match self.0 {}
        }
        pub fn lane(&self) -> HipDevice {
            match self.0 {}
        }
        pub fn bind_thread(&self) -> Result<()> {
            match self.0 {}
        }
        pub fn ordinal(&self) -> usize {
            match self.0 {}
        }
        pub fn alloc_pinned(&self, _bytes: usize) -> Result<HipPinned> {
            match self.0 {}
        }
        pub unsafe fn download_async(&self, _src: &HipBuffer, _off: usize, _dst: *mut u8, _len: usize) -> Result<()> {
            match self.0 {}
        }
        pub unsafe fn upload_async(&self, _dst: &HipBuffer, _off: usize, _src: *const u8, _len: usize) -> Result<()> {
            match self.0 {}
        }
        pub fn event(&self) -> Result<HipEvent> {
            match self.0 {}
        }
        pub fn record(&self, _event: &HipEvent) -> Result<()> {
            match self.0 {}
        }
        pub fn export(&self, _buf: &HipBuffer) -> Result<HipExport> {
            match self.0 {}
        }
        pub fn open_ipc(&self, _handle: &[u8; 64]) -> Result<HipMapping> {
            match self.0 {}
        }
    }

    pub struct HipPinned(Never);
    pub struct HipEvent(Never);
    pub struct HipMapping(Never);
    pub struct HipExport {
        pub handle: [u8; 64],
        pub offset: u64,
    }

    impl HipBuffer {
        pub unsafe fn borrowed(_address: u64, _len: usize) -> HipBuffer {
            unreachable!("no HIP device exists in a build without HIP, so nothing borrows its memory")
        }
    }

    impl HipPinned {
        pub fn as_mut_ptr(&mut self) -> *mut u8 {
            match self.0 {}
        }
        pub fn len(&self) -> usize {
            match self.0 {}
        }
    }

    impl HipEvent {
        pub fn synchronize(&self) -> Result<()> {
            match self.0 {}
        }
    }

    impl HipMapping {
        pub fn address(&self) -> u64 {
            match self.0 {}
        }
    }
}

#[cfg(feature = "hip")]
#[path = "hip_runtime.rs"]
mod imp;

/// An opened AMD GPU with the meshtrain kernels loaded.
pub struct HipDevice(imp::HipDevice);

/// Device memory of a [`HipDevice`], freed on drop.
pub struct HipBuffer(imp::HipBuffer);

impl HipBuffer {
    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True for a zero-byte buffer.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn address(&self) -> u64 {
        self.0.address()
    }

    /// A buffer naming `len` bytes at `address` that frees nothing.
    ///
    /// # Safety
    /// The memory must stay allocated while the result (or anything queued with it) is in use.
    pub(crate) unsafe fn borrowed(address: u64, len: usize) -> HipBuffer {
        HipBuffer(imp::HipBuffer::borrowed(address, len))
    }
}

impl HipDevice {
    /// Opens GPU `local_rank % visible_count` and loads the kernels (`NotCompiled` without the
    /// `hip` feature).
    pub fn open(local_rank: usize) -> Result<HipDevice> {
        imp::HipDevice::open(local_rank).map(HipDevice)
    }

    /// Ordinal among the visible GPUs.
    pub fn ordinal(&self) -> usize {
        self.0.ordinal()
    }

    /// The same GPU and kernels for another thread (the HIP arm's one queue is the null stream).
    pub(crate) fn lane(&self) -> HipDevice {
        HipDevice(self.0.lane())
    }

    /// Makes this GPU current on the calling thread.
    pub(crate) fn bind_thread(&self) -> Result<()> {
        self.0.bind_thread()
    }

    pub(crate) fn alloc(&self, bytes: usize) -> Result<HipBuffer> {
        self.0.alloc(bytes).map(HipBuffer)
    }

    pub(crate) fn copy_to_device(&self, dst: &mut HipBuffer, src: &[u8]) -> Result<()> {
        self.0.copy_to_device(&mut dst.0, src)
    }

    pub(crate) fn copy_to_host(&self, src: &HipBuffer, dst: &mut [u8]) -> Result<()> {
        self.0.copy_to_host(&src.0, dst)
    }

    pub(crate) fn copy_on_device(&self, dst: &mut HipBuffer, src: &HipBuffer) -> Result<()> {
        self.0.copy_on_device(&mut dst.0, &src.0)
    }

    pub(crate) fn launch(&self, name: &str, dims: LaunchDims, args: &[RawArg]) -> Result<()> {
        self.0.launch(name, dims, args)
    }

    pub(crate) fn synchronize(&self) -> Result<()> {
        self.0.synchronize()
    }

    /// `bytes` of page-locked host memory.
    pub(crate) fn alloc_pinned(&self, bytes: usize) -> Result<HipPinned> {
        self.0.alloc_pinned(bytes)
    }

    /// See `CudaDevice::download_async`.
    ///
    /// # Safety
    /// `dst..dst+len` stays valid and untouched until an event recorded after this call completed.
    pub(crate) unsafe fn download_async(&self, src: &HipBuffer, offset: usize, dst: *mut u8, len: usize) -> Result<()> {
        self.0.download_async(&src.0, offset, dst, len)
    }

    /// See `CudaDevice::upload_async`.
    ///
    /// # Safety
    /// `src..src+len` stays valid and unwritten until an event recorded after this call completed.
    pub(crate) unsafe fn upload_async(&self, dst: &HipBuffer, offset: usize, src: *const u8, len: usize) -> Result<()> {
        self.0.upload_async(&dst.0, offset, src, len)
    }

    pub(crate) fn event(&self) -> Result<HipEvent> {
        self.0.event()
    }

    pub(crate) fn record(&self, event: &HipEvent) -> Result<()> {
        self.0.record(event)
    }

    /// The IPC handle of the allocation holding `buf` and `buf`'s offset in it.
    pub(crate) fn export(&self, buf: &HipBuffer) -> Result<HipExport> {
        self.0.export(&buf.0)
    }

    /// Maps a peer process's allocation from its IPC handle.
    pub(crate) fn open_ipc(&self, handle: &[u8; 64]) -> Result<HipMapping> {
        self.0.open_ipc(handle)
    }
}
