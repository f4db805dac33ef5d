//! The sharded optimizer state of the device step (ZeRO 1, 2 and 3), on the device: so that a GPU
//! rank holds a 1/N share of the AdamW moments and reduced gradients instead of all of them, and
//! nothing but the norm's partial sums crosses to the host.
//!
//! A rank's shard is exactly [`DataParallel`]'s: block `dp_rank` of every gradient bucket, so
//! the per-bucket AdamW states that checkpoints save per rank are the host copies of this state
//! ([`DeviceShards::store`], [`DeviceShards::load`]). Per bucket, in the buckets' readiness order,
//! the model's device gradients of the bucket are packed into one bucket-sized staging buffer,
//! scaled by 1/micro-batches and reduce-scattered (average over DP) into the bucket's gradient
//! shard: ZeRO-1 once per step after the last backward, ZeRO-2 after every micro-batch's backward,
//! summing into the shard, the model's gradients then zeroed for the next micro-batch. The step
//! adds the squares of the shard's counted elements (summed over DP by the caller's step and over
//! the TP group), clips, and runs AdamW on the shard's weights. The model's f32 parameters are the
//! master weights, so the step keeps no copy of them: at ZeRO 1/2 each bucket's block is packed
//! from the model's tensors into the receive buffer, updated there and all-gathered through the
//! staging buffer back into the model's tensors; at ZeRO-3 AdamW updates the model's own
//! parameter shards in place, which the model gathers unit by unit when it reads them
//! (`model::device_gpt::shards`).
//!
//! Device memory per rank (f32; Ψ parameters on the rank, N data-parallel ranks): gradient shard,
//! m and v, 4Ψ/N bytes each, plus one bucket of staging and one bucket block of receive buffer;
//! no full-length flat buffer (the model's own per-tensor parameters and gradients are all that
//! is whole).
//!
//! Invariants: the shard ranges are `sync.owned()`, bucket by bucket; the arithmetic is
//! [`DataParallel::step`]'s at ZeRO 1/2 (staging scaled by the same f32 factor, the same average,
//! reports summed into the shard in the same order, the norm's f64 partials added per (bucket,
//! counted span) in the same order, the same clip factor and AdamW): on the CPU device the result
//! is the host step's bit for bit; on a GPU the kernels may fuse multiply-adds and the norm's block
//! sums differ, so results agree to rounding.

use std::ops::Range;
use std::time::{Duration, Instant};

use super::grad_sync::DataParallel;
use super::nonfinite::LocalFlag;
use crate::comm::device::GpuCommState;
use crate::comm::{Communicator, DType, ReduceOp};
use crate::device::cpu::adamw::AdamWStep;
use crate::device::ipc::alloc_shareable;
use crate::device::ops::{self, AdamWBuffers};
use crate::device::{Device, DeviceBuffer};
use crate::error::{Error, Result};
use crate::model::DeviceGpt;

/// One bucket's shard on the device.
struct Shard {
    /// The bucket (flat range of the model's buffer).
    bucket: Range<usize>,
    /// This rank's block of it (flat range; `DataParallel`'s state range).
    own: Range<usize>,
    grads: DeviceBuffer,  // (own.len) reduced gradients, summed over the step's micro-batches
    m: DeviceBuffer,      // (own.len) first moments
    v: DeviceBuffer,      // (own.len) second moments
    /// (range, decay) segments, relative to `own`.
    decay: Vec<(Range<usize>, bool)>,
    /// Ranges this rank counts in the norm, relative to `own`, in `norm` span order.
    counted: Vec<Range<usize>>,
    /// No reduction reached `grads` yet this step (the next one sets it, later ones add).
    fresh: bool,
}

