//! The optimizer state of the device step at ZeRO 0: AdamW moments for every tensor of the
//! model, updated in place on the model's own f32 parameters (which are the master weights:
//! the bf16 copies of a bf16 run are cast from them after each step) and gradients.
//!
//! Why in place: a flat copy of the parameters and one of the gradients would hold two more
//! full-size buffers per rank than the model needs. Resident per rank (f32, Ψ parameters on the
//! rank): the model's parameters and gradients, 4Ψ each, m and v, 4Ψ each, and the reduction's
//! staging: one bucket on device memory, or the host reducer's buckets (4Ψ) on host memory.
//!
//! The reduction is bucket by bucket ([`DataParallel`]'s buckets): on device memory each bucket is
//! packed into a staging buffer, scaled by 1/micro-batches, all-reduced (average over DP) with
//! the device collectives and unpacked into the model's gradients; on host memory the step's
//! [`OverlapReducer`] already reduced the buckets during the backward and hands them over here.
//! Either way the squares of the counted elements are taken from the reduced bucket, per
//! (bucket, counted span), and added in bucket order once all are in, so on the CPU the norm is
//! the same number whichever way the buckets arrived.
//!
//! Invariants: moments are one buffer per layout entry (`layout.entries()` order); the model's
//! device parameters are the training state between [`WholeState::load`] and
//! [`WholeState::store`] (the host copy is given back in between).

use std::ops::Range;
use std::time::{Duration, Instant};

use super::buckets::{OverlapReducer, ReduceTiming};
use super::device_overlap::DeviceReducer;
use super::grad_sync::{DataParallel, Spans};
use super::nonfinite::LocalFlag;
use crate::comm::device::GpuCommState;
use crate::comm::{Communicator, DType, ReduceOp};
use crate::device::cpu::adamw::AdamWStep;
use crate::device::ipc::alloc_shareable;
use crate::device::ops::{self, AdamWClearing};
use crate::device::DeviceBuffer;
use crate::error::{Error, Result};
use crate::model::DeviceGpt;
use crate::optim::sum_of_squares;

/// ZeRO-0 optimizer state of a whole (unsharded) parameter buffer.
pub struct WholeState {
    m: Vec<DeviceBuffer>, // per layout entry: (len) first moments
    v: Vec<DeviceBuffer>, // per layout entry: (len) second moments
    /// Weight decay of each layout entry.
    decay: Vec<bool>,
    stage: DeviceBuffer, // (largest bucket) f32: a bucket being reduced on device memory (shareable)
    buckets: Vec<Range<usize>>,
    /// Per bucket: the flat ranges this rank counts in the norm (bucket ∩ counted span).
    counted: Vec<Vec<Range<usize>>>,
    /// Per bucket: the sums of squares of `counted`, this step.
    squares: Vec<Vec<f64>>,
    n: usize,
    /// The gradients packed for the device reduction held a NaN or an infinity.
    flag: LocalFlag,
}

impl WholeState {
    /// Moments for `model`'s tensors, weight decay on the `decay` segments, counting the
    /// `(range, counted)` spans `norm`, reducing `sync`'s buckets; the staging buffer only where
    /// the device collectives reduce (`device_reduce`).
    pub fn new(
        model: &DeviceGpt,
        sync: &DataParallel,
        (decay, norm): (&Spans, &Spans),
        device_reduce: bool,
    ) -> Result<Self> {
        let dev = model.device();
        let entries = model.layout().entries();
        let decay_of = |off: usize| decay.iter().find(|(r, _)| r.contains(&off)).map(|(_, d)| *d);
        let mut state = WholeState {
            m: entries.iter().map(|e| dev.alloc(e.len * 4)).collect::<Result<_>>()?,
            v: entries.iter().map(|e| dev.alloc(e.len * 4)).collect::<Result<_>>()?,
            decay: entries.iter().map(|e| decay_of(e.offset).unwrap_or(false)).collect(),
            stage: dev.alloc(0)?,
            buckets: sync.bucket_ranges().to_vec(),
            counted: Vec::new(),
            squares: Vec::new(),
            n: model.layout().total_len(),
            flag: LocalFlag::new(dev)?,
        };
        state.counted = state.buckets.iter().map(|b| clip_spans(b, norm)).collect();
        state.squares = state.counted.iter().map(|c| vec![0.0; c.len()]).collect();
        if device_reduce {
            let largest = state.buckets.iter().map(|b| b.len()).max().unwrap_or(0);
            state.stage = alloc_shareable(dev, largest.max(1) * 4)?;
        }
        Ok(state)
    }

