"""A tiny model and batch for the curvature and flatness tests: small enough to form H exactly."""

from __future__ import annotations

import torch
from torch import nn


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def tiny_mlp(dtype: torch.dtype = torch.float64) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 10), nn.Tanh(), nn.Linear(10, 3)).to(dtype)


def tiny_batch(dtype: torch.dtype = torch.float64, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = generator(1)
    return torch.randn(n, 8, generator=g, dtype=torch.float64).to(dtype), torch.randint(0, 3, (n,), generator=g)
