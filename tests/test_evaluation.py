"""The server's test-set evaluation: loss and accuracy as their definitions give them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from fedmask_app.engines.local import run_local
from fedmask_app.run.config import ConfigError, run_config_from_values
from fedmask_app.run.evaluation import Evaluator, evaluation_due
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


def test_evaluation_due_every_nth_round_from_the_first_and_the_last():
    def due(num_rounds: int, every: int, first: int) -> list[int]:
        return [r for r in range(1, num_rounds + 1) if evaluation_due(r, num_rounds, every, first)]

    assert due(5, 1, 1) == [1, 2, 3, 4, 5]
    assert due(7, 3, 1) == [3, 6, 7]  # and the last round
    assert due(7, 0, 1) == [] and due(7, 0, 5) == []  # eval-every = 0: never
    assert due(200, 1, 151) == list(range(151, 201))  # the paper's window, rounds 151-200
    assert due(10, 3, 5) == [6, 9, 10]
    assert due(4, 1, 10) == [4]  # from past the end: the last round still evaluates


def test_a_run_with_eval_from_evaluates_only_from_that_round(tmp_path, one_thread):
    """Rounds 3 and 4 of 4 evaluated, and every value the same as in the run evaluated every round."""
    rows = {}
    for first in (1, 3):
        cfg = run_config_from_values({
            "model": "linear-softmax", "num-clients": 4, "clients-per-round": 2, "max-shard-size": 16,
            "num-rounds": 4, "eval-from": first, "test-subset": 100, "checkpoint-every": 0,
            "data-dir": str(SHARED_DATA), "output-dir": str(tmp_path), "run-name": f"from-{first}",
        })
        run_local(cfg, echo=lambda _: None)
        rows[first] = pd.read_csv(cfg.run_dir / "rounds.csv").drop(columns="seconds")
    assert rows[3]["test_accuracy"].isna().tolist() == [True, True, False, False]
    tests = ["test_loss", "test_accuracy"]
    pd.testing.assert_frame_equal(rows[3].drop(columns=tests), rows[1].drop(columns=tests))
    pd.testing.assert_frame_equal(rows[3][tests].iloc[2:], rows[1][tests].iloc[2:])


def test_eval_from_is_checked():
    with pytest.raises(ConfigError, match="eval-from"):
        run_config_from_values({"eval-from": 0})
