//! Token + position embedding: `out[b, t] = wte[token[b, t]] + wpe[t]`.
//!
//! Invariant: every token is below the number of rows of `wte` (checked by the model before any
//! layer runs). The backward scatters into the rows that were read, so embedding rows of tokens
//! absent from the batch keep a zero gradient.

use super::float::Float;

/// out (B, T, C) = wte (Vp, C) rows of `tokens` (B, T) + wpe (maxT, C) rows 0..T.
pub fn encoder_forward<F: Float>(out: &mut [F], tokens: &[u32], wte: &[F], wpe: &[F], t: usize, c: usize) {
    for (bt, (row, &tok)) in out.chunks_exact_mut(c).zip(tokens).enumerate() {
        let pos = bt % t;
        let w = &wte[tok as usize * c..][..c]; // (C)
        let p = &wpe[pos * c..][..c]; // (C)
        for ((o, &wi), &pi) in row.iter_mut().zip(w).zip(p) {
            *o = wi + pi;
        }
    }
}

/// dwte (Vp, C) += scatter of dout; dwpe (maxT, C) += sum over batch of dout; dout (B, T, C).
pub fn encoder_backward<F: Float>(
    dwte: &mut [F],
    dwpe: &mut [F],
    dout: &[F],
    tokens: &[u32],
    t: usize,
    c: usize,
) {
    for (bt, (drow, &tok)) in dout.chunks_exact(c).zip(tokens).enumerate() {
        let pos = bt % t;
        for (g, &d) in dwte[tok as usize * c..][..c].iter_mut().zip(drow) {
            *g += d;
        }
        for (g, &d) in dwpe[pos * c..][..c].iter_mut().zip(drow) {
            *g += d;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forward_adds_rows_and_backward_scatters() {
        let (t, c) = (2, 3);
        let wte: Vec<f64> = (0..4 * c).map(|i| i as f64).collect(); // (4, C)
        let wpe: Vec<f64> = (0..t * c).map(|i| 100.0 * i as f64).collect(); // (T, C)
        let tokens = [3u32, 1, 3, 0]; // (B=2, T=2)
        let mut out = vec![0.0; 4 * c];
        encoder_forward(&mut out, &tokens, &wte, &wpe, t, c);
        assert_eq!(&out[..3], &[9.0, 110.0, 211.0]);
        assert_eq!(&out[3..6], &[303.0, 404.0, 505.0]);
        let dout = vec![1.0; 4 * c];
        let (mut dwte, mut dwpe) = (vec![0.0; 4 * c], vec![0.0; t * c]);
        encoder_backward(&mut dwte, &mut dwpe, &dout, &tokens, t, c);
        assert_eq!(&dwte[9..12], &[2.0, 2.0, 2.0]); // token 3 used twice
        assert_eq!(&dwte[6..9], &[0.0, 0.0, 0.0]); // token 2 unused
        assert_eq!(dwpe, vec![2.0; t * c]);
    }
}
