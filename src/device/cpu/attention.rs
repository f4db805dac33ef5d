//! Causal multi-head self-attention core (between the qkv and output projections).
//!
//! `qkv` rows hold `[q | k | v]`, each `nh * hs` wide, head `h` at columns `h*hs..(h+1)*hs` of
//! each part. The number of heads is an argument, so a tensor-parallel rank holding a subset of
//! heads calls the same function with its local count. The forward keeps the softmax
//! probabilities `att` (B, NH, T, T) for the backward; entries above the diagonal are zero.
//! Batch rows are independent, so they are split across cores (see `parallel.rs`). The q·k
//! scores and the backward's dy·v products are taken four keys at a time (`dots`), each sum
//! still in index order, so the results are bitwise those of one dot product at a time.

use super::float::Float;
use super::parallel::{chunk_items, run_parts};

/// Shape of one attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    /// Batch size (B).
    pub b: usize,
    /// Sequence length (T).
    pub t: usize,
    /// Heads held by this caller (NH).
    pub nh: usize,
    /// Head width (hs); the scale is 1/sqrt(hs).
    pub hs: usize,
}

impl AttnShape {
    fn c(&self) -> usize {
        self.nh * self.hs
    }
}

/// out (B, T, NH*hs), att (B, NH, T, T) from qkv (B, T, 3*NH*hs).
pub fn attention_forward<F: Float>(out: &mut [F], att: &mut [F], qkv: &[F], s: AttnShape) {
    let (t, c) = (s.t, s.c());
    let per = chunk_items(s.b, s.nh * t * t * s.hs);
    let outs = out[..s.b * t * c].chunks_mut(per * t * c);
    let atts = att[..s.b * s.nh * t * t].chunks_mut(per * s.nh * t * t);
    run_parts(
        outs.zip(atts).zip(qkv.chunks(per * t * 3 * c)),
        |((o, a), x)| {
            attention_forward_serial(
                o,
                a,
                x,
                AttnShape {
                    b: o.len() / (t * c),
                    ..s
                },
            )
        },
    );
}

fn attention_forward_serial<F: Float>(out: &mut [F], att: &mut [F], qkv: &[F], s: AttnShape) {
    let AttnShape { b, t, nh, hs } = s;
    let c = s.c();
    let scale = F::one() / F::from_f64(hs as f64).sqrt();
    for bi in 0..b {
        for h in 0..nh {
            for ti in 0..t {
                let q = &qkv[(bi * t + ti) * 3 * c + h * hs..][..hs]; // (hs)
                let row = &mut att[((bi * nh + h) * t + ti) * t..][..t]; // (T)
                let key = |t2: usize| &qkv[(bi * t + t2) * 3 * c + c + h * hs..][..hs]; // (hs)
                dots(&mut row[..=ti], q, key);
                let mut max = F::neg_infinity();
                for a in row[..=ti].iter_mut() {
                    *a *= scale;
                    max = max.max(*a);
                }
                let mut sum = F::zero();
                for a in row[..=ti].iter_mut() {
                    *a = (*a - max).exp();
                    sum += *a;
                }
                let inv = F::one() / sum;
                row[..=ti].iter_mut().for_each(|a| *a *= inv);
                row[ti + 1..].iter_mut().for_each(|a| *a = F::zero());
                let o = &mut out[(bi * t + ti) * c + h * hs..][..hs]; // (hs)
                o.iter_mut().for_each(|x| *x = F::zero());
                for (t2, &a) in row[..=ti].iter().enumerate() {
                    let v = &qkv[(bi * t + t2) * 3 * c + 2 * c + h * hs..][..hs]; // (hs)
                    for (x, &vi) in o.iter_mut().zip(v) {
                        *x += a * vi;
                    }
                }
            }
        }
    }
}

/// Scratch elements [`attention_backward`] should get for sequence length `t`: one row of T
/// per thread (with less, it uses fewer threads).
pub fn attention_scratch_len(t: usize) -> usize {
    super::parallel::cores() * t
}

