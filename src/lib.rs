//! meshtrain: trains GPT models on supercomputers.
//!
//! Layers, bottom to top; each only uses the ones below it (or beside it in the same line), and
//! no import points up or round:
//! - [`dtype`], [`error`], [`env`], [`memory`], [`logging`]: leaves. Element types and reduce
//!   operators with their byte kernels; the one error type; every runtime `MESHTRAIN_*` variable
//!   and the one size parser; releasing buffer pages (ZeRO-2/3 residency) and measuring resident
//!   memory; log output in whole-line writes that launchers merge intact.
//! - [`bootstrap`]: MPI discovers ranks and nodes and broadcasts the unique id (root address +
//!   secret) under the start-up watchdog; nothing else ever goes through MPI.
//! - [`transport`]: chunk FIFOs between two ranks over shared memory, TCP or libfabric.
//! - [`device`]: `Device {Cpu, Cuda, Hip, Emu}`: buffers, streams, and ops with one arm per
//!   device; `device::cpu` holds the CPU arm's kernels (one file per layer, the matrix product,
//!   AdamW, threads), which are also the numerical reference of the GPU kernels.
//! - [`comm`]: communicators, rings, and the collective algorithms written over transport
//!   primitives; `comm::device` runs them on device buffers (paths behind one trait).
//! - [`world`]: assembles the job on what `bootstrap` found: the pre-MPI check of the runtime
//!   environment, meshtrain's own network (listeners, the control channel, the peer table) and
//!   the communicator of all ranks.
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
pub mod logging;
pub mod mem;
pub mod memory;
pub mod metrics;
pub mod model;
pub mod optim;
pub mod parallel;
pub mod plan;
pub mod sweep;
pub mod train;
pub mod transport;
pub mod world;

pub use error::{Error, Result};
