#!/bin/bash
# Weak-scaling sweep of the collective benchmark: one job per node count.
# Usage: slurm/sweep-collectives.sh <account> [node counts...]   (default 1 2 4 8 16)
# When the jobs are done, plot bus bandwidth over size, one line per node count:
#   target/release/meshtrain sweep bench "1 node=bench-<job1>/all_reduce.csv" \
#     "2 nodes=bench-<job2>/all_reduce.csv" ... --out bench-plots
set -euo pipefail
ACCOUNT=${1:?usage: $0 <account> [nodes...]}; shift
NODES=${*:-1 2 4 8 16}
here=$(cd "$(dirname "$0")" && pwd)
for n in $NODES; do
  sbatch -A "$ACCOUNT" -N "$n" -J "meshtrain-bench-n$n" "$here/bench-collectives.sbatch"
done
