"""The models a run can train, 10 classes, on images of any input shape C×H×W (CIFAR-10's 3×32×32
unless told): ResNet-18 with GroupNorm(2 groups) in place of
BatchNorm (the paper's model), ``cnn-fedavg`` (the small CNN of the FedAvg paper: a second
architecture, for the paper's "one architecture" limit), and ``linear-softmax`` (one linear layer
on the flattened image, 2 blocks: fast smoke runs, and a model whose updates a test can compute
in closed form)."""

from __future__ import annotations

import math
import threading

import torch
import torchvision
from torch import nn

from clients.seeds import INIT, derive_seed
from fedmask_app.run.gemm_convs import use_gemm_convs
from fedmask_app.run.live_taps import use_live_taps

MODELS = ("resnet18-gn", "resnet18-gn-cifar", "cnn-fedavg", "linear-softmax")
CIFAR10_INPUT = (3, 32, 32)


def _group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(2, channels)


def fedavg_cnn(input_shape: tuple[int, int, int] = CIFAR10_INPUT) -> nn.Sequential:
    """The CNN of McMahan et al. (2017), "Communication-efficient learning of deep networks from
    decentralized data": two 5×5 convolutions ("same" padding; 32 and 64 channels, each followed by
    ReLU and 2×2 max-pooling), a 512-unit ReLU layer and the 10-way output; no normalisation
    layers. 8 blocks; 2,156,490 parameters on 3×32×32 images, 1,663,370 on 1×28×28 (the paper's
    MNIST count)."""
    channels, height, width = input_shape
    return nn.Sequential(
        nn.Conv2d(channels, 32, kernel_size=5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, kernel_size=5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * (height // 4) * (width // 4), 512), nn.ReLU(), nn.Linear(512, 10),
    )


# Every model's default initialisation draws from torch's global generator: runs in threads of one
# process (engines/run_group.py) build their models in turn, or θ_0's draws would interleave.
_GLOBAL_GENERATOR = threading.Lock()


def build_model(name: str, skip_padding_taps: bool = False, gemm_convs: bool = False,
                input_shape: tuple[int, int, int] = CIFAR10_INPUT) -> nn.Module:
    """``resnet18-gn``: torchvision's stem (7×7/2 conv + max-pool); ``resnet18-gn-cifar``: 3×3/1
    conv and no max-pool, the usual CIFAR stem (about 15× costlier on a CPU); ``cnn-fedavg``:
    ``fedavg_cnn``; ``linear-softmax``: flatten the image, then one ``nn.Linear`` (3072 → 10 on
    CIFAR-10; weight and bias: 2 blocks), for fast smoke runs. ``input_shape``: C, H, W of the
    images (the ResNets' first convolution takes C channels). ``skip_padding_taps``: convolutions skip the
    kernel taps that only read zero padding (fedmask_app/run/live_taps.py): the same function and
    parameters, float rounding aside. ``gemm_convs``: convolutions computed as one matrix product
    over image patches (fedmask_app/run/gemm_convs.py), the same function and parameters too."""
    with _GLOBAL_GENERATOR:
        model = _architecture(name, skip_padding_taps, input_shape)
    return use_gemm_convs(model) if gemm_convs else model


def _architecture(name: str, skip_padding_taps: bool, input_shape: tuple[int, int, int]) -> nn.Module:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: expected one of {', '.join(MODELS)}")
    if name == "linear-softmax":
        return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 10))
    if name == "cnn-fedavg":
        model = fedavg_cnn(input_shape)
    else:
        model = torchvision.models.resnet18(num_classes=10, norm_layer=_group_norm)
        channels = input_shape[0]
        if name == "resnet18-gn-cifar":
            model.conv1 = nn.Conv2d(channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
            model.maxpool = nn.Identity()
        elif channels != 3:  # torchvision's stem on C channels, initialised as torchvision initialises its own
            model.conv1 = nn.Conv2d(channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
            nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    return use_live_taps(model) if skip_padding_taps else model


def initial_parameters(name: str, run_seed: int,
                       input_shape: tuple[int, int, int] = CIFAR10_INPUT) -> list[torch.Tensor]:
    """θ_0: the model's default initialisation drawn under a seed derived from the run seed."""
    with _GLOBAL_GENERATOR, torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(run_seed, INIT))
        model = _architecture(name, False, input_shape)
    return [p.detach() for p in model.parameters()]


def parameter_names(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters()]
