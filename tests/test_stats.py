"""strategies.stats.cohort_statistics against PAPER.md's formulas, on hand-made updates."""

from __future__ import annotations

import math

import numpy as np
import pytest

from strategies.stats import STAT_NAMES, cohort_statistics


def _flat(update) -> np.ndarray:
    return np.concatenate([np.asarray(b, dtype=np.float64).ravel() for b in update])


def _by_hand(updates, weights=None) -> dict[str, float]:
    """Every statistic straight from the equations, on flat float64 vectors."""
    d = np.stack([_flat(u) for u in updates])
    k = len(d)
    n = np.ones(k) if weights is None else np.asarray(weights, dtype=np.float64)
    w = n / n.sum()
    sq = np.einsum("ij,ij->i", d, d)
    total = d.sum(axis=0)
    a = sq.mean()
    mean = d.mean(axis=0)
    b = float(mean @ mean)
    wsum = w @ d
    out = {
        "recovery": float(total @ total) / sq.sum(),
        "recovery_weighted": float(wsum @ wsum) / float((w**2 * sq).sum()),
        "mean_sq_norm": a,
        "sq_norm_of_mean": b,
    }
    sigma2 = (a - b) / (1 - 1 / k)
    out["sigma2_hat"] = sigma2
    out["mu2_hat"] = a - sigma2
    return out


def test_returns_exactly_the_named_statistics():
    stats = cohort_statistics([[np.ones(3)], [np.zeros(3) + 2]])
    assert set(stats) == set(STAT_NAMES)


@pytest.mark.parametrize("k", [1, 2, 10, 37])
def test_identical_updates_give_recovery_equal_to_cohort_size(k):
    rng = np.random.default_rng(k)
    update = [rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=7).astype(np.float32)]
    n = rng.integers(10, 1000, size=k)
    stats = cohort_statistics([update] * k, weights=n)
    assert stats["recovery"] == pytest.approx(k, rel=1e-12)
    # With unequal n_k the weighted factor of identical updates is (Σ n_k)² / Σ n_k² (≤ K_c) ...
    assert stats["recovery_weighted"] == pytest.approx(float(n.sum()) ** 2 / float((n**2).sum()), rel=1e-12)
    # ... and K_c for equal n_k.
    assert cohort_statistics([update] * k, weights=[50] * k)["recovery_weighted"] == pytest.approx(k, rel=1e-12)


def test_identical_updates_have_zero_noise_and_full_signal():
    rng = np.random.default_rng(0)
    update = [rng.normal(size=50)]
    stats = cohort_statistics([update] * 10)
    sq = float(update[0] @ update[0])
    assert stats["sigma2_hat"] == pytest.approx(0.0, abs=1e-12 * sq)
    assert stats["mu2_hat"] == pytest.approx(sq, rel=1e-12)


def test_equal_norm_orthogonal_updates_give_recovery_one():
    k = 6
    updates = [[3.0 * np.eye(k)[i]] for i in range(k)]
    stats = cohort_statistics(updates)
    assert stats["recovery"] == pytest.approx(1.0, rel=1e-12)
    assert stats["recovery_weighted"] == pytest.approx(1.0, rel=1e-12)
    # A = 9, B = ‖(3/k) 1‖² = 9/k, σ̂² = (9 − 9/k) / (1 − 1/k) = 9, ‖μ̂‖² = 0.
    assert stats["mean_sq_norm"] == pytest.approx(9.0, rel=1e-12)
    assert stats["sq_norm_of_mean"] == pytest.approx(9.0 / k, rel=1e-12)
    assert stats["sigma2_hat"] == pytest.approx(9.0, rel=1e-12)
    assert stats["mu2_hat"] == pytest.approx(0.0, abs=1e-12)


def test_conflicting_updates_give_recovery_below_one():
    delta = np.array([1.0, -2.0, 0.5, 3.0])
    small = np.array([0.1, 0.0, 0.0, 0.0])
    stats = cohort_statistics([[delta], [-delta], [small]])
    # ‖Σ Δ‖² = 0.01, Σ ‖Δ‖² = 2 · 14.25 + 0.01.
    assert stats["recovery"] == pytest.approx(0.01 / 28.51, rel=1e-12)
    assert stats["recovery"] < 1.0
    # σ̂² > A here: the signal estimate goes negative, nothing clamps it.
    assert stats["mu2_hat"] < 0


def test_weighted_recovery_equals_uniform_for_equal_counts():
    rng = np.random.default_rng(1)
    updates = [[rng.normal(size=5), rng.normal(size=(2, 2))] for _ in range(4)]
    equal = cohort_statistics(updates, weights=[250, 250, 250, 250])
    uniform = cohort_statistics(updates)
    assert equal["recovery_weighted"] == pytest.approx(equal["recovery"], rel=1e-12)
    for name in STAT_NAMES:
        assert equal[name] == pytest.approx(uniform[name], rel=1e-12)


