"""Seconds per fedmask-local round on this machine, and the paper protocol's projected time.

Times the local engine's round (``fedmask_app.engines.local.local_train_round``: the cohort's
local training, sequential, vectorised (``vectorize``), sequential with each full minibatch's
step replayed from a CUDA graph (``cuda-graphs``: path "graphs"), vectorised with each full
cohort step replayed ("vec-graphs"), or sequential clients side by side on a CUDA stream each
(``client-streams`` = K_c: "streams", and with each replica's step replayed: "streams-graphs"),
each also with the clients' convolutions as matrix products over patches (``gemm-convs``: the
path's name with "-gemm", e.g. "vec-graphs-gemm"), then aggregation and the statistics; each line splits
the round into the training and the server step after it; ``--residency both`` times each
configuration with the replies' Δ_k reduced on the device and on the host, side by side)
for the paper's cells bs 32 τ 2, bs 128 τ 1 and full batch τ 1, in each precision (float32,
tf32, bf16), with ``--warmup`` untimed and ``--rounds`` timed rounds per cell, precision and
path; and one evaluation of the test set (10,000 images, eval-batch-size 500) per precision.

Data: ``--data-dir`` holding cifar10.npz or cifar10-subset.npz gives real images (Dirichlet
α = 100 shards over as many clients as the file allows, each cut to ``--samples``); without it,
synthetic CIFAR-shaped shards of exactly ``--samples`` images (the timing does not depend on the
pixels). The projection (a projection from measured rounds, not a measurement) covers grid 1
(bs {32, 128, full} × τ {1, 2, 5}) and grid 2's two extra cells (bs 32, τ 2, α {1, 0.1}): 11
cells × 3 seeds × 200 rounds, K_c = 10 clients of 500 images a round; a cell's training time is
its batch size's measured images/s applied to 10 · 500 · τ images, i.e. linear in τ from the
measured τ, plus one test-set evaluation per round.

``--threaded N ...`` runs N copies of one configuration in N threads of this process instead,
each on a CUDA stream of its own: runs in separate processes take turns on a GPU (without MPS
it time-slices between them), while kernels of one process's streams can run at the same time.

``--grouped N ...`` times N runs (seeds 0..N-1) trained together as ``fedmask-sweep --group-runs N``
trains them (fedmask_app/engines/run_group.py: their cohorts as one vmapped computation, on
``--grouped-path``), a group of one first as the baseline, and prints their summed images/s against
the group of one's; with all three cells timed, the protocol's projection with each cell's seeds
trained together.

``--concurrent N ...`` also starts N copies of this script at once (float32, ``--concurrent-path``,
the ``--concurrent-cells``, one after another with a barrier before each cell's timed rounds, so that their
timed rounds overlap), as N runs of a sweep sharing one GPU would (``fedmask-sweep --ray-address
... --run-gpus 1/N``), and prints their summed images/s against one process's.

    python benchmarks/gpu_timing.py --data-dir .gpu-data            # GPU, a few minutes
    python benchmarks/gpu_timing.py --quick --device cpu            # CPU check of the script (tiny model)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.func import functional_call, vmap

from clients.training import load_parameters
from clients.vectorized import stack_copies
from fedmask_app.engines.local import in_process, local_train_round, resident_on
from fedmask_app.engines.run_group import TrainingGroup
from fedmask_app.run.client_task import ClientTask
from fedmask_app.run.config import RunConfig, pyproject_defaults, run_config_from_values
from fedmask_app.run.data import FILE_NAME, SUBSET_FILE_NAME, load_dataset, normalize
from fedmask_app.run.device import compute_setup
from fedmask_app.run.model import MODELS, build_model, initial_parameters

CELLS = (("bs32-tau2", 32, 2), ("bs128-tau1", 128, 1), ("full-tau1", "full", 1))
PRECISIONS = ("float32", "tf32", "bf16")
# (name, vectorize, cuda-graphs, client streams: one per client of the cohort)
PATHS = (("sequential", False, False, False), ("vectorised", True, False, False), ("graphs", False, True, False),
         ("vec-graphs", True, True, False), ("streams", False, False, True), ("streams-graphs", False, True, True))
GEMM = "-gemm"  # a path's name with this suffix: the same path with gemm-convs = true
PATH_NAMES = tuple(name + suffix for suffix in ("", GEMM) for name, *_ in PATHS)
# --residency: (name, ClientTask resident) pairs timed per configuration; None: as the engine does
RESIDENCIES = {"engine": (("engine", None),), "device": (("device", True),), "host": (("host", False),),
               "both": (("device", True), ("host", False))}
GRID1 = tuple((bs, tau) for bs in (32, 128, "full") for tau in (1, 2, 5))
GRID2_EXTRA = ((32, 2), (32, 2))  # α = 1 and α = 0.1 (α = 100 is grid 1's cell)
SEEDS, ROUNDS, K_C, N_K, TEST_IMAGES, EVAL_BATCH = 3, 200, 10, 500, 10000, 500
PAPER_WINDOW = 50  # the paper's medians read rounds 151-200


@dataclass(frozen=True)
class Timing:
    """Median seconds per timed round and images processed per second (τ · Σ n_k per round); of a
    round, the median seconds of the cohort's training (replies made, θ and shards already on the
    device) and of the server step after it (checks, aggregation, statistics)."""

    seconds: float
    images_per_s: float
    train_seconds: float
    server_seconds: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="", help="folder with cifar10.npz or cifar10-subset.npz (else synthetic)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--model", choices=MODELS, default=None,
                        help="default: the run config's model; linear-softmax with --quick")
    parser.add_argument("--clients", type=int, default=K_C, help="clients per round")
    parser.add_argument("--samples", type=int, default=N_K, help="images per client (shard cap)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds per configuration")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per configuration (median)")
    parser.add_argument("--test-images", type=int, default=TEST_IMAGES, help="images of the timed evaluation")
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    parser.add_argument("--budget-s", type=float, default=0.0, help="skip configurations once past this (0: none)")
    parser.add_argument("--config-cap-s", type=float, default=0.0,
                        help="stop a configuration's timed rounds once it has run this long (0: none)")
    parser.add_argument("--cells", nargs="+", choices=[c[0] for c in CELLS], default=[c[0] for c in CELLS])
    parser.add_argument("--paths", nargs="*", choices=PATH_NAMES, default=[p[0] for p in PATHS],
                        help=f"the paths timed per cell and precision (none: only --grouped/--threaded/--concurrent); "
                             f"a name ending in {GEMM}: the path with gemm-convs = true")
    parser.add_argument("--concurrent", nargs="*", type=int, default=[],
                        help="also time N processes at once (float32, --concurrent-path), for each N given")
    parser.add_argument("--threaded", nargs="*", type=int, default=[],
                        help="also time N runs in N threads of this process, a CUDA stream each (float32, "
                             "--concurrent-path), for each N given")
    parser.add_argument("--concurrent-cells", nargs="+", choices=[c[0] for c in CELLS], default=["bs32-tau2"],
                        help="the cells --concurrent and --threaded time (default: bs32-tau2, the launch-bound one)")
    parser.add_argument("--concurrent-path", choices=PATH_NAMES, default="sequential",
                        help="the path --concurrent and --threaded time (float32)")
    parser.add_argument("--grouped", nargs="*", type=int, default=[],
                        help="also time N runs trained together (fedmask-sweep --group-runs N; float32, "
                             "--grouped-path, the --concurrent-cells), for each N given, against a group of one")
    parser.add_argument("--grouped-path", choices=("vectorised", "vec-graphs"), default="vectorised",
                        help="the path --grouped times")
    parser.add_argument("--grouped-precision", choices=PRECISIONS, default="float32",
                        help="the precision --grouped times")
    parser.add_argument("--grouped-chunked", action="store_true",
                        help="also time each group of more than one run at bs 32 with its clients vmapped in chunks "
                             "of --clients (one cohort), against the group as the engine trains it (on a GPU: in "
                             "one vmapped call)")
    parser.add_argument("--skip-padding-taps", action="store_true",
                        help="every configuration with skip-padding-taps = true (convolutions skip padding-only taps)")
    parser.add_argument("--eval-batch-sizes", nargs="*", type=int, default=[],
                        help=f"also time the evaluation at these eval-batch-size values (the projection uses "
                             f"{EVAL_BATCH}, the default)")
    parser.add_argument("--eval-together", nargs="*", type=int, default=[], metavar="N",
                        help="also time N runs' evaluations one after another against one vmapped evaluation of "
                             "all N (evaluation batched across runs, a candidate), per precision, for each N given")
    parser.add_argument("--residency", choices=tuple(RESIDENCIES), default="engine",
                        help="where the replies' Δ_k are reduced: as the engine does (on a GPU: on the device), "
                             "device, host (numpy), or both side by side with their ratio")
    parser.add_argument("--worker-json", default="", help=argparse.SUPPRESS)  # a --concurrent worker's output
    parser.add_argument("--barrier", default="", help=argparse.SUPPRESS)  # folder of its ready files
    parser.add_argument("--barrier-count", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true",
                        help="a CPU check of the script, not a timing: linear-softmax, 2 clients × 16 images, 1 round")
    args = parser.parse_args(argv)
    if args.threaded and args.warmup < 1:
        parser.error("--threaded needs --warmup >= 1: CUDA graphs are captured in the warm-up, one thread at a time")
    if args.quick:
        args.clients, args.samples, args.warmup, args.rounds, args.test_images = 2, 16, 1, 1, 200
    args.model = args.model or ("linear-softmax" if args.quick else pyproject_defaults()["model"])
    return args


def data_file(data_dir: str) -> Path | None:
    """The data file ``--data-dir`` holds, or None (synthetic data)."""
    if not data_dir:
        return None
    found = [Path(data_dir) / name for name in (FILE_NAME, SUBSET_FILE_NAME) if (Path(data_dir) / name).is_file()]
    if not found:
        raise SystemExit(f"--data-dir {data_dir} holds neither {FILE_NAME} nor {SUBSET_FILE_NAME}")
    return found[0]


def synthetic_shards(num_clients: int, samples: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Random uint8 CIFAR-shaped shards of exactly ``samples`` images, one per client."""
    rng = np.random.default_rng(0)
    return {k: (rng.integers(0, 256, (samples, 32, 32, 3), dtype=np.uint8), rng.integers(0, 10, samples))
            for k in range(num_clients)}


