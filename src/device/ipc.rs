//! Device memory shared between processes of one node, and buffers that borrow memory.
//!
//! [`export`] gives the IPC handle of the allocation that holds a buffer (plus the buffer's
//! offset in it); a peer process turns the handle into a [`Mapping`] with [`open`] and reads the
//! memory through [`Borrowed`] buffers, which kernels and copies accept like any
//! [`DeviceBuffer`] but which free nothing and cannot outlive what they borrow.
//!
//! Invariants: a mapping is closed when dropped, after its owner synchronized every use of it;
//! an exporting process must not free an allocation while a peer still holds a mapping of it
//! (the collectives that cache mappings say how they are released). The CPU arm has no IPC; the
//! emu arm's shareable buffers are memfd pages that peer processes of the node map
//! (`emu_memory.rs`), so the IPC paths run, bounds-checked, without a GPU.

use std::marker::PhantomData;
use std::ops::{Deref, DerefMut, Range};

use super::cuda::CudaMapping;
use super::emu_memory::GuardedBytes;
use super::hip::HipMapping;
use super::{CudaBuffer, Device, DeviceBuffer, HipBuffer, HostBytes};
use crate::error::{Error, Result};

/// What a peer needs to map a buffer of this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Export {
    /// The allocation's IPC handle (`CUipcMemHandle` / `hipIpcMemHandle_t` bytes).
    pub handle: [u8; 64],
    /// Offset of the buffer in that allocation, in bytes.
    pub offset: u64,
}

/// A peer's allocation mapped into this process.
pub enum Mapping {
    /// CUDA.
    Cuda(CudaMapping),
    /// HIP.
    Hip(HipMapping),
    /// emu: the peer's memfd pages between guard pages of this process.
    Emu(GuardedBytes),
}

/// The IPC handle of the allocation holding `buf`. Fails on the CPU arm and, for CUDA, for
/// memory from the stream-ordered pool (see [`alloc_shareable`]).
pub fn export(dev: &Device, buf: &DeviceBuffer) -> Result<Export> {
    match (dev, buf) {
        (Device::Cuda(d), DeviceBuffer::Cuda(b)) => d.export(b).map(|e| Export { handle: e.handle, offset: e.offset }),
        (Device::Hip(d), DeviceBuffer::Hip(b)) => d.export(b).map(|e| Export { handle: e.handle, offset: e.offset }),
        (Device::Emu(_), DeviceBuffer::Emu(b)) => match b.guard().and_then(GuardedBytes::export) {
            Some(handle) => Ok(Export { handle, offset: 0 }),
            None => Err(Error::InvalidArgument(
                "ipc: this emu buffer cannot be shared (allocate it with device::ipc::alloc_shareable)".into(),
            )),
        },
        (Device::Cpu, _) => Err(Error::InvalidArgument("ipc: the cpu device has no IPC handles".into())),
        (_, b) => Err(super::buffer::wrong_device("ipc export", dev, b)),
    }
}

/// Maps a peer process's allocation from its IPC handle.
pub fn open(dev: &Device, handle: &[u8; 64]) -> Result<Mapping> {
    match dev {
        Device::Cuda(d) => d.open_ipc(handle).map(Mapping::Cuda),
        Device::Hip(d) => d.open_ipc(handle).map(Mapping::Hip),
        Device::Emu(_) => GuardedBytes::open(handle).map(Mapping::Emu),
        Device::Cpu => Err(Error::InvalidArgument("ipc: the cpu device has no IPC handles".into())),
    }
}

/// A buffer whose memory other processes can map: on CUDA from `cuMemAlloc` rather than the
/// stream-ordered pool (freeing it waits for the stream: allocate once); on emu memfd pages; on HIP
/// and the CPU the same as [`Device::alloc`].
pub fn alloc_shareable(dev: &Device, bytes: usize) -> Result<DeviceBuffer> {
    match dev {
        Device::Cuda(d) => d.alloc_shareable(bytes).map(DeviceBuffer::Cuda),
        Device::Emu(_) => HostBytes::guarded_shared(bytes).map(DeviceBuffer::Emu),
        _ => dev.alloc(bytes),
    }
}

/// A [`DeviceBuffer`] naming memory owned by something that outlives `'a`; frees nothing.
pub struct Borrowed<'a> {
    buf: DeviceBuffer,
    _owner: PhantomData<&'a ()>,
}

impl Deref for Borrowed<'_> {
    type Target = DeviceBuffer;
    fn deref(&self) -> &DeviceBuffer {
        &self.buf
    }
}

impl DerefMut for Borrowed<'_> {
    fn deref_mut(&mut self) -> &mut DeviceBuffer {
        &mut self.buf
    }
}

fn out_of_range(what: &str, range: &Range<usize>, len: usize) -> Error {
    Error::InvalidArgument(format!("{what}: bytes {}..{} outside a {len}-byte buffer", range.start, range.end))
}

/// Bytes `range` of `buf` as a buffer of their own (GPU arms only). Writes through the result
/// need `buf` borrowed mutably, which is why this takes `&mut`.
pub fn part_mut<'a>(buf: &'a mut DeviceBuffer, range: Range<usize>) -> Result<Borrowed<'a>> {
    part_of(buf, range)
}

/// Bytes `range` of `buf` as a read-only buffer of their own (GPU arms only).
pub fn part<'a>(buf: &'a DeviceBuffer, range: Range<usize>) -> Result<Borrowed<'a>> {
    part_of(buf, range)
}

fn part_of<'a>(buf: &DeviceBuffer, range: Range<usize>) -> Result<Borrowed<'a>> {
    if range.start > range.end || range.end > buf.len() {
        return Err(out_of_range("buffer part", &range, buf.len()));
    }
    let (off, len) = (range.start as u64, range.len());
    // SAFETY: the range lies inside `buf` (checked above), which the caller's borrow keeps alive
    // for `'a`; the result frees nothing.
    let buf = unsafe {
        match buf {
            DeviceBuffer::Cuda(b) => DeviceBuffer::Cuda(CudaBuffer::borrowed(b.address() + off, len)),
            DeviceBuffer::Hip(b) => DeviceBuffer::Hip(HipBuffer::borrowed(b.address() + off, len)),
            DeviceBuffer::Emu(h) => match h.guard() {
                Some(g) => DeviceBuffer::Emu(HostBytes::from_guarded(g.view(range))),
                None => return Err(Error::InvalidArgument("buffer part: an emu buffer without guard pages".into())),
            },
            DeviceBuffer::Host(_) => return Err(Error::InvalidArgument("buffer part: the cpu arm has no borrowed buffers".into())),
        }
    };
    Ok(Borrowed { buf, _owner: PhantomData })
}

/// Bytes `range` of a peer's mapped allocation as a buffer. The peer's allocation size is not
/// known here: the caller checks `range` against the size the peer announced.
pub fn mapped(map: &Mapping, range: Range<usize>) -> Borrowed<'_> {
    let len = range.len();
    // SAFETY: the mapping stays open while the result borrows it; the caller checked the range
    // against the peer's buffer.
    let buf = unsafe {
        match map {
            Mapping::Cuda(m) => DeviceBuffer::Cuda(CudaBuffer::borrowed(m.address() + range.start as u64, len)),
            Mapping::Hip(m) => DeviceBuffer::Hip(HipBuffer::borrowed(m.address() + range.start as u64, len)),
            Mapping::Emu(g) => DeviceBuffer::Emu(HostBytes::from_guarded(g.view(range))),
        }
    };
    Borrowed { buf, _owner: PhantomData }
}
