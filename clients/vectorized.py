"""A cohort's local training in one batched computation: every client's SGD step at once.

``vectorized_local_updates`` gives each client the result ``clients.training.local_update`` gives
it with the same generator: the same batch order (one ``torch.randperm(n_k, generator=gen)`` per
epoch, batches ``order[start:start + bs]``), ``torch.optim.SGD``'s update (plain, or with weight
decay and momentum buffers that start at zero for every client), loss = mean cross-entropy of the
batch, train_loss = mean loss over the examples seen. The parameters of the K_c clients are stacked
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


def stack_copies(model: nn.Module, thetas: Sequence[list[torch.Tensor]], counts: Sequence[int]) -> Params:
    """``counts[g]`` copies of ``thetas[g]`` for every group g of clients (one group: a cohort from
    one θ; several: the cohorts of runs trained together), stacked along a leading dimension, by
    parameter name."""
    return {name: torch.cat([t[i].unsqueeze(0).expand(c, *t[i].shape) for t, c in zip(thetas, counts, strict=True)])
            for i, (name, _) in enumerate(model.named_parameters())}


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
        self.momentum_buffers: Params | None = None  # one per stacked parameter, with momentum > 0

    def stacked_params(self, thetas: Sequence[list[torch.Tensor]], counts: Sequence[int]) -> Params:
        """``counts[g]`` copies of ``thetas[g]`` per group g, stacked (``stack_copies``); the
        momentum buffers start again at zero."""
        stacked = stack_copies(self.model, thetas, counts)
        self.reset_momentum(stacked)
        return stacked

    @torch.no_grad()
    def reset_momentum(self, stacked: Params) -> None:
        """Momentum buffers shaped like ``stacked``, all zero (in place where the shapes allow, so that
        a captured graph keeps its tensors). A zero buffer makes the first step's buffer the
        gradient, as ``torch.optim.SGD`` starts it."""
        if self.training.momentum == 0:
            return
        buffers = self.momentum_buffers
        if buffers is None or any(buffers[n].shape != p.shape for n, p in stacked.items()):
            self.momentum_buffers = {n: torch.zeros_like(p) for n, p in stacked.items()}
            return
        for b in buffers.values():
            b.zero_()

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
        _sgd(stacked, grads, clients, self.training, self.momentum_buffers)
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
    return grouped_local_updates(model, [global_params], [shards], training, [generators], chunk_size, step)[0]


def grouped_local_updates(
    model: nn.Module,
    starts: Sequence[Sequence],
    shards: Sequence[list[tuple[torch.Tensor, torch.Tensor]]],
    training: LocalTraining,
    generators: Sequence[list[torch.Generator]],
    chunk_size: int | None = None,
    step: CohortStep | None = None,
) -> list[list[LocalResult]]:
    """Several cohorts, each from a θ of its own (``starts[g]``: the runs of a sweep trained
    together), as one batched computation: group g's clients train on ``shards[g]`` with
    ``generators[g]`` from ``starts[g]``, each exactly as ``vectorized_local_updates`` would train
    that cohort alone (clients never interact). One list of ``LocalResult`` per group."""
    if not shards or len(starts) != len(shards) or len(generators) != len(shards):
        raise ValueError(f"need one θ and one list of generators per group of shards, got {len(starts)} θ, "
                         f"{len(shards)} groups of shards and {len(generators)} of generators")
    for group_shards, group_generators in zip(shards, generators, strict=True):
        if not group_shards or len(group_shards) != len(group_generators):
            raise ValueError(f"need one generator per shard, got {len(group_shards)} shards and "
                             f"{len(group_generators)} generators")
    flat = [shard for group in shards for shard in group]
    if any(len(labels) == 0 for _, labels in flat):
        raise ValueError("every shard needs at least one example")
    _check_model(model)
    step = step or CohortStep(model, training, chunk_size)
    thetas = [model_theta(model, start) for start in starts]
    counts = [len(group) for group in shards]
    stacked = step.stacked_params(thetas, counts)
    device = thetas[0][0].device
    sizes = [len(labels) for _, labels in flat]
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
    images = torch.cat([x for x, _ in flat]).to(device)
    labels = torch.cat([y for _, y in flat]).to(device)
    schedules = [batch_orders(n, training, g)
                 for n, g in zip(sizes, [g for group in generators for g in group], strict=True)]
    loss_sums = _train(model, step, stacked, images, labels, cohort_schedule(schedules, offsets, device))
    results = _results(thetas, counts, stacked, sizes, schedules, loss_sums)
    ends = np.cumsum(counts).tolist()
    return [results[end - count : end] for count, end in zip(counts, ends, strict=True)]


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
def _sgd(stacked: Params, grads: Params, clients: torch.Tensor | None, training: LocalTraining,
         momentum_buffers: Params | None) -> None:
    """``torch.optim.SGD``'s step for the clients taking part (None: all of them), in place:
    g ← g + wd · p; b ← m · b + g; p ← p − lr · b (plain SGD: p ← p − lr · g, one foreach call)."""
    lr, momentum, weight_decay = training.lr, training.momentum, training.weight_decay
    if momentum == 0 and weight_decay == 0 and clients is None:
        torch._foreach_add_(list(stacked.values()), [grads[n] for n in stacked], alpha=-lr)
        return
    for name, p in stacked.items():
        g = grads[name]
        if weight_decay:
            g = g.add(p if clients is None else p.index_select(0, clients), alpha=weight_decay)
        if momentum:
            buffer = momentum_buffers[name]
            if clients is None:
                g = buffer.mul_(momentum).add_(g)
            else:
                g = buffer.index_select(0, clients).mul_(momentum).add_(g)
                buffer.index_copy_(0, clients, g)
        if clients is None:
            p.add_(g, alpha=-lr)
        else:
            p.index_add_(0, clients, g, alpha=-lr)


@torch.no_grad()
def _results(
    thetas: list[list[torch.Tensor]], counts: list[int], stacked: Params, sizes: list[int],
    schedules: list[list[torch.Tensor]], loss_sums: torch.Tensor,
) -> list[LocalResult]:
    """Δ_k = θ − θ_k per client, θ its group's start (views into one tensor per parameter and
    group), and its train loss."""
    deltas = [[d for slice_, theta in zip(p.split(counts), thetas, strict=True)
               for d in (theta[i].unsqueeze(0) - slice_).unbind(0)]
              for i, p in enumerate(stacked.values())]
    results = []
    for k, (n, loss_sum) in enumerate(zip(sizes, loss_sums.tolist(), strict=True)):
        seen = sum(len(b) for b in schedules[k])
        results.append(LocalResult(update=[d[k] for d in deltas], num_examples=n, train_loss=loss_sum / seen))
    return results
