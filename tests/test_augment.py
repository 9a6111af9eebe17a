"""clients.augment.crop_flip against torchvision's crop and flip, image by image; the run-config key
``augment`` through the local engine (the identical-shards control, determinism, batch order kept)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from torchvision.transforms.v2 import functional as tvf

from clients.augment import crop_flip
from clients.training import LocalTraining, local_update

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def _draws(seed: int, n: int, padding: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The offsets and flips crop_flip draws from a generator seeded with ``seed``, in its order."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2 * padding + 1, (n, 2), generator=g), torch.randint(0, 2, (n,), generator=g).bool()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_each_image_is_torchvisions_padded_crop_then_flip(dtype):
    images = torch.randn(64, 3, 32, 32, dtype=dtype)
    fill = torch.tensor([-1.5, 0.25, 2.0], dtype=dtype)
    got = crop_flip(images, torch.Generator().manual_seed(7), fill)
    offsets, flips = _draws(7, 64, 4)
    assert flips.any() and not flips.all() and len({tuple(o) for o in offsets.tolist()}) > 10
    for image, (dy, dx), flip, out in zip(images, offsets.tolist(), flips.tolist(), got, strict=True):
        padded = tvf.pad(image, [4, 4, 4, 4], fill=fill.tolist())
        want = tvf.crop(padded, dy, dx, 32, 32)
        if flip:
            want = tvf.horizontal_flip(want)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert got.dtype == dtype and got.shape == images.shape and got.is_contiguous()


def test_hand_made_offsets_centre_corner_and_mirror():
    """A 1-channel 2×2 image, padding 1, fill 9: offset (1, 1) is the image itself, (0, 0) shifts it
    one pixel down and right behind a border of fill, and a flip mirrors the columns."""
    image = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]])
    fill = torch.tensor([9.0])
    seen = {}
    for seed in range(200):
        (dy, dx), flip = (t[0] for t in _draws(seed, 1, 1))
        out = crop_flip(image, torch.Generator().manual_seed(seed), fill, padding=1)
        seen[(int(dy), int(dx), bool(flip))] = out[0, 0]
    assert len(seen) == 18  # every offset in {0, 1, 2}² with and without the flip
    assert seen[(1, 1, False)].tolist() == [[1, 2], [3, 4]]
    assert seen[(1, 1, True)].tolist() == [[2, 1], [4, 3]]
    assert seen[(0, 0, False)].tolist() == [[9, 9], [9, 1]]
    assert seen[(2, 2, False)].tolist() == [[4, 9], [9, 9]]
    assert seen[(0, 2, True)].tolist() == [[9, 9], [9, 2]]  # the crop [[9, 9], [2, 9]], mirrored


def test_same_generator_seed_same_images_and_the_images_are_a_permutation_with_fill():
    images = torch.randn(8, 3, 32, 32)
    fill = torch.zeros(3)
    a = crop_flip(images, torch.Generator().manual_seed(1), fill)
    b = crop_flip(images, torch.Generator().manual_seed(1), fill)
    c = crop_flip(images, torch.Generator().manual_seed(2), fill)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(a, c)
    for image, out in zip(images, a, strict=True):  # every output pixel is an input pixel or the fill
        values = set(image.flatten().tolist()) | {0.0}
        assert set(out.flatten().tolist()) <= values


def test_local_update_augments_once_an_epoch_and_keeps_the_batch_order():
    """The augment callable sees the whole shard once an epoch; the identity augmentation gives
    the plain update bit for bit (so the batch order does not depend on it)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3))
    theta = [p.detach().numpy().copy() for p in model.parameters()]
    images, labels = torch.randn(10, 3, 2, 2), torch.randint(0, 3, (10,))
    training = LocalTraining(epochs=3, batch_size=4, lr=0.1)
    calls = []

    def identity(x: torch.Tensor) -> torch.Tensor:
        calls.append(len(x))
        return x.clone()

    plain = local_update(model, theta, images, labels, training, torch.Generator().manual_seed(3))
    same = local_update(model, theta, images, labels, training, torch.Generator().manual_seed(3), augment=identity)
    assert calls == [10, 10, 10]
    for a, b in zip(plain.update, same.update, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    flipped = local_update(model, theta, images, labels, training, torch.Generator().manual_seed(3),
                           augment=lambda x: x.flip(-1))
    assert not torch.equal(flipped.update[0], plain.update[0])


def _run(tmp_path: Path, name: str, **values) -> pd.DataFrame:
    from fedmask_app.engines.local import run_local
    from fedmask_app.run.config import run_config_from_values

    cfg = run_config_from_values({
        "num-clients": 10, "clients-per-round": 4, "num-rounds": 2, "max-shard-size": 24, "batch-size": 8,
        "local-epochs": 2, "model": "linear-softmax", "eval-every": 0, "checkpoint-every": 0,
        "data-dir": str(SHARED_DATA), "output-dir": str(tmp_path), "run-name": name, "threads": 1, **values,
    })
    run_local(cfg, echo=lambda _: None)
    return pd.read_csv(tmp_path / name / "rounds.csv")


def test_augmented_runs_pass_the_control_are_deterministic_and_change_the_training(tmp_path):
    control = _run(tmp_path, "control", augment="crop-flip", **{"identical-shards": True})
    np.testing.assert_allclose(control[["recovery", "recovery_weighted"]], 4.0, rtol=1e-6)
    first = _run(tmp_path, "first", augment="crop-flip")
    again = _run(tmp_path, "again", augment="crop-flip")
    plain = _run(tmp_path, "plain")
    columns = ["cohort", "recovery", "recovery_weighted", "train_loss", "mu2_hat", "sigma2_hat"]
    pd.testing.assert_frame_equal(first[columns], again[columns])
    assert first.cohort.tolist() == plain.cohort.tolist()
    assert (first.train_loss != plain.train_loss).all()


@pytest.mark.parametrize(("overrides", "message"), [
    ({"augment": "flip"}, "augment = 'flip' is not allowed"),
    ({"augment": "crop-flip", "vectorize": True}, "'none' with vectorize = true"),
])
def test_bad_augment_values_are_refused_by_name(overrides, message):
    from fedmask_app.run.config import ConfigError, run_config_from_values

    with pytest.raises(ConfigError, match=message):
        run_config_from_values({"data-dir": str(SHARED_DATA), **overrides})
