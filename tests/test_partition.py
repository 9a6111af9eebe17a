"""fedmask_app.run.partition against flwr-datasets' DirichletPartitioner, on the real CIFAR-10 labels."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from fedmask_app.run.partition import dirichlet_partition, identical_shards

CIFAR10 = Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar10.npz"
MIN_SIZE = 10


@pytest.fixture(scope="module")
def labels() -> np.ndarray:
    if not CIFAR10.is_file():
        pytest.skip(f"{CIFAR10} not found")
    with np.load(CIFAR10) as data:
        y = data["y_train"]
    assert y.shape == (50000,)
    return y


@pytest.fixture(scope="module")
def label_dataset(labels):
    datasets = pytest.importorskip("datasets")
    # "idx" carries each row's position, so a partition's rows give back the indices it drew.
    return datasets.Dataset.from_dict({"label": labels, "idx": np.arange(len(labels))})


def _flwr_partition(dataset, num_clients: int, alpha: float, seed: int, min_size: int) -> list[np.ndarray]:
    partitioner_mod = pytest.importorskip("flwr_datasets.partitioner")
    partitioner = partitioner_mod.DirichletPartitioner(
        num_partitions=num_clients,
        partition_by="label",
        alpha=alpha,
        min_partition_size=min_size,
        self_balancing=False,
        shuffle=True,
        seed=seed,
    )
    partitioner.dataset = dataset
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [
            np.asarray(partitioner.load_partition(i).with_format("numpy")[:]["idx"], dtype=np.int64)
            for i in range(num_clients)
        ]


@pytest.mark.parametrize(
    ("num_clients", "alpha", "seed"),
    [(100, 100.0, 0), (100, 1.0, 1), (100, 0.1, 0), (10, 0.5, 3)],
)
def test_matches_flwr_datasets_index_for_index(labels, label_dataset, num_clients, alpha, seed):
    theirs = _flwr_partition(label_dataset, num_clients, alpha, seed, MIN_SIZE)
    ours = dirichlet_partition(labels, num_clients, alpha, seed, MIN_SIZE)
    assert len(ours) == len(theirs) == num_clients
    for pid, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"partition {pid}")


@pytest.mark.parametrize(("num_clients", "alpha", "seed"), [(100, 100.0, 0), (100, 0.1, 0), (7, 1.0, 5)])
def test_shards_are_disjoint_and_cover_every_index(labels, num_clients, alpha, seed):
    shards = dirichlet_partition(labels, num_clients, alpha, seed, MIN_SIZE)
    assert all(s.dtype == np.int64 for s in shards)
    everything = np.concatenate(shards)
    assert len(everything) == len(labels)
    np.testing.assert_array_equal(np.sort(everything), np.arange(len(labels)))
    assert min(len(s) for s in shards) >= MIN_SIZE


def test_deterministic_in_the_seed(labels):
    a = dirichlet_partition(labels, 20, 0.5, 4, MIN_SIZE)
    b = dirichlet_partition(labels, 20, 0.5, 4, MIN_SIZE)
    c = dirichlet_partition(labels, 20, 0.5, 5, MIN_SIZE)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_shards_are_shuffled(labels):
    shard = dirichlet_partition(labels, 10, 100.0, 0, MIN_SIZE)[0]
    assert not np.all(np.diff(shard) > 0)


def test_alpha_controls_label_skew(labels):
    """Near-IID at α = 100, concentrated on few classes at α = 0.1."""

    def mean_top_class_share(shards):
        return np.mean([np.bincount(labels[s], minlength=10).max() / len(s) for s in shards])

    assert mean_top_class_share(dirichlet_partition(labels, 100, 100.0, 0, MIN_SIZE)) < 0.25
    assert mean_top_class_share(dirichlet_partition(labels, 100, 0.1, 0, MIN_SIZE)) > 0.5


def test_redraws_past_flwr_datasets_limit(labels):
    """α = 0.1, seed 2, K = 100: flwr-datasets gives up after 10 redraws; we keep going."""
    shards = dirichlet_partition(labels, 100, 0.1, 2, MIN_SIZE)
    assert min(len(s) for s in shards) >= MIN_SIZE
    np.testing.assert_array_equal(np.sort(np.concatenate(shards)), np.arange(len(labels)))


def test_unreachable_min_size_raises(labels):
    with pytest.raises(ValueError, match="min-partition-size"):
        dirichlet_partition(labels[:200], 20, 1.0, 0, min_size=11)  # 20 · 11 > 200 samples


def test_identical_shards_are_copies_of_client_zero(labels):
    shards = identical_shards(labels, 10, 100.0, 0, MIN_SIZE)
    reference = dirichlet_partition(labels, 10, 100.0, 0, MIN_SIZE)[0]
    assert len(shards) == 10
    for shard in shards:
        np.testing.assert_array_equal(shard, reference)


@pytest.mark.parametrize("alpha", [0.0, -1.0])
def test_non_positive_alpha_raises(labels, alpha):
    with pytest.raises(ValueError, match="alpha"):
        dirichlet_partition(labels, 10, alpha, 0, MIN_SIZE)
