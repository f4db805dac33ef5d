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
        pub fn ordinal(&self) -> usize {
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
}
