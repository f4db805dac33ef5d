//! Throughput of the collective reduction kernels on host memory (`cargo bench --bench
//! reduce_kernels`): GB/s of output for `out = a op b` per element type, next to a plain memcpy of
//! the same size, the bound a fused ring step is measured against.

use std::time::Instant;

use meshtrain::dtype::Reducer;
use meshtrain::comm::{DType, ReduceOp};

fn main() {
    let bytes = 64 << 20;
    let a = vec![1u8; bytes];
    let b = vec![2u8; bytes];
    let mut out = vec![0u8; bytes];
    let reps = 10;
    let t = Instant::now();
    for _ in 0..reps {
        out.copy_from_slice(&a);
        std::hint::black_box(&mut out);
    }
    let memcpy = (bytes * reps) as f64 / t.elapsed().as_secs_f64() / 1e9;
    println!("{:>6} {:>6} {:>10}", "dtype", "op", "GB/s");
    println!("{:>6} {:>6} {memcpy:>10.2}", "-", "memcpy");
    for dtype in DType::ALL {
        for op in [ReduceOp::Sum, ReduceOp::Max] {
            let r = Reducer::new(dtype, op);
            let t = Instant::now();
            for _ in 0..reps {
                r.reduce_out(&mut out, &a, &b);
                std::hint::black_box(&mut out);
            }
            let gbs = (bytes * reps) as f64 / t.elapsed().as_secs_f64() / 1e9;
            println!("{:>6} {:>6} {gbs:>10.2}", dtype.name(), op.name());
        }
    }
}
