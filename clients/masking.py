"""Update masking, per tensor or per coordinate: Bernoulli(p) draws, kept blocks scaled by 1/p.

A block is one parameter tensor (granularity ``"tensor"``; the mask is a bit per tensor and
travels with the reply) or one coordinate (``"coordinate"``, update dropout; the mask is never
sent: the server regenerates it from the same seed).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from clients.seeds import independent_mask_seed, synchronized_mask_seed


def block_mask(seed: int, num_blocks: int, keep_prob: float) -> np.ndarray:
    """m^(b) ~ Bernoulli(p), independent across the B blocks; returns a bool vector of length B."""
    _check_keep_prob(keep_prob)
    return np.random.default_rng(seed).random(num_blocks) < keep_prob


def coordinate_mask(seed: int, tensor_index: int, size: int, keep_prob: float) -> np.ndarray:
    """m_i ~ Bernoulli(p) for each of the ``size`` coordinates of parameter tensor ``tensor_index``,
    flat, as bools: u_i < p with u = ``random(size, float32)`` of child ``tensor_index`` of the mask
    seed's SeedSequence. Tensor by tensor, so the server can regenerate a mask a piece at a time."""
    _check_keep_prob(keep_prob)
    stream = np.random.SeedSequence(seed, spawn_key=(tensor_index,))
    return np.random.default_rng(stream).random(size, dtype=np.float32) < np.float32(keep_prob)


def mask_scales(keep: Sequence[bool], keep_prob: float) -> list[float]:
    """Per-block factor m^(b) / p of the masked update, as Python floats (they keep float32 float32)."""
    return [1.0 / keep_prob if kept else 0.0 for kept in keep]


def apply_mask(update: Sequence, keep: Sequence[bool], keep_prob: float) -> list:
    """Δ̃^(b) = (m^(b) / p) · Δ^(b); works on numpy arrays and torch tensors alike."""
    if len(update) != len(keep):
        raise ValueError(f"mask has {len(keep)} blocks, update has {len(update)}")
    return [block * scale for block, scale in zip(update, mask_scales(keep, keep_prob), strict=True)]


def mask_seed(mask_mode: str, run_seed: int, server_round: int, partition_id: int, sync_seed: int | None) -> int | None:
    """The seed of a client's mask this round, or None when masking is off: the server's broadcast
    seed in ``synchronized`` mode (one mask for the cohort), (run seed, round, partition id) in
    ``independent`` mode."""
    if mask_mode == "none":
        return None
    if mask_mode == "synchronized":
        if sync_seed is None:
            raise ValueError("synchronized masking needs the server's mask seed in the train config")
        return sync_seed
    if mask_mode == "independent":
        return independent_mask_seed(run_seed, server_round, partition_id)
    raise ValueError(f"unknown mask mode {mask_mode!r}: expected none, independent or synchronized")


def coordinate_mask_seeds(
    mask_mode: str, granularity: str, run_seed: int, server_round: int, partition_ids: Sequence[int],
) -> dict[int, int] | None:
    """What the server regenerates a cohort's coordinate masks from: partition id -> mask seed
    (``mask_seed``). None when masking is off or per tensor (those masks travel with the replies)."""
    if granularity == "tensor" or mask_mode == "none":
        return None
    if granularity != "coordinate":
        raise ValueError(f"unknown mask granularity {granularity!r}: expected tensor or coordinate")
    sync_seed = synchronized_mask_seed(run_seed, server_round) if mask_mode == "synchronized" else None
    return {pid: mask_seed(mask_mode, run_seed, server_round, pid, sync_seed) for pid in partition_ids}


def client_block_mask(
    mask_mode: str, keep_prob: float, num_blocks: int, run_seed: int, server_round: int, partition_id: int,
    sync_seed: int | None,
) -> list[bool] | None:
    """The per-tensor mask a client draws this round (``mask_seed``), or None when masking is off."""
    seed = mask_seed(mask_mode, run_seed, server_round, partition_id, sync_seed)
    return None if seed is None else block_mask(seed, num_blocks, keep_prob).tolist()


def _check_keep_prob(keep_prob: float) -> None:
    if not 0.0 < keep_prob <= 1.0:
        raise ValueError(f"keep_prob must be in (0, 1], got {keep_prob}")
