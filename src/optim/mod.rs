//! The optimizer: AdamW over flat buffers, the learning-rate schedule, gradient-norm clipping.
//! The element kernels (the AdamW update, sums of squares, scaling) are the CPU arm's, in
//! `device::cpu`; this module holds the state and the decay mask built from the layout.
//!
//! Everything works on offset ranges of the flat parameter/gradient buffers described by
//! [`crate::model::ParamLayout`], so a data-parallel rank updating only its ZeRO shard calls the
//! same code with its sub-slices. Combining partial results across ranks (norms) is the caller's
//! job; gradient accumulation is the training loop's (the model's backward adds into grads).

pub mod optimizer;
pub mod lr_schedule;

pub use crate::device::cpu::clip::{clip_scale, scale_grads, sum_of_squares};
pub use optimizer::{AdamW, AdamWConfig, AdamWState, DecayMask};
pub use lr_schedule::LrSchedule;
