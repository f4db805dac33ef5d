#!/usr/bin/env bash
# SIGUSR1 requeue test on the cluster of tests/slurm/start.sh: slurm/train-cpu.sbatch (2 nodes x 1
# rank) is signalled mid-run the way `--signal=B:USR1@120` does it (to the batch shell), stops
# after a step with a checkpoint, requeues itself, resumes from `latest` and finishes. Its per-step
# losses (two runs) and final checkpoint must equal an uninterrupted run's bit for bit.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-$PWD/target/release/meshtrain}
WORK=${WORK:-$(mktemp -d /tmp/meshtrain-requeue.XXXXXX)}
STEPS=${STEPS:-120}
job=$WORK/job.toml
cat > "$job" <<JOB
device = "cpu"
[model]
size = "tiny"
[data]
source = "synthetic"
shuffle = true
seed = 5
[train]
steps = $STEPS
micro_batch = 8
seq_len = 64
seed = 11
log_every = 50
[optim]
lr = 2e-3
warmup_steps = 10
[parallel]
dp = 2
[checkpoint]
every = $STEPS
JOB
submit() { # name -> job id
  BIN=$BIN JOB=$job STEPS=$STEPS OUT=$WORK/$1 sbatch --parsable -J "$1" -N 2 --ntasks-per-node=1 \
    -o "$WORK/$1.out" slurm/train-cpu.sbatch
}
finished() { # job id -> 0 once it has left the queue
  [ -z "$(squeue -h -j "$1" -o %T 2>/dev/null)" ]
}
full=$(submit full)
while ! finished "$full"; do sleep 1; done

stop=$(submit stopped)
metrics=$WORK/stopped/metrics-0.jsonl
for _ in $(seq 1 600); do
  [ -f "$metrics" ] && [ "$(wc -l < "$metrics")" -ge 20 ] && break
  sleep 0.2
done
scancel --batch --signal=USR1 "$stop"
# Slurm holds a requeued batch job back for a while (reason BeginTime, ~1-2 min here). Release it
# once it has been pending for 3 s: slurmd refuses a launch whose credential is not newer (in whole
# seconds) than the revocation of the first run's.
pending=0
for _ in $(seq 1 900); do
  finished "$stop" && break
  if [ "$(squeue -h -j "$stop" -o %T)" = PENDING ]; then
    pending=$((pending + 1))
    [ "$pending" = 15 ] && scontrol update jobid="$stop" StartTime=now
  fi
  sleep 0.2
done
cat "$WORK/stopped.out"
grep -q "stopped by SIGUSR1 after step" "$WORK/stopped.out" || { echo "FAIL: the run was not stopped by SIGUSR1" >&2; exit 1; }
grep -q "requeue: resuming from" "$WORK/stopped.out" || { echo "FAIL: the job was not requeued and resumed" >&2; exit 1; }
[ -f "$WORK/stopped/metrics-1.jsonl" ] || { echo "FAIL: no second run" >&2; exit 1; }
first=$(wc -l < "$WORK/stopped/metrics-0.jsonl")
[ "$first" -lt "$STEPS" ] || { echo "FAIL: the first run was not cut short" >&2; exit 1; }

# (step, loss) as written (shortest round-trip decimal: equal text = equal bits).
losses() { python3 -c '
import json, sys
for f in sys.argv[1:]:
    for l in open(f):
        v = json.loads(l); print(v["step"], repr(v["loss"]))' "$@"; }
diff <(losses "$WORK/full/metrics-0.jsonl") <(losses "$WORK/stopped/metrics-0.jsonl" "$WORK/stopped/metrics-1.jsonl")
last=$(printf 'step_%08d' "$STEPS")
"$BIN" export "$WORK/full/ckpt/$last" "$WORK/full.h5" >/dev/null
"$BIN" export "$WORK/stopped/ckpt/$last" "$WORK/stopped.h5" >/dev/null
h5diff "$WORK/full.h5" "$WORK/stopped.h5"
echo "requeue: OK: stopped after step $first of $STEPS, requeued, resumed; losses and final checkpoint equal bit for bit"
