"""clients.training.local_update: Δ_k = θ − θ_k, the same whether or not it is written into
caller-supplied arrays, and whichever object takes its steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call

from clients.cuda_graphs import CudaGraphStep
from clients.training import LocalTraining, SGDStep, local_update


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))
    theta = [p.detach().numpy().copy() for p in model.parameters()]
    images = torch.randn(12, 5)
    labels = torch.randint(0, 3, (12,))
    return model, theta, images, labels


def test_update_written_into_out_equals_the_returned_one():
    model, theta, images, labels = _setup()
    training = LocalTraining(epochs=2, batch_size=4, lr=0.1)
    plain = local_update(model, theta, images, labels, training, torch.Generator().manual_seed(3))
    out = [np.full_like(t, np.nan) for t in theta]
    written = local_update(model, theta, images, labels, training, torch.Generator().manual_seed(3), out)
    for a, b, o in zip(plain.update, written.update, out, strict=True):
        np.testing.assert_array_equal(a.numpy(), o)  # bit for bit
        assert np.shares_memory(b.numpy(), o)
    assert plain.train_loss == written.train_loss and plain.num_examples == written.num_examples == 12
    assert not np.allclose(out[0], 0.0)  # training moved the weights


def test_every_batch_goes_through_the_given_step_in_order():
    """A step object (CudaGraphStep on a GPU) sees each minibatch once, the last partial one too,
    and gives the default step's Δ_k when it takes the same steps."""
    model, theta, images, labels = _setup()
    training = LocalTraining(epochs=2, batch_size=5, lr=0.1)
    sizes = []
    plain_step = SGDStep(model, training)

    def counting(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        sizes.append(len(y))
        return plain_step(x, y)

    plain = local_update(model, theta, images, labels, training, torch.Generator().manual_seed(3))
    stepped = local_update(model, theta, images, labels, training, torch.Generator().manual_seed(3), step=counting)
    assert sizes == [5, 5, 2] * 2
    for a, b in zip(plain.update, stepped.update, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert plain.train_loss == stepped.train_loss


def test_cuda_graph_step_refuses_a_model_off_the_gpu():
    model, _, _, _ = _setup()
    with pytest.raises(ValueError, match="cuda-graphs = true needs the model on a CUDA device"):
        CudaGraphStep(model, LocalTraining(epochs=1, batch_size=4, lr=0.1))


def _heavy_ball(model, theta, images, labels, training: LocalTraining, generator) -> list[torch.Tensor]:
    """Δ_k by the equations, in float64: g ← ∇L(p) + wd · p; b ← m · b + g (b = 0 at the start);
    p ← p − lr · b, over the batches in local_update's order."""
    names = [name for name, _ in model.named_parameters()]
    params = [torch.tensor(t, dtype=torch.float64, requires_grad=True) for t in theta]
    buffers = [torch.zeros_like(p) for p in params]
    n = len(labels)
    for _ in range(training.epochs):
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, training.batch_size):
            idx = order[start : start + training.batch_size]
            logits = functional_call(model, dict(zip(names, params, strict=True)), (images[idx],))
            grads = torch.autograd.grad(nn.functional.cross_entropy(logits, labels[idx]), params)
            with torch.no_grad():
                for p, b, g in zip(params, buffers, grads, strict=True):
                    b.mul_(training.momentum).add_(g + training.weight_decay * p)
                    p.sub_(training.lr * b)
    return [torch.tensor(t, dtype=torch.float64) - p.detach() for t, p in zip(theta, params, strict=True)]


@pytest.mark.parametrize(("momentum", "weight_decay"), [(0.9, 0.0), (0.0, 0.01), (0.5, 0.05)])
def test_momentum_and_weight_decay_follow_the_equations(momentum, weight_decay):
    """local_update with momentum / weight decay equals the heavy-ball recursion written out, and a
    second client (or round) starts from a zero buffer: the same call twice gives the same Δ_k."""
    model, theta, images, labels = _setup()
    model = model.double()
    theta = [t.astype(np.float64) for t in theta]
    images = images.double()
    training = LocalTraining(epochs=2, batch_size=5, lr=0.1, momentum=momentum, weight_decay=weight_decay)
    first = local_update(model, theta, images, labels, training, torch.Generator().manual_seed(3))
    again = local_update(model, theta, images, labels, training, torch.Generator().manual_seed(3))
    expected = _heavy_ball(model, theta, images, labels, training, torch.Generator().manual_seed(3))
    for a, b, e in zip(first.update, again.update, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-14)
        assert torch.equal(a, b)
    plain = local_update(model, theta, images, labels, LocalTraining(epochs=2, batch_size=5, lr=0.1),
                         torch.Generator().manual_seed(3))
    assert not torch.allclose(first.update[0], plain.update[0])  # the optimizer changed the update
