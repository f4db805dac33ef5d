//! meshtrain: trains GPT models on supercomputers.
//!
//! Layers, bottom to top (each only uses the ones below it; where code does not yet, the arrow
//! is listed under "Not yet" so that it is not copied):
//! - [`dtype`], [`error`], [`env`], [`memory`]: leaves. Element types and reduce operators with
//!   their byte kernels; the one error type; every runtime `MESHTRAIN_*` variable and the one size
//!   parser; releasing buffer pages (ZeRO-2/3 residency) and measuring resident memory.
//! - [`bootstrap`]: MPI discovers ranks and broadcasts the unique id (root address + secret);
//!   nothing else ever goes through MPI. The pre-MPI check of the environment lives here.
//! - [`transport`]: chunk FIFOs between two ranks over shared memory, TCP or libfabric.
//! - [`device`]: `Device {Cpu, Cuda, Hip, Emu}`: buffers, streams, and ops with one arm per
//!   device; `device::cpu` holds the CPU arm's kernels (one file per layer, the matrix product,
//!   AdamW, threads), which are also the numerical reference of the GPU kernels.
//! - [`comm`]: communicators, rings, and the collective algorithms written over transport
//!   primitives; `comm::device` runs them on device buffers (paths behind one trait).
//! - [`model`], [`optim`], [`data`]: the GPT model (layout tables, init, sampling; one executor,
//!   `model::DeviceGpt`, runs every layout on every device arm, the CPU's included, and
//!   `model::Gpt` is the single-rank reference that tests compare it with), AdamW state over flat
//!   buffers, token shards.
//! - [`parallel`], [`config`]: the tp x pp x dp grid, pipeline schedules and their simulator; the
//!   validated job configuration.
//! - [`train`], [`checkpoint`], [`metrics`]: the training session and its one step
//!   (`train::device_step`: reduce, clip and update for ZeRO 0-3 on every arm), checkpoints,
//!   metrics.
//! - [`bench`], [`sweep`], [`plan`]: `meshtrain bench` (collective and step benchmarks), scaling
//!   sweeps, and `meshtrain plan`/`tune` (machine profiles, the cost model, the layout search).
//!
//! Not yet (arrows that still point up or round): `bootstrap` imports `transport` and `comm` (it
//! builds the connector and the world communicator; only its MPI part belongs at the bottom) and
//! `config` (the override names of the misspelling check).

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
