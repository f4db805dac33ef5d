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
//! Batch rows are independent, so they are split across cores (see `parallel.rs`). Every product
//! (q·k scores, att·v, dy·v, and the three gradients) is an accumulation `out[j] += Σ_k c_k r_k[j]`
//! done by [`accumulate`]: a block of 64 outputs stays in registers while k runs, each element's
//! additions still one at a time in k order, so the results are bitwise those of one dot product
//! (or one axpy) at a time; keys and values are transposed per head so the score and dy·v rows
//! are such accumulations too, and the gradients of k and v are taken per key over the queries
//! (the backward keeps the score gradients of a head in `dpre`) instead of as one axpy per query
//! and key. The loops are compiled for the widest vector unit the CPU has (`simd.rs`).

use super::float::Float;
use super::parallel::{chunk_items, run_parts};
use super::simd;
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
    simd::widest(#[inline(always)] || forward_body(out, att, qkv, s))
}

#[inline(always)]
fn forward_body<F: Float>(out: &mut [F], att: &mut [F], qkv: &[F], s: AttnShape) {
    let AttnShape { b, t, nh, hs, .. } = s;
    let (c, w) = (s.c(), s.row());
    let scale = F::one() / F::from_f64(hs as f64).sqrt();
    let neg_zero: F = std::iter::empty().sum(); // where `Iterator::sum` starts
    let mut kt = vec![F::zero(); hs * t]; // (hs, T): one head's keys, transposed
    for bi in 0..b {
        for h in 0..nh {
            let (qo, ko, vo) = s.offsets(h);
            transpose_head(&mut kt, &qkv[bi * t * w + ko..], w, (t, hs));
            for ti in 0..t {
                let q = &qkv[(bi * t + ti) * w + qo..][..hs]; // (hs)
                let row = &mut att[((bi * nh + h) * t + ti) * t..][..t]; // (T)
                // Scores q·k[t2] for t2 <= ti, and for a few keys past it (a whole vector; they
                // are zeroed below). Each is the plain dot product's sum, bit for bit.
                let wide = &mut row[..padded(ti + 1, t)];
                wide.fill(neg_zero);
                accumulate(wide, hs, |i| q[i], |i| &kt[i * t..]);
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
                o.fill(F::zero());
                accumulate(o, ti + 1, |t2| row[t2], |t2| &qkv[(bi * t + t2) * w + vo..][..hs]);
            }
        }
    }
}

