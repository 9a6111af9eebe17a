"""The cohort pass (strategies/cohort_pass.py) for updates that are torch tensors on a device.

When the local engine trains on a GPU, the clients' Δ_k stay there, sparing each round ten
model-sized copies to the host and the numpy pass over them. Here each block's updates are
stacked into one (K_c, size) float64 tensor and the same sums are taken with a few reductions;
θ − step stays on the device too (the next round, the evaluation and the measurements read it
there), and only the scalars cross to the host. The sums are the numpy pass's up to float64
summation order (tests/test_device_pass.py runs both).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from clients.training import as_tensor

if TYPE_CHECKING:
    from strategies.cohort_pass import ServerStep


@dataclass(frozen=True)
class DeviceSums:
    """Σ over blocks of what one block contributes, as host floats."""

    sq_norms: list[float]  # ‖Δ_k‖² per client
    sq_norm_of_sum: float  # ‖Σ_k Δ_k‖²
    sq_norm_of_weighted_sum: float  # ‖Σ_k n_k Δ_k‖²


def tensor_device(updates: Sequence[Sequence]) -> torch.device | None:
    """The device of the first torch tensor among the updates, or None when all are numpy arrays."""
    for update in updates:
        for block in update:
            if isinstance(block, torch.Tensor):
                return block.device
    return None


def _flat64(block, device: torch.device) -> torch.Tensor:
    return as_tensor(block).reshape(-1).to(device, torch.float64)


@torch.no_grad()
def reduce_on_device(
    updates: Sequence[Sequence], weights: Sequence[float], step: ServerStep | None, device: torch.device
) -> tuple[DeviceSums, list[torch.Tensor] | None]:
    """The sums of ``reduce_cohort`` and, given ``step``, θ − step as tensors on ``device`` in θ's
    dtypes (θ itself may be numpy arrays or tensors).

    Blocks that are numpy arrays (a client whose update was corrupted on the host) are moved to
    ``device``; inputs are validated by ``reduce_cohort``.
    """
    w = torch.tensor(weights, dtype=torch.float64, device=device)
    sq_norms = torch.zeros(len(updates), dtype=torch.float64, device=device)
    sq_norm_of_sum = torch.zeros((), dtype=torch.float64, device=device)
    sq_norm_of_weighted_sum = torch.zeros((), dtype=torch.float64, device=device)
    new_params: list[torch.Tensor] | None = None if step is None else []
    for b in range(len(updates[0])):
        if len({int(np.prod(u[b].shape)) for u in updates}) > 1:
            raise ValueError(f"block {b} has different sizes across updates")
        stacked = torch.stack([_flat64(u[b], device) for u in updates])  # (K_c, size)
        total = stacked.sum(0)
        weighted_total = w @ stacked
        sq_norms += (stacked * stacked).sum(1)
        sq_norm_of_sum += total @ total
        sq_norm_of_weighted_sum += weighted_total @ weighted_total
        if step is not None:
            new_params.append(_server_step_block(step, b, stacked, total, weighted_total, w))
    sums = DeviceSums(sq_norms.tolist(), float(sq_norm_of_sum), float(sq_norm_of_weighted_sum))
    return sums, new_params


def _server_step_block(step: ServerStep, b: int, stacked: torch.Tensor, total: torch.Tensor,
                       weighted_total: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """θ^(b) − step^(b) in float64, rounded once to θ's dtype, on the updates' device (ServerStep
    says what the step is)."""
    theta = as_tensor(step.params[b])
    if theta.numel() != stacked.shape[1]:
        raise ValueError(f"block {b}: θ has {theta.numel()} values, updates have {stacked.shape[1]}")
    if step.block_coefs is not None:
        coefs = torch.tensor([c[b] for c in step.block_coefs], dtype=torch.float64, device=stacked.device)
        if step.coordinate_masks is not None:
            masks = step.coordinate_masks.for_tensor(b, stacked.shape[1])
            stacked = stacked * torch.as_tensor(np.stack(masks)).to(stacked.device)
        delta = coefs @ stacked
    elif step.weighted:
        delta = weighted_total / w.sum()
    else:
        delta = total / stacked.shape[0]
    return (_flat64(theta, stacked.device) - delta).to(theta.dtype).reshape(theta.shape)