/// The device optimizer state of one rank at ZeRO 1 or 2.
pub struct DeviceShards {
    shards: Vec<Shard>,
    stage: DeviceBuffer, // (largest bucket) f32: a bucket's gradients to reduce, then its gathered weights (shareable)
    recv: DeviceBuffer,  // (largest block) f32: a later micro-batch's reduced block before it is added; the block's weights while AdamW updates them (shareable: the all-gather reads it)
    /// ZeRO-2/3: reduce after every backward.
    every_backward: bool,
    /// ZeRO-2/3 on a whole model: each unit's buckets are reduced during the backward, as soon
    /// as the unit's gradients are final, and the model frees those gradients.
    per_unit: bool,
    /// ZeRO-3: the model keeps only parameter shards (the master weights, updated in place, never
    /// all-gathered here).
    sharded_params: bool,
    /// Micro-batches reduced into the shards this step.
    reduced: usize,
    /// Time spent in the reductions this step.
    comm: Duration,
    /// The gradients packed for the device reduction held a NaN or an infinity.
    flag: LocalFlag,
}

/// The part of `span` inside `own`, relative to `own.start`.
fn local(own: &Range<usize>, span: &Range<usize>) -> Option<Range<usize>> {
    let (lo, hi) = (span.start.max(own.start), span.end.min(own.end));
    (lo < hi).then_some(lo - own.start..hi - own.start)
}

impl DeviceShards {
    /// Device buffers for `sync`'s shard of `model`'s parameters (`sync` at ZeRO 1 or 2), with
    /// weight decay on the `decay` segments, counting the `(range, counted)` spans `norm`.
    pub fn new(model: &DeviceGpt, sync: &DataParallel, decay: &[(Range<usize>, bool)], norm: &[(Range<usize>, bool)]) -> Result<Self> {
        let dev = model.device();
        // Shareable buffers are at least one element (an empty block has nothing to export).
        let shareable = |elems: usize| alloc_shareable(dev, elems.max(1) * 4);
        let mut shards = Vec::new();
        for (bucket, state) in sync.bucket_ranges().iter().zip(sync.states()) {
            let own = state.range();
            let n = own.len();
            shards.push(Shard {
                bucket: bucket.clone(),
                grads: dev.alloc(n * 4)?,
                m: dev.alloc(n * 4)?,
                v: dev.alloc(n * 4)?,
                decay: decay.iter().filter_map(|(r, d)| Some((local(&own, r)?, *d))).collect(),
                counted: norm.iter().filter(|(_, c)| *c).filter_map(|(r, _)| local(&own, r)).collect(),
                fresh: true,
                own,
            });
        }
        let bucket = shards.iter().map(|s| s.bucket.len()).max().unwrap_or(0);
        let block = shards.iter().map(|s| s.own.len()).max().unwrap_or(0);
        Ok(DeviceShards {
            shards,
            stage: shareable(bucket)?,
            recv: shareable(block)?,
            every_backward: sync.reduces_every_backward(),
            per_unit: sync.reduces_every_backward() && model.is_whole(),
            sharded_params: sync.zero == 3,
            reduced: 0,
            comm: Duration::ZERO,
            flag: LocalFlag::new(dev)?,
        })
    }

    /// Device bytes of the optimizer state and its staging (3 shard-sized buffers, one bucket,
    /// one block).
    pub fn device_bytes(&self) -> usize {
        let shard: usize = self.shards.iter().map(|s| s.own.len()).sum();
        12 * shard + self.stage.len() + self.recv.len()
    }

    /// Takes the moments from `sync`'s AdamW states and returns their step count. The weights
    /// are the model's: it uploads its host parameters before its next forward (whole on every
    /// rank at ZeRO <= 2); at ZeRO-3 its parameter shards are set from the host mirror's owned
    /// ranges here.
    pub fn load(&mut self, model: &mut DeviceGpt, sync: &DataParallel) -> Result<u64> {
        let mut step = None;
        for (s, state) in self.shards.iter_mut().zip(sync.states()) {
            if state.range() != s.own || *step.get_or_insert(state.step) != state.step {
                return Err(Error::Check("AdamW states do not match the device shards".into()));
            }
            let dev = model.device();
            dev.copy_to_device(&mut s.m, &state.m)?;
            dev.copy_to_device(&mut s.v, &state.v)?;
        }
        if self.sharded_params {
            model.param_shards_from_host()?;
        }
        if self.per_unit {
            model.set_grad_release()?;
        }
        Ok(step.unwrap_or(0))
    }

