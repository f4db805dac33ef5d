//! AdamW (Loshchilov & Hutter): Adam with bias correction and decoupled weight decay.
//!
//! Per element, at step t (1-based):
//! `m = b1 m + (1-b1) g`, `v = b2 v + (1-b2) g²`, `m̂ = m/(1-b1ᵗ)`, `v̂ = v/(1-b2ᵗ)`,
//! `p -= lr (m̂ / (sqrt(v̂) + eps) + wd p)`, where `wd` is 0 for elements outside the decay mask
//! (by default decay applies to 2-D weights only). This is the update of `torch.optim.AdamW`.
//! A state covers `offset..offset+len` of the flat buffers, so a ZeRO shard is just an offset.

use std::ops::Range;

pub use crate::device::cpu::adamw::AdamWConfig;
use crate::device::cpu::adamw::{update_elements, AdamWStep, Coefficients};
use crate::device::cpu::parallel::{chunk_items, run_parts};
use crate::device::cpu::Float;
use crate::error::{Error, Result};
use crate::model::ParamLayout;

/// Which flat-buffer elements get weight decay: sorted, disjoint spans covering the buffer.
#[derive(Debug, Clone)]
pub struct DecayMask {
    spans: Vec<(Range<usize>, bool)>,
}

impl DecayMask {
    /// Decay on the layout's 2-D weights, none on biases and LayerNorm parameters.
    pub fn from_layout(layout: &ParamLayout) -> Self {
        DecayMask {
            spans: layout.decay_spans(),
        }
    }

    /// Decay given by sorted, disjoint `(range, decay)` spans covering the buffer (e.g. a
    /// tensor-parallel shard's layout).
    pub fn from_spans(spans: Vec<(Range<usize>, bool)>) -> Self {
        DecayMask { spans }
    }

    /// Spans clipped to `range`, in order.
    fn segments(&self, range: Range<usize>) -> impl Iterator<Item = (Range<usize>, bool)> + '_ {
        self.spans.iter().filter_map(move |(r, d)| {
            let (lo, hi) = (r.start.max(range.start), r.end.min(range.end));
            (lo < hi).then_some((lo..hi, *d))
        })
    }

    /// End of the covered buffer.
    fn len(&self) -> usize {
        self.spans.last().map_or(0, |(r, _)| r.end)
    }
}

/// Moments of the elements `offset..offset + len` and the number of steps taken. The moments may
/// be given back ([`AdamWState::release`]) while a device holds them, and are brought back to
/// their length ([`AdamWState::ensure`]) before they are read or written again.
#[derive(Debug, Clone)]
pub struct AdamWState<F> {
    /// First moments.
    pub m: Vec<F>,
    /// Second moments.
    pub v: Vec<F>,
    /// Steps taken so far (the next step is `step + 1`).
    pub step: u64,
    offset: usize,
    len: usize,
}

impl<F: Float> AdamWState<F> {
    /// Zero moments for the flat range `offset..offset + len`.
    pub fn new(offset: usize, len: usize) -> Self {
        AdamWState {
            m: vec![F::zero(); len],
            v: vec![F::zero(); len],
            step: 0,
            offset,
            len,
        }
    }

    /// The flat range this state covers.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.len
    }

    /// Gives the moments' memory back (a device holds the training state).
    pub fn release(&mut self) {
        self.m = Vec::new();
        self.v = Vec::new();
    }

    /// Brings released moments back to their length (zeros until written).
    pub fn ensure(&mut self) {
        self.m.resize(self.len, F::zero());
        self.v.resize(self.len, F::zero());
    }
}

/// AdamW over flat buffers with a decay mask.
#[derive(Debug, Clone)]
pub struct AdamW {
    config: AdamWConfig,
    mask: DecayMask,
}

