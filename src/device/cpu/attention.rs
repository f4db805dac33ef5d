//! Causal multi-head self-attention core (between the qkv and output projections).
//!
//! `qkv` rows hold `[q (NH*hs) | k (NKV*hs) | v (NKV*hs)]`, head `h` at columns
//! `h*hs..(h+1)*hs` of each part. With NKV < NH (grouped-query attention) query head `h` reads
//! key/value head `h / (NH/NKV)` (transformers' `repeat_kv`), and the backward adds the dk, dv
//! of every query head of a group, in head order; NKV == NH is GPT-2's multi-head attention with
//! exactly the arithmetic it always had. The numbers of heads are arguments, so a
//! tensor-parallel rank holding a subset of heads calls the same function with its local counts.
//! The forward keeps the softmax probabilities `att` (B, NH, T, T) for the backward; entries
//! above the diagonal are zero.
//! Batch rows are independent, so they are split across cores (see `parallel.rs`). The q·k
//! scores and the backward's dy·v products are taken four keys at a time (`dots`), each sum
//! still in index order, so the results are bitwise those of one dot product at a time.

use super::float::Float;
use super::parallel::{chunk_items, run_parts};
use crate::error::{Error, Result};

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
    /// Key/value heads held by this caller (NKV, dividing NH; NH for multi-head attention).
    pub nkv: usize,
}

impl AttnShape {
    /// Multi-head attention (NKV = NH), GPT-2's.
    pub fn mha(b: usize, t: usize, nh: usize, hs: usize) -> Self {
        AttnShape { b, t, nh, hs, nkv: nh }
    }

    /// Grouped-query attention with `nkv` key/value heads; an error unless `nkv` divides `nh`.
    pub fn gqa(b: usize, t: usize, nh: usize, nkv: usize, hs: usize) -> Result<Self> {
        let s = AttnShape { b, t, nh, hs, nkv };
        s.check()?;
        Ok(s)
    }

    /// An error unless NKV >= 1 divides NH.
    pub fn check(&self) -> Result<()> {
        if self.nkv == 0 || self.nh % self.nkv != 0 {
            return Err(Error::InvalidArgument(format!(
                "attention: {} query heads are not a multiple of {} key/value heads",
                self.nh, self.nkv
            )));
        }
        Ok(())
    }

    /// Query heads per key/value head.
    pub fn group(&self) -> usize {
        self.nh / self.nkv
    }

    /// Width of the attention output (NH*hs).
    pub fn c(&self) -> usize {
        self.nh * self.hs
    }

    /// Width of one key (or value) part (NKV*hs).
    pub fn c_kv(&self) -> usize {
        self.nkv * self.hs
    }

    /// Width of one token's qkv row, (NH + 2*NKV)*hs.
    pub fn row(&self) -> usize {
        self.c() + 2 * self.c_kv()
    }

    /// Offsets in a qkv row of query head `h`'s q, k and v (its key/value head's).
    fn offsets(&self, h: usize) -> (usize, usize, usize) {
        let kv = h / self.group() * self.hs;
        (h * self.hs, self.c() + kv, self.c() + self.c_kv() + kv)
    }

    fn assert_valid(&self) {
        if let Err(e) = self.check() {
            panic!("{e}");
        }
    }
}

