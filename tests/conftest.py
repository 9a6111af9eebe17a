"""Fixtures several test modules share."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
import torch
from flwr_runner import FlowerRunner

from fedmask_app.run import data


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


@pytest.fixture(scope="session")
def fashion_mnist_dir(request, tmp_path_factory) -> Path:
    """A data-dir holding a verified fashion-mnist.npz: fetched by the app's own Debian fetcher once
    per checkout into pytest's cache (.pytest_cache; without the cache plugin, once per session);
    skipped only when deb.debian.org cannot be reached."""
    cache = getattr(request.config, "cache", None)
    folder = cache.mkdir("fashion-mnist") if cache is not None else tmp_path_factory.mktemp("fashion-mnist")
    if not (folder / data.FASHION_MNIST.file_name).is_file():
        try:
            urllib.request.urlopen(urllib.request.Request(data.FASHION_MNIST_DEB_URL, method="HEAD"), timeout=30)
        except OSError as exc:
            pytest.skip(f"deb.debian.org cannot be reached ({exc}): Fashion-MNIST not fetched")
        data.ensure_dataset(folder, data.FASHION_MNIST, fetchers=(data.fetch_fashion_mnist_debian,))
    return folder
