//! Rotary position embedding (RoPE) of the query and key heads, Hugging Face's half-split
//! convention, with Llama 3's frequency scaling.
//!
//! For a head of width hd and pair index i < hd/2, the two elements rotated together are
//! `x[i]` and `x[i + hd/2]` (transformers' `rotate_half`, NOT interleaved neighbours):
//! `out[i] = x[i] cos - x[i+hd/2] sin`, `out[i+hd/2] = x[i+hd/2] cos + x[i] sin`, with the
//! angle `pos * inv_freq_i`, `inv_freq_i = theta^(-2i/hd)` (optionally rescaled by
//! [`Llama3Scaling`]) and `pos` the token's index in its sequence. The table is computed in f64
//! and rounded once to f32 (transformers computes the angles in f32, which differs by a few
//! f32 ulps of the angle: about 1e-6 absolute at position 64, growing with the position).
//! The backward is the transposed (inverse) rotation, `sin` negated: rotations are orthogonal.
//! Rotation runs in place on the q and k parts of `qkv` rows `[q (NH*hd) | k (NKV*hd) | v]`;
//! v is untouched. Rows are independent and split across the cores.

use super::float::Float;
use super::parallel::{chunk_items, run_parts};

/// Llama 3's RoPE frequency scaling (transformers' `rope_type = "llama3"`): long wavelengths are
/// stretched by `factor`, short ones kept, and the band between blended smoothly.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3Scaling {
    /// Divides the inverse frequency of the long wavelengths (`factor`).
    pub factor: f64,
    /// Wavelengths above `original_max_position / low_freq_factor` are fully scaled.
    pub low_freq_factor: f64,
    /// Wavelengths below `original_max_position / high_freq_factor` are unchanged.
    pub high_freq_factor: f64,
    /// The context length the model was pre-trained at (`original_max_position_embeddings`).
    pub original_max_position: f64,
}

impl Llama3Scaling {
    /// The scaled inverse frequency of `inv_freq`.
    pub fn apply(&self, inv_freq: f64) -> f64 {
        let wavelen = 2.0 * std::f64::consts::PI / inv_freq;
        let low_wavelen = self.original_max_position / self.low_freq_factor;
        let high_wavelen = self.original_max_position / self.high_freq_factor;
        if wavelen > low_wavelen {
            inv_freq / self.factor
        } else if wavelen < high_wavelen {
            inv_freq
        } else {
            let smooth = (self.original_max_position / wavelen - self.low_freq_factor)
                / (self.high_freq_factor - self.low_freq_factor);
            (1.0 - smooth) * inv_freq / self.factor + smooth * inv_freq
        }
    }
}

/// The inverse frequencies `theta^(-2i/hd)`, i < hd/2, scaled by `scaling`, in f64.
pub fn inv_freqs(head_dim: usize, theta: f64, scaling: Option<Llama3Scaling>) -> Vec<f64> {
    (0..head_dim / 2)
        .map(|i| {
            let f = theta.powf(-((2 * i) as f64) / head_dim as f64);
            scaling.map_or(f, |s| s.apply(f))
        })
        .collect()
}

/// cos and sin, each (T, hd/2): entry (pos, i) of the angle `pos * inv_freq_i`, computed in f64
/// and rounded to f32.
pub fn rope_table(
    head_dim: usize,
    t: usize,
    theta: f64,
    scaling: Option<Llama3Scaling>,
) -> (Vec<f32>, Vec<f32>) {
    let freqs = inv_freqs(head_dim, theta, scaling);
    let angles = (0..t).flat_map(|pos| freqs.iter().map(move |f| pos as f64 * f));
    angles.map(|a| (a.cos() as f32, a.sin() as f32)).unzip()
}