/// dqkv (B, T, (NH + 2*NKV)*hs) += ... from dout (B, T, NH*hs), qkv and att of the forward;
/// `dpre` (B, NH, T, T) is scratch, overwritten with the gradient of the pre-softmax scores
/// (zero above the diagonal), as the GPU arm leaves it. Panics unless NKV divides NH.
pub fn attention_backward<F: Float>(
    dqkv: &mut [F],
    dpre: &mut [F],
    dout: &[F],
    qkv: &[F],
    att: &[F],
    s: AttnShape,
) {
    s.assert_valid();
    let (t, c, w) = (s.t, s.c(), s.row());
    let tt = s.nh * t * t;
    let per = chunk_items(s.b, s.nh * t * t * s.hs);
    let dqkvs = dqkv[..s.b * t * w].chunks_mut(per * t * w);
    let parts = dout
        .chunks(per * t * c)
        .zip(qkv.chunks(per * t * w))
        .zip(att.chunks(per * tt));
    run_parts(
        dqkvs.zip(dpre[..s.b * tt].chunks_mut(per * tt)).zip(parts),
        |((d, p), ((dy, x), a))| {
            attention_backward_serial(
                d,
                p,
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
    dpre: &mut [F],
    dout: &[F],
    qkv: &[F],
    att: &[F],
    s: AttnShape,
) {
    simd::widest(#[inline(always)] || backward_body(dqkv, dpre, dout, qkv, att, s))
}

/// Every element of dq, dk and dv receives its terms in the order of the plain per-query loop
/// (for each head, queries ti ascending, keys t2 ascending within a query): dq[ti] over t2, dk[t2]
/// and dv[t2] over ti. The loops run per output row instead, with the row held in registers.
#[inline(always)]
fn backward_body<F: Float>(
    dqkv: &mut [F],
    dpre: &mut [F],
    dout: &[F],
    qkv: &[F],
    att: &[F],
    s: AttnShape,
) {
    let AttnShape { b, t, nh, hs, .. } = s;
    let (c, w) = (s.c(), s.row());
    let scale = F::one() / F::from_f64(hs as f64).sqrt();
    let neg_zero: F = std::iter::empty().sum();
    let mut vt = vec![F::zero(); hs * t]; // (hs, T): one head's values, transposed
    for bi in 0..b {
        for h in 0..nh {
            let (qo, ko, vo) = s.offsets(h);
            let head = (bi * nh + h) * t * t;
            let a = &att[head..][..t * t]; // (T, T)
            let p = &mut dpre[head..][..t * t]; // (T, T)
            let dy = |ti: usize| &dout[(bi * t + ti) * c + h * hs..][..hs]; // (hs)
            let row = |ti: usize, off: usize| (bi * t + ti) * w + off; // a qkv row's part
            transpose_head(&mut vt, &qkv[bi * t * w + vo..], w, (t, hs));
            for ti in 0..t {
                // out = sum_t2 a[t2] v[t2]: datt[t2] = dy·v[t2] (into dpre's row).
                let dyi = dy(ti);
                let pr = &mut p[ti * t..][..t]; // (T)
                let wide = &mut pr[..padded(ti + 1, t)];
                wide.fill(neg_zero);
                accumulate(wide, hs, |i| dyi[i], |i| &vt[i * t..]);
                // Softmax backward: dpre = a * (datt - sum(a * datt)) * scale (q·k was scaled).
                let ar = &a[ti * t..][..=ti]; // (ti+1)
                let dot: F = pr[..=ti].iter().zip(ar).map(|(&x, &y)| x * y).sum();
                for (d, &ai) in pr[..=ti].iter_mut().zip(ar) {
                    *d = ai * (*d - dot) * scale;
                }
                pr[ti + 1..].fill(F::zero());
                // dq[ti] += sum_t2 dpre[ti][t2] k[t2].
                let pr = &p[ti * t..][..=ti]; // (ti+1)
                let dq = &mut dqkv[row(ti, qo)..][..hs];
                accumulate(dq, ti + 1, |t2| pr[t2], |t2| &qkv[row(t2, ko)..][..hs]);
            }
            for t2 in 0..t {
                // dk[t2] += sum_ti dpre[ti][t2] q[ti]; dv[t2] += sum_ti a[ti][t2] dy[ti], ti >= t2.
                let n = t - t2;
                let dk = &mut dqkv[row(t2, ko)..][..hs];
                accumulate(dk, n, |j| p[(t2 + j) * t + t2], |j| &qkv[row(t2 + j, qo)..][..hs]);
                let dv = &mut dqkv[row(t2, vo)..][..hs];
                accumulate(dv, n, |j| a[(t2 + j) * t + t2], |j| dy(t2 + j));
            }
        }
    }
}

/// `n` rounded up to a whole [`WIDE`] block, at most `t`: a row's chains of additions are
/// latency-bound, so four vectors of them take the time of one.
fn padded(n: usize, t: usize) -> usize {
    n.div_ceil(WIDE).saturating_mul(WIDE).min(t)
}

/// Elements of the widest accumulator block [`accumulate`] holds in registers (four 16-float
/// AVX-512 vectors: four independent chains of additions).
const WIDE: usize = 64;
/// Elements of its narrower block, for what is left of a row after the wide blocks.
const NARROW: usize = 16;

/// `out[j] += coef(0) · row(0)[j] + coef(1) · row(1)[j] + ...` for k < n, each element's
/// additions one at a time in that order (so bit for bit the plain loop over k of axpys, and,
/// from a start of -0.0, the iterator sum of the products). Blocks of `out` stay in registers
/// across all of k, where the axpy loop would load and store every element n times.
/// `row(k)` must hold at least `out.len()` elements.
#[inline(always)]
fn accumulate<'a, F: Float>(out: &mut [F], n: usize, coef: impl Fn(usize) -> F, row: impl Fn(usize) -> &'a [F]) {
    let wide = out.len() / WIDE * WIDE;
    let narrow = out.len() / NARROW * NARROW;
    for j0 in (0..wide).step_by(WIDE) {
        accumulate_block::<F, WIDE>(&mut out[j0..j0 + WIDE], j0, n, &coef, &row);
    }
    for j0 in (wide..narrow).step_by(NARROW) {
        accumulate_block::<F, NARROW>(&mut out[j0..j0 + NARROW], j0, n, &coef, &row);
    }
    for (j, o) in out.iter_mut().enumerate().skip(narrow) {
        let mut acc = *o;
        for k in 0..n {
            acc += coef(k) * row(k)[j];
        }
        *o = acc;
    }
}

#[inline(always)]
fn accumulate_block<'a, F: Float, const W: usize>(
    out: &mut [F],
    j0: usize,
    n: usize,
    coef: &impl Fn(usize) -> F,
    row: &impl Fn(usize) -> &'a [F],
) {
    let mut acc: [F; W] = std::array::from_fn(|i| out[i]);
    for k in 0..n {
        let c = coef(k);
        let r: &[F; W] = row(k)[j0..j0 + W].try_into().expect("W elements");
        for i in 0..W {
            acc[i] += c * r[i];
        }
    }
    out.copy_from_slice(&acc);
}

/// `xt[i * T + t2] = x[t2 * stride + i]`: the (T, hs) head starting at `x` with rows `stride`
/// apart, transposed to (hs, T).
#[inline(always)]
fn transpose_head<F: Float>(xt: &mut [F], x: &[F], stride: usize, (t, hs): (usize, usize)) {
    for t2 in 0..t {
        let row = &x[t2 * stride..][..hs]; // (hs)
        for (i, &v) in row.iter().enumerate() {
            xt[i * t + t2] = v;
        }
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

    /// The register-blocked accumulation gives every element bit for bit the plain loop of
    /// axpys (and, from -0.0, the iterator sum of the products), for widths that use the wide
    /// blocks, the narrow blocks and the scalar rest, with any count of terms.
    #[test]
    fn blocked_accumulation_equals_axpys_bitwise() {
        let rows: Vec<Vec<f32>> = (0..23)
            .map(|k| (0..150).map(|j| ((j * 17 + k * 31) % 89) as f32 * 0.021 - 0.9).collect())
            .collect();
        let coef = |k: usize| ((k * 29) % 83) as f32 * 0.013 - 0.5;
        for width in [0, 1, 5, 15, 16, 17, 63, 64, 65, 80, 97, 128, 150] {
            for n in [0, 1, 2, 7, 23] {
                let start: Vec<f32> = (0..width).map(|j| ((j * 7) % 5) as f32 * 0.3 - 0.6).collect();
                let mut got = start.clone();
                accumulate(&mut got, n, coef, |k| &rows[k][..]);
                let mut want = start.clone();
                for (k, row) in rows.iter().enumerate().take(n) {
                    want.iter_mut().zip(row).for_each(|(w, &r)| *w += coef(k) * r);
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "width {width}, {n} terms");
                // From -0.0 it is the dot product as `Iterator::sum` adds it.
                let mut dots = vec![-0.0f32; width];
                accumulate(&mut dots, n, coef, |k| &rows[k][..]);
                for (j, d) in dots.iter().enumerate() {
                    let sum: f32 = (0..n).map(|k| coef(k) * rows[k][j]).sum();
                    assert_eq!(d.to_bits(), sum.to_bits(), "width {width}, {n} terms, element {j}");
                }
            }
        }
    }

    /// The forward and backward compiled for each vector unit this CPU has give the same bits
    /// (T = 70 and hs = 64 use the wide blocks, the narrow ones and the scalar rest).
    #[test]
    fn every_vector_level_gives_the_same_bits() {
        let s = AttnShape::gqa(2, 70, 4, 2, 64).unwrap();
        let qkv: Vec<f32> = (0..2 * 70 * s.row()).map(|i| ((i * 37) % 101) as f32 * 0.02 - 1.0).collect();
        let dout: Vec<f32> = (0..2 * 70 * s.c()).map(|i| ((i * 53) % 97) as f32 * 0.01 - 0.5).collect();
        let run = |level| {
            let (mut out, mut att) = (vec![0f32; dout.len()], vec![0f32; 2 * 4 * 70 * 70]);
            simd::run_at(level, || forward_body(&mut out, &mut att, &qkv, s));
            let (mut d, mut p) = (vec![0.5f32; qkv.len()], vec![f32::NAN; att.len()]);
            simd::run_at(level, || backward_body(&mut d, &mut p, &dout, &qkv, &att, s));
            [out, att, d, p].map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
        };
        let base = run(simd::Level::Baseline);
        for level in [simd::Level::Avx2, simd::Level::Avx512] {
            assert!(run(level) == base, "{} differs from the baseline", level.name());
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
            let mut dpre = vec![0.0; a1.len()];
            let mut d1 = vec![0.0; qkv.len()];
            let mut d2 = vec![0.0; big.len()];
            attention_backward(&mut d1, &mut dpre, &dout, &qkv, &a1, s);
            attention_backward(&mut d2, &mut dpre, &dout, &big, &a2, m);
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
            attention_backward(&mut d, &mut vec![0.0; att.len()], &g, &qkv, &att, s);
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
        let (mut p1, mut p2) = (vec![f32::NAN; a1.len()], vec![f32::NAN; a1.len()]);
        attention_backward(&mut d1, &mut p1, &dout, &qkv, &a1, s);
        attention_backward_serial(&mut d2, &mut p2, &dout, &qkv, &a1, s);
        assert_eq!((&d1, &p1), (&d2, &p2));
    }
}
