"""SGD steps replayed from a captured CUDA graph (``cuda-graphs = true``): one client's step
(``CudaGraphStep``) or, with ``vectorize = true``, the whole cohort's (``CudaGraphCohortStep``).

At batch size 32 a ResNet-18 step on an H200 is bound by the CPU launching a few hundred small
kernels as much as by the GPU running them (docs/gpu: 11–12 ms a step eagerly, 6.4 ms replayed,
float32). A CUDA graph records the whole step once (forward, loss, backward, SGD update) and
replays it with one launch. The replay runs the kernels the eager step runs, on the same
parameter tensors (θ is copied into them in place), so a client's Δ_k is the eager path's: bit
for bit on an H200 in float32 and bf16 (tests/test_cuda.py::test_cuda_graphs_replay_the_eager_step).

Only full minibatches of ``batch_size`` images replay the graph; a shard's last partial batch and
full-batch training (one step of n_k images, a size per client) run eagerly through an
``SGDStep``. Capturing follows PyTorch's whole-network recipe: a few eager warm-up steps on a side
stream (their parameter changes are undone), then the capture, with ``.grad`` unset so that the
backward pass allocates the gradients inside the graph's private memory pool (an eager step in
between allocates its own).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from clients.training import LocalTraining, SGDStep
from clients.vectorized import CohortStep, Params, stack_copies

WARMUP_STEPS = 3  # PyTorch's recipe: let lazy initialisation (cuDNN, autograd) happen before capture


class CudaGraphStep:
    """``SGDStep`` with full minibatches replayed from one captured CUDA graph."""

    def __init__(self, model: nn.Module, training: LocalTraining):
        device = next(model.parameters()).device
        if device.type != "cuda":
            raise ValueError(f"cuda-graphs = true needs the model on a CUDA device; it is on {device}")
        self.model = model
        self.training = training
        self.eager = SGDStep(model, training)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._images: torch.Tensor | None = None
        self._labels: torch.Tensor | None = None
        self._loss: torch.Tensor | None = None

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One step on (``images``, ``labels``); returns the batch's mean loss (detached)."""
        if self.training.batch_size is None or len(labels) != self.training.batch_size:
            return self.eager(images, labels)
        if self._graph is None:
            self._capture(images, labels)
        self._images.copy_(images)
        self._labels.copy_(labels)
        self._graph.replay()
        return self._loss.clone()

    def _capture(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        params = list(self.model.parameters())
        saved = [p.detach().clone() for p in params]
        self._images, self._labels = images.clone(), labels.clone()
        # The graph gets an SGDStep of its own: autocast's weight cache must be off under capture.
        step = SGDStep(self.model, self.training, autocast_cache=False)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                step(self._images, self._labels)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._loss = step(self._images, self._labels)
        with torch.no_grad():  # undo the warm-up steps: the caller's θ is in place again
            for p, value in zip(params, saved, strict=True):
                p.copy_(value)
        self._graph = graph


class CudaGraphCohortStep(CohortStep):
    """The vectorised cohort step (``clients.vectorized.CohortStep``) with each full step — every
    client taking part, full minibatches of ``batch_size`` — replayed from one captured CUDA graph.

    The graph updates the stacked parameters in buffers of its own (``stacked_params`` copies θ
    into them each round) from static input buffers; steps of other shapes (a shard's partial last
    batch, clients that have run out of batches, full-batch training) run eagerly on the same
    buffers. ``capture = False`` runs the full steps on the static buffers without a graph: the
    same bookkeeping, testable on a CPU.
    """

    def __init__(self, model: nn.Module, training: LocalTraining, capture: bool = True, chunk_size: int | None = None):
        device = next(model.parameters()).device
        if capture and device.type != "cuda":
            raise ValueError(f"cuda-graphs = true needs the model on a CUDA device; it is on {device}")
        # autocast's cache must be off under capture; chunk_size: vmap's chunks, all captured in the one graph
        super().__init__(model, training, chunk_size, autocast_cache=not capture)
        self.capture = capture
        self._stacked: Params | None = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._inputs: tuple[torch.Tensor, ...] | None = None  # images, labels, weights, counts
        self._losses: torch.Tensor | None = None

    def stacked_params(self, thetas: Sequence[list[torch.Tensor]], counts: Sequence[int]) -> Params:
        """``counts[g]`` copies of ``thetas[g]`` per group g copied into the persistent buffers (new
        buffers, and a new capture, when the number of clients changes)."""
        num_clients = sum(counts)
        if self._stacked is None or next(iter(self._stacked.values())).shape[0] != num_clients:
            self._stacked, self._graph, self._inputs = stack_copies(self.model, thetas, counts), None, None
        else:
            with torch.no_grad():  # each group's θ into its clients' slices, in place
                for i, p in enumerate(self._stacked.values()):
                    for slice_, theta in zip(p.split(list(counts)), thetas, strict=True):
                        slice_.copy_(theta[i].unsqueeze(0).expand_as(slice_))
        self.reset_momentum(self._stacked)
        return self._stacked

    def __call__(self, stacked: Params, clients: torch.Tensor | None, images: torch.Tensor, labels: torch.Tensor,
                 weights: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        full = clients is None and self.training.batch_size is not None and labels.shape[1] == self.training.batch_size
        if not full or stacked is not self._stacked:
            return super().__call__(stacked, clients, images, labels, weights, counts)
        if self._inputs is None:
            self._inputs = tuple(x.clone() for x in (images, labels, weights, counts))
            if self.capture:
                self._capture()
        for static, value in zip(self._inputs, (images, labels, weights, counts), strict=True):
            static.copy_(value)
        if self._graph is None:
            return super().__call__(self._stacked, None, *self._inputs)
        self._graph.replay()
        return self._losses.clone()

    def _capture(self) -> None:
        state = list(self._stacked.values()) + list((self.momentum_buffers or {}).values())
        saved = [t.clone() for t in state]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                super().__call__(self._stacked, None, *self._inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._losses = super().__call__(self._stacked, None, *self._inputs)
        with torch.no_grad():  # undo the warm-up steps: the parameters and momentum are this step's again
            for t, value in zip(state, saved, strict=True):
                t.copy_(value)
        self._graph = graph