    /// Device bytes of the moments and the staging buffer.
    pub fn device_bytes(&self) -> usize {
        8 * self.n + self.stage.len()
    }

    /// Sets the moments from `sync`'s AdamW states (which must cover every element); returns
    /// the states' step count.
    pub fn load(&mut self, model: &mut DeviceGpt, sync: &DataParallel) -> Result<u64> {
        let (m, v, step) = gather_moments(sync, self.n)?;
        let dev = model.device();
        for (i, e) in model.layout().entries().iter().enumerate() {
            dev.copy_to_device(&mut self.m[i], &m[e.range()])?;
            dev.copy_to_device(&mut self.v[i], &v[e.range()])?;
        }
        Ok(step)
    }

    /// Brings the parameters into the model's host copy and the moments into `sync`'s AdamW
    /// states at step count `step`, for a checkpoint.
    pub fn store(&self, model: &mut DeviceGpt, sync: &mut DataParallel, step: u64) -> Result<()> {
        model.host_params_from_device()?;
        let (mut m, mut v) = (vec![0f32; self.n], vec![0f32; self.n]);
        let dev = model.device();
        for (i, e) in model.layout().entries().iter().enumerate() {
            dev.copy_to_host(&self.m[i], &mut m[e.range()])?;
            dev.copy_to_host(&self.v[i], &mut v[e.range()])?;
        }
        for s in sync.states_mut() {
            let r = s.range();
            s.m.copy_from_slice(&m[r.clone()]);
            s.v.copy_from_slice(&v[r]);
            s.step = step;
        }
        Ok(())
    }

    /// Takes the buckets the host reducer averaged during the backward into the model's
    /// gradients, with their squares; returns the reduction's timing.
    pub fn take_reduced(&mut self, model: &mut DeviceGpt, reducer: &mut OverlapReducer) -> Result<ReduceTiming> {
        let WholeState { counted, squares, .. } = self;
        reducer.finish(&mut |b, range, data, _| {
            for (sq, c) in squares[b].iter_mut().zip(&counted[b]) {
                *sq = sum_of_squares(&data[c.start - range.start..c.end - range.start]);
            }
            model.set_grads_range(range, data)
        })
    }

    /// Takes the buckets the device reducer averaged during the backward into the model's
    /// gradients, with their squares (`partials`: the norm kernel's block sums); returns the
    /// reduction's timing.
    pub fn take_device_reduced(
        &mut self,
        model: &mut DeviceGpt,
        reducer: &mut DeviceReducer,
        partials: &mut DeviceBuffer,
    ) -> Result<ReduceTiming> {
        let WholeState { counted, squares, .. } = self;
        reducer.finish(&mut |b, range, buf, _| {
            for (sq, c) in squares[b].iter_mut().zip(&counted[b]) {
                *sq = ops::sum_squares(model.device(), partials, buf, c.start - range.start, c.len())?;
            }
            model.unpack_grads_range(range, buf)
        })
    }

    /// Reduces every bucket with the device collectives (after the step's last backward): packs
    /// it, averages it over the micro-batches and `dp`, takes its squares and unpacks it into the
    /// model's gradients (`partials`: the norm kernel's block sums); returns the reduction time.
    pub fn reduce(
        &mut self,
        model: &mut DeviceGpt,
        (dp, coll): (&Communicator, &mut GpuCommState),
        partials: &mut DeviceBuffer,
        micro_batches: usize,
    ) -> Result<Duration> {
        let mut comm = Duration::ZERO;
        for (b, bucket) in self.buckets.iter().enumerate() {
            let dev = model.device();
            let n = bucket.len();
            if dp.size() == 1 && micro_batches == 1 {
                // Nothing to reduce or average: the squares are taken from the model's
                // gradients (in place on the CPU), with the bits of the packed path.
                for (sq, c) in self.squares[b].iter_mut().zip(&self.counted[b]) {
                    let parts = model.grad_parts(c.clone());
                    *sq = ops::sum_squares_parts(dev, partials, &mut self.stage, &parts)?;
                }
                continue;
            }
            model.pack_grads_range(bucket.clone(), &mut self.stage)?;
            self.flag.mark(dev, &self.stage, 0, n)?;
            if micro_batches > 1 {
                // The host reducer's staging copy multiplies by the same f32 factor.
                ops::scale(dev, &mut self.stage, 0, n, 1.0 / micro_batches as f32)?;
            }
            // The backward and the packing are still queued: the communication time starts after them.
            dev.synchronize()?;
            let t0 = Instant::now();
            if dp.size() > 1 {
                coll.bind(dp, dev).all_reduce(&mut self.stage, n, DType::F32, ReduceOp::Avg)?;
            }
            comm += t0.elapsed();
            for (sq, c) in self.squares[b].iter_mut().zip(&self.counted[b]) {
                *sq = ops::sum_squares(dev, partials, &self.stage, c.start - bucket.start, c.len())?;
            }
            model.unpack_grads_range(bucket.clone(), &self.stage)?;
        }
        Ok(comm)
    }

