//! [`Staging`]: two slots of host memory through which the staged device collectives move
//! chunks, with the asynchronous copies between a slot and device buffers.
//!
//! GPU arms use page-locked memory (`cuMemHostAlloc` / `hipHostMalloc`) and queue the copies on
//! the device's one stream, recording one event per slot after each copy; the CPU arm uses plain
//! 8-byte-aligned memory and copies at once (`memcpy`). The collective pipeline is the same code
//! for every arm.
//!
//! Invariant, checked: a slot's host bytes are handed out only after [`Staging::wait`] on that
//! slot, so the host never reads a chunk that is still arriving or writes one that a queued
//! upload still reads. Queued copies of different slots may overlap each other and the host's
//! work on the other slot; on one stream they run in the order queued.

use super::hip::{HipEvent, HipPinned};
use super::cuda::CudaPinned;
use super::{Device, DeviceBuffer};
use crate::error::{Error, Result};
use cudarc::driver::CudaEvent;

/// Host memory of one slot.
enum HostMemory {
    /// 8-byte words (so every element type can view the bytes in place), `len` bytes used.
    Cpu(Vec<u64>, usize),
    Cuda(CudaPinned, CudaEvent),
    Hip(HipPinned, HipEvent),
}

struct Slot {
    memory: HostMemory,
    /// Copies were queued since the last wait.
    pending: bool,
}

/// Two staging slots of `slot_bytes` bytes each for one device.
pub struct Staging {
    slots: [Slot; 2],
    slot_bytes: usize,
}

fn slot(dev: &Device, bytes: usize) -> Result<Slot> {
    let memory = match dev {
        Device::Cpu | Device::Emu(_) => HostMemory::Cpu(vec![0; bytes.div_ceil(8)], bytes),
        Device::Cuda(d) => HostMemory::Cuda(d.alloc_pinned(bytes)?, d.event()?),
        Device::Hip(d) => HostMemory::Hip(d.alloc_pinned(bytes)?, d.event()?),
    };
    Ok(Slot { memory, pending: false })
}

fn wrong_arm(op: &str) -> Error {
    Error::InvalidArgument(format!("{op}: the buffer and the staging memory belong to different device arms"))
}

fn check_span(op: &str, what: &str, have: usize, off: usize, len: usize) -> Result<()> {
    if off.checked_add(len).is_none_or(|end| end > have) {
        return Err(Error::InvalidArgument(format!(
            "{op}: bytes {off}..{} outside the {have}-byte {what}",
            off.saturating_add(len)
        )));
    }
    Ok(())
}

impl Staging {
    /// Two slots of `slot_bytes` bytes of host memory suited to `dev`.
    pub fn new(dev: &Device, slot_bytes: usize) -> Result<Staging> {
        Ok(Staging { slots: [slot(dev, slot_bytes)?, slot(dev, slot_bytes)?], slot_bytes })
    }

    /// Bytes per slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// The host bytes of slot `s`; an error while copies into or out of it may be in flight.
    pub fn host(&mut self, s: usize) -> Result<&mut [u8]> {
        let slot = &mut self.slots[s];
        if slot.pending {
            return Err(Error::InvalidArgument(format!(
                "staging slot {s} used by the host before its copies finished (a pipeline bug)"
            )));
        }
        Ok(match &mut slot.memory {
            HostMemory::Cpu(words, len) => &mut bytemuck::cast_slice_mut(words)[..*len],
            // SAFETY: the slot owns `len` bytes at `ptr`, no copy is in flight (checked above),
            // and the result borrows `self` mutably.
            HostMemory::Cuda(p, _) => unsafe { std::slice::from_raw_parts_mut(p.as_mut_ptr(), p.len()) },
            // SAFETY: as above.
            HostMemory::Hip(p, _) => unsafe { std::slice::from_raw_parts_mut(p.as_mut_ptr(), p.len()) },
        })
    }

