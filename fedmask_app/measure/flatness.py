"""Flatness of the loss at given parameters: the top Hessian eigenvalue λ_max (largest algebraic, not
largest magnitude) by Lanczos with full reorthogonalisation, and the Hessian trace tr H by
Hutchinson's estimator with Rademacher probes. HVPs come from ``curvature.hvp`` (torch.func).

Stopping rule of ``lanczos_lambda_max``: after each iteration j the top Ritz pair (θ_j, y) of the
j×j tridiagonal matrix has residual ‖H y − θ_j y‖ = β_j |e_jᵀ s| (s the eigenvector of the
tridiagonal matrix); iteration stops when that residual is ≤ tol·|θ_j|. H then has an eigenvalue
within that residual of θ_j, and θ_j ≤ λ_max always (Ritz values interlace).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from fedmask_app.measure.curvature import (
    LossFn,
    evaluation_mode,
    hvp,
    mean_and_se,
    model_loss_fn,
    quadratic_form,
    rademacher_signs,
)
from fedmask_app.run.schema import FLATNESS_ESTIMATES

FLATNESS_COLUMNS = FLATNESS_ESTIMATES
"""Columns of ``measure_flatness`` (all floats): λ_max, its Ritz residual ‖Hy − λy‖, the Lanczos
iterations (= HVPs) used, 1.0 if the residual met the tolerance (else 0.0), tr H and its standard
error."""


@dataclass(frozen=True)
class LanczosResult:
    """λ_max estimate (top Ritz value), its residual ‖Hy − θy‖, iterations (HVPs) used, converged."""

    value: float
    residual: float
    iterations: int
    converged: bool


def _flatten(blocks: Sequence[Tensor]) -> Tensor:
    return torch.cat([b.reshape(-1) for b in blocks])


def _unflatten(vector: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    return [chunk.view_as(p) for chunk, p in zip(vector.split([p.numel() for p in like]), like, strict=True)]


def _top_ritz(alphas: list[float], betas: list[float]) -> tuple[float, float]:
    """Top eigenvalue of the tridiagonal T (diagonal alphas, off-diagonal betas) and the last
    component of its unit eigenvector."""
    t = torch.diag(torch.tensor(alphas, dtype=torch.float64))
    if betas:
        off = torch.tensor(betas, dtype=torch.float64)
        t += torch.diag(off, 1) + torch.diag(off, -1)
    values, vectors = torch.linalg.eigh(t)
    return float(values[-1]), float(vectors[-1, -1])


def lanczos_lambda_max(
    loss_fn: LossFn,
    params: Sequence[Tensor],
    generator: torch.Generator,
    tol: float = 1e-3,
    max_iter: int = 20,
) -> LanczosResult:
    """λ_max of H = ∇²l(params), the largest algebraic eigenvalue, by Lanczos from a Gaussian start
    drawn from ``generator``, with full (twice-applied) reorthogonalisation against all previous
    Lanczos vectors, stopped when the top Ritz residual is ≤ tol·|θ| (module docstring) or after
    ``max_iter`` HVPs. Stores max_iter vectors of the parameters' size."""
    params = [p.detach() for p in params]
    like = params[0]
    n = sum(p.numel() for p in params)
    steps = min(max_iter, n)
    basis = torch.empty(steps, n, dtype=like.dtype, device=like.device)
    q = torch.randn(n, generator=generator, device=generator.device, dtype=torch.float64)
    q = (q / q.norm()).to(device=like.device, dtype=like.dtype)
    alphas: list[float] = []
    betas: list[float] = []
    value = residual = math.nan
    for j in range(steps):
        basis[j] = q
        w = _flatten(hvp(loss_fn, params, _unflatten(q, params)))
        alphas.append(float(torch.dot(q.double(), w.double())))
        for _ in range(2):  # full reorthogonalisation, "twice is enough"
            w -= basis[: j + 1].T @ (basis[: j + 1] @ w)
        beta = float(w.double().norm())
        value, last = _top_ritz(alphas, betas)
        residual = beta * abs(last)
        scale = max(abs(a) for a in alphas) + (max(betas) if betas else 0.0)
        if residual <= tol * abs(value) or beta <= 1e-12 * max(scale, 1e-300):
            return LanczosResult(value, residual, j + 1, True)
        betas.append(beta)
        q = w / beta
    return LanczosResult(value, residual, steps, residual <= tol * abs(value))


def hutchinson_trace(
    loss_fn: LossFn, params: Sequence[Tensor], probes: int, generator: torch.Generator
) -> tuple[float, float]:
    """tr H ≈ mean over probes of zᵀHz, z Rademacher per coordinate; returns (mean, standard error)."""
    params = [p.detach() for p in params]
    samples = [
        quadratic_form(loss_fn, params, rademacher_signs(params, "coordinate", generator)) for _ in range(probes)
    ]
    return mean_and_se(samples)


def flatness_from_loss(
    loss_fn: LossFn,
    params: Sequence[Tensor],
    *,
    generator: torch.Generator,
    probes: int = 8,
    tol: float = 1e-3,
    max_iter: int = 20,
) -> dict[str, float]:
    """The ``FLATNESS_COLUMNS`` of a generic loss l at ``params``: max_iter + probes HVPs at most."""
    top = lanczos_lambda_max(loss_fn, params, generator, tol=tol, max_iter=max_iter)
    trace, trace_se = hutchinson_trace(loss_fn, params, probes, generator)
    return {
        "hessian_lambda_max": top.value,
        "hessian_lambda_max_residual": top.residual,
        "hessian_lambda_max_iterations": float(top.iterations),
        "hessian_lambda_max_converged": float(top.converged),
        "hessian_trace": trace,
        "hessian_trace_se": trace_se,
    }


def measure_flatness(
    model: nn.Module,
    params: Sequence[Tensor],
    probe_x: Tensor,
    probe_y: Tensor,
    *,
    generator: torch.Generator,
    probes: int = 8,
    tol: float = 1e-3,
    max_iter: int = 20,
) -> dict[str, float]:
    """``flatness_from_loss`` with l = mean cross-entropy of ``model`` on (probe_x, probe_y) at
    ``params`` (moved to the model's device; eval mode; the model's parameters are not changed)."""
    device = next(model.parameters()).device
    params = [p.detach().to(device) for p in params]
    with evaluation_mode(model):
        loss_fn = model_loss_fn(model, probe_x.to(device), probe_y.to(device))
        return flatness_from_loss(loss_fn, params, generator=generator, probes=probes, tol=tol, max_iter=max_iter)
