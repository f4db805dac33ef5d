//! `train.loss_scale` and its five `train.loss_scale_*` parameters: the value forms and their
//! checks. The scaler itself (what a step does with them) is `train::loss_scale`.
//!
//! `train.loss_scale` is a word or a number in TOML: `"dynamic"` (the default under
//! `precision = "fp16"`), `"none"` (the default otherwise) or a positive number (a fixed scale).
//! The effective configuration writes it back in the same form, so it loads to the same value.

use std::fmt;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::TrainConfig;
use crate::error::{Error, Result};

/// `train.loss_scale`: how the loss gradient is scaled before the backward.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LossScale {
    /// No scaling (the gradients are the loss's).
    None,
    /// Start at `train.loss_scale_init`; back off on overflow, grow after good steps.
    Dynamic,
    /// A fixed scale: a step with non-finite gradients is skipped, the scale stays.
    Fixed(f64),
}

impl Serialize for LossScale {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            LossScale::None => s.serialize_str("none"),
            LossScale::Dynamic => s.serialize_str("dynamic"),
            LossScale::Fixed(v) => s.serialize_f64(*v),
        }
    }
}

struct LossScaleVisitor;

impl Visitor<'_> for LossScaleVisitor {
    type Value = LossScale;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("\"dynamic\", \"none\" or a positive number")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> std::result::Result<LossScale, E> {
        match v.to_ascii_lowercase().as_str() {
            "dynamic" => Ok(LossScale::Dynamic),
            "none" => Ok(LossScale::None),
            _ => Err(E::invalid_value(de::Unexpected::Str(v), &self)),
        }
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> std::result::Result<LossScale, E> {
        Ok(LossScale::Fixed(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> std::result::Result<LossScale, E> {
        Ok(LossScale::Fixed(v as f64))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> std::result::Result<LossScale, E> {
        Ok(LossScale::Fixed(v as f64))
    }
}

impl<'de> Deserialize<'de> for LossScale {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        d.deserialize_any(LossScaleVisitor)
    }
}

/// Checks the loss-scaling keys of `t`; errors name the key.
pub(super) fn validate(t: &TrainConfig) -> Result<()> {
    let positive = |key: &str, v: f64| {
        if v.is_finite() && v > 0.0 {
            Ok(())
        } else {
            Err(Error::config(key, format!("{v} is not a positive finite number")))
        }
    };
    if let LossScale::Fixed(v) = t.loss_scale {
        positive("train.loss_scale", v)?;
    }
    positive("train.loss_scale_init", t.loss_scale_init)?;
    positive("train.loss_scale_min", t.loss_scale_min)?;
    if !(t.loss_scale_growth.is_finite() && t.loss_scale_growth >= 1.0) {
        return Err(Error::config("train.loss_scale_growth", format!("{} is not a finite number >= 1", t.loss_scale_growth)));
    }
    if !(t.loss_scale_backoff > 0.0 && t.loss_scale_backoff < 1.0) {
        return Err(Error::config("train.loss_scale_backoff", format!("{} is not in (0, 1)", t.loss_scale_backoff)));
    }
    if t.loss_scale_growth_interval == 0 {
        return Err(Error::config("train.loss_scale_growth_interval", "0 is below the minimum 1"));
    }
    if t.loss_scale == LossScale::Dynamic && t.loss_scale_init < t.loss_scale_min {
        return Err(Error::config(
            "train.loss_scale_init",
            format!("{} is below train.loss_scale_min = {}", t.loss_scale_init, t.loss_scale_min),
        ));
    }
    Ok(())
}