/// Shape of one RoPE call: qkv (B, T, (NH + 2*NKV) * hd), heads held by this caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RopeShape {
    /// Batch size (B).
    pub b: usize,
    /// Sequence length (T); positions are 0..T.
    pub t: usize,
    /// Query heads (NH).
    pub nh: usize,
    /// Key/value heads (NKV).
    pub nkv: usize,
    /// Head width (hd), even.
    pub hd: usize,
}

impl RopeShape {
    /// Elements of one token's qkv row.
    pub fn row(&self) -> usize {
        (self.nh + 2 * self.nkv) * self.hd
    }
}

/// Rotates the q and k heads of qkv (B, T, (NH + 2 NKV) hd) in place by the angles of the
/// tables cos, sin (T, hd/2) (`rope_table` rounded to `F`).
pub fn rope_forward<F: Float>(qkv: &mut [F], cos: &[F], sin: &[F], s: RopeShape) {
    rotate(qkv, cos, sin, s, false);
}

/// The transposed rotation (angle negated) of the dq and dk heads of dqkv, in place: the
/// gradient of [`rope_forward`]. dv is untouched.
pub fn rope_backward<F: Float>(dqkv: &mut [F], cos: &[F], sin: &[F], s: RopeShape) {
    rotate(dqkv, cos, sin, s, true);
}

