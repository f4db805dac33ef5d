//! Parameter residency around each use (ZeRO-3): the seam between a model executor and whatever
//! keeps only a shard of its parameters.
//!
//! A [`super::Stage`] addresses its parameters through one flat buffer, in *units* that partition
//! it ([`super::Stage::units`]: `wte`, `wpe`, each block, the final LayerNorm). Before it reads a
//! unit's parameters it calls [`ParamGate::acquire`] with the units it is about to read and the
//! ones it will read next; without a gate every parameter is always resident.
//!
//! Invariants a gate keeps: after `acquire(units, ..)` returns, `params[u]` holds the unit's
//! current values for every `u` in `units`; a gate may give back (zero, see
//! [`crate::memory::zero_release`]) any unit not named in the latest `acquire`'s `units` or `next`;
//! it never changes the values of the elements its owner updates (its shard).

use std::ops::Range;

use crate::error::Result;

/// Makes parameter units resident on demand; see the module documentation.
pub trait ParamGate: Send {
    /// Makes every unit in `units` resident in `params` (with current values); `next` are the
    /// units the executor will read after these (a prefetch hint). Units outside `units` and
    /// `next` may be released.
    fn acquire(&mut self, units: &[Range<usize>], next: &[Range<usize>], params: &mut [f32]) -> Result<()>;
    /// Releases every unit but the shard this rank owns; the next `acquire` of a unit fetches it
    /// again. Call after the owned shard changed (optimizer step, checkpoint load), since
    /// resident copies of other ranks' shards are then stale.
    fn release_all(&mut self, params: &mut [f32]) -> Result<()>;
}
