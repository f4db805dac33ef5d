//! Flat-range access to the per-entry device buffers, for an optimizer that holds only a shard of
//! the flat buffer and moves it bucket by bucket (`train::device_zero`), and ZeRO-3's parameter
//! shards: with [`DeviceGpt::shard_params`] the model keeps only this data-parallel rank's block
//! of every bucket ([`ParamShards`]) and materialises a unit's tensors (the embedding's, a
//! block's, the head's) right before it reads them, all-gathering the unit's buckets over the
//! data-parallel group into freshly allocated entry buffers (and their bf16 copies), and frees
//! every other unit's: at most the units of one layer are resident besides the shard.
//!
//! Invariants: buckets lie inside units (the data-parallel reducer plans them over
//! [`DeviceGpt::units`]); the shards are the device optimizer's master weights, copied in after
//! each step or load ([`DeviceGpt::with_param_shard`]), which releases every gathered unit since
//! those copies are stale; every member of the group acquires the same units in the same order
//! (SPMD), so the all-gathers match.

use std::ops::Range;

use super::{DeviceGpt, GradSink};
use crate::comm::device::{GpuCommConfig, GpuCommState};
use crate::comm::{Communicator, DType};
use crate::device::ipc::alloc_shareable;
use crate::device::{ops, Device, DeviceBuffer};
use crate::error::{Error, Result};
use crate::model::tp_layout::ShardLayout;

/// One bucket's owned block of parameters.
struct Bucket {
    /// The bucket (flat range).
    range: Range<usize>,
    /// This rank's block of it.
    own: Range<usize>,
    shard: DeviceBuffer, // (own.len) f32 master weights (shareable: the all-gather reads it)
}

/// ZeRO-3's sharded parameters of a [`DeviceGpt`]; see the module documentation.
pub(super) struct ParamShards {
    comm: Communicator,
    coll: GpuCommState,
    buckets: Vec<Bucket>,
    staging: DeviceBuffer, // (largest bucket) f32: a gathered bucket
    /// The model's units and whether each is resident.
    units: Vec<Range<usize>>,
    resident: Vec<bool>,
}

/// What a layer reads.
#[derive(Debug, Clone, Copy)]
pub(super) enum Use {
    /// `wte` and `wpe`.
    Embedding,
    /// Block `l`.
    Block(usize),
    /// `lnf` and `wte`.
    Head,
}

impl DeviceGpt {
    /// Hands the gradients of the flat range `r` to `f(range, values)`, one piece per layout
    /// entry, as host slices: on arms whose buffers are host memory (the CPU, emu), without a
    /// copy. Other arms are an error naming the arm.
    pub fn host_grads_in(&self, r: Range<usize>, f: &mut dyn FnMut(Range<usize>, &[f32])) -> Result<()> {
        for (i, p) in entry_parts(&self.layout, r) {
            let e = &self.layout.entries()[i];
            if self.grads[i].len() < e.len * 4 {
                return Err(Error::Check(format!("the gradients of `{}` were handed over after being freed", e.name)));
            }
            let g = ops::host("host_grads_in", &self.grads[i])?.view::<f32>(e.len);
            f(p.clone(), &g[p.start - e.offset..p.end - e.offset]);
        }
        Ok(())
    }

    /// Hands the gradients of the flat range `r` to `f(range, values)`, one piece per layout
    /// entry, as host slices on every arm: the CPU's without a copy, a device arm's (emu, CUDA,
    /// HIP alike) copied device -> host into `scratch` first (the entry from its start to the
    /// piece's end; the entries' own stream order makes the copy wait for their backward).
    pub fn grads_to_host_in(&self, r: Range<usize>, scratch: &mut Vec<f32>, f: &mut dyn FnMut(Range<usize>, &[f32])) -> Result<()> {
        if matches!(self.dev, Device::Cpu) {
            return self.host_grads_in(r, f);
        }
        for (i, p) in entry_parts(&self.layout, r) {
            let e = &self.layout.entries()[i];
            if self.grads[i].len() < e.len * 4 {
                return Err(Error::Check(format!("the gradients of `{}` were handed over after being freed", e.name)));
            }
            let (lo, hi) = (p.start - e.offset, p.end - e.offset);
            scratch.resize(hi, 0.0);
            self.dev.copy_to_host(&self.grads[i], &mut scratch[..hi])?;
            f(p, &scratch[lo..hi]);
        }
        Ok(())
    }