    /// Whether the gradients this rank packed for the reduction this step held a NaN or an
    /// infinity; clears the flag.
    pub fn take_nonfinite(&mut self, model: &DeviceGpt) -> Result<bool> {
        self.flag.take(model.device())
    }

    /// This rank's sum of squares of the counted reduced gradients: per (bucket, counted span),
    /// added in bucket order.
    pub fn square(&self) -> f64 {
        self.squares.iter().flatten().fold(0.0, |acc, s| acc + s)
    }

    /// Applies the AdamW update `s` (clipping scale included) to every tensor of the model in
    /// place; the bf16 copies follow. On the CPU arm the update zeroes each gradient as it reads
    /// it (nothing reads the gradients after the update: the norm and the non-finite check came
    /// before, checkpoints hold parameters and moments), so the next step's
    /// [`DeviceGpt::zero_grad`] has no pass over them to make.
    pub fn update(&mut self, model: &mut DeviceGpt, s: &AdamWStep) -> Result<()> {
        let (dev, layout, params, grads) = model.tensors_mut()?;
        let mut zeroed = true;
        for (i, e) in layout.entries().iter().enumerate() {
            let bufs = AdamWClearing {
                params: &mut params[i],
                grads: &mut grads[i],
                m: &mut self.m[i],
                v: &mut self.v[i],
            };
            zeroed &= ops::adamw_update_clearing(dev, bufs, 0..e.len, s, self.decay[i])?;
        }
        if zeroed {
            model.note_grads_zeroed();
        }
        model.refresh_params16()
    }
}

/// The counted parts of the `(range, counted)` spans inside `bucket`, in span order.
fn clip_spans(bucket: &Range<usize>, spans: &[(Range<usize>, bool)]) -> Vec<Range<usize>> {
    spans
        .iter()
        .filter(|(_, c)| *c)
        .filter_map(|(r, _)| {
            let (lo, hi) = (bucket.start.max(r.start), bucket.end.min(r.end));
            (lo < hi).then_some(lo..hi)
        })
        .collect()
}

