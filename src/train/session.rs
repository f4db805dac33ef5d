//! `meshtrain train` in three phases over one [`Session`]: set-up (grid, the model on its device,
//! the data-parallel plan, data, resume, the device step), one optimizer step at a time, and the
//! finish. The loop never branches on the device, the precision or the layout: those were chosen
//! once, when the replica and its step were built.
//!
//! Invariants: every rank runs the same phases in the same order (every collective here is SPMD);
//! the device holds the training state from the end of set-up on, and the host copies exist only
//! while a checkpoint is written; the per-step peak resident set covers the steps, not set-up.

use std::sync::Arc;
use std::time::Instant;

use serde_json::json;

use super::checkpointing;
use super::config_agree;
use super::device_step::DeviceStep;
use super::grad_sync::{DataParallel, StepOutcome};
use super::loss_scale::LossScaler;
use super::memory_estimate::{MemoryEstimate, MemoryInputs};
use super::memory_fit;
use super::nonfinite::{NonFiniteGuard, Verdict};
use super::ps::{PsClient, PsLinks};
use super::replica::{DeviceEvent, Replica, ReplicaLayout, TensorMap};
use super::shutdown;
use super::stragglers::Stragglers;
use super::{TrainOptions, TrainReport};
use crate::comm::stats::CommStats;
use crate::comm::{Communicator, ReduceOp};
use crate::config::JobConfig;
use crate::data::{open_source, Batch, Sampler, SamplerState, Split};
use crate::device::{bind_cpu_threads, cpu_peak_tflops, Device};
use crate::error::Result;
use crate::memory::{peak_rss_bytes, reset_peak_rss, rss_bytes};
use crate::metrics::{FlopCounter, MetricsWriter, Progress, StepRecord};
use crate::model::ExecOptions;
use crate::optim::{AdamWConfig, LrSchedule};
use crate::parallel::grid::{Grid, GridShape};
use crate::parallel::schedule::Schedule;
use crate::parallel::stage_split;
use crate::world::World;

/// The training and validation data of this data-parallel rank.
struct Data {
    sampler: Sampler,
    /// The validation sampler and its start (every evaluation reads the same windows).
    val: Option<(Sampler, SamplerState)>,
    batch: Batch,
    /// One step's micro-batches.
    batches: Vec<Batch>,
}

/// The communicators a session keeps: the world's, the data-parallel group's, the TP and PP
/// groups' norm communicators, and the traffic counters reported per group.
struct Groups {
    world_comm: Communicator,
    dp: Communicator,
    norm_groups: Vec<Communicator>,
    traffic: Vec<(&'static str, Arc<CommStats>)>,
    /// Parameter servers (`parallel.dp_sync = "ps"`): the links to them.
    ps: Option<PsLinks>,
}

/// What the set-up measured and printed about memory.
struct Memory {
    estimate: MemoryEstimate,
    /// Resident bytes before the model existed (binary, libraries, MPI).
    baseline: u64,
    /// The per-step peak covers the steps only (the kernel could reset it).
    steps_only: bool,
}

/// One rank's training run; see the module documentation.
pub(super) struct Session<'a> {
    cfg: &'a JobConfig,
    world: &'a World,
    world_comm: Communicator,
    dp: Communicator,
    /// The TP and PP groups' own communicators, over which partial gradient norms are summed.
    norm_groups: Vec<Communicator>,
    /// Traffic counters per group, reported in the metrics.
    traffic: Vec<(&'static str, Arc<CommStats>)>,
    model: Replica,
    sync: DataParallel,
    step: DeviceStep,
    adamw: AdamWConfig,
    maps: Vec<TensorMap>,
    sched: LrSchedule,
    data: Data,
    memory: Memory,
    flops: FlopCounter,
    writer: Option<MetricsWriter>,
    progress: Progress,
    guard: NonFiniteGuard,
    /// Loss scaling: the scale of the next step and its schedule.
    scaler: LossScaler,
    /// Micro-batches per optimizer step on each data-parallel rank.
    accum: usize,
    tokens_per_step: f64,
    first_step: u64,
    tokens_seen: u64,
    start: Instant,
    /// Seconds and count of the timed steps (all but the first).
    timed: (f64, u64),
    report: TrainReport,
    /// Rank 0: the checkpoint directory's lock, held until the session ends.
    dir_lock: Option<crate::checkpoint::DirLock>,
    /// Each rank's own work per step, compared every `log_every` steps.
    stragglers: Stragglers,
    /// Test-only: milliseconds this rank works longer per step (`MESHTRAIN_FAULT=slow-step@R:MS`).
    slow_ms: Option<u64>,
    /// `MESHTRAIN_FAULT=nan-grad@RANK:STEP`: this rank's loss gradient is NaN at that step.
    nan_grad_at: Option<u64>,
}

/// How a step ended.
pub(super) enum StepEnd {
    Continue,
    /// A stop signal was agreed on: the run ends after this step.
    Stop,
}

impl<'a> Session<'a> {
    /// Everything before step 1: the job agreed on, the grid, the model on its device and
    /// initialised (or restored), the data and the device step holding the state.
    pub fn setup(world: &'a World, cfg: &'a JobConfig, opts: &TrainOptions) -> Result<Self> {
        Self::setup_on(world, world.communicator()?, None, cfg, opts)
    }

