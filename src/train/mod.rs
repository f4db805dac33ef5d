//! `meshtrain train`: the training loop.
//!
//! One optimizer step = `grad_accum` micro-batches of (B, T) on every data-parallel rank, gradients
//! averaged over micro-batches and ranks, clipped by the global norm, AdamW with the warm-up +
//! cosine schedule. Every rank computes the same loss (averaged over the group) and rank 0 writes
//! the metrics. Invariants: the same seed and config give bit-identical losses run to run; a
//! data-parallel run sees exactly the windows a single rank sees with `grad_accum * dp`
//! micro-batches, so both follow the same trajectory up to float summation order.

mod bench_step;
mod buckets;
#[cfg(test)]
pub(crate) use buckets::plan_buckets;
mod checkpointing;
mod comm_worker;
mod config_agree;
mod device_step;
mod device_zero;
mod grad_sync;
mod memory_estimate;
mod memory_fit;
mod nonfinite;
mod pipeline;
mod replica;
mod shutdown;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::bootstrap::World;
use crate::comm::stats::CommStats;
use crate::comm::{Communicator, ReduceOp};
use crate::config::JobConfig;
use crate::data::{open_source, Batch, Sampler, Split};
use crate::error::Result;
use crate::memory::{peak_rss_bytes, reset_peak_rss, rss_bytes};
use crate::metrics::{FlopCounter, MetricsWriter, Progress, StepRecord};
use crate::device::{bind_cpu_threads, cpu_peak_tflops, Device};
use crate::parallel::grid::{Grid, GridShape};
use crate::parallel::schedule::Schedule;
use crate::parallel::stage_split;
use crate::optim::{AdamWConfig, LrSchedule};

use device_step::DeviceStep;
use nonfinite::{NonFiniteGuard, Verdict};
pub use bench_step::{HeldBytes, StepHarness, StepResult};
pub use grad_sync::DataParallel;
pub use memory_estimate::{MemoryEstimate, MemoryInputs};
pub use replica::{DeviceEvent, Replica, ReplicaLayout};

/// Options of one run that are not part of the job config.
#[derive(Debug, Clone, Default)]
pub struct TrainOptions {
    /// Where rank 0 writes one JSON line per step.
    pub metrics: Option<PathBuf>,
}

/// What a finished run reports (identical on every rank).
#[derive(Debug, Clone)]
pub struct TrainReport {
    /// Training loss of each step.
    pub losses: Vec<f64>,
    /// (step, validation loss) pairs.
    pub val_losses: Vec<(u64, f64)>,
    /// Mean tokens per second over the steps after the first.
    pub tokens_per_s: f64,
}

/// Mean validation loss over `batches` micro-batches on every rank, averaged over the group.
fn evaluate(model: &mut Replica, batch: &mut Batch, sampler: &mut Sampler, batches: usize, dp: &Communicator) -> Result<f64> {
    let mut sum = 0.0f64;
    for _ in 0..batches {
        sampler.next_batch(batch)?;
        sum += model.eval(batch)?;
    }
    // The evaluation's stream-ordered TP calls are checked like a step's.
    model.model_mut().check_collectives()?;
    let mut mean = [sum / batches.max(1) as f64];
    dp.all_reduce(&mut mean, ReduceOp::Avg)?;
    Ok(mean[0])
}

