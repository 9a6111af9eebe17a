"""Monte-Carlo check of the paper's Propositions 2 and 3 on a quadratic loss.

L(θ) = ½ (θ − θ*)ᵀ H (θ − θ*). For a quadratic the second-order expansion is exact, so with
Δ̃_k the masked updates (block mask m^(b) ~ Bernoulli(p), kept blocks scaled by 1/p):

    E[L(θ − mean_k Δ̃_k)] − L(θ − mean_k Δ_k) = R_ind = (1/K_c²) Σ_k R(Δ_k)   (independent masks)
                                               = R_shr = R(Δ̄)                 (one shared mask)

with R(Δ) = (1−p)/(2p) Σ_b Δ^(b)ᵀ H_bb Δ^(b). The masks come from the project's block_mask.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from clients.masking import apply_mask, block_mask, mask_scales
from clients.seeds import derive_seed
from strategies.stats import cohort_statistics

BLOCK_SIZES = (2, 3, 1, 4, 2)
K_C = 4
P = 0.5
DRAWS = 20_000


def _spd(rng: np.random.Generator, n: int) -> np.ndarray:
    a = rng.normal(size=(n, n))
    return a @ a.T + 0.5 * np.eye(n)


def _block_slices() -> list[slice]:
    edges = np.cumsum((0, *BLOCK_SIZES))
    return [slice(int(lo), int(hi)) for lo, hi in itertools.pairwise(edges)]


def _hessian(rng: np.random.Generator, dense: bool) -> np.ndarray:
    d = sum(BLOCK_SIZES)
    if dense:  # off-diagonal blocks too: they must not matter, masks are independent across blocks
        return _spd(rng, d)
    h = np.zeros((d, d))
    for sl, n in zip(_block_slices(), BLOCK_SIZES, strict=True):
        h[sl, sl] = _spd(rng, n)
    return h


def _penalty(delta: np.ndarray, h: np.ndarray, p: float) -> float:
    """R(Δ) = (1−p)/(2p) Σ_b Δ^(b)ᵀ H_bb Δ^(b)."""
    return (1 - p) / (2 * p) * sum(float(delta[sl] @ h[sl, sl] @ delta[sl]) for sl in _block_slices())


def _loss(theta: np.ndarray, theta_star: np.ndarray, h: np.ndarray) -> np.ndarray:
    """L for a batch of parameter vectors (rows)."""
    e = theta - theta_star
    return 0.5 * np.einsum("...i,ij,...j->...", e, h, e)


def _client_updates(rng: np.random.Generator) -> np.ndarray:
    """K_c updates with a shared component, so that R_shr and R_ind are far apart."""
    d = sum(BLOCK_SIZES)
    mu = rng.normal(size=d)
    return mu + 0.6 * rng.normal(size=(K_C, d))


def _expand(scales: np.ndarray) -> np.ndarray:
    """Per-block factors (..., B) to per-coordinate factors (..., d)."""
    return np.repeat(scales, BLOCK_SIZES, axis=-1)


def _masked_mean(deltas: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """mean_k (m_k / p) Δ_k for masks of shape (draws, K_c, B); returns (draws, d)."""
    scales = _expand(masks.astype(np.float64) / P)
    return np.einsum("nkd,kd->nd", scales, deltas) / len(deltas)


def _check(excess: np.ndarray, expected: float, other: float) -> None:
    mean = float(excess.mean())
    se = float(excess.std(ddof=1)) / math.sqrt(len(excess))
    assert se < 0.05 * expected, "too few draws to be a tight check"
    assert abs(other - expected) > 8 * se, "the check cannot tell R_ind and R_shr apart"
    assert abs(mean - expected) < 4 * se, f"Monte-Carlo {mean:.5g} ± {se:.2g}, formula {expected:.5g}"


@pytest.fixture(scope="module", params=[False, True], ids=["block-diagonal", "dense"])
def problem(request):
    rng = np.random.default_rng(2024 + request.param)
    d = sum(BLOCK_SIZES)
    h = _hessian(rng, request.param)
    theta_star = rng.normal(size=d)
    theta = theta_star + rng.normal(size=d)
    deltas = _client_updates(rng)
    mean = deltas.mean(axis=0)
    r_ind = sum(_penalty(delta, h, P) for delta in deltas) / K_C**2
    r_shr = _penalty(mean, h, P)
    return h, theta_star, theta, deltas, r_ind, r_shr


def test_masked_mean_helper_agrees_with_apply_mask(problem):
    _, _, _, deltas, _, _ = problem
    masks = np.stack([[block_mask(derive_seed(5, k), len(BLOCK_SIZES), P) for k in range(K_C)]])
    ours = _masked_mean(deltas, masks)[0]
    slices = _block_slices()
    by_project = np.zeros_like(ours)
    for k, delta in enumerate(deltas):
        masked = apply_mask([delta[sl] for sl in slices], masks[0, k].tolist(), P)
        by_project += np.concatenate(masked) / K_C
    np.testing.assert_allclose(ours, by_project, rtol=1e-14, atol=1e-14)
    assert mask_scales(masks[0, 0].tolist(), P) == [2.0 if m else 0.0 for m in masks[0, 0]]


def test_proposition_2_independent_masks(problem):
    h, theta_star, theta, deltas, r_ind, r_shr = problem
    b = len(BLOCK_SIZES)
    masks = np.array([[block_mask(derive_seed(1, n, k), b, P) for k in range(K_C)] for n in range(DRAWS)])
    assert abs(masks.mean() - P) < 0.01
    masked = _masked_mean(deltas, masks)
    excess = _loss(theta - masked, theta_star, h) - _loss(theta - deltas.mean(axis=0), theta_star, h)
    _check(excess, r_ind, r_shr)


def test_proposition_3_synchronized_masks(problem):
    h, theta_star, theta, deltas, r_ind, r_shr = problem
    b = len(BLOCK_SIZES)
    shared = np.array([block_mask(derive_seed(2, n), b, P) for n in range(DRAWS)])
    masks = np.repeat(shared[:, None, :], K_C, axis=1)  # every client applies the same mask
    masked = _masked_mean(deltas, masks)
    excess = _loss(theta - masked, theta_star, h) - _loss(theta - deltas.mean(axis=0), theta_star, h)
    _check(excess, r_shr, r_ind)


def test_shared_over_independent_penalty_is_the_recovery_for_isotropic_blocks():
    """With H_bb = h·I, R_shr / R_ind = ‖Δ̄‖² / ((1/K_c²) Σ‖Δ_k‖²) = 1/ΔS of cohort_statistics."""
    rng = np.random.default_rng(9)
    d = sum(BLOCK_SIZES)
    h = 3.7 * np.eye(d)
    for p in (0.2, 0.5, 0.9):
        for spread in (0.1, 1.0, 5.0):
            deltas = rng.normal(size=d) + spread * rng.normal(size=(K_C, d))
            r_ind = sum(_penalty(delta, h, p) for delta in deltas) / K_C**2
            r_shr = _penalty(deltas.mean(axis=0), h, p)
            updates = [[delta[sl] for sl in _block_slices()] for delta in deltas]
            recovery = cohort_statistics(updates)["recovery"]
            assert r_shr / r_ind == pytest.approx(recovery, rel=1e-12)
    # With anisotropic blocks the Euclidean recovery is only an approximation (PAPER.md, "Limits").
    h = _hessian(rng, dense=False)
    deltas = _client_updates(rng)
    ratio = _penalty(deltas.mean(axis=0), h, P) / (sum(_penalty(x, h, P) for x in deltas) / K_C**2)
    updates = [[delta[sl] for sl in _block_slices()] for delta in deltas]
    assert ratio != pytest.approx(cohort_statistics(updates)["recovery"], rel=1e-6)


def test_recovery_bounds_the_ratio_between_one_cohort_size_and_below_one():
    """R_shr / R_ind = K_c for identical updates and < 1 for conflicting ones (isotropic H)."""
    d = sum(BLOCK_SIZES)
    h = np.eye(d)
    delta = np.arange(1.0, d + 1)
    same = np.tile(delta, (K_C, 1))
    ratio = _penalty(same.mean(axis=0), h, P) / (sum(_penalty(x, h, P) for x in same) / K_C**2)
    assert ratio == pytest.approx(K_C, rel=1e-12)
    conflict = np.stack([delta, -delta, 0.1 * delta, -0.05 * delta])
    ratio = _penalty(conflict.mean(axis=0), h, P) / (sum(_penalty(x, h, P) for x in conflict) / K_C**2)
    assert ratio < 1