    /// Sets the gradients of the flat range `r` from the host values `src` (`r.len()`), on arms
    /// whose buffers are host memory (the CPU, emu); other arms are an error naming the arm.
    pub fn set_grads_range(&mut self, r: Range<usize>, src: &[f32]) -> Result<()> {
        self.grads_zero = false;
        let parts: Vec<_> = entry_parts(&self.layout, r.clone()).collect();
        for (i, p) in parts {
            let off = p.start - self.layout.entries()[i].offset;
            let vals = &src[p.start - r.start..p.end - r.start];
            let g = ops::host_mut("set_grads_range", &mut self.grads[i])?.view_mut::<f32>(off + vals.len());
            g[off..].copy_from_slice(vals);
        }
        Ok(())
    }

    /// Sets the device gradients of the flat range `r` from `src` (`r.len()` elements from 0 on
    /// this device).
    pub fn unpack_grads_range(&mut self, r: Range<usize>, src: &DeviceBuffer) -> Result<()> {
        self.grads_zero = false;
        let parts: Vec<_> = entry_parts(&self.layout, r.clone()).collect();
        for (i, p) in parts {
            let off = p.start - self.layout.entries()[i].offset;
            ops::copy(&self.dev, &mut self.grads[i], off, src, p.start - r.start, p.len())?;
        }
        Ok(())
    }

    /// The device gradients of the flat range `r`, in order, as (tensor buffer, element range)
    /// parts (what [`DeviceGpt::pack_grads_range`] would copy one after the other).
    pub fn grad_parts(&self, r: Range<usize>) -> Vec<(&DeviceBuffer, Range<usize>)> {
        entry_parts(&self.layout, r)
            .map(|(i, p)| {
                let off = self.layout.entries()[i].offset;
                (&self.grads[i], p.start - off..p.end - off)
            })
            .collect()
    }

    /// Copies the device gradients of the flat range `r` into `dst` (`r.len()` elements from 0).
    pub fn pack_grads_range(&self, r: Range<usize>, dst: &mut DeviceBuffer) -> Result<()> {
        self.pack_grads_at(r, dst, 0)
    }

    /// Copies the device gradients of the flat range `r` into `dst` from element `at` on.
    pub fn pack_grads_at(&self, r: Range<usize>, dst: &mut DeviceBuffer, at: usize) -> Result<()> {
        for (i, p) in entry_parts(&self.layout, r.clone()) {
            let e = &self.layout.entries()[i];
            if self.grads[i].len() < e.len * 4 {
                return Err(Error::Check(format!("the gradients of `{}` were packed after being freed", e.name)));
            }
            ops::copy(&self.dev, dst, at + p.start - r.start, &self.grads[i], p.start - e.offset, p.len())?;
        }
        Ok(())
    }

    /// Copies the device parameters of the flat range `r` into `dst` (`r.len()` elements from 0),
    /// uploading the host mirror first if it is newer.
    pub fn pack_params_range(&mut self, r: Range<usize>, dst: &mut DeviceBuffer) -> Result<()> {
        if self.params_stale && self.shards.is_none() {
            self.upload_params()?;
        }
        for (i, p) in entry_parts(&self.layout, r.clone()) {
            let off = p.start - self.layout.entries()[i].offset;
            ops::copy(&self.dev, dst, p.start - r.start, &self.params[i], off, p.len())?;
        }
        Ok(())
    }

    /// Sets the device parameters of the flat range `r` from `src` (`r.len()` elements from 0);
    /// the bf16 copies follow in [`DeviceGpt::refresh_params16`] once every range is set.
    pub fn unpack_params_range(&mut self, r: Range<usize>, src: &DeviceBuffer) -> Result<()> {
        let parts: Vec<_> = entry_parts(&self.layout, r.clone()).collect();
        for (i, p) in parts {
            self.ensure_entry(i)?;
            let off = p.start - self.layout.entries()[i].offset;
            ops::copy(&self.dev, &mut self.params[i], off, src, p.start - r.start, p.len())?;
        }
        Ok(())
    }

