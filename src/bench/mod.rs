//! `meshtrain bench`: measurements, never tests. [`collectives`] sweeps buffer sizes for each
//! collective (optionally against the system MPI); [`step`] times a training step of the model on
//! CPU against the GEMM rate of its own matrix shapes; [`device_p2p`] times device send/recv.

pub mod collectives;
pub mod device_p2p;
pub mod step;
