#!/usr/bin/env python3
"""Runs `meshtrain bench --vs-mpi` and the standalone MPI benchmark (benches/mpi_coll.c) in
alternation, several rounds per world size, and prints per collective and size the median and
spread (min-max) of: meshtrain's time, MPI's time measured inside meshtrain, MPI's time from the
standalone program, the agreement of the two MPI columns (inside / standalone) and meshtrain's
speedup over the standalone program (the honest baseline). For the collectives that only move
data (all-gather, broadcast, all-to-all) also meshtrain's copy floor (every rank copying the bytes
the collective brings it, at once, in the same run) and the fraction of it meshtrain reaches
(floor / meshtrain time; 1.00 = as fast as a plain copy of the same bytes).

Pages: the meshtrain binary puts every buffer of 2 MiB or more on transparent huge pages
(src/mem.rs); the standalone program does the same by default, so that both time the same memory.
`--pages both` also runs the standalone program on malloc'd buffers (`--pages small`: 4 KiB pages
where the kernel's huge pages are in `madvise` mode) and reports meshtrain's speedup over that
too: what a plain MPI program's buffers cost, not a difference between the collectives.

Why alternate: the machine may be shared; alternating rounds spreads any load over both programs
rather than over one. Ratios are of medians over the same rounds.

usage: mpi_compare.py [--ranks 2,4] [--rounds 3] [--min 4K] [--max 64M] [--factor 4]
                      [--colls all] [--meshtrain target/release/meshtrain]
                      [--baseline target/bench/mpi_coll] [--pages huge|both]
                      [--csv OUT.csv] [--markdown]
"""
import argparse
import csv
import io
import os
import statistics
import subprocess
import sys


def mpirun(ranks):
    # Both programs get the same binding: one core per rank where the ranks fit (Open MPI's own
    # default for up to 2 ranks), none when they oversubscribe the cores. Unbound, meshtrain's
    # ranks (which sleep on a futex when they wait) are often woken onto the waker's core and
    # then share one core for a whole run: 4 KiB collectives on 2 ranks took ~5 us instead of
    # ~1.6 us in most unbound runs here, never when bound; MPI's ranks poll without sleeping and
    # are spread by the scheduler either way.
    bind = "core" if ranks <= (os.cpu_count() or 1) else "none"
    cmd = ["mpirun", "--bind-to", bind, "-np", str(ranks)]
    if os.geteuid() == 0:
        cmd[1:1] = ["--allow-run-as-root", "--oversubscribe"]
    return cmd


# The MCA settings meshtrain's bootstrap makes on one node (src/bootstrap/mpi_defaults.rs) unless
# the user set them: the standalone program runs under the same ones, so that both MPI columns
# time the same MPI configuration (without them the standalone program also opens the TCP BTL).
SAME_MCA = {"OMPI_MCA_btl": "self,vader", "OMPI_MCA_pml": "ob1"}


def standalone_env():
    env = dict(os.environ)
    for k, v in SAME_MCA.items():
        env.setdefault(k, v)
    return env


def run_csv(cmd, env=None):
    """Runs cmd, returns its CSV rows (lines after the header that starts with `coll,`)."""
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"mpi_compare: `{' '.join(cmd)}` failed (exit {p.returncode}):\n{p.stderr[-2000:]}")
    lines = p.stdout.splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith("coll,")), None)
    if start is None:
        sys.exit(f"mpi_compare: `{' '.join(cmd)}` printed no CSV header")
    return list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))


def spread(xs):
    return statistics.median(xs), min(xs), max(xs)


