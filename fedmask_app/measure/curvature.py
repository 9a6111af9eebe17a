"""How much of masking's curvature penalty survives averaging, measured with the Hessian instead of
the Euclidean norm of PAPER.md.

Notation (the project's conventions): parameters θ are a list of tensors in ``model.parameters()``
order, a *block* is one tensor (granularity ``"tensor"``) or one coordinate (``"coordinate"``);
client updates Δ_k = θ − θ_k with weights w_k summing to 1; Δ̄ = Σ_k w_k Δ_k; θ' = θ − Δ̄ (the unmasked
FedAvg result); l is the mean cross-entropy on a fixed probe batch; H = ∇²l(θ') and
Q(Δ) = Σ_b Δ^(b)ᵀ H_bb Δ^(b) (block-diagonal part of H only; coordinate blocks give Σ_i H_ii Δ_i²).

* ρ_H = Q(Δ̄) / Σ_k w_k² Q(Δ_k), estimated with Rademacher probes (``probe_quadratic_sums``) or
  exactly (``exact_quadratic_sums``, small models); with H = I it is 1/ΔS_w.
* P_mode = E_m[l(θ − Δ̃_mode)] − l(θ') for synchronized and independent masks by Monte Carlo over mask
  draws with the first-order term as a control variate (``penalty_draws``), its second-order
  prediction (1−p)/(2p)·Q, and ρ_direct = P_shr / P_ind.
* Standard errors: ρ_H's two sums share each probe's block signs, so its delta method uses their
  covariance across probes (``paired_ratio``); the two penalties use independent mask draws, so
  ρ_direct's delta method treats them as independent (``independent_ratio``). A ratio whose
  denominator is ≤ 0 or within ``SIGNIFICANCE_Z`` standard errors of 0 is NaN, with a flag.

Hessian-vector products use ``torch.func`` (forward-over-reverse: ``jvp`` of ``grad`` through
``functional_call``) rather than curvlinops-for-pytorch or hessian-eigenthings: both install, but the
estimators here need only an HVP on a list of tensors (block-wise signs, masks and sums are ours),
which is a few lines of torch, while those packages would add scipy (and backpack, einops, …) to the
app's dependencies and work on flattened numpy/scipy linear operators.

Every random draw comes from the ``torch.Generator`` the caller passes: signs and masks are drawn on
the generator's device and then moved to the parameters' device, so a CPU generator gives the same
draws whether the model runs on CPU or CUDA.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, grad_and_value, jvp

from fedmask_app.run.schema import CURVATURE_ESTIMATES

LossFn = Callable[[Sequence[Tensor]], Tensor]
"""l(params) -> scalar tensor, params a sequence of tensors in ``model.parameters()`` order."""

GRANULARITIES = ("tensor", "coordinate")
MODES = ("synchronized", "independent")

SIGNIFICANCE_Z = 2.0
"""A ratio's denominator must exceed this many standard errors, else the ratio is NaN."""

FLAG_OK = "ok"
FLAG_NONPOSITIVE = "denominator_nonpositive"
FLAG_NOT_SIGNIFICANT = "denominator_not_significant"

CURVATURE_COLUMNS = CURVATURE_ESTIMATES
"""Columns of ``measure_curvature``: floats, except the two ``*_flag`` strings (``FLAG_*``).

probe_loss = l(θ'); probe_recovery_weighted = 1/ΔS_w (Euclidean, as rounds.csv's recovery_weighted);
q_mean = Q(Δ̄); q_clients = Σ_k w_k² Q(Δ_k); rho_h = q_mean / q_clients;
penalty_sync / penalty_ind = P_shr / P_ind (direct); rho_direct = penalty_sync / penalty_ind;
penalty_*_pred = (1−p)/(2p)·q_mean and (1−p)/(2p)·q_clients; ``*_se`` are standard errors (0 for
exact values)."""


# ---------------------------------------------------------------------------------------------
# The loss and its derivatives


