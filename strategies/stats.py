"""The paper's server-side statistics of one cohort (PAPER.md, "Gradient diversity" and
"Signal-noise decomposition"), computed from the unmasked client updates Δ_k.

Everything streams over the updates: two model-sized float64 buffers (Σ Δ_k and Σ n_k Δ_k)
and a few scalars, whatever the cohort size.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

STAT_NAMES = ("recovery", "recovery_weighted", "mean_sq_norm", "sq_norm_of_mean", "sigma2_hat", "mu2_hat")


def recovery_factor(sum_sq_norms: float, sq_norm_of_sum: float) -> float:
    """1/ΔS = ‖Σ_k Δ_k‖² / Σ_k ‖Δ_k‖² (the reciprocal of gradient diversity)."""
    return sq_norm_of_sum / sum_sq_norms


def weighted_recovery_factor(weighted_sum_sq_norms: float, sq_norm_of_weighted_sum: float) -> float:
    """1/ΔS_w = ‖Σ_k w_k Δ_k‖² / Σ_k w_k² ‖Δ_k‖²."""
    return sq_norm_of_weighted_sum / weighted_sum_sq_norms


def noise_variance(mean_sq_norm: float, sq_norm_of_mean: float, cohort_size: int) -> float:
    """σ̂² = (A − B) / (1 − 1/K_c)."""
    return (mean_sq_norm - sq_norm_of_mean) / (1.0 - 1.0 / cohort_size)


def signal_sq_norm(mean_sq_norm: float, sigma2_hat: float) -> float:
    """‖μ̂‖² = A − σ̂²."""
    return mean_sq_norm - sigma2_hat


def _as_float64(block) -> np.ndarray:
    return np.asarray(block, dtype=np.float64).ravel()


@dataclass
class CohortStatistics:
    """Accumulates one cohort's updates; ``add`` each Δ_k, then ``result()``."""

    cohort_size: int = 0
    total_weight: float = 0.0
    sum_sq_norms: float = 0.0  # Σ ‖Δ_k‖²
    weighted_sum_sq_norms: float = 0.0  # Σ n_k² ‖Δ_k‖²
    _sum: list[np.ndarray] = field(default_factory=list)  # Σ Δ_k
    _weighted_sum: list[np.ndarray] = field(default_factory=list)  # Σ n_k Δ_k

    def add(self, update: Sequence, weight: float = 1.0) -> None:
        """Fold in one client's unmasked update Δ_k (a list of blocks) with weight n_k > 0."""
        if weight <= 0:
            raise ValueError(f"client weight must be positive, got {weight}")
        first = not self._sum
        if not first and len(update) != len(self._sum):
            raise ValueError(f"update has {len(update)} blocks, earlier updates had {len(self._sum)}")
        sq_norm = 0.0
        for b, block in enumerate(update):
            x = _as_float64(block)
            sq_norm += float(np.dot(x, x))
            if first:
                self._sum.append(x.copy())
                self._weighted_sum.append(x * weight)
            else:
                self._sum[b] += x
                self._weighted_sum[b] += weight * x
        self.cohort_size += 1
        self.total_weight += weight
        self.sum_sq_norms += sq_norm
        self.weighted_sum_sq_norms += weight * weight * sq_norm

    def mean_update(self, weighted: bool) -> list[np.ndarray]:
        """Σ_k w_k Δ_k as flat float64 blocks: w_k = n_k / Σ_j n_j when ``weighted``, else 1/K_c."""
        if weighted:
            return [s / self.total_weight for s in self._weighted_sum]
        return [s / self.cohort_size for s in self._sum]

    def result(self) -> dict[str, float]:
        """The statistics of PAPER.md for the updates added so far."""
        k = self.cohort_size
        if k == 0:
            raise ValueError("no updates were added")
        sq_norm_of_sum = sum(float(np.dot(s, s)) for s in self._sum)
        sq_norm_of_weighted_sum = sum(float(np.dot(s, s)) for s in self._weighted_sum)
        a = self.sum_sq_norms / k
        b = sq_norm_of_sum / (k * k)
        stats = {
            "recovery": _safe(recovery_factor, self.sum_sq_norms, sq_norm_of_sum),
            # w_k = n_k / N: numerator and denominator both carry 1/N², which cancels.
            "recovery_weighted": _safe(
                weighted_recovery_factor, self.weighted_sum_sq_norms, sq_norm_of_weighted_sum
            ),
            "mean_sq_norm": a,
            "sq_norm_of_mean": b,
            "sigma2_hat": float("nan"),
            "mu2_hat": float("nan"),
        }
        if k > 1:
            stats["sigma2_hat"] = noise_variance(a, b, k)
            stats["mu2_hat"] = signal_sq_norm(a, stats["sigma2_hat"])
        return stats


def _safe(ratio, denominator: float, numerator: float) -> float:
    """A ratio whose denominator is a sum of squares: undefined (nan) when every update is zero."""
    return ratio(denominator, numerator) if denominator > 0 else float("nan")


def cohort_statistics(updates: Iterable[Sequence], weights: Sequence[float] | None = None) -> dict[str, float]:
    """recovery (1/ΔS), recovery_weighted (1/ΔS_w), mean_sq_norm (A), sq_norm_of_mean (B),
    sigma2_hat (σ̂²) and mu2_hat (‖μ̂‖²) of the K_c unmasked updates Δ_k.

    ``updates`` holds each client's update as a list of arrays (one per parameter tensor);
    ``weights`` are the n_k (any positive scale; they are normalised), uniform when None.
    With K_c = 1, σ̂² and ‖μ̂‖² are undefined and returned as nan.
    """
    acc = CohortStatistics()
    updates = list(updates)
    if weights is None:
        weights = [1.0] * len(updates)
    if len(weights) != len(updates):
        raise ValueError(f"{len(updates)} updates but {len(weights)} weights")
    for update, weight in zip(updates, weights, strict=True):
        acc.add(update, float(weight))
    return acc.result()
