"""fedmask_app.measure.curvature against exact Hessians of tiny models and quadratic losses."""

from __future__ import annotations

import math

import pytest
import torch
from small_models import generator as _gen
from small_models import tiny_batch as _batch
from small_models import tiny_mlp as _mlp

from fedmask_app.measure.curvature import (
    CURVATURE_COLUMNS,
    FLAG_NONPOSITIVE,
    FLAG_NOT_SIGNIFICANT,
    FLAG_OK,
    curvature_from_loss,
    exact_quadratic_sums,
    masked_mean_update,
    measure_curvature,
    model_loss_fn,
    paired_ratio,
    penalty_draws,
    probe_quadratic_sums,
    subtract,
    weighted_recovery,
)

WEIGHTS = [0.1, 0.2, 0.3, 0.4]


pytestmark = pytest.mark.usefixtures("one_thread")


def _updates(like, scale: float = 0.3, seed: int = 2) -> list[list[torch.Tensor]]:
    """Δ_k = scale·(μ + ε_k): a shared direction plus client noise."""
    g = _gen(seed)
    mu = [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in like]
    updates = [[scale * (m + torch.randn(m.shape, generator=g, dtype=m.dtype)) for m in mu] for _ in WEIGHTS]
    return [[d.to(p.dtype) for d, p in zip(u, like, strict=True)] for u in updates]


def _flat(blocks) -> torch.Tensor:
    return torch.cat([b.reshape(-1) for b in blocks])


def _unflatten(vector, like) -> list[torch.Tensor]:
    return [c.view_as(p) for c, p in zip(vector.split([p.numel() for p in like]), like, strict=True)]


def _exact_q(hessian: torch.Tensor, like, delta, granularity: str) -> float:
    """Q(Δ) from a dense Hessian: Σ_b Δ_bᵀ H_bb Δ_b or Σ_i H_ii Δ_i²."""
    d = _flat(delta)
    if granularity == "coordinate":
        return float(torch.diagonal(hessian) @ (d * d))
    total, start = 0.0, 0
    for p in like:
        block = slice(start, start + p.numel())
        total += float(d[block] @ hessian[block, block] @ d[block])
        start += p.numel()
    return total


def _exact_sums(hessian, like, updates, granularity: str) -> tuple[float, float]:
    mean = [sum(w * u[b] for u, w in zip(updates, WEIGHTS, strict=True)) for b in range(len(like))]
    q_clients = sum(w * w * _exact_q(hessian, like, u, granularity) for u, w in zip(updates, WEIGHTS, strict=True))
    return _exact_q(hessian, like, mean, granularity), q_clients


def _quadratic(like, a: torch.Tensor, b: torch.Tensor):
    """l(θ) = ½ θᵀAθ + bᵀθ on the flattened blocks."""

    def loss(params):
        t = _flat(params)
        return 0.5 * t @ a @ t + b @ t

    return loss


@pytest.fixture(scope="module")
def mlp_case():
    model = _mlp()
    x, y = _batch()
    theta = [p.detach().clone() for p in model.parameters()]
    updates = _updates(theta)
    loss_fn = model_loss_fn(model, x, y)
    mean = [sum(w * u[b] for u, w in zip(updates, WEIGHTS, strict=True)) for b in range(len(theta))]
    theta_prime = subtract(theta, mean)
    flat = _flat(theta_prime)
    hessian = torch.autograd.functional.hessian(lambda f: loss_fn(_unflatten(f, theta_prime)), flat)
    return loss_fn, theta, theta_prime, updates, hessian


@pytest.mark.parametrize("granularity", ["tensor", "coordinate"])
def test_probe_estimates_match_exact_hessian(mlp_case, granularity):
    loss_fn, _, theta_prime, updates, hessian = mlp_case
    q_mean, q_clients = _exact_sums(hessian, theta_prime, updates, granularity)
    assert q_clients > 0

    exact = exact_quadratic_sums(loss_fn, theta_prime, updates, WEIGHTS, granularity)
    assert exact == pytest.approx((q_mean, q_clients), rel=1e-9, abs=1e-12)

    a, b = probe_quadratic_sums(loss_fn, theta_prime, updates, WEIGHTS, granularity, 1000, _gen(3))
    n = len(a)
    for samples, target in ((a, q_mean), (b, q_clients)):
        se = float(samples.std()) / math.sqrt(n)
        assert se > 0
        assert abs(float(samples.mean()) - target) < 4 * se
    rho, rho_se, flag = paired_ratio(a, b)
    assert flag == FLAG_OK
    assert abs(rho - q_mean / q_clients) < 4 * rho_se