def model_loss_fn(model: nn.Module, probe_x: Tensor, probe_y: Tensor) -> LossFn:
    """l(params) = mean cross-entropy of ``model`` with ``params`` on (probe_x, probe_y).

    The model's own parameters are never read or written (``torch.func.functional_call``); its
    buffers are. The cross-entropy is reduced in float64 so that loss differences of a float32
    model keep their digits. Call it inside ``evaluation_mode(model)`` (dropout, batch-norm).
    """
    names = [name for name, _ in model.named_parameters()]

    def loss(params: Sequence[Tensor]) -> Tensor:
        if len(params) != len(names):
            raise ValueError(f"expected {len(names)} parameter tensors, got {len(params)}")
        logits = functional_call(model, dict(zip(names, params, strict=True)), (probe_x,))
        return F.cross_entropy(logits.to(torch.float64), probe_y)

    return loss


@contextmanager
def evaluation_mode(model: nn.Module) -> Iterator[nn.Module]:
    """``model.eval()`` for the duration, each module's training flag restored afterwards."""
    flags = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in flags:
            module.training = training


def loss_value(loss_fn: LossFn, params: Sequence[Tensor]) -> float:
    """l(params)."""
    with torch.no_grad():
        return float(loss_fn(params))


def loss_and_grad(loss_fn: LossFn, params: Sequence[Tensor]) -> tuple[float, list[Tensor]]:
    """l(params) and g = ∇l(params)."""
    g, value = grad_and_value(loss_fn)(tuple(params))
    return float(value), list(g)


def hvp(loss_fn: LossFn, params: Sequence[Tensor], vector: Sequence[Tensor]) -> list[Tensor]:
    """H v with H = ∇²l(params), forward-over-reverse (jvp of grad); ``vector`` shaped like params."""
    _, out = jvp(grad(loss_fn), (tuple(params),), (tuple(vector),))
    return list(out)


def quadratic_form(loss_fn: LossFn, params: Sequence[Tensor], vector: Sequence[Tensor]) -> float:
    """vᵀ H v (one HVP)."""
    return dot(vector, hvp(loss_fn, params, vector))


# ---------------------------------------------------------------------------------------------
# Block algebra and random draws


def dot(a: Sequence[Tensor], b: Sequence[Tensor]) -> float:
    """⟨a, b⟩ over all blocks, accumulated in float64."""
    return float(sum(torch.sum(x * y, dtype=torch.float64) for x, y in zip(a, b, strict=True)))


def combine(updates: Sequence[Sequence[Tensor]], coeffs: Sequence[float]) -> list[Tensor]:
    """Σ_k c_k Δ_k, block by block."""
    out = [torch.zeros_like(block) for block in updates[0]]
    for update, c in zip(updates, coeffs, strict=True):
        for acc, block in zip(out, update, strict=True):
            acc.add_(block, alpha=float(c))
    return out


def subtract(a: Sequence[Tensor], b: Sequence[Tensor]) -> list[Tensor]:
    """a − b, block by block."""
    return [x - y for x, y in zip(a, b, strict=True)]


def rademacher_signs(like: Sequence[Tensor], granularity: str, generator: torch.Generator) -> list[Tensor]:
    """One ±1 per block of ``like``: a 0-dim tensor per tensor ("tensor") or a tensor of its shape
    ("coordinate"), in each block's dtype and on its device."""
    _check_granularity(granularity)
    out = []
    for block in like:
        shape = () if granularity == "tensor" else block.shape
        bits = torch.randint(0, 2, shape, generator=generator, device=generator.device)
        out.append((2 * bits - 1).to(device=block.device, dtype=block.dtype))
    return out


def bernoulli_mask(
    like: Sequence[Tensor], keep_prob: float, granularity: str, generator: torch.Generator
) -> list[Tensor]:
    """m^(b) ~ Bernoulli(p) per block of ``like`` (per tensor or per coordinate), as 0/1 in the
    block's dtype; shapes as in ``rademacher_signs``."""
    _check_granularity(granularity)
    out = []
    for block in like:
        shape = () if granularity == "tensor" else block.shape
        keep = torch.rand(shape, generator=generator, device=generator.device) < keep_prob
        out.append(keep.to(device=block.device, dtype=block.dtype))
    return out


