//! Helpers of the GPU tests (tests/gpu_*.rs), which run only on a machine with a CUDA GPU.

use meshtrain::config::DeviceKind;
use meshtrain::device::Device;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The CUDA GPU of local rank 0.
pub fn gpu() -> Device {
    Device::open(DeviceKind::Cuda, 0).expect("a CUDA GPU with driver, NVRTC and cuBLAS")
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