/// Trains `cfg` on this world (every rank calls it).
pub fn train(world: &World, cfg: &JobConfig, opts: &TrainOptions) -> Result<TrainReport> {
    // From here on SIGTERM/SIGUSR1 stop the run after a step, with a checkpoint (`shutdown.rs`).
    shutdown::install()?;
    // Every rank must train the same job: refuse differing configs before anything else.
    let world_comm = world.communicator()?;
    config_agree::check(&world_comm, cfg)?;
    memory_fit::check(&world_comm, cfg, world.local_size)?;
    cfg.validate_world(world.size)?;
    let device = (Device::open(cfg.device, world.local_rank)?, cfg.precision);
    let leader = world.rank == 0;
    bind_cpu_threads(world.local_size);
    // What the process holds before the model exists (binary, libraries, MPI): the baseline of
    // the memory estimate.
    let baseline = rss_bytes()?;
    if leader {
        println!("# effective config\n{}", cfg.to_toml());
    }
    let shape = GridShape::from_config(&cfg.parallel);
    let grid = Grid::new(&world_comm, shape)?;
    if leader {
        println!("# {}", shape.describe());
    }
    let Grid { tp, pp, dp, .. } = grid;
    // Partial gradient norms are summed over the TP and PP groups, on communicators of their own.
    let mut norm_groups = Vec::new();
    for g in [&tp, &pp] {
        if g.size() > 1 {
            norm_groups.push(g.split(Some(0), g.rank() as i64)?.expect("joined"));
        }
    }
    let norm_groups: Vec<&Communicator> = norm_groups.iter().collect();
    // Traffic counters per group, reported in the metrics (groups of one rank move nothing).
    let mut traffic: Vec<(&str, Arc<CommStats>)> = Vec::new();
    for (name, g) in [("tp", &tp), ("pp", &pp), ("dp", &dp)] {
        if g.size() > 1 {
            traffic.push((name, g.stats()));
        }
    }
    let (b, t) = (cfg.train.micro_batch, cfg.train.seq_len);
    // Micro-batches per optimizer step on each data-parallel rank.
    let accum = cfg.train.grad_accum * cfg.parallel.microbatches;
    let schedule = Schedule::from_config(&cfg.parallel);
    let stages = pp.size() * schedule.chunks();
    let stage_layers = stage_split::stage_layers(&cfg.model, t, stages, &cfg.parallel.stage_layers)?;
    if leader && pp.size() > 1 {
        // Chunk c of pipeline rank r is global stage c * pp + r.
        println!("# pipeline stages (blocks of each global stage): {stage_layers:?}");
    }
    let layout = ReplicaLayout {
        tp,
        pp,
        sequence_parallel: cfg.parallel.sequence_parallel,
        schedule,
        microbatches: cfg.parallel.microbatches,
        stage_layers,
        device,
    };
    let zero = cfg.parallel.zero;
    let mut model = Replica::new(cfg.model, b, t, layout)?;
    let n = model.params().len();
    let norm_spans = model.norm_spans();
    let units = model.units();
    let bucket_elems = ((cfg.parallel.bucket_mb * (1 << 20) as f64 / 4.0) as usize).max(1);
    let mut sync = DataParallel::new(&dp, &units, zero, bucket_elems)?;
    if dp.size() > 1 {
        traffic.push(("dp_buckets", sync.bucket_stats()));
    }
    // Each rank initialises its part of the model (its host copy; at ZeRO-3 its device keeps the
    // owned blocks of it and gathers the units on a communicator of its own, so the gathers and
    // the gradient reductions interleave).
    let owned = sync.owned();
    model.initialize(&cfg.model, cfg.train.seed)?;
    if zero == 3 {
        let gathers = dp.split(Some(0), dp.rank() as i64)?.expect("every rank joins");
        model.model_mut().shard_params(gathers, sync.bucket_ranges(), &owned)?;
    }
    let gather_wait = Arc::new(AtomicU64::new(0));
    let estimate = MemoryEstimate::new(&MemoryInputs {
        zero,
        n,
        shard: sync.state_len(),
        dp: dp.size(),
        buckets: sync.bucket_ranges(),
        units: &units,
        wte: model.wte(),
        passes: &[],
        activations: model.activation_elements(),
    });
    if leader {
        println!(
            "# layout: dp={} tp={} pp={} zero={}; {} parameters on this rank in {} gradient bucket(s)",
            dp.size(),
            cfg.parallel.tp,
            cfg.parallel.pp,
            zero,
            n,
            sync.buckets(),
        );
        println!(
            "# memory estimate per rank (rank 0): {} + runtime baseline {:.1} MB",
            estimate.describe(),
            baseline as f64 / 1e6
        );
    }
    let adamw = AdamWConfig {
        beta1: cfg.optim.beta1,
        beta2: cfg.optim.beta2,
        eps: cfg.optim.eps,
        weight_decay: cfg.optim.weight_decay,
    };
    let maps = model.tensor_maps();
    if let Some(path) = &cfg.init_from {
        checkpointing::init_from(path, cfg, &maps, model.params_mut())?;
    }
    let sched = LrSchedule::new(cfg.optim.lr, cfg.optim.min_lr, cfg.optim.warmup_steps, cfg.train.steps)?;
    let vocab = cfg.model.vocab_size;
    let train_src = open_source(&cfg.data.source, Split::Train, vocab, cfg.data.seed, "data.source")?;
    let mut sampler = Sampler::new(train_src, t, b, dp.rank(), dp.size(), cfg.data.shuffle, cfg.data.seed)?;
    let mut val_sampler = if cfg.train.eval_every > 0 {
        let (src, key) = match &cfg.data.val_source {
            Some(v) => (v.as_str(), "data.val_source"),
            None => (cfg.data.source.as_str(), "data.source"),
        };
        let val = open_source(src, Split::Val, vocab, cfg.data.seed, key)?;
        Some(Sampler::new(val, t, b, dp.rank(), dp.size(), false, cfg.data.seed)?)
    } else {
        None
    };
    // Every evaluation reads the same validation windows, so resumed runs report the same values.
    let val_start = val_sampler.as_ref().map(|v| v.state());
    let (mut first_step, mut tokens_seen) = (1, 0u64);
    let resume_from = match &cfg.checkpoint.resume {
        Some(resume) => checkpointing::resolve(cfg, resume)?,
        None => None,
    };
    if let (true, None, Some(dir)) = (leader && cfg.checkpoint.resume.is_some(), &resume_from, &cfg.checkpoint.dir) {
        println!("# checkpoint.resume = \"latest\": no checkpoint in {} yet, starting fresh", dir.display());
    }
    if leader && cfg.checkpoint.dir.is_none() {
        println!("# no checkpoint.dir: this run writes no checkpoints");
    }
    if let Some(path) = resume_from {
        let r = checkpointing::restore(&path, cfg, &maps, model.params_mut(), &mut sync)?;
        sampler.restore(r.sampler)?;
        (first_step, tokens_seen) = (r.step + 1, r.tokens_seen);
        if leader {
            println!("# resumed from {} at step {}", path.display(), r.step);
        }
    }

    let peak = match (cfg.metrics.peak_tflops, model.device()) {
        (Some(p), _) => Some(p),
        (None, Device::Cpu) => Some(cpu_peak_tflops(world.local_size)),
        (None, dev) => dev.peak_tflops(cfg.precision),
    };
    let flops = FlopCounter::new(&cfg.model, t, peak, world.size);
    let mut writer = match (&opts.metrics, leader) {
        (Some(p), true) => Some(MetricsWriter::create(p)?),
        _ => None,
    };
    let progress = Progress::new(cfg.train.steps, cfg.train.log_every, leader);
    let tokens_per_step = (dp.size() * accum * b * t) as f64;
    let mut batch = Batch::new(b, t);
    let mut batches: Vec<Batch> = (0..accum).map(|_| Batch::new(b, t)).collect();
    let mut report = TrainReport { losses: Vec::new(), val_losses: Vec::new(), tokens_per_s: 0.0 };
    let (start, mut timed_s, mut timed_steps) = (Instant::now(), 0.0, 0u64);
    // The peak resident set reported per step is that of the training steps, not of the set-up
    // (which builds the initial model from one seed on every rank). Without the kernel interface
    // the peak covers the whole run.
    let peak_is_steps = reset_peak_rss().is_ok();
    let every_backward = sync.reduces_every_backward();
    // The model steps on its device (ZeRO 1-3: on its shard of the state); from here on its
    // device weights and moments are the training state (stored back into the host copies before
    // each checkpoint).
    let mut device_step = {
        let m = model.model_mut();
        let mut s = DeviceStep::new(m, &sync, m.layout().decay_spans(), &norm_spans, adamw)?;
        s.load(m, &sync)?;
        if leader {
            println!("# device optimizer state per rank (ZeRO {zero}): {:.2} MB", s.device_bytes() as f64 / 1e6);
        }
        s
    };

    let mut last_step = first_step - 1;
    let mut guard = NonFiniteGuard::new(&cfg.train);
    for step in first_step..=cfg.train.steps {
        last_step = step;
        let t0 = Instant::now();
        // ZeRO-2/3 zeroed every reported gradient range (handing its pages back) as it was staged,
        // and the reducer checked that every range was reported: clearing the buffer again would
        // only fault all of its pages back in.
        if !every_backward {
            model.zero_grad()?;
        }
        for batch in batches.iter_mut() {
            sampler.next_batch(batch)?;
        }
        // The last backward (ZeRO-2/3: every backward) communicates, overlapped bucket by bucket
        // (the device step: after the backward, on the device).
        let round = model.round();
        let mut device_events = |e: DeviceEvent| match e {
            DeviceEvent::UnitFinal(m, unit) => device_step.reduce_unit(m, &dp, accum, unit),
            DeviceEvent::BackwardDone(m) => device_step.after_backward(m, &dp, (accum, round)),
        };
        let loss_mean = model.run(&batches, every_backward, &mut device_events)?;
        let loss_mean = guard.local_loss(step, world.rank, loss_mean);
        let lr = sched.lr(step - 1);
        // Every rank applies or skips the update alike (`nonfinite.rs`), before anything changes.
        let mut verdict = Verdict::Apply;
        let mut apply = |norm: f64| -> Result<bool> {
            verdict = guard.decide(&world_comm, step, loss_mean, norm)?;
            Ok(verdict == Verdict::Apply)
        };
        let outcome = device_step.step(model.model_mut(), &dp, &norm_groups, accum, lr, cfg.optim.grad_clip, &mut apply)?;
        if let Verdict::Skip(why) = &verdict {
            progress.println(&format!("# step {step}: {why}"));
        }
        let param_wait = Duration::from_nanos(gather_wait.swap(0, Ordering::Relaxed));
        let mut loss = [loss_mean];
        dp.all_reduce(&mut loss, ReduceOp::Avg)?;
        // The largest peak resident set over all ranks, in MB, and the largest stop signal any
        // rank received (0: none), in one reduction: every rank decides alike whether to stop.
        let stop_signal = shutdown::requested().unwrap_or(0);
        let mut peak_mb = [peak_rss_bytes()? as f64 / 1e6, stop_signal as f64];
        world_comm.all_reduce(&mut peak_mb, ReduceOp::Max)?;
        let stop_signal = peak_mb[1] as libc::c_int;
        let step_s = t0.elapsed().as_secs_f64();
        if step > 1 {
            timed_s += step_s;
            timed_steps += 1;
        }
        let val_loss = match &mut val_sampler {
            Some(v) if step % cfg.train.eval_every == 0 || step == cfg.train.steps => {
                v.restore(val_start.expect("a validation sampler has a start"))?;
                let l = evaluate(&mut model, &mut batch, v, cfg.train.eval_batches, &dp)?;
                report.val_losses.push((step, l));
                Some(l)
            }
            _ => None,
        };
        let tokens_per_s = tokens_per_step / step_s;
        // The step split: exposed communication (gradient buckets not hidden behind backward,
        // ZeRO-3 gathers waited for), pipeline bubble (idle and point-to-point waits), and the rest
        // (compute, including the optimizer and the hidden communication).
        let bubble = model.pipeline_idle().map_or(0.0, |(idle, _)| idle);
        let exposed = outcome.timing.exposed.as_secs_f64() + param_wait.as_secs_f64();
        let compute_s = (step_s - exposed - bubble).max(0.0);
        let pipeline = model.pipeline_metrics()?;
        let record = StepRecord {
            step,
            loss: loss[0],
            lr,
            grad_norm: outcome.grad_norm,
            tokens_per_s,
            model_tflops: flops.model_tflops(tokens_per_s),
            mfu: flops.mfu(tokens_per_s),
            elapsed_s: start.elapsed().as_secs_f64(),
            val_loss,
            extra: [
                ("comm_s".to_string(), serde_json::json!(outcome.timing.comm.as_secs_f64())),
                ("comm_exposed_s".to_string(), serde_json::json!(outcome.timing.exposed.as_secs_f64())),
                ("param_gather_wait_s".to_string(), serde_json::json!(param_wait.as_secs_f64())),
                ("step_s".to_string(), serde_json::json!(step_s)),
                ("compute_s".to_string(), serde_json::json!(compute_s)),
                ("peak_rss_mb".to_string(), serde_json::json!(peak_mb[0])),
                ("peak_rss_covers".to_string(), serde_json::json!(if peak_is_steps { "steps" } else { "run" })),
                ("mem_estimate_mb".to_string(), serde_json::json!((estimate.total() + baseline) as f64 / 1e6)),
                ("skipped".to_string(), serde_json::json!(verdict != Verdict::Apply)),
            ]
            .into_iter()
            .chain(std::iter::once((
                "collectives".to_string(),
                serde_json::Value::Object(traffic.iter().map(|(n, s)| (n.to_string(), s.take_json())).collect()),
            )))
            .chain(pipeline)
            .collect(),
        };
        if let Some(w) = &mut writer {
            w.write(&record)?;
        }
        progress.update(&record);
        report.losses.push(loss[0]);
        tokens_seen += tokens_per_step as u64;
        let stopping = stop_signal != 0 && step < cfg.train.steps;
        let due = step == cfg.train.steps || cfg.checkpoint.every > 0 && step % cfg.checkpoint.every == 0;
        if let (Some(dir), true) = (&cfg.checkpoint.dir, stopping || due) {
            let state = sampler.state();
            device_step.store(model.model_mut(), &mut sync)?;
            let dir =
                checkpointing::save(dir, &world_comm, &dp, cfg, adamw, &maps, model.params(), &sync, step, tokens_seen, state)?;
            progress.println(&format!("# checkpoint {}", dir.display()));
        }
        if stopping {
            let why = shutdown::name(stop_signal);
            if shutdown::requested().is_some() {
                log::warn!("{why} received: stopping after step {step} of {}", cfg.train.steps);
            }
            match cfg.checkpoint.dir {
                Some(_) => progress.println(&format!("# stopped by {why} after step {step}; resume with checkpoint.resume = \"latest\"")),
                None => progress.println(&format!("# stopped by {why} after step {step}; no checkpoint.dir, so no checkpoint")),
            }
            break;
        }
    }
    device_step.finish(model.model(), &dp)?;
    let m = model.model_mut();
    m.release_param_shards()?;
    m.release_collectives()?;
    progress.finish();
    report.tokens_per_s = if timed_s > 0.0 { tokens_per_step * timed_steps as f64 / timed_s } else { 0.0 };
    if leader {
        println!(
            "# done: {} steps, final loss {:.4}{}, {:.0} tokens/s{}",
            last_step,
            report.losses.last().copied().unwrap_or(f64::NAN),
            report.val_losses.last().map_or(String::new(), |(_, v)| format!(", val loss {v:.4}")),
            report.tokens_per_s,
            match guard.skipped {
                0 => String::new(),
                n => format!(", {n} step(s) skipped (non-finite)"),
            }
        );
    }
    Ok(report)
}
