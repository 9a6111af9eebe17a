"""strategies.cohort_pass.reduce_cohort against the sums written out model-sized, one client
at a time, in float64 (the textbook form of PAPER.md's sums and FedAvg's step)."""

from __future__ import annotations

import numpy as np
import pytest

import strategies.cohort_pass as cohort_pass
from strategies.cohort_pass import ServerStep, reduce_cohort

SHAPES = [(7, 5), (3,), (2, 2, 3), (1,)]


def _cohort(k: int, seed: int = 0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    updates = [[rng.standard_normal(s).astype(dtype) for s in SHAPES] for _ in range(k)]
    weights = [float(n) for n in rng.integers(1, 50, size=k)]
    theta = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    return updates, weights, theta


def _reference(updates, weights, theta, step: str, coefs=None):
    """Model-sized float64 sums, client by client in the given order."""
    flat = [np.concatenate([np.asarray(b, np.float64).ravel() for b in u]) for u in updates]
    total = sum(flat)
    weighted = sum(w * f for w, f in zip(weights, flat, strict=True))
    sums = {
        "sum_sq_norms": sum(float(f @ f) for f in flat),
        "weighted_sum_sq_norms": sum(w * w * float(f @ f) for w, f in zip(weights, flat, strict=True)),
        "sq_norm_of_sum": float(total @ total),
        "sq_norm_of_weighted_sum": float(weighted @ weighted),
    }
    new = []
    for b, t in enumerate(theta):
        blocks = [np.asarray(u[b], np.float64) for u in updates]
        if step == "masked":
            delta = blocks[0] * coefs[0][b]
            for k in range(1, len(blocks)):
                if coefs[k][b] != 0.0:
                    delta += coefs[k][b] * blocks[k]
        elif step == "weighted":
            delta = weights[0] * blocks[0]
            for w, x in zip(weights[1:], blocks[1:], strict=True):
                delta += w * x
            delta /= sum(weights)
        else:
            delta = blocks[0].copy()
            for x in blocks[1:]:
                delta += x
            delta /= len(blocks)
        new.append((t.astype(np.float64) - delta).astype(t.dtype))
    return sums, new


@pytest.fixture(params=[4, 1 << 16], ids=["chunk=4", "chunk=65536"])
def chunk(request, monkeypatch):
    """A 4-element chunk splits every block into many chunks; the default keeps them whole."""
    monkeypatch.setattr(cohort_pass, "CHUNK", request.param)
    return request.param


@pytest.mark.parametrize("step", ["weighted", "uniform", "masked"])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_the_model_sized_reference(chunk, step, threads):
    updates, weights, theta = _cohort(5)
    rng = np.random.default_rng(1)
    coefs = [[float(rng.random() < 0.5) * 2.0 * w / sum(weights) for _ in SHAPES] for w in weights]
    expected_sums, expected_params = _reference(updates, weights, theta, step, coefs)
    server_step = ServerStep(theta, weighted=step == "weighted", block_coefs=coefs if step == "masked" else None)
    sums, params = reduce_cohort(updates, weights, server_step, threads=threads)
    for name, value in expected_sums.items():
        assert getattr(sums, name) == pytest.approx(value, rel=1e-12), name
    assert sums.cohort_size == 5 and sums.total_weight == sum(weights)
    for got, want in zip(params, expected_params, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)  # same float64 operations per element, in order


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_thread_count_changes_neither_the_step_nor_the_sums(chunk, threads):
    updates, weights, theta = _cohort(4, seed=3)
    one = reduce_cohort(updates, weights, ServerStep(theta), threads=1)
    many = reduce_cohort(updates, weights, ServerStep(theta), threads=threads)
    for a, b in zip(one[1], many[1], strict=True):
        np.testing.assert_array_equal(a, b)
    assert one[0] == many[0]  # every sum bit for bit


def test_without_a_step_only_the_sums():
    updates, weights, _ = _cohort(3)
    sums, params = reduce_cohort(updates, weights)
    assert params is None and sums.cohort_size == 3


def test_float64_accumulation_of_float32_updates():
    big, one = np.array([2.0**24], np.float32), np.array([1.0], np.float32)
    sums, params = reduce_cohort([[big], [one], [-big]], [1.0, 1.0, 1.0],
                                 ServerStep([np.zeros(1, np.float32)], weighted=False))
    assert sums.sq_norm_of_sum == 1.0  # float32 sums would lose the 1
    np.testing.assert_allclose(params[0], [-1.0 / 3.0], rtol=1e-7)


def test_identical_updates_give_k_squared_over_k():
    update = [np.linspace(-1, 1, 11, dtype=np.float32)]
    sums, _ = reduce_cohort([update] * 10, [1.0] * 10)
    assert sums.sq_norm_of_sum / sums.sum_sq_norms == pytest.approx(10.0, rel=1e-12)


def test_updates_are_only_read():
    updates, weights, theta = _cohort(3)
    for u in updates:
        for block in u:
            block.flags.writeable = False
    theta_before = [t.copy() for t in theta]
    reduce_cohort(updates, weights, ServerStep(theta))
    for t, before in zip(theta, theta_before, strict=True):
        np.testing.assert_array_equal(t, before)


@pytest.mark.parametrize(
    ("updates", "weights", "step", "match"),
    [
        ([], [], None, "no updates"),
        ([[np.ones(2)], [np.ones(2)]], [1.0], None, "weights"),
        ([[np.ones(2)], [np.ones(2)]], [1.0, 0.0], None, "positive"),
        ([[np.ones(2)], [np.ones(2), np.ones(1)]], [1.0, 1.0], None, "blocks"),
        ([[np.ones(2)], [np.ones(3)]], [1.0, 1.0], None, "sizes"),
        ([[np.ones(2)]], [1.0], ServerStep([np.ones(2), np.ones(1)]), "blocks"),
        ([[np.ones(2)]], [1.0], ServerStep([np.ones(3)]), "values"),
        ([[np.ones(2)]], [1.0], ServerStep([np.ones(2)], block_coefs=[[1.0, 1.0]]), "coefficient"),
    ],
)
def test_bad_input_is_refused_by_name(updates, weights, step, match):
    with pytest.raises(ValueError, match=match):
        reduce_cohort(updates, weights, step)


def test_split_blocks_balances_sizes():
    assert cohort_pass._split_blocks([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert cohort_pass._split_blocks([100, 1, 1], 2) == [[0], [1, 2]]
    assert cohort_pass._split_blocks([5], 4) == [[0]]
