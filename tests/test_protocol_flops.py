"""benchmarks/protocol_flops.py: the protocol's image passes and a model's FLOPs, against hand counts."""

from __future__ import annotations

import importlib

import pytest
from flwr_runner import PROJECT

from fedmask_app.run.model import build_model


@pytest.fixture
def protocol_flops(monkeypatch):
    monkeypatch.syspath_prepend(str(PROJECT / "benchmarks"))
    return importlib.import_module("protocol_flops")


def test_the_protocol_has_84_million_training_and_66_million_evaluation_image_passes(protocol_flops):
    """Grid 1 (τ 1, 2, 5 at each of 3 batch sizes) + grid 2's two τ-2 cells = Σ τ of 28, × 3 seeds ×
    200 rounds × 10 clients × 500 images; 11 cells × 3 seeds × 200 rounds × 10,000 test images."""
    assert protocol_flops.protocol_image_passes() == (28 * 3 * 200 * 10 * 500, 11 * 3 * 200 * 10_000)
    assert protocol_flops.protocol_image_passes() == (84_000_000, 66_000_000)


def test_a_linear_models_flops_are_its_matrix_products(protocol_flops):
    """Linear(3072, 10): forward 2·3072·10 per image; backward only the weight's gradient (the
    images need none), as many again."""
    train, evaluation = protocol_flops.flops_per_image(build_model("linear-softmax"))
    assert (train, evaluation) == (2 * 2 * 3072 * 10, 2 * 3072 * 10)


def test_measured_hours_must_name_a_precision(protocol_flops):
    assert protocol_flops.parse_measured(["tf32=1.87"]) == {"tf32": 1.87}
    with pytest.raises(SystemExit, match="PRECISION=HOURS"):
        protocol_flops.parse_measured(["fp8=1"])
