"""The paper protocol's arithmetic, and what the 15-minute target of issue 15 asks of one H200.

Counts the floating-point operations of the model's convolutions and matrix products with
``torch.utils.flop_counter.FlopCounterMode`` (GroupNorm, ReLU, pooling and the SGD update are
not counted: they are memory-bound and a few percent of the arithmetic) for one training image
(forward and backward, in a bs-32 step) and one evaluation image (forward), multiplies them by
the protocol's image passes (grid 1 and grid 2's two extra cells, 3 seeds, 200 rounds,
K_c = 10 clients × n_k = 500 images × τ epochs; one evaluation of the 10,000 test images a
round: the constants of benchmarks/gpu_timing.py's projection) and divides by an H200's dense
peak rates (NVIDIA's H100/H200 SXM figures: FP32 66.9 TFLOP/s without tensor cores, TF32 494.7
and BF16 989.4 on tensor cores, without 2:4 sparsity). That gives the protocol's device time at
100% of peak, a bound that no implementation beats, and the share of peak that 15 minutes
needs; ``--measured-hours PRECISION=H`` adds the share that a projection of H hours reached.
A count, not a measurement: it needs no GPU.

    python benchmarks/protocol_flops.py --measured-hours float32=2.90 tf32=1.87 bf16=2.08
"""

from __future__ import annotations

import argparse

import torch
from gpu_timing import GRID1, GRID2_EXTRA, K_C, N_K, ROUNDS, SEEDS, TEST_IMAGES
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from fedmask_app.run.model import MODELS, build_model

# Dense peak TFLOP/s of one H200 (SXM; the same GH100 compute as the H100 SXM) per precision setting:
# float32 runs on the CUDA cores, tf32 and bf16 on the tensor cores.
H200_PEAK_TFLOPS = {"float32": 66.9, "tf32": 494.7, "bf16": 989.4}
TARGET_MINUTES = 15.0
BATCH = 32


def flops_per_image(model: nn.Module, batch: int = BATCH) -> tuple[float, float]:
    """(training, evaluation) FLOPs per 32×32 image: a step's forward + backward, and a forward."""
    images, labels = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    with FlopCounterMode(display=False) as train:
        nn.functional.cross_entropy(model(images), labels).backward()
    with torch.no_grad(), FlopCounterMode(display=False) as evaluation:
        model(images)
    return train.get_total_flops() / batch, evaluation.get_total_flops() / batch


def protocol_image_passes() -> tuple[int, int]:
    """(training image passes, evaluation image passes) of the whole protocol."""
    cells = (*GRID1, *GRID2_EXTRA)
    training = sum(SEEDS * ROUNDS * K_C * N_K * tau for _, tau in cells)
    evaluation = len(cells) * SEEDS * ROUNDS * TEST_IMAGES
    return training, evaluation


def parse_measured(pairs: list[str]) -> dict[str, float]:
    measured = {}
    for pair in pairs:
        precision, _, hours = pair.partition("=")
        if precision not in H200_PEAK_TFLOPS or not hours:
            raise SystemExit(f"--measured-hours takes PRECISION=HOURS with PRECISION in {sorted(H200_PEAK_TFLOPS)}, "
                             f"got {pair!r}")
        measured[precision] = float(hours)
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="resnet18-gn")
    parser.add_argument("--measured-hours", nargs="*", default=[], metavar="PRECISION=H",
                        help="a projected whole-protocol time, e.g. float32=2.90 (README: Measured on one H200)")
    args = parser.parse_args()
    measured = parse_measured(args.measured_hours)

    train_flops, eval_flops = flops_per_image(build_model(args.model))
    train_passes, eval_passes = protocol_image_passes()
    total = train_flops * train_passes + eval_flops * eval_passes
    print(f"# {args.model}: {train_flops / 1e6:.1f} MFLOP per training image (forward + backward, bs {BATCH}), "
          f"{eval_flops / 1e6:.1f} MFLOP per evaluation image (convolutions and matrix products only)")
    print(f"# protocol: {train_passes / 1e6:.1f} M training image passes + {eval_passes / 1e6:.1f} M evaluation "
          f"image passes = {total / 1e15:.2f} PFLOP")
    for precision, tflops in H200_PEAK_TFLOPS.items():
        bound_s = total / (tflops * 1e12)
        line = (f"{precision:8s} H200 peak {tflops:6.1f} TFLOP/s: {bound_s / 60:6.2f} min at 100% of peak; "
                f"{TARGET_MINUTES:.0f} min needs {bound_s / (TARGET_MINUTES * 60):6.1%} of peak")
        if precision in measured:
            share = bound_s / (measured[precision] * 3600)
            line += f"; a projection of {measured[precision]:.2f} h ran at {share:6.2%}"
        print(line)


if __name__ == "__main__":
    main()
