//! Tile digests: a shard dataset is cut into fixed tiles, each with its own SHA-256, so that a
//! partial read (a resharding load) reads and checks only the tiles its box touches instead of the
//! whole dataset.
//!
//! A 2-D shard of shape (rows, cols) is cut into [`TILE_ROWS`] x [`TILE_COLS`] tiles (the last
//! ones smaller); a 1-D shard into runs of [`TILE_LEN`] elements. Tiles are numbered row-major over
//! the tile grid and hashed over their little-endian f32 bytes in row-major order. The digests live
//! in the index (`tile_sha256` of each shard record), which `index_sha256` covers. Shards of other
//! ranks have no tiles and are read whole. Invariant: a box read through [`read_box_checked`] has
//! every element of every tile it returns checked against the index before any is used.

use std::path::Path;

use hdf5_metno::Dataset;
use sha2::{Digest, Sha256};

use crate::checkpoint::h5;
use crate::checkpoint::meta::ShardRecord;
use crate::error::{Error, Result};

/// Rows of a 2-D tile.
pub const TILE_ROWS: usize = 256;
/// Columns of a 2-D tile (a power of two, so tensor-parallel column splits fall on tile edges).
pub const TILE_COLS: usize = 256;
/// Elements of a 1-D tile.
pub const TILE_LEN: usize = 65536;

/// A shard seen as (rows, cols) with its tile size, or `None` for shapes without tiles.
fn grid(shape: &[usize]) -> Option<[usize; 4]> {
    match *shape {
        [n] => Some([1, n, 1, TILE_LEN]),
        [r, c] => Some([r, c, TILE_ROWS, TILE_COLS]),
        _ => None,
    }
}

/// Number of tiles of a shard of `shape` (0 when the shape has no tiles).
pub fn tile_count(shape: &[usize]) -> usize {
    grid(shape).map_or(0, |[r, c, tr, tc]| r.div_ceil(tr) * c.div_ceil(tc))
}

/// Hex SHA-256 of rows `r0..r1`, columns `c0..c1` of the row-major (_, `cols`) buffer `data`.
fn digest_box(data: &[f32], cols: usize, (r0, r1): (usize, usize), (c0, c1): (usize, usize)) -> String {
    let mut h = Sha256::new();
    for r in r0..r1 {
        h.update(bytemuck::cast_slice::<f32, u8>(&data[r * cols + c0..r * cols + c1]));
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// The tile digests of a shard of `shape` holding `data` (row-major), empty for shapes without tiles.
pub fn tile_digests(shape: &[usize], data: &[f32]) -> Vec<String> {
    let Some([rows, cols, tr, tc]) = grid(shape) else {
        return Vec::new();
    };
    let mut out = Vec::with_capacity(tile_count(shape));
    for r0 in (0..rows).step_by(tr) {
        for c0 in (0..cols).step_by(tc) {
            out.push(digest_box(data, cols, (r0, (r0 + tr).min(rows)), (c0, (c0 + tc).min(cols))));
        }
    }
    out
}

/// A box of a shard in local coordinates, widened to whole tiles, with its data.
pub struct CheckedBox {
    /// Local offset of the widened box.
    pub offset: Vec<usize>,
    /// Shape of the widened box.
    pub shape: Vec<usize>,
    /// Its elements, row-major, every tile checked.
    pub data: Vec<f32>,
}

/// Reads the tiles of shard `s` (dataset `ds` of file `path`) that the local box (`at`, `part`)
/// touches, checks each against its recorded digest and returns them as one box covering
/// (`at`, `part`). `None` when the shard has no tile digests (an older checkpoint, or a shape
/// without tiles): the caller then reads and checks the whole dataset.
pub fn read_box_checked(
    ds: &Dataset,
    path: &Path,
    s: &ShardRecord,
    at: &[usize],
    part: &[usize],
) -> Result<Option<CheckedBox>> {
    let Some([rows, cols, tr, tc]) = grid(&s.shape) else {
        return Ok(None);
    };
    if s.tile_sha256.is_empty() {
        return Ok(None);
    }
    // The box as (rows, cols), then widened to tile edges.
    let (r_at, r_n, c_at, c_n) = match (at, part) {
        ([c], [n]) => (0, 1, *c, *n),
        ([r, c], [rn, cn]) => (*r, *rn, *c, *cn),
        _ => unreachable!("grid() accepted the shard's shape, and the box has its rank"),
    };
    let (tr0, tr1) = (r_at / tr, (r_at + r_n).div_ceil(tr));
    let (tc0, tc1) = (c_at / tc, (c_at + c_n).div_ceil(tc));
    let (r0, r1) = (tr0 * tr, (tr1 * tr).min(rows));
    let (c0, c1) = (tc0 * tc, (tc1 * tc).min(cols));
    let (offset, shape) = if s.shape.len() == 1 { (vec![c0], vec![c1 - c0]) } else { (vec![r0, c0], vec![r1 - r0, c1 - c0]) };
    let data = h5::read_box(ds, path, &s.dataset, &offset, &shape)?;
    let width = c1 - c0;
    let tiles_per_row = cols.div_ceil(tc);
    for ti in tr0..tr1 {
        for tj in tc0..tc1 {
            let rr = (ti * tr - r0, ((ti + 1) * tr).min(rows) - r0);
            let cc = (tj * tc - c0, ((tj + 1) * tc).min(cols) - c0);
            let found = digest_box(&data, width, rr, cc);
            let recorded = &s.tile_sha256[ti * tiles_per_row + tj];
            if &found != recorded {
                return Err(Error::file(
                    path,
                    None,
                    format!(
                        "dataset `{}`: tile ({ti}, {tj}) sha256 {found} differs from the recorded {recorded}",
                        s.dataset
                    ),
                ));
            }
        }
    }
    Ok(Some(CheckedBox { offset, shape, data }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_cover_a_shard_and_differ_when_one_element_does() {
        let shape = [TILE_ROWS + 3, 2 * TILE_COLS + 1];
        let data: Vec<f32> = (0..shape[0] * shape[1]).map(|i| i as f32).collect();
        let digests = tile_digests(&shape, &data);
        assert_eq!(digests.len(), 2 * 3);
        assert_eq!(digests.len(), tile_count(&shape));
        // The last tile is row range TILE_ROWS.., column range 2*TILE_COLS.. (one column).
        let mut changed = data.clone();
        changed[(TILE_ROWS + 2) * shape[1] + 2 * TILE_COLS] = -1.0;
        let after = tile_digests(&shape, &changed);
        let differing: Vec<usize> = (0..digests.len()).filter(|&i| digests[i] != after[i]).collect();
        assert_eq!(differing, vec![5]);
        assert_eq!(tile_count(&[5, 4, 3]), 0);
        assert_eq!(tile_count(&[TILE_LEN + 1]), 2);
    }
}