    /// Casts every entry's bf16 copy from its f32 device parameters once they are all set
    /// ([`DeviceGpt::unpack_params_range`], or an optimizer that updated them in place); the
    /// device parameters are then the model's.
    pub fn refresh_params16(&mut self) -> Result<()> {
        for (i, e) in self.layout.entries().iter().enumerate() {
            if let Some(p16) = &mut self.params16[i] {
                super::cast_copy(&self.linear, &self.dev, p16, &self.params[i], e.len)?;
            }
        }
        self.params_stale = false;
        Ok(())
    }

    /// Copies `src` (`r.len()` f32 on this device) into the host mirror's flat range `r` without
    /// marking it newer than the device (ZeRO-3 checkpoints: the owned ranges).
    pub fn host_params_range_from(&mut self, r: Range<usize>, src: &DeviceBuffer) -> Result<()> {
        self.host_params.resize(self.layout.total_len(), 0.0);
        self.dev.copy_to_host(src, &mut self.host_params[r])
    }

    /// Brings the device parameters into the host mirror (for checkpoints of an optimizer that
    /// keeps no flat copy of them).
    pub fn host_params_from_device(&mut self) -> Result<()> {
        self.host_params.resize(self.layout.total_len(), 0.0);
        for (i, e) in self.layout.entries().iter().enumerate() {
            self.dev.copy_to_host(&self.params[i], &mut self.host_params[e.range()])?;
        }
        Ok(())
    }

    /// The parameter units in buffer order: `wte`, `wpe`, each block, `lnf` (Llama: `norm` and
    /// `lm_head`) (those this stage holds); they partition the flat buffer.
    pub fn units(&self) -> Vec<Range<usize>> {
        let l = &self.layout;
        let mut units: Vec<Range<usize>> = [l.wte(), l.wpe()].into_iter().flatten().collect();
        units.extend(self.chunks.iter().flat_map(|c| c.layers.clone()).map(|b| l.block_span(b)));
        units.extend(l.final_unit());
        units
    }

    /// ZeRO-3: from now on keeps only block `owned[k]` of each bucket `buckets[k]` of the flat
    /// parameters (the data-parallel reducer's shards over `comm`, the data-parallel group) and
    /// gathers units on use; frees every entry's parameters. The shards' values come with
    /// [`DeviceGpt::with_param_shard`].
    pub fn shard_params(&mut self, comm: Communicator, buckets: &[Range<usize>], owned: &[Range<usize>]) -> Result<()> {
        let units = self.units();
        let inside = |b: &Range<usize>| units.iter().any(|u| u.start <= b.start && b.end <= u.end);
        if buckets.len() != owned.len() || !buckets.iter().all(inside) {
            return Err(Error::Check("ZeRO-3 buckets must lie inside the model's units".into()));
        }
        let dev = &self.dev;
        let mut list = Vec::new();
        for (range, own) in buckets.iter().zip(owned) {
            // Shareable buffers are at least one element (an empty block has nothing to export).
            let shard = alloc_shareable(dev, own.len().max(1) * 4)?;
            list.push(Bucket { range: range.clone(), own: own.clone(), shard });
        }
        let largest = buckets.iter().map(|b| b.len()).max().unwrap_or(0);
        let n = units.len();
        self.shards = Some(ParamShards {
            comm,
            coll: GpuCommState::new(GpuCommConfig::from_env()?),
            buckets: list,
            staging: dev.alloc(largest * 4)?,
            units,
            resident: vec![true; n],
        });
        self.release_units(&[])
    }

    /// ZeRO-3: runs `f` on the device and bucket `k`'s owned block (its `own.len()` f32, the
    /// optimizer's master weights, updated in place), then releases every gathered unit, whose
    /// copies are stale.
    pub fn with_param_shard(&mut self, k: usize, f: &mut dyn FnMut(&Device, &mut DeviceBuffer) -> Result<()>) -> Result<()> {
        let Some(z) = &mut self.shards else {
            return Err(Error::Check("with_param_shard without ZeRO-3 parameter shards".into()));
        };
        f(&self.dev, &mut z.buckets[k].shard)?;
        self.release_units(&[])
    }