def _check_granularity(granularity: str) -> None:
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")


# ---------------------------------------------------------------------------------------------
# Statistics


def mean_and_se(values: Sequence[float] | Tensor) -> tuple[float, float]:
    """Sample mean and its standard error sd/√n (n−1 in the variance)."""
    x = torch.as_tensor(values, dtype=torch.float64)
    if x.numel() < 2:
        raise ValueError("a standard error needs at least 2 samples")
    return float(x.mean()), float(x.std(unbiased=True) / math.sqrt(x.numel()))


def ratio_flag(denominator: float, denominator_se: float, z: float = SIGNIFICANCE_Z) -> str:
    """``FLAG_OK`` when the denominator is positive and more than z standard errors from 0."""
    if not denominator > 0:
        return FLAG_NONPOSITIVE
    if not denominator > z * denominator_se:
        return FLAG_NOT_SIGNIFICANT
    return FLAG_OK


def paired_ratio(
    numerators: Sequence[float] | Tensor, denominators: Sequence[float] | Tensor
) -> tuple[float, float, str]:
    """ā / b̄ from paired samples (a_i, b_i) and its delta-method standard error, which uses the
    covariance across the pairs: se = sd(a_i − ρ̂ b_i) / (√n · b̄). NaN and a flag when b̄ fails
    ``ratio_flag``."""
    a = torch.as_tensor(numerators, dtype=torch.float64)
    b = torch.as_tensor(denominators, dtype=torch.float64)
    b_mean, b_se = mean_and_se(b)
    flag = ratio_flag(b_mean, b_se)
    if flag != FLAG_OK:
        return math.nan, math.nan, flag
    rho = float(a.mean()) / b_mean
    _, residual_se = mean_and_se(a - rho * b)
    return rho, residual_se / b_mean, flag


def independent_ratio(num: float, num_se: float, den: float, den_se: float) -> tuple[float, float, str]:
    """num / den of two independent estimates and its delta-method standard error,
    se = √(se_num² + ρ² se_den²) / den. NaN and a flag when den fails ``ratio_flag``."""
    flag = ratio_flag(den, den_se)
    if flag != FLAG_OK:
        return math.nan, math.nan, flag
    rho = num / den
    return rho, math.sqrt(num_se**2 + rho**2 * den_se**2) / den, flag


def weighted_recovery(updates: Sequence[Sequence[Tensor]], weights: Sequence[float]) -> float:
    """recovery_weighted = 1/ΔS_w = ‖Σ_k w_k Δ_k‖² / Σ_k w_k² ‖Δ_k‖² (Euclidean; NaN if all Δ_k = 0)."""
    mean = combine(updates, weights)
    denominator = sum(w * w * dot(u, u) for u, w in zip(updates, weights, strict=True))
    return dot(mean, mean) / denominator if denominator > 0 else math.nan


# ---------------------------------------------------------------------------------------------
# Q(Δ̄) and Σ_k w_k² Q(Δ_k)


