//! Collective schedules: [`ring`] (bandwidth-optimal, chunked and pipelined), [`direct`]
//! (all-pairs: latency-optimal for small messages, and all-to-all) and [`read`] (single copy:
//! peers read each other's buffers, on links that allow it). Pure functions over
//! [`crate::comm::primitives`]; the communicator picks one per call.

pub mod direct;
pub mod read;
pub mod ring;