/// The flat moments and the step count of `sync`'s states (ZeRO 0: they cover every element).
fn gather_moments(sync: &DataParallel, n: usize) -> Result<(Vec<f32>, Vec<f32>, u64)> {
    let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
    let mut covered = 0;
    let mut step = None;
    for s in sync.states() {
        let r = s.range();
        covered += r.len();
        m[r.clone()].copy_from_slice(&s.m);
        v[r].copy_from_slice(&s.v);
        if *step.get_or_insert(s.step) != s.step {
            return Err(Error::Check("AdamW states of one model disagree on the step count".into()));
        }
    }
    if covered != n {
        return Err(Error::Check(format!("AdamW states cover {covered} of {n} parameters: the whole-state step needs ZeRO 0")));
    }
    Ok((m, v, step.unwrap_or(0)))
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::device::ops::AdamWBuffers;
    use crate::device::Device;
    use crate::model::{Gpt, GptConfig, Precision};
    use crate::optim::AdamWConfig;

    fn rand_vec(r: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| r.gen::<f32>() - 0.5).collect()
    }

    fn down(dev: &Device, b: &DeviceBuffer, n: usize) -> Vec<u32> {
        let mut out = vec![0f32; n];
        dev.copy_to_host(b, &mut out).unwrap();
        out.iter().map(|x| x.to_bits()).collect()
    }

    /// The zeroing update gives the plain update's bits (several threads' worth of elements,
    /// a clipping scale, decay on and off), zeroes exactly the gradients of its span, and names
    /// a buffer too short for the span.
    #[test]
    fn clearing_update_has_the_plain_update_bits_and_zeroes_its_span() {
        let dev = Device::Cpu;
        let mut r = ChaCha8Rng::seed_from_u64(3);
        let n = 300_001;
        let (p, g, m, v) = (
            rand_vec(&mut r, n),
            rand_vec(&mut r, n),
            rand_vec(&mut r, n),
            rand_vec(&mut r, n),
        );
        let v: Vec<f32> = v.iter().map(|x| x.abs()).collect();
        let config = AdamWConfig::default();
        for (decay, step, grad_scale) in [(true, 1, 1.0), (false, 7, 0.37)] {
            let s = AdamWStep {
                config: &config,
                step,
                lr: 3e-3,
                grad_scale,
            };
            let span = 5..n - 3;
            let up = |x: &[f32]| dev.upload(x).unwrap();
            let (mut p1, g1, mut m1, mut v1) = (up(&p), up(&g), up(&m), up(&v));
            let bufs = AdamWBuffers {
                params: &mut p1,
                grads: &g1,
                m: &mut m1,
                v: &mut v1,
            };
            ops::adamw_update(&dev, bufs, span.clone(), &s, decay).unwrap();
            let (mut p2, mut g2, mut m2, mut v2) = (up(&p), up(&g), up(&m), up(&v));
            let bufs = AdamWClearing {
                params: &mut p2,
                grads: &mut g2,
                m: &mut m2,
                v: &mut v2,
            };
            assert!(ops::adamw_update_clearing(&dev, bufs, span.clone(), &s, decay).unwrap());
            for (a, b) in [(&p1, &p2), (&m1, &m2), (&v1, &v2)] {
                assert!(
                    down(&dev, a, n) == down(&dev, b, n),
                    "decay {decay}, step {step}"
                );
            }
            let cleared = down(&dev, &g2, n);
            let expected: Vec<u32> = g
                .iter()
                .enumerate()
                .map(|(i, x)| if span.contains(&i) { 0 } else { x.to_bits() })
                .collect();
            assert!(
                cleared == expected,
                "exactly the span's gradients are zeroed"
            );
        }
        let s = AdamWStep {
            config: &config,
            step: 1,
            lr: 1e-3,
            grad_scale: 1.0,
        };
        let (mut p, mut g, mut m, mut v) = (
            dev.upload(&p).unwrap(),
            dev.upload(&g[..10]).unwrap(),
            dev.alloc(4 * n).unwrap(),
            dev.alloc(4 * n).unwrap(),
        );
        let bufs = AdamWClearing {
            params: &mut p,
            grads: &mut g,
            m: &mut m,
            v: &mut v,
        };
        let err = ops::adamw_update_clearing(&dev, bufs, 0..n, &s, true)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("adamw_f32") && err.contains("`grads`"),
            "{err}"
        );
    }

    /// `zero_grad` skips its pass only while the gradients are still the ones the optimizer
    /// zeroed: a backward in between makes it clear them again.
    #[test]
    fn zero_grad_after_a_backward_clears_even_once_the_optimizer_zeroed() {
        let cfg = GptConfig {
            n_layer: 1,
            n_head: 2,
            n_embd: 16,
            vocab_size: 50,
            max_seq_len: 8,
            llama: None,
        };
        let params = Gpt::<f32>::new(cfg, 2, 8, 1).unwrap().params().to_vec();
        let mut m = DeviceGpt::new(Device::Cpu, cfg, 2, 8, params, Precision::Fp32).unwrap();
        let (x, y): (Vec<u32>, Vec<u32>) = (
            (0..16).map(|i| i % 50).collect(),
            (0..16).map(|i| (i * 7) % 50).collect(),
        );
        let nonzero = |m: &DeviceGpt| {
            let n = m.layout().total_len();
            let parts = m.grad_parts(0..n);
            parts.iter().any(|(b, r)| {
                let mut h = vec![0f32; r.end];
                m.device().copy_to_host(b, &mut h).unwrap();
                h[r.clone()].iter().any(|&g| g != 0.0)
            })
        };
        m.zero_grad().unwrap();
        m.forward(&x, &y).unwrap();
        m.backward(false, &mut |_, _| {}).unwrap();
        assert!(nonzero(&m));
        // As after a zeroing update; then another backward writes gradients again.
        m.note_grads_zeroed();
        m.forward(&x, &y).unwrap();
        m.backward(false, &mut |_, _| {}).unwrap();
        m.zero_grad().unwrap();
        assert!(
            !nonzero(&m),
            "zero_grad skipped gradients a backward had written"
        );
    }
}
