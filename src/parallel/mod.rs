//! Parallelism over the 3D process grid: the grid itself, data, tensor and pipeline parallelism.
//!
//! [`grid`] maps ranks to (tp, pp, dp) coordinates and builds the axis communicators; [`schedule`]
//! holds the pipeline schedules as pure functions of (schedule, rank, stages, micro-batches) and
//! [`stage_split`] the split of the blocks into pipeline stages; the modules that execute them own
//! the communicators and buffers.
//!
//! # Layouts in detail
//!
//! #### Tensor and sequence parallelism
//!
//! `parallel.tp` splits every block Megatron-style: qkv (viewed as (3, C, C) so each rank keeps the
//! q, k and v rows of its heads) and mlp.fc column-parallel, attn.proj and mlp.proj row-parallel
//! followed by an all-reduce (bias added once after it), the tied embedding vocab-parallel (lookup
//! all-reduced) and a vocab-parallel cross-entropy that exchanges only row maxima and sums, never
//! logits. `parallel.sequence_parallel = true` turns the row-parallel all-reduces into
//! reduce-scatters along the B·T rows and all-gathers them before the column-parallel linears;
//! LayerNorm and other replicated gradients are then all-reduced over the TP group. The world is a
//! grid TP x PP x DP (`parallel.order`, innermost first, default `tp-pp-dp` so TP ranks share a node);
//! each axis has its own communicator, built by `split`, and rank 0 prints the grid. The global
//! gradient norm counts a tensor replicated over TP once.
//!
//! #### Pipeline parallelism
//!
//! Each of the `parallel.pp` ranks runs `parallel.virtual_stages` model chunks (more than one only
//! with `parallel.schedule = "interleaved"`): the blocks are cut into `pp x virtual_stages` global
//! stages, chunk c of rank r being stage c*pp + r, and a rank keeps all its chunks in one flat
//! parameter buffer. The default split balances estimated training FLOPs
//! (`src/parallel/stage_split.rs`): a block costs 72C^2 + 12CT per token, the last stage's head (final
//! LayerNorm, tied logits, cross-entropy) 6C*Vp, i.e. Vp / (12C + 2T) blocks: 0.05 at the bubble
//! benchmark's shape (so its 4 blocks still split 2/2), 4.5 for GPT-2 small (12 blocks on 4 stages
//! split 4/4/3/1). `parallel.stage_layers = [..]` overrides it (one count >= 1 per global stage, in
//! stage order, summing to `model.n_layer`); rank 0 prints the split. `parallel.schedule` (`gpipe`,
//! `1f1b`, `interleaved`) and `parallel.microbatches` give each rank its action list (forward,
//! backward, send and receive of activations and their gradients, per chunk) from
//! `src/parallel/schedule.rs`, pure functions that a simulator checks for dependency order, deadlock
//! freedom under blocking sends (p 1..8, m 1..16, v 1..4) and the bubble fraction: (p-1)/(m+p-1) for
//! GPipe and 1F1B, exact at backward = 1x and 2x forward; (p-1)/(v*m+p-1) for interleaved
//! (Megatron-LM's compute order), exact at backward = 2x forward over buffered links, whose message
//! order it is tuned for (up to 33% longer at equal times, 43% under blocking sends). Interleaved needs
//! `microbatches` to be a multiple of `pp` and a block for every stage; a layout that cannot run is
//! rejected before start, naming the key. Every rank reads the same micro-batches; the loss comes from the model's last chunk; the tied
//! embedding lives on the first and last rank and its gradient is summed between them, so both copies
//! stay equal. A step consumes `grad_accum x microbatches` micro-batches per data-parallel rank.
//! A stage keeps activations only for the micro-batches its schedule has in flight: each forward
//! takes a free activation slot of its chunk and the backward frees it, so 1F1B holds p - rank
//! slots per chunk (not m), GPipe m, and interleaved a count set by p and v, not by m
//! (`src/train/pipeline.rs`, tested for every rank of p = 4, m = 8).
//!
//! | layout (tested in CI against one rank, 20 steps: losses within 1e-5 relative at every step, final parameters within 1e-5 relative L2 over the model and 5e-5 per tensor) | ranks |
//! |---|---|
//! | DP2 (with accumulation), DP4 ZeRO-1, DP2 ZeRO-1 with accumulation, DP4 ZeRO-2, DP4 ZeRO-3, DP2 ZeRO-3 with accumulation | 2-4 |
//! | TP2, TP4, TP2 + SP | 2-4 |
//! | TP2 x DP2 ZeRO-1, TP2 x DP2 ZeRO-3, TP2 + SP x DP2 ZeRO-2 | 4 |
//! | PP2 GPipe, PP2 1F1B (with accumulation), PP4 1F1B | 2-4 |
//! | PP2 and PP4 interleaved (2 chunks per rank, 8 blocks; one tensor drifts 1.5e-5 at that depth in every reordering layout, DP2 included), TP2 x PP2 interleaved, PP2 interleaved with uneven `stage_layers`, PP2 x DP2 ZeRO-3 interleaved | 2-4 |
//! | TP2 x PP2, PP2 x DP2 ZeRO-1, PP2 x DP2 ZeRO-3 GPipe with accumulation, TP2 x PP2 x DP2 ZeRO-1, TP2 x PP2 x DP2 ZeRO-3 | 4-8 |
//! | resume DP2 ZeRO-1 -> DP4 ZeRO-0, TP2 x PP2 -> DP2 ZeRO-1, DP2 ZeRO-3 -> TP2 + SP x DP2 ZeRO-2, PP2 interleaved -> PP2 1F1B with stages of 3 and 1 blocks, from a checkpoint (same layout: bit for bit) | 2-4 |
//!
//! The final parameters are compared through the step-20 checkpoint, exported at global shapes. The key
//! third of each `attn.qkv.bias` is left out of that comparison: its gradient is zero in exact
//! arithmetic (a constant added to every key's score leaves the softmax unchanged), so it receives
//! rounding noise that AdamW normalises into steps of about lr, with signs that depend on summation
//! order; two correct layouts disagree there at the 1e-4 level. Each tensor alone may differ by 5x the model-wide bound:
//! a tensor with many near-zero gradient components collects AdamW-amplified rounding noise that
//! depends on the summation order and on the BLAS kernels the CPU selects (`h.1.attn.proj.weight`
//! of TP2 lands at 1.12e-5 on one Xeon and below 1e-5 on another); a wrong gradient moves a tensor
//! by orders of magnitude more.
//!
//! The demo (`jobs/demo.toml`: tiny model, synthetic Markov data whose entropy floor is 1.09 nats,
//! 2-way tensor x 2-stage pipeline (1F1B, 2 micro-batches) x 2-way data parallel with ZeRO-1 on 8
//! ranks) goes from loss 5.55 to 1.16 (validation 1.18) in 300 steps, about 20 s here — the same
//! losses as a 4-rank data-parallel run of the same global batch.
//!
//! #### Data parallelism
//!
//! Every layout on every device arm trains one executor (`src/model/device_gpt.rs`, the CPU arm's
//! kernels in fp32 or bf16 included) and one step (`src/train/device_step.rs`): the loop never
//! branches on the device or the precision. Gradients are cut into buckets of `parallel.bucket_mb`
//! MiB (fractions allowed) from the end of the flat layout backwards, the order in which backward
//! finishes them. The executor hands each unit's gradients over as soon as they are final (the final
//! LayerNorm, then each block in reverse, then the tied embedding, which also gets the head's
//! gradient; a pipeline stage: its whole buffer after the round). Where the buckets are reduced is
//! chosen once, by the memory the model lives in:
//!
//! - host memory (`device = "cpu"`): each unit is staged into its buckets and every complete bucket
//!   goes to a communication thread with its own communicator, reduced while the backward continues;
//! - device memory (`cuda`, `hip`, `emu`): the device collectives (peer memory within a node,
//!   stream-ordered small calls, libfabric rings or staging between nodes), after the step's last
//!   backward, or unit by unit during the backward at ZeRO-2/3.
//!
//! With gradient accumulation only the last micro-batch communicates (ZeRO-0/1). ZeRO-0 updates the
//! model's own tensors in place (AdamW moments per tensor, no flat copies). ZeRO-1 reduce-scatters
//! each bucket into this rank's block of it, runs AdamW on those blocks (master weights, moments and
//! reduced gradients are only those blocks) and all-gathers the updated parameters. ZeRO-2 also stops
//! holding the full gradient: every micro-batch's backward hands each unit over, and the unit's
//! gradient buffers are freed once reduced. ZeRO-3 also shards the parameters: between uses a rank
//! keeps only its block of every bucket (buckets never straddle a unit: `wte`, `wpe`, a block,
//! `lnf`), and the executor all-gathers a unit's tensors right before the layer reads them and frees
//! the others. The optimizer state and checkpoints see the same flat offsets in every stage.
//!
//! | ZeRO | per rank resident (fp32, Ψ params on the rank, N data-parallel ranks) |
//! |---|---|
//! | 0 | params 4Ψ, grads 4Ψ, AdamW 8Ψ, staging 4Ψ (host) or one bucket (device) |
//! | 1 | params 4Ψ + master 4Ψ/N, grads 4Ψ + shard 4Ψ/N (+ 4Ψ/N host), AdamW 8Ψ/N, staging |
//! | 2 | params 4Ψ + master 4Ψ/N, grads live + shard 4Ψ/N (+ 4Ψ/N host), AdamW 8Ψ/N, staging |
//! | 3 | params 8Ψ/N + one layer's units, grads live + shard 4Ψ/N (+ 4Ψ/N host), AdamW 8Ψ/N, staging |
//!
//! "live" is the gradient not yet reduced during backward (the tied `wte`, written by the head and
//! final after the embedding, plus the largest block; a pipeline stage keeps all of its gradients);
//! "staging" is the device step's bucket and block buffers plus, on the host, the reducer's 4 largest
//! buckets (`src/train/memory_estimate.rs`).
//! `meshtrain train` prints each term before step 0. The JSONL carries `comm_s` (time spent reducing
//! gradients) and `comm_exposed_s` (time the step waited for it after backward); pipeline runs add `bubble_s` and
//! `pipeline_s` (idle and total time of the step's pipeline rounds on pipeline rank 0),
//! `stage_forward_s` / `stage_backward_s` (every pipeline rank's compute) and `bubble_sim_s` /
//! `pipeline_sim_s` (rank 0's idle and the round when the schedule is simulated with those compute
//! times over buffered links with free transfers: what imbalance alone explains); `collectives`
//! gives, per group (`tp`, `pp`, `dp`, and `dp_buckets` for the host reducer's thread) and operation, the step's calls, bytes, time and
//! bus bandwidth as seen by rank 0.
//!

pub mod grid;
pub mod options;
pub mod schedule;
pub mod stage_split;