    /// [`Session::setup`] on `world_comm` (all ranks, or the workers of a parameter-server job,
    /// whose links to the servers `ps` holds).
    pub fn setup_on(world: &'a World, world_comm: Communicator, ps: Option<PsLinks>, cfg: &'a JobConfig, opts: &TrainOptions) -> Result<Self> {
        // Every rank must train the same job: refuse differing configs before anything else.
        config_agree::check(&world_comm, cfg)?;
        memory_fit::check(&world_comm, cfg, world.local_size)?;
        cfg.validate_world(world.size)?;
        // The checkpoint directory belongs to this job until it ends (another job is refused now,
        // not at its first save).
        let dir_lock = match &cfg.checkpoint.dir {
            Some(dir) => crate::checkpoint::lock_for_job(&world_comm, dir)?,
            None => None,
        };
        let device = (Device::open(cfg.device, world.local_rank)?, cfg.precision);
        let leader = world.rank == 0;
        let threads = bind_cpu_threads(cfg.train.threads, world.local_size)?;
        if leader {
            log::info!("CPU threads per rank (BLAS and layers): {threads}");
            let cores = crate::device::cpu::parallel::available_cores();
            if threads.threads * world.local_size > cores {
                log::warn!("{} threads x {} ranks on this node exceed its {cores} cores (oversubscribed BLAS threads spin against each other)", threads.threads, world.local_size);
            }
        }
        let baseline = rss_bytes()?;
        if leader {
            write_effective_config(cfg, opts.metrics.as_deref())?;
        }
        let shape = GridShape::from_config(&cfg.parallel);
        let Grid { tp, pp, dp, .. } = Grid::new(&world_comm, shape)?;
        if leader {
            log::debug!("{}", shape.describe());
        }
        let mut norm_groups = Vec::new();
        let mut traffic = Vec::new();
        for (name, g) in [("tp", &tp), ("pp", &pp), ("dp", &dp)] {
            if g.size() > 1 {
                traffic.push((name, g.stats()));
                if name != "dp" {
                    norm_groups.push(g.split(Some(0), g.rank() as i64)?.expect("joined"));
                }
            }
        }
        let model = build_replica(cfg, (tp, pp), device, leader)?;
        let mut s = Session::assemble(world, cfg, opts, Groups { world_comm, dp, norm_groups, traffic, ps }, model, baseline)?;
        s.dir_lock = dir_lock;
        s.resume()?;
        s.start_step()?;
        Ok(s)
    }

