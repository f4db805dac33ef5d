//! Hyperslab ("box") arithmetic: the slices a rank passes to `save`, the cut of a contiguous flat
//! range of a row-major tensor into boxes, box intersection, and copies between boxes.
//!
//! Invariant: the boxes of [`flat_range_boxes`] are disjoint, in row-major order, each contiguous
//! in row-major order, and together cover exactly the range; so box `i` maps to a contiguous
//! sub-slice of the range's buffer. A range of an n-dimensional tensor needs at most `2n - 1`
//! boxes (partial rows at both ends, whole rows between).

use std::ops::Range;

use crate::checkpoint::index::CheckpointIndex;
use crate::error::{Error, Result};
use crate::model::ParamEntry;

/// A hyperslab of a tensor that this rank owns and writes.
#[derive(Debug, Clone)]
pub struct ShardSlice<'a> {
    /// Tensor name, e.g. `model/wte`.
    pub name: String,
    /// Shape of the whole tensor.
    pub global_shape: Vec<usize>,
    /// Global offset of the hyperslab, per dimension.
    pub offset: Vec<usize>,
    /// Shape of the hyperslab.
    pub shape: Vec<usize>,
    /// The hyperslab's elements, row-major (`shape.iter().product()` of them).
    pub data: &'a [f32],
}

/// A hyperslab: offset and shape per dimension.
pub type Hyperslab = (Vec<usize>, Vec<usize>);

/// The boxes covering elements `range` (row-major flat indices) of a tensor of `shape`.
pub fn flat_range_boxes(shape: &[usize], range: Range<usize>) -> Vec<Hyperslab> {
    let mut out = Vec::new();
    if range.start < range.end {
        push_boxes(shape, range.start, range.end, &mut Vec::new(), &mut out);
    }
    out
}

fn push_boxes(shape: &[usize], a: usize, b: usize, prefix: &mut Vec<usize>, out: &mut Vec<Hyperslab>) {
    let with_prefix = |off: Vec<usize>, shp: Vec<usize>, prefix: &[usize]| {
        let ones = vec![1; prefix.len()];
        ([prefix, &off[..]].concat(), [&ones[..], &shp[..]].concat())
    };
    if shape.len() == 1 {
        out.push(with_prefix(vec![a], vec![b - a], prefix));
        return;
    }
    let inner: usize = shape[1..].iter().product();
    let (r0, r1) = (a / inner, b / inner);
    if r0 == r1 {
        prefix.push(r0);
        push_boxes(&shape[1..], a % inner, b % inner, prefix, out);
        prefix.pop();
        return;
    }
    let mut first_full = r0;
    if a % inner != 0 {
        prefix.push(r0);
        push_boxes(&shape[1..], a % inner, inner, prefix, out);
        prefix.pop();
        first_full = r0 + 1;
    }
    if r1 > first_full {
        let off = [vec![first_full], vec![0; shape.len() - 1]].concat();
        let shp = [&[r1 - first_full][..], &shape[1..]].concat();
        out.push(with_prefix(off, shp, prefix));
    }
    if b % inner != 0 {
        prefix.push(r1);
        push_boxes(&shape[1..], 0, b % inner, prefix, out);
        prefix.pop();
    }
}

/// Slices named `<prefix>/<entry name>` for the elements `range` of a flat buffer laid out by
/// `entries`; `buf` holds flat elements `buf_start..buf_start + buf.len()` (the whole buffer for
/// parameters, a ZeRO shard for optimizer moments), which must contain `range`.
pub fn flat_range_slices<'a>(
    prefix: &str,
    entries: &[ParamEntry],
    buf: &'a [f32],
    buf_start: usize,
    range: Range<usize>,
) -> Result<Vec<ShardSlice<'a>>> {
    if range.start < buf_start || range.end > buf_start + buf.len() {
        return Err(Error::InvalidArgument(format!(
            "flat range {range:?} is not inside the buffer's {buf_start}..{}",
            buf_start + buf.len()
        )));
    }
    let mut out = Vec::new();
    for e in entries {
        let (lo, hi) = (range.start.max(e.offset), range.end.min(e.offset + e.len));
        if lo >= hi {
            continue;
        }
        let mut at = lo - buf_start;
        for (offset, shape) in flat_range_boxes(&e.shape, lo - e.offset..hi - e.offset) {
            let n: usize = shape.iter().product();
            let data = &buf[at..at + n];
            at += n;
            out.push(ShardSlice {
                name: format!("{prefix}/{}", e.name),
                global_shape: e.shape.clone(),
                offset,
                shape,
                data,
            });
        }
    }
    Ok(out)
}

/// Reads the elements `range` of the flat buffer laid out by `entries` from tensors
/// `<prefix>/<entry name>` into `out` (`range.len()` elements), whatever layout wrote them.
pub fn load_flat_range(
    index: &CheckpointIndex,
    prefix: &str,
    entries: &[ParamEntry],
    range: Range<usize>,
    out: &mut [f32],
) -> Result<()> {
    if out.len() != range.len() {
        return Err(Error::InvalidArgument(format!(
            "load_flat_range: buffer of {} elements for range {range:?}",
            out.len()
        )));
    }
    for e in entries {
        let (lo, hi) = (range.start.max(e.offset), range.end.min(e.offset + e.len));
        if lo >= hi {
            continue;
        }
        let mut at = lo - range.start;
        let name = format!("{prefix}/{}", e.name);
        for (offset, shape) in flat_range_boxes(&e.shape, lo - e.offset..hi - e.offset) {
            let n: usize = shape.iter().product();
            index.load_slice(&name, &offset, &shape, &mut out[at..at + n])?;
            at += n;
        }
    }
    Ok(())
}

