//! Helpers of the GPU tests (tests/gpu_*.rs). Each test is written once against a device kind and
//! instantiated twice by [`gpu_and_emu_tests!`]: `gpu::NAME` on a CUDA GPU (ignored elsewhere;
//! `benches/gpu_run.sh` runs them) and `emu::NAME` on the emu arm (the same kernels on the host,
//! bounds-checked; runs in CI).

use meshtrain::config::DeviceKind;
use meshtrain::device::Device;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The device of `kind` for local rank 0. Emu devices run blocks and threads in reverse order:
/// the forward order hides races where thread 0 writes what the others read without a barrier
/// (tests/device_emu.rs shows one), the reverse order exposes them.
pub fn open(kind: DeviceKind) -> Device {
    let dev = Device::open(kind, 0).unwrap_or_else(|e| panic!("device {kind:?} (a CUDA GPU needs driver, NVRTC, cuBLAS; emu needs g++): {e}"));
    if let Device::Emu(e) = &dev {
        e.set_reverse_order(true);
    }
    dev
}

/// For each `fn NAME(kind: DeviceKind)` of the test file: `gpu::NAME` (ignored: needs a CUDA
/// GPU) and `emu::NAME` (the emu arm, in every `cargo test`).
#[macro_export]
macro_rules! gpu_and_emu_tests {
    ($($name:ident),* $(,)?) => {
        mod gpu {
            $(
                #[test]
                #[ignore = "needs a CUDA GPU"]
                fn $name() {
                    super::$name(meshtrain::config::DeviceKind::Cuda)
                }
            )*
        }
        mod emu {
            $(
                #[test]
                fn $name() {
                    super::$name(meshtrain::config::DeviceKind::Emu)
                }
            )*
        }
    };
}

/// A fresh random generator for `test`; its seed is printed, and `MESHTRAIN_GPU_SEED` replays it.
pub fn rng(test: &str) -> ChaCha8Rng {
    let seed = std::env::var("MESHTRAIN_GPU_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::thread_rng().gen::<u64>());
    eprintln!("{test}: seed {seed}");
    ChaCha8Rng::seed_from_u64(seed)
}