    /// The session around a freshly built `model`: its data-parallel plan (ZeRO-3: the model
    /// keeps only its owned blocks), initial parameters, memory estimate, data and metrics.
    fn assemble(
        world: &'a World,
        cfg: &'a JobConfig,
        opts: &TrainOptions,
        Groups { world_comm, dp, norm_groups, traffic, ps }: Groups,
        mut model: Replica,
        baseline: u64,
    ) -> Result<Self> {
        let zero = cfg.parallel.zero;
        let units = model.units();
        let bucket_elems = ((cfg.parallel.bucket_mb * (1 << 20) as f64 / 4.0) as usize).max(1);
        let sync = DataParallel::new((dp.rank(), dp.size()), &units, zero, bucket_elems)?;
        // Each rank initialises its part of the model (its host copy; at ZeRO-3 its device keeps
        // the owned blocks and gathers the units on a communicator of its own, so the gathers
        // and the gradient reductions interleave).
        model.initialize(&cfg.model, cfg.train.seed)?;
        if zero == 3 {
            let gathers = dp.split(Some(0), dp.rank() as i64)?.expect("every rank joins");
            model.model_mut().shard_params(gathers, sync.bucket_ranges(), &sync.owned())?;
        }
        let adamw = AdamWConfig { beta1: cfg.optim.beta1, beta2: cfg.optim.beta2, eps: cfg.optim.eps, weight_decay: cfg.optim.weight_decay };
        let (decay, norm) = (model.decay_spans(), model.norm_spans());
        let ps_worker = ps.is_some();
        let step = match ps {
            None => DeviceStep::new(model.model(), &sync, &dp, (&decay, &norm), adamw)?,
            Some(links) => {
                let client = PsClient::new(links, cfg, &world_comm, model.params().len(), (decay.clone(), norm.clone()))?;
                DeviceStep::with_ps(model.model(), &sync, &dp, (&decay, &norm), adamw, client)?
            }
        };
        let (host_reduce, device_overlap) = step.reduces_during_backward();
        let estimate = MemoryEstimate::new(&MemoryInputs {
            zero,
            n: model.params().len(),
            shard: sync.state_len(),
            dp: dp.size(),
            buckets: sync.bucket_ranges(),
            units: &units,
            // An untied `wte` (Llama's own `lm_head`) is an ordinary unit of the formula.
            wte: model.wte().filter(|_| cfg.model.llama.is_none_or(|l| l.tie_embeddings)),
            releases_grads: zero >= 2 && model.model().is_whole(),
            host_reduce,
            device_overlap,
            activations: model.activation_elements(),
            adamw_state: !ps_worker,
        });
        if world.rank == 0 {
            println!(
                "# layout: dp={} tp={} pp={} zero={zero}; {} parameters on this rank in {} gradient bucket(s)",
                dp.size(),
                cfg.parallel.tp,
                cfg.parallel.pp,
                model.params().len(),
                sync.buckets(),
            );
            println!("# memory estimate per rank (rank 0): {} + runtime baseline {:.1} MB", estimate.describe(), baseline as f64 / 1e6);
        }
        let maps = model.tensor_maps();
        if let Some(path) = &cfg.init_from {
            checkpointing::init_from(path, cfg, &maps, model.params_mut())?;
        }
        let peak = match (cfg.metrics.peak_tflops, model.device()) {
            (Some(p), _) => Some(p),
            (None, Device::Cpu) => Some(cpu_peak_tflops()),
            (None, dev) => dev.peak_tflops(cfg.precision),
        };
        let accum = cfg.train.grad_accum * cfg.parallel.microbatches;
        let tokens_per_step = (dp.size() * accum * cfg.train.micro_batch * cfg.train.seq_len) as f64;
        Ok(Session {
            cfg,
            world,
            data: open_data(cfg, &dp)?,
            world_comm,
            dp,
            norm_groups,
            traffic,
            model,
            sync,
            step,
            adamw,
            maps,
            sched: LrSchedule::new(cfg.optim.lr, cfg.optim.min_lr, cfg.optim.warmup_steps, cfg.train.steps)?,
            memory: Memory { estimate, baseline, steps_only: false },
            flops: FlopCounter::new(&cfg.model, cfg.train.seq_len, peak, world.size).with_recompute(&cfg.model, cfg.train.seq_len, cfg.train.recompute),
            writer: match (&opts.metrics, world.rank == 0) {
                (Some(p), true) => Some(MetricsWriter::create(p)?),
                _ => None,
            },
            progress: Progress::new(cfg.train.steps, cfg.train.log_every, world.rank == 0),
            guard: NonFiniteGuard::new(&cfg.train).with_loss_scaling(LossScaler::new(&cfg.train).active()),
            scaler: LossScaler::new(&cfg.train),
            accum,
            tokens_per_step,
            first_step: 1,
            tokens_seen: 0,
            start: Instant::now(),
            timed: (0.0, 0),
            report: TrainReport { losses: Vec::new(), val_losses: Vec::new(), tokens_per_s: 0.0 },
            dir_lock: None,
            stragglers: Stragglers::new(if cfg.train.log_every > 0 { cfg.train.log_every } else { 100 }),
            slow_ms: crate::env::slow_step_ms(world.rank)?,
            nan_grad_at: crate::env::nan_grad_step(world.rank)?,
        })
    }

