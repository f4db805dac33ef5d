//! Collective schedules: [`ring`] (bandwidth-optimal, chunked and pipelined), [`direct`]
//! (all-pairs: latency-optimal for small messages, and all-to-all), [`read`] (single copy:
//! peers read each other's buffers, on links that allow it) and [`split`] (all-reduce composed of
//! a reduce-scatter and an all-gather, each with its own schedule). Pure functions over
//! [`crate::comm::primitives`]; the communicator picks one per call.

pub mod direct;
pub mod read;
pub mod ring;
pub mod split;
