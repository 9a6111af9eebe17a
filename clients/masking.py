"""Block-wise update masking: one Bernoulli(p) draw per parameter tensor, kept blocks scaled by 1/p."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


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
