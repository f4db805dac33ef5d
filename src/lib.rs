//! meshtrain: trains GPT models on supercomputers.
//!
//! Layers, bottom to top (each only uses the ones below it):
//! - [`bootstrap`]: MPI discovers ranks and broadcasts the unique id (root address + secret); nothing
//!   else ever goes through MPI.
//! - [`transport`]: chunk FIFOs between two ranks over shared memory or TCP.
//! - [`comm`]: communicators, rings, and the collective algorithms written over transport primitives.
//! - [`device`]: CPU (numerical reference), CUDA and HIP arms.
//! - [`model`], [`optim`], [`data`], [`train`]: the GPT model, AdamW, token shards, the training loop.
//! - [`memory`]: releasing buffer pages (ZeRO-2/3 residency) and measuring resident memory.
//! - [`bench`]: `meshtrain bench`, collective and step benchmarks.

pub mod bench;
pub mod bootstrap;
pub mod checkpoint;
pub mod comm;
pub mod config;
pub mod data;
pub mod device;
pub mod dtype;
pub mod env;
pub mod error;
pub mod memory;
pub mod metrics;
pub mod model;
pub mod optim;
pub mod parallel;
pub mod sweep;
pub mod train;
pub mod transport;

pub use error::{Error, Result};
