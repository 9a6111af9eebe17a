"""How far two runs of one configuration drift apart when only the torch thread count differs.

Runs the local engine twice on the same configuration (default: conf/quick.toml with 10 rounds),
with ``threads = 1`` and ``threads = 2``, and prints per round the relative difference of 1/ΔS,
σ̂² and the training loss, and at the end the relative difference of the final θ. (The Flower
engine's clients train with one thread each, so a local run with ``threads = 1`` is its bitwise
twin: tests/test_flower_integration.py checks that.)

    python benchmarks/reproducibility.py --data-dir ../shared/data
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from fedmask_app.engines.local import run_local
from fedmask_app.run.config import load_run_config

COMPARED = ("recovery", "sigma2_hat", "train_loss", "test_accuracy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="../shared/data")
    parser.add_argument("--config", default="conf/quick.toml")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="fedmask-repro-"))
    rows, thetas = {}, {}
    for threads in (1, 2):
        cfg = load_run_config([args.config, f"num-rounds={args.rounds}", f"threads={threads}", "eval-every=5",
                               f'data-dir="{Path(args.data_dir).resolve()}"', f'output-dir="{out}"',
                               f'run-name="threads{threads}"', f"checkpoint-every={args.rounds}"])
        thetas[threads] = run_local(cfg, echo=lambda _: None)
        rows[threads] = pd.read_csv(cfg.run_dir / "rounds.csv")
    print(f"config {args.config}, {args.rounds} rounds, local engine, threads 1 vs 2 (torch {torch.__version__})")
    print("round  " + "  ".join(f"rel.diff {c:>13}" for c in COMPARED))
    for i in range(args.rounds):
        diffs = []
        for column in COMPARED:
            a, b = rows[1][column].iloc[i], rows[2][column].iloc[i]
            diffs.append(abs(a - b) / abs(a) if a == a and a != 0 else float("nan"))
        print(f"{i + 1:5d}  " + "  ".join(f"{d:22.2e}" for d in diffs))
    num = sum(float(np.sum((a.astype(np.float64) - b) ** 2)) for a, b in zip(thetas[1], thetas[2], strict=True))
    den = sum(float(np.sum(a.astype(np.float64) ** 2)) for a in thetas[1])
    print(f"final θ: ‖θ(1 thread) − θ(2 threads)‖ / ‖θ(1 thread)‖ = {(num / den) ** 0.5:.2e}")


if __name__ == "__main__":
    main()
