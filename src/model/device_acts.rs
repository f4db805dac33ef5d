//! Activation and scratch buffers of the device model ([`super::DeviceGpt`]), allocated once.
//!
//! A slot keeps everything the backward of one micro-batch through one chunk needs (the chunk's
//! input, every block's saved activations and, on the model's last chunk, the head's), so a
//! pipeline can hold several micro-batches between their forward and backward, in any order; the
//! scratch is shared by every backward and fully rewritten before it is read. Shapes: B*T rows,
//! C = n_embd, Cl = C/tp (this rank's heads), H = 4C/tp, Vl = Vp/tp (this rank's vocabulary rows).

use crate::device::ipc::alloc_shareable;
use crate::device::{Device, DeviceBuffer};
use crate::error::Result;

/// This rank's sizes of one chunk.
#[derive(Debug, Clone, Copy)]
pub(super) struct ActDims {
    pub bt: usize,
    pub c: usize,
    pub cl: usize,
    pub hl: usize,
    pub vl: usize,
    /// Elements of one block's attention probabilities (B, NH/tp, T, T).
    pub att: usize,
    /// Whether a TP group all-reduces some buffers in place (they are then shareable, so GPUs of
    /// one node reduce them through IPC rather than staged through the host: CUDA pool memory
    /// cannot be exported).
    pub tp: bool,
}

impl ActDims {
    fn f32(dev: &Device, elems: usize) -> Result<DeviceBuffer> {
        dev.alloc(elems * 4)
    }

    /// A buffer the TP group reduces in place.
    fn reduced(&self, dev: &Device, elems: usize) -> Result<DeviceBuffer> {
        if self.tp {
            alloc_shareable(dev, elems * 4)
        } else {
            Self::f32(dev, elems)
        }
    }
}

/// Activations of one block, kept from forward for backward.
pub(super) struct BlockActs {
    pub ln1: DeviceBuffer,       // (B*T, C)
    pub ln1_mean: DeviceBuffer,  // (B*T)
    pub ln1_rstd: DeviceBuffer,  // (B*T)
    pub qkv: DeviceBuffer,       // (B*T, 3Cl)
    pub atty: DeviceBuffer,      // (B*T, Cl)
    pub att: DeviceBuffer,       // (B, NH/tp, T, T)
    pub residual2: DeviceBuffer, // (B*T, C)
    pub ln2: DeviceBuffer,       // (B*T, C)
    pub ln2_mean: DeviceBuffer,  // (B*T)
    pub ln2_rstd: DeviceBuffer,  // (B*T)
    pub fch: DeviceBuffer,       // (B*T, H)
    pub fch_gelu: DeviceBuffer,  // (B*T, H)
    pub residual3: DeviceBuffer, // (B*T, C)
}

impl BlockActs {
    fn new(dev: &Device, d: &ActDims) -> Result<Self> {
        let f = |n: usize| ActDims::f32(dev, n);
        let (bt, c) = (d.bt, d.c);
        Ok(BlockActs {
            ln1: f(bt * c)?,
            ln1_mean: f(bt)?,
            ln1_rstd: f(bt)?,
            qkv: f(bt * 3 * d.cl)?,
            atty: f(bt * d.cl)?,
            att: f(d.att)?,
            residual2: f(bt * c)?,
            ln2: f(bt * c)?,
            ln2_mean: f(bt)?,
            ln2_rstd: f(bt)?,
            fch: f(bt * d.hl)?,
            fch_gelu: f(bt * d.hl)?,
            residual3: f(bt * c)?,
        })
    }

    /// f32 elements of one block's activations.
    fn elements(d: &ActDims) -> usize {
        d.bt * (4 * d.c + 4 * d.cl + 2 * d.hl) + 4 * d.bt + d.att
    }
}

/// The head's activations (the model's last chunk only).
pub(super) struct HeadActs {
    pub targets: DeviceBuffer,  // (B*T) u32
    pub lnf: DeviceBuffer,      // (B*T, C)
    pub lnf_mean: DeviceBuffer, // (B*T)
    pub lnf_rstd: DeviceBuffer, // (B*T)
    pub logits: DeviceBuffer,   // (B*T, Vl)
    pub losses: DeviceBuffer,   // (B*T)
    pub lse: DeviceBuffer,      // (B*T)
    pub ce_max: DeviceBuffer,   // (B*T) under TP: the group's row max (else empty)
    pub ce_stats: DeviceBuffer, // (2*B*T) under TP: the group's sum-exp | target logit (else empty)
}

