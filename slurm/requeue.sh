# Sourced by the train-*.sbatch scripts: one training step (srun) that survives the time limit.
#
#   #SBATCH --signal=B:USR1@120 --requeue
#   source slurm/requeue.sh
#   train_requeue JOB.toml STEPS CKPT_DIR METRICS_PREFIX [srun options...] -- [train options...]
#
# Slurm signals the batch shell (B:) 120 s before the limit; the trap forwards SIGUSR1 through srun
# to every rank, meshtrain finishes the step, writes a checkpoint and exits 0 on all ranks, and the
# script requeues the job unless the last step was reached. Every run resumes from CKPT_DIR/latest
# when it exists; metrics go to METRICS_PREFIX-<restart>.jsonl (one file per run of the job).
train_requeue() {
  local job=$1 steps=$2 ckpt=$3 metrics=$4
  shift 4
  local srun_opts=() train_opts=()
  while (($#)) && [ "$1" != -- ]; do srun_opts+=("$1"); shift; done
  (($#)) && shift
  train_opts=("$@")
  local resume=()
  if [ -f "$ckpt/latest" ]; then
    resume=(--set 'checkpoint.resume="latest"')
    echo "requeue: resuming from $ckpt/$(cat "$ckpt/latest") (restart ${SLURM_RESTART_COUNT:-0})"
  fi
  STOP_REQUESTED=0
  trap 'STOP_REQUESTED=1; echo "requeue: SIGUSR1, stopping after the current step"; kill -USR1 "$SRUN_PID" 2>/dev/null' USR1
  # --kill-on-bad-exit: a rank that fails (or dies during start-up) ends the whole step at once
  # instead of leaving the others waiting in MPI (options in SRUN_ARGS come later and win).
  srun --kill-on-bad-exit=1 "${srun_opts[@]}" "${BIN:?set BIN to the meshtrain binary}" train "$job" \
    --set train.steps="$steps" --set checkpoint.dir="\"$ckpt\"" "${resume[@]}" "${train_opts[@]}" \
    --metrics "$metrics-${SLURM_RESTART_COUNT:-0}.jsonl" &
  SRUN_PID=$!
  # `wait` returns early when the trap runs; wait again until srun itself has ended.
  local rc
  while :; do
    wait "$SRUN_PID"; rc=$?
    kill -0 "$SRUN_PID" 2>/dev/null || break
  done
  trap - USR1
  if [ "$rc" != 0 ]; then echo "requeue: srun failed ($rc)" >&2; return "$rc"; fi
  local done_step
  done_step=$(printf 'step_%08d' "$steps")
  if [ "$STOP_REQUESTED" = 1 ] && [ "$(cat "$ckpt/latest" 2>/dev/null)" != "$done_step" ]; then
    echo "requeue: stopped at $(cat "$ckpt/latest" 2>/dev/null); requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
  fi
}

# `--set` options of the layout from the environment: TP, PP, SP, ZERO, SCHEDULE, MICROBATCHES,
# DP (default: SLURM_NTASKS / (TP x PP)); only the ones given when none of TP/PP/DP is set.
layout_sets() {
  LAYOUT=()
  if [ -z "${TP:-}${PP:-}${DP:-}" ]; then return 0; fi
  local tp=${TP:-1} pp=${PP:-1}
  if (( SLURM_NTASKS % (tp * pp) != 0 )); then
    echo "layout: TP=$tp x PP=$pp does not divide $SLURM_NTASKS ranks" >&2; return 2
  fi
  local dp=${DP:-$((SLURM_NTASKS / (tp * pp)))}
  LAYOUT=(--set parallel.tp="$tp" --set parallel.pp="$pp" --set parallel.dp="$dp"
          --set parallel.sequence_parallel="${SP:-false}" --set parallel.zero="${ZERO:-0}"
          --set parallel.schedule="${SCHEDULE:-1f1b}" --set parallel.microbatches="${MICROBATCHES:-$((2 * pp))}")
  echo "layout: tp=$tp (sp=${SP:-false}) pp=$pp (${SCHEDULE:-1f1b}) dp=$dp zero=${ZERO:-0}"
}
