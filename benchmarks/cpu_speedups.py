"""Seconds per round on a CPU for the paper's cells (bs 32 τ 2, bs 128 τ 1, full batch τ 1; bs 32 at τ 1
and τ 5 with ``--cells bs32-tau1 bs32-tau5``), run as a user runs them: the local engine and the Flower
simulation, each with and without ``skip-padding-taps``, side by side in one run.

    local          fedmask-local: the cohort's clients one after another, torch on all --threads
    local+live     the same with skip-padding-taps = true (convolutions skip taps that read only padding)
    local-2x1      fedmask-local with client-processes = 2: the cohort's clients in two worker
                   processes, one torch thread each on the 2-core machine (threads = 0 shares the
                   CPUs among them)
    local-2x1+live the same with skip-padding-taps = true
    flower         fedmask-run: Flower's Ray simulation, one-CPU virtual clients (--num-cpus 1), so
                   as many clients train at once, one thread each, as the machine has cores
    flower+live    the same with skip-padding-taps = true
    sweep-2x1      fedmask-sweep of two runs (seeds 0 and 1) with --ray-address local --run-cpus 1:
                   both runs at once on the local engine, one thread each, as a sweep of the
                   paper's grids runs on a 2-core machine
    sweep-2x1+live the same with skip-padding-taps = true

Each variant is a real run of the paper's shards (K = 100, K_c = 10, α = 100) for ``--rounds``
rounds without evaluation; its figure is the median of rounds.csv's ``seconds`` over rounds 2 on
(round 1 pays start-up costs). A sweep variant's figure is that median over both runs divided by
2, the runs it trains at once: its seconds per round of the sweep (both runs start together and
train the same amount). The variants alternate, ``--repeats`` times each. Speed-ups are over
``local`` (over the first variant given when ``local`` is not among them); the last lines are the
bs-32 speed-ups of the fastest variant, a line per bs-32 cell.

    python benchmarks/cpu_speedups.py --data-dir ../shared/data
"""

from __future__ import annotations

import argparse
import csv
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CELLS = {"bs32-tau2": (32, 2), "bs128-tau1": (128, 1), "full-tau1": ("full", 1),
         "bs32-tau1": (32, 1), "bs32-tau5": (32, 5)}  # the last two only when named in --cells
DEFAULT_CELLS = ["bs32-tau2", "bs128-tau1", "full-tau1"]
LIVE = {"skip-padding-taps": "true"}
VARIANTS = {
    "local": ("fedmask-local", {}),
    "local+live": ("fedmask-local", LIVE),
    "local-2x1": ("fedmask-local", {"client-processes": 2}),
    "local-2x1+live": ("fedmask-local", {"client-processes": 2, **LIVE}),
    "flower": ("fedmask-run", {}),
    "flower+live": ("fedmask-run", LIVE),
    "sweep-2x1": ("fedmask-sweep", {}),
    "sweep-2x1+live": ("fedmask-sweep", LIVE),
}
SWEEP_RUNS = 2  # seeds 0 and 1, trained at once


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="../shared/data", help="folder with cifar10.npz")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per run (the first is not counted)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per variant and cell")
    parser.add_argument("--cells", nargs="+", choices=list(CELLS), default=DEFAULT_CELLS)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (round 1 is not counted)")
    return args


def run_seconds(args: argparse.Namespace, variant: str, cell: str, out: Path, name: str) -> list[float]:
    """One run (a sweep variant: one sweep) of ``variant`` on ``cell``; rounds.csv's seconds of
    rounds 2 on, divided by the runs trained at once."""
    command, overrides = VARIANTS[variant]
    executable = shutil.which(command) or sys.exit(f"{command} is not on PATH: pip install -e . first")
    batch_size, epochs = CELLS[cell]
    values = {"num-rounds": args.rounds, "eval-every": 0, "checkpoint-every": 0,
              "batch-size": '"full"' if batch_size == "full" else batch_size, "local-epochs": epochs,
              "data-dir": f'"{Path(args.data_dir).resolve()}"', **overrides}
    if command == "fedmask-sweep":
        folder = out / name
        folder.mkdir(parents=True)
        grid = folder / "grid.toml"
        grid.write_text("[base]\n" + "".join(f"{k} = {v}\n" for k, v in values.items())
                        + f"[axes]\nseed = {list(range(SWEEP_RUNS))}\n")
        argv = [str(grid), "--output-dir", str(folder), "--ray-address", "local", "--run-cpus", "1"]
        concurrent = SWEEP_RUNS
    else:
        folder, concurrent = out, 1
        argv = [f"{k}={v}" for k, v in {**values, "output-dir": f'"{out}"', "run-name": f'"{name}"'}.items()]
    done = subprocess.run([executable, *argv], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{variant} {cell} failed (exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    rounds_files = [folder / name / "rounds.csv"] if concurrent == 1 else sorted(folder.glob("*/rounds.csv"))
    if len(rounds_files) != concurrent:
        sys.exit(f"{variant} {cell}: expected {concurrent} rounds.csv under {folder}, found {len(rounds_files)}")
    seconds = []
    for path in rounds_files:
        with path.open(newline="") as f:
            seconds += [float(row["seconds"]) / concurrent for row in csv.DictReader(f) if int(row["round"]) >= 2]
    return seconds


def main() -> None:
    args = parse_args()
    print(f"# CPU, resnet18-gn, paper shards (K_c = 10 of 100, α = 100), {args.rounds} rounds per run "
          f"(median s/round of rounds 2-{args.rounds}), {args.repeats} run(s) per variant and cell", flush=True)
    base = "local" if "local" in args.variants else args.variants[0]  # what the speed-ups are over
    best = {}
    with tempfile.TemporaryDirectory(prefix="fedmask-cpu-speedups-") as scratch:
        for cell in args.cells:
            seconds = {v: [] for v in args.variants}
            for repeat in range(args.repeats):
                for variant in args.variants:
                    seconds[variant] += run_seconds(args, variant, cell, Path(scratch),
                                                  f"{cell}-{variant.replace('+', '_')}-{repeat}")
            medians = {v: statistics.median(s) for v, s in seconds.items()}
            for variant, median in medians.items():
                print(f"{cell:10s} {variant:15s} {median:6.2f} s/round  speed-up over {base} "
                      f"{medians[base] / median:.2f}x", flush=True)
            fastest = min(medians, key=medians.get)
            best[cell] = (fastest, medians[base] / medians[fastest])
    for cell, (fastest, speedup) in best.items():
        if cell.startswith("bs32-"):
            print(f"{cell} speed-up of the fastest ({fastest}) over {base}: {speedup:.2f}")


if __name__ == "__main__":
    main()