    /// Queues a copy of `len` bytes of `src` at `src_off` into slot `s` at `at`.
    pub fn download(&mut self, dev: &Device, s: usize, at: usize, src: &DeviceBuffer, src_off: usize, len: usize) -> Result<()> {
        const OP: &str = "staging download";
        check_span(OP, "staging slot", self.slot_bytes, at, len)?;
        check_span(OP, "source buffer", src.len(), src_off, len)?;
        let slot = &mut self.slots[s];
        match (&mut slot.memory, dev, src) {
            (HostMemory::Cpu(words, _), Device::Cpu, DeviceBuffer::Host(b))
            | (HostMemory::Cpu(words, _), Device::Emu(_), DeviceBuffer::Emu(b)) => {
                bytemuck::cast_slice_mut::<u64, u8>(words)[at..at + len].copy_from_slice(&b.bytes()[src_off..src_off + len]);
                return Ok(());
            }
            (HostMemory::Cuda(p, ev), Device::Cuda(d), DeviceBuffer::Cuda(b)) => {
                // SAFETY: the range lies in the slot (checked); `pending` keeps the host off it,
                // and `Drop` keeps it allocated, until the event recorded below has completed.
                unsafe { d.download_async(b, src_off, p.as_mut_ptr().add(at), len)? };
                d.record(ev)?;
            }
            (HostMemory::Hip(p, ev), Device::Hip(d), DeviceBuffer::Hip(b)) => {
                // SAFETY: as for CUDA.
                unsafe { d.download_async(b, src_off, p.as_mut_ptr().add(at), len)? };
                d.record(ev)?;
            }
            _ => return Err(wrong_arm(OP)),
        }
        slot.pending = true;
        Ok(())
    }

    /// Queues a copy of `len` bytes of slot `s` at `at` into `dst` at `dst_off`.
    pub fn upload(&mut self, dev: &Device, s: usize, at: usize, dst: &mut DeviceBuffer, dst_off: usize, len: usize) -> Result<()> {
        const OP: &str = "staging upload";
        check_span(OP, "staging slot", self.slot_bytes, at, len)?;
        check_span(OP, "destination buffer", dst.len(), dst_off, len)?;
        let slot = &mut self.slots[s];
        match (&mut slot.memory, dev, dst) {
            (HostMemory::Cpu(words, _), Device::Cpu, DeviceBuffer::Host(b))
            | (HostMemory::Cpu(words, _), Device::Emu(_), DeviceBuffer::Emu(b)) => {
                b.bytes_mut()[dst_off..dst_off + len].copy_from_slice(&bytemuck::cast_slice::<u64, u8>(words)[at..at + len]);
                return Ok(());
            }
            (HostMemory::Cuda(p, ev), Device::Cuda(d), DeviceBuffer::Cuda(b)) => {
                // SAFETY: as in `download`; the host does not write the slot until the wait.
                unsafe { d.upload_async(b, dst_off, p.as_mut_ptr().add(at), len)? };
                d.record(ev)?;
            }
            (HostMemory::Hip(p, ev), Device::Hip(d), DeviceBuffer::Hip(b)) => {
                // SAFETY: as for CUDA.
                unsafe { d.upload_async(b, dst_off, p.as_mut_ptr().add(at), len)? };
                d.record(ev)?;
            }
            _ => return Err(wrong_arm(OP)),
        }
        slot.pending = true;
        Ok(())
    }

    /// Blocks until the copies queued for slot `s` (and all work queued before them) finished.
    pub fn wait(&mut self, dev: &Device, s: usize) -> Result<()> {
        let slot = &mut self.slots[s];
        if slot.pending {
            match (&slot.memory, dev) {
                (HostMemory::Cuda(_, ev), Device::Cuda(d)) => d.wait(ev)?,
                (HostMemory::Hip(_, ev), Device::Hip(_)) => ev.synchronize()?,
                _ => return Err(wrong_arm("staging wait")),
            }
            slot.pending = false;
        }
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // Queued copies may still touch the slots (after an error cut a collective short): let
        // them finish before the memory is freed.
        for slot in &self.slots {
            let waited = match (&slot.memory, slot.pending) {
                (HostMemory::Cuda(_, ev), true) => ev.synchronize().map_err(|e| format!("{e:?}")),
                (HostMemory::Hip(_, ev), true) => ev.synchronize().map_err(|e| e.to_string()),
                _ => Ok(()),
            };
            if let Err(e) = waited {
                log::error!("staging: waiting for queued copies before freeing: {e}");
            }
        }
    }
}