def fmt_size(b):
    for unit, s in (("M", 20), ("K", 10)):
        if b >= 1 << s and b % (1 << s) == 0:
            return f"{b >> s}{unit}"
    return str(b)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min", default="4K")
    ap.add_argument("--max", default="64M")
    ap.add_argument("--factor", default="4")
    ap.add_argument("--iters", default="20")
    ap.add_argument("--warmup", default="5")
    ap.add_argument("--iter-bytes", default="256M", help="more timed calls for small sizes (both programs' rule)")
    ap.add_argument("--colls", default="all")
    ap.add_argument("--meshtrain", default="target/release/meshtrain")
    ap.add_argument("--baseline", default="target/bench/mpi_coll")
    ap.add_argument("--pages", choices=["huge", "both"], default="huge",
                    help="both: also time the standalone program on malloc'd (small-page) buffers")
    ap.add_argument("--csv", help="also write every measurement here")
    ap.add_argument("--markdown", action="store_true", help="print markdown tables")
    a = ap.parse_args()
    if a.rounds < 1:
        sys.exit("mpi_compare: --rounds must be >= 1")
    sweep = ["--min", a.min, "--max", a.max, "--factor", a.factor, "--iters", a.iters, "--warmup", a.warmup, "--iter-bytes", a.iter_bytes]
    raw = []  # (ranks, round, coll, bytes, meshtrain_us, inside_us, standalone_us, copy_us, small_pages_us)
    for ranks in [int(r) for r in a.ranks.split(",")]:
        for rnd in range(a.rounds):
            mt_cmd = mpirun(ranks) + [a.meshtrain, "bench", a.colls, "--vs-mpi", "--csv"] + sweep
            sa_cmd = mpirun(ranks) + [a.baseline, a.colls, "--pages", "huge"] + sweep
            order = [("mt", mt_cmd), ("sa", sa_cmd)]
            if a.pages == "both":
                order.append(("small", mpirun(ranks) + [a.baseline, a.colls, "--pages", "small"] + sweep))
            if rnd % 2:
                order.reverse()
            env = {"mt": None, "sa": standalone_env(), "small": standalone_env()}
            got = {name: run_csv(cmd, env[name]) for name, cmd in order}
            times = lambda rows: {(r["coll"], int(r["bytes"])): float(r["mpi_time_us"]) for r in rows}
            sa, small = times(got["sa"]), times(got.get("small", []))
            for r in got["mt"]:
                key = (r["coll"], int(r["bytes"]))
                if r["wrong"] != "0":
                    sys.exit(f"mpi_compare: meshtrain reported {r['wrong']} wrong elements at {key}")
                inside = float(r["mpi_time_us"]) if r["mpi_time_us"] else float("nan")
                copy = float(r["copy_us"]) if r.get("copy_us") else float("nan")
                nan = float("nan")
                raw.append((ranks, rnd, key[0], key[1], float(r["time_us"]), inside, sa.get(key, nan), copy, small.get(key, nan)))
            print(f"# {ranks} ranks: round {rnd + 1}/{a.rounds} done", file=sys.stderr)
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["ranks", "round", "coll", "bytes", "meshtrain_us", "mpi_inside_us", "mpi_standalone_us", "copy_floor_us", "mpi_small_pages_us"])
            w.writerows(raw)
    report(raw, a.markdown)


def report(raw, markdown):
    keys = []
    for r in raw:
        if (r[0], r[2], r[3]) not in keys:
            keys.append((r[0], r[2], r[3]))
    with_small = any(r[8] == r[8] for r in raw)
    head = ["ranks", "coll", "size", "meshtrain us", "MPI inside us", "MPI standalone us", "inside/standalone", "speedup vs standalone", "copy floor us", "of copy floor"]
    if with_small:
        head += ["MPI small pages us", "speedup vs small pages"]
    print(("| " + " | ".join(head) + " |\n|" + "---|" * len(head)) if markdown else ",".join(head))
    for ranks, coll, size in keys:
        rows = [r for r in raw if (r[0], r[2], r[3]) == (ranks, coll, size)]
        mt, ins, sa, cp, sm = (spread([r[i] for r in rows]) for i in (4, 5, 6, 7, 8))
        cell = lambda s: f"{s[0]:.1f} ({s[1]:.1f}-{s[2]:.1f})"
        agree = ins[0] / sa[0] if sa[0] > 0 else float("nan")
        speed = sa[0] / mt[0] if mt[0] > 0 else float("nan")
        floor = ["", ""] if cp[0] != cp[0] else [cell(cp), f"{cp[0] / mt[0]:.2f}"]
        cells = [str(ranks), coll, fmt_size(size), cell(mt), cell(ins), cell(sa), f"{agree:.2f}", f"{speed:.2f}x"] + floor
        if with_small:
            cells += [cell(sm), f"{sm[0] / mt[0]:.2f}x"]
        print(("| " + " | ".join(cells) + " |") if markdown else ",".join(cells))


if __name__ == "__main__":
    main()
