"""The server's test-set evaluation: loss and accuracy as their definitions give them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from fedmask_app.run.config import run_config_from_values
from fedmask_app.run.evaluation import Evaluator
from fedmask_app.run.model import initial_parameters

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def test_loss_and_accuracy_are_the_per_image_means_in_batches_of_any_size(one_thread):
    """Mean cross-entropy and accuracy over the first 250 test images, for θ_0 and a scaled θ_0:
    the evaluator's batched float64 sums equal a per-batch Python sum to rounding, and the batch
    size (250 does not divide by 64) does not matter beyond it."""
    results = {}
    for batch in (64, 250):
        cfg = run_config_from_values({"model": "linear-softmax", "test-subset": 250, "eval-batch-size": batch,
                                      "data-dir": str(SHARED_DATA), "threads": 1})
        evaluator = Evaluator(cfg)
        for scale in (1.0, 40.0):
            params = [scale * p.numpy() for p in initial_parameters(cfg.model, cfg.seed)]
            results[batch, scale] = evaluator(params)
            with torch.no_grad():  # the definition, image by image
                logits = evaluator.model(evaluator.images)
                per_image = nn.functional.cross_entropy(logits, evaluator.labels, reduction="none").double()
                accuracy = (logits.argmax(1) == evaluator.labels).double().mean().item()
            loss, acc = results[batch, scale]
            np.testing.assert_allclose(loss, per_image.mean().item(), rtol=1e-6)
            assert acc == accuracy
    for scale in (1.0, 40.0):
        np.testing.assert_allclose(results[64, scale], results[250, scale], rtol=1e-6)
    assert results[64, 1.0][0] != results[64, 40.0][0]  # the parameters reached the model
