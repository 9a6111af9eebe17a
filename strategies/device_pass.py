"""The cohort pass (strategies/cohort_pass.py) for updates that are torch tensors on a device.

When the local engine trains on a GPU, the clients' Δ_k stay there, sparing each round ten
model-sized copies to the host and the numpy pass over them. Here the cohort's updates become one
(K_c, P) float64 matrix, every block's values side by side in a row, and the sums are a few
reductions over it; θ − step stays on the device too (the next round, the evaluation and the
measurements read it there), and only the scalars cross to the host, once. (Block by block, the
pass launched hundreds of small kernels a round and waited for the device at every block whose
coefficients it copied over.) The sums are the numpy pass's up to float64 summation order
(tests/test_device_pass.py runs both).
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


def _stack_rows(updates: Sequence[Sequence], device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """The updates as one (K_c, P) float64 matrix on ``device`` (client k's blocks, flattened, one
    after another in row k) and the blocks' sizes."""
    sizes = []
    for b in range(len(updates[0])):
        block_sizes = {int(np.prod(u[b].shape)) for u in updates}
        if len(block_sizes) > 1:
            raise ValueError(f"block {b} has different sizes across updates")
        sizes.append(block_sizes.pop())
    rows = [torch.cat([as_tensor(block).reshape(-1).to(device) for block in update]) for update in updates]
    return torch.stack(rows).to(torch.float64), sizes


@torch.no_grad()
def reduce_on_device(
    updates: Sequence[Sequence], weights: Sequence[float], step: ServerStep | None, device: torch.device
) -> tuple[DeviceSums, list[torch.Tensor] | None]:
    """The sums of ``reduce_cohort`` and, given ``step``, θ − step as tensors on ``device`` in θ's
    dtypes (θ itself may be numpy arrays or tensors).

    Blocks that are numpy arrays (a client whose update was corrupted on the host) are moved to
    ``device``; inputs are validated by ``reduce_cohort``.
    """
    stacked, sizes = _stack_rows(updates, device)  # (K_c, P)
    w = torch.tensor(weights, dtype=torch.float64, device=device)
    total = stacked.sum(0)
    weighted_total = w @ stacked
    scalars = torch.cat([(stacked * stacked).sum(1), (total @ total)[None], (weighted_total @ weighted_total)[None]])
    new_params = None if step is None else _server_step(step, stacked, sizes, total, weighted_total, w)
    *sq_norms, sq_norm_of_sum, sq_norm_of_weighted_sum = scalars.tolist()  # the one wait for the device
    return DeviceSums(sq_norms, sq_norm_of_sum, sq_norm_of_weighted_sum), new_params


def _server_step(step: ServerStep, stacked: torch.Tensor, sizes: list[int], total: torch.Tensor,
                 weighted_total: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    """θ − step block by block, each in float64 and rounded once to its block's dtype, on the
    updates' device (ServerStep says what the step is)."""
    if len(step.params) != len(sizes):
        raise ValueError(f"θ has {len(step.params)} blocks, the updates {len(sizes)}")
    if step.block_coefs is None:
        delta = weighted_total / w.sum() if step.weighted else total / stacked.shape[0]
    else:
        coefs = torch.tensor(step.block_coefs, dtype=torch.float64, device=stacked.device)  # (K_c, blocks)
    new_params, offset = [], 0
    for b, (theta, size) in enumerate(zip(map(as_tensor, step.params), sizes, strict=True)):
        if theta.numel() != size:
            raise ValueError(f"block {b}: θ has {theta.numel()} values, updates have {size}")
        if step.block_coefs is None:
            block_delta = delta[offset : offset + size]
        else:
            block = stacked[:, offset : offset + size]
            if step.coordinate_masks is not None:
                masks = step.coordinate_masks.for_tensor(b, size)
                block = block * torch.as_tensor(np.stack(masks)).to(block.device)
            block_delta = coefs[:, b] @ block
        new_params.append((_flat64(theta, stacked.device) - block_delta).to(theta.dtype).reshape(theta.shape))
        offset += size
    return new_params