/// dqkv (B, T, 3*NH*hs) += ... from dout (B, T, NH*hs), qkv and att of the forward;
/// `scratch` holds [`attention_scratch_len`] elements.
pub fn attention_backward<F: Float>(
    dqkv: &mut [F],
    scratch: &mut [F],
    dout: &[F],
    qkv: &[F],
    att: &[F],
    s: AttnShape,
) {
    let (t, c) = (s.t, s.c());
    assert!(
        scratch.len() >= t,
        "attention_backward: scratch of {} < T = {t}",
        scratch.len()
    );
    // No more parts than scratch rows.
    let per = chunk_items(s.b, s.nh * t * t * s.hs).max(s.b.div_ceil(scratch.len() / t));
    let dqkvs = dqkv[..s.b * t * 3 * c].chunks_mut(per * t * 3 * c);
    let parts = dout
        .chunks(per * t * c)
        .zip(qkv.chunks(per * t * 3 * c))
        .zip(att.chunks(per * s.nh * t * t));
    run_parts(
        dqkvs.zip(scratch.chunks_mut(t)).zip(parts),
        |((d, row), ((dy, x), a))| {
            attention_backward_serial(
                d,
                row,
                dy,
                x,
                a,
                AttnShape {
                    b: d.len() / (t * 3 * c),
                    ..s
                },
            )
        },
    );
}

fn attention_backward_serial<F: Float>(
    dqkv: &mut [F],
    scratch: &mut [F],
    dout: &[F],
    qkv: &[F],
    att: &[F],
    s: AttnShape,
) {
    let AttnShape { b, t, nh, hs } = s;
    let c = s.c();
    let scale = F::one() / F::from_f64(hs as f64).sqrt();
    for bi in 0..b {
        for h in 0..nh {
            for ti in 0..t {
                // out = sum_t2 a[t2] v[t2]: datt[t2] = dy·v[t2], dv[t2] += a[t2] dy.
                let a = &att[((bi * nh + h) * t + ti) * t..][..=ti]; // (ti+1)
                let dy = &dout[(bi * t + ti) * c + h * hs..][..hs]; // (hs)
                let datt = &mut scratch[..=ti]; // (ti+1)
                let value = |t2: usize| &qkv[(bi * t + t2) * 3 * c + 2 * c + h * hs..][..hs]; // (hs)
                dots(datt, dy, value);
                for (t2, &ai) in a.iter().enumerate() {
                    let voff = (bi * t + t2) * 3 * c + 2 * c + h * hs;
                    for (dv, &d) in dqkv[voff..][..hs].iter_mut().zip(dy) {
                        *dv += ai * d;
                    }
                }
                // Softmax backward: dpre = a * (datt - sum(a * datt)), then through q·k * scale.
                let dot: F = datt.iter().zip(a).map(|(&x, &y)| x * y).sum();
                let qoff = (bi * t + ti) * 3 * c + h * hs;
                let q = &qkv[qoff..][..hs]; // (hs)
                for (t2, (&da, &ai)) in datt.iter().zip(a).enumerate() {
                    let dpre = ai * (da - dot) * scale;
                    let koff = (bi * t + t2) * 3 * c + c + h * hs;
                    let k = &qkv[koff..][..hs]; // (hs)
                    let (dq, dk) = q_and_k_rows(dqkv, qoff, koff, hs);
                    dq.iter_mut().zip(k).for_each(|(d, &x)| *d += dpre * x);
                    dk.iter_mut().zip(q).for_each(|(d, &x)| *d += dpre * x);
                }
            }
        }
    }
}

/// `out[j] = Σ_i x[i] · row(j)[i]` for every j, each sum in index order exactly as
/// `x.iter().zip(row(j)).map(|(a, b)| a * b).sum()` adds it: four rows at a time, so the four
/// independent chains of additions overlap instead of each waiting on the previous (bitwise the
/// same result, several times faster at head widths of 64).
fn dots<'a, F: Float>(out: &mut [F], x: &[F], row: impl Fn(usize) -> &'a [F]) {
    // The value `Iterator::sum` starts from (-0.0 in recent Rust), so a zero sum has its sign.
    let zero: F = std::iter::empty().sum();
    let done = out.len() / 4 * 4;
    for (j, o) in out[..done].chunks_exact_mut(4).enumerate() {
        let r = [row(4 * j), row(4 * j + 1), row(4 * j + 2), row(4 * j + 3)];
        let mut acc = [zero; 4];
        for (i, &xi) in x.iter().enumerate() {
            for (a, r) in acc.iter_mut().zip(&r) {
                *a += xi * r[i];
            }
        }
        o.copy_from_slice(&acc);
    }
    for (j, o) in out[done..].iter_mut().enumerate() {
        *o = x.iter().zip(row(done + j)).map(|(&a, &b)| a * b).sum();
    }
}

