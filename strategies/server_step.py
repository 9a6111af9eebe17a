"""The server's step size and the round's keep-prob: FedExP's extrapolation, and a keep-prob
schedule that holds the masking penalty's Euclidean proxy at a target. Pure functions of the
cohort's sums (strategies/cohort_pass.py) with the aggregation weights w_k = n_k / Σn or 1/K_c.
"""

from __future__ import annotations

from strategies.cohort_pass import CohortSums

FEDEXP_DECAY = 0.998  # the official FedExP code multiplies ε by decay² every round


def weighted_sums(sums: CohortSums, aggregation: str) -> tuple[float, float]:
    """(A_w, B_w) = (Σ_k w_k ‖Δ_k‖², ‖Σ_k w_k Δ_k‖²) for the aggregation's normalised weights.
    The pass's weights are n_k: "uniform" reads the unweighted sums instead."""
    if aggregation == "uniform":
        k = sums.cohort_size
        return sums.sum_sq_norms / k, sums.sq_norm_of_sum / (k * k)
    if aggregation != "weighted":
        raise ValueError(f"unknown aggregation {aggregation!r}: expected 'weighted' or 'uniform'")
    total = sums.total_weight
    return (
        sum(w * s for w, s in zip(sums.weights, sums.sq_norms, strict=True)) / total,
        sums.sq_norm_of_weighted_sum / (total * total),
    )


def fedexp_epsilon(epsilon0: float, server_round: int, decay: float = FEDEXP_DECAY) -> float:
    """ε_t = ε_0 · decay^(2t): the official FedExP code decays ε by decay² at the start of every
    round, before its first use (round t = 1 here is its round 0)."""
    return epsilon0 * decay ** (2 * server_round)


def fedexp_server_lr(a_w: float, b_w: float, cohort_size: int, epsilon: float) -> float:
    """FedExP (Jhunjhunwala et al., ICLR 2023): η_g = max{1, Σ_k w_k‖Δ_k‖² / (2(‖Σ_k w_k Δ_k‖² + K_c·ε))}
    = max{1, A_w / (2(B_w + K_c ε))}. With uniform weights and ε = 0 this is max{1, (K_c/2)·ΔS}."""
    denominator = 2.0 * (b_w + cohort_size * epsilon)
    if not denominator > 0:  # every update zero and ε = 0: nothing to extrapolate
        return 1.0
    return max(1.0, a_w / denominator)


def calibrated_keep_prob(b_previous: float, penalty_target: float, keep_prob_min: float) -> float:
    """p_t such that the synchronized-mask penalty proxy (1−p)/(2p)·B_{t−1} equals the target c:
    p_t = B_{t−1} / (B_{t−1} + 2c), clipped to [keep-prob-min, 1]."""
    if penalty_target <= 0:
        raise ValueError(f"penalty target must be > 0, got {penalty_target}")
    p = b_previous / (b_previous + 2.0 * penalty_target)
    return min(1.0, max(keep_prob_min, p))


def penalty_proxy(keep_prob: float, b_w: float) -> float:
    """(1−p)/(2p)·B_w: the Euclidean proxy of synchronized masking's penalty at keep-prob p."""
    return (1.0 - keep_prob) / (2.0 * keep_prob) * b_w


def fedexp_step(aggregation: str, epsilon0: float, server_round: int):
    """η_g of round ``server_round`` as a function of the cohort's sums (``aggregate_cohort``'s
    ``server_lr``)."""
    epsilon = fedexp_epsilon(epsilon0, server_round)

    def server_lr(sums: CohortSums) -> float:
        a_w, b_w = weighted_sums(sums, aggregation)
        return fedexp_server_lr(a_w, b_w, sums.cohort_size, epsilon)

    return server_lr
