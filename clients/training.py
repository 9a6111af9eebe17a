"""Local training of one client: τ epochs of SGD (plain by default), then Δ_k = θ − θ_k."""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True)
class LocalTraining:
    """How a client trains: τ epochs, batch size (None = full shard), learning rate, and
    ``torch.optim.SGD``'s heavy-ball momentum and weight decay (0: plain SGD). Momentum buffers
    start at zero for every client in every round: nothing of a client's optimizer crosses rounds."""

    epochs: int
    batch_size: int | None
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    bf16: bool = False

    def num_steps(self, num_examples: int) -> int:
        """T = τ for full-batch training, τ · ceil(n_k / bs) otherwise."""
        if self.batch_size is None:
            return self.epochs
        return self.epochs * math.ceil(num_examples / self.batch_size)


@dataclass
class LocalResult:
    update: list[torch.Tensor]  # Δ_k = θ − θ_k, one tensor per parameter, on the model's device
    num_examples: int
    train_loss: float  # mean loss over the examples seen during local training


def as_tensor(value) -> torch.Tensor:
    """A tensor as it is, or an array as a tensor sharing its memory. Read-only arrays (views over
    a message's bytes, a checkpoint's) are accepted without torch's warning: callers only read them."""
    if isinstance(value, torch.Tensor):
        return value
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.as_tensor(np.asarray(value))


def as_array(value) -> np.ndarray:
    """An array as it is, or a tensor (on any device) copied to the host as a numpy array."""
    return value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value


def load_parameters(model: nn.Module, params: Sequence) -> None:
    """Copy ``params`` (numpy arrays or tensors, in ``model.parameters()`` order) into the model in place."""
    model_params = list(model.parameters())
    if len(params) != len(model_params):
        raise ValueError(f"got {len(params)} parameter tensors, the model has {len(model_params)}")
    with torch.no_grad():
        for p, value in zip(model_params, params, strict=True):
            p.copy_(as_tensor(value), non_blocking=True)


class SGDStep:
    """One SGD step of ``model`` on a batch: mean cross-entropy, backward, ``torch.optim.SGD``'s
    update (plain: p ← p − lr · g; bf16: the forward under bfloat16 autocast). One ``SGDStep`` per
    client: its optimizer holds that client's momentum. ``autocast_cache=False`` for CUDA-graph capture."""

    def __init__(self, model: nn.Module, training: LocalTraining, autocast_cache: bool = True):
        self.model = model
        self.bf16 = training.bf16
        self.autocast_cache = autocast_cache
        self.optimizer = torch.optim.SGD(model.parameters(), lr=training.lr, momentum=training.momentum,
                                         weight_decay=training.weight_decay)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Take the step; returns the batch's mean loss (detached)."""
        autocast = (
            torch.autocast(device_type=images.device.type, dtype=torch.bfloat16, cache_enabled=self.autocast_cache)
            if self.bf16
            else contextlib.nullcontext()
        )
        self.optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = nn.functional.cross_entropy(self.model(images), labels)
        loss.backward()
        self.optimizer.step()
        return loss.detach()


def epoch_orders(num_examples: int, epochs: int, generator: torch.Generator) -> torch.Tensor:
    """The shard's visiting order, one ``torch.randperm(n_k, generator=generator)`` per epoch: (τ, n_k)."""
    return torch.stack([torch.randperm(num_examples, generator=generator) for _ in range(epochs)])


def train_steps(
    images: torch.Tensor, labels: torch.Tensor, orders: torch.Tensor, batch_size: int | None,
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    augment: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Every SGD step of local training: per epoch (a row of ``orders``), batches
    ``order[start:start + bs]`` of the shard, or of ``augment(shard)``, drawn anew each epoch.
    Returns Σ loss × batch size over the steps, a tensor on the device: nothing here waits for the GPU."""
    n = len(labels)
    batch = n if batch_size is None else batch_size
    loss_sum = torch.zeros((), device=images.device)
    for order in orders:
        epoch_images = images if augment is None else augment(images)
        for start in range(0, n, batch):
            idx = order[start : start + batch]
            loss = step(epoch_images[idx], labels[idx])
            loss_sum += loss.float() * len(idx)
    return loss_sum


def local_update(
    model: nn.Module,
    global_params: Sequence,
    images: torch.Tensor,
    labels: torch.Tensor,
    training: LocalTraining,
    generator: torch.Generator,
    out: Sequence[np.ndarray] | None = None,
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    augment: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> LocalResult:
    """Train ``model`` from θ = ``global_params`` on the shard (``images``, ``labels``) and return Δ_k.

    The minibatch order comes from ``generator`` alone (a CPU generator), so a client's result
    depends only on θ, its shard and the seed it was given. With ``out`` (CPU arrays shaped like
    the parameters), Δ_k is written into them and the returned tensors share their memory.
    ``step`` takes one SGD step of ``model`` on a batch and returns its loss: by default an
    ``SGDStep``; ``clients.cuda_graphs.CudaGraphStep`` replays the same step from a CUDA graph.
    ``augment`` maps the shard's images to augmented ones (``clients.augment``), once an epoch.
    """
    load_parameters(model, global_params)
    theta = [p.detach().clone() for p in model.parameters()]
    n = len(labels)
    orders = epoch_orders(n, training.epochs, generator).to(images.device)
    model.train()
    loss_sum = train_steps(images, labels, orders, training.batch_size, step or SGDStep(model, training), augment)
    with torch.no_grad():
        if out is None:
            update = [t0 - p for t0, p in zip(theta, model.parameters(), strict=True)]
        else:
            update = [torch.from_numpy(o) for o in out]
            for target, t0, p in zip(update, theta, model.parameters(), strict=True):
                if p.device.type == "cpu":
                    torch.sub(t0, p, out=target)
                else:
                    target.copy_(t0 - p)
    return LocalResult(update=update, num_examples=n, train_loss=float(loss_sum) / (training.epochs * n))
