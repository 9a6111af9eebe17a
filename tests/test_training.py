"""clients.training.local_update: Δ_k = θ − θ_k, the same whether or not it is written into
caller-supplied arrays, and whichever object takes its steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

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
