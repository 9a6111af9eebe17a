"""strategies/server_step.py against its equations on hand-made updates, and FedExP's step through
aggregate_cohort."""

from __future__ import annotations

import numpy as np
import pytest

from strategies.aggregate import ClientReply, aggregate_cohort
from strategies.cohort_pass import reduce_cohort
from strategies.server_step import (
    FEDEXP_DECAY,
    calibrated_keep_prob,
    fedexp_epsilon,
    fedexp_server_lr,
    penalty_proxy,
    weighted_sums,
)


def sums_of(updates, counts):
    return reduce_cohort([[np.asarray(u, dtype=np.float64)] for u in updates], counts)[0]


def fedexp_lr(updates, counts, aggregation, epsilon=0.0):
    sums = sums_of(updates, counts)
    a_w, b_w = weighted_sums(sums, aggregation)
    return fedexp_server_lr(a_w, b_w, sums.cohort_size, epsilon)


def test_uniform_fedexp_without_epsilon_is_half_the_cohort_times_gradient_diversity():
    updates = [[1.0, 2.0, 0.0], [0.5, -1.0, 3.0], [2.0, 0.0, 1.0]]
    k = len(updates)
    delta_s = sum(np.dot(u, u) for u in map(np.array, updates)) / np.sum(np.sum(updates, axis=0) ** 2)
    assert fedexp_lr(updates, [1, 1, 1], "uniform") == pytest.approx(max(1.0, k / 2 * delta_s), rel=1e-12)


def test_equal_updates_are_not_extrapolated_and_orthogonal_ones_by_half_the_cohort():
    assert fedexp_lr([[1.0, 2.0]] * 4, [1, 1, 1, 1], "uniform") == 1.0  # A = B: max(1, 1/2)
    orthogonal = np.eye(4).tolist()  # A = 1/K_c... B = 1/K_c²·K_c: A / 2B = K_c / 2
    assert fedexp_lr(orthogonal, [1, 1, 1, 1], "uniform") == pytest.approx(2.0, rel=1e-12)


def test_cancelling_updates_without_epsilon_take_a_unit_step_of_zero():
    assert fedexp_lr([[1.0, -2.0], [-1.0, 2.0]], [1, 1], "uniform") == 1.0


def test_weighted_fedexp_uses_the_normalised_weights_and_epsilon_times_the_cohort():
    updates, counts, eps = [[3.0, 0.0], [0.0, 1.0]], [1, 3], 0.01
    w = np.array(counts) / 4
    a_w = w[0] * 9 + w[1] * 1
    b_w = float(np.sum((w[0] * np.array(updates[0]) + w[1] * np.array(updates[1])) ** 2))
    want = max(1.0, a_w / (2 * (b_w + 2 * eps)))
    assert fedexp_lr(updates, counts, "weighted", eps) == pytest.approx(want, rel=1e-12)
    assert want > 1.0


def test_fedexp_epsilon_decays_by_decay_squared_a_round():
    assert fedexp_epsilon(0.001, 1) == pytest.approx(0.001 * FEDEXP_DECAY**2)
    assert fedexp_epsilon(0.001, 10) / fedexp_epsilon(0.001, 9) == pytest.approx(FEDEXP_DECAY**2)


def test_aggregate_cohort_takes_fedexps_step():
    theta = [np.zeros(3, np.float64)]
    updates = [np.array([1.0, 0.0, 0.0]), np.array([0.0, 1.0, 0.0]), np.array([0.0, 0.0, 1.0])]
    replies = [ClientReply(pid, 10, 0.0, [u], None) for pid, u in enumerate(updates)]

    def lr(sums):
        return fedexp_server_lr(*weighted_sums(sums, "uniform"), sums.cohort_size, 0.0)

    result = aggregate_cohort(theta, replies, "uniform", 1.0, server_lr=lr)
    assert result.server_lr == pytest.approx(1.5)  # orthogonal: K_c / 2
    np.testing.assert_allclose(result.params[0], -1.5 * np.mean(updates, axis=0), rtol=1e-15)
    plain = aggregate_cohort(theta, replies, "uniform", 1.0)
    assert plain.server_lr == 1.0 and plain.stats == result.stats


def test_calibrated_keep_prob_makes_the_proxy_hit_the_target_and_clips():
    b, c = 0.02, 0.005
    p = calibrated_keep_prob(b, c, keep_prob_min=0.1)
    assert p == pytest.approx(b / (b + 2 * c))
    assert penalty_proxy(p, b) == pytest.approx(c, rel=1e-12)
    assert calibrated_keep_prob(1e-6, c, keep_prob_min=0.2) == 0.2  # tiny updates: clipped below
    assert calibrated_keep_prob(b, c, keep_prob_min=0.99) == 0.99
    with pytest.raises(ValueError, match="target"):
        calibrated_keep_prob(b, 0.0, 0.1)