/// The intersection of two boxes, `None` if empty.
pub fn intersect(
    a_off: &[usize],
    a_shape: &[usize],
    b_off: &[usize],
    b_shape: &[usize],
) -> Option<Hyperslab> {
    let mut off = Vec::with_capacity(a_off.len());
    let mut shape = Vec::with_capacity(a_off.len());
    for d in 0..a_off.len() {
        let lo = a_off[d].max(b_off[d]);
        let hi = (a_off[d] + a_shape[d]).min(b_off[d] + b_shape[d]);
        if lo >= hi {
            return None;
        }
        off.push(lo);
        shape.push(hi - lo);
    }
    Some((off, shape))
}

/// Where box (`at`, `shape`) starts in the row-major buffer of box (`off`, `outer`) that contains
/// it, if its elements are contiguous there (leading extents 1, then one partial dimension, then
/// whole trailing dimensions).
pub fn contiguous_start(at: &[usize], shape: &[usize], off: &[usize], outer: &[usize]) -> Option<usize> {
    let k = shape.iter().position(|&n| n != 1).unwrap_or(shape.len());
    if (k + 1..shape.len()).any(|d| shape[d] != outer[d]) {
        return None;
    }
    Some((0..at.len()).fold(0, |acc, d| acc * outer[d] + at[d] - off[d]))
}

/// A row-major buffer holding box (offset, shape) of a tensor.
pub type BoxBuf<'a, T> = (T, &'a [usize], &'a [usize]);

/// Copies box (`at`, `shape`) (global coordinates) from `src` into `dst`; both contain it.
pub fn copy_box(src: BoxBuf<&[f32]>, dst: BoxBuf<&mut [f32]>, at: &[usize], shape: &[usize]) {
    let (src, src_off, src_shape) = src;
    let (dst, dst_off, dst_shape) = dst;
    let nd = shape.len();
    let row = shape[nd - 1];
    let rows: usize = shape[..nd - 1].iter().product();
    let mut idx = vec![0usize; nd]; // position inside the copied box, last dim stays 0
    for _ in 0..rows {
        let (mut s, mut d) = (0usize, 0usize);
        for k in 0..nd {
            s = s * src_shape[k] + at[k] + idx[k] - src_off[k];
            d = d * dst_shape[k] + at[k] + idx[k] - dst_off[k];
        }
        dst[d..d + row].copy_from_slice(&src[s..s + row]);
        for k in (0..nd - 1).rev() {
            idx[k] += 1;
            if idx[k] < shape[k] {
                break;
            }
            idx[k] = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every flat range of a 3-d tensor: boxes are disjoint, contiguous, in order, and cover it.
    #[test]
    fn flat_boxes_cover_ranges_exactly() {
        let shape = [3, 4, 5];
        let n = 60;
        for a in 0..n {
            for b in a + 1..=n {
                let boxes = flat_range_boxes(&shape, a..b);
                assert!(boxes.len() <= 5, "{a}..{b}: {} boxes", boxes.len());
                let mut next = a;
                for (off, shp) in &boxes {
                    // Enumerate the box's flat indices in row-major order: must be next, next+1, ...
                    for i in 0..shp[0] {
                        for j in 0..shp[1] {
                            for k in 0..shp[2] {
                                let flat = ((off[0] + i) * 4 + off[1] + j) * 5 + off[2] + k;
                                assert_eq!(flat, next, "{a}..{b} box {off:?} {shp:?}");
                                next += 1;
                            }
                        }
                    }
                }
                assert_eq!(next, b);
            }
        }
    }

    #[test]
    fn contiguity_of_boxes() {
        // Inside rows 0..4, cols 0..6: a whole-width band is contiguous, a column band is not.
        assert_eq!(contiguous_start(&[1, 0], &[2, 6], &[0, 0], &[4, 6]), Some(6));
        assert_eq!(contiguous_start(&[2, 3], &[1, 2], &[0, 0], &[4, 6]), Some(15));
        assert_eq!(contiguous_start(&[1, 3], &[2, 3], &[0, 0], &[4, 6]), None);
        assert_eq!(contiguous_start(&[5, 1], &[1, 1], &[4, 1], &[2, 2]), Some(2));
    }

    #[test]
    fn copy_box_moves_the_right_elements() {
        // src: rows 1..3, cols 2..6 of a (4, 8) tensor whose value is 10*row + col.
        let src: Vec<f32> = (1..3)
            .flat_map(|r| (2..6).map(move |c| (10 * r + c) as f32))
            .collect();
        // dst: rows 0..4, cols 3..5.
        let mut dst = vec![-1.0; 8];
        copy_box(
            (&src, &[1, 2], &[2, 4]),
            (&mut dst, &[0, 3], &[4, 2]),
            &[1, 3],
            &[2, 2],
        );
        assert_eq!(dst, vec![-1.0, -1.0, 13.0, 14.0, 23.0, 24.0, -1.0, -1.0]);
    }
}