def test_quadratic_direct_penalty_matches_second_order_prediction():
    like = [torch.zeros(3, 4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64),
            torch.zeros(5, dtype=torch.float64)]
    g = _gen(4)
    n = sum(p.numel() for p in like)
    m = torch.randn(n, n, generator=g, dtype=torch.float64)
    a = m @ m.T / n + 0.1 * torch.eye(n, dtype=torch.float64)
    loss_fn = _quadratic(like, a, torch.randn(n, generator=g, dtype=torch.float64))
    theta = [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in like]
    updates = _updates(like, scale=1.0, seed=5)
    for granularity in ("tensor", "coordinate"):
        row = curvature_from_loss(loss_fn, theta, updates, WEIGHTS, generator=_gen(6), keep_prob=0.3, probes=2,
                                  draws=3000, granularity=granularity, exact=True)
        q_mean, q_clients = _exact_sums(a, like, updates, granularity)
        assert row["q_mean"] == pytest.approx(q_mean, rel=1e-10)
        assert row["q_clients"] == pytest.approx(q_clients, rel=1e-10)
        assert row["penalty_sync_pred"] == pytest.approx(0.7 / 0.6 * q_mean, rel=1e-10)
        assert row["penalty_ind_pred"] == pytest.approx(0.7 / 0.6 * q_clients, rel=1e-10)
        for mode in ("sync", "ind"):
            assert row[f"penalty_{mode}_se"] > 0
            assert abs(row[f"penalty_{mode}"] - row[f"penalty_{mode}_pred"]) < 4 * row[f"penalty_{mode}_se"]
        assert row["rho_direct_flag"] == FLAG_OK
        assert abs(row["rho_direct"] - q_mean / q_clients) < 4 * row["rho_direct_se"]