/// out (B, T, NH*hs), att (B, NH, T, T) from qkv (B, T, (NH + 2*NKV)*hs). Panics unless NKV
/// divides NH (the device ops check [`AttnShape::check`] first and return the error).
pub fn attention_forward<F: Float>(out: &mut [F], att: &mut [F], qkv: &[F], s: AttnShape) {
    s.assert_valid();
    let (t, c, w) = (s.t, s.c(), s.row());
    let per = chunk_items(s.b, s.nh * t * t * s.hs);
    let outs = out[..s.b * t * c].chunks_mut(per * t * c);
    let atts = att[..s.b * s.nh * t * t].chunks_mut(per * s.nh * t * t);
    run_parts(
        outs.zip(atts).zip(qkv.chunks(per * t * w)),
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
    let AttnShape { b, t, nh, hs, .. } = s;
    let (c, w) = (s.c(), s.row());
    let scale = F::one() / F::from_f64(hs as f64).sqrt();
    for bi in 0..b {
        for h in 0..nh {
            let (qo, ko, vo) = s.offsets(h);
            for ti in 0..t {
                let q = &qkv[(bi * t + ti) * w + qo..][..hs]; // (hs)
                let row = &mut att[((bi * nh + h) * t + ti) * t..][..t]; // (T)
                let key = |t2: usize| &qkv[(bi * t + t2) * w + ko..][..hs]; // (hs)
                dots(&mut row[..=ti], q, key);
                let mut max = F::neg_infinity();
                for a in row[..=ti].iter_mut() {
                    *a *= scale;
                    max = max.max(*a);
                }
                row[..=ti].iter_mut().for_each(|a| *a = (*a - max).fast_exp());
                let sum = row[..=ti].iter().fold(F::zero(), |s, &a| s + a);
                let inv = F::one() / sum;
                row[..=ti].iter_mut().for_each(|a| *a *= inv);
                row[ti + 1..].iter_mut().for_each(|a| *a = F::zero());
                let o = &mut out[(bi * t + ti) * c + h * hs..][..hs]; // (hs)
                o.iter_mut().for_each(|x| *x = F::zero());
                for (t2, &a) in row[..=ti].iter().enumerate() {
                    let v = &qkv[(bi * t + t2) * w + vo..][..hs]; // (hs)
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

/// dqkv (B, T, (NH + 2*NKV)*hs) += ... from dout (B, T, NH*hs), qkv and att of the forward;
/// `scratch` holds [`attention_scratch_len`] elements. Panics unless NKV divides NH.
pub fn attention_backward<F: Float>(
    dqkv: &mut [F],
    scratch: &mut [F],
    dout: &[F],
    qkv: &[F],
    att: &[F],
    s: AttnShape,
) {
    s.assert_valid();
    let (t, c, w) = (s.t, s.c(), s.row());
    assert!(
        scratch.len() >= t,
        "attention_backward: scratch of {} < T = {t}",
        scratch.len()
    );
    // No more parts than scratch rows.
    let per = chunk_items(s.b, s.nh * t * t * s.hs).max(s.b.div_ceil(scratch.len() / t));
    let dqkvs = dqkv[..s.b * t * w].chunks_mut(per * t * w);
    let parts = dout
        .chunks(per * t * c)
        .zip(qkv.chunks(per * t * w))
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
                    b: d.len() / (t * w),
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
    let AttnShape { b, t, nh, hs, .. } = s;
    let (c, w) = (s.c(), s.row());
    let scale = F::one() / F::from_f64(hs as f64).sqrt();
    for bi in 0..b {
        for h in 0..nh {
            let (qo, ko, vo) = s.offsets(h);
            for ti in 0..t {
                // out = sum_t2 a[t2] v[t2]: datt[t2] = dy·v[t2], dv[t2] += a[t2] dy.
                let a = &att[((bi * nh + h) * t + ti) * t..][..=ti]; // (ti+1)
                let dy = &dout[(bi * t + ti) * c + h * hs..][..hs]; // (hs)
                let datt = &mut scratch[..=ti]; // (ti+1)
                let value = |t2: usize| &qkv[(bi * t + t2) * w + vo..][..hs]; // (hs)
                dots(datt, dy, value);
                for (t2, &ai) in a.iter().enumerate() {
                    let voff = (bi * t + t2) * w + vo;
                    for (dv, &d) in dqkv[voff..][..hs].iter_mut().zip(dy) {
                        *dv += ai * d;
                    }
                }
                // Softmax backward: dpre = a * (datt - sum(a * datt)), then through q·k * scale.
                let dot: F = datt.iter().zip(a).map(|(&x, &y)| x * y).sum();
                let qoff = (bi * t + ti) * w + qo;
                let q = &qkv[qoff..][..hs]; // (hs)
                for (t2, (&da, &ai)) in datt.iter().zip(a).enumerate() {
                    let dpre = ai * (da - dot) * scale;
                    let koff = (bi * t + t2) * w + ko;
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
/// never overlap: each is `hs` wide inside its own part of a row).
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
        let s = AttnShape::mha(1, 3, 2, 2);
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

    /// qkv (B, T, (NH + 2 NKV) hs) with every key/value head repeated for its query heads
    /// (transformers' `repeat_kv`): the multi-head input GQA must behave as.
    fn repeat_kv(qkv: &[f64], s: AttnShape) -> Vec<f64> {
        let (hs, g) = (s.hs, s.group());
        let mut out = Vec::new();
        for row in qkv.chunks(s.row()) {
            out.extend_from_slice(&row[..s.c()]);
            for part in [s.c(), s.c() + s.c_kv()] {
                (0..s.nh).for_each(|h| out.extend_from_slice(&row[part + h / g * hs..][..hs]));
            }
        }
        out
    }

    /// Grouped-query attention with NKV in {NH, NH/2, 1} equals multi-head attention on the
    /// repeated heads: out and att exactly, dq exactly as computed per head, dk and dv the sums
    /// of the repeated heads' gradients over each group.
    #[test]
    fn gqa_equals_mha_on_repeated_kv_heads() {
        let (b, t, nh, hs) = (2, 7, 4, 5);
        for nkv in [nh, nh / 2, 1] {
            let s = AttnShape::gqa(b, t, nh, nkv, hs).unwrap();
            let m = AttnShape::mha(b, t, nh, hs);
            let qkv: Vec<f64> = (0..b * t * s.row()).map(|i| ((i * 37) % 101) as f64 * 0.02 - 1.0).collect();
            let dout: Vec<f64> = (0..b * t * s.c()).map(|i| ((i * 53) % 97) as f64 * 0.01 - 0.5).collect();
            let big = repeat_kv(&qkv, s);
            let (mut o1, mut a1) = (vec![0.0; b * t * s.c()], vec![0.0; b * nh * t * t]);
            let (mut o2, mut a2) = (o1.clone(), a1.clone());
            attention_forward(&mut o1, &mut a1, &qkv, s);
            attention_forward(&mut o2, &mut a2, &big, m);
            assert_eq!((&o1, &a1), (&o2, &a2), "nkv {nkv}");
            let mut scratch = vec![0.0; attention_scratch_len(t)];
            let mut d1 = vec![0.0; qkv.len()];
            let mut d2 = vec![0.0; big.len()];
            attention_backward(&mut d1, &mut scratch, &dout, &qkv, &a1, s);
            attention_backward(&mut d2, &mut scratch, &dout, &big, &a2, m);
            for (tok, (r1, r2)) in d1.chunks(s.row()).zip(d2.chunks(m.row())).enumerate() {
                assert_eq!(&r1[..s.c()], &r2[..s.c()], "nkv {nkv} token {tok} dq");
                for (part, big_part) in [(s.c(), m.c()), (s.c() + s.c_kv(), 2 * m.c())] {
                    for i in 0..s.c_kv() {
                        let (kv, x) = (i / hs, i % hs);
                        let want: f64 = (0..s.group()).map(|j| r2[big_part + (kv * s.group() + j) * hs + x]).sum();
                        let got = r1[part + i];
                        assert!((got - want).abs() < 1e-12, "nkv {nkv} token {tok} dk/dv {i}: {got} vs {want}");
                    }
                }
            }
        }
        assert!(AttnShape::gqa(1, 1, 4, 3, 2).unwrap_err().to_string().contains("4 query heads"));
        assert!(AttnShape::gqa(1, 1, 4, 0, 2).is_err());
    }

    /// The GQA backward (NKV = 1 and NKV = NH/2) against central differences of the forward in
    /// f64, L = Σ out * g.
    #[test]
    fn gqa_backward_matches_finite_differences() {
        for nkv in [1, 2] {
            let s = AttnShape::gqa(2, 4, 4, nkv, 3).unwrap();
            let qkv: Vec<f64> = (0..2 * 4 * s.row()).map(|i| ((i * 37) % 29) as f64 * 0.1 - 1.4).collect();
            let g: Vec<f64> = (0..2 * 4 * s.c()).map(|i| ((i * 53) % 17) as f64 * 0.1 - 0.8).collect();
            let loss = |x: &[f64]| {
                let (mut out, mut att) = (vec![0.0; g.len()], vec![0.0; 2 * 4 * 16]);
                attention_forward(&mut out, &mut att, x, s);
                out.iter().zip(&g).map(|(o, g)| o * g).sum::<f64>()
            };
            let (mut out, mut att) = (vec![0.0; g.len()], vec![0.0; 2 * 4 * 16]);
            attention_forward(&mut out, &mut att, &qkv, s);
            let mut d = vec![0.0; qkv.len()];
            attention_backward(&mut d, &mut vec![0.0; attention_scratch_len(4)], &g, &qkv, &att, s);
            let h = 1e-6;
            for i in 0..qkv.len() {
                let (mut p, mut m) = (qkv.clone(), qkv.clone());
                (p[i], m[i]) = (p[i] + h, m[i] - h);
                let fd = (loss(&p) - loss(&m)) / (2.0 * h);
                assert!((d[i] - fd).abs() < 1e-8, "nkv {nkv} element {i}: {} vs {fd}", d[i]);
            }
        }
    }

    /// Splitting the batch across threads computes every element exactly as one thread does.
    #[test]
    fn threaded_equals_serial_bitwise() {
        let s = AttnShape::mha(5, 32, 4, 16); // enough work to split
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