fn rotate<F: Float>(qkv: &mut [F], cos: &[F], sin: &[F], s: RopeShape, inverse: bool) {
    let (row, half) = (s.row(), s.hd / 2);
    if row == 0 || half == 0 {
        return;
    }
    let tokens = s.b * s.t;
    let per = chunk_items(tokens, row);
    let parts = qkv[..tokens * row].chunks_mut(per * row).enumerate();
    run_parts(parts, |(i, x)| {
        for (j, r) in x.chunks_exact_mut(row).enumerate() {
            let pos = (i * per + j) % s.t;
            let (c, sn) = (&cos[pos * half..][..half], &sin[pos * half..][..half]);
            for head in r[..(s.nh + s.nkv) * s.hd].chunks_exact_mut(s.hd) {
                let (lo, hi) = head.split_at_mut(half);
                for (((a, b), &ci), &si) in lo.iter_mut().zip(hi).zip(c).zip(sn) {
                    let si = if inverse { -si } else { si };
                    let (x0, x1) = (*a, *b);
                    *a = x0 * ci - x1 * si;
                    *b = x1 * ci + x0 * si;
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// theta = 100, hd = 4: inv_freq = (1, 100^-1/2 = 0.1); the angles of position 3 are 3 and
    /// 0.3.
    #[test]
    fn table_without_scaling() {
        let (cos, sin) = rope_table(4, 4, 100.0, None);
        assert_eq!(cos.len(), 8);
        assert_eq!(&cos[..2], &[1.0, 1.0]);
        assert_eq!(&sin[..2], &[0.0, 0.0]);
        assert_eq!((cos[6], sin[6]), (3f64.cos() as f32, 3f64.sin() as f32));
        assert_eq!((cos[7], sin[7]), (0.3f64.cos() as f32, 0.3f64.sin() as f32));
    }

    /// hd = 8, theta = 10000: inv_freq = 1, 0.1, 0.01, 0.001, wavelengths 2π (6.28), 62.8,
    /// 628, 6283. With original 1000, low 1, high 4, factor 8 the bands are: wavelen < 250
    /// unchanged (i = 0, 1), > 1000 divided by 8 (i = 3), between smoothed (i = 2:
    /// smooth = (1000/628.3 - 1)/3 = 0.197183..., (1 - smooth) 0.01/8 + smooth 0.01).
    #[test]
    fn llama3_scaling_has_three_bands() {
        let s = Llama3Scaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 1000.0,
        };
        let f = inv_freqs(8, 10000.0, Some(s));
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-15 * b.abs();
        assert!(close(f[0], 1.0) && close(f[1], 0.1), "{f:?}");
        let wavelen = 2.0 * std::f64::consts::PI / 0.01;
        let smooth = (1000.0 / wavelen - 1.0) / 3.0;
        assert!((smooth - 0.197_183_143_6).abs() < 1e-9);
        assert!(
            close(f[2], (1.0 - smooth) * 0.01 / 8.0 + smooth * 0.01),
            "{f:?}"
        );
        assert!(close(f[3], 0.001 / 8.0), "{f:?}");
        let (cos, sin) = rope_table(8, 3, 10000.0, Some(s));
        assert_eq!(
            (cos[4 + 3], sin[4 + 3]),
            ((0.001f64 / 8.0).cos() as f32, (0.001f64 / 8.0).sin() as f32)
        );
        // At the band edges the blend meets the outer bands (continuity).
        let edge = Llama3Scaling {
            original_max_position: 2.0 * std::f64::consts::PI * 100.0,
            ..s
        };
        let near = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs();
        assert!(near(edge.apply(0.01), 0.01 / 8.0));
        let edge = Llama3Scaling {
            original_max_position: 4.0 * 2.0 * std::f64::consts::PI * 100.0,
            ..s
        };
        assert!(near(edge.apply(0.01), 0.01));
    }

    fn shape() -> RopeShape {
        RopeShape {
            b: 2,
            t: 5,
            nh: 4,
            nkv: 2,
            hd: 6,
        }
    }

    fn data(n: usize, a: usize) -> Vec<f64> {
        (0..n)
            .map(|i| ((i * a) % 101) as f64 * 0.02 - 1.0)
            .collect()
    }

    /// Each (i, i + hd/2) pair of every q and k head rotates by its position's angle; v stays.
    #[test]
    fn forward_rotates_half_split_pairs_and_leaves_v() {
        let s = shape();
        let (cos, sin) = rope_table(s.hd, s.t, 10000.0, None);
        let (cos, sin): (Vec<f64>, Vec<f64>) = (
            cos.iter().map(|&v| v as f64).collect(),
            sin.iter().map(|&v| v as f64).collect(),
        );
        let x = data(s.b * s.t * s.row(), 37);
        let mut y = x.clone();
        rope_forward(&mut y, &cos, &sin, s);
        let half = s.hd / 2;
        for tok in 0..s.b * s.t {
            let pos = tok % s.t;
            for h in 0..s.nh + 2 * s.nkv {
                for i in 0..half {
                    let at = tok * s.row() + h * s.hd + i;
                    let (c, sn) = (cos[pos * half + i], sin[pos * half + i]);
                    let (x0, x1) = (x[at], x[at + half]);
                    let want = if h < s.nh + s.nkv {
                        (x0 * c - x1 * sn, x1 * c + x0 * sn)
                    } else {
                        (x0, x1)
                    };
                    assert_eq!((y[at], y[at + half]), want, "token {tok} head {h} pair {i}");
                }
            }
        }
    }

    /// The backward is the transpose: <rope(x), y> == <x, rope_backward(y)>, and it undoes the
    /// forward up to the f32 rounding of the table (cos² + sin² = 1 within 2^-23).
    #[test]
    fn backward_is_the_transposed_rotation() {
        let s = shape();
        let (cos, sin) = rope_table(s.hd, s.t, 500000.0, None);
        let (cos, sin): (Vec<f64>, Vec<f64>) = (
            cos.iter().map(|&v| v as f64).collect(),
            sin.iter().map(|&v| v as f64).collect(),
        );
        let n = s.b * s.t * s.row();
        let (x, y) = (data(n, 37), data(n, 53));
        let (mut rx, mut ry) = (x.clone(), y.clone());
        rope_forward(&mut rx, &cos, &sin, s);
        rope_backward(&mut ry, &cos, &sin, s);
        let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(p, q)| p * q).sum::<f64>();
        assert!((dot(&rx, &y) - dot(&x, &ry)).abs() < 1e-12);
        rope_backward(&mut rx, &cos, &sin, s);
        assert!(rx.iter().zip(&x).all(|(a, b)| (a - b).abs() < 1e-6));
    }
}
