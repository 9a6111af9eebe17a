"""Shard files for real devices: one client's images and labels, written by fedmask-export-shards."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedmask_app.files import atomic_write


def write_shard_file(path: Path, partition_id: int, images: np.ndarray, labels: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: np.savez(f, partition_id=np.int64(partition_id), images=images, labels=labels))


def load_shard_file(path: str | Path) -> tuple[int, np.ndarray, np.ndarray]:
    """(partition id, uint8 HWC images, int64 labels) of one device's shard."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"shard file {path} (node config data-path) does not exist")
    with np.load(path, allow_pickle=False) as npz:
        images, labels = npz["images"], npz["labels"]
        well_formed = images.dtype == np.uint8 and images.shape[1:] == (32, 32, 3) and len(images) == len(labels)
        if not well_formed:
            raise ValueError(f"{path} is not a fedmask shard file (images {images.dtype}{images.shape})")
        return int(npz["partition_id"]), images, labels.astype(np.int64)