    /// ZeRO-3: sets every owned block from the host mirror (a load) and releases every
    /// gathered unit.
    pub fn param_shards_from_host(&mut self) -> Result<()> {
        let Some(z) = &mut self.shards else {
            return Err(Error::Check("param_shards_from_host without ZeRO-3 parameter shards".into()));
        };
        if self.host_params.len() != self.layout.total_len() {
            return Err(Error::Check("the host copy of the parameters was given back: the device holds the training state".into()));
        }
        for b in z.buckets.iter_mut().filter(|b| !b.own.is_empty()) {
            self.dev.copy_to_device(&mut b.shard, &self.host_params[b.own.clone()])?;
        }
        self.params_stale = false;
        self.release_units(&[])
    }

    /// ZeRO-3: copies every owned block into the host mirror's ranges (checkpoints write each
    /// rank's owned ranges only); the rest of the mirror is left as it is.
    pub fn host_params_from_shards(&mut self) -> Result<()> {
        let Some(z) = &self.shards else {
            return Err(Error::Check("host_params_from_shards without ZeRO-3 parameter shards".into()));
        };
        self.host_params.resize(self.layout.total_len(), 0.0);
        for b in z.buckets.iter().filter(|b| !b.own.is_empty()) {
            self.dev.copy_to_host(&b.shard, &mut self.host_params[b.own.clone()])?;
        }
        Ok(())
    }

    /// Checks the gathers' last calls, then closes their peer mappings (collective over the
    /// data-parallel group; no-op without ZeRO-3).
    pub fn release_param_shards(&mut self) -> Result<()> {
        self.check_param_shards()?;
        match &mut self.shards {
            Some(z) => z.coll.release_mappings(&z.comm, &self.dev),
            None => Ok(()),
        }
    }

    /// Collective over the data-parallel group (no-op without ZeRO-3): an error on every member
    /// if a stream-ordered parameter gather failed on any.
    pub(super) fn check_param_shards(&mut self) -> Result<()> {
        match &mut self.shards {
            Some(z) => z.coll.check(&z.comm, &self.dev),
            None => Ok(()),
        }
    }

    /// The units (flat ranges) `what` reads.
    pub(super) fn use_ranges(&self, what: Use) -> Vec<Range<usize>> {
        let l = &self.layout;
        match what {
            Use::Embedding => [l.wte(), l.wpe()].into_iter().flatten().collect(),
            Use::Block(b) => vec![l.block_span(b)],
            Use::Head => l.final_unit().into_iter().chain(l.wte().filter(|_| l.tied_head())).collect(),
        }
    }

    /// With [`DeviceGpt::set_grad_release`]: allocates (zeroed) the gradients of the units
    /// `what` writes that are not allocated.
    pub(super) fn ensure_grads(&mut self, what: Use) -> Result<()> {
        if !self.release_grads {
            return Ok(());
        }
        for r in self.use_ranges(what) {
            let parts: Vec<(usize, Range<usize>)> = entry_parts(&self.layout, r).collect();
            for (i, _) in parts {
                let len = self.layout.entries()[i].len;
                if self.grads[i].len() != len * 4 {
                    self.grads[i] = self.dev.alloc(len * 4)?;
                    ops::fill_zero(&self.dev, &mut self.grads[i], len)?;
                }
            }
        }
        Ok(())
    }

    /// Hands the final gradients of the units `ranges` to `sink` (which reduces them) and, with
    /// [`DeviceGpt::set_grad_release`], frees them.
    pub(super) fn grads_final(&mut self, ranges: &[Range<usize>], sink: &mut GradSink) -> Result<()> {
        for r in ranges {
            sink(self, r.clone())?;
            if self.release_grads {
                let parts: Vec<(usize, Range<usize>)> = entry_parts(&self.layout, r.clone()).collect();
                for (i, _) in parts {
                    self.grads[i] = self.dev.alloc(0)?;
                }
            }
        }
        Ok(())
    }

    /// Frees every gradient from now on once it is handed to the sink of
    /// [`DeviceGpt::backward_reducing`] (ZeRO-2/3 on the whole model: only the units in use hold
    /// gradients), and frees them all now.
    pub fn set_grad_release(&mut self) -> Result<()> {
        self.release_grads = true;
        for g in &mut self.grads {
            *g = self.dev.alloc(0)?;
        }
        Ok(())
    }

