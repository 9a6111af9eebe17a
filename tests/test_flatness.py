"""fedmask_app.measure.flatness against eigvalsh and the exact trace of small dense Hessians."""

from __future__ import annotations

import math

import pytest
import torch
from small_models import generator as _gen
from small_models import tiny_batch as _batch
from small_models import tiny_mlp as _mlp

from fedmask_app.measure.curvature import model_loss_fn
from fedmask_app.measure.flatness import (
    FLATNESS_COLUMNS,
    flatness_from_loss,
    hutchinson_trace,
    lanczos_lambda_max,
    measure_flatness,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _flat(blocks) -> torch.Tensor:
    return torch.cat([b.reshape(-1) for b in blocks])


def _unflatten(vector, like) -> list[torch.Tensor]:
    return [c.view_as(p) for c, p in zip(vector.split([p.numel() for p in like]), like, strict=True)]


def _indefinite_quadratic():
    """l(θ) = ½ θᵀAθ over blocks of shapes (4, 5), (5,), (3,), (2, 2) (n = 32): A has eigenvalues
    −10 (the largest magnitude), spread values in [−2, 2], and the largest algebraic value 5."""
    like = [torch.zeros(4, 5, dtype=torch.float64), torch.zeros(5, dtype=torch.float64),
            torch.zeros(3, dtype=torch.float64), torch.zeros(2, 2, dtype=torch.float64)]
    n = sum(p.numel() for p in like)
    eigenvalues = torch.cat([torch.tensor([-10.0, 5.0], dtype=torch.float64),
                             torch.linspace(-2.0, 2.0, n - 2, dtype=torch.float64)])
    basis, _ = torch.linalg.qr(torch.randn(n, n, generator=_gen(2), dtype=torch.float64))
    a = basis @ torch.diag(eigenvalues) @ basis.T

    def loss(params):
        t = _flat(params)
        return 0.5 * t @ a @ t

    return loss, like, a


@pytest.fixture(scope="module")
def mlp_case():
    model = _mlp()
    x, y = _batch()
    params = [p.detach().clone() for p in model.parameters()]
    loss_fn = model_loss_fn(model, x, y)
    hessian = torch.autograd.functional.hessian(lambda f: loss_fn(_unflatten(f, params)), _flat(params))
    return loss_fn, params, hessian


def test_lambda_max_is_the_largest_algebraic_eigenvalue():
    loss_fn, like, a = _indefinite_quadratic()
    eigenvalues = torch.linalg.eigvalsh(a)
    assert eigenvalues[0] == pytest.approx(-10.0) and eigenvalues[-1] == pytest.approx(5.0)
    params = [torch.randn(p.shape, generator=_gen(3), dtype=p.dtype) for p in like]
    full = lanczos_lambda_max(loss_fn, params, _gen(4), tol=1e-10, max_iter=100)
    assert full.converged and full.iterations <= 32
    assert full.value == pytest.approx(5.0, rel=1e-9)
    assert abs(full.value - float(eigenvalues.abs().max())) > 1  # not the largest magnitude (10)
    loose = lanczos_lambda_max(loss_fn, params, _gen(4), tol=1e-3, max_iter=100)
    assert loose.converged and loose.iterations < full.iterations
    assert loose.value <= 5.0 + 1e-12  # Ritz values never exceed λ_max
    assert 5.0 - loose.value <= loose.residual <= 1e-3 * abs(loose.value)
    capped = lanczos_lambda_max(loss_fn, params, _gen(4), tol=1e-14, max_iter=3)
    assert capped.iterations == 3 and not capped.converged


def test_lambda_max_and_trace_of_an_indefinite_mlp_hessian(mlp_case):
    loss_fn, params, hessian = mlp_case
    eigenvalues = torch.linalg.eigvalsh(hessian)
    assert eigenvalues[0] < 0 < eigenvalues[-1]  # away from a minimum: both signs
    top = lanczos_lambda_max(loss_fn, params, _gen(5), tol=1e-8, max_iter=hessian.shape[0])
    assert top.converged
    assert top.value == pytest.approx(float(eigenvalues[-1]), rel=1e-6)
    trace, trace_se = hutchinson_trace(loss_fn, params, 2000, _gen(6))
    assert trace_se > 0
    assert abs(trace - float(torch.trace(hessian))) < 4 * trace_se


def test_measure_flatness_model_untouched_float32_and_reproducible(mlp_case):
    _, _, hessian = mlp_case
    exact = float(torch.linalg.eigvalsh(hessian)[-1])
    rows = {}
    for dtype in (torch.float64, torch.float32):
        model = _mlp(dtype)
        model.train()
        before = [p.detach().clone() for p in model.parameters()]
        x, y = _batch(dtype)
        row = measure_flatness(model, before, x, y, generator=_gen(7), probes=8, tol=1e-5, max_iter=60)
        again = flatness_from_loss(model_loss_fn(model, x, y), before, generator=_gen(7), probes=8, tol=1e-5,
                                   max_iter=60)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
        assert model.training
        assert tuple(row) == FLATNESS_COLUMNS and row == again
        assert all(math.isfinite(v) for v in row.values())
        assert row["hessian_lambda_max_converged"] == 1.0
        assert row["hessian_lambda_max"] == pytest.approx(exact, rel=1e-4)
        rows[dtype] = row
    assert rows[torch.float32]["hessian_trace"] == pytest.approx(rows[torch.float64]["hessian_trace"], rel=1e-4)
