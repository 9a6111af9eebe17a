"""Server side of a round: weights, θ ← θ − Σ w_k (m_k/p) Δ_k, bad replies, cohort sampling."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from clients.masking import coordinate_mask
from strategies.aggregate import ClientReply, NonFiniteUpdates, aggregate_cohort, client_weights, reply_problem
from strategies.cohort import sample_cohort
from strategies.round import RoundFailed, finish_round
from strategies.stats import STAT_NAMES, cohort_statistics

# ---------------------------------------------------------------------------------------------
# client_weights


def test_weighted_client_weights_are_n_over_total():
    assert client_weights([1, 3, 4], "weighted") == [0.125, 0.375, 0.5]


def test_uniform_client_weights_ignore_counts():
    assert client_weights([1, 3, 4, 100], "uniform") == [0.25] * 4


def test_unknown_aggregation_raises():
    with pytest.raises(ValueError, match="median"):
        client_weights([1, 2], "median")


# ---------------------------------------------------------------------------------------------
# A tiny cohort worked out by hand: two blocks, three clients, p = 1/2.

THETA = [np.array([1.0, 2.0]), np.array([[3.0]])]


def _replies(keeps=((True, False), (False, True), (True, True))) -> list[ClientReply]:
    updates = [
        [np.array([1.0, 0.0]), np.array([[2.0]])],
        [np.array([0.0, 4.0]), np.array([[-2.0]])],
        [np.array([2.0, 2.0]), np.array([[1.0]])],
    ]
    counts = [1, 3, 4]
    losses = [1.0, 2.0, 3.0]
    return [
        ClientReply(
            partition_id=pid, num_examples=n, train_loss=loss, update=u, keep=None if keep is None else list(keep)
        )
        for pid, n, loss, u, keep in zip((7, 2, 5), counts, losses, updates, keeps, strict=True)
    ]


def test_masked_weighted_step_by_hand():
    result = aggregate_cohort(THETA, _replies(), "weighted", keep_prob=0.5)
    # w = (1/8, 3/8, 1/2), m/p ∈ {0, 2}:
    # block 0: 2·(1/8)·(1, 0) + 0 + 2·(1/2)·(2, 2) = (2.25, 2)      → θ = (1 − 2.25, 2 − 2)
    # block 1: 0 + 2·(3/8)·(−2) + 2·(1/2)·1 = −0.5                  → θ = 3 + 0.5
    np.testing.assert_allclose(result.params[0], [-1.25, 0.0], rtol=0, atol=1e-15)
    np.testing.assert_allclose(result.params[1], [[3.5]], rtol=0, atol=1e-15)


def test_masked_uniform_step_by_hand():
    result = aggregate_cohort(THETA, _replies(), "uniform", keep_prob=0.5)
    # block 0: (2/3)·(1, 0) + (2/3)·(2, 2) = (2, 4/3); block 1: (2/3)·(−2) + (2/3)·1 = −2/3.
    np.testing.assert_allclose(result.params[0], [-1.0, 2.0 / 3.0], rtol=1e-15)
    np.testing.assert_allclose(result.params[1], [[3.0 + 2.0 / 3.0]], rtol=1e-15)


def test_unmasked_weighted_step_by_hand():
    result = aggregate_cohort(THETA, _replies(keeps=(None, None, None)), "weighted", keep_prob=0.5)
    # keep_prob is ignored without masks: (1/8)(1, 0) + (3/8)(0, 4) + (1/2)(2, 2) = (1.125, 2.5);
    # (1/8)·2 + (3/8)·(−2) + (1/2)·1 = 0.
    np.testing.assert_allclose(result.params[0], [-0.125, -0.5], rtol=0, atol=1e-15)
    np.testing.assert_allclose(result.params[1], [[3.0]], rtol=0, atol=1e-15)


def test_server_lr_without_masks_scales_the_fedavg_step_only():
    """FedExP over unmasked updates: θ − η_g Σ w_k Δ_k, whatever keep-prob is configured (a 1/p here
    once doubled the step of mask-mode = none runs with keep-prob 0.5)."""
    unmasked = _replies(keeps=(None, None, None))
    plain = aggregate_cohort(THETA, unmasked, "weighted", keep_prob=0.5)
    for lr in (1.0, 3.0):
        stepped = aggregate_cohort(THETA, unmasked, "weighted", keep_prob=0.5, server_lr=lambda sums, lr=lr: lr)
        assert stepped.server_lr == lr
        for got, theta, fedavg in zip(stepped.params, THETA, plain.params, strict=True):
            np.testing.assert_allclose(got, theta - lr * (theta - fedavg), rtol=1e-14, atol=1e-14)


def test_coordinate_masks_are_regenerated_from_the_seeds():
    """θ − Σ_k w_k (m_k / p) ⊙ Δ_k with m_k = coordinate_mask(seed_k, b, size, p), the replies'
    block bits ignored; the statistics stay those of the unmasked Δ_k."""
    replies = _replies()
    seeds = {7: 11, 2: 12, 5: 13}
    p = 0.5
    result = aggregate_cohort(THETA, replies, "weighted", keep_prob=p, coordinate_mask_seeds=seeds)
    w = {7: 1 / 8, 2: 3 / 8, 5: 1 / 2}
    for b, theta in enumerate(THETA):
        masks = {pid: coordinate_mask(seeds[pid], b, theta.size, p).reshape(theta.shape) for pid in seeds}
        want = theta - sum(w[r.partition_id] * masks[r.partition_id] / p * r.update[b] for r in replies)
        np.testing.assert_allclose(result.params[b], want, rtol=1e-15, atol=1e-15)
    unmasked = aggregate_cohort(THETA, _replies(keeps=(None, None, None)), "weighted", keep_prob=p)
    assert result.stats == unmasked.stats
    # p = 1 keeps every coordinate: plain FedAvg.
    every = aggregate_cohort(THETA, replies, "weighted", keep_prob=1.0, coordinate_mask_seeds=seeds)
    for got, want in zip(every.params, unmasked.params, strict=True):
        np.testing.assert_array_equal(got, want)


def test_coordinate_masks_with_a_shared_seed_drop_the_same_coordinates_for_everyone():
    """Synchronized coordinate masks: every client's Δ_k loses the same coordinates, so θ moves
    only where the one mask keeps them."""
    rng = np.random.default_rng(3)
    theta = [rng.normal(size=(40, 5))]
    replies = [ClientReply(pid, 10, 0.0, [rng.normal(size=(40, 5))], None) for pid in range(4)]
    result = aggregate_cohort(theta, replies, "uniform", 0.3, coordinate_mask_seeds=dict.fromkeys(range(4), 99))
    kept = coordinate_mask(99, 0, 200, 0.3).reshape(40, 5)
    assert 0 < kept.sum() < kept.size
    np.testing.assert_array_equal(result.params[0][~kept], theta[0][~kept])
    assert np.all(result.params[0][kept] != theta[0][kept])


def test_coordinate_masks_need_a_seed_for_every_reply():
    with pytest.raises(ValueError, match=r"no coordinate mask seed for partitions \[5\]"):
        aggregate_cohort(THETA, _replies(), "weighted", 0.5, coordinate_mask_seeds={7: 1, 2: 2})


def test_cohort_result_bookkeeping():
    result = aggregate_cohort(THETA, _replies(), "weighted", keep_prob=0.5)
    assert result.partition_ids == [2, 5, 7]
    assert result.num_examples == 8
    # n_k-weighted mean loss: (1·1 + 3·2 + 4·3) / 8.
    assert result.train_loss == pytest.approx(19.0 / 8.0, rel=1e-15)


def test_statistics_are_of_the_unmasked_updates():
    replies = _replies()
    masked = aggregate_cohort(THETA, replies, "uniform", keep_prob=0.5)
    expected = cohort_statistics([r.update for r in replies], [r.num_examples for r in replies])
    for name in STAT_NAMES:
        assert masked.stats[name] == pytest.approx(expected[name], rel=1e-12), name
    # and the same whatever the aggregation weights or masks
    unmasked = aggregate_cohort(THETA, _replies(keeps=(None, None, None)), "weighted", keep_prob=0.5)
    assert unmasked.stats == masked.stats


def test_params_keep_their_dtype_and_inputs_are_not_changed():
    theta = [np.array([1.0, 2.0], dtype=np.float32), np.array([[3.0]], dtype=np.float32)]
    replies = _replies()
    for r in replies:
        r.update = [u.astype(np.float32) for u in r.update]
    before = [u.copy() for r in replies for u in r.update]
    result = aggregate_cohort(theta, replies, "weighted", keep_prob=0.5)
    assert [p.dtype for p in result.params] == [np.float32, np.float32]
    np.testing.assert_array_equal(result.params[0], np.array([-1.25, 0.0], dtype=np.float32))
    np.testing.assert_array_equal(theta[0], [1.0, 2.0])
    after = [u for r in replies for u in r.update]
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))


def test_random_cohort_matches_dense_formula():
    rng = np.random.default_rng(0)
    shapes = [(3, 2), (4,), (1,)]
    theta = [rng.normal(size=s) for s in shapes]
    p = 0.3
    replies = []
    for pid in range(6):
        replies.append(
            ClientReply(
                pid,
                int(rng.integers(5, 50)),
                0.0,
                [rng.normal(size=s) for s in shapes],
                (rng.random(len(shapes)) < 0.5).tolist(),
            )
        )
    n = np.array([r.num_examples for r in replies], dtype=np.float64)
    w = n / n.sum()
    expected = [t.copy() for t in theta]
    for wk, r in zip(w, replies, strict=True):
        for b in range(len(shapes)):
            expected[b] -= wk * (r.keep[b] / p) * r.update[b]
    result = aggregate_cohort(theta, replies, "weighted", p)
    for got, want in zip(result.params, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


def test_result_is_independent_of_reply_order():
    rng = np.random.default_rng(1)
    shapes = [(5, 3), (7,)]
    theta = [rng.normal(size=s).astype(np.float32) for s in shapes]
    replies = [
        ClientReply(
            pid,
            int(rng.integers(10, 500)),
            float(rng.random()),
            [(rng.normal(size=s) * 10.0 ** rng.integers(-4, 4)).astype(np.float32) for s in shapes],
            (rng.random(2) < 0.5).tolist(),
        )
        for pid in rng.permutation(50)[:10]
    ]
    reference = aggregate_cohort(theta, replies, "weighted", 0.5)
    order = random.Random(0)
    for _ in range(5):
        shuffled = replies[:]
        order.shuffle(shuffled)
        again = aggregate_cohort(theta, shuffled, "weighted", 0.5)
        assert all(a.tobytes() == b.tobytes() for a, b in zip(again.params, reference.params, strict=True))
        assert again.stats == reference.stats
        assert again.train_loss == reference.train_loss
        assert again.partition_ids == reference.partition_ids


def test_no_replies_raises():
    with pytest.raises(ValueError):
        aggregate_cohort(THETA, [], "weighted", 0.5)


def test_first_client_masked_out_of_a_block():
    """The first client in partition order keeps block 1 only, the second block 0 only."""
    replies = [
        ClientReply(0, 1, 0.0, [np.array([5.0]), np.array([1.0])], [False, True]),
        ClientReply(1, 1, 0.0, [np.array([3.0]), np.array([1.0])], [True, False]),
    ]
    out = aggregate_cohort([np.array([10.0]), np.array([10.0])], replies, "uniform", keep_prob=0.5)
    np.testing.assert_array_equal(out.params[0], [10.0 - 3.0])
    np.testing.assert_array_equal(out.params[1], [10.0 - 1.0])


@pytest.mark.parametrize("keep", [None, [True]])
def test_mean_update_accumulates_in_float64(keep):
    big = np.array([2.0**24], dtype=np.float32)
    one = np.array([1.0], dtype=np.float32)
    replies = [ClientReply(k, 1, 0.0, [block], keep) for k, block in enumerate((big, one, -big))]
    out = aggregate_cohort([np.zeros(1, dtype=np.float32)], replies, "uniform", 1.0)
    # A float32 running sum would give 2^24 + 1 → 2^24, then 0; the mean is 1/3.
    np.testing.assert_allclose(out.params[0], [-1.0 / 3.0], rtol=1e-7)


def test_new_params_keep_shape_and_dtype():
    theta = [np.ones((2, 3), dtype=np.float32)]
    replies = [ClientReply(0, 1, 0.0, [np.full((2, 3), 0.5, dtype=np.float32)], None)]
    out = aggregate_cohort(theta, replies, "uniform", 1.0)
    assert out.params[0].shape == (2, 3) and out.params[0].dtype == np.float32
    np.testing.assert_array_equal(out.params[0], np.full((2, 3), 0.5, dtype=np.float32))


# ---------------------------------------------------------------------------------------------
# reply_problem and finish_round

SHAPES = [(2, 3), (4,)]
DTYPES = [np.dtype(np.float32), np.dtype(np.float32)]
GLOBAL = [np.zeros(s, dtype=np.float32) for s in SHAPES]


def _good(pid: int, value: float = 1.0, n: int = 10, keep=None) -> ClientReply:
    return ClientReply(pid, n, 0.5, [np.full(s, value, dtype=np.float32) for s in SHAPES], keep)


def test_good_reply_has_no_problem():
    assert reply_problem(_good(0), SHAPES, DTYPES) is None
    assert reply_problem(_good(0, keep=[True, False]), SHAPES, DTYPES) is None


def _broken(kind: str) -> ClientReply:
    reply = _good(3)
    if kind == "nan":
        reply.update[1][2] = np.nan
    elif kind == "inf":
        reply.update[0][1, 1] = -np.inf
    elif kind == "shape":
        reply.update[0] = np.zeros((3, 2), dtype=np.float32)
    elif kind == "dtype":
        reply.update[1] = reply.update[1].astype(np.float64)
    elif kind == "blocks":
        reply.update = reply.update[:1]
    elif kind == "extra-block":
        reply.update = [*reply.update, np.zeros(1, dtype=np.float32)]
    elif kind == "mask":
        reply.keep = [True]
    elif kind == "examples":
        reply.num_examples = 0
    return reply


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("shape", "shape"),
        ("dtype", "dtype"),
        ("blocks", "arrays"),
        ("extra-block", "arrays"),
        ("mask", "mask"),
        ("examples", "num-examples"),
    ],
)
def test_reply_problem_catches(kind, says):
    problem = reply_problem(_broken(kind), SHAPES, DTYPES)
    assert problem is not None and says in problem


@pytest.mark.parametrize("kind", ["nan", "inf"])
def test_non_finite_updates_are_named_and_nothing_is_aggregated(kind):
    assert reply_problem(_broken(kind), SHAPES, DTYPES) is None  # the layout is fine
    with pytest.raises(NonFiniteUpdates) as info:
        aggregate_cohort(GLOBAL, [_good(0), _broken(kind), _good(5)], "weighted", 0.5)
    assert info.value.partition_ids == [3]


def test_huge_finite_updates_are_not_taken_for_inf():
    huge = _good(0, value=float(np.finfo(np.float32).max))
    result = aggregate_cohort(GLOBAL, [huge, _good(1)], "uniform", 1.0)
    assert all(np.isfinite(v) for v in result.stats.values() if v == v)


def test_finish_round_leaves_bad_replies_out():
    replies = [_good(0, 1.0), _broken("nan"), _good(4, 2.0, n=30), _broken("shape")]
    replies[3].partition_id = 8
    outcome = finish_round(
        5, GLOBAL, replies, ["partition 9: timed out"], aggregation="weighted", keep_prob=0.5, min_clients=2
    )
    assert outcome.num_failures == 3
    assert outcome.failures[0] == "partition 9: timed out"
    assert any(f.startswith("partition 3:") and "NaN" in f for f in outcome.failures)
    assert any(f.startswith("partition 8:") and "shape" in f for f in outcome.failures)
    assert outcome.result.partition_ids == [0, 4]
    # θ − (10 · 1 + 30 · 2) / 40 = −1.75 everywhere: the bad replies left no trace.
    for block in outcome.result.params:
        np.testing.assert_array_equal(block, np.full(block.shape, -1.75, dtype=np.float32))
    assert math.isfinite(outcome.result.stats["recovery"])


def test_finish_round_with_every_reply_good_has_no_failures():
    outcome = finish_round(1, GLOBAL, [_good(0), _good(1)], [], aggregation="uniform", keep_prob=1.0, min_clients=2)
    assert outcome.num_failures == 0
    assert outcome.result.stats["recovery"] == pytest.approx(2.0, rel=1e-12)


def test_finish_round_raises_below_min_clients():
    replies = [_good(0), _broken("inf"), _broken("dtype")]
    with pytest.raises(RoundFailed, match=r"round 7: 1 good replies, min-clients is 2") as info:
        finish_round(7, GLOBAL, replies, ["partition 5: raised"], aggregation="weighted", keep_prob=0.5, min_clients=2)
    assert "partition 5: raised" in str(info.value)
    assert "Inf" in str(info.value) and "dtype" in str(info.value)
    # Exactly min-clients good replies is enough.
    outcome = finish_round(7, GLOBAL, replies, [], aggregation="weighted", keep_prob=0.5, min_clients=1)
    assert outcome.result.partition_ids == [0]
    assert outcome.num_failures == 2


def test_finish_round_with_no_replies_raises_round_failed():
    with pytest.raises(RoundFailed):
        finish_round(2, GLOBAL, [], ["partition 1: timed out"], aggregation="weighted", keep_prob=0.5, min_clients=1)


# ---------------------------------------------------------------------------------------------
# sample_cohort


def test_cohort_is_deterministic_sorted_and_without_replacement():
    pids = list(range(100))
    cohort = sample_cohort(0, 3, pids, 10)
    assert cohort == sample_cohort(0, 3, pids, 10)
    assert cohort == sorted(cohort)
    assert len(set(cohort)) == 10
    assert set(cohort) <= set(pids)
    assert all(type(pid) is int for pid in cohort)
    full = sample_cohort(0, 3, pids, 100)
    assert full == pids


def test_cohort_varies_across_rounds_and_seeds():
    pids = range(100)
    by_round = {tuple(sample_cohort(0, r, pids, 10)) for r in range(1, 21)}
    assert len(by_round) == 20
    assert sample_cohort(0, 1, pids, 10) != sample_cohort(1, 1, pids, 10)


def test_cohort_does_not_depend_on_the_order_of_partition_ids():
    pids = list(range(0, 300, 3))
    shuffled = pids[:]
    random.Random(4).shuffle(shuffled)
    for server_round in range(1, 6):
        assert sample_cohort(2, server_round, shuffled, 10) == sample_cohort(2, server_round, pids, 10)
        assert sample_cohort(2, server_round, tuple(reversed(pids)), 10) == sample_cohort(2, server_round, pids, 10)


def test_cohort_is_uniform_over_clients():
    num_clients, k, rounds = 20, 5, 2000
    counts = np.zeros(num_clients)
    for server_round in range(rounds):
        counts[sample_cohort(0, server_round, range(num_clients), k)] += 1
    expected = rounds * k / num_clients
    sd = math.sqrt(rounds * (k / num_clients) * (1 - k / num_clients))
    assert np.abs(counts - expected).max() < 5 * sd


@pytest.mark.parametrize("k", [0, 11, -1])
def test_impossible_cohort_size_raises(k):
    with pytest.raises(ValueError, match="cohort"):
        sample_cohort(0, 1, range(10), k)