def base_values(args: argparse.Namespace, scratch: Path) -> tuple[dict, dict[int, tuple] | None, str]:
    """Run-config values shared by every configuration, the synthetic shards (or None) and a label."""
    path = data_file(args.data_dir)
    values = {"clients-per-round": args.clients, "max-shard-size": args.samples, "model": args.model,
              "device": args.device, "eval-every": 0, "checkpoint-every": 0, "output-dir": str(scratch),
              "data-dir": str(path.parent.resolve()) if path else str(scratch), "alpha": 100.0,
              "skip-padding-taps": args.skip_padding_taps}
    if path is None:
        values["num-clients"] = args.clients
        return values, synthetic_shards(args.clients, args.samples), "synthetic"
    num_train = len(load_dataset(path.parent.resolve()).y_train)
    values["num-clients"] = max(args.clients, min(100, num_train // args.samples))
    return values, None, f"{path.name}, {values['num-clients']} Dirichlet(100) shards"


def sync(device: torch.device) -> None:
    """Wait for the current stream (the local engine joins every stream it uses into it)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def wait_at_barrier(folder: str, name: str, count: int, timeout_s: float = 120.0) -> None:
    """Mark this process ready for ``name`` and wait (at most ``timeout_s``) until ``count`` are."""
    if not folder:
        return
    Path(folder, f"{name}.{time.perf_counter_ns()}.{id(folder)}").touch()
    deadline = time.perf_counter() + timeout_s
    while len(list(Path(folder).glob(f"{name}.*"))) < count and time.perf_counter() < deadline:
        time.sleep(0.05)


def path_settings(path: str) -> tuple[bool, bool, bool, bool]:
    """vectorize, cuda-graphs, client streams and gemm-convs of a path of PATH_NAMES."""
    gemm = path.endswith(GEMM)
    _, vectorize, graphs, streams = next(p for p in PATHS if p[0] == path.removesuffix(GEMM))
    return vectorize, graphs, streams, gemm


def config_values(base: dict, precision: str, path: str, bs: int | str, tau: int) -> dict:
    """Run-config values of one timed configuration: ``base`` with a precision, a path of PATH_NAMES and a cell."""
    vectorize, graphs, streams, gemm = path_settings(path)
    return {**base, "precision": precision, "vectorize": vectorize, "cuda-graphs": graphs,
            "client-streams": base["clients-per-round"] if streams else 1, "gemm-convs": gemm, "batch-size": bs,
            "local-epochs": tau}


def time_rounds(cfg: RunConfig, shards: dict | None, warmup: int, rounds: int, cap_s: float = 0.0,
                before_timed: Callable[[], object] = lambda: None, resident: bool | None = None,
                setup_lock: contextlib.AbstractContextManager | None = None) -> Timing:
    """Warm-up then timed rounds of the local engine's round for ``cfg``. Every shard is moved to the
    device first, as a long run has them all resident after its first rounds. With ``cap_s`` the
    timed rounds stop once they have taken that long (at least one is timed). ``before_timed`` runs
    between the warm-up and the timed rounds (a barrier with the other processes or threads);
    ``setup_lock`` is held through the set-up and the warm-up (threads: one CUDA-graph capture at a
    time, while the others wait). ``resident``: whether the replies' Δ_k stay tensors on the device
    (None: as the engine decides, ``resident_on``). ``sync`` waits for the current stream only:
    with threads, each thread's own."""
    device = compute_setup(cfg)[0]
    train_seconds: list[float] = []
    seconds, server_seconds, images = [], [], 0
    with setup_lock or contextlib.nullcontext():
        task = ClientTask(cfg, shards, resident=resident_on(device) if resident is None else resident)
        for partition_id in range(cfg.num_clients):
            task.shard(partition_id)
        train_cohort = in_process(cfg, task)

        def timed_train_cohort(*args):
            sync(device)
            started = time.perf_counter()
            replies = train_cohort(*args)
            sync(device)
            train_seconds.append(time.perf_counter() - started)
            return replies

        train_round = local_train_round(cfg, timed_train_cohort)
        params = [p.numpy() for p in initial_parameters(cfg.model, cfg.seed)]

        def timed_round(server_round: int) -> tuple[float, int]:
            nonlocal params
            sync(device)
            started = time.perf_counter()
            outcome = train_round(server_round, params, cfg.keep_prob, None)
            sync(device)
            if outcome.num_failures:
                raise RuntimeError("; ".join(outcome.failures))
            params = outcome.result.params
            return time.perf_counter() - started, cfg.local_epochs * outcome.result.num_examples

        for server_round in range(1, warmup + 1):
            timed_round(server_round)
    before_timed()
    for server_round in range(warmup + 1, warmup + rounds + 1):
        if cap_s and seconds and sum(seconds) > cap_s:
            break
        round_seconds, round_images = timed_round(server_round)
        seconds.append(round_seconds)
        server_seconds.append(round_seconds - train_seconds[-1])
        images += round_images
    del task
    release_memory()
    return Timing(statistics.median(seconds), images / sum(seconds), statistics.median(train_seconds[warmup:]),
                  statistics.median(server_seconds))


def time_evaluation(cfg: RunConfig, test_images: int, batch: int = EVAL_BATCH) -> float:
    """Median seconds of one evaluation pass (forward only, as fedmask_app.run.evaluation) over
    ``test_images`` synthetic images."""
    device, dtype = compute_setup(cfg)
    model = build_model(cfg.model, cfg.skip_padding_taps).to(device, dtype).eval()
    images = synthetic_test_images(test_images, device, dtype)

    def evaluate() -> None:
        for start in range(0, test_images, batch):
            model(images[start : start + batch]).argmax(1)

    return median_seconds(evaluate, device)  # the caller releases the model and images (release_memory)


def time_evaluation_together(cfg: RunConfig, runs: int, test_images: int, batch: int = EVAL_BATCH
                             ) -> tuple[float, float, float]:
    """Median seconds of evaluating ``runs`` global models (θ_0 of seeds 0..runs-1): one after
    another, as the runs of a group evaluate now, and as one vmapped forward a test batch over their
    stacked parameters — evaluation batched across runs, a candidate the engine does not have
    (docs/performance.md, session 13): the same arithmetic, fewer launches. Also the largest
    difference of the two ways' logits on the first batch, relative to the largest logit."""
    device, dtype = compute_setup(cfg)
    model = build_model(cfg.model, cfg.skip_padding_taps).to(device, dtype).eval()
    thetas = [[t.to(device, dtype) for t in initial_parameters(cfg.model, seed)] for seed in range(runs)]
    stacked = stack_copies(model, thetas, [1] * runs)
    forward = vmap(lambda params, x: functional_call(model, params, (x,)), in_dims=(0, None))
    images = synthetic_test_images(test_images, device, dtype)

    def one_after_another() -> None:
        for theta in thetas:
            load_parameters(model, theta)
            for start in range(0, test_images, batch):
                model(images[start : start + batch]).argmax(1)

    def together() -> None:
        for start in range(0, test_images, batch):
            forward(stacked, images[start : start + batch]).argmax(-1)

    with torch.no_grad():  # the same logits, within float rounding: printed so a timing of a wrong computation shows
        x = images[:batch]
        apart = torch.stack([functional_call(model, {k: v[i] for k, v in stacked.items()}, (x,)) for i in range(runs)])
        drift = float((forward(stacked, x) - apart).abs().max() / apart.abs().max())
    return median_seconds(one_after_another, device), median_seconds(together, device), drift


def synthetic_test_images(count: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    rng = np.random.default_rng(1)
    return normalize(rng.integers(0, 256, (count, 32, 32, 3), dtype=np.uint8)).to(device, dtype)


def median_seconds(call: Callable[[], None], device: torch.device, repeats: int = 3) -> float:
    """Median seconds of ``call`` without gradients, the first of ``repeats`` calls a warm-up."""
    seconds = []
    with torch.no_grad():
        for _ in range(repeats):
            sync(device)
            started = time.perf_counter()
            call()
            sync(device)
            seconds.append(time.perf_counter() - started)
    return statistics.median(seconds[1:])


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def protocol_hours(timings: dict, eval_s: float, eval_scale: float) -> tuple[float, float]:
    """Projected hours of grid 1 and grid 2's extra cells from each batch size's measured round:
    its training at the measured images/s for 10 · 500 · τ images, its server step once a round."""
    def cell_s(bs, tau: int) -> float:
        timing, measured_tau = timings[bs], next(t for _, b, t in CELLS if b == bs)
        train_rate = K_C * N_K * measured_tau / timing.train_seconds
        return SEEDS * ROUNDS * (K_C * N_K * tau / train_rate + timing.server_seconds + eval_s * eval_scale)

    return sum(cell_s(*c) for c in GRID1) / 3600, sum(cell_s(*c) for c in GRID2_EXTRA) / 3600


def print_projection(results: dict, eval_seconds: dict, test_images: int) -> None:
    """One line per precision and path that has all three cells measured."""
    if not results:  # --paths given none
        return
    print("\n# PROJECTION from measured rounds (not measured runs): paper protocol = grid 1 (bs {32,128,full} × "
          f"τ {{1,2,5}}, 9 cells) + grid 2's 2 extra cells (bs 32 τ 2, α 1 and 0.1) = 11 cells × {SEEDS} seeds × "
          f"{ROUNDS} rounds, K_c = {K_C} × n_k = {N_K}; τ scales a cell's training time linearly from the measured τ "
          f"(bs 32 at τ 2, bs 128 and full at τ 1), plus its measured server step and one evaluation of "
          f"{TEST_IMAGES} test images per round; "
          "runs one after another on this one device. Grid 2's non-IID cells have unequal n_k: the vectorised "
          "and streams paths wait for the cohort's largest shard, so α = 0.1 costs more than projected there.")
    eval_scale = TEST_IMAGES / test_images
    for (precision, path), timings in results.items():
        if len(timings) < len(CELLS):
            print(f"projection {precision:8s} {path:21s}: incomplete (a cell failed or was skipped)")
            continue
        grid1, grid2 = protocol_hours(timings, eval_seconds.get(precision, 0.0), eval_scale)
        print(f"projection {precision:8s} {path:21s}: grid 1 {grid1:7.2f} h + grid 2 extra {grid2:6.2f} h = "
              f"{grid1 + grid2:7.2f} h of device time")
    cells = len(GRID1) + len(GRID2_EXTRA)
    for precision, seconds in eval_seconds.items():
        every_round = cells * SEEDS * ROUNDS * seconds * eval_scale / 3600
        print(f"projection {precision:8s} evaluations: {every_round:.3f} h of each {precision} line above (one a "
              f"round, {seconds * eval_scale:.3f} s each); with eval-from = {ROUNDS - PAPER_WINDOW + 1} (only the "
              f"rounds the paper's medians read) {every_round * PAPER_WINDOW / ROUNDS:.3f} h")


def print_gemm_ratios(results: dict) -> None:
    """For every path timed both ways in this run: its seconds per round over the same path's with
    gemm-convs, cell by cell (above 1: gemm-convs is faster)."""
    for (precision, name), timings in results.items():
        gemm = results.get((precision, name + GEMM), {})
        for cell, bs, _ in CELLS:
            if bs in timings and bs in gemm:
                print(f"{precision:8s} {name:14s} {cell:10s}: seconds per round without / with gemm-convs = "
                      f"{timings[bs].seconds / gemm[bs].seconds:.2f}x (training alone "
                      f"{timings[bs].train_seconds / gemm[bs].train_seconds:.2f}x)", flush=True)


def run_configuration(values: dict, shards: dict | None, args: argparse.Namespace, label: str,
                      before_timed: Callable[[], object] = lambda: None, resident: bool | None = None,
                      setup_lock: contextlib.AbstractContextManager | None = None) -> Timing | None:
    """Time one configuration and print its line; None when it failed."""
    try:
        cfg = run_config_from_values(values)
        timing = time_rounds(cfg, shards, args.warmup, args.rounds, args.config_cap_s, before_timed, resident,
                             setup_lock)
    except Exception as exc:  # report and go on: one failing configuration must not hide the others
        print(f"{label}: FAILED {type(exc).__name__}: {exc}", flush=True)
        release_memory()
        return None
    print(f"{label}: {timing.seconds:8.3f} s/round  {timing.images_per_s:10.0f} images/s  (training "
          f"{timing.train_seconds:.3f} s + server step {timing.server_seconds:.3f} s)", flush=True)
    return timing


def worker_main(args: argparse.Namespace) -> int:
    """One of ``--concurrent``'s processes: float32, ``--concurrent-path``, each cell; images/s per
    cell as JSON in ``--worker-json``."""
    rates = {}
    with tempfile.TemporaryDirectory(prefix="fedmask-gpu-worker-") as scratch:
        base, shards, _ = base_values(args, Path(scratch))
        for cell, bs, tau in (c for c in CELLS if c[0] in args.cells):
            values = config_values(base, "float32", args.concurrent_path, bs, tau)
            timing = run_configuration(values, shards, args, f"  worker {cell}",
                                       lambda cell=cell: wait_at_barrier(args.barrier, cell, args.barrier_count))
            rates[cell] = timing.images_per_s if timing else None
    Path(args.worker_json).write_text(json.dumps(rates))
    return 0


def time_concurrent(args: argparse.Namespace, counts: list[int], single: dict) -> None:
    """N processes at once per N in ``counts``: summed images/s per cell against one process's
    (``single``: cell -> images/s of the float32 ``--concurrent-path`` measured in this process)."""
    forwarded = ["--device", args.device, "--model", args.model, "--clients", str(args.clients),
                 "--samples", str(args.samples), "--warmup", str(args.warmup), "--rounds", str(args.rounds),
                 "--config-cap-s", str(args.config_cap_s), "--cells", *args.concurrent_cells,
                 "--concurrent-path", args.concurrent_path, *(["--skip-padding-taps"] * args.skip_padding_taps)]
    if args.data_dir:
        forwarded += ["--data-dir", args.data_dir]
    print(f"\n# CONCURRENT: N processes of this script at once (float32, {args.concurrent_path}; timed rounds start "
          "together at a barrier), as N runs of a sweep sharing the device; summed images/s", flush=True)
    for n in counts:
        with tempfile.TemporaryDirectory(prefix="fedmask-gpu-concurrent-") as folder:
            started = time.perf_counter()
            outs = [Path(folder, f"worker{i}.json") for i in range(n)]
            # Each process gets its share of the CPUs, as Ray gives a sweep's run task (--run-cpus).
            env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // n))}
            procs = [subprocess.Popen([sys.executable, __file__, *forwarded, "--worker-json", str(out),
                                       "--barrier", folder, "--barrier-count", str(n)],
                                      stdout=subprocess.DEVNULL if i else None, env=env)
                     for i, out in enumerate(outs)]
            codes = [p.wait() for p in procs]
            rates = [json.loads(out.read_text()) if out.is_file() else {} for out in outs]
            for cell in args.concurrent_cells:
                per_process = [r.get(cell) for r in rates]
                if any(code != 0 for code in codes) or None in per_process:
                    print(f"concurrent N={n:2d} {cell:10s}: FAILED (exit codes {codes})", flush=True)
                    continue
                total = sum(per_process)
                gain = f"{total / single[cell]:5.2f}x one process" if single.get(cell) else "no single-process rate"
                print(f"concurrent N={n:2d} {cell:10s}: {total:10.0f} images/s summed "
                      f"({min(per_process):.0f}-{max(per_process):.0f} per process), {gain}", flush=True)
            print(f"concurrent N={n:2d} took {time.perf_counter() - started:.0f} s", flush=True)


def threaded_timings(n: int, values: dict, shards: dict | None, args: argparse.Namespace, device: torch.device,
                     cell: str) -> list[Timing | None]:
    """``values`` timed in n threads at once, each on a CUDA stream of its own (see ``time_threaded``)."""
    setup_lock, barrier = threading.Lock(), threading.Barrier(n, timeout=600)
    timings: list[Timing | None] = [None] * n

    def work(i: int) -> None:
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            timings[i] = run_configuration(values, shards, args, f"  thread {i} {cell}", barrier.wait,
                                           setup_lock=setup_lock)
        if timings[i] is None:
            barrier.abort()  # the others stop waiting for this one

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return timings


def time_threaded(args: argparse.Namespace, counts: list[int], base: dict, shards: dict | None,
                  single: dict) -> bool:
    """N runs in N threads of this process per N in ``counts``, each on a CUDA stream of its own
    (and its client streams): summed images/s per cell against one run's (``single``, as in
    ``time_concurrent``). Set-up and warm-up rounds (where CUDA graphs are captured) go one thread
    at a time; the timed rounds start together. Returns whether every thread's timing succeeded."""
    device = compute_setup(run_config_from_values(base))[0]
    print(f"\n# THREADED: N runs in N threads of this process (float32, {args.concurrent_path}, a CUDA stream each; "
          "warm-up one at a time, timed rounds start together), the GPU shared within one process; summed images/s",
          flush=True)
    ok = True
    for n in counts:
        for cell, bs, tau in (c for c in CELLS if c[0] in args.concurrent_cells):
            values = config_values(base, "float32", args.concurrent_path, bs, tau)
            timings = threaded_timings(n, values, shards, args, device, cell)
            if None in timings:
                print(f"threaded N={n:2d} {cell:10s}: FAILED", flush=True)
                ok = False
                continue
            total = sum(t.images_per_s for t in timings)
            gain = f"{total / single[cell]:5.2f}x one run" if single.get(cell) else "no single-run rate"
            print(f"threaded N={n:2d} {cell:10s}: {total:10.0f} images/s summed "
                  f"({min(t.images_per_s for t in timings):.0f}-{max(t.images_per_s for t in timings):.0f} per run), "
                  f"{gain}", flush=True)
    release_memory()
    return ok


def grouped_timing(n: int, values: dict, shards: dict | None, args: argparse.Namespace,
                   chunk_clients: int | None = None) -> Timing:
    """``args.rounds`` rounds of n runs (seeds 0..n-1 of ``values``) trained together, each run's
    round loop in a thread of its own as ``run_group`` runs it, after ``args.warmup`` untimed rounds
    (where a CUDA graph is captured). Seconds and training seconds are per round of all n runs;
    images/s is their sum; the server steps overlap the waiting, so ``server_seconds`` is 0."""
    cfgs = [run_config_from_values({**values, "seed": seed, "run-name": f"grouped-{seed}"}) for seed in range(n)]
    device = compute_setup(cfgs[0])[0]
    group = TrainingGroup(cfgs, shards, chunk_clients)
    for task in group.tasks:
        for partition_id in range(task.cfg.num_clients):
            task.shard(partition_id)
    barrier = threading.Barrier(n + 1)  # no timeout: a failing thread aborts it
    images, errors = [0] * n, []

    def work(index: int) -> None:
        cfg, train_round = cfgs[index], group.train_round(index)
        params = [p.numpy() for p in initial_parameters(cfg.model, cfg.seed)]
        try:
            for server_round in range(1, args.warmup + args.rounds + 1):
                if server_round == args.warmup + 1:
                    barrier.wait()
                outcome = train_round(server_round, params, cfg.keep_prob, None)
                params = outcome.result.params
                if server_round > args.warmup:
                    images[index] += cfg.local_epochs * outcome.result.num_examples
            sync(device)
        except Exception as exc:
            errors.append(exc)
            barrier.abort()
        finally:
            group.leave()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    try:
        barrier.wait()
    except threading.BrokenBarrierError:
        pass
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    seconds = (time.perf_counter() - started) / args.rounds
    if errors:
        raise errors[0]
    return Timing(seconds, sum(images) / (seconds * args.rounds), seconds, 0.0)


def time_grouped(args: argparse.Namespace, counts: list[int], base: dict, shards: dict | None,
                 eval_s: float | None, test_images: int, started: float) -> bool:
    """Groups of 1 and of each N in ``counts`` per cell: seconds per round of the whole group, summed
    images/s, the ratio to the group of one. Returns whether every timing succeeded."""
    precision, path = args.grouped_precision, args.grouped_path
    print(f"\n# GROUPED: N runs trained together (fedmask-sweep --group-runs N: their cohorts as one vmapped "
          f"computation; {precision}, {path}, seeds 0..N-1, a thread per run); summed images/s against a group "
          "of one, timed in this run", flush=True)
    eval_cfg = run_config_from_values({**base, "precision": precision})
    eval_together = {n: time_grouped_evaluation(eval_cfg, n, test_images) for n in counts if n > 1}
    ok, by_count = True, {}
    for cell, bs, tau in (c for c in CELLS if c[0] in args.concurrent_cells):
        values = config_values(base, precision, path, bs, tau)
        one = None
        for n in [1, *counts]:
            if args.budget_s and time.perf_counter() - started > args.budget_s:
                print(f"grouped N={n:2d} {cell:10s}: skipped (past --budget-s {args.budget_s:g})", flush=True)
                continue
            try:
                timing = grouped_timing(n, values, shards, args)
            except Exception as exc:
                print(f"grouped N={n:2d} {cell:10s}: FAILED {type(exc).__name__}: {exc}", flush=True)
                ok = False
                continue
            finally:
                release_memory()  # the group's tasks and their shards
            one = timing if n == 1 else one
            gain = f"{timing.images_per_s / one.images_per_s:5.2f}x a group of one" if one else "no group of one"
            print(f"grouped N={n:2d} {cell:10s}: {timing.seconds:8.3f} s per round of all {n} runs, "
                  f"{timing.images_per_s:10.0f} images/s summed, {gain}", flush=True)
            by_count.setdefault(n, {})[bs] = Timing(timing.seconds / n, timing.images_per_s, timing.seconds / n, 0.0)
    if args.grouped_chunked:
        ok &= time_grouped_in_chunks(args, counts, base, shards, by_count, started)
    for n, timings in by_count.items():
        if n > 1 and len(timings) == len(CELLS) and eval_s is not None:
            for evaluation, per_run in (("one after another", eval_s), ("batched across the group", eval_together[n])):
                if per_run is None:
                    continue
                grid1, grid2 = protocol_hours(timings, per_run, TEST_IMAGES / test_images)
                print(f"projection {precision:8s} {path}, {n} runs trained together, evaluations {evaluation}: "
                      f"grid 1 {grid1:7.2f} h + grid 2 extra {grid2:6.2f} h = {grid1 + grid2:7.2f} h of device time "
                      "(each cell's seeds together, server steps counted inside the group's round)", flush=True)
    return ok


def time_grouped_in_chunks(args: argparse.Namespace, counts: list[int], base: dict, shards: dict | None,
                           by_count: dict, started: float) -> bool:
    """Groups of each N > 1 in ``counts`` at bs 32 τ 2 with their clients vmapped ``args.clients``
    at a time (one cohort a call, all calls in the one CUDA graph with vec-graphs), against the
    same group as the engine trains it (``by_count``; on a GPU in one call, on a CPU already in
    chunks of one cohort): whether cuDNN, as oneDNN on a CPU, slows down when a grouped convolution
    has many groups. Returns whether every timing succeeded."""
    cell, bs, tau = CELLS[0]
    values = config_values(base, args.grouped_precision, args.grouped_path, bs, tau)
    ok = True
    for n in (n for n in counts if n > 1):
        label = f"grouped N={n:2d} {cell:10s} in vmap chunks of {args.clients} clients"
        if args.budget_s and time.perf_counter() - started > args.budget_s:
            print(f"{label}: skipped (past --budget-s {args.budget_s:g})", flush=True)
            continue
        try:
            timing = grouped_timing(n, values, shards, args, chunk_clients=args.clients)
        except Exception as exc:
            print(f"{label}: FAILED {type(exc).__name__}: {exc}", flush=True)
            ok = False
            continue
        finally:
            release_memory()
        whole = by_count.get(n, {}).get(bs)
        gain = f"{timing.images_per_s / whole.images_per_s:5.2f}x the engine's group" if whole else "no group rate"
        print(f"{label}: {timing.seconds:8.3f} s per round of all {n} runs, {timing.images_per_s:10.0f} images/s "
              f"summed, {gain}", flush=True)
    return ok


def time_grouped_evaluation(cfg: RunConfig, n: int, test_images: int) -> float | None:
    """Print n runs' evaluations one after another against one vmapped evaluation of all n; return
    the vmapped seconds per run (None when it failed)."""
    try:
        apart, together, drift = time_evaluation_together(cfg, n, test_images)
    except Exception as exc:
        print(f"{cfg.precision:8s} grouped eval N={n:2d}: FAILED {type(exc).__name__}: {exc}", flush=True)
        return None
    finally:
        release_memory()
    print(f"{cfg.precision:8s} grouped eval N={n:2d}: {n} evaluations of {test_images} images (eval-batch-size "
          f"{EVAL_BATCH}) one after another {apart:.3f} s, batched across the runs {together:.3f} s: "
          f"{apart / together:5.2f}x (logits differ by {drift:.1e} of the largest)", flush=True)
    return together / n


def main(argv: list[str] | None = None) -> int:
    """Time every configuration, print the projection; exit status 1 when a configuration failed."""
    args = parse_args(argv)
    if args.worker_json:
        return worker_main(args)
    started, failed = time.perf_counter(), False
    with tempfile.TemporaryDirectory(prefix="fedmask-gpu-timing-") as scratch:
        base, shards, source = base_values(args, Path(scratch))
        device = compute_setup(run_config_from_values(base))[0]
        print(f"# gpu_timing: model {args.model}, {source}, device {device}, K_c {args.clients}, n_k ≤ {args.samples}, "
              f"{args.warmup} warm-up + {args.rounds} timed rounds per configuration, torch {torch.__version__}, "
              f"skip-padding-taps {args.skip_padding_taps}", flush=True)
        results: dict[tuple[str, str], dict] = {}
        eval_seconds: dict[str, float] = {}
        width = max([14, *map(len, args.paths)])  # the labels' path column
        for precision in args.precisions:
            eval_cfg = run_config_from_values({**base, "precision": precision})
            eval_seconds[precision] = time_evaluation(eval_cfg, args.test_images)
            print(f"{precision:8s} evaluation of {args.test_images} images: {eval_seconds[precision]:.3f} s "
                  f"(eval-batch-size {EVAL_BATCH})", flush=True)
            for batch in args.eval_batch_sizes:
                print(f"{precision:8s} evaluation of {args.test_images} images: "
                      f"{time_evaluation(eval_cfg, args.test_images, batch):.3f} s (eval-batch-size {batch})",
                      flush=True)
            release_memory()
            for n in args.eval_together:
                time_grouped_evaluation(eval_cfg, n, args.test_images)
            for path in args.paths:  # in the order given
                _, graphs, streams, _ = path_settings(path)
                if (graphs or streams) and device.type != "cuda":
                    print(f"{precision:8s} {path:{width}s}: skipped (CUDA graphs and streams need a CUDA device)",
                          flush=True)
                    continue
                for cell, bs, tau in (c for c in CELLS if c[0] in args.cells):
                    measured = {}
                    for residency, resident in RESIDENCIES[args.residency]:
                        name = path if args.residency != "both" else f"{path}/{residency}"
                        label = f"{precision:8s} {name:{width if args.residency != 'both' else width + 7}s} {cell:10s}"
                        if args.budget_s and time.perf_counter() - started > args.budget_s:
                            print(f"{label}: skipped (past --budget-s {args.budget_s:g})", flush=True)
                            continue
                        timing = run_configuration(config_values(base, precision, path, bs, tau), shards, args,
                                                   label, resident=resident)
                        failed |= timing is None
                        if timing is not None:
                            results.setdefault((precision, name), {})[bs] = measured[residency] = timing
                    if len(measured) == 2:
                        print(f"{precision:8s} {path:{width}s} {cell:10s}: host / device-resident seconds per round = "
                              f"{measured['host'].seconds / measured['device'].seconds:.2f}x", flush=True)
        print_gemm_ratios(results)
        print_projection(results, eval_seconds, args.test_images)
        single = results.get(("float32", args.concurrent_path), {})
        single_rates = {c[0]: single[c[1]].images_per_s if c[1] in single else None for c in CELLS}
        if args.concurrent:
            time_concurrent(args, args.concurrent, single_rates)
        if args.threaded:
            failed |= not time_threaded(args, args.threaded, base, shards, single_rates)
        if args.grouped:
            failed |= not time_grouped(args, args.grouped, base, shards, eval_seconds.get(args.grouped_precision),
                                       args.test_images, started)
    print(f"# gpu_timing took {time.perf_counter() - started:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
