"""Fixtures several test modules share."""

from __future__ import annotations

import pytest
import torch
from flwr_runner import FlowerRunner


@pytest.fixture(scope="module")
def flower(tmp_path_factory):
    """A runner for real `flwr run`s on a SuperLink of the module's own; everything it started is
    stopped at the end of the module."""
    runner = FlowerRunner(tmp_path_factory.mktemp("flwr-home"))
    yield runner
    runner.kill_all()
    assert runner.pids() == [], "processes of the test's Flower runs are still alive"


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one torch thread avoids oversubscription and is faster than two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