    /// Copies the model's device parameters (every rank's updated shards, gathered) to its host
    /// mirror and the moments into `sync`'s AdamW states at step count `step`.
    pub fn store(&self, model: &mut DeviceGpt, sync: &mut DataParallel, step: u64) -> Result<()> {
        if self.sharded_params {
            // ZeRO-3 checkpoints write each rank's owned ranges only.
            model.host_params_from_shards()?;
        } else {
            model.host_params_from_device()?;
        }
        let dev = model.device();
        for (s, state) in self.shards.iter().zip(sync.states_mut()) {
            dev.copy_to_host(&s.m, &mut state.m)?;
            dev.copy_to_host(&s.v, &mut state.v)?;
            state.step = step;
        }
        Ok(())
    }

    /// After a backward holding `covered` of the step's `micro_batches`: at ZeRO-2 reduces their
    /// gradients into the shards and zeroes the model's gradients for the next (ZeRO-1 waits for
    /// the step).
    pub fn after_backward(
        &mut self,
        model: &mut DeviceGpt,
        dp: &Communicator,
        coll: &mut GpuCommState,
        (micro_batches, covered): (usize, usize),
    ) -> Result<()> {
        if self.per_unit {
            // The backward reduced every unit as it finished ([`DeviceShards::reduce_unit`]).
            self.reduced += covered;
        } else if self.every_backward {
            self.reduce(model, dp, coll, micro_batches, covered)?;
            model.zero_grad()?;
        }
        Ok(())
    }

    /// Whether the backward hands each unit's gradients to [`DeviceShards::reduce_unit`].
    pub fn per_unit(&self) -> bool {
        self.per_unit
    }

    /// Reduces the buckets inside the flat range `unit` (a unit whose gradients for this
    /// micro-batch are final) into the shards.
    pub fn reduce_unit(&mut self, model: &DeviceGpt, dp: &Communicator, coll: &mut GpuCommState, micro_batches: usize, unit: Range<usize>) -> Result<()> {
        let inside = |s: &Shard| unit.start <= s.bucket.start && s.bucket.end <= unit.end;
        self.reduce_shards(model, dp, coll, micro_batches, &inside)
    }

    /// Reduce-scatters the model's device gradients, scaled by 1/`micro_batches`, bucket by
    /// bucket into the shards (the first reduction of a step sets them, later ones add).
    /// `covered` micro-batches' gradients are in the model.
    fn reduce(&mut self, model: &DeviceGpt, dp: &Communicator, coll: &mut GpuCommState, micro_batches: usize, covered: usize) -> Result<()> {
        self.reduce_shards(model, dp, coll, micro_batches, &|_| true)?;
        self.reduced += covered;
        Ok(())
    }

    /// Reduce-scatters the model's gradients of the buckets `which` selects, scaled by
    /// 1/`micro_batches`, into their shards.
    fn reduce_shards(
        &mut self,
        model: &DeviceGpt,
        dp: &Communicator,
        coll: &mut GpuCommState,
        micro_batches: usize,
        which: &dyn Fn(&Shard) -> bool,
    ) -> Result<()> {
        let dev = model.device();
        for s in self.shards.iter_mut().filter(|s| which(s)) {
            let first = std::mem::replace(&mut s.fresh, false);
            let n = s.bucket.len();
            model.pack_grads_range(s.bucket.clone(), &mut self.stage)?;
            self.flag.mark(dev, &self.stage, 0, n)?;
            // The host reducer's staging copy multiplies by the same f32 factor.
            ops::scale(dev, &mut self.stage, 0, n, 1.0 / micro_batches.max(1) as f32)?;
            // The packing is still queued: the communication time starts after it.
            dev.synchronize()?;
            let t0 = Instant::now();
            let out = if first { &mut s.grads } else { &mut self.recv };
            if dp.size() > 1 {
                coll.bind(dp, dev).reduce_scatter_into(&self.stage, out, n, DType::F32, ReduceOp::Avg)?;
            } else {
                ops::copy(dev, out, 0, &self.stage, 0, n)?;
            }
            if !first {
                ops::reduce_into(dev, DType::F32, ReduceOp::Sum, &mut s.grads, &self.recv, s.own.len())?;
            }
            dev.synchronize()?;
            self.comm += t0.elapsed();
        }
        Ok(())
    }

