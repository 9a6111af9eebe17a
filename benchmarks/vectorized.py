"""Seconds per round of a cohort's local training: one client after another vs all clients at once.

The sequential path is ``clients.training.local_update`` for each of the K_c clients in turn (as
the bare loop trains them); the vectorised path is ``clients.vectorized.vectorized_local_updates``
for the whole cohort. Both use the same model (ResNet-18/GN), θ, shards, batch orders and thread
count. Cells: the paper's bs 32 τ 2, bs 128 τ 1 and full batch τ 1. One line per cell; the last
line is the bs-32 speed-up (sequential seconds / vectorised seconds). ``--gemm-convs`` times a
third path in the same alternation: the vectorised one over the model with ``gemm-convs = true``
(convolutions as matrix products, which vmap batches into one GEMM for all clients), against the
same sequential path; the last line then gives both speed-ups.

    python benchmarks/vectorized.py --samples 100 --clients 4
    python benchmarks/vectorized.py --rounds 2 --cells bs32-tau2 --gemm-convs   # the paper's 10 × 500 images
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from clients.training import LocalTraining, local_update
from clients.vectorized import vectorized_local_updates
from fedmask_app.run.data import normalize
from fedmask_app.run.model import MODELS, build_model, initial_parameters

CELLS = (("bs32-tau2", 32, 2), ("bs128-tau1", 128, 1), ("full-tau1", None, 1))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="../shared/data", help="folder with cifar10.npz (else synthetic data)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, the same for both paths")
    parser.add_argument("--clients", type=int, default=10, help="K_c, clients per round")
    parser.add_argument("--samples", type=int, default=500, help="examples per client")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per cell and path (median)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--model", choices=MODELS, default="resnet18-gn")
    parser.add_argument("--chunk-size", type=int, default=None, help="clients per vmapped call (default: all)")
    parser.add_argument("--channels-last", action="store_true", help="images in channels_last memory format")
    parser.add_argument("--skip-padding-taps", action="store_true",
                        help="both paths with skip-padding-taps = true (convolutions skip padding-only taps)")
    parser.add_argument("--gemm-convs", action="store_true",
                        help="also time the vectorised path with gemm-convs = true, side by side")
    parser.add_argument("--cells", nargs="+", choices=[c[0] for c in CELLS], default=[c[0] for c in CELLS])
    return parser.parse_args()


def pick_device(name: str) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def load_images(data_dir: str, count: int) -> tuple[np.ndarray, np.ndarray, str]:
    """The first ``count`` CIFAR-10 training images (uint8 NHWC) when the file exists, else random ones."""
    path = Path(data_dir) / "cifar10.npz"
    if path.is_file():
        with np.load(path) as data:
            if count <= len(data["y_train"]):
                return data["x_train"][:count], data["y_train"][:count].astype(np.int64), "cifar10"
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (count, 32, 32, 3), dtype=np.uint8), rng.integers(0, 10, count), "synthetic"


def make_shards(args: argparse.Namespace, device: torch.device) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], str]:
    """K_c disjoint shards of ``--samples`` normalised images each, on the device."""
    x, y, source = load_images(args.data_dir, args.clients * args.samples)
    images = normalize(x)
    if args.channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    labels = torch.from_numpy(y)
    shards = []
    for k in range(args.clients):
        part = slice(k * args.samples, (k + 1) * args.samples)
        shards.append((images[part].to(device), labels[part].to(device)))
    return shards, source


def generators(count: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(1000 + k) for k in range(count)]


def sequential_round(model, theta, shards, training: LocalTraining) -> None:
    for (x, y), gen in zip(shards, generators(len(shards)), strict=True):
        local_update(model, theta, x, y, training, gen)


def vectorized_round(model, theta, shards, training: LocalTraining, chunk_size: int | None) -> None:
    vectorized_local_updates(model, theta, shards, training, generators(len(shards)), chunk_size=chunk_size)


def timed(run: Callable[[], None], device: torch.device) -> tuple[float, float]:
    """Wall and process CPU seconds of one call (the device synchronised around it)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    started, cpu_started = time.perf_counter(), time.process_time()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started, time.process_time() - cpu_started


def time_cell(models: list, theta, shards, training: LocalTraining, args: argparse.Namespace,
              device) -> tuple[list[float], list[float]]:
    """Median seconds per round, wall and process CPU: the sequential path over ``models[0]``,
    then the vectorised path over each model. The paths alternate, so a drift of the machine's
    speed (other load) favours none; the CPU seconds (this process, all threads) are less
    sensitive to other processes' load."""
    runs = [lambda: sequential_round(models[0], theta, shards, training)]
    runs += [lambda m=m: vectorized_round(m, theta, shards, training, args.chunk_size) for m in models]
    times: list[list[tuple[float, float]]] = [[] for _ in runs]
    for _ in range(args.rounds):
        for run, measured in zip(runs, times, strict=True):
            measured.append(timed(run, device))
    return ([statistics.median(t[0] for t in m) for m in times], [statistics.median(t[1] for t in m) for m in times])


def warm_up(model, theta, shards, chunk_size: int | None) -> None:
    """One tiny step of each path, so neither pays first-call costs inside the timing."""
    tiny = [(x[:2], y[:2]) for x, y in shards]
    training = LocalTraining(epochs=1, batch_size=None, lr=0.01)
    sequential_round(model, theta, tiny, training)
    vectorized_round(model, theta, tiny, training, chunk_size)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    models = [build_model(args.model, args.skip_padding_taps, gemm).to(device)
              for gemm in ((False, True) if args.gemm_convs else (False,))]
    theta = [p.to(device) for p in initial_parameters(args.model, 0)]
    shards, source = make_shards(args, device)
    print(f"# {args.model}, {source} data, K_c={args.clients}, n_k={args.samples}, device={device}, "
          f"threads={torch.get_num_threads()}, chunk_size={args.chunk_size}, channels_last={args.channels_last}, "
          f"skip_padding_taps={args.skip_padding_taps}, gemm_convs={args.gemm_convs} (vectorised path)")
    for model in models:
        warm_up(model, theta, shards, args.chunk_size)
    ratios = {}
    for name, batch_size, epochs in CELLS:
        if name not in args.cells:
            continue
        training = LocalTraining(epochs=epochs, batch_size=batch_size, lr=0.01)
        (seq, vec, *gemm), (seq_cpu, vec_cpu, *gemm_cpu) = time_cell(models, theta, shards, training, args, device)
        ratios[name] = [seq / vec, *(seq / g for g in gemm)]
        line = (f"{name}: sequential {seq:.2f} s/round, vectorised {vec:.2f} s/round, speed-up {seq / vec:.2f}x "
                f"(CPU seconds {seq_cpu:.2f} vs {vec_cpu:.2f})")
        if gemm:
            line += (f"; vectorised with gemm-convs {gemm[0]:.2f} s/round, speed-up {seq / gemm[0]:.2f}x "
                     f"(CPU seconds {gemm_cpu[0]:.2f})")
        print(line, flush=True)
    if "bs32-tau2" in ratios:
        speedups = ratios["bs32-tau2"]
        print(f"bs32-tau2 speed-up (sequential/vectorised): {speedups[0]:.2f}"
              + (f"; with gemm-convs: {speedups[1]:.2f}" if len(speedups) > 1 else ""))


if __name__ == "__main__":
    main()