    /// Restores the checkpoint `checkpoint.resume` names, if any (parameters, moments, sampler).
    fn resume(&mut self) -> Result<()> {
        let (cfg, leader) = (self.cfg, self.world.rank == 0);
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
            let r = checkpointing::restore(&path, cfg, &self.maps, self.model.params_mut(), &mut self.sync)?;
            self.data.sampler.restore(r.sampler)?;
            (self.first_step, self.tokens_seen) = (r.step + 1, r.tokens_seen);
            self.scaler.restore(r.loss_scale);
            self.guard.skipped = r.loss_scale.map_or(0, |s| s.skipped_steps);
            if leader {
                println!("# resumed from {} at step {}", path.display(), r.step);
            }
        }
        Ok(())
    }

    /// Moves the training state onto the device (ZeRO 1-3: this rank's shard of it); from here
    /// on the device's weights and moments are the state (stored back into the host copies for
    /// each checkpoint). The peak resident set is reset after this.
    fn start_step(&mut self) -> Result<()> {
        self.step.load(self.model.model_mut(), &mut self.sync)?;
        if self.world.rank == 0 {
            let mb = self.step.device_bytes() as f64 / 1e6;
            log::debug!("device optimizer state per rank (ZeRO {}): {mb:.2} MB", self.cfg.parallel.zero);
        }
        if let (Some(stats), true) = (self.step.bucket_stats(), self.dp.size() > 1) {
            self.traffic.push(("dp_buckets", stats));
        }
        // Without the kernel interface the peak covers the whole run.
        self.memory.steps_only = reset_peak_rss().is_ok();
        Ok(())
    }

    /// The steps this run takes.
    pub fn steps(&self) -> std::ops::RangeInclusive<u64> {
        self.first_step..=self.cfg.train.steps
    }