    /// Finishes the step's reduction on the device (ZeRO-1: the only one) and returns the time
    /// spent in it this step.
    pub fn reduce_all(&mut self, model: &DeviceGpt, dp: &Communicator, coll: &mut GpuCommState, micro_batches: usize) -> Result<Duration> {
        if !self.every_backward {
            self.reduce(model, dp, coll, micro_batches, micro_batches)?;
        }
        if self.reduced != micro_batches || self.shards.iter().any(|s| s.fresh) {
            return Err(Error::Check(format!("{} micro-batches reduced in a step of {micro_batches}, or a bucket never", self.reduced)));
        }
        self.reduced = 0;
        for s in &mut self.shards {
            s.fresh = true;
        }
        Ok(std::mem::take(&mut self.comm))
    }

    /// Adds a reduced block of bucket `k` (its first this step: sets it) into the gradient
    /// shard, as the device reducer hands it over.
    pub fn add_block(&mut self, dev: &Device, k: usize, block: &DeviceBuffer, first: bool) -> Result<()> {
        let s = &mut self.shards[k];
        let n = s.own.len();
        s.fresh = false;
        match first {
            true => ops::copy(dev, &mut s.grads, 0, block, 0, n),
            false => ops::reduce_into(dev, DType::F32, ReduceOp::Sum, &mut s.grads, block, n),
        }
    }

    /// Ends a step whose shards the device reducer filled: every shard must have had a result.
    pub fn end_overlapped(&mut self) -> Result<()> {
        if let Some(s) = self.shards.iter().find(|s| s.fresh) {
            return Err(Error::Check(format!("gradient bucket {:?} was never reduced this step", s.bucket)));
        }
        self.shards.iter_mut().for_each(|s| s.fresh = true);
        Ok(())
    }

    /// Adds a reduced block of bucket `k` in host memory (its first this step: sets it) into
    /// the gradient shard, as the host reducer hands it over (the CPU arm: the shard is host
    /// memory too, so this is the host reducer's own sum, in place).
    pub fn add_host_block(&mut self, dev: &Device, k: usize, block: &[f32], first: bool) -> Result<()> {
        let s = &mut self.shards[k];
        s.fresh = false;
        if first {
            return dev.copy_to_device(&mut s.grads, block);
        }
        let g = ops::host_mut("add_host_block", &mut s.grads)?.view_mut::<f32>(block.len());
        g.iter_mut().zip(block).for_each(|(a, x)| *a += x);
        Ok(())
    }

    /// Whether the gradients this rank packed for the reduction this step held a NaN or an
    /// infinity; clears the flag.
    pub fn take_nonfinite(&mut self, model: &DeviceGpt) -> Result<bool> {
        self.flag.take(model.device())
    }

    /// This rank's sum of the squares of its counted shard elements, summed over `dp`.
    pub fn square(&self, model: &DeviceGpt, dp: &Communicator, partials: &mut DeviceBuffer) -> Result<f64> {
        let dev = model.device();
        let mut sq = [0.0f64];
        for s in &self.shards {
            for r in &s.counted {
                sq[0] += ops::sum_squares(dev, partials, &s.grads, r.start, r.len())?;
            }
        }
        dp.all_reduce(&mut sq, ReduceOp::Sum)?;
        Ok(sq[0])
    }

