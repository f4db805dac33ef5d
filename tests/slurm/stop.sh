#!/usr/bin/env bash
# Ends the cluster of tests/slurm/start.sh: cancels its jobs, stops its slurmd and slurmctld (by the pids
# in their pid files) and leaves munged running (other users of munge may exist).
STATE=${STATE:-/tmp/meshtrain-slurm}
export SLURM_CONF=$STATE/slurm.conf
[ -f "$SLURM_CONF" ] && scancel --full --quiet -u root 2>/dev/null
for f in "$STATE"/run/slurmd-*.pid "$STATE"/run/slurmctld.pid; do
  [ -f "$f" ] || continue
  pid=$(cat "$f")
  kill "$pid" 2>/dev/null
  for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  kill -9 "$pid" 2>/dev/null
  rm -f "$f"
done
exit 0