def test_weighted_recovery_for_unequal_counts_matches_hand_computation():
    # Three 2-d updates with n = (1, 2, 7): w = (0.1, 0.2, 0.7).
    updates = [[np.array([1.0, 0.0])], [np.array([0.0, 1.0])], [np.array([1.0, 1.0])]]
    n = [1, 2, 7]
    stats = cohort_statistics(updates, weights=n)
    # Σ w_k Δ_k = (0.1 + 0.7, 0.2 + 0.7) = (0.8, 0.9): ‖·‖² = 1.45.
    # Σ w_k² ‖Δ_k‖² = 0.01 · 1 + 0.04 · 1 + 0.49 · 2 = 1.03.
    assert stats["recovery_weighted"] == pytest.approx(1.45 / 1.03, rel=1e-12)
    # Uniform: ‖Σ Δ‖² = ‖(2, 2)‖² = 8; Σ ‖Δ‖² = 4.
    assert stats["recovery"] == pytest.approx(2.0, rel=1e-12)
    assert stats["recovery_weighted"] != pytest.approx(stats["recovery"], rel=1e-3)
    # Only the ratios of the n_k matter.
    scaled = cohort_statistics(updates, weights=[10, 20, 70])
    assert scaled["recovery_weighted"] == pytest.approx(stats["recovery_weighted"], rel=1e-12)


def test_a_b_sigma_mu_match_the_formulas_by_hand():
    # K_c = 4, 3-d updates chosen so everything is a short hand sum.
    updates = [
        [np.array([1.0, 2.0, 0.0])],
        [np.array([3.0, 0.0, 1.0])],
        [np.array([-1.0, 2.0, 1.0])],
        [np.array([1.0, 0.0, 2.0])],
    ]
    stats = cohort_statistics(updates)
    # ‖Δ_k‖² = 5, 10, 6, 5: A = 26 / 4 = 6.5.
    # Δ̄ = (4, 4, 4) / 4 = (1, 1, 1): B = 3.
    # σ̂² = (6.5 − 3) / (1 − 1/4) = 14/3; ‖μ̂‖² = 6.5 − 14/3 = 11/6.
    assert stats["mean_sq_norm"] == pytest.approx(6.5, rel=1e-12)
    assert stats["sq_norm_of_mean"] == pytest.approx(3.0, rel=1e-12)
    assert stats["sigma2_hat"] == pytest.approx(14.0 / 3.0, rel=1e-12)
    assert stats["mu2_hat"] == pytest.approx(11.0 / 6.0, rel=1e-12)
    # 1/ΔS = ‖ΣΔ‖² / Σ‖Δ‖² = 48 / 26.
    assert stats["recovery"] == pytest.approx(48.0 / 26.0, rel=1e-12)


def test_random_cohort_matches_reference_implementation():
    rng = np.random.default_rng(7)
    updates = [[rng.normal(size=(3, 4)), rng.normal(size=6), rng.normal(size=1)] for _ in range(9)]
    n = rng.integers(20, 800, size=9)
    stats = cohort_statistics(updates, weights=n)
    expected = _by_hand(updates, n)
    for name in STAT_NAMES:
        assert stats[name] == pytest.approx(expected[name], rel=1e-10), name


def test_uniform_recovery_is_k_times_b_over_a():
    """1/ΔS = K_c · B / A ties the two halves of PAPER.md together."""
    rng = np.random.default_rng(3)
    updates = [[rng.normal(size=20) + 0.5] for _ in range(7)]
    stats = cohort_statistics(updates)
    assert stats["recovery"] == pytest.approx(7 * stats["sq_norm_of_mean"] / stats["mean_sq_norm"], rel=1e-12)


def test_estimators_recover_signal_and_noise_in_large_dimension():
    """Δ_k = μ + ε_k with ε_k ~ N(0, σ²/d · I): one draw in d = 200 000 is within sampling error."""
    rng = np.random.default_rng(11)
    d, k = 200_000, 10
    mu2, sigma2 = 2.0, 5.0
    mu = rng.normal(size=d)
    mu *= math.sqrt(mu2) / np.linalg.norm(mu)
    eps = rng.normal(scale=math.sqrt(sigma2 / d), size=(k, d))
    stats = cohort_statistics([[mu + e] for e in eps])
    # Relative fluctuations are O(1/sqrt(d · K_c)) ≈ 1e-3; 2 % is a loose but discriminating bound.
    assert stats["sigma2_hat"] == pytest.approx(sigma2, rel=0.02)
    assert stats["mu2_hat"] == pytest.approx(mu2, rel=0.02)
    r = mu2 / sigma2
    assert stats["recovery"] == pytest.approx((k * r + 1) / (r + 1), rel=0.02)