    /// Applies the AdamW update `u` (clipping scale included) to the shards' weights, and
    /// gathers the updated weights over `dp` into the model's tensors (ZeRO-3: updates the
    /// model's parameter shards in place).
    pub fn update(
        &mut self,
        model: &mut DeviceGpt,
        dp: &Communicator,
        coll: &mut GpuCommState,
        u: &AdamWStep,
    ) -> Result<()> {
        for (k, s) in self.shards.iter_mut().enumerate() {
            let mut adamw = |dev: &Device, params: &mut DeviceBuffer| {
                for (span, decay) in &s.decay {
                    let bufs = AdamWBuffers { params: &mut *params, grads: &s.grads, m: &mut s.m, v: &mut s.v };
                    ops::adamw_update(dev, bufs, span.clone(), u, *decay)?;
                }
                Ok(())
            };
            if self.sharded_params {
                model.with_param_shard(k, &mut adamw)?;
                continue;
            }
            model.pack_params_range(s.own.clone(), &mut self.recv)?;
            adamw(model.device(), &mut self.recv)?;
            if dp.size() > 1 {
                coll.bind(dp, model.device()).all_gather_into(&self.recv, &mut self.stage, s.bucket.len(), DType::F32)?;
                model.unpack_params_range(s.bucket.clone(), &self.stage)?;
            } else {
                model.unpack_params_range(s.bucket.clone(), &self.recv)?;
            }
        }
        match self.sharded_params {
            true => Ok(()),
            false => model.refresh_params16(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::buckets::{OverlapReducer, Reduction, ShardSums};
    use super::super::device_step::DeviceStep;
    use super::*;
    use crate::comm::testing::run_ranks;
    use crate::comm::CommConfig;
    use crate::device::Device;
    use crate::model::{Gpt, GptConfig, Precision};
    use crate::optim::{
        clip_scale, scale_grads, sum_of_squares, AdamW, AdamWConfig, AdamWState, DecayMask,
    };

    const B: usize = 2;
    const T: usize = 16;

    /// Tokens of micro-batch `k` of step `step` on data-parallel rank `rank`.
    fn batch(step: usize, rank: usize, k: usize) -> Vec<u32> {
        (0..B * T).map(|i| ((i * 7 + rank * 13 + k * 5 + step * 31) % 256) as u32).collect()
    }

    /// The reference optimizer step on host slices, written out: the reducer's averaged shards,
    /// the norm's squares per (bucket shard, counted span) summed over `dp`, the clip factor,
    /// AdamW per shard and the buckets all-gathered. Returns the pre-clip norm.
    fn reference_step(
        (red, sums): (&mut OverlapReducer, &mut ShardSums),
        (states, buckets): (&mut [AdamWState<f32>], &[Range<usize>]),
        dp: &Communicator,
        (opt, lr, max_norm): (&AdamW, f64, f64),
        params: &mut [f32],
    ) -> f64 {
        red.finish(&mut |b, _, v, first| sums.add(b, v, first)).unwrap();
        let mut sq = [0.0f64];
        for (b, s) in states.iter().enumerate() {
            sq[0] += sum_of_squares(&sums.0[b]);
            debug_assert_eq!(s.range().len(), sums.0[b].len());
        }
        dp.all_reduce(&mut sq, ReduceOp::Sum).unwrap();
        let norm = sq[0].sqrt();
        let scale = clip_scale(norm, max_norm);
        for (b, s) in states.iter_mut().enumerate() {
            let g = &mut sums.0[b];
            scale_grads(g, scale);
            let r = s.range();
            opt.step(s, lr, &mut params[r], g).unwrap();
        }
        for b in buckets {
            dp.all_gather(&mut params[b.clone()]).unwrap();
        }
        norm
    }

    /// Three bf16 steps of two micro-batches on each of two ranks, once through a reference step
    /// written out on host slices over the model's reported gradients ([`reference_step`]) and
    /// once through the device step with its sharded state: the parameters, moments, step counts
    /// and gradient norms are bit for bit the same on the CPU device, with clipping active and
    /// buckets that cut tensors apart; at ZeRO 2 the model hands each unit's gradients to the
    /// step as soon as they are final and frees them.
    #[test]
    fn device_shards_step_exactly_as_the_reference_step() {
        for zero in [1u8, 2] {
            let results = run_ranks(2, CommConfig::default(), move |c| {
                let cfg = GptConfig::named("tiny").unwrap();
                let init = Gpt::<f32>::new(cfg, B, T, 7).unwrap().params().to_vec();
                let n = init.len();
                let new_model = || DeviceGpt::new(Device::Cpu, cfg, B, T, init.clone(), Precision::Bf16).unwrap();
                let (mut host, mut dev) = (new_model(), new_model());
                let decay = host.layout().decay_spans();
                let norm = vec![(0..n, true)];
                let adamw = AdamWConfig::default();
                let opt = AdamW::new(adamw, DecayMask::from_spans(decay.clone()));
                // The model's units, as the trainer plans buckets (inside them: ZeRO-2 reduces unit by
                // unit during the backward).
                let (bucket, units) = (5000, dev.units());
                let mut host_sync = DataParallel::new((c.rank(), c.size()), &units, zero, bucket).unwrap();
                let mut dev_sync = DataParallel::new((c.rank(), c.size()), &units, zero, bucket).unwrap();
                assert!(dev_sync.buckets() > 3);
                let buckets = host_sync.bucket_ranges().to_vec();
                let red_comm = c.split(Some(0), c.rank() as i64).unwrap().unwrap();
                let mut red = OverlapReducer::new(red_comm, buckets.clone(), Reduction::ReduceScatter);
                let mut sums = ShardSums::new(&red, buckets.len());
                let mut step = DeviceStep::new(&dev, &dev_sync, &c, (&decay, &norm), adamw).unwrap();
                step.load(&mut dev, &mut dev_sync).unwrap();
                let (accum, lr, max_norm) = (2, 1e-3, 0.5);
                for s in 0..3 {
                    host.zero_grad().unwrap();
                    dev.zero_grad().unwrap();
                    red.begin(accum);
                    step.begin(accum);
                    for k in 0..accum {
                        let tokens = batch(s, c.rank(), k);
                        host.forward(&tokens, &tokens).unwrap();
                        let report = zero == 2 || k + 1 == accum;
                        host.backward(report, &mut |r, g| red.on_final(r, g, &mut |b, _, v, first| sums.add(b, v, first))).unwrap();
                        if zero == 2 {
                            host.zero_grad().unwrap();
                        }
                        dev.forward(&tokens, &tokens).unwrap();
                        if report {
                            // Each unit handed over as soon as its gradients are final (ZeRO-2: then freed).
                            dev.backward_reducing(&mut |m, unit| step.reduce_unit(m, &c, accum, unit)).unwrap();
                        } else {
                            dev.backward(false, &mut |_, _| panic!("the device step reads the device gradients")).unwrap();
                        }
                        step.after_backward(&mut dev, &c, (accum, 1)).unwrap();
                    }
                    let mut params = host.params().to_vec();
                    let want = reference_step((&mut red, &mut sums), (host_sync.states_mut(), &buckets), &c, (&opt, lr, max_norm), &mut params);
                    host.params_and_grads().0.copy_from_slice(&params);
                    let got = step.step(&mut dev, &c, &[], accum, lr, (max_norm, 1.0), &mut |_, _| Ok(true)).unwrap();
                    assert!(want > max_norm, "clipping is exercised");
                    assert_eq!(got.grad_norm.to_bits(), want.to_bits(), "ZeRO {zero} step {s}");
                }
                step.store(&mut dev, &mut dev_sync).unwrap();
                let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same(dev.params(), host.params()), "ZeRO {zero}: parameters differ");
                for (d, h) in dev_sync.states().iter().zip(host_sync.states()) {
                    assert_eq!((d.range(), d.step), (h.range(), h.step));
                    assert!(same(&d.m, &h.m) && same(&d.v, &h.v), "ZeRO {zero}: moments of {:?} differ", d.range());
                }
                // The state is a shard: 3 shard-sized buffers (the weights are the model's), one
                // bucket and one block of staging.
                let shard = dev_sync.state_len();
                assert!(shard < n / 2 + dev_sync.buckets());
                assert_eq!(step.device_bytes(), 12 * shard + 4 * bucket + 4 * bucket.div_ceil(2));
                step.finish(&dev, &c).unwrap();
                dev.params().to_vec()
            });
            assert_eq!(results[0], results[1], "ZeRO {zero}: ranks disagree");
        }
    }
}
