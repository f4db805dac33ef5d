//! Collective schedules: [`ring`] (bandwidth-optimal, chunked and pipelined) and [`direct`]
//! (all-pairs: latency-optimal for small messages, and all-to-all). Pure functions over
//! [`crate::comm::primitives`]; the communicator picks one per call.

pub mod direct;
pub mod ring;