def probe_quadratic_sums(
    loss_fn: LossFn,
    params: Sequence[Tensor],
    updates: Sequence[Sequence[Tensor]],
    weights: Sequence[float],
    granularity: str,
    probes: int,
    generator: torch.Generator,
) -> tuple[Tensor, Tensor]:
    """Per-probe Rademacher estimates (a_i, b_i), i < probes, of Q(Δ̄) and Σ_k w_k² Q(Δ_k) at
    ``params`` (θ'); two HVPs per probe whatever the number of clients.

    Probe i draws block signs s (per tensor or coordinate) and client signs r_k and sets
    v1 = s ⊙ Δ̄ and v2 = s ⊙ Σ_k r_k w_k Δ_k; a_i = v1ᵀHv1, b_i = v2ᵀHv2. Since E[s_b s_b'] = δ_bb'
    and E[r_k r_k'] = δ_kk', E[a_i] = Q(Δ̄) and E[b_i] = Σ_k w_k² Q(Δ_k) (the client signs
    s_b r_k are pairwise independent across (k, b), which is all the expectation needs). Sharing s
    pairs a_i with b_i: ``paired_ratio`` uses their covariance.
    """
    mean = combine(updates, weights)
    a = torch.empty(probes, dtype=torch.float64)
    b = torch.empty(probes, dtype=torch.float64)
    for i in range(probes):
        signs = rademacher_signs(mean, granularity, generator)
        client_signs = (2 * torch.randint(0, 2, (len(updates),), generator=generator, device=generator.device) - 1)
        coeffs = [float(r) * w for r, w in zip(client_signs.tolist(), weights, strict=True)]
        v1 = [s * x for s, x in zip(signs, mean, strict=True)]
        v2 = [s * x for s, x in zip(signs, combine(updates, coeffs), strict=True)]
        a[i] = quadratic_form(loss_fn, params, v1)
        b[i] = quadratic_form(loss_fn, params, v2)
    return a, b


def hessian_diagonal(loss_fn: LossFn, params: Sequence[Tensor]) -> list[Tensor]:
    """diag H block by block, one HVP per coordinate: small models only."""
    diagonal = [torch.zeros_like(p) for p in params]
    for b, block in enumerate(params):
        for j in range(block.numel()):
            unit = [torch.zeros_like(p) for p in params]
            unit[b].view(-1)[j] = 1
            diagonal[b].view(-1)[j] = hvp(loss_fn, params, unit)[b].view(-1)[j]
    return diagonal


def block_quadratic(
    loss_fn: LossFn, params: Sequence[Tensor], delta: Sequence[Tensor], granularity: str,
    diagonal: Sequence[Tensor] | None = None,
) -> float:
    """Q(Δ) exactly: Σ_b Δ^(b)ᵀ H_bb Δ^(b) with one HVP per tensor ("tensor"), or Σ_i H_ii Δ_i²
    ("coordinate", from ``diagonal`` = ``hessian_diagonal`` if given, else computed)."""
    _check_granularity(granularity)
    if granularity == "coordinate":
        diagonal = hessian_diagonal(loss_fn, params) if diagonal is None else diagonal
        return dot(diagonal, [d * d for d in delta])
    total = 0.0
    for b, block in enumerate(delta):
        vector = [block if j == b else torch.zeros_like(p) for j, p in enumerate(params)]
        total += float(torch.sum(block * hvp(loss_fn, params, vector)[b], dtype=torch.float64))
    return total


def exact_quadratic_sums(
    loss_fn: LossFn,
    params: Sequence[Tensor],
    updates: Sequence[Sequence[Tensor]],
    weights: Sequence[float],
    granularity: str,
) -> tuple[float, float]:
    """Q(Δ̄) and Σ_k w_k² Q(Δ_k) exactly (``block_quadratic``): (K_c + 1)·B HVPs for "tensor",
    one per coordinate for "coordinate". For tests and small models."""
    diagonal = hessian_diagonal(loss_fn, params) if granularity == "coordinate" else None
    q_mean = block_quadratic(loss_fn, params, combine(updates, weights), granularity, diagonal)
    q_clients = sum(
        w * w * block_quadratic(loss_fn, params, u, granularity, diagonal)
        for u, w in zip(updates, weights, strict=True)
    )
    return q_mean, float(q_clients)


# ---------------------------------------------------------------------------------------------
# The direct penalty


