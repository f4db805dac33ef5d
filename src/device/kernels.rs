//! The GPU kernel sources, embedded in the binary, and the list of their entry points.
//!
//! Each `kernels/*.cu` file is valid CUDA and HIP at once (see `kernels/compat.h`). Both
//! compilers get one translation unit: the files concatenated in [`SOURCES`] order with every
//! `#include "x.h"` of a local header replaced by that header's text the first time and dropped
//! after (the embedded sources have no include directory at run time). [`entry_points`] is the
//! contract between the sources and the launchers in `ops.rs`; the compile tests check that every
//! name is in the compiled module.

use std::collections::HashSet;

use crate::dtype::{DType, ReduceOp};

/// Local headers the kernels include, by name (compat.h includes emu.h only when MT_EMU is
/// defined, so the GPU compilers see its text but skip it).
const HEADERS: [(&str, &str); 2] = [
    ("compat.h", include_str!("../../kernels/compat.h")),
    ("emu.h", include_str!("../../kernels/emu.h")),
];

/// The emu arm's launcher, appended to its translation unit.
const EMU_RUNTIME: &str = include_str!("../../kernels/emu_runtime.cpp");

/// Kernel files, by name.
pub const SOURCES: [(&str, &str); 15] = [
    ("reduce.cu", include_str!("../../kernels/reduce.cu")),
    ("layernorm.cu", include_str!("../../kernels/layernorm.cu")),
    ("gelu.cu", include_str!("../../kernels/gelu.cu")),
    ("attention.cu", include_str!("../../kernels/attention.cu")),
    ("cross_entropy.cu", include_str!("../../kernels/cross_entropy.cu")),
    ("adamw.cu", include_str!("../../kernels/adamw.cu")),
    ("cast.cu", include_str!("../../kernels/cast.cu")),
    ("residual.cu", include_str!("../../kernels/residual.cu")),
    ("encoder.cu", include_str!("../../kernels/encoder.cu")),
    ("linear.cu", include_str!("../../kernels/linear.cu")),
    ("vocab_parallel.cu", include_str!("../../kernels/vocab_parallel.cu")),
    ("oneshot.cu", include_str!("../../kernels/oneshot.cu")),
    ("rmsnorm.cu", include_str!("../../kernels/rmsnorm.cu")),
    ("swiglu.cu", include_str!("../../kernels/swiglu.cu")),
    ("rope.cu", include_str!("../../kernels/rope.cu")),
];

/// Entry points other than the reductions.
const MODEL_KERNELS: [&str; 38] = [
    "layernorm_forward_f32",
    "layernorm_backward_dinp_f32",
    "norm_backward_dparams_f32",
    "gelu_forward_f32",
    "gelu_backward_f32",
    "attention_split_heads_f32",
    "attention_merge_heads_f32",
    "attention_softmax_forward_f32",
    "attention_softmax_backward_f32",
    "cross_entropy_forward_f32",
    "cross_entropy_backward_f32",
    "adamw_f32",
    "cast_f32_to_bf16",
    "cast_bf16_to_f32",
    "residual_forward_f32",
    "encoder_forward_f32",
    "encoder_backward_wpe_f32",
    "encoder_backward_wte_f32",
    "bias_add_f32",
    "bias_backward_f32",
    "fill_zero_f32",
    "sum_squares_f32",
    "scale_f32",
    "nonfinite_mark_f32",
    "copy_f32",
    "embedding_shard_forward_f32",
    "embedding_shard_backward_f32",
    "position_forward_f32",
    "shard_max_f32",
    "shard_sum_exp_f32",
    "cross_entropy_combine_f32",
    "oneshot_signal",
    "oneshot_wait",
    "rmsnorm_forward_f32",
    "rmsnorm_backward_dinp_f32",
    "swiglu_forward_f32",
    "swiglu_backward_f32",
    "rope_f32",
];

/// The IEEE half casts of `precision = "fp16"` (kernels/cast.cu).
const HALF_KERNELS: [&str; 2] = ["cast_f32_to_f16", "cast_f16_to_f32"];

/// The whole kernel translation unit, local includes expanded once.
pub fn kernel_source() -> String {
    let mut seen = HashSet::new();
    let mut out = String::new();
    for (name, text) in SOURCES {
        out.push_str(&format!("// ---- {name}\n"));
        expand(text, &mut seen, &mut out);
    }
    out
}

/// The emu arm's C++ translation unit: MT_EMU defined, the kernels, `extra` kernel source (test
/// kernels; may include compat.h), the launcher, and one launch entry per name in `entries`.
pub fn emu_source(extra: &str, entries: &[String]) -> String {
    let mut seen = HashSet::new();
    let mut out = String::from("#define MT_EMU 1\n");
    for (name, text) in SOURCES.iter().chain(&[("extra", extra)]) {
        out.push_str(&format!("// ---- {name}\n"));
        expand(text, &mut seen, &mut out);
    }
    out.push_str(EMU_RUNTIME);
    for name in entries {
        out.push_str(&format!("MT_EMU_ENTRY({name})\n"));
    }
    out
}

fn expand(text: &str, seen: &mut HashSet<&'static str>, out: &mut String) {
    for line in text.lines() {
        let header = line
            .trim()
            .strip_prefix("#include \"")
            .and_then(|rest| rest.strip_suffix('"'))
            .and_then(|name| HEADERS.iter().find(|(h, _)| *h == name));
        match header {
            Some((name, body)) => {
                if seen.insert(name) {
                    expand(body, seen, out);
                }
            }
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
}

/// Name of the combine kernel for `dtype` and `op` (`Avg` combines with the sum kernel).
pub fn reduce_kernel(dtype: DType, op: ReduceOp) -> String {
    let op = match op {
        ReduceOp::Avg => "sum",
        other => other.name(),
    };
    format!("reduce_{op}_{}", dtype.name())
}

/// Name of the `avg` divide kernel for `dtype`.
pub fn avg_div_kernel(dtype: DType) -> String {
    format!("avg_div_{}", dtype.name())
}

/// Every `extern "C"` kernel the sources define.
pub fn entry_points() -> Vec<String> {
    let mut names: Vec<String> = MODEL_KERNELS.iter().chain(&HALF_KERNELS).map(|s| s.to_string()).collect();
    for dtype in DType::ALL {
        for op in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max] {
            names.push(reduce_kernel(dtype, op));
        }
        names.push(avg_div_kernel(dtype));
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The header is inlined exactly once and no local include survives.
    #[test]
    fn includes_expand_once() {
        let src = kernel_source();
        assert_eq!(src.matches("#pragma once").count(), 1);
        assert!(!src.contains("#include \"compat.h\""));
        assert!(src.find("mt_shfl_down").unwrap() < src.find("reduce_##op").unwrap());
    }

    /// Every listed entry point is defined by name or by the reduction macros, and the list has
    /// no duplicates (28 combine kernels, 7 avg divides, 38 model and flag kernels, 2 fp16 casts).
    #[test]
    fn entry_points_are_unique_and_defined() {
        let names = entry_points();
        assert_eq!(names.len(), 28 + 7 + 38 + HALF_KERNELS.len());
        assert_eq!(names.iter().collect::<HashSet<_>>().len(), names.len());
        let src = kernel_source();
        for n in names
            .iter()
            .filter(|n| !n.starts_with("reduce_") && !n.starts_with("avg_div_"))
        {
            // `void name(`, or `void __launch_bounds__(..) name(`.
            let defined = src.contains(&format!("void {n}(")) || src.contains(&format!(") {n}("));
            assert!(defined, "{n} not defined");
        }
    }
}
