"""FedAvg's server step over (masked) client updates: θ ← θ − Σ_k w_k Δ̃_k."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from clients.masking import mask_scales
from strategies.cohort_pass import CohortSums, CoordinateMasks, ServerStep, reduce_cohort
from strategies.stats import cohort_result


def client_weights(num_examples: Sequence[int], aggregation: str) -> list[float]:
    """w_k = n_k / Σ_j n_j ("weighted", the paper's runs) or 1 / K_c ("uniform")."""
    if aggregation == "weighted":
        total = float(sum(num_examples))
        return [n / total for n in num_examples]
    if aggregation == "uniform":
        return [1.0 / len(num_examples)] * len(num_examples)
    raise ValueError(f"unknown aggregation {aggregation!r}: expected 'weighted' or 'uniform'")


@dataclass
class ClientReply:
    """What one client returns: its unmasked update Δ_k and the per-tensor mask it drew.

    The server scales kept blocks by 1/p when it averages (the masked update Δ̃_k), and computes
    the statistics on Δ_k itself. Coordinate masks are not sent (``keep`` is None): the server
    regenerates them from the clients' mask seeds.
    """

    partition_id: int
    num_examples: int
    train_loss: float
    update: list[np.ndarray]  # or torch tensors on the device they were trained on (local engine, CUDA)
    keep: list[bool] | None  # m^(b) per tensor; None when masking is off or per coordinate


def reply_problem(reply: ClientReply, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[np.dtype]) -> str | None:
    """Why a reply cannot enter the aggregate (wrong layout), or None. NaN/Inf values are found
    by the aggregation pass itself (``NonFiniteUpdates``), which reads every value anyway."""
    if len(reply.update) != len(shapes):
        return f"{len(reply.update)} arrays, expected {len(shapes)}"
    if reply.keep is not None and len(reply.keep) != len(shapes):
        return f"mask of {len(reply.keep)} blocks, expected {len(shapes)}"
    if reply.num_examples <= 0:
        return f"num-examples = {reply.num_examples}"
    for b, (block, shape, dtype) in enumerate(zip(reply.update, shapes, dtypes, strict=True)):
        if block.shape != tuple(shape):
            return f"array {b} has shape {block.shape}, expected {tuple(shape)}"
        expected = _name(dtype)
        if _dtype_name(block) != expected:
            return f"array {b} has dtype {_dtype_name(block)}, expected {expected}"
    return None


def _dtype_name(block) -> str:
    """'float32' for a numpy array and a torch tensor alike (the local engine keeps Δ_k on a GPU)."""
    return _name(block.dtype)


def _name(dtype) -> str:
    """'float32' for numpy's and torch's float32 alike."""
    text = str(dtype)
    return text.removeprefix("torch.") if text.startswith("torch.") else np.dtype(dtype).name


class NonFiniteUpdates(ValueError):
    """Some updates hold NaN or Inf; nothing was aggregated."""

    def __init__(self, partition_ids: list[int]):
        super().__init__(f"updates of partitions {partition_ids} hold NaN or Inf")
        self.partition_ids = partition_ids


@dataclass
class CohortResult:
    params: list  # θ after the step: numpy arrays, or tensors on the device when the Δ_k were there
    stats: dict[str, float]
    train_loss: float  # n_k-weighted mean of the clients' training losses
    num_examples: int
    partition_ids: list[int]
    sums: CohortSums  # what the statistics are made of (the keep-prob schedule reads B_w from them)
    server_lr: float = 1.0  # η_g: θ ← θ − η_g Σ_k w_k Δ̃_k


def _block_scales(keep: Sequence[bool] | None, num_blocks: int, keep_prob: float, per_coordinate: bool) -> list[float]:
    """m^(b) / p of each tensor: 1/p throughout for coordinate masks (m is applied per coordinate),
    1 for an unmasked update."""
    if per_coordinate:
        return [1.0 / keep_prob] * num_blocks
    if keep is None:
        return [1.0] * num_blocks
    return mask_scales(keep, keep_prob)


ServerLr = Callable[[CohortSums], float]  # η_g from the cohort's sums (strategies/server_step.py)


def aggregate_cohort(
    global_params: Sequence[np.ndarray], replies: Sequence[ClientReply], aggregation: str, keep_prob: float,
    server_lr: ServerLr | None = None, coordinate_mask_seeds: Mapping[int, int] | None = None,
) -> CohortResult:
    """θ ← θ − η_g Σ_k w_k Δ̃_k and the cohort statistics of the unmasked Δ_k: one pass (FedAvg,
    η_g = 1), or two when ``server_lr`` computes η_g from the statistics' sums (FedExP).

    Δ̃_k is Δ_k with the kept tensors scaled by 1/p (the replies' ``keep``), or, given
    ``coordinate_mask_seeds`` (partition id -> mask seed), (m_k / p) ⊙ Δ_k with m_k regenerated
    per coordinate (``clients.masking.coordinate_mask``); the replies' ``keep`` is then ignored.

    Replies are taken in partition-id order, so float results do not depend on arrival order.
    """
    if not replies:
        raise ValueError("no client replies to aggregate")
    ordered = sorted(replies, key=lambda r: r.partition_id)
    counts = [r.num_examples for r in ordered]
    num_blocks = len(global_params)
    masks = None
    if coordinate_mask_seeds is not None:
        missing = [r.partition_id for r in ordered if r.partition_id not in coordinate_mask_seeds]
        if missing:
            raise ValueError(f"no coordinate mask seed for partitions {missing}")
        masks = CoordinateMasks([coordinate_mask_seeds[r.partition_id] for r in ordered], keep_prob)
    block_coefs = None
    if masks is not None or any(r.keep is not None for r in ordered) or server_lr is not None:
        block_coefs = [  # w_k m_k^(b) / p; per coordinate, w_k / p here and m_k in the pass
            [w * s for s in _block_scales(r.keep, num_blocks, keep_prob, per_coordinate=masks is not None)]
            for r, w in zip(ordered, client_weights(counts, aggregation), strict=True)
        ]
    lr = 1.0
    if server_lr is None:
        step = ServerStep(global_params, weighted=aggregation == "weighted", block_coefs=block_coefs,
                          coordinate_masks=masks)
        sums, params = reduce_cohort([r.update for r in ordered], [float(n) for n in counts], step)
    else:
        sums, _ = reduce_cohort([r.update for r in ordered], [float(n) for n in counts])
        lr = server_lr(sums) if all(math.isfinite(sq) for sq in sums.sq_norms) else 1.0
        step = ServerStep(global_params, block_coefs=[[lr * c for c in coefs] for coefs in block_coefs],
                          coordinate_masks=masks)
        _, params = reduce_cohort([r.update for r in ordered], [float(n) for n in counts], step)
    # ‖Δ_k‖² in float64 is finite exactly when every value of Δ_k is (float32 squares cannot overflow).
    non_finite = [r.partition_id for r, sq in zip(ordered, sums.sq_norms, strict=True) if not math.isfinite(sq)]
    if non_finite:
        raise NonFiniteUpdates(non_finite)
    total = sum(counts)
    return CohortResult(
        params=params,
        stats=cohort_result(sums),
        train_loss=sum(r.train_loss * r.num_examples for r in ordered) / total,
        num_examples=total,
        partition_ids=[r.partition_id for r in ordered],
        sums=sums,
        server_lr=lr,
    )
