"""A cohort's local training in one batched computation: every client's SGD step at once.

``vectorized_local_updates`` gives each client the result ``clients.training.local_update`` gives
it with the same generator: the same batch order (one ``torch.randperm(n_k, generator=gen)`` per
epoch, batches ``order[start:start + bs]``), plain SGD, loss = mean cross-entropy of the batch,
train_loss = mean loss over the examples seen. The parameters of the K_c clients are stacked
along a leading dimension, ``torch.func.vmap`` runs ``functional_call(model, ...)`` over them
(convolutions become grouped convolutions, linear layers batched matmuls), and one autograd
backward of Σ_k loss_k gives every client its own gradient (client k's loss depends on its own
parameters only). On a CPU with vmap(grad(...)) instead, the backward was slower (functorch's
convolution-backward batching rule).

Unequal shards: at step t only the clients with t < T_k take part (their parameters are
gathered, updated and scattered back); the others keep theirs unchanged. A step's batches are
padded to the longest batch among the clients taking part; padded samples get weight 0 and each
client's loss is divided by its own real batch size. Padding is exact only for models whose
samples do not interact in a forward pass (GroupNorm, LayerNorm; not BatchNorm), so models with
buffers (running statistics) are refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, vmap

from clients.training import LocalResult, LocalTraining, as_tensor, epoch_orders

Params = dict[str, torch.Tensor]


@dataclass(frozen=True)
class _Step:
    """One synchronous step: which clients take part and what each one's batch is."""

    clients: torch.Tensor  # (A,) client indices taking part
    indices: torch.Tensor  # (A, B) rows of the pooled images, padded
    weights: torch.Tensor  # (A, B) 1 for a real sample, 0 for padding
    counts: torch.Tensor  # (A,) real batch size of each client


def batch_orders(num_examples: int, training: LocalTraining, generator: torch.Generator) -> list[torch.Tensor]:
    """A client's minibatches (indices into its shard), in the order ``local_update`` visits them."""
    batch = num_examples if training.batch_size is None else training.batch_size
    return [order[start : start + batch] for order in epoch_orders(num_examples, training.epochs, generator)
            for start in range(0, num_examples, batch)]


def cohort_schedule(schedules: list[list[torch.Tensor]], offsets: list[int], device: torch.device) -> list[_Step]:
    """The synchronous steps of a cohort: step t holds batch t of every client with T_k > t."""
    steps = []
    for t in range(max(len(s) for s in schedules)):
        active = [k for k, s in enumerate(schedules) if t < len(s)]
        batches = [schedules[k][t] + offsets[k] for k in active]
        width = max(len(b) for b in batches)
        indices = torch.zeros(len(active), width, dtype=torch.long)
        weights = torch.zeros(len(active), width)
        for row, b in enumerate(batches):
            indices[row, : len(b)] = b
            indices[row, len(b) :] = offsets[active[row]]  # any real sample of the client; weight 0
            weights[row, : len(b)] = 1.0
        counts = torch.tensor([len(b) for b in batches])
        steps.append(_Step(*(x.to(device) for x in (torch.tensor(active), indices, weights, counts))))
    return steps


def _client_step_loss(
    model: nn.Module, params: Params, images: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
    count: torch.Tensor,
) -> torch.Tensor:
    """Mean cross-entropy over one client's real samples (padding has weight 0)."""
    logits = functional_call(model, params, (images,))
    per_sample = nn.functional.cross_entropy(logits, labels, reduction="none")
    return (per_sample * weights.to(per_sample.dtype)).sum() / count


def _check_model(model: nn.Module) -> None:
    if any(True for _ in model.buffers()):
        raise ValueError(
            "vectorized_local_updates needs a model without buffers (no BatchNorm running statistics): "
            "padding and batched steps are exact only when samples do not interact"
        )


def model_theta(model: nn.Module, global_params: Sequence) -> list[torch.Tensor]:
    """θ cast to the model's parameter dtypes and device, checked against its shapes."""
    theta = []
    for (name, p), value in zip(model.named_parameters(), global_params, strict=True):
        t = as_tensor(value).to(device=p.device, dtype=p.dtype)
        if t.shape != p.shape:
            raise ValueError(f"parameter {name}: got shape {tuple(t.shape)}, the model has {tuple(p.shape)}")
        theta.append(t)
    return theta


def stack_copies(model: nn.Module, theta: list[torch.Tensor], num_clients: int) -> Params:
    """A copy of θ per client, stacked along a leading dimension, by parameter name."""
    return {name: t.unsqueeze(0).repeat(num_clients, *([1] * t.dim())).contiguous()
            for (name, _), t in zip(model.named_parameters(), theta, strict=True)}