    /// Optimizer step `step`: forward and backward of the step's micro-batches with the
    /// gradient reduction overlapped, the non-finite verdict, clip and AdamW, metrics, evaluation
    /// and checkpoint when due.
    pub fn step(&mut self, step: u64) -> Result<StepEnd> {
        let t0 = Instant::now();
        let every_backward = self.sync.reduces_every_backward();
        // ZeRO-2/3 hand every backward's gradients over and free or zero them once reduced.
        if !every_backward {
            self.model.zero_grad()?;
        }
        for batch in self.data.batches.iter_mut() {
            self.data.sampler.next_batch(batch)?;
        }
        if let Some(ms) = self.slow_ms {
            std::thread::sleep(std::time::Duration::from_millis(ms));
        }
        if self.nan_grad_at == Some(step) {
            self.model.model_mut().poison_next_backward();
        }
        let loss_scale = self.scaler.scale();
        self.model.model_mut().set_loss_scale(loss_scale);
        let accum = self.accum;
        self.step.begin(accum);
        let units = self.step.wants_units(self.model.model());
        let round = self.model.round();
        let Session { step: dstep, dp, model, data, .. } = self;
        let mut events = |e: DeviceEvent| match e {
            DeviceEvent::UnitFinal(m, unit) => dstep.reduce_unit(m, dp, accum, unit),
            DeviceEvent::BackwardDone(m) => dstep.after_backward(m, dp, (accum, round)),
        };
        let loss_mean = model.run(&data.batches, (every_backward, units), &mut events)?;
        let loss_mean = self.guard.local_loss(step, self.world.rank, loss_mean);
        self.step.note_loss(loss_mean);
        let lr = self.sched.lr(step - 1);
        // Every rank applies or skips the update alike (`nonfinite.rs`), before anything changes.
        let mut verdict = Verdict::Apply;
        let Session { guard, world_comm, step: dstep, model, dp, norm_groups, cfg, .. } = self;
        let mut apply = |norm: f64, own: bool| -> Result<bool> {
            verdict = guard.decide(world_comm, step, loss_mean, (norm, own))?;
            Ok(verdict == Verdict::Apply)
        };
        let groups: Vec<&Communicator> = norm_groups.iter().collect();
        let outcome = dstep.step(model.model_mut(), dp, &groups, accum, lr, (cfg.optim.grad_clip, loss_scale), &mut apply)?;
        if let Verdict::Skip(why) | Verdict::Overflow(why) = &verdict {
            let scale = if self.scaler.active() { format!(" (loss scale {loss_scale})") } else { String::new() };
            self.progress.println(&format!("# step {step}: {why}{scale}"));
        }
        self.scaler.update(step, matches!(verdict, Verdict::Overflow(_)))?;
        let mut loss = [loss_mean];
        self.dp.all_reduce(&mut loss, ReduceOp::Avg)?;
        // The largest peak resident set over all ranks, in MB, and the largest stop signal any
        // rank received (0: none), in one reduction: every rank decides alike whether to stop.
        let mut peak_mb = [peak_rss_bytes()? as f64 / 1e6, shutdown::requested().unwrap_or(0) as f64];
        self.world_comm.all_reduce(&mut peak_mb, ReduceOp::Max)?;
        let stop_signal = peak_mb[1] as libc::c_int;
        let step_s = t0.elapsed().as_secs_f64();
        if step > 1 {
            self.timed = (self.timed.0 + step_s, self.timed.1 + 1);
        }
        let val_loss = self.evaluate_if_due(step)?;
        let mut record = self.record(step, (loss[0], lr, val_loss), &outcome, (step_s, peak_mb[0]), verdict != Verdict::Apply)?;
        self.report_straggler(step, &mut record)?;
        record.extra.insert("loss_scale".into(), json!(loss_scale));
        record.extra.insert("skipped_steps".into(), json!(self.guard.skipped));
        if let Some(w) = &mut self.writer {
            w.write(&record)?;
        }
        self.progress.update(&record);
        self.report.losses.push(loss[0]);
        self.tokens_seen += self.tokens_per_step as u64;
        let stopping = stop_signal != 0 && step < self.cfg.train.steps;
        let every = self.cfg.checkpoint.every;
        if stopping || step == self.cfg.train.steps || every > 0 && step % every == 0 {
            self.checkpoint(step)?;
        }
        if !stopping {
            return Ok(StepEnd::Continue);
        }
        let why = shutdown::name(stop_signal);
        if shutdown::requested().is_some() {
            log::warn!("{why} received: stopping after step {step} of {}", self.cfg.train.steps);
        }
        self.progress.println(&match self.cfg.checkpoint.dir {
            Some(_) => format!("# stopped by {why} after step {step}; resume with checkpoint.resume = \"latest\""),
            None => format!("# stopped by {why} after step {step}; no checkpoint.dir, so no checkpoint"),
        });
        Ok(StepEnd::Stop)
    }

    /// Every `log_every` steps: names the rank whose own work per step lags the others' (log and
    /// metrics `straggler_rank`, `straggler_lag_s`); collective over the world.
    fn report_straggler(&mut self, step: u64, record: &mut StepRecord) -> Result<()> {
        let own_s = record.extra.get("compute_s").and_then(|v| v.as_f64()).unwrap_or(0.0);
        let Some(lag) = self.stragglers.observe(&self.world_comm, step, own_s)? else { return Ok(()) };
        if self.world.rank == 0 {
            self.progress.println(&format!(
                "# straggler at step {step}: rank {} works {:.1} ms per step, {:.1} ms more than the median rank ({:.1} ms), since the last report",
                lag.rank,
                lag.mean_s * 1e3,
                lag.lag_s() * 1e3,
                lag.median_s * 1e3,
            ));
        }
        record.extra.insert("straggler_rank".into(), json!(lag.rank));
        record.extra.insert("straggler_lag_s".into(), json!(lag.lag_s()));
        Ok(())
    }

