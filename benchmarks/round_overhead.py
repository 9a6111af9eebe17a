"""What a simulated round costs beyond its training, measured side by side in one run.

Workload: K_c = 10 clients a round, each 1 local epoch over 64 samples at bs 32, ResNet-18/GN,
real CIFAR-10, no evaluation. Timed three ways, each after warm-up rounds, median of the rest:
  (a) the bare loop: one process, model and data resident, the same rounds with no engine at
      all: the project's own client code (ClientTask.train) for the 10 clients one after
      another, then the project's own server step (aggregate_cohort: θ update and statistics).
      Its training alone is printed too. It runs before and after (b) and (c), and its median
      is over both, so a drift of the machine's speed during the run does not favour (b);
  (b) the same rounds through the Flower simulation (fedmask-run: flwr run --stream, Ray) with
      the speed-only transport (fast-simulation = true, the default), and (b0) without it
      (Flower's public API alone);
  (c) the same rounds through the local engine (fedmask-local's run_local).
(b) and (c) take the per-round wall time that rounds.csv records (train + aggregate + write).
The last line is the ratio b/a.

    python benchmarks/round_overhead.py --data-dir ../shared/data
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from fedmask_app.engines.flower.superlink import run_with_flower
from fedmask_app.engines.local import run_local
from fedmask_app.run.client_task import ClientTask
from fedmask_app.run.config import run_config_from_values
from fedmask_app.run.model import initial_parameters
from fedmask_app.run.results import is_complete
from strategies.aggregate import aggregate_cohort
from strategies.cohort import sample_cohort

WORKLOAD = {
    "num-clients": 10, "clients-per-round": 10, "max-shard-size": 64, "local-epochs": 1, "batch-size": 32,
    "eval-every": 0, "checkpoint-every": 0,
}


def config(args: argparse.Namespace, out: Path, name: str, threads: int, **extra):
    values = {**WORKLOAD, **extra, "max-shard-size": args.samples, "local-epochs": args.epochs,
              "num-rounds": args.warmup + args.rounds, "data-dir": str(Path(args.data_dir).resolve()),
              "output-dir": str(out), "run-name": name, "threads": threads}
    return run_config_from_values(values)


def bare_loop(cfg) -> tuple[list[float], list[float]]:
    """Seconds per round: (training + server step, training alone), warm-up rounds included."""
    task = ClientTask(cfg)
    params = [p.numpy() for p in initial_parameters(cfg.model, cfg.seed)]
    rounds, training = [], []
    for server_round in range(1, cfg.num_rounds + 1):
        started = time.perf_counter()
        cohort = sample_cohort(cfg.seed, server_round, range(cfg.num_clients), cfg.clients_per_round)
        replies = [task.train(pid, server_round, params, None) for pid in cohort]
        trained = time.perf_counter()
        params = aggregate_cohort(params, replies, cfg.aggregation, cfg.keep_prob).params
        rounds.append(time.perf_counter() - started)
        training.append(trained - started)
    return rounds, training


def round_seconds(cfg) -> list[float]:
    return pd.read_csv(cfg.run_dir / "rounds.csv")["seconds"].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="../shared/data")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8, help="timed rounds per engine (median reported)")
    parser.add_argument("--samples", type=int, default=64, help="samples per client (the issue's workload: 64)")
    parser.add_argument("--epochs", type=int, default=1, help="local epochs (the issue's workload: 1)")
    parser.add_argument("--num-cpus", type=int, default=1, help="CPUs per virtual client in the simulation")
    parser.add_argument("--threads", type=int, default=0, help="torch threads of the bare loop and local engine "
                        "(0: all cores)")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="fedmask-bench-"))

    bare, bare_training = [], []

    def run_bare() -> None:
        rounds, training = bare_loop(config(args, out, "bare", args.threads))
        bare.extend(rounds[args.warmup:])
        bare_training.extend(training[args.warmup:])

    run_bare()

    local_cfg = config(args, out, "local", args.threads)
    run_local(local_cfg, echo=lambda _: None)
    local = round_seconds(local_cfg)[args.warmup:]

    peak: list[str] = []

    def run_flower(name: str, fast: bool) -> list[float]:
        cfg = config(args, out, name, 0, **{"fast-simulation": fast})
        log = collections.deque(maxlen=40)

        def on_line(line: str) -> None:
            log.append(line)
            peak.extend(re.findall(r"peak RSS of this flower server process: (\d+)", line))

        run_with_flower(cfg, num_cpus=args.num_cpus, num_gpus=0.0, on_line=on_line)
        if not is_complete(cfg.run_dir, cfg.num_rounds):
            sys.exit("the Flower run did not complete; the end of its output:\n" + "\n".join(log))
        return round_seconds(cfg)[args.warmup:]

    flower = run_flower("flower", fast=True)
    flower_public = run_flower("flower-public-api", fast=False)
    run_bare()

    images = WORKLOAD["clients-per-round"] * args.samples * args.epochs
    a, a_train, b, b0, c = (statistics.median(t) for t in (bare, bare_training, flower, flower_public, local))
    print(f"workload: {WORKLOAD['clients-per-round']} clients x {args.samples} samples, "
          f"bs {WORKLOAD['batch-size']}, {args.epochs} epoch(s), ResNet-18/GN; "
          f"median of {args.rounds} rounds after {args.warmup} warm-up ((a): 2 x {args.rounds})")
    print(f"    bare loop training alone  {a_train:7.3f} s/round  {images / a_train:7.1f} images/s  "
          f"(server step {a - a_train:.3f} s)")
    print(f"(a) bare loop         {a:7.3f} s/round  {images / a:7.1f} images/s")
    print(f"(c) local engine      {c:7.3f} s/round  {images / c:7.1f} images/s  ratio c/a = {c / a:.3f}")
    print(f"(b0) flower, public API {b0:7.3f} s/round  {images / b0:7.1f} images/s  "
          f"ratio b0/a = {b0 / a:.3f} (fast-simulation = false)")
    print(f"(b) flower simulation {b:7.3f} s/round  {images / b:7.1f} images/s")
    print(f"server peak RSS (flower ServerApp process): {peak[0] if peak else '?'} MiB with fast-simulation, "
          f"{peak[-1] if len(peak) > 1 else '?'} MiB without")
    print(f"b / bare loop training alone = {b / a_train:.3f}")
    print(f"ratio b/a = {b / a:.3f}")


if __name__ == "__main__":
    main()