class CohortStep:
    """One synchronous SGD step of the clients taking part, on their stacked parameters in place.

    ``clients.cuda_graphs.CudaGraphCohortStep`` replays the same step from a CUDA graph; it keeps
    the stacked parameters in buffers of its own (``stacked_params``) for the graph to update.
    """

    def __init__(self, model: nn.Module, training: LocalTraining, chunk_size: int | None = None,
                 autocast_cache: bool = True):
        self.model = model
        self.training = training
        self.losses = vmap(lambda *a: _client_step_loss(model, *a), chunk_size=chunk_size)
        self.autocast_cache = autocast_cache

    def stacked_params(self, theta: list[torch.Tensor], num_clients: int) -> Params:
        return stack_copies(self.model, theta, num_clients)

    def __call__(self, stacked: Params, clients: torch.Tensor | None, images: torch.Tensor, labels: torch.Tensor,
                 weights: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The step of ``clients`` (None: every client) on their padded batches; their losses, detached."""
        params = {n: (p if clients is None else p.index_select(0, clients)).detach().requires_grad_()
                  for n, p in stacked.items()}
        autocast = (
            torch.autocast(device_type=images.device.type, dtype=torch.bfloat16, cache_enabled=self.autocast_cache)
            if self.training.bf16
            else contextlib.nullcontext()
        )
        with autocast:
            losses = self.losses(params, images, labels, weights, counts)
        # Σ_k loss_k: client k's loss depends on its own parameters only, so this is every
        # client's own gradient (the backward of the batched forward: grouped convolutions).
        grads = dict(zip(params, torch.autograd.grad(losses.sum(), list(params.values())), strict=True))
        _sgd(stacked, grads, clients, self.training.lr)
        return losses.detach()


def vectorized_local_updates(
    model: nn.Module,
    global_params: Sequence,
    shards: list[tuple[torch.Tensor, torch.Tensor]],
    training: LocalTraining,
    generators: list[torch.Generator],
    chunk_size: int | None = None,
    step: CohortStep | None = None,
) -> list[LocalResult]:
    """Train every client of a cohort from θ = ``global_params`` at once; one ``LocalResult`` per shard.

    ``model`` supplies the architecture (its parameters are not changed); ``shards`` are
    (images, labels) on the model's device; ``generators[k]`` orders client k's batches exactly as
    in ``local_update``. ``chunk_size`` bounds how many clients one vmapped call processes;
    ``step`` takes each synchronous step (default: an eager ``CohortStep``).
    """
    if not shards or len(shards) != len(generators):
        raise ValueError(f"need one generator per shard, got {len(shards)} shards and {len(generators)} generators")
    if any(len(labels) == 0 for _, labels in shards):
        raise ValueError("every shard needs at least one example")
    _check_model(model)
    step = step or CohortStep(model, training, chunk_size)
    theta = model_theta(model, global_params)
    stacked = step.stacked_params(theta, len(shards))
    device = theta[0].device
    sizes = [len(labels) for _, labels in shards]
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
    images = torch.cat([x for x, _ in shards]).to(device)
    labels = torch.cat([y for _, y in shards]).to(device)
    schedules = [batch_orders(n, training, g) for n, g in zip(sizes, generators, strict=True)]
    loss_sums = _train(model, step, stacked, images, labels, cohort_schedule(schedules, offsets, device))
    return _results(theta, stacked, sizes, schedules, loss_sums)


def _train(model: nn.Module, step: CohortStep, stacked: Params, images: torch.Tensor, labels: torch.Tensor,
           steps: list[_Step]) -> torch.Tensor:
    """Run the steps in place on ``stacked``; returns each client's float32 sum of loss × batch size."""
    num_clients = next(iter(stacked.values())).shape[0]
    loss_sums = torch.zeros(num_clients, device=images.device)
    was_training = model.training
    model.train()
    try:
        for s in steps:
            clients = None if len(s.clients) == num_clients else s.clients
            losses = step(stacked, clients, images[s.indices], labels[s.indices], s.weights, s.counts)
            loss_sums.index_add_(0, s.clients, losses.float() * s.counts)
    finally:
        model.train(was_training)
    return loss_sums


@torch.no_grad()
def _sgd(stacked: Params, grads: Params, clients: torch.Tensor | None, lr: float) -> None:
    """p ← p − lr · g for the clients taking part (None: all of them, in place, one foreach call)."""
    if clients is None:
        torch._foreach_add_(list(stacked.values()), [grads[n] for n in stacked], alpha=-lr)
        return
    for name, p in stacked.items():
        p.index_add_(0, clients, grads[name], alpha=-lr)


@torch.no_grad()
def _results(
    theta: list[torch.Tensor], stacked: Params, sizes: list[int], schedules: list[list[torch.Tensor]],
    loss_sums: torch.Tensor,
) -> list[LocalResult]:
    """Δ_k = θ − θ_k per client (views into one stacked tensor per parameter) and its train loss."""
    deltas = [(t0.unsqueeze(0) - p).unbind(0) for t0, p in zip(theta, stacked.values(), strict=True)]
    results = []
    for k, (n, loss_sum) in enumerate(zip(sizes, loss_sums.tolist(), strict=True)):
        seen = sum(len(b) for b in schedules[k])
        results.append(LocalResult(update=[d[k] for d in deltas], num_examples=n, train_loss=loss_sum / seen))
    return results