def masked_mean_update(
    updates: Sequence[Sequence[Tensor]],
    weights: Sequence[float],
    keep_prob: float,
    mode: str,
    granularity: str,
    generator: torch.Generator,
) -> list[Tensor]:
    """One draw of Δ̃: Σ_k w_k (m/p) ⊙ Δ_k with one mask m for all clients ("synchronized") or
    Σ_k w_k (m_k/p) ⊙ Δ_k with a mask per client ("independent")."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "synchronized":
        mask = bernoulli_mask(updates[0], keep_prob, granularity, generator)
        return [m / keep_prob * x for m, x in zip(mask, combine(updates, weights), strict=True)]
    out = [torch.zeros_like(block) for block in updates[0]]
    for update, w in zip(updates, weights, strict=True):
        mask = bernoulli_mask(update, keep_prob, granularity, generator)
        for acc, m, x in zip(out, mask, update, strict=True):
            acc.add_(m * x, alpha=w / keep_prob)
    return out


def penalty_draws(
    loss_fn: LossFn,
    theta: Sequence[Tensor],
    updates: Sequence[Sequence[Tensor]],
    weights: Sequence[float],
    keep_prob: float,
    mode: str,
    granularity: str,
    draws: int,
    generator: torch.Generator,
    base: tuple[float, Sequence[Tensor]] | None = None,
) -> Tensor:
    """Per-draw samples of P_mode = E_m[l(θ − Δ̃)] − l(θ') with the control variate removed:
    y = l(θ − Δ̃) − l(θ') + gᵀ(Δ̃ − Δ̄), g = ∇l(θ'). The subtracted term −gᵀ(Δ̃ − Δ̄) is the
    first-order part of the deviation and has zero mean (E[Δ̃] = Δ̄), so E[y] = P_mode.
    ``base`` = (l(θ'), g) if already computed."""
    mean = combine(updates, weights)
    base_loss, g = loss_and_grad(loss_fn, subtract(theta, mean)) if base is None else base
    out = torch.empty(draws, dtype=torch.float64)
    for i in range(draws):
        masked = masked_mean_update(updates, weights, keep_prob, mode, granularity, generator)
        first_order = dot(g, subtract(masked, mean))
        out[i] = loss_value(loss_fn, subtract(theta, masked)) - base_loss + first_order
    return out


def second_order_penalty(q: float, keep_prob: float) -> float:
    """(1−p)/(2p)·Q: the second-order prediction of a penalty from its quadratic sum."""
    return (1.0 - keep_prob) / (2.0 * keep_prob) * q


# ---------------------------------------------------------------------------------------------
# One round's measurement


def curvature_from_loss(
    loss_fn: LossFn,
    theta: Sequence[Tensor],
    updates: Sequence[Sequence[Tensor]],
    weights: Sequence[float],
    *,
    generator: torch.Generator,
    keep_prob: float = 0.5,
    probes: int = 8,
    draws: int = 16,
    granularity: str = "tensor",
    exact: bool = False,
) -> dict[str, float | str]:
    """The ``CURVATURE_COLUMNS`` of one round for a generic loss l(params).

    ρ_H pairs its two sums probe by probe (covariance in the delta method); ρ_direct divides two
    independent Monte Carlo estimates (independent delta method). ``exact`` replaces the probe
    estimates of the Q sums by ``exact_quadratic_sums`` (standard errors 0).
    """
    theta, updates, weights = _validated(theta, updates, weights, keep_prob, probes, draws, granularity)
    mean = combine(updates, weights)
    theta_prime = subtract(theta, mean)
    base_loss, g = loss_and_grad(loss_fn, theta_prime)
    row: dict[str, float | str] = {
        "probe_loss": base_loss, "probe_recovery_weighted": weighted_recovery(updates, weights),
    }

    if exact:
        q_mean, q_clients = exact_quadratic_sums(loss_fn, theta_prime, updates, weights, granularity)
        q_mean_se = q_clients_se = 0.0
        rho_h, rho_h_se, rho_h_flag = independent_ratio(q_mean, 0.0, q_clients, 0.0)
    else:
        a, b = probe_quadratic_sums(loss_fn, theta_prime, updates, weights, granularity, probes, generator)
        (q_mean, q_mean_se), (q_clients, q_clients_se) = mean_and_se(a), mean_and_se(b)
        rho_h, rho_h_se, rho_h_flag = paired_ratio(a, b)
    row.update(q_mean=q_mean, q_mean_se=q_mean_se, q_clients=q_clients, q_clients_se=q_clients_se,
               rho_h=rho_h, rho_h_se=rho_h_se, rho_h_flag=rho_h_flag)

    penalties = {}
    for mode in MODES:
        samples = penalty_draws(loss_fn, theta, updates, weights, keep_prob, mode, granularity, draws, generator,
                                base=(base_loss, g))
        penalties[mode] = mean_and_se(samples)
    (p_sync, p_sync_se), (p_ind, p_ind_se) = penalties["synchronized"], penalties["independent"]
    rho_direct, rho_direct_se, rho_direct_flag = independent_ratio(p_sync, p_sync_se, p_ind, p_ind_se)
    row.update(penalty_sync=p_sync, penalty_sync_se=p_sync_se, penalty_ind=p_ind, penalty_ind_se=p_ind_se,
               rho_direct=rho_direct, rho_direct_se=rho_direct_se, rho_direct_flag=rho_direct_flag,
               penalty_sync_pred=second_order_penalty(q_mean, keep_prob),
               penalty_ind_pred=second_order_penalty(q_clients, keep_prob))
    return {column: row[column] for column in CURVATURE_COLUMNS}


def measure_curvature(
    model: nn.Module,
    theta: Sequence[Tensor],
    updates: Sequence[Sequence[Tensor]],
    weights: Sequence[float],
    probe_x: Tensor,
    probe_y: Tensor,
    *,
    generator: torch.Generator,
    keep_prob: float = 0.5,
    probes: int = 8,
    draws: int = 16,
    granularity: str = "tensor",
    exact: bool = False,
) -> dict[str, float | str]:
    """``curvature_from_loss`` with l = mean cross-entropy of ``model`` on (probe_x, probe_y).

    θ, the Δ_k and the probe batch are moved to the device of the model's parameters (dtypes kept;
    they must match the model's). The model is evaluated in eval mode (its flags restored after);
    its parameters are never changed. Cost: 1 gradient, 2·probes HVPs and 2·draws forward passes.
    """
    device = next(model.parameters()).device
    theta = [t.detach().to(device) for t in theta]
    updates = [[block.detach().to(device) for block in u] for u in updates]
    with evaluation_mode(model):
        loss_fn = model_loss_fn(model, probe_x.to(device), probe_y.to(device))
        return curvature_from_loss(loss_fn, theta, updates, weights, generator=generator, keep_prob=keep_prob,
                                   probes=probes, draws=draws, granularity=granularity, exact=exact)


def _validated(
    theta: Sequence[Tensor],
    updates: Sequence[Sequence[Tensor]],
    weights: Sequence[float],
    keep_prob: float,
    probes: int,
    draws: int,
    granularity: str,
) -> tuple[list[Tensor], list[list[Tensor]], list[float]]:
    _check_granularity(granularity)
    theta = [t.detach() for t in theta]
    updates = [[block.detach() for block in u] for u in updates]
    weights = [float(w) for w in weights]
    if not updates or len(updates) != len(weights):
        raise ValueError(f"need one weight per update, got {len(updates)} updates and {len(weights)} weights")
    if abs(sum(weights) - 1.0) > 1e-6:
        raise ValueError(f"weights must sum to 1, got {sum(weights)}")
    for k, u in enumerate(updates):
        if [b.shape for b in u] != [t.shape for t in theta]:
            raise ValueError(f"update {k} is not shaped like theta")
    if not 0.0 < keep_prob <= 1.0:
        raise ValueError(f"keep_prob must be in (0, 1], got {keep_prob}")
    if probes < 2 or draws < 2:
        raise ValueError(f"probes and draws must be at least 2 (standard errors), got {probes} and {draws}")
    return theta, updates, weights
