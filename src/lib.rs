//! meshtrain: trains GPT models on supercomputers.
//!
//! Layers, bottom to top (each only uses the ones below it; where code does not yet, the arrow
//! is listed under "Not yet" so that it is not copied):
//! - [`dtype`], [`error`], [`env`]: leaves. Element types and reduce operators with their byte
//!   kernels; the one error type; every runtime `MESHTRAIN_*` variable and the one size parser.
//! - [`bootstrap`]: MPI discovers ranks and broadcasts the unique id (root address + secret);
//!   nothing else ever goes through MPI. The pre-MPI check of the environment lives here.
//! - [`transport`]: chunk FIFOs between two ranks over shared memory, TCP or libfabric.
//! - [`device`]: CPU (numerical reference), CUDA, HIP and emu arms: buffers, streams, kernels.
//! - [`comm`]: communicators, rings, and the collective algorithms written over transport
//!   primitives; `comm::device` runs them on device buffers (paths behind one trait).
//! - [`model`], [`optim`], [`data`], [`train`]: the GPT model, AdamW, token shards, the training
//!   loop. One executor (`model::DeviceGpt`) runs every layout on every device arm, the CPU's
//!   included; `model::Gpt` is the single-rank reference that tests compare it with. One step
//!   (`train::device_step`) reduces, clips and updates for ZeRO 0-3 on every arm.
//! - [`memory`]: releasing buffer pages (ZeRO-2/3 residency) and measuring resident memory.
//! - [`bench`]: `meshtrain bench`, collective and step benchmarks.
//!
//! Not yet (arrows that still point up): `device` imports `model` (CPU layer kernels, thread
//! setting), `optim` (AdamW), `config` (device kind, precision) and `memory` (page size);
//! `bootstrap` imports `transport` and `comm` (it builds the connector and the world
//! communicator; only its MPI part belongs at the bottom) and `config` (the override names of
//! the misspelling check).

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
pub mod plan;
pub mod sweep;
pub mod train;
pub mod transport;

pub use error::{Error, Result};
