# Two entry points for a fresh Debian/Ubuntu machine; each installs what is missing first.
#   make demo   - a small 3D-parallel training run on 8 CPU ranks (TP2 x PP2 x DP2)
#   make test   - the whole test suite (what CI runs)
#   make slurm-test - a throw-away Slurm on this machine (root): sweeps under srun, SIGUSR1 requeue
#   make gpu-bundle - one directory to copy onto a bare GPU node and run there: bash run.sh
#                     (benches/README.md; GPU_BUNDLE=dir picks where)
SHELL := /bin/bash
RANKS ?= 8
MPIRUN ?= mpirun --oversubscribe $(if $(filter 0,$(shell id -u)),--allow-run-as-root,)
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
APT_PACKAGES := build-essential pkg-config libclang-dev libopenmpi-dev openmpi-bin libopenblas-dev libhdf5-dev hdf5-tools python3-h5py libfabric-dev libfabric-bin fonts-dejavu-core
SLURM_PACKAGES := slurmctld slurmd slurm-client munge
export HDF5_DIR ?= /usr/lib/x86_64-linux-gnu/hdf5/serial
GPU_BUNDLE ?= target/gpu-bundle/meshtrain-gpu

.PHONY: deps rust build release demo test bench slurm-test gpu-bundle

deps: rust
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $$missing; \
	fi

rust:
	@command -v cargo >/dev/null 2>&1 || [ -x "$$HOME/.cargo/bin/cargo" ] || { \
	  echo "cargo not found: installing Rust with rustup"; \
	  curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal; }

build: deps
	PATH="$$HOME/.cargo/bin:$$PATH" cargo build --release

demo: build
	$(MPIRUN) --bind-to none -np $(RANKS) target/release/meshtrain train jobs/demo.toml --metrics out/demo.jsonl

test: deps
	PATH="$$HOME/.cargo/bin:$$PATH" cargo test --release -- --test-threads=1

# meshtrain's collectives, MPI's inside meshtrain and the standalone MPI program (benches/mpi_coll.c)
# on 2 and 4 ranks, alternating, medians and spread of BENCH_ROUNDS runs (benches/README.md).
BENCH_ROUNDS ?= 3
bench: build target/bench/mpi_coll
	python3 benches/mpi_compare.py --ranks 2,4 --rounds $(BENCH_ROUNDS) --min 4K --max 64M --factor 4 --markdown

target/bench/mpi_coll: benches/mpi_coll.c
	mkdir -p target/bench && mpicc -O2 -Wall -o $@ $<

slurm-test: build
	@dpkg -s $(SLURM_PACKAGES) >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $(SLURM_PACKAGES); }
	$(SUDO) bash tests/slurm/ci.sh

gpu-bundle: deps
	PATH="$$HOME/.cargo/bin:$$PATH" bash benches/bundle/build.sh $(GPU_BUNDLE)
