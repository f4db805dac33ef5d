//! `meshtrain bench`: measurements, never tests. [`collectives`] sweeps buffer sizes for each
//! collective (optionally against the system MPI); [`step`] times a training step of the executor
//! that trains (CPU arm by default) against the GEMM rate of its own matrix shapes; [`device`] times the device all-reduce per
//! path (stream-ordered, IPC, staged) and [`device_p2p`] device send/recv (direct or staged);
//! [`tune_table`] measures the collective schedules and writes the tuner's table.

pub mod collectives;
pub mod device;
pub mod device_p2p;
pub mod step;
pub mod tune_table;