/// The disjoint rows `dqkv[qoff..][..hs]` and `dqkv[koff..][..hs]` (a q part and a k part, which
/// never overlap: each is `hs` wide inside its own `C`-wide third of a row).
fn q_and_k_rows<F>(dqkv: &mut [F], qoff: usize, koff: usize, hs: usize) -> (&mut [F], &mut [F]) {
    if qoff < koff {
        let (lo, hi) = dqkv.split_at_mut(koff);
        (&mut lo[qoff..][..hs], &mut hi[..hs])
    } else {
        let (lo, hi) = dqkv.split_at_mut(qoff);
        (&mut hi[..hs], &mut lo[koff..][..hs])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causal_rows_sum_to_one_and_first_token_copies_v() {
        let s = AttnShape {
            b: 1,
            t: 3,
            nh: 2,
            hs: 2,
        };
        let qkv: Vec<f64> = (0..3 * 12).map(|i| ((i * 7) % 11) as f64 * 0.1).collect(); // (B, T, 3C)
        let (mut out, mut att) = (vec![0.0; 3 * 4], vec![0.0; 2 * 9]);
        attention_forward(&mut out, &mut att, &qkv, s);
        for (r, row) in att.chunks(3).enumerate() {
            let ti = r % 3;
            assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-15);
            assert!(row[ti + 1..].iter().all(|&a| a == 0.0));
        }
        // Position 0 attends only to itself: out = v of token 0.
        assert_eq!(&out[..4], &qkv[8..12]);
    }

    /// Four dot products at a time give every sum bit for bit as the plain iterator sum, for
    /// any count of rows (whole groups of four and the rest).
    #[test]
    fn grouped_dots_equal_one_at_a_time_bitwise() {
        let x: Vec<f32> = (0..64).map(|i| ((i * 29) % 83) as f32 * 0.013 - 0.5).collect();
        let rows: Vec<Vec<f32>> = (0..11)
            .map(|j| (0..64).map(|i| ((i * 17 + j * 31) % 89) as f32 * 0.021 - 0.9).collect())
            .collect();
        for n in 0..=rows.len() {
            let mut got = vec![f32::NAN; n];
            dots(&mut got, &x, |j| &rows[j][..]);
            for (j, g) in got.iter().enumerate() {
                let want: f32 = x.iter().zip(&rows[j]).map(|(&a, &b)| a * b).sum();
                assert_eq!(g.to_bits(), want.to_bits(), "row {j} of {n}");
            }
        }
    }

    /// Splitting the batch across threads computes every element exactly as one thread does.
    #[test]
    fn threaded_equals_serial_bitwise() {
        let s = AttnShape {
            b: 5,
            t: 32,
            nh: 4,
            hs: 16,
        }; // enough work to split
        let c = 64;
        let qkv: Vec<f32> = (0..5 * 32 * 3 * c)
            .map(|i| ((i * 37) % 101) as f32 * 0.02 - 1.0)
            .collect();
        let dout: Vec<f32> = (0..5 * 32 * c)
            .map(|i| ((i * 53) % 97) as f32 * 0.01 - 0.5)
            .collect();
        let (mut o1, mut a1) = (vec![0f32; 5 * 32 * c], vec![0f32; 5 * 4 * 32 * 32]);
        let (mut o2, mut a2) = (o1.clone(), a1.clone());
        attention_forward(&mut o1, &mut a1, &qkv, s);
        attention_forward_serial(&mut o2, &mut a2, &qkv, s);
        assert_eq!((&o1, &a1), (&o2, &a2));
        let (mut d1, mut d2) = (vec![0f32; qkv.len()], vec![0f32; qkv.len()]);
        attention_backward(
            &mut d1,
            &mut vec![0f32; attention_scratch_len(32)],
            &dout,
            &qkv,
            &a1,
            s,
        );
        attention_backward_serial(&mut d2, &mut [0f32; 32], &dout, &qkv, &a1, s);
        assert_eq!(d1, d2);
    }
}