@pytest.mark.parametrize("mode", ["synchronized", "independent"])
def test_control_variate_leaves_exactly_the_quadratic_term(mode):
    """On a quadratic each controlled draw is ½ dᵀAd with d = Δ̃ − Δ̄, for the very same masks."""
    like = [torch.zeros(2, 3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)]
    g = _gen(7)
    n = sum(p.numel() for p in like)
    m = torch.randn(n, n, generator=g, dtype=torch.float64)
    a = m + m.T
    loss_fn = _quadratic(like, a, torch.randn(n, generator=g, dtype=torch.float64))
    theta = [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in like]
    updates = _updates(like, seed=8)
    samples = penalty_draws(loss_fn, theta, updates, WEIGHTS, 0.5, mode, "coordinate", 5, _gen(9))
    replay = _gen(9)
    mean = _flat([sum(w * u[b] for u, w in zip(updates, WEIGHTS, strict=True)) for b in range(len(like))])
    for sample in samples:
        d = _flat(masked_mean_update(updates, WEIGHTS, 0.5, mode, "coordinate", replay)) - mean
        assert float(sample) == pytest.approx(float(0.5 * d @ a @ d), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("granularity", ["tensor", "coordinate"])
def test_identity_hessian_gives_euclidean_recovery(granularity):
    like = [torch.zeros(3, 4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64),
            torch.zeros(5, dtype=torch.float64)]
    theta = [torch.ones_like(p) for p in like]
    updates = _updates(like, seed=10)

    def half_sq_norm(params):
        return 0.5 * sum((p * p).sum() for p in params)

    exact = curvature_from_loss(half_sq_norm, theta, updates, WEIGHTS, generator=_gen(11), granularity=granularity,
                                exact=True)
    recovery = weighted_recovery(updates, WEIGHTS)
    flat = [_flat(u) for u in updates]
    mean = sum(w * f for w, f in zip(WEIGHTS, flat, strict=True))
    by_hand = float(mean @ mean) / sum(w * w * float(f @ f) for w, f in zip(WEIGHTS, flat, strict=True))
    assert recovery == pytest.approx(by_hand, rel=1e-14)
    assert exact["probe_recovery_weighted"] == pytest.approx(by_hand, rel=1e-14)
    assert exact["rho_h"] == pytest.approx(by_hand, rel=1e-13)

    estimated = curvature_from_loss(half_sq_norm, theta, updates, WEIGHTS, generator=_gen(12), probes=1000,
                                    granularity=granularity)
    assert estimated["q_mean"] == pytest.approx(float(mean @ mean), rel=1e-13)  # v1ᵀv1 = ‖Δ̄‖² for every probe
    assert estimated["rho_h_flag"] == FLAG_OK
    assert abs(estimated["rho_h"] - by_hand) < 4 * estimated["rho_h_se"]


def test_negative_curvature_is_kept_and_ratios_are_flagged():
    like = [torch.zeros(3, dtype=torch.float64), torch.zeros(2, 2, dtype=torch.float64)]

    def concave(params):
        return -0.5 * sum((p * p).sum() for p in params)

    row = curvature_from_loss(concave, [torch.ones_like(p) for p in like], _updates(like, seed=13), WEIGHTS,
                              generator=_gen(14), exact=True)
    assert row["q_mean"] < 0 and row["q_clients"] < 0 and row["penalty_ind"] < 0
    assert math.isnan(row["rho_h"]) and row["rho_h_flag"] == FLAG_NONPOSITIVE
    assert math.isnan(row["rho_direct"]) and row["rho_direct_flag"] == FLAG_NONPOSITIVE


def test_paired_ratio_delta_method():
    a = torch.tensor([2.0, 3.0, 5.0, 4.0, 6.0], dtype=torch.float64)
    b = torch.tensor([1.0, 2.0, 2.0, 3.0, 2.0], dtype=torch.float64)
    rho, se, flag = paired_ratio(a, b)
    n, rho_hat = len(a), float(a.mean() / b.mean())
    cov = torch.cov(torch.stack([a, b]))
    var = (cov[0, 0] - 2 * rho_hat * cov[0, 1] + rho_hat**2 * cov[1, 1]) / (n * float(b.mean()) ** 2)
    assert flag == FLAG_OK and rho == pytest.approx(rho_hat) and se == pytest.approx(math.sqrt(float(var)))
    rho, se, flag = paired_ratio(a, torch.tensor([1.0, -1.0, 1.0, -1.0, 0.5]))
    assert math.isnan(rho) and math.isnan(se) and flag == FLAG_NOT_SIGNIFICANT


def test_measure_curvature_model_untouched_float32_and_reproducible():
    rows = {}
    for dtype in (torch.float64, torch.float32):
        model = _mlp(dtype)
        model.train()
        before = [p.detach().clone() for p in model.parameters()]
        theta = [p + 0.05 for p in before]  # θ need not be the model's own parameters
        updates = _updates(before, scale=0.1)
        x, y = _batch(dtype)
        row = measure_curvature(model, theta, updates, WEIGHTS, x, y, generator=_gen(15), probes=4, draws=4,
                                exact=True)
        again = measure_curvature(model, theta, updates, WEIGHTS, x, y, generator=_gen(15), probes=4, draws=4,
                                  exact=True)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
        assert model.training
        assert tuple(row) == CURVATURE_COLUMNS
        assert row == again
        assert all(isinstance(v, str) or math.isfinite(v) for v in row.values())
        estimated = measure_curvature(model, theta, updates, WEIGHTS, x, y, generator=_gen(16), probes=4, draws=4,
                                      granularity="coordinate")
        assert tuple(estimated) == CURVATURE_COLUMNS
        rows[dtype] = row
    # Same data, updates and masks in both dtypes: only rounding differs (the loss is reduced in float64).
    single, double = rows[torch.float32], rows[torch.float64]
    for column in CURVATURE_COLUMNS:
        if column.endswith("_flag"):
            assert single[column] == double[column] == FLAG_OK
        else:
            assert single[column] == pytest.approx(double[column], rel=1e-4, abs=1e-12)