    /// Whether gradients are freed once handed over (see [`DeviceGpt::set_grad_release`]).
    pub fn releases_grads(&self) -> bool {
        self.release_grads
    }

    /// Makes the units `what` reads resident (ZeRO-3; a no-op otherwise), releasing the others.
    pub(super) fn acquire(&mut self, what: Use) -> Result<()> {
        if self.shards.is_none() {
            return Ok(());
        }
        let ranges = self.use_ranges(what);
        let Some(z) = &self.shards else { return Ok(()) };
        let wanted: Vec<usize> = ranges.iter().filter_map(|r| z.units.iter().position(|u| u == r)).collect();
        if wanted.len() != ranges.len() {
            return Err(Error::Check(format!("{what:?} reads parameters outside this stage's units")));
        }
        self.release_units(&wanted)?;
        for u in wanted {
            self.gather_unit(u)?;
        }
        Ok(())
    }

    /// Frees the parameters of every resident unit but `keep`.
    fn release_units(&mut self, keep: &[usize]) -> Result<()> {
        let Some(z) = &mut self.shards else { return Ok(()) };
        for (u, resident) in z.resident.iter_mut().enumerate() {
            if !*resident || keep.contains(&u) {
                continue;
            }
            for (i, _) in entry_parts(&self.layout, z.units[u].clone()) {
                self.params[i] = self.dev.alloc(0)?;
                if let Some(p16) = &mut self.params16[i] {
                    *p16 = self.dev.alloc(0)?;
                }
            }
            *resident = false;
        }
        Ok(())
    }

    /// All-gathers unit `u`'s buckets into newly allocated entry buffers and their bf16 copies.
    fn gather_unit(&mut self, u: usize) -> Result<()> {
        let Some(z) = &mut self.shards else { return Ok(()) };
        if z.resident[u] {
            return Ok(());
        }
        let unit = z.units[u].clone();
        let dev = &self.dev;
        let parts: Vec<(usize, Range<usize>)> = entry_parts(&self.layout, unit.clone()).collect();
        for &(i, _) in &parts {
            let len = self.layout.entries()[i].len;
            self.params[i] = dev.alloc(len * 4)?;
            if let Some(p16) = &mut self.params16[i] {
                *p16 = dev.alloc(len * 2)?;
            }
        }
        for b in z.buckets.iter().filter(|b| unit.start <= b.range.start && b.range.end <= unit.end) {
            let n = b.range.len();
            if z.comm.size() > 1 {
                z.coll.bind(&z.comm, dev).all_gather_into(&b.shard, &mut z.staging, n, DType::F32)?;
            } else {
                ops::copy(dev, &mut z.staging, 0, &b.shard, 0, n)?;
            }
            for (i, p) in entry_parts(&self.layout, b.range.clone()) {
                let off = p.start - self.layout.entries()[i].offset;
                ops::copy(dev, &mut self.params[i], off, &z.staging, p.start - b.range.start, p.len())?;
            }
        }
        for (i, _) in parts {
            if let Some(p16) = &mut self.params16[i] {
                super::cast_copy(&self.linear, dev, p16, &self.params[i], self.layout.entries()[i].len)?;
            }
        }
        z.resident[u] = true;
        Ok(())
    }
}

