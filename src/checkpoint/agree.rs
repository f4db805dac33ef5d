//! Agreement between the ranks of a save: every rank's report gathered everywhere, and rank 0's
//! decision broadcast, as JSON over the communicator. Both are collectives: every member calls them
//! in the same order.

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::comm::{Communicator, ReduceOp};
use crate::error::{Error, Result};

fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).expect("checkpoint reports serialize (plain structs of strings and numbers)")
}

fn decode<T: DeserializeOwned>(bytes: &[u8], from: usize) -> Result<T> {
    serde_json::from_slice(bytes).map_err(|e| {
        Error::Check(format!(
            "checkpoint agreement: garbled report from rank {from}: {e}"
        ))
    })
}

/// Every rank's `mine`, in rank order, on every rank.
pub fn gather_all<T: Serialize + DeserializeOwned>(comm: &Communicator, mine: &T) -> Result<Vec<T>> {
    let bytes = encode(mine);
    let k = comm.size();
    let mut lens = vec![0i64; k];
    lens[comm.rank()] = bytes.len() as i64;
    comm.all_reduce(&mut lens, ReduceOp::Sum)?;
    let width = *lens.iter().max().expect("a communicator has at least one member") as usize;
    let mut all = vec![0u8; width * k];
    all[comm.rank() * width..comm.rank() * width + bytes.len()].copy_from_slice(&bytes);
    comm.all_gather(&mut all)?;
    (0..k)
        .map(|r| decode(&all[r * width..r * width + lens[r] as usize], r))
        .collect()
}

/// Rank `root`'s `value` on every rank (`value` is ignored elsewhere).
pub fn broadcast_from<T: Serialize + DeserializeOwned>(
    comm: &Communicator,
    root: usize,
    value: Option<&T>,
) -> Result<T> {
    let bytes = value.map(encode).unwrap_or_default();
    let mut len = [bytes.len() as i64];
    comm.broadcast(&mut len, root)?;
    let mut buf = if comm.rank() == root {
        bytes
    } else {
        vec![0u8; len[0] as usize]
    };
    comm.broadcast(&mut buf, root)?;
    decode(&buf, root)
}
