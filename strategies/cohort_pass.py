"""One pass over a cohort's updates: the sums behind the statistics and, optionally, θ − step.

The pass walks the model in chunks and, inside each chunk, over the clients. Every float64
accumulator is then chunk-sized and stays in cache, so the cohort costs one read of each update
and one write of θ, instead of reading and writing model-sized float64 sums once per client.
Per element, clients are folded in the order given (the caller sorts them by partition id), so
results do not depend on arrival order; only the dot products are summed chunk by chunk.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from clients.masking import coordinate_mask
from strategies.device_pass import reduce_on_device, tensor_device

CHUNK = 1 << 16  # elements; a few float64 buffers of this size fit in L2


@dataclass(frozen=True)
class CohortSums:
    """The scalars PAPER.md's statistics are made of, for K_c updates Δ_k with weights n_k."""

    cohort_size: int  # K_c
    total_weight: float  # Σ n_k
    sum_sq_norms: float  # Σ ‖Δ_k‖²
    weighted_sum_sq_norms: float  # Σ n_k² ‖Δ_k‖²
    sq_norm_of_sum: float  # ‖Σ Δ_k‖²
    sq_norm_of_weighted_sum: float  # ‖Σ n_k Δ_k‖²
    sq_norms: tuple[float, ...] = ()  # ‖Δ_k‖² of each client, in the order given (inf/nan: NaN or Inf in Δ_k)
    weights: tuple[float, ...] = ()  # n_k of each client, in the same order


@dataclass(frozen=True)
class CoordinateMasks:
    """Per-coordinate masks the server regenerates: client k's mask of tensor b is
    ``coordinate_mask(seeds[k], b, size, keep_prob)``."""

    seeds: Sequence[int]  # one per client, in the order of the updates
    keep_prob: float

    def for_tensor(self, tensor_index: int, size: int) -> list[np.ndarray]:
        """Every client's mask of one tensor (one draw per distinct seed: synchronized masks share one)."""
        drawn: dict[int, np.ndarray] = {}
        for seed in self.seeds:
            if seed not in drawn:
                drawn[seed] = coordinate_mask(seed, tensor_index, size, self.keep_prob)
        return [drawn[seed] for seed in self.seeds]


@dataclass(frozen=True)
class ServerStep:
    """How the pass forms θ − step: step = Σ_k c_kb Δ_k^(b) with c_kb = ``block_coefs[k][b]``
    (masked; with ``coordinate_masks``, Σ_k c_kb (m_k^(b) ⊙ Δ_k^(b))), else Σ_k n_k Δ_k / Σ_k n_k
    (``weighted``) or Σ_k Δ_k / K_c."""

    params: Sequence[np.ndarray]  # θ
    weighted: bool = True
    block_coefs: Sequence[Sequence[float]] | None = None
    coordinate_masks: CoordinateMasks | None = None


def _check(updates: Sequence[Sequence], weights: Sequence[float]) -> int:
    if not updates:
        raise ValueError("no updates were given")
    if len(weights) != len(updates):
        raise ValueError(f"{len(updates)} updates but {len(weights)} weights")
    for w in weights:
        if not w > 0:
            raise ValueError(f"client weight must be positive, got {w}")
    num_blocks = len(updates[0])
    for update in updates:
        if len(update) != num_blocks:
            raise ValueError(f"an update has {len(update)} blocks, another has {num_blocks}")
    return num_blocks


@dataclass
class _Partial:
    """What one block contributes (summed over blocks in block order, whichever thread ran it)."""

    sq_norms: list[float]
    sq_norm_of_sum: float = 0.0
    sq_norm_of_weighted_sum: float = 0.0


def _reduce_blocks(
    blocks: Sequence[int], updates: Sequence[Sequence], weights: Sequence[float], step: ServerStep | None,
    new_params: list,
) -> list[tuple[int, _Partial]]:
    total_weight = sum(weights)
    buffers = np.empty((5, CHUNK))
    done = []
    for b in blocks:
        partial = _Partial(sq_norms=[0.0] * len(updates))
        done.append((b, partial))
        flats = [np.asarray(u[b]).reshape(-1) for u in updates]
        size = flats[0].size
        if any(f.size != size for f in flats):
            raise ValueError(f"block {b} has different sizes across updates")
        if step is not None:
            theta = np.asarray(step.params[b])
            if theta.size != size:
                raise ValueError(f"block {b}: θ has {theta.size} values, updates have {size}")
            theta_flat = theta.reshape(-1)
            out = np.empty(size, dtype=theta.dtype)
        masks = None
        if step is not None and step.coordinate_masks is not None:
            masks = step.coordinate_masks.for_tensor(b, size)
        for lo in range(0, size, CHUNK):
            n = min(CHUNK, size - lo)
            x, scaled, total, weighted_total, masked_total = (buf[:n] for buf in buffers)
            for k, flat in enumerate(flats):
                np.copyto(x, flat[lo : lo + n])
                partial.sq_norms[k] += float(np.einsum("i,i->", x, x))
                np.multiply(x, weights[k], out=scaled)
                if k == 0:
                    total[:] = x
                    weighted_total[:] = scaled
                else:
                    total += x
                    weighted_total += scaled
                if step is not None and step.block_coefs is not None:
                    coef = step.block_coefs[k][b]
                    if k == 0 or coef != 0.0:
                        target = masked_total if k == 0 else scaled
                        np.multiply(x, coef, out=target)
                        if masks is not None:
                            np.multiply(target, masks[k][lo : lo + n], out=target)
                        if k != 0:
                            masked_total += scaled
            partial.sq_norm_of_sum += float(np.einsum("i,i->", total, total))
            partial.sq_norm_of_weighted_sum += float(np.einsum("i,i->", weighted_total, weighted_total))
            if step is not None:
                if step.block_coefs is not None:
                    delta = masked_total
                elif step.weighted:
                    delta = np.divide(weighted_total, total_weight, out=scaled)
                else:
                    delta = np.divide(total, len(updates), out=scaled)
                # In float64, rounded once to θ's dtype: (θ − step).astype(θ.dtype).
                np.subtract(theta_flat[lo : lo + n], delta, out=out[lo : lo + n], casting="unsafe")
        if step is not None:
            new_params[b] = out.reshape(theta.shape)
    return done