/// The parts of `layout`'s entries inside the flat range `r`: (entry index, flat sub-range).
fn entry_parts(layout: &ShardLayout, r: Range<usize>) -> impl Iterator<Item = (usize, Range<usize>)> + '_ {
    layout.entries().iter().enumerate().filter_map(move |(i, e)| {
        let (lo, hi) = (e.offset.max(r.start), (e.offset + e.len).min(r.end));
        (lo < hi).then_some((i, lo..hi))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::testing::run_ranks;
    use crate::comm::CommConfig;
    use crate::device::Device;
    use crate::model::{Gpt, GptConfig, Precision};
    use crate::comm::block_range;
    use crate::train::plan_buckets;

    const B: usize = 2;
    const T: usize = 8;

    /// Two data-parallel ranks, each keeping only its block of every bucket (buckets cut tensors
    /// apart): one bf16 forward and backward give the unsharded model's loss and gradients bit for
    /// bit (the gathered units hold exactly the parameters), and between uses only the units of
    /// the layer last run hold device parameters; with gradient release each unit's gradients are
    /// handed over when final (the unsharded values) and freed.
    #[test]
    fn sharded_parameters_and_released_gradients_are_exact_and_freed() {
        run_ranks(2, CommConfig::default(), |c| {
            let cfg = GptConfig { n_layer: 2, n_head: 2, n_embd: 16, vocab_size: 64, max_seq_len: T, llama: None };
            let init = Gpt::<f32>::new(cfg, B, T, 3).unwrap().params().to_vec();
            let new_model = || DeviceGpt::new(Device::Cpu, cfg, B, T, init.clone(), Precision::Bf16).unwrap();
            let (mut whole, mut sharded) = (new_model(), new_model());
            // The data-parallel reducer's buckets and shards (block `rank` of every bucket).
            let buckets = plan_buckets(&sharded.units(), 300);
            let own = |r: &Range<usize>| {
                let b = block_range(r.len(), c.size(), c.rank());
                r.start + b.start..r.start + b.end
            };
            let owned: Vec<Range<usize>> = buckets.iter().map(own).collect();
            assert!(buckets.len() > sharded.units().len(), "some tensor is cut across buckets");
            let comm = c.split(Some(0), c.rank() as i64).unwrap().unwrap();
            sharded.shard_params(comm, &buckets, &owned).unwrap();
            // The owned blocks come from the host mirror (the initialisation).
            sharded.param_shards_from_host().unwrap();
            let resident = |m: &DeviceGpt| m.params.iter().filter(|p| !p.is_empty()).count();
            assert_eq!(resident(&sharded), 0, "nothing is resident before a use");
            let tokens: Vec<u32> = (0..B * T).map(|i| (i * 7 % 64) as u32).collect();
            let targets: Vec<u32> = (0..B * T).map(|i| (i * 5 % 64) as u32).collect();
            let want = whole.forward(&tokens, &targets).unwrap();
            let got = sharded.forward(&tokens, &targets).unwrap();
            assert_eq!(got.to_bits(), want.to_bits(), "loss {got} vs {want}");
            // After the forward only the head's units (lnf and wte) are resident.
            assert_eq!(resident(&sharded), 3);
            whole.backward(true, &mut |_, _| {}).unwrap();
            sharded.backward(true, &mut |_, _| {}).unwrap();
            // After the backward only block 0's 12 tensors are.
            assert_eq!(resident(&sharded), 12);
            let (gw, gs) = (whole.params_and_grads().1.to_vec(), sharded.params_and_grads().1.to_vec());
            assert!(gw.iter().zip(&gs).all(|(a, b)| a.to_bits() == b.to_bits()), "gradients differ");
            // Gradients released unit by unit: each unit handed over when final, with the whole
            // model's values, and freed after; nothing is left once the backward ends.
            whole.zero_grad().unwrap();
            whole.forward(&tokens, &targets).unwrap();
            whole.backward(true, &mut |_, _| {}).unwrap();
            let gw = whole.params_and_grads().1.to_vec();
            sharded.set_grad_release().unwrap();
            sharded.forward(&tokens, &targets).unwrap();
            let mut seen: Vec<(Range<usize>, Vec<f32>)> = Vec::new();
            sharded
                .backward_reducing(&mut |m, r| {
                    let mut buf = Device::Cpu.alloc(r.len() * 4)?;
                    m.pack_grads_range(r.clone(), &mut buf)?;
                    let mut host = vec![0f32; r.len()];
                    Device::Cpu.copy_to_host(&buf, &mut host)?;
                    seen.push((r, host));
                    Ok(())
                })
                .unwrap();
            assert!(sharded.grads.iter().all(|g| g.is_empty()), "gradients left allocated");
            let u = sharded.units();
            let order: Vec<Range<usize>> = seen.iter().map(|(r, _)| r.clone()).collect();
            assert_eq!(order, vec![u[4].clone(), u[3].clone(), u[2].clone(), u[0].clone(), u[1].clone()], "lnf, blocks down, wte, wpe");
            for (r, g) in &seen {
                assert!(g.iter().zip(&gw[r.clone()]).all(|(a, b)| a.to_bits() == b.to_bits()), "gradients of {r:?} differ");
            }
            sharded.release_param_shards().unwrap();
        });
    }
}
