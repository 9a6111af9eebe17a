"""The paper's server-side statistics of one cohort (PAPER.md, "Gradient diversity" and
"Signal-noise decomposition"), computed from the unmasked client updates Δ_k.

The sums they are made of come from one chunked pass over the updates
(strategies/cohort_pass.py); the functions here are the equations on those sums.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from strategies.cohort_pass import CohortSums, reduce_cohort

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


def cohort_result(sums: CohortSums) -> dict[str, float]:
    """The statistics of PAPER.md from the cohort's sums (see ``reduce_cohort``)."""
    k = sums.cohort_size
    a = sums.sum_sq_norms / k
    b = sums.sq_norm_of_sum / (k * k)
    stats = {
        "recovery": _safe(recovery_factor, sums.sum_sq_norms, sums.sq_norm_of_sum),
        # w_k = n_k / N: numerator and denominator both carry 1/N², which cancels.
        "recovery_weighted": _safe(
            weighted_recovery_factor, sums.weighted_sum_sq_norms, sums.sq_norm_of_weighted_sum
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
    updates = list(updates)
    sums, _ = reduce_cohort(updates, [1.0] * len(updates) if weights is None else weights)
    return cohort_result(sums)
