"""Seconds per round of the sequential path on a CPU: plain vs ``retain-freed-memory`` vs that and
``skip-padding-taps``, and two runs at once on one thread each, for the paper's cells (bs 32 τ 2,
bs 128 τ 1, full batch τ 1).

The round is the one benchmarks/vectorized.py times (``clients.training.local_update`` for each of
the K_c clients in turn, the same θ, shards and batch orders). The allocator setting lasts for a
process, so every (variant, cell) runs in a fresh process, as a run's client process would; the
variants alternate, ``--repeats`` times each, and the medians are compared. Each line prints the
page faults per round too: with glibc's own thresholds they vary from process to process.

    plain      glibc's defaults, every convolution tap (the sequential path before these keys)
    retain     retain-freed-memory = true: freed memory stays in the process
    retain+live  and skip-padding-taps = true: convolutions skip taps that read only padding
    2runs-1thread  retain+live in two processes at once with --threads / 2 threads each, as
                 `fedmask-sweep GRID --ray-address local --run-cpus 1` runs a sweep on 2 cores; its
                 s/round is the span of both timed sections over the rounds both ran (a sweep's
                 seconds per round)

The last line is the bs-32 speed-up, plain / the last variant.

    python benchmarks/cpu_speedups.py --data-dir ../shared/data
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from vectorized import CELLS, make_shards, sequential_round

from clients.training import LocalTraining
from fedmask_app.run.device import retain_freed_memory
from fedmask_app.run.model import build_model, initial_parameters

VARIANTS = {"plain": (False, False), "retain": (True, False), "retain+live": (True, True),
            "2runs-1thread": (True, True)}
CONCURRENT = {"2runs-1thread": 2}  # processes at once


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="../shared/data", help="folder with cifar10.npz (else synthetic data)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in every process")
    parser.add_argument("--clients", type=int, default=10, help="K_c, clients per round")
    parser.add_argument("--samples", type=int, default=500, help="examples per client")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per process, after one warm-up round")
    parser.add_argument("--repeats", type=int, default=2, help="processes per variant and cell")
    parser.add_argument("--cells", nargs="+", choices=[c[0] for c in CELLS], default=[c[0] for c in CELLS])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--worker", nargs=2, metavar=("VARIANT", "CELL"), help=argparse.SUPPRESS)
    parser.add_argument("--barrier", nargs=2, metavar=("FOLDER", "COUNT"), help=argparse.SUPPRESS)
    return parser.parse_args()


def worker(args: argparse.Namespace) -> None:
    """One process: one variant, one cell; prints its seconds and page faults per round as JSON."""
    variant, cell = args.worker
    retain, live_taps = VARIANTS[variant]
    if retain and not retain_freed_memory():
        raise SystemExit("retain-freed-memory: this C library has no mallopt")
    torch.set_num_threads(args.threads)
    args.device, args.channels_last = "cpu", False
    shards, _ = make_shards(args, torch.device("cpu"))
    model = build_model("resnet18-gn", skip_padding_taps=live_taps)
    theta = initial_parameters("resnet18-gn", 0)
    _, batch_size, epochs = next(c for c in CELLS if c[0] == cell)
    training = LocalTraining(epochs=epochs, batch_size=batch_size, lr=0.01)
    sequential_round(model, theta, shards, training)  # warm-up
    if args.barrier:  # concurrent workers start their timed rounds together
        folder, count = Path(args.barrier[0]), int(args.barrier[1])
        (folder / str(os.getpid())).touch()
        while len(list(folder.iterdir())) < count:
            time.sleep(0.01)
    seconds, faults = [], []
    first_started = time.time()
    for _ in range(args.rounds):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        started = time.perf_counter()
        sequential_round(model, theta, shards, training)
        seconds.append(time.perf_counter() - started)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(json.dumps({"seconds": seconds, "faults": faults, "span": [first_started, time.time()]}))


def run_worker(args: argparse.Namespace, variant: str, cell: str) -> dict:
    """One process (or, for a CONCURRENT variant, several at once sharing the threads)."""
    count = CONCURRENT.get(variant, 1)
    command = [sys.executable, __file__, "--worker", variant, cell, "--data-dir", args.data_dir,
               "--threads", str(max(1, args.threads // count)), "--clients", str(args.clients),
               "--samples", str(args.samples), "--rounds", str(args.rounds)]
    with tempfile.TemporaryDirectory(prefix="fedmask-cpu-barrier-") as barrier:
        if count > 1:
            command += ["--barrier", barrier, str(count)]
        procs = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for _ in range(count)]
        outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"{variant} {cell}: a worker failed (exit codes {[p.returncode for p in procs]})")
    measured = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    if count == 1:
        return measured[0]
    # From the barrier to the last process's end over the rounds all ran; a process that finishes
    # first leaves the others alone on the cores for a while, so this errs against the variant.
    span = max(m["span"][1] for m in measured) - min(m["span"][0] for m in measured)
    return {"seconds": [span / (count * args.rounds)], "faults": [sum(f for m in measured for f in m["faults"])]}


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    print(f"# resnet18-gn, K_c={args.clients}, n_k={args.samples}, threads={args.threads}, CPU, "
          f"{args.repeats} processes x {args.rounds} rounds per variant and cell (medians)")
    speedups = {}
    for cell in args.cells:
        results = {v: {"seconds": [], "faults": []} for v in args.variants}
        for _ in range(args.repeats):
            for variant in args.variants:
                measured = run_worker(args, variant, cell)
                for key in results[variant]:
                    results[variant][key].extend(measured[key])
        medians = {v: statistics.median(r["seconds"]) for v, r in results.items()}
        first = args.variants[0]
        for variant in args.variants:
            faults = results[variant]["faults"]
            print(f"{cell} {variant}: {medians[variant]:.2f} s/round (speed-up over {first} "
                  f"{medians[first] / medians[variant]:.2f}x; page faults per round {min(faults)}-{max(faults)})",
                  flush=True)
        speedups[cell] = medians[first] / medians[args.variants[-1]]
    if "bs32-tau2" in speedups:
        print(f"bs32-tau2 speed-up ({args.variants[0]} / {args.variants[-1]}): {speedups['bs32-tau2']:.2f}")


if __name__ == "__main__":
    main()
