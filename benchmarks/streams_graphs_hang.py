"""Which float32 ``client-streams`` + ``cuda-graphs`` runs finish on a GPU and which hang.

On an H200 (2026-12-04, docs/gpu/gpu_run2-2026-12-04-streams-graphs-float32-hang.log) a round
of 10 clients × 500 images at bs 32 with ``client-streams = 10``, ``cuda-graphs = true`` and
``precision = "float32"`` never finished: the stack, dumped after 55 s, stood in a convolution's
forward of the eager step that a shard's partial last batch (500 = 15 × 32 + 20) takes after the
replica's graph was captured. tf32 and bf16 ran the same round in 0.48 and 0.57 s, and
``tests/test_cuda.py`` passed the same paths in float32 with 3 streams, 4 clients and shards of
80. Each line below is one round of the local engine in a process of its own, ended after
``--timeout-s`` (its Python stacks are printed then), varying one thing at a time from the hung
run: the number of streams and clients, a shard size without a partial batch (512), and float32
with deterministic algorithms off (the case marked "nondeterministic": TF32 stays off; not a
setting the engine offers, only the discriminator). What hangs says which of them is the trigger.

    python benchmarks/streams_graphs_hang.py --data-dir .gpu-data           # on the GPU, about 2 minutes
    python benchmarks/streams_graphs_hang.py --data-dir ../shared/data --device cpu --cases 2   # the harness on a CPU
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (client-streams, clients per round, shard cap, precision, variant); the hung run is the first
CASES = (
    (10, 10, 500, "float32", "default"),
    (10, 10, 512, "float32", "default"),
    (10, 10, 500, "float32", "nondeterministic"),
    (3, 10, 500, "float32", "default"),
    (3, 4, 80, "float32", "default"),
    (10, 10, 500, "tf32", "default"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", required=True, help="folder with cifar10.npz or cifar10-subset.npz")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: the cases without streams and graphs, 2 clients of <= 40 images (checks the script)")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="a case still running then counts as hung")
    parser.add_argument("--cases", type=int, default=len(CASES), help="run the first N cases")
    parser.add_argument("--case", default="", help=argparse.SUPPRESS)  # a child's case, as JSON
    return parser.parse_args(argv)


def run_values(case: tuple, data_dir: str, device: str, out: str) -> dict:
    """The run config of one case: one round, K_c clients of 20 (Dirichlet(100) shards of ~600
    images of the 12,000-image subset, capped), no evaluation."""
    streams, clients, shard, precision, _ = case
    values = {
        "num-clients": 20, "clients-per-round": clients, "max-shard-size": shard, "batch-size": 32,
        "local-epochs": 1, "num-rounds": 1, "test-subset": 200, "eval-every": 0, "checkpoint-every": 0,
        "precision": precision, "device": device, "data-dir": data_dir, "output-dir": out, "run-name": "case",
    }
    if device == "cuda":
        values |= {"client-streams": streams, "cuda-graphs": True}
    else:
        values |= {"clients-per-round": min(clients, 2), "max-shard-size": min(shard, 40)}
    return values


def child(case: tuple, data_dir: str, device: str, timeout_s: float) -> None:
    """Run one case in this process; dump every thread's stack if it is still running at the timeout."""
    import faulthandler

    import torch

    import fedmask_app.run.device as device_setup
    from fedmask_app.engines.local import run_local
    from fedmask_app.run.config import run_config_from_values

    faulthandler.dump_traceback_later(timeout_s, exit=True)
    if case[4] == "nondeterministic":
        configure = device_setup.configure_precision

        def configure_nondeterministic(cfg, dev):  # float32 (TF32 off) with free algorithm choice
            configure(cfg, dev)
            torch.backends.cudnn.deterministic = False
            torch.use_deterministic_algorithms(False)

        device_setup.configure_precision = configure_nondeterministic
    with tempfile.TemporaryDirectory() as out:
        cfg = run_config_from_values(run_values(case, data_dir, device, out))
        run_local(cfg, echo=lambda _: None)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.case:
        child(tuple(json.loads(args.case)), args.data_dir, args.device, args.timeout_s)
        return 0
    print(f"# streams_graphs_hang: device {args.device}, one round a case, hung after {args.timeout_s:g} s"
          + ("" if args.device == "cuda" else " (cpu: streams and graphs off, tiny, the harness only)"))
    hung = []
    cases = CASES[: args.cases]
    for case in cases:
        streams, clients, shard, precision, variant = case
        label = f"streams {streams:2d}, K_c {clients:2d}, shard {shard}, {precision} {variant}"
        started = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, __file__, "--data-dir", args.data_dir, "--device", args.device,
             "--timeout-s", str(args.timeout_s), "--case", json.dumps(case)],
            cwd=ROOT, capture_output=True, text=True, timeout=args.timeout_s + 60,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
        )
        seconds = time.perf_counter() - started
        if proc.returncode == 0:
            print(f"{label}: finished in {seconds:.1f} s")
            continue
        timed_out = "Timeout (" in proc.stderr
        print(f"{label}: {'HUNG' if timed_out else f'FAILED (exit {proc.returncode})'} after {seconds:.1f} s")
        hung.append(label)
        stderr = [line for line in proc.stderr.splitlines() if "Warning" not in line and "_warn_once" not in line]
        print("\n".join("    " + line for line in stderr[-40:]))
    print(f"# {len(hung)} of {len(cases)} cases hung or failed" + "".join(f"\n#   {h}" for h in hung))
    return 0


if __name__ == "__main__":
    sys.exit(main())