impl HeadActs {
    fn new(dev: &Device, d: &ActDims) -> Result<Self> {
        let f = |n: usize| ActDims::f32(dev, n);
        let bt = d.bt;
        Ok(HeadActs {
            targets: dev.alloc(bt * 4)?,
            lnf: f(bt * d.c)?,
            lnf_mean: f(bt)?,
            lnf_rstd: f(bt)?,
            logits: f(bt * d.vl)?,
            losses: f(bt)?,
            lse: f(bt)?,
            ce_max: d.reduced(dev, if d.tp { bt } else { 0 })?,
            ce_stats: d.reduced(dev, if d.tp { 2 * bt } else { 0 })?,
        })
    }

    fn elements(d: &ActDims) -> usize {
        let ce = if d.tp { 3 * d.bt } else { 0 };
        d.bt * (d.c + d.vl) + 5 * d.bt + ce
    }
}

/// One micro-batch's activations through one chunk.
pub(super) struct SlotActs {
    /// Token ids (B*T) u32: read by the embedding's backward (embedding chunk; else empty).
    pub tokens: DeviceBuffer,
    /// Input of the chunk's first block (B*T, C): the embedding output or the received hidden.
    pub input: DeviceBuffer,
    /// One per block of the chunk.
    pub blocks: Vec<BlockActs>,
    /// The model's last chunk.
    pub head: Option<HeadActs>,
    /// Whether a forward ran since this slot's last backward.
    pub forward_done: bool,
}

impl SlotActs {
    pub(super) fn new(dev: &Device, d: &ActDims, blocks: usize, embeds: bool, ends: bool) -> Result<Self> {
        Ok(SlotActs {
            tokens: dev.alloc(if embeds { d.bt * 4 } else { 0 })?,
            // The embedding's output is summed over TP in place.
            input: if embeds { d.reduced(dev, d.bt * d.c)? } else { ActDims::f32(dev, d.bt * d.c)? },
            blocks: (0..blocks).map(|_| BlockActs::new(dev, d)).collect::<Result<_>>()?,
            head: if ends { Some(HeadActs::new(dev, d)?) } else { None },
            forward_done: false,
        })
    }

    /// f32 elements of a slot (u32 ids count as one each).
    pub(super) fn elements(d: &ActDims, blocks: usize, embeds: bool, ends: bool) -> usize {
        let ids = if embeds { d.bt } else { 0 };
        let head = if ends { HeadActs::elements(d) } else { 0 };
        ids + d.bt * d.c + blocks * BlockActs::elements(d) + head
    }

    /// The chunk's output (B*T, C): the last block's residual stream (the input without blocks).
    pub(super) fn output(&self) -> &DeviceBuffer {
        self.blocks.last().map_or(&self.input, |b| &b.residual3)
    }
}

/// Backward scratch shared by every slot (each buffer is written before it is read).
pub(super) struct Scratch {
    pub branch: DeviceBuffer,    // (B*T, C) sub-block output before the residual add
    pub dlogits: DeviceBuffer,   // (B*T, Vl) (a model's last chunk only, else empty)
    pub dres: DeviceBuffer,      // (B*T, C) gradient of the residual stream
    pub dln: DeviceBuffer,       // (B*T, C) gradient of a LayerNorm output
    pub datty: DeviceBuffer,     // (B*T, Cl)
    pub dqkv: DeviceBuffer,      // (B*T, 3Cl)
    pub dpre: DeviceBuffer,      // (B, NH/tp, T, T)
    pub dfch_gelu: DeviceBuffer, // (B*T, H)
    pub dfch: DeviceBuffer,      // (B*T, H)
}

impl Scratch {
    pub(super) fn new(dev: &Device, d: &ActDims, head: bool) -> Result<Self> {
        let f = |n: usize| ActDims::f32(dev, n);
        let (bt, c) = (d.bt, d.c);
        Ok(Scratch {
            branch: d.reduced(dev, bt * c)?,
            dlogits: f(if head { bt * d.vl } else { 0 })?,
            dres: f(bt * c)?,
            dln: d.reduced(dev, bt * c)?,
            datty: f(bt * d.cl)?,
            dqkv: f(bt * 3 * d.cl)?,
            dpre: f(d.att)?,
            dfch_gelu: f(bt * d.hl)?,
            dfch: f(bt * d.hl)?,
        })
    }

    pub(super) fn elements(d: &ActDims, head: bool) -> usize {
        let dlogits = if head { d.bt * d.vl } else { 0 };
        d.bt * (3 * d.c + 4 * d.cl + 2 * d.hl) + dlogits + d.att
    }
}
