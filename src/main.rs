//! The `meshtrain` command: one process per GPU (or CPU rank), started by srun or mpirun.
//!
//! Errors print one line naming the rank and exit non-zero (2 for bad input). A failing rank raises
//! the job-wide abort first, so that every other rank stops within its deadline instead of hanging,
//! and exits without finalizing MPI (finalize waits for peers that are gone).

use std::io::Write;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use meshtrain::bench::collectives::{self, CollBench, COLLECTIVES};
use meshtrain::env::parse_size;
use meshtrain::bench::step::{run_step_bench, StepBenchArgs};
use meshtrain::config::JobConfig;
use meshtrain::checkpoint;
use meshtrain::data::{tokenize_files, Gpt2Tokenizer, GPT2_VOCAB_SIZE};
use meshtrain::model::sample::{self, SampleOptions};
use meshtrain::model::{Gpt, GptConfig, ParamLayout};
use meshtrain::train::{self, TrainOptions};
use meshtrain::bootstrap::rank_hint;
use meshtrain::world::World;
use meshtrain::comm::{probe::Reads, selftest, Communicator, DType, ReduceOp};
use meshtrain::config::{DeviceKind, Precision};
use meshtrain::device::Device;
use meshtrain::{Error, Result};

#[derive(Parser)]
#[command(name = "meshtrain", version, about = "Train GPT models on supercomputers")]
struct Cli {
    /// More detail: `-v` per-rank and per-communicator lines and the effective config (debug),
    /// `-vv` everything (trace). `RUST_LOG` sets finer filters when no `-v` is given.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Benchmark collectives (`all_reduce`, `all_gather`, `reduce_scatter`, `all_to_all`,
    /// `broadcast`, `reduce`, or `all`); run one process per rank under mpirun/srun.
    Bench(BenchArgs),
    /// Train a GPT model: `meshtrain train JOB.toml [--set section.key=value ...] [--metrics FILE]`.
    Train(TrainArgs),
    /// Summarize a checkpoint (`--verify` recomputes every hash, `--tensor NAME` shows one tensor).
    Inspect(InspectArgs),
    /// Write a checkpoint as one self-contained HDF5 file with plain datasets (usable as `init_from`).
    Export(ExportArgs),
    /// Sample text from a model exported with `meshtrain export` (or a checkpoint directory).
    Generate(GenerateArgs),
    /// Turn UTF-8 text files into llm.c token shards with GPT-2 BPE.
    Tokenize(TokenizeArgs),
    /// Check every collective, element type and operator bit for bit on this job's ranks and
    /// transports (exit status 1 on any mismatch).
    Selftest(SelftestArgs),
    /// Strong/weak scaling sweeps: `sweep run JOB --mode strong --ranks 1,2,4` (CSV, JSON, plots),
    /// `sweep report DIR`, `sweep bench LABEL=CSV...` (bus bandwidth plots).
    Sweep(meshtrain::sweep::cli::SweepArgs),
    /// Choose the 3D layout for a model on a machine: `plan --model 175b --machine frontier
    /// --gpus 1024 --global-batch 1536` (ranked table, `--json`, `--write job.toml`),
    /// `plan validate` (published runs predicted vs measured).
    Plan(meshtrain::plan::command::PlanArgs),
    /// Run the best predicted layouts of a job as short trials (`tune JOB --machine M --top K`),
    /// print predicted vs measured step times and write the measured winner's job file.
    Tune(meshtrain::plan::tune::TuneArgs),
}

#[derive(Args)]
struct TrainArgs {
    /// The job file (TOML).
    job: PathBuf,
    /// Overrides, e.g. `--set train.steps=10` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Write one JSON line per step here (rank 0).
    #[arg(long)]
    metrics: Option<PathBuf>,
}

#[derive(Args)]
struct InspectArgs {
    /// A checkpoint directory (or its checkpoint.h5).
    path: PathBuf,
    /// Recompute and compare every shard hash.
    #[arg(long)]
    verify: bool,
    /// Print statistics and a few values of one tensor.
    #[arg(long)]
    tensor: Option<String>,
    /// JSON output for scripts.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct ExportArgs {
    /// The checkpoint directory.
    ckpt: PathBuf,
    /// The HDF5 file to write.
    out: PathBuf,
    /// Also write the optimizer state (AdamW moments); by default only the model's weights.
    #[arg(long)]
    optimizer: bool,
    /// `h5` (one HDF5 file, meshtrain's names) or `safetensors` (a directory that transformers'
    /// `GPT2LMHeadModel.from_pretrained` or, for `model.arch = "llama"`, `LlamaForCausalLM.from_pretrained` loads: model.safetensors + config.json).
    #[arg(long, default_value = "h5", value_parser = ["h5", "safetensors"])]
    format: String,
}