    /// The mean validation loss over `train.eval_batches` micro-batches, averaged over the group,
    /// on evaluation steps and the last.
    fn evaluate_if_due(&mut self, step: u64) -> Result<Option<f64>> {
        let cfg = self.cfg;
        let Some((v, start)) = &mut self.data.val else { return Ok(None) };
        if step % cfg.train.eval_every != 0 && step != cfg.train.steps {
            return Ok(None);
        }
        v.restore(*start)?;
        let mut sum = 0.0f64;
        for _ in 0..cfg.train.eval_batches {
            v.next_batch(&mut self.data.batch)?;
            sum += self.model.eval(&self.data.batch)?;
        }
        // The evaluation's stream-ordered TP calls are checked like a step's.
        self.model.model_mut().check_collectives()?;
        let mut mean = [sum / cfg.train.eval_batches.max(1) as f64];
        self.dp.all_reduce(&mut mean, ReduceOp::Avg)?;
        self.report.val_losses.push((step, mean[0]));
        Ok(Some(mean[0]))
    }

    /// The step's metrics record: the step split into exposed communication (gradient buckets
    /// not hidden behind backward), pipeline bubble (idle and point-to-point waits) and the rest
    /// (compute, including the optimizer and the hidden communication).
    fn record(
        &self,
        step: u64,
        (loss, lr, val_loss): (f64, f64, Option<f64>),
        outcome: &StepOutcome,
        (step_s, peak_mb): (f64, f64),
        skipped: bool,
    ) -> Result<StepRecord> {
        let tokens_per_s = self.tokens_per_step / step_s;
        let bubble = self.model.pipeline_idle().map_or(0.0, |(idle, _)| idle);
        let exposed = outcome.timing.exposed.as_secs_f64();
        let compute_s = (step_s - exposed - bubble).max(0.0);
        let m = &self.memory;
        let collectives = serde_json::Value::Object(self.traffic.iter().map(|(n, s)| (n.to_string(), s.take_json())).collect());
        let extra = [
            ("comm_s", json!(outcome.timing.comm.as_secs_f64())),
            ("comm_exposed_s", json!(exposed)),
            ("param_gather_wait_s", json!(0.0)),
            ("step_s", json!(step_s)),
            ("hardware_tflops", json!(self.flops.hardware_tflops(tokens_per_s))),
            ("compute_s", json!(compute_s)),
            ("peak_rss_mb", json!(peak_mb)),
            ("peak_rss_covers", json!(if m.steps_only { "steps" } else { "run" })),
            ("mem_estimate_mb", json!((m.estimate.total() + m.baseline) as f64 / 1e6)),
            ("skipped", json!(skipped)),
            ("collectives", collectives),
        ];
        Ok(StepRecord {
            step,
            loss,
            lr,
            grad_norm: outcome.grad_norm,
            tokens_per_s,
            model_tflops: self.flops.model_tflops(tokens_per_s),
            mfu: self.flops.mfu(tokens_per_s),
            elapsed_s: self.start.elapsed().as_secs_f64(),
            val_loss,
            extra: extra.into_iter().map(|(k, v)| (k.to_string(), v)).chain(self.model.pipeline_metrics()?).chain(self.step.ps_metrics()).collect(),
        })
    }

    /// Writes the checkpoint of `step` (if the job has a checkpoint directory): the device's
    /// state comes back into the host copies for it and goes again after.
    fn checkpoint(&mut self, step: u64) -> Result<()> {
        let Some(dir) = &self.cfg.checkpoint.dir else { return Ok(()) };
        let state = self.data.sampler.state();
        self.step.store(self.model.model_mut(), &mut self.sync)?;
        let (params, sync) = (self.model.params(), &self.sync);
        let written =
            checkpointing::save(dir, &self.world_comm, &self.dp, self.cfg, self.adamw, &self.maps, params, sync, step, self.tokens_seen, (state, self.scaler.state(self.guard.skipped)))?;
        self.sync.release_states();
        self.model.model_mut().release_host_params()?;
        self.progress.println(&format!("# checkpoint {}", written.display()));
        Ok(())
    }