def _split_blocks(sizes: Sequence[int], parts: int) -> list[list[int]]:
    """Block indices in ``parts`` contiguous groups of about equal total size."""
    total, groups, current, filled = sum(sizes), [], [], 0
    for b, size in enumerate(sizes):
        current.append(b)
        filled += size
        if filled >= total * (len(groups) + 1) / parts and len(groups) < parts - 1:
            groups.append(current)
            current = []
    groups.append(current)
    return [g for g in groups if g]


def reduce_cohort(
    updates: Sequence[Sequence], weights: Sequence[float], step: ServerStep | None = None, threads: int = 0
) -> tuple[CohortSums, list | None]:
    """The cohort's sums and, when ``step`` is given, θ − step in θ's dtypes and shapes.

    ``updates[k]`` is client k's Δ_k as a list of arrays (one per parameter tensor), any float
    dtype; everything is accumulated in float64. Updates (or θ) that hold torch tensors are reduced
    on their device (``strategies.device_pass``), and θ − step then stays there as tensors.
    ``threads`` share the blocks (0: all cores); neither θ nor the sums depend on it: each
    block's sums are added up in block order.
    """
    num_blocks = _check(updates, weights)
    weights = [float(w) for w in weights]
    if step is not None:
        if len(step.params) != num_blocks:
            raise ValueError(f"model has {len(step.params)} blocks, updates have {num_blocks}")
        if step.block_coefs is not None and any(len(c) != num_blocks for c in step.block_coefs):
            raise ValueError(f"every client needs one mask coefficient per block ({num_blocks})")
        if step.coordinate_masks is not None:
            if step.block_coefs is None:
                raise ValueError("coordinate masks need block_coefs (the w_k / p of every client)")
            if len(step.coordinate_masks.seeds) != len(updates):
                raise ValueError(f"{len(step.coordinate_masks.seeds)} mask seeds for {len(updates)} updates")
    device = tensor_device(updates) or (tensor_device([step.params]) if step is not None else None)
    if device is not None:  # Δ_k left on the device by the local engine (strategies/device_pass.py)
        on_device, new_params = reduce_on_device(updates, weights, step, device)
        return _sums(weights, on_device.sq_norms, on_device.sq_norm_of_sum,
                     on_device.sq_norm_of_weighted_sum), new_params
    groups = _split_blocks([np.size(block) for block in updates[0]], threads or os.cpu_count() or 1)
    new_params = [None] * num_blocks
    if len(groups) == 1:
        per_group = [_reduce_blocks(groups[0], updates, weights, step, new_params)]
    else:
        with ThreadPoolExecutor(len(groups)) as pool:
            per_group = list(pool.map(lambda g: _reduce_blocks(g, updates, weights, step, new_params), groups))
    partials = [partial for _, partial in sorted((pair for group in per_group for pair in group), key=lambda p: p[0])]
    sq_norms = [sum(p.sq_norms[k] for p in partials) for k in range(len(updates))]
    sums = _sums(weights, sq_norms, sum(p.sq_norm_of_sum for p in partials),
                 sum(p.sq_norm_of_weighted_sum for p in partials))
    return sums, (new_params if step is not None else None)


def _sums(weights: list[float], sq_norms: list[float], sq_norm_of_sum: float,
          sq_norm_of_weighted_sum: float) -> CohortSums:
    return CohortSums(
        cohort_size=len(sq_norms),
        total_weight=sum(weights),
        sum_sq_norms=sum(sq_norms),
        weighted_sum_sq_norms=sum(w * w * s for w, s in zip(weights, sq_norms, strict=True)),
        sq_norm_of_sum=sq_norm_of_sum,
        sq_norm_of_weighted_sum=sq_norm_of_weighted_sum,
        sq_norms=tuple(sq_norms),
        weights=tuple(weights),
    )
