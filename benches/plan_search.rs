//! Speed of `meshtrain plan` (`cargo bench --bench plan_search`): every layout of the 1T model on
//! 3072 GPUs (global batch 3072, seq 2048), searched and ranked, for each shipped profile and both
//! stacks. The bound is 2 s per search; each search runs 3 times, the best wall and CPU
//! times reported.
//! A search that finds no fitting layout (meshtrain's fp32 activations without recomputation do
//! not fit the 1T model) still costs every layout and is timed the same way.

use std::time::Instant;

/// CPU seconds (user + system) this process has used: on a shared machine wall time measures the
/// other builds as much as the search.
fn cpu_s() -> f64 {
    let mut u = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes one rusage into the zeroed buffer it is given.
    let u = unsafe {
        libc::getrusage(libc::RUSAGE_SELF, u.as_mut_ptr());
        u.assume_init()
    };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(u.ru_utime) + tv(u.ru_stime)
}

use meshtrain::plan::cost::Machine;
use meshtrain::plan::search::{search, Options};
use meshtrain::plan::{Job, Profile, Stack};

fn main() {
    let job = Job::named("1t", 3072, 3072, 2048).expect("the 1t job");
    println!(
        "{:<10} {:<10} {:>8} {:>8} {:>9} {:>8} {:>8}",
        "machine", "stack", "costed", "fit", "rejected", "wall_s", "cpu_s"
    );
    for machine in Profile::shipped() {
        let profile = Profile::load(machine).expect("a shipped profile");
        for stack in [Stack::Meshtrain, Stack::Megatron] {
            let mach = Machine::new(&profile, stack, "bf16").expect("bf16 peak");
            let opts = Options::default();
            let (mut best, mut best_cpu) = (f64::MAX, f64::MAX);
            let mut outcome = String::new();
            for _ in 0..3 {
                let (t, c) = (Instant::now(), cpu_s());
                let result = search(&job, &mach, &opts);
                best = best.min(t.elapsed().as_secs_f64());
                best_cpu = best_cpu.min(cpu_s() - c);
                outcome = match result {
                    Ok(plan) => format!(
                        "{:>8} {:>8} {:>9}",
                        plan.costed,
                        plan.ranked.len(),
                        plan.rejected.len()
                    ),
                    Err(_) => format!("{:>8} {:>8} {:>9}", "-", 0, "all"),
                };
            }
            println!(
                "{machine:<10} {:<10} {outcome} {best:>8.3} {best_cpu:>8.3}",
                format!("{stack:?}")
            );
        }
    }
}
