"""Where one training step's time goes: wall time against the device's busy time, and the kernels.

For each path — one client's SGD step (``clients.training.SGDStep``), the vectorised cohort step
(``clients.vectorized.CohortStep``: K_c clients at once), on CUDA each replayed from a CUDA graph
(``clients.cuda_graphs``), and on CUDA K_c clients' steps issued side by side on a stream each
(``clients.streams.StreamedClients``: "streams", with graphs "streams-graphs") — prints the wall
milliseconds per step (steps issued back to back, synchronised once) and, from
``torch.profiler`` over the same steps, the device time per step summed over kernels, the
kernels launched per step and the most expensive kernels. When
the device time is close to the wall time the step is bound by the GPU's kernels; when it is
far below, by the CPU issuing them (which CUDA graphs remove). On the streams paths kernels of
different clients overlap, so their sum may pass the wall time. ``--cudnn-benchmark`` measures
each path again with cuDNN's autotuner choosing the convolution algorithms (the engine leaves it
off: under float32's deterministic setting it picks among deterministic algorithms only, but its
choice may differ from run to run). ``--channels-last`` measures the one-client paths again with
the model and the images in channels-last (NHWC) layout, a candidate and not an engine setting:
cuDNN's tensor-core convolutions work in NHWC and transpose NCHW tensors to it (the float32
vectorised step spent 7.2 of its 60.6 kernel milliseconds in such transposes on an H200), but
GroupNorm's CUDA kernels may convert back. ``--gemm-convs`` measures each path again with the
model's convolutions as matrix products over patches (``gemm-convs = true``: under vmap one
batched GEMM for all clients instead of a grouped convolution, which cuDNN ran group by group on
an H200). Synthetic CIFAR-shaped batches: the timing does not
depend on the pixels.

    python benchmarks/step_profile.py --device cuda --precision float32 tf32 --cudnn-benchmark
    python benchmarks/step_profile.py --device cuda --precision bf16 --paths graphs vec-graphs --gemm-convs
    python benchmarks/step_profile.py --device cpu --steps 2 --clients 2   # a CPU check of the script
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from clients.cuda_graphs import CudaGraphCohortStep, CudaGraphStep
from clients.streams import StreamedClients
from clients.training import LocalTraining, SGDStep
from clients.vectorized import CohortStep
from fedmask_app.run.config import run_config_from_values
from fedmask_app.run.device import compute_setup
from fedmask_app.run.model import MODELS, build_model

PATHS = ("sequential", "graphs", "vectorised", "vec-graphs", "streams", "streams-graphs")
COHORT_PATHS = ("vectorised", "vec-graphs", "streams", "streams-graphs")  # a step: every client's step


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--precision", nargs="+", choices=("float32", "tf32", "bf16"), default=["float32"])
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--model", choices=MODELS, default="resnet18-gn")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--clients", type=int, default=10, help="K_c of the vectorised and streams steps")
    parser.add_argument("--steps", type=int, default=20, help="timed and profiled steps per path")
    parser.add_argument("--top", type=int, default=6, help="kernels listed per path")
    parser.add_argument("--skip-padding-taps", action="store_true")
    parser.add_argument("--cudnn-benchmark", action="store_true",
                        help="each path again with cuDNN's autotuner on (the engine leaves it off), side by side")
    parser.add_argument("--channels-last", action="store_true",
                        help="the one-client paths (sequential, graphs) again with model and images channels-last")
    parser.add_argument("--gemm-convs", action="store_true",
                        help="each path again with gemm-convs = true (convolutions as matrix products), side by side")
    return parser.parse_args(argv)


def step_function(path: str, model: torch.nn.Module, training: LocalTraining, clients: int,
                  device: torch.device, dtype: torch.dtype,
                  memory_format: torch.memory_format = torch.contiguous_format) -> Callable[[], object]:
    """One step of ``path`` on fixed synthetic batches, as a no-argument callable; ``memory_format``
    (one-client paths only): the model's and the images' layout."""
    gen = torch.Generator().manual_seed(0)
    if path in ("sequential", "graphs"):
        model.to(memory_format=memory_format)
        images = torch.randn(training.batch_size, 3, 32, 32, generator=gen).to(device, dtype)
        images = images.contiguous(memory_format=memory_format)
        labels = torch.randint(0, 10, (training.batch_size,), generator=gen).to(device)
        step = CudaGraphStep(model, training) if path == "graphs" else SGDStep(model, training)
        return lambda: step(images, labels)
    if path.startswith("streams"):
        return streams_step(path, model, training, clients, device, dtype, gen)
    images = torch.randn(clients, training.batch_size, 3, 32, 32, generator=gen).to(device, dtype)
    labels = torch.randint(0, 10, (clients, training.batch_size), generator=gen).to(device)
    weights = torch.ones(clients, training.batch_size, device=device)
    counts = torch.full((clients,), training.batch_size, device=device)
    step = CudaGraphCohortStep(model, training) if path == "vec-graphs" else CohortStep(model, training)
    stacked = step.stacked_params([[p.detach() for p in model.parameters()]], [clients])
    return lambda: step(stacked, None, images, labels, weights, counts)


def streams_step(path: str, model: torch.nn.Module, training: LocalTraining, clients: int, device: torch.device,
                 dtype: torch.dtype, gen: torch.Generator) -> Callable[[], object]:
    """Each of ``clients`` replicas takes one step on its own stream, as client-streams trains them."""
    make_step = (lambda replica: CudaGraphStep(replica, training)) if path == "streams-graphs" else None
    streamed = StreamedClients(model, training, clients, make_step)
    batches = [(torch.randn(training.batch_size, 3, 32, 32, generator=gen).to(device, dtype),
                torch.randint(0, 10, (training.batch_size,), generator=gen).to(device)) for _ in range(clients)]

    def run() -> None:
        for stream, step, (images, labels) in zip(streamed.streams, streamed.steps, batches, strict=True):
            with torch.cuda.stream(stream):
                step(images, labels)

    return run


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(run_step: Callable[[], object], steps: int, device: torch.device, top: int) -> str:
    """Wall ms per step, then the profiler's device time, kernel count and top kernels per step."""
    for _ in range(3):  # warm-up: cuDNN's algorithm choice, a CUDA graph's capture
        run_step()
    sync(device)
    started = time.perf_counter()
    for _ in range(steps):
        run_step()
    sync(device)
    wall_ms = (time.perf_counter() - started) * 1000 / steps
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            run_step()
        sync(device)
    lines = [f"wall {wall_ms:8.2f} ms/step"]
    if device.type == "cuda":
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy_ms = sum(e.device_time_total for e in kernels) / 1000 / steps
        lines[0] += (f", kernels {busy_ms:8.2f} ms/step ({busy_ms / wall_ms:4.0%} of wall), "
                     f"{len(kernels) / steps:.0f} kernels/step")
        per_name: dict[str, float] = {}
        for e in kernels:
            per_name[e.name] = per_name.get(e.name, 0.0) + e.device_time_total / 1000 / steps
        for name, ms in sorted(per_name.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"    {ms:7.3f} ms/step  {name[:110]}")
    else:
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
        lines.extend("    " + line for line in table.splitlines())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"# step_profile: {args.model}, bs {args.batch_size}, K_c {args.clients} (a step of "
          f"{', '.join(COHORT_PATHS)}: every client's step), {args.steps} steps per path, "
          f"torch {torch.__version__}, skip-padding-taps {args.skip_padding_taps}", flush=True)
    failed = False
    for precision in args.precision:
        cfg = run_config_from_values({"device": args.device, "precision": precision, "model": args.model})
        device, dtype = compute_setup(cfg)
        training = LocalTraining(epochs=1, batch_size=args.batch_size, lr=0.01, bf16=precision == "bf16")
        for path in args.paths:
            layouts = [torch.contiguous_format]
            if args.channels_last and path in ("sequential", "graphs"):
                layouts.append(torch.channels_last)
            for gemm, autotune, layout in itertools.product((False, True) if args.gemm_convs else (False,),
                                                            (False, True) if args.cudnn_benchmark else (False,),
                                                            layouts):
                extras = ", gemm-convs" if gemm else ""
                extras += ", cudnn.benchmark" if autotune else ""
                extras += ", channels-last" if layout is torch.channels_last else ""
                label = f"{precision:8s} {path:14s} ({device.type}{extras})"
                if (path.endswith("graphs") or path.startswith("streams")) and device.type != "cuda":
                    print(f"{label}: skipped (CUDA graphs and streams need a CUDA device)", flush=True)
                    continue
                torch.backends.cudnn.benchmark = autotune
                try:
                    model = build_model(args.model, args.skip_padding_taps, gemm).to(device, dtype)
                    report = measure(step_function(path, model, training, args.clients, device, dtype, layout),
                                     args.steps, device, args.top)
                except Exception as exc:  # report and go on: one failing path must not hide the others
                    print(f"{label}: FAILED {type(exc).__name__}: {exc}", flush=True)
                    failed = True
                    continue
                finally:
                    torch.backends.cudnn.benchmark = False
                print(f"{label}: {report}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
