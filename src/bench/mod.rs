//! `meshtrain bench`: measurements, never tests. [`collectives`] sweeps buffer sizes for each
//! collective (optionally against the system MPI).

pub mod collectives;
