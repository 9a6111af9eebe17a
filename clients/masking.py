"""Block-wise update masking: one Bernoulli(p) draw per parameter tensor, kept blocks scaled by 1/p."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from clients.seeds import independent_mask_seed


def block_mask(seed: int, num_blocks: int, keep_prob: float) -> np.ndarray:
    """m^(b) ~ Bernoulli(p), independent across the B blocks; returns a bool vector of length B."""
    if not 0.0 < keep_prob <= 1.0:
        raise ValueError(f"keep_prob must be in (0, 1], got {keep_prob}")
    return np.random.default_rng(seed).random(num_blocks) < keep_prob


def mask_scales(keep: Sequence[bool], keep_prob: float) -> list[float]:
    """Per-block factor m^(b) / p of the masked update, as Python floats (they keep float32 float32)."""
    return [1.0 / keep_prob if kept else 0.0 for kept in keep]


def apply_mask(update: Sequence, keep: Sequence[bool], keep_prob: float) -> list:
    """Δ̃^(b) = (m^(b) / p) · Δ^(b); works on numpy arrays and torch tensors alike."""
    if len(update) != len(keep):
        raise ValueError(f"mask has {len(keep)} blocks, update has {len(update)}")
    return [block * scale for block, scale in zip(update, mask_scales(keep, keep_prob), strict=True)]


def client_block_mask(
    mask_mode: str, keep_prob: float, num_blocks: int, run_seed: int, server_round: int, partition_id: int,
    sync_seed: int | None,
) -> list[bool] | None:
    """The block mask a client draws this round, or None when masking is off: from the server's
    broadcast seed in ``synchronized`` mode (one mask for the cohort), from (run seed, round,
    partition id) in ``independent`` mode."""
    if mask_mode == "none":
        return None
    if mask_mode == "synchronized":
        if sync_seed is None:
            raise ValueError("synchronized masking needs the server's mask seed in the train config")
        seed = sync_seed
    elif mask_mode == "independent":
        seed = independent_mask_seed(run_seed, server_round, partition_id)
    else:
        raise ValueError(f"unknown mask mode {mask_mode!r}: expected none, independent or synchronized")
    return block_mask(seed, num_blocks, keep_prob).tolist()
