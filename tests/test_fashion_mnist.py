"""The second data set, Fashion-MNIST: its fetcher's formats on hand-made bytes, the verified file,
every model on 1×28×28 images, and runs on it."""

from __future__ import annotations

import gzip
import io
import json
import tarfile

import numpy as np
import pandas as pd
import pytest
import torch

from fedmask_app.deploy.shards import check_shard_matches, load_shard_file, partition_config, write_shard_file
from fedmask_app.engines.local import run_local
from fedmask_app.run import data
from fedmask_app.run.config import ConfigError, load_run_config
from fedmask_app.run.data import DATASETS, FASHION_MNIST, DataError, load_dataset, normalize
from fedmask_app.run.model import MODELS, build_model, fedavg_cnn

GREY_28 = FASHION_MNIST.input_shape


def idx_bytes(array: np.ndarray) -> bytes:
    """The IDX (MNIST) encoding of a uint8 array."""
    header = bytes([0, 0, 8, array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def ar_archive(members: dict[str, bytes]) -> bytes:
    """A Unix ar archive as dpkg writes one: GNU-style names ending in "/", data padded to even length."""
    out = b"!<arch>\n"
    for name, blob in members.items():
        header = f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(blob):<10}`\n".encode()
        assert len(header) == 60
        out += header + blob + (b"\n" if len(blob) % 2 else b"")
    return out


def fake_deb(files: dict[str, bytes]) -> bytes:
    """A .deb whose data.tar.xz holds ``files`` (name: IDX bytes), gzipped where Debian's package has them."""
    tar_bytes = io.BytesIO()
    with tarfile.open(fileobj=tar_bytes, mode="w:xz") as tar:
        for name, raw in files.items():
            blob = gzip.compress(raw)
            info = tarfile.TarInfo(f"./usr/share/datasets/fashion-mnist/{name}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    return ar_archive({"debian-binary": b"2.0\n", "control.tar.xz": b"", "data.tar.xz": tar_bytes.getvalue()})


def test_read_idx_reads_the_mnist_format_and_refuses_others():
    array = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    np.testing.assert_array_equal(data.read_idx(idx_bytes(array)), array)
    np.testing.assert_array_equal(data.read_idx(idx_bytes(np.array([9, 0, 3], np.uint8))), [9, 0, 3])
    with pytest.raises(DataError, match="not an IDX file of unsigned bytes"):
        data.read_idx(b"\x00\x00\x0d\x01" + (3).to_bytes(4, "big") + bytes(12))  # float32 data
    with pytest.raises(DataError, match=r"shape \[2, 3, 4\] holds 23 data bytes"):
        data.read_idx(idx_bytes(array)[:-1])


def test_ar_members_reads_every_member_across_odd_sizes():
    members = {"debian-binary": b"2.0\n", "odd": b"abc", "last": b"xyz1"}
    assert data.ar_members(ar_archive(members)) == members
    with pytest.raises(DataError, match="not an ar archive"):
        data.ar_members(b"PK\x03\x04 a zip file")


def test_a_deb_with_the_four_idx_files_gives_the_four_arrays():
    rng = np.random.default_rng(0)
    x_train = rng.integers(0, 256, (5, 28, 28), dtype=np.uint8)
    x_test = rng.integers(0, 256, (2, 28, 28), dtype=np.uint8)
    y_train, y_test = np.array([9, 0, 0, 3, 0], np.uint8), np.array([9, 2], np.uint8)
    files = {data.FASHION_MNIST_IDX[name]: idx_bytes(array)
             for name, array in {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test}.items()}
    arrays = data.fashion_mnist_from_deb(fake_deb(files))
    assert list(arrays) == list(data.ARRAYS)
    assert arrays["x_train"].shape == (5, 28, 28, 1) and arrays["x_train"].dtype == np.uint8
    np.testing.assert_array_equal(arrays["x_test"][..., 0], x_test)
    assert arrays["y_train"].dtype == np.int64 and arrays["y_train"].tolist() == [9, 0, 0, 3, 0]
    del files["t10k-labels-idx1-ubyte.gz"]
    with pytest.raises(DataError, match=r"lacks t10k-labels-idx1-ubyte\.gz"):
        data.fashion_mnist_from_deb(fake_deb(files))


def test_every_data_set_states_its_shapes_files_and_statistics():
    for spec in DATASETS.values():
        height, width, channels = spec.image_shape
        assert spec.input_shape == (channels, height, width)
        assert len(spec.channel_mean) == len(spec.channel_std) == channels
        assert spec.file_name == f"{spec.name}.npz" and spec.subset_file_name == f"{spec.name}-subset.npz"
        assert normalize(np.zeros((2, *spec.image_shape), np.uint8), spec).shape == (2, *spec.input_shape)
    with pytest.raises(DataError, match="unknown data set 'mnist': expected one of cifar10, fashion-mnist"):
        data.data_spec("mnist")


def test_the_config_checks_the_data_set_and_names_runs_after_another_one():
    with pytest.raises(ConfigError, match="dataset"):
        load_run_config(['dataset="mnist"'])
    cfg = load_run_config(['dataset="fashion-mnist"', 'model="cnn-fedavg"', "seed=3"])
    assert cfg.data is FASHION_MNIST
    assert cfg.name.startswith("fashion-mnist_cnn-fedavg_a100_") and cfg.name.endswith("_seed3")
    assert load_run_config(["seed=3"]).name.startswith("resnet18-gn_a100_")  # CIFAR-10's names as before


@pytest.mark.parametrize("name", MODELS)
def test_every_model_reads_grey_28x28_images(name):
    model = build_model(name, input_shape=GREY_28)
    assert model(torch.zeros(2, *GREY_28)).shape == (2, 10)
    if name.startswith("resnet18"):
        assert model.conv1.weight.shape[1] == 1


def test_the_fedavg_cnn_on_grey_28x28_has_the_fedavg_papers_parameter_count():
    assert sum(p.numel() for p in fedavg_cnn(GREY_28).parameters()) == 1_663_370  # McMahan et al. (2017), MNIST
    assert sum(p.numel() for p in fedavg_cnn().parameters()) == 2_156_490


@pytest.mark.parametrize("name", ["resnet18-gn", "cnn-fedavg"])
def test_skipping_padding_taps_computes_the_same_function_on_28x28(name):
    plain = build_model(name, input_shape=GREY_28).double()
    fast = build_model(name, skip_padding_taps=True, input_shape=GREY_28).double()
    fast.load_state_dict(plain.state_dict())
    x = torch.randn(3, *GREY_28, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    torch.testing.assert_close(fast(x), plain(x), rtol=1e-10, atol=1e-12)


def test_the_fetched_file_verifies_and_has_the_published_statistics(fashion_mnist_dir):
    fashion = load_dataset(fashion_mnist_dir, "fashion-mnist")  # its content sha256 is checked on load
    assert fashion.sha256 == FASHION_MNIST.content_sha256
    assert np.bincount(fashion.y_train).tolist() == [6000] * 10
    assert np.bincount(fashion.y_test).tolist() == [1000] * 10
    assert fashion.y_train[:10].tolist() == [9, 0, 0, 3, 0, 2, 7, 2, 5, 5]  # ankle boot, T-shirt, T-shirt, dress, ...
    assert fashion.y_test[:10].tolist() == [9, 2, 1, 1, 6, 1, 4, 6, 5, 7]
    scaled = fashion.x_train / 255.0
    assert round(scaled.mean(), 4) == 0.2860 and round(scaled.std(), 4) == 0.3530  # the published statistics
    images = normalize(fashion.x_train[:5000], FASHION_MNIST)
    assert abs(images.mean().item()) < 0.02 and abs(images.std().item() - 1) < 0.02


def test_a_local_run_trains_measures_and_records_fashion_mnist(fashion_mnist_dir, tmp_path, one_thread):
    cfg = load_run_config([
        'dataset="fashion-mnist"', 'model="cnn-fedavg"', f'data-dir="{fashion_mnist_dir}"', f'output-dir="{tmp_path}"',
        "num-rounds=2", "clients-per-round=3", "local-epochs=1", "test-subset=200", "checkpoint-every=0",
        'augment="crop-flip"', "curvature-every=2", "measure-from=2", "probe-size=32", "threads=1",
    ])
    run_local(cfg, echo=lambda _: None)
    rows = pd.read_csv(cfg.run_dir / "rounds.csv")
    assert rows["round"].tolist() == [1, 2] and rows["test_accuracy"].notna().all()
    assert (rows["num_clients"] == 3).all() and rows["recovery"].between(1, 3 + 1e-9).all()
    assert np.isfinite(rows["q_mean"].iloc[1])
    config = json.loads((cfg.run_dir / "config.json").read_text())
    assert config["run_config"]["dataset"] == "fashion-mnist"
    assert config["data_sha256"] == FASHION_MNIST.content_sha256


def test_shard_files_name_their_data_set_and_older_ones_read_as_cifar10(tmp_path):
    fashion = load_run_config(['dataset="fashion-mnist"', "num-clients=3", "clients-per-round=3"])
    cifar = load_run_config(["num-clients=3", "clients-per-round=3"])
    path = tmp_path / "shard-0.npz"
    write_shard_file(path, 0, np.zeros((4, 28, 28, 1), np.uint8), np.zeros(4, np.int64), fashion)
    check_shard_matches(load_shard_file(path), fashion, path)
    with pytest.raises(ValueError, match="dataset: shard 'fashion-mnist', run 'cifar10'"):
        check_shard_matches(load_shard_file(path), cifar, path)
    older = {k: v for k, v in partition_config(cifar).items() if k != "dataset"}  # written before the key existed
    np.savez(path, partition_id=np.int64(0), images=np.zeros((4, 32, 32, 3), np.uint8), labels=np.zeros(4, np.int64),
             partition_config=np.array(json.dumps(older)))
    check_shard_matches(load_shard_file(path), cifar, path)
