"""A cohort's clients trained side by side on CUDA streams (``client-streams = N``): the
sequential path's computation, client for client, issued so that the GPU runs N clients at once.

At batch size 32 one client's ResNet-18 step leaves most of an H200 idle: its kernels are small
(docs/gpu: 6.4 ms a step even replayed from a CUDA graph), and runs in separate processes take
turns on the GPU rather than share it (four CUDA-graph runs at once: 1.19× one run's images/s).
Streams of one process do share it. Each of N model replicas trains the clients at cohort
positions k ≡ j (mod N) on a stream of its own, with the step ``local_update`` takes (an
``SGDStep``, or one ``CudaGraphStep`` per replica with ``cuda-graphs = true``), and nothing waits
for the GPU until every client's work is queued. A client's kernels are the ones the sequential
path runs for it (same θ, batches, step and algorithms), so its Δ_k and loss are the sequential
path's; on a GPU that is unmeasured, and tests/test_cuda.py compares the two bit for bit.

Without CUDA the replicas train one after another: the CPU test of everything but the streams.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn

from clients.training import LocalResult, LocalTraining, SGDStep, epoch_orders, load_parameters, train_steps
from clients.vectorized import model_theta

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class StreamedClients:
    """``num_streams`` replicas of ``model`` (the first is ``model`` itself), a step and, on CUDA,
    a stream each. ``make_step(replica)`` builds a replica's step (default: ``SGDStep``)."""

    def __init__(self, model: nn.Module, training: LocalTraining, num_streams: int,
                 make_step: Callable[[nn.Module], Step] | None = None):
        if num_streams < 1:
            raise ValueError(f"num_streams must be >= 1, got {num_streams}")
        self.training = training
        self.device = next(model.parameters()).device
        self.replicas = [model, *(copy.deepcopy(model) for _ in range(num_streams - 1))]
        self.steps = [(make_step or (lambda m: SGDStep(m, training)))(m) for m in self.replicas]
        cuda = self.device.type == "cuda"
        self.streams = [torch.cuda.Stream(self.device) for _ in self.replicas] if cuda else None

    def local_updates(self, global_params: Sequence, shards: list[tuple[torch.Tensor, torch.Tensor]],
                      generators: list[torch.Generator]) -> list[LocalResult]:
        """Each shard's ``local_update`` from θ = ``global_params``, ``generators[k]`` ordering
        shard k's batches; the updates are tensors on the device."""
        if len(shards) != len(generators):
            raise ValueError(f"need one generator per shard, got {len(shards)} shards and {len(generators)} generators")
        theta = model_theta(self.replicas[0], global_params)
        orders = [epoch_orders(len(labels), self.training.epochs, g).to(self.device)
                  for (_, labels), g in zip(shards, generators, strict=True)]
        main = torch.cuda.current_stream(self.device) if self.streams else None
        for stream in self.streams or ():
            stream.wait_stream(main)  # θ, the shards and the orders are ready
        queued = []
        for k, ((images, labels), order) in enumerate(zip(shards, orders, strict=True)):
            j = k % len(self.replicas)
            with torch.cuda.stream(self.streams[j]) if self.streams else contextlib.nullcontext():
                queued.append(self._train(j, theta, images, labels, order))
        for stream in self.streams or ():
            main.wait_stream(stream)
        losses = torch.stack([loss_sum for _, loss_sum in queued]).tolist()  # the one wait for the GPU
        results = []
        for (update, _), loss_sum, (_, labels) in zip(queued, losses, shards, strict=True):
            for block in update if self.streams else ():
                block.record_stream(main)  # made on a replica's stream, used and freed on the caller's
            results.append(LocalResult(update=update, num_examples=len(labels),
                                       train_loss=loss_sum / (self.training.epochs * len(labels))))
        return results

    def _train(self, j: int, theta: list[torch.Tensor], images: torch.Tensor, labels: torch.Tensor,
               orders: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Replica j's local training of one shard, queued on the current stream: (Δ_k, Σ loss × batch)."""
        model = self.replicas[j]
        load_parameters(model, theta)
        model.train()
        loss_sum = train_steps(images, labels, orders, self.training.batch_size, self.steps[j])
        with torch.no_grad():
            update = [t0 - p for t0, p in zip(theta, model.parameters(), strict=True)]
        return update, loss_sum
