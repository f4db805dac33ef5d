//! Op fingerprints: each call announces what it is on every link before its first data message.
//!
//! Why: members of a communicator must call the same collectives in the same order with the
//! same counts, element types, operators and roots. A rank that does not (an all-reduce of 1000
//! f32 against an all-gather, a different count or root) used to turn into a protocol error, a
//! hang or silently wrong data. Now the first message a call sends on a link carries a 32-byte
//! [`OpPrint`] (operation, element type, operator, root, count and sequence number) in front of
//! its data, in the same slot, and the first message a call reads from a link must start with the
//! peer's print, equal to its own; any difference (or a message of another length) is an error
//! naming both calls and the peer rank.
//!
//! Cost: 32 bytes more in one message per link and call; no extra message or round trip (links
//! carry the collectives' chunk plus [`PRINT_LEN`]; README, "Reliability", has the 4 KiB
//! all-reduce before and after).
//!
//! Invariants: prints are lazy (a link a call never uses carries none, so both ends skip it
//! alike); collectives are numbered by a per-communicator count of collective calls, point-to-point
//! calls by a per-peer count of sends (the n-th send to a peer pairs with its n-th receive from this
//! rank), so point-to-point traffic between some members never shifts the collective numbering.

use std::fmt;

use crate::dtype::{DType, ReduceOp};
use crate::error::Error;

/// Bytes of a print on the wire.
pub const PRINT_LEN: usize = 32;
const MAGIC: u32 = u32::from_le_bytes(*b"MTOP");
/// Root field of operations that have none.
const NO_ROOT: u32 = u32::MAX;
/// Operator field of operations that reduce nothing.
const NO_REDUCE: u8 = u8::MAX;

/// Which operation a print describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    /// All-reduce.
    AllReduce,
    /// Reduce-scatter.
    ReduceScatter,
    /// All-gather.
    AllGather,
    /// Broadcast.
    Broadcast,
    /// Reduce to a root.
    Reduce,
    /// All-to-all.
    AllToAll,
    /// A send paired with the peer's receive.
    SendRecv,
}

const KINDS: [OpKind; 7] = [
    OpKind::AllReduce,
    OpKind::ReduceScatter,
    OpKind::AllGather,
    OpKind::Broadcast,
    OpKind::Reduce,
    OpKind::AllToAll,
    OpKind::SendRecv,
];

impl OpKind {
    fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::AllGather => "all_gather",
            OpKind::Broadcast => "broadcast",
            OpKind::Reduce => "reduce",
            OpKind::AllToAll => "all_to_all",
            OpKind::SendRecv => "send/recv",
        }
    }
}

/// What one call is, as both ends of a link must agree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpPrint {
    /// The operation.
    pub kind: OpKind,
    /// Element type.
    pub dtype: DType,
    /// Reduction operator, if the operation reduces.
    pub reduce: Option<ReduceOp>,
    /// Root member, if the operation has one.
    pub root: Option<usize>,
    /// Elements of the whole buffer (the same number on every member).
    pub count: u64,
    /// Collective number on the communicator, or send number towards the receiver.
    pub seq: u64,
}

impl OpPrint {
    /// The wire form.
    pub fn encode(&self) -> [u8; PRINT_LEN] {
        let mut b = [0u8; PRINT_LEN];
        b[..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = KINDS.iter().position(|k| *k == self.kind).expect("listed") as u8;
        b[5] = DType::ALL.iter().position(|d| *d == self.dtype).expect("listed") as u8;
        b[6] = self.reduce.map_or(NO_REDUCE, |r| ReduceOp::ALL.iter().position(|o| *o == r).expect("listed") as u8);
        b[8..12].copy_from_slice(&self.root.map_or(NO_ROOT, |r| r as u32).to_le_bytes());
        b[16..24].copy_from_slice(&self.count.to_le_bytes());
        b[24..32].copy_from_slice(&self.seq.to_le_bytes());
        b
    }

    /// Reads a print; `None` for anything else (another length, magic or field value).
    pub fn decode(b: &[u8]) -> Option<OpPrint> {
        if b.len() != PRINT_LEN || b[..4] != MAGIC.to_le_bytes() {
            return None;
        }
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        let root = u32::from_le_bytes(b[8..12].try_into().expect("4 bytes"));
        Some(OpPrint {
            kind: *KINDS.get(usize::from(b[4]))?,
            dtype: *DType::ALL.get(usize::from(b[5]))?,
            reduce: match b[6] {
                NO_REDUCE => None,
                i => Some(*ReduceOp::ALL.get(usize::from(i))?),
            },
            root: (root != NO_ROOT).then_some(root as usize),
            count: u64_at(16),
            seq: u64_at(24),
        })
    }
}

impl fmt::Display for OpPrint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} #{} of {} {}", self.kind.name(), self.seq, self.count, self.dtype.name())?;
        if let Some(r) = self.reduce {
            write!(f, " ({})", r.name())?;
        }
        if let Some(r) = self.root {
            write!(f, " root {r}")?;
        }
        Ok(())
    }
}

/// The prints of the current call on one link: still to send, still to check.
#[derive(Debug, Clone, Copy, Default)]
pub struct LinkPrints {
    /// Sent before the next data message on this link (then cleared).
    pub send: Option<OpPrint>,
    /// Expected before the next data message from this link (then cleared).
    pub expect: Option<OpPrint>,
}

impl LinkPrints {
    /// Both directions armed with `p`.
    pub fn armed(p: Option<OpPrint>) -> Self {
        LinkPrints { send: p, expect: p }
    }
}

/// Start of every mismatch error's cause.
const MISMATCH: &str = "op mismatch: ";

/// True for the error a fingerprint check raised: it names both calls already, so it needs no
/// arbitration of which rank failed.
pub fn is_mismatch(e: &Error) -> bool {
    matches!(e, Error::Comm { cause, .. } if cause.starts_with(MISMATCH))
}

/// The error text for a peer whose first message of a call was `got` (starting with a print, or
/// not) where this rank's call `mine` expected its twin.
pub fn mismatch(me: usize, mine: &OpPrint, peer: usize, got: &[u8]) -> String {
    match got.get(..PRINT_LEN).and_then(OpPrint::decode) {
        Some(theirs) => format!("{MISMATCH}rank {me} called {mine}, but peer rank {peer} called {theirs}"),
        None => format!(
            "{MISMATCH}rank {me} called {mine}, but peer rank {peer} sent a {}-byte data message left over from an \
             earlier call instead of this call's fingerprint (the two ranks called different operations before)",
            got.len()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prints_round_trip_and_differ_by_every_field() {
        let base = OpPrint { kind: OpKind::Broadcast, dtype: DType::BF16, reduce: None, root: Some(3), count: 1000, seq: 7 };
        assert_eq!(OpPrint::decode(&base.encode()), Some(base));
        let variants = [
            OpPrint { kind: OpKind::Reduce, reduce: Some(ReduceOp::Max), ..base },
            OpPrint { dtype: DType::F32, ..base },
            OpPrint { root: Some(0), ..base },
            OpPrint { root: None, ..base },
            OpPrint { count: 1001, ..base },
            OpPrint { seq: 8, ..base },
        ];
        for v in variants {
            assert_eq!(OpPrint::decode(&v.encode()), Some(v));
            assert_ne!(v.encode(), base.encode(), "{v} encodes like {base}");
        }
        assert_eq!(OpPrint::decode(&[0u8; PRINT_LEN]), None);
        assert_eq!(OpPrint::decode(&base.encode()[..16]), None);
    }
}
