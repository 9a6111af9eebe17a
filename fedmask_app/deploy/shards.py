"""Shard files for real devices: one client's images and labels, written by fedmask-export-shards,
with the run-config keys that define the partition, so a device cannot train on the shard of
another configuration unnoticed."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedmask_app.run.config import RunConfig
from fedmask_app.run.files import atomic_write

PARTITION_KEYS = ("dataset", "seed", "num-clients", "alpha", "min-partition-size", "max-shard-size", "identical-shards")
# what a shard file written before the key existed was exported from
PARTITION_DEFAULTS = {"dataset": "cifar10"}


def partition_config(cfg: RunConfig) -> dict[str, Any]:
    """The run-config keys that define the shards, as in the run config."""
    values = cfg.to_mapping()
    return {key: values[key] for key in PARTITION_KEYS}


@dataclass(frozen=True)
class Shard:
    partition_id: int
    images: np.ndarray  # uint8, N x H x W x C (CIFAR-10: 32 x 32 x 3)
    labels: np.ndarray  # int64, N
    config: dict[str, Any]  # partition_config of the run that wrote it


def write_shard_file(path: Path, partition_id: int, images: np.ndarray, labels: np.ndarray, cfg: RunConfig) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    config = np.array(json.dumps(partition_config(cfg), sort_keys=True))
    atomic_write(path, lambda f: np.savez(
        f, partition_id=np.int64(partition_id), images=images, labels=labels, partition_config=config,
    ))


def load_shard_file(path: str | Path) -> Shard:
    """One device's shard, checked for shape and type."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"shard file {path} (node config data-path) does not exist")
    with np.load(path, allow_pickle=False) as npz:
        images, labels = npz["images"], npz["labels"]
        well_formed = images.dtype == np.uint8 and images.ndim == 4 and len(images) == len(labels)
        if not well_formed or "partition_config" not in npz.files:
            raise ValueError(f"{path} is not a fedmask shard file (images {images.dtype}{images.shape})")
        config = {**PARTITION_DEFAULTS, **json.loads(str(npz["partition_config"]))}
        return Shard(int(npz["partition_id"]), images, labels.astype(np.int64), config)


def check_shard_matches(shard: Shard, cfg: RunConfig, path: str | Path) -> None:
    """Refuse a shard exported for another partition than this run's."""
    expected = partition_config(cfg)
    if shard.config != expected:
        diffs = ", ".join(
            f"{k}: shard {shard.config.get(k)!r}, run {expected[k]!r}" for k in PARTITION_KEYS
            if shard.config.get(k) != expected[k]
        )
        raise ValueError(f"shard file {path} was exported for another partition ({diffs}): re-export it")
    if shard.images.shape[1:] != cfg.data.image_shape:
        raise ValueError(f"shard file {path} holds images of shape {shard.images.shape[1:]}, not {cfg.data.title}'s "
                         f"{cfg.data.image_shape}")