impl AdamW {
    /// An optimizer with hyper-parameters `config` and decay mask `mask`.
    pub fn new(config: AdamWConfig, mask: DecayMask) -> Self {
        AdamW { config, mask }
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    /// One update with learning rate `lr` of `params` from `grads`, both the slices of the flat
    /// buffers at `state.range()`.
    pub fn step<F: Float>(
        &self,
        state: &mut AdamWState<F>,
        lr: f64,
        params: &mut [F],
        grads: &[F],
    ) -> Result<()> {
        let range = state.range();
        if params.len() != range.len() || grads.len() != range.len() || range.end > self.mask.len() {
            return Err(Error::InvalidArgument(format!(
                "adamw: state covers {range:?} of {} elements but got {} params and {} grads",
                self.mask.len(),
                params.len(),
                grads.len()
            )));
        }
        state.step += 1;
        let k = Coefficients::new(&AdamWStep {
            config: &self.config,
            step: state.step,
            lr,
            grad_scale: 1.0,
        });
        // Element-wise, so the range is split across cores; see `device::cpu::parallel`.
        let per = chunk_items(range.len(), 1);
        let parts = params.chunks_mut(per).zip(grads.chunks(per));
        let moments = state.m.chunks_mut(per).zip(state.v.chunks_mut(per));
        run_parts(parts.zip(moments).enumerate(), |(i, ((p, g), (m, v)))| {
            self.update(&k, range.start + i * per, p, g, m, v)
        });
        Ok(())
    }

    /// Updates the flat elements `start..start + p.len()`, segment by segment of the mask.
    fn update<F: Float>(
        &self,
        k: &Coefficients<F>,
        start: usize,
        p: &mut [F],
        g: &[F],
        m: &mut [F],
        v: &mut [F],
    ) {
        for (seg, decay) in self.mask.segments(start..start + p.len()) {
            let local = seg.start - start..seg.end - start;
            let wd = F::from_f64(if decay { self.config.weight_decay } else { 0.0 });
            let (p, g) = (&mut p[local.clone()], &g[local.clone()]);
            let (m, v) = (&mut m[local.clone()], &mut v[local]);
            update_elements(k, wd, p, g, m, v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::GptConfig;

    fn layout() -> ParamLayout {
        ParamLayout::new(&GptConfig {
            n_layer: 2,
            n_head: 2,
            n_embd: 8,
            vocab_size: 20,
            max_seq_len: 5,
            llama: None,
        })
    }

    /// The first step moves every element by lr·sign(g) (m̂ = g, v̂ = g²) plus decay lr·wd·p.
    #[test]
    fn first_step_is_sign_descent_plus_decay() {
        let lay = layout();
        let n = lay.total_len();
        let opt = AdamW::new(
            AdamWConfig {
                eps: 0.0,
                ..Default::default()
            },
            DecayMask::from_layout(&lay),
        );
        let mut p = vec![1.0f64; n];
        let g: Vec<f64> = (0..n).map(|i| if i % 2 == 0 { 0.5 } else { -2.0 }).collect();
        let mut st = AdamWState::new(0, n);
        opt.step(&mut st, 0.01, &mut p, &g).unwrap();
        for e in lay.entries() {
            for i in e.range() {
                let want = 1.0 - 0.01 * g[i].signum() - if e.decay { 0.01 * 0.1 } else { 0.0 };
                assert!(
                    (p[i] - want).abs() < 1e-15,
                    "{} [{i}]: {} vs {want}",
                    e.name,
                    p[i]
                );
            }
        }
    }

    /// Updating two shards separately equals updating the whole buffer (ZeRO invariant).
    #[test]
    fn sharded_update_equals_full_update() {
        let lay = layout();
        let n = lay.total_len();
        let opt = AdamW::new(AdamWConfig::default(), DecayMask::from_layout(&lay));
        let p0: Vec<f32> = (0..n).map(|i| ((i * 37) % 101) as f32 * 0.01 - 0.5).collect();
        let g: Vec<f32> = (0..n).map(|i| ((i * 53) % 97) as f32 * 0.001 - 0.05).collect();
        let mut full = p0.clone();
        let mut st = AdamWState::new(0, n);
        let mut sharded = p0;
        let cut = n / 3 + 5;
        let (mut s1, mut s2) = (AdamWState::new(0, cut), AdamWState::new(cut, n - cut));
        for _ in 0..3 {
            opt.step(&mut st, 1e-3, &mut full, &g).unwrap();
            let (a, b) = sharded.split_at_mut(cut);
            opt.step(&mut s1, 1e-3, a, &g[..cut]).unwrap();
            opt.step(&mut s2, 1e-3, b, &g[cut..]).unwrap();
        }
        assert_eq!(full, sharded);
        assert!(opt.step(&mut s2, 1e-3, &mut full[..3], &g[..3]).is_err());
    }
}