#[derive(Args)]
struct GenerateArgs {
    /// An exported model (`meshtrain export`: an .h5 file or a safetensors directory), a
    /// checkpoint directory or its `latest`.
    model: PathBuf,
    /// Prompt text (GPT-2 BPE; for models with a smaller vocabulary use --tokens).
    #[arg(long, default_value = "")]
    prompt: String,
    /// Prompt as comma-separated token ids.
    #[arg(long, value_delimiter = ',')]
    tokens: Vec<u32>,
    /// Tokens to generate.
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// Softmax temperature (0 = greedy).
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Sample among the k most likely tokens (0 = all).
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    /// RNG seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

#[derive(Args)]
struct TokenizeArgs {
    /// Input text files (each one document).
    #[arg(required = true)]
    inputs: Vec<PathBuf>,
    /// Output prefix: writes PREFIX_val_000000.bin, PREFIX_train_000000.bin, ...
    #[arg(long, short)]
    out: PathBuf,
    /// Fraction of tokens that go to the validation split.
    #[arg(long, default_value_t = 0.05)]
    val_fraction: f64,
    /// Tokens per shard file.
    #[arg(long, default_value_t = 100_000_000)]
    shard_tokens: usize,
}

#[derive(Args)]
struct SelftestArgs {
    /// Counts checked with every element type and operator.
    #[arg(long, value_delimiter = ',', default_value = "0,1,2,13,97,4099")]
    counts: Vec<usize>,
    /// A large count (several MiB) checked with sum for every element type and with every operator
    /// for f32; 0 skips it.
    #[arg(long, default_value_t = 786_431)]
    large: usize,
    /// `cuda` or `hip`: check the device collectives on this GPU's buffers instead (IPC or
    /// staged path per MESHTRAIN_GPU_IPC; `cpu` runs them on the CPU arm, `emu` with the GPU
    /// kernels emulated on the host).
    #[arg(long)]
    device: Option<String>,
    /// Test only: make member 1 call a mismatched collective (op, count, dtype, root, reduce)
    /// and expect every rank to fail naming both calls.
    #[arg(long, hide = true)]
    mismatch: Option<String>,
}

#[derive(Args)]
struct BenchArgs {
    /// What to measure: a collective name, `all` (every collective), `step` (a training step of
    /// the training executor, CPU arm by default, against its own GEMM rate), `checkpoint`
    /// (save/load bandwidth) or
    /// `device` (a device collective per path: stream-ordered, IPC, FI_HMEM ring, staged), `device-sendrecv`
    /// (device buffers between members 0 and 1, direct or staged).
    what: String,
    /// `step`: named model size.
    #[arg(long, default_value = "d12")]
    size: String,
    /// `step`: micro-batch size.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// `step`: sequence length.
    #[arg(long, default_value_t = 64)]
    seq_len: usize,
    /// `step`: timed steps.
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// `checkpoint`: directory on the filesystem to measure (shared by all ranks).
    #[arg(long, default_value = "out/bench-checkpoint")]
    dir: PathBuf,
    /// `checkpoint`: parameters of the model whose weights and AdamW state are saved
    /// (default: d12's).
    #[arg(long, default_value_t = 124_475_904)]
    params: usize,
    /// Smallest buffer (K/M/G suffixes).
    #[arg(long, default_value = "4K", value_parser = parse_size)]
    min: usize,
    /// Largest buffer (K/M/G suffixes).
    #[arg(long, default_value = "64M", value_parser = parse_size)]
    max: usize,
    /// Size multiplier between rows.
    #[arg(long, default_value_t = 2)]
    factor: usize,
    /// Element type: f32, f64, bf16, f16, i32, i64, u8.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Reduction: sum, prod, min, max, avg.
    #[arg(long, default_value = "sum")]
    op: String,
    /// Untimed calls per size (collectives: at least; a tenth of the timed calls when more).
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Timed calls per size (collectives: at least; see --iter-bytes).
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Collectives: more timed calls for small sizes, as many as move this many bytes per size (at
    /// most 1000); 0 times exactly --iters. benches/mpi_coll.c has the same rule.
    #[arg(long, default_value = "256M", value_parser = parse_size)]
    iter_bytes: usize,
    /// Use the in-place variants.
    #[arg(long)]
    inplace: bool,
    /// Also time the system MPI's collective on the same buffers.
    #[arg(long)]
    vs_mpi: bool,
    /// Print CSV (header + one line per size).
    #[arg(long)]
    csv: bool,
    /// Collectives: keep each size's element count as given instead of rounding it to a multiple
    /// of the world size (uneven blocks); not with --vs-mpi or --tune.
    #[arg(long)]
    exact_count: bool,
    /// Collectives: time every schedule candidate per size and write the tuner's table
    /// (MESHTRAIN_TUNING=FILE loads it); rules for other world sizes in the file are kept.
    #[arg(long)]
    tune: bool,
    /// `--tune`: the table file written.
    #[arg(long, default_value = "tuning.toml")]
    tune_out: PathBuf,
    /// `--tune`: rounds per candidate (its time is the best round's).
    #[arg(long, default_value_t = 3)]
    tune_rounds: usize,
    /// `device`: the collective timed (all_reduce, all_gather, broadcast).
    #[arg(long, default_value = "all_reduce")]
    coll: String,
    /// `device`, `device-sendrecv`: device kind of the buffers (cuda, hip, emu, cpu; default cuda
    /// for `device`, emu for `device-sendrecv`); `step`: the arm the executor runs on (default
    /// cpu).
    #[arg(long)]
    device: Option<String>,
    /// `step`: element type of the matrix products (fp32, bf16, fp16).
    #[arg(long, default_value = "fp32")]
    precision: String,
}

impl BenchArgs {
    fn to_bench(&self) -> Result<CollBench> {
        let colls = if self.what == "all" {
            COLLECTIVES.iter().map(|s| s.to_string()).collect()
        } else if COLLECTIVES.contains(&self.what.as_str()) {
            vec![self.what.clone()]
        } else {
            return Err(Error::InvalidArgument(format!(
                "bench: unknown target `{}` (known: {}, all)",
                self.what,
                COLLECTIVES.join(", ")
            )));
        };
        let dtype = DType::parse(&self.dtype)
            .ok_or_else(|| Error::InvalidArgument(format!("bench: --dtype `{}` is not f32/f64/bf16/f16/i32/i64/u8", self.dtype)))?;
        let op = ReduceOp::parse(&self.op)
            .ok_or_else(|| Error::InvalidArgument(format!("bench: --op `{}` is not sum/prod/min/max/avg", self.op)))?;
        if self.min > self.max || self.iters == 0 {
            return Err(Error::InvalidArgument("bench: need --min <= --max and --iters >= 1".into()));
        }
        if self.exact_count && (self.vs_mpi || self.tune) {
            return Err(Error::InvalidArgument(
                "bench: --exact-count times uneven blocks, which MPI's block collectives and the tuner's table do not describe; drop --vs-mpi/--tune".into(),
            ));
        }
        Ok(CollBench {
            colls,
            min_bytes: self.min,
            max_bytes: self.max,
            factor: self.factor,
            dtype,
            op,
            warmup: self.warmup,
            iters: self.iters,
            iter_bytes: self.iter_bytes,
            inplace: self.inplace,
            vs_mpi: self.vs_mpi,
            csv: self.csv,
            exact_count: self.exact_count,
        })
    }
}

/// `meshtrain bench step`: the training executor's step on one rank.
fn bench_step(world: &World, args: &BenchArgs) -> Result<()> {
    if world.size != 1 {
        return Err(Error::config("bench step", format!("runs on one rank, not {} (start it without mpirun)", world.size)));
    }
    let precision = match args.precision.as_str() {
        "fp32" => Precision::Fp32,
        "bf16" => Precision::Bf16,
        "fp16" => Precision::Fp16,
        other => return Err(Error::config("--precision", format!("`{other}` is not fp32, bf16 or fp16"))),
    };
    let report = run_step_bench(&world.communicator()?, &StepBenchArgs {
        size: args.size.clone(),
        batch: args.batch,
        seq_len: args.seq_len,
        warmup: args.warmup.min(2),
        steps: args.steps,
        seed: 0,
        device: device_kind(args.device.as_deref().unwrap_or("cpu"))?,
        precision,
        threads: 0,
    })?;
    if args.csv {
        println!("{}", serde_json::to_string(&report).map_err(|e| Error::Check(e.to_string()))?);
    } else {
        println!("{report}");
    }
    Ok(())
}

/// `meshtrain bench all --tune`: the tuner's table, measured on this communicator.
fn bench_tune(world: &World, args: &BenchArgs, b: &CollBench) -> Result<()> {
    use meshtrain::bench::tune_table as tune;
    let comm = world.communicator()?;
    let chunk = meshtrain::comm::CommConfig::from_env()?.chunk_bytes;
    let leader = world.rank == 0;
    let results = tune::measure(&comm, b, chunk, args.tune_rounds, |r| {
        if leader {
            println!("{}", tune::format_result(r));
            let _ = std::io::stdout().flush();
        }
    })?;
    if leader {
        let rules = tune::rules_from(&results, comm.size(), comm.link_kind());
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let header = [
            format!("meshtrain bench --tune: {} ranks, {} links, host {}", comm.size(), comm.link_kind().name(), host.trim()),
            format!("sizes {}..{} bytes x{}, {}, best of {} rounds, f32", b.min_bytes, b.max_bytes, b.factor, b.rounds_text(), args.tune_rounds),
            meshtrain::mem::describe(),
        ];
        let table = tune::write_table(&args.tune_out, rules, &header)?;
        println!("# wrote {} ({} rules); load it with MESHTRAIN_TUNING={}", args.tune_out.display(), table.rules().len(), args.tune_out.display());
    }
    Ok(())
}

fn bench(world: &World, args: &BenchArgs) -> Result<()> {
    let b = args.to_bench()?;
    if args.tune {
        return bench_tune(world, args, &b);
    }
    let comm = world.communicator()?;
    let mpi = if b.vs_mpi { Some(world.mpi_for_comparison()?) } else { None };
    let leader = world.rank == 0;
    if leader {
        if !b.csv {
            println!(
                "# meshtrain bench: {} ranks on {} node(s), dtype {}, op {}, {}, {}",
                world.size,
                world.nodes.iter().max().map_or(1, |m| m + 1),
                b.dtype.name(),
                b.op.name(),
                if b.inplace { "in place" } else { "out of place" },
                b.rounds_text()
            );
            println!("# {}", meshtrain::mem::describe());
        }
        println!("{}", collectives::header(&b, comm.link_kind() == meshtrain::comm::tuner::LinkKind::Net));
    }
    let rows = collectives::run(&comm, mpi, &b, |row| {
        if leader {
            println!("{}", collectives::format_row(row, &b));
            let _ = std::io::stdout().flush();
        }
    })?;
    let wrong: u64 = rows.iter().map(|r| r.wrong).sum();
    if wrong > 0 {
        return Err(Error::Check(format!("bench: {wrong} wrong elements in checked results")));
    }
    Ok(())
}

/// `meshtrain bench device-sendrecv --device KIND`: device send/recv ping-pong, members 0 and 1.
fn bench_device_p2p(world: &World, args: &BenchArgs) -> Result<()> {
    let kind = device_kind(args.device.as_deref().unwrap_or("emu"))?;
    let comm = world.communicator()?;
    let dev = Device::open(kind, world.local_rank)?;
    let sizes: Vec<usize> = std::iter::successors(Some(args.min), |&s| Some(s * args.factor.max(2))).take_while(|&s| s <= args.max).collect();
    let rows = meshtrain::bench::device_p2p::bench_device_sendrecv(&comm, &dev, &sizes, args.warmup, args.iters)?;
    if world.rank == 0 {
        println!("# device send/recv, members 0 and 1, {kind:?} buffers; bytes, one-way us, GB/s");
        for r in rows {
            println!("{} {:.1} {:.3}", r.bytes, r.one_way_s * 1e6, r.bytes as f64 / r.one_way_s / 1e9);
        }
    }
    Ok(())
}

/// The device kind a `--device` flag names.
fn device_kind(kind: &str) -> Result<DeviceKind> {
    Ok(match kind {
        "cpu" => DeviceKind::Cpu,
        "cuda" => DeviceKind::Cuda,
        "hip" => DeviceKind::Hip,
        "emu" => DeviceKind::Emu,
        other => return Err(Error::config("--device", format!("`{other}` is not cpu, cuda, hip or emu"))),
    })
}

/// `meshtrain selftest --device KIND`: the device collectives, checked bit for bit.
fn selftest_device(world: &World, args: &SelftestArgs, kind: &str) -> Result<()> {
    let kind = device_kind(kind)?;
    let comm = world.communicator()?;
    let dev = Device::open(kind, world.local_rank)?;
    if let Some(case) = &args.mismatch {
        return selftest::device_mismatch(&comm, &dev, case);
    }
    let (fails, paths) = selftest::check_device_job(&comm, &dev, &args.counts, args.large)?;
    report_selftest(world, &comm, &fails, &paths)
}

fn selftest(world: &World, args: &SelftestArgs) -> Result<()> {
    if let Some(kind) = &args.device {
        return selftest_device(world, args, kind);
    }
    let comm = world.communicator()?;
    if let Some(case) = &args.mismatch {
        return selftest::mismatch(&comm, case);
    }
    let mut fails = selftest::check_all(&comm, &args.counts, &ReduceOp::ALL)?;
    if args.large > 0 {
        fails.extend(selftest::check_all(&comm, &[args.large], &[ReduceOp::Sum])?);
        fails.extend(selftest::check_type::<f32>(&comm, &[args.large], &ReduceOp::ALL)?);
    }
    let reads = match comm.single_copy_reads() {
        None => "not probed".to_string(),
        Some(Reads::Pay) => "work and pay".to_string(),
        Some(Reads::Slow(why)) => format!("work, do not pay ({why})"),
        Some(Reads::Fail(why)) => format!("unavailable ({why})"),
    };
    let what = format!("counts {:?} + {}", args.counts, args.large);
    report_selftest(world, &comm, &fails, &format!("{what}: single-copy reads: {reads}"))
}

/// Logs this rank's failures; rank 0 prints the job's total and `note`; an error if any failed.
fn report_selftest(world: &World, comm: &Communicator, fails: &[String], note: &str) -> Result<()> {
    for f in fails {
        log::error!("selftest: {f}");
    }
    let mut total = [fails.len() as i64];
    comm.all_reduce(&mut total, ReduceOp::Sum)?;
    if world.rank == 0 {
        println!("selftest: {} ranks: {} mismatches; {note}", world.size, total[0]);
    }
    if total[0] > 0 {
        return Err(Error::Check(format!("selftest: {} mismatches", total[0])));
    }
    Ok(())
}

fn inspect(args: &InspectArgs) -> Result<()> {
    let report = checkpoint::inspect(&args.path, args.verify, args.tensor.as_deref())?;
    let text = if args.json { report.to_json().to_string() } else { report.to_string() };
    // A reader that stops early (`inspect | head`) closes the pipe: not an error of ours.
    match writeln!(std::io::stdout().lock(), "{text}") {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(Error::io("write to stdout", e)),
        _ => Ok(()),
    }
}

fn generate(args: &GenerateArgs) -> Result<()> {
    if !(args.temperature.is_finite() && args.temperature >= 0.0) {
        return Err(Error::config("--temperature", format!("{} is not a number >= 0 (0 = greedy)", args.temperature)));
    }
    let (config, params) = load_model(&args.model)?;
    let mut model = Gpt::<f32>::from_params(config, 1, config.max_seq_len, params)?;
    let tokenizer = (config.vocab_size == GPT2_VOCAB_SIZE).then(Gpt2Tokenizer::new).transpose()?;
    if tokenizer.is_none() && !args.prompt.is_empty() {
        return Err(Error::config(
            "--prompt",
            format!(
                "this model's vocabulary has {} tokens, not GPT-2's {GPT2_VOCAB_SIZE}, so text cannot be encoded; \
                 give the prompt as token ids with --tokens (train on `meshtrain tokenize` shards with \
                 model.vocab_size = {GPT2_VOCAB_SIZE} for text)",
                config.vocab_size
            ),
        ));
    }
    let prompt: Vec<u32> = match &tokenizer {
        _ if !args.tokens.is_empty() => args.tokens.clone(),
        Some(t) if !args.prompt.is_empty() => t.encode(&args.prompt),
        Some(_) => vec![meshtrain::data::EOT_TOKEN],
        None => vec![0],
    };
    let opts = SampleOptions { max_new_tokens: args.max_new_tokens, temperature: args.temperature, top_k: args.top_k, seed: args.seed };
    let out = sample::generate(&mut model, &prompt, &opts)?;
    match &tokenizer {
        Some(t) if args.tokens.is_empty() => println!("{}{}", args.prompt, t.decode(&out)?),
        Some(t) => println!("{}{}", t.decode(&args.tokens)?, t.decode(&out)?),
        None => {
            log::info!("vocabulary of {} tokens is not GPT-2's: printing token ids", config.vocab_size);
            println!("{}", out.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(","));
        }
    }
    Ok(())
}

/// A model's config and flat parameters from an exported file or a checkpoint directory.
fn load_model(path: &std::path::Path) -> Result<(GptConfig, Vec<f32>)> {
    let in_checkpoint = path.file_name().is_some_and(|n| n == "latest" || n == "checkpoint.h5");
    if (path.is_dir() && !checkpoint::is_hf_dir(path)) || in_checkpoint {
        let index = checkpoint::open(path)?;
        let config = index.meta().model;
        let layout = ParamLayout::new(&config);
        let mut params = vec![0f32; layout.total_len()];
        checkpoint::load_flat_range(&index, "model", layout.entries(), 0..layout.total_len(), &mut params)?;
        return Ok((config, params));
    }
    let (model, tensors) = checkpoint::read_weights(path)?;
    let layout = ParamLayout::new(&model);
    let mut params = vec![0f32; layout.total_len()];
    for e in layout.entries() {
        let name = format!("model/{}", e.name);
        let t = tensors.iter().find(|t| t.0 == name).ok_or_else(|| Error::file(path, None, format!("missing `{name}`")))?;
        if t.1 != e.shape {
            return Err(Error::file(path, None, format!("`{name}` has shape {:?}, expected {:?}", t.1, e.shape)));
        }
        params[e.range()].copy_from_slice(&t.2);
    }
    Ok((model, params))
}

fn export(args: &ExportArgs) -> Result<()> {
    let n = match args.format.as_str() {
        "safetensors" if args.optimizer => {
            return Err(Error::config("--optimizer", "the safetensors (Hugging Face) format holds the weights only"))
        }
        "safetensors" => checkpoint::export_hf(&args.ckpt, &args.out)?,
        _ => checkpoint::export(&args.ckpt, &args.out, args.optimizer)?,
    };
    println!("export: {n} tensors -> {}", args.out.display());
    Ok(())
}

fn tokenize(args: &TokenizeArgs) -> Result<()> {
    let r = tokenize_files(&args.inputs, &args.out, args.val_fraction, args.shard_tokens)?;
    println!(
        "tokenize: {} documents, {} train tokens in {} shard(s), {} val tokens in {} shard(s)",
        r.documents,
        r.train_tokens,
        r.train_shards.len(),
        r.val_tokens,
        r.val_shards.len()
    );
    Ok(())
}

/// `meshtrain train`: a layout that does not fit the ranks the job got is said once, by rank 0,
/// before any rank exits (the world's shutdown barrier), with the `--set` that would fit.
fn train_job(cfg: &JobConfig, args: &TrainArgs) -> Result<()> {
    let mut world = World::init(meshtrain::config::is_override_var)?;
    if let Err(e) = cfg.validate_world(world.size) {
        if world.rank == 0 {
            let _ = std::io::stderr().write_all(format!("meshtrain: error: {e}\n").as_bytes());
        }
        drop(world);
        std::process::exit(e.exit_code());
    }
    // Training never uses MPI again: its transports and listeners close now.
    if let Err(e) = world.end_mpi() {
        world.abort_state().raise(&e.to_string());
        fail(&e);
    }
    in_world(world, |w| train::train(w, cfg, &TrainOptions { metrics: args.metrics.clone() }).map(|_| ()))
}

/// Runs `f` inside an initialized world; on failure raises the job-wide abort and exits at once.
fn with_world(f: impl FnOnce(&World) -> Result<()>) -> Result<()> {
    in_world(World::init(meshtrain::config::is_override_var)?, f)
}

/// Runs `f` in `world`; on failure raises the job-wide abort and exits at once.
fn in_world(world: World, f: impl FnOnce(&World) -> Result<()>) -> Result<()> {
    if let Err(e) = f(&world) {
        world.abort_state().raise(&e.to_string());
        world.remove_dead_peer_regions();
        fail(&e);
    }
    drop(world);
    Ok(())
}

fn fail(e: &Error) -> ! {
    // One write, so that launchers that tag output by line keep the message whole.
    let _ = std::io::stderr().write_all(format!("meshtrain: error: {e}\n").as_bytes());
    // The exit skips the libfabric endpoint's close, which would remove its shm region.
    meshtrain::transport::ofi::remove_own_shm_regions();
    std::process::exit(e.exit_code());
}

/// Logs to stderr, each line prefixed with the rank (`[r3 INFO ...]`; a process started without a
/// launcher is rank 0 of a world of one), in writes of whole lines (`logging::LineWrites`). Default
/// level info; `-v` debug, `-vv` trace, else `RUST_LOG`.
fn init_logging(verbose: u8) {
    let rank = rank_hint().unwrap_or(0);
    let mut builder = match verbose {
        0 => env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")),
        v => {
            let mut b = env_logger::Builder::new();
            b.parse_filters(if v == 1 { "debug" } else { "trace" });
            b
        }
    };
    builder
        .format(move |buf, rec| writeln!(buf, "[r{rank} {} {}] {}", rec.level(), rec.target(), rec.args()))
        .target(env_logger::Target::Pipe(Box::new(meshtrain::logging::LineWrites::new(std::io::stderr()))))
        .init();
}

/// Large buffers on transparent huge pages (see `meshtrain::mem`).
#[global_allocator]
static ALLOC: meshtrain::mem::HugePageAlloc = meshtrain::mem::HugePageAlloc;

fn main() {
    let cli = Cli::parse();
    init_logging(cli.verbose);
    match meshtrain::env::hugepages() {
        Ok(on) => meshtrain::mem::set_advise(on.unwrap_or(true)),
        Err(e) => fail(&e),
    }
    match meshtrain::env::cpu_simd() {
        Ok(cap) => meshtrain::device::cpu::simd::set_cap(cap),
        Err(e) => fail(&e),
    }
    let result = match &cli.command {
        Command::Bench(args) if args.what == "step" => with_world(|w| bench_step(w, args)),
        Command::Bench(args) if args.what == "checkpoint" => with_world(|w| {
            let report = checkpoint::bench_checkpoint(&w.communicator()?, &args.dir, args.params)?;
            if w.rank == 0 {
                println!("{report}");
            }
            Ok(())
        }),
        Command::Bench(args) if args.what == "device" => with_world(|w| {
            let dev = Device::open(device_kind(args.device.as_deref().unwrap_or("cuda"))?, w.local_rank)?;
            let c = w.communicator()?;
            let what = meshtrain::bench::device::Timed::parse(&args.coll)?;
            meshtrain::bench::device::run(&c, &dev, what, args.min, args.max, args.factor, args.warmup, args.iters)
        }),
        Command::Bench(args) if args.what == "device-sendrecv" => with_world(|w| bench_device_p2p(w, args)),
        Command::Bench(args) => with_world(|w| bench(w, args)),
        Command::Train(args) => {
            // A layout that cannot fit the launched world is refused before MPI and the
            // transports start.
            let cfg = JobConfig::load(&args.job, &args.sets).and_then(|cfg| match meshtrain::bootstrap::size_hint() {
                Some(n) => cfg.validate_world(n).map(|()| cfg),
                None => Ok(cfg),
            });
            match cfg {
                Ok(cfg) => train_job(&cfg, args),
                // Every rank loads the same job before MPI: rank 0 alone says what is wrong, the
                // others end with the same status.
                Err(e) if rank_hint().is_some_and(|r| r != 0) => std::process::exit(e.exit_code()),
                Err(e) => Err(e),
            }
        }
        Command::Tokenize(args) => tokenize(args),
        Command::Inspect(args) => inspect(args),
        Command::Export(args) => export(args),
        Command::Generate(args) => generate(args),
        Command::Selftest(args) => with_world(|w| selftest(w, args)),
        Command::Sweep(args) => meshtrain::sweep::cli::main(args),
        Command::Plan(args) if args.needs_world() => with_world(|w| meshtrain::plan::command::calibrate(w, args)),
        Command::Plan(args) => meshtrain::plan::command::main(args),
        Command::Tune(args) => meshtrain::plan::tune::main(args),
    };
    if let Err(e) = result {
        fail(&e);
    }
}