def test_estimators_are_unbiased_over_many_draws():
    """E[σ̂²] = σ² and E[‖μ̂‖²] = ‖μ‖² (small d, many cohorts; checked within 4 standard errors)."""
    rng = np.random.default_rng(5)
    d, k, draws = 8, 5, 1500
    mu = rng.normal(size=d)
    mu2 = float(mu @ mu)
    sigma2 = 3.0  # non-isotropic noise of total variance 3
    scales = rng.uniform(0.2, 1.0, size=d)
    scales *= math.sqrt(sigma2 / float(scales @ scales))
    s_hat, m_hat = [], []
    for _ in range(draws):
        eps = rng.normal(size=(k, d)) * scales
        stats = cohort_statistics([[mu[:3] + e[:3], mu[3:] + e[3:]] for e in eps])
        s_hat.append(stats["sigma2_hat"])
        m_hat.append(stats["mu2_hat"])
    for values, truth in ((np.array(s_hat), sigma2), (np.array(m_hat), mu2)):
        se = values.std(ddof=1) / math.sqrt(draws)
        assert abs(values.mean() - truth) < 4 * se
        assert se < 0.05 * truth  # tight enough to tell a biased estimator (e.g. no 1/(1 − 1/K_c)) apart


def test_accumulates_in_float64():
    big = np.float32(2**24)
    one = np.float32(1.0)
    # In float32, 2^24 + 1 rounds back to 2^24: a float32 running sum of these updates would be 0.
    updates = [
        [np.array([big], dtype=np.float32)],
        [np.array([one], dtype=np.float32)],
        [np.array([-big], dtype=np.float32)],
    ]
    assert (np.float32(big) + one) - big == 0  # the float32 pitfall this guards against
    stats = cohort_statistics(updates)
    assert stats["sq_norm_of_mean"] == pytest.approx(1.0 / 9.0, rel=1e-12)
    assert stats["recovery"] == pytest.approx(1.0 / (2.0 * 2.0**48 + 1.0), rel=1e-12)


def test_sum_of_squares_in_float64():
    # One large entry and a million small ones: float32 accumulation drops the small squares.
    x = np.full(1_000_001, 1e-4, dtype=np.float32)
    x[0] = 1.0
    exact = float(np.dot(x.astype(np.float64), x.astype(np.float64)))
    assert abs(float(np.dot(x, x)) - exact) > 1e-9 * exact  # float32 dot product: off in the 4th digit
    stats = cohort_statistics([[x]])
    assert stats["mean_sq_norm"] == pytest.approx(exact, rel=1e-12)
    assert stats["sq_norm_of_mean"] == pytest.approx(exact, rel=1e-12)


def test_blocks_give_the_same_as_one_concatenated_vector():
    rng = np.random.default_rng(2)
    blocked = [[rng.normal(size=(2, 3)), rng.normal(size=4), rng.normal(size=(1, 1, 5))] for _ in range(5)]
    flat = [[_flat(u)] for u in blocked]
    n = [3, 1, 4, 1, 5]
    a = cohort_statistics(blocked, weights=n)
    b = cohort_statistics(flat, weights=n)
    for name in STAT_NAMES:
        assert a[name] == pytest.approx(b[name], rel=1e-12), name


def test_single_client_gives_nan_noise_and_signal():
    stats = cohort_statistics([[np.array([1.0, 2.0])]])
    assert stats["recovery"] == pytest.approx(1.0)
    assert stats["mean_sq_norm"] == pytest.approx(5.0)
    assert stats["sq_norm_of_mean"] == pytest.approx(5.0)
    assert math.isnan(stats["sigma2_hat"])
    assert math.isnan(stats["mu2_hat"])


def test_all_zero_updates_give_nan_recovery():
    stats = cohort_statistics([[np.zeros(3)], [np.zeros(3)]])
    assert math.isnan(stats["recovery"])
    assert math.isnan(stats["recovery_weighted"])


def test_mismatched_block_counts_raise():
    with pytest.raises(ValueError, match="blocks"):
        cohort_statistics([[np.ones(2), np.ones(3)], [np.ones(5)]])


def test_mismatched_weight_count_raises():
    with pytest.raises(ValueError, match="weights"):
        cohort_statistics([[np.ones(2)], [np.ones(2)]], weights=[1.0])


@pytest.mark.parametrize("weight", [0.0, -1.0])
def test_non_positive_weight_raises(weight):
    with pytest.raises(ValueError, match="positive"):
        cohort_statistics([[np.ones(2)], [np.ones(2)]], weights=[1.0, weight])


def test_empty_cohort_raises():
    with pytest.raises(ValueError, match="no updates"):
        cohort_statistics([])


def test_statistics_do_not_modify_the_updates():
    first = np.array([1.0, 2.0])
    stats = cohort_statistics([[first], [np.array([3.0, 4.0])]])
    np.testing.assert_array_equal(first, [1.0, 2.0])
    assert stats["sq_norm_of_mean"] == pytest.approx(2.0**2 + 3.0**2)
