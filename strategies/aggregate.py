"""FedAvg's server step over (masked) client updates: θ ← θ − Σ_k w_k Δ̃_k, streaming."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from clients.masking import mask_scales
from strategies.stats import CohortStatistics


def client_weights(num_examples: Sequence[int], aggregation: str) -> list[float]:
    """w_k = n_k / Σ_j n_j ("weighted", the paper's runs) or 1 / K_c ("uniform")."""
    if aggregation == "weighted":
        total = float(sum(num_examples))
        return [n / total for n in num_examples]
    if aggregation == "uniform":
        return [1.0 / len(num_examples)] * len(num_examples)
    raise ValueError(f"unknown aggregation {aggregation!r}: expected 'weighted' or 'uniform'")


@dataclass
class MaskedMeanUpdate:
    """Σ_k w_k (m_k^(b)/p) Δ_k^(b), accumulated in float64 one client at a time."""

    steps: list[np.ndarray] = field(default_factory=list)

    def add(self, update: Sequence, weight: float, block_scales: Sequence[float]) -> None:
        """Fold in w_k · Δ̃_k; ``block_scales`` are the m^(b)/p of the client's mask."""
        if len(block_scales) != len(update):
            raise ValueError(f"mask has {len(block_scales)} blocks, update has {len(update)}")
        first = not self.steps
        for b, (block, scale) in enumerate(zip(update, block_scales, strict=True)):
            coef = weight * scale
            if first:
                self.steps.append(np.asarray(block, dtype=np.float64) * coef)
            elif coef != 0.0:
                self.steps[b] += coef * np.asarray(block, dtype=np.float64)


def apply_step(global_params: Sequence[np.ndarray], steps: Sequence[np.ndarray]) -> list[np.ndarray]:
    """θ − Σ_k w_k Δ̃_k, block by block, in the dtype and shape of θ."""
    if len(global_params) != len(steps):
        raise ValueError(f"model has {len(global_params)} blocks, updates have {len(steps)}")
    out = []
    for theta, step in zip(global_params, steps, strict=True):
        theta = np.asarray(theta)
        out.append((theta.astype(np.float64) - step.reshape(theta.shape)).astype(theta.dtype))
    return out


@dataclass
class ClientReply:
    """What one client returns: its unmasked update Δ_k and the block mask it drew.

    The server scales kept blocks by 1/p when it averages (the masked update Δ̃_k), and computes
    the statistics on Δ_k itself.
    """

    partition_id: int
    num_examples: int
    train_loss: float
    update: list[np.ndarray]
    keep: list[bool] | None  # m^(b) per block; None when masking is off


def reply_problem(reply: ClientReply, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[np.dtype]) -> str | None:
    """Why a reply cannot enter the aggregate (wrong layout, non-finite values), or None."""
    if len(reply.update) != len(shapes):
        return f"{len(reply.update)} arrays, expected {len(shapes)}"
    if reply.keep is not None and len(reply.keep) != len(shapes):
        return f"mask of {len(reply.keep)} blocks, expected {len(shapes)}"
    if reply.num_examples <= 0:
        return f"num-examples = {reply.num_examples}"
    for b, (block, shape, dtype) in enumerate(zip(reply.update, shapes, dtypes, strict=True)):
        if block.shape != tuple(shape):
            return f"array {b} has shape {block.shape}, expected {tuple(shape)}"
        if block.dtype != dtype:
            return f"array {b} has dtype {block.dtype}, expected {dtype}"
        if not np.isfinite(block).all():
            return f"array {b} holds NaN or Inf"
    return None


@dataclass
class CohortResult:
    params: list[np.ndarray]
    stats: dict[str, float]
    train_loss: float  # n_k-weighted mean of the clients' training losses
    num_examples: int
    partition_ids: list[int]


def aggregate_cohort(
    global_params: Sequence[np.ndarray], replies: Sequence[ClientReply], aggregation: str, keep_prob: float
) -> CohortResult:
    """θ ← θ − Σ_k w_k Δ̃_k and the cohort statistics of the unmasked Δ_k, in one pass.

    Replies are taken in partition-id order, so float results do not depend on arrival order.
    """
    if not replies:
        raise ValueError("no client replies to aggregate")
    ordered = sorted(replies, key=lambda r: r.partition_id)
    counts = [r.num_examples for r in ordered]
    weights = client_weights(counts, aggregation)
    stats = CohortStatistics()
    masked = MaskedMeanUpdate() if any(r.keep is not None for r in ordered) else None
    for reply, weight in zip(ordered, weights, strict=True):
        update = [np.asarray(block, dtype=np.float64) for block in reply.update]  # converted once, used twice
        stats.add(update, float(reply.num_examples))
        if masked is not None:
            keep = [True] * len(update) if reply.keep is None else reply.keep
            masked.add(update, weight, mask_scales(keep, keep_prob))
    # Unmasked, the mean update is one of the sums the statistics already hold.
    steps = masked.steps if masked is not None else stats.mean_update(weighted=aggregation == "weighted")
    total = sum(counts)
    return CohortResult(
        params=apply_step(global_params, steps),
        stats=stats.result(),
        train_loss=sum(r.train_loss * r.num_examples for r in ordered) / total,
        num_examples=total,
        partition_ids=[r.partition_id for r in ordered],
    )