    /// Releases the device state (collective) and reports the run; `last` is the last step run.
    pub fn finish(mut self, last: u64) -> Result<TrainReport> {
        self.step.finish(self.model.model(), &self.dp)?;
        let m = self.model.model_mut();
        m.release_param_shards()?;
        m.release_collectives()?;
        self.progress.finish();
        let (secs, steps) = self.timed;
        let mut report = self.report;
        report.tokens_per_s = if secs > 0.0 { self.tokens_per_step * steps as f64 / secs } else { 0.0 };
        if self.world.rank == 0 {
            println!(
                "# done: {last} steps, final loss {:.4}{}, {:.0} tokens/s{}",
                report.losses.last().copied().unwrap_or(f64::NAN),
                report.val_losses.last().map_or(String::new(), |(_, v)| format!(", val loss {v:.4}")),
                report.tokens_per_s,
                match (self.guard.skipped, self.scaler.active()) {
                    (0, _) => String::new(),
                    (n, false) => format!(", {n} step(s) skipped (non-finite)"),
                    (n, true) => format!(", {n} step(s) skipped (non-finite; final loss scale {})", self.scaler.scale()),
                }
            );
        }
        Ok(report)
    }
}

/// The effective configuration (rank 0): printed at debug level (`-v`), and written beside the
/// metrics file (`out/run.jsonl` -> `out/run.config.toml`) when there is one.
fn write_effective_config(cfg: &JobConfig, metrics: Option<&std::path::Path>) -> Result<()> {
    let text = cfg.to_toml();
    if log::log_enabled!(log::Level::Debug) {
        println!("# effective config\n{text}");
    }
    if let Some(m) = metrics {
        let path = m.with_extension("config.toml");
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| crate::error::Error::io(format!("create {}", dir.display()), e))?;
        }
        std::fs::write(&path, text).map_err(|e| crate::error::Error::io(format!("write {}", path.display()), e))?;
    }
    Ok(())
}

/// The replica of `cfg` over the TP and PP groups on `device`, with its pipeline stages split.
fn build_replica(cfg: &JobConfig, (tp, pp): (Communicator, Communicator), device: (Device, crate::config::Precision), leader: bool) -> Result<Replica> {
    let t = cfg.train.seq_len;
    let schedule = Schedule::from_config(&cfg.parallel);
    let stages = pp.size() * schedule.chunks();
    let stage_layers = stage_split::stage_layers(&cfg.model, t, stages, &cfg.parallel.stage_layers)?;
    if leader && pp.size() > 1 {
        // Chunk c of pipeline rank r is global stage c * pp + r.
        log::debug!("pipeline stages (blocks of each global stage): {stage_layers:?}");
    }
    let exec = ExecOptions { precision: device.1, recompute: cfg.train.recompute };
    let layout = ReplicaLayout {
        tp,
        pp,
        sequence_parallel: cfg.parallel.sequence_parallel,
        schedule,
        microbatches: cfg.parallel.microbatches,
        stage_layers,
        device: (device.0, exec),
    };
    Replica::new(cfg.model, cfg.train.micro_batch, t, layout)
}

/// This data-parallel rank's training sampler and, when the job evaluates, its validation
/// sampler with its start.
fn open_data(cfg: &JobConfig, dp: &Communicator) -> Result<Data> {
    let (b, t, vocab) = (cfg.train.micro_batch, cfg.train.seq_len, cfg.model.vocab_size);
    let (rank, size, seed) = (dp.rank(), dp.size(), cfg.data.seed);
    let train = open_source(&cfg.data.source, Split::Train, vocab, seed, "data.source")?;
    let sampler = Sampler::new(train, t, b, rank, size, cfg.data.shuffle, seed)?;
    let val = if cfg.train.eval_every > 0 {
        let (src, key) = match &cfg.data.val_source {
            Some(v) => (v.as_str(), "data.val_source"),
            None => (cfg.data.source.as_str(), "data.source"),
        };
        let v = Sampler::new(open_source(src, Split::Val, vocab, seed, key)?, t, b, rank, size, false, seed)?;
        let start = v.state();
        Some((v, start))
    } else {
        None
    };
    let accum = cfg.train.grad_accum * cfg.parallel.microbatches;
    Ok(Data { sampler, val, batch: Batch::new(b, t), batches: (0..accum).map(|_| Batch::new(b, t)).collect() })
}
