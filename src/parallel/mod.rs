//! Parallelism over the 3D process grid: the grid itself, data, tensor and pipeline parallelism.
//!
//! [`grid`] maps ranks to (tp, pp, dp) coordinates and builds the axis communicators; [`schedule`]
//! holds the pipeline schedules as pure functions of (schedule, rank, stages, micro-batches) and
//! [`stage_split`] the split of the blocks into pipeline stages; the modules that execute them own
//! the communicators and buffers.

pub mod grid;
pub mod schedule;
pub mod stage_split;
