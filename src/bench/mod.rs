//! Benchmarks behind `meshtrain bench`: the step benchmark (model + optimizer on CPU).

pub mod step;
