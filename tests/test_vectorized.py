"""clients.vectorized: the whole cohort in one batched computation gives every client the Δ_k and
train loss that clients.training.local_update gives it with the same generator."""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from clients.cuda_graphs import CudaGraphCohortStep
from clients.training import LocalResult, LocalTraining, local_update
from clients.vectorized import vectorized_local_updates
from fedmask_app.run.model import build_model, initial_parameters

SIZES = (5, 9, 12)  # with bs 4: partial last batches (5, 9), a full one (12), and T_k of 4 and 6 (τ = 2)


def _small_model() -> nn.Module:
    """Conv + GroupNorm + ReLU + pooling + linear: every layer kind ResNet-18/GN has, at toy size."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.GroupNorm(2, 8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.GroupNorm(2, 8), nn.ReLU(), nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10),
    )


def _shards(sizes, dtype: torch.dtype, side: int = 32, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 3, side, side, generator=gen, dtype=dtype), torch.randint(0, 10, (n,), generator=gen))
            for n in sizes]


def _generators(count: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(100 + k) for k in range(count)]


def _sequential(model, theta, shards, training: LocalTraining) -> list[LocalResult]:
    return [local_update(model, theta, x, y, training, g) for (x, y), g in zip(shards, _generators(len(shards)),
                                                                                strict=True)]


def _relative(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """‖a − b‖ / ‖b‖ over all parameters, in float64."""
    diff = sum(float(((x.double() - y.double()) ** 2).sum()) for x, y in zip(a, b, strict=True))
    norm = sum(float((y.double() ** 2).sum()) for y in b)
    return (diff / norm) ** 0.5


def _assert_equal_results(vec: list[LocalResult], seq: list[LocalResult], tol: float) -> None:
    assert len(vec) == len(seq)
    for v, s in zip(vec, seq, strict=True):
        assert v.num_examples == s.num_examples
        assert [t.shape for t in v.update] == [t.shape for t in s.update]
        assert _relative(v.update, s.update) <= tol
        assert v.train_loss == pytest.approx(s.train_loss, rel=tol)


@pytest.mark.parametrize("batch_size", [4, None])
def test_float64_small_model_matches_sequential(batch_size):
    model = _small_model().double()
    theta = [p.detach().clone() for p in model.parameters()]
    shards = _shards(SIZES, torch.float64)
    training = LocalTraining(epochs=2, batch_size=batch_size, lr=0.05)
    seq = _sequential(model, theta, shards, training)
    before = [p.detach().clone() for p in model.parameters()]
    vec = vectorized_local_updates(model, theta, shards, training, _generators(len(shards)))
    _assert_equal_results(vec, seq, 1e-10)
    assert all(any(bool(t.any()) for t in s.update) for s in seq)  # training moved the weights
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # model untouched


@pytest.mark.parametrize("batch_size", [4, None])
def test_cohort_step_on_persistent_buffers_is_the_eager_step(batch_size):
    """CudaGraphCohortStep without capture (what a CPU can run): θ copied into its persistent
    buffers each round, full steps taken on static input buffers, other steps eagerly on the same
    buffers. Two rounds from different θ give the plain vectorised path's results bit for bit;
    with equal shards every step is a full one."""
    model = _small_model().double()
    training = LocalTraining(epochs=2, batch_size=batch_size, lr=0.05)
    step = CudaGraphCohortStep(model, training, capture=False)
    for sizes in (SIZES, (8, 8, 8), (12, 8, 8), (8, 8)):  # the last: a new cohort size, new buffers
        shards = _shards(sizes, torch.float64)
        for round_seed in (0, 1):
            torch.manual_seed(round_seed)
            theta = [p.detach() + 0.01 * torch.randn_like(p) for p in model.parameters()]
            plain = vectorized_local_updates(model, theta, shards, training, _generators(len(shards)))
            buffered = vectorized_local_updates(model, theta, shards, training, _generators(len(shards)), step=step)
            for a, b in zip(plain, buffered, strict=True):
                assert all(torch.equal(x, y) for x, y in zip(a.update, b.update, strict=True))
                assert a.train_loss == b.train_loss
    assert (step._inputs is not None) == (batch_size is not None)  # full steps went through the static buffers


def test_cuda_graph_cohort_step_needs_cuda():
    with pytest.raises(ValueError, match="CUDA device"):
        CudaGraphCohortStep(_small_model(), LocalTraining(epochs=1, batch_size=4, lr=0.1))


@pytest.mark.parametrize(("skip_padding_taps", "gemm_convs"), [(False, False), (True, False), (False, True),
                                                              (True, True)],
                         ids=["all-taps", "live-taps", "gemm-convs", "live-taps-gemm-convs"])
def test_float64_resnet18_matches_sequential(skip_padding_taps, gemm_convs):
    """The real model: unequal shards, partial last batches, and a step only two clients take.
    With skip-padding-taps and/or gemm-convs, both paths over that model equal the plain
    sequential path."""
    model = build_model("resnet18-gn").double()
    theta = [p.double() for p in initial_parameters("resnet18-gn", 0)]
    shards = _shards(SIZES, torch.float64)
    training = LocalTraining(epochs=1, batch_size=4, lr=0.01)
    seq = _sequential(model, theta, shards, training)
    candidate = build_model("resnet18-gn", skip_padding_taps, gemm_convs).double()
    vec = vectorized_local_updates(candidate, theta, shards, training, _generators(len(shards)))
    _assert_equal_results(vec, seq, 1e-10)
    if skip_padding_taps or gemm_convs:
        _assert_equal_results(_sequential(candidate, theta, shards, training), seq, 1e-10)


def test_float64_fedavg_cnn_matches_sequential():
    """The second architecture (no normalisation layers, max-pooling, a wide linear layer) through
    the vectorised path: McMahan et al.'s CNN, 8 blocks, 2,156,490 parameters."""
    model = build_model("cnn-fedavg").double()
    theta = [p.double() for p in initial_parameters("cnn-fedavg", 0)]
    assert len(theta) == 8 and sum(t.numel() for t in theta) == 2_156_490
    shards = _shards(SIZES, torch.float64)
    training = LocalTraining(epochs=2, batch_size=4, lr=0.05)
    seq = _sequential(model, theta, shards, training)
    vec = vectorized_local_updates(build_model("cnn-fedavg").double(), theta, shards, training,
                                   _generators(len(shards)))
    _assert_equal_results(vec, seq, 1e-10)


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")
@pytest.mark.parametrize("path", ["vectorised", "live-taps", "vectorised-live-taps", "gemm-convs",
                                  "vectorised-gemm-convs"])
def test_float32_resnet18_within_ten_times_the_sequential_noise_floor(path):
    """The sequential path's own float32 noise: the same computation with 1 vs 2 threads and with
    oneDNN off (another convolution algorithm). A ReLU gate sitting at ~1 ulp can flip under any
    change of accumulation order and move one client's Δ_k by up to ~1e-2, so the typical
    (median) client is compared; every client must still be far from an O(1) disagreement.
    live-taps: the sequential path over the model with skip-padding-taps; gemm-convs: with its
    convolutions as matrix products over patches."""
    model = build_model("resnet18-gn")
    theta = initial_parameters("resnet18-gn", 0)
    shards = _shards((16, 16, 16, 16), torch.float32, seed=2)
    training = LocalTraining(epochs=1, batch_size=8, lr=0.01)
    threads = torch.get_num_threads()
    reference = _sequential(model, theta, shards, training)
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        other_threads = _sequential(model, theta, shards, training)
    finally:
        torch.set_num_threads(threads)
    with torch.backends.mkldnn.flags(enabled=False):
        other_algorithm = _sequential(model, theta, shards, training)
    candidate = build_model("resnet18-gn", skip_padding_taps="live-taps" in path, gemm_convs="gemm" in path)
    if not path.startswith("vectorised"):
        vec = _sequential(candidate, theta, shards, training)
    else:
        vec = vectorized_local_updates(candidate, theta, shards, training, _generators(len(shards)))
    floor = [max(_relative(a.update, r.update), _relative(b.update, r.update))
             for a, b, r in zip(other_threads, other_algorithm, reference, strict=True)]
    diff = [_relative(v.update, r.update) for v, r in zip(vec, reference, strict=True)]
    print(f"\n{path}: median relative difference {statistics.median(diff):.1e}, "
          f"noise floor {statistics.median(floor):.1e}")
    assert statistics.median(diff) <= 10 * statistics.median(floor), (diff, floor)
    assert max(diff) < 0.1, diff
    for v, r in zip(vec, reference, strict=True):
        assert v.train_loss == pytest.approx(r.train_loss, rel=1e-4)


def test_bf16_autocast_runs_and_stays_finite():
    model = _small_model()
    theta = [p.detach().clone() for p in model.parameters()]
    shards = _shards(SIZES, torch.float32)
    training = LocalTraining(epochs=1, batch_size=4, lr=0.05, bf16=True)
    vec = vectorized_local_updates(model, theta, shards, training, _generators(len(shards)))
    seq = _sequential(model, theta, shards, training)
    for v, s in zip(vec, seq, strict=True):
        assert all(torch.isfinite(t).all() for t in v.update)
        assert v.update[0].dtype == torch.float32
        assert v.train_loss == pytest.approx(s.train_loss, rel=0.05)


def test_refuses_models_with_buffers_and_mismatched_generators():
    batch_norm = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(144, 10))
    shards = _shards((4, 4), torch.float32, side=8)
    training = LocalTraining(epochs=1, batch_size=2, lr=0.1)
    with pytest.raises(ValueError, match="buffers"):
        theta = [p.detach() for p in batch_norm.parameters()]
        vectorized_local_updates(batch_norm, theta, shards, training, _generators(2))
    model = _small_model()
    theta = [p.detach() for p in model.parameters()]
    with pytest.raises(ValueError, match="one generator per shard"):
        vectorized_local_updates(model, theta, shards, training, _generators(1))


def test_the_local_engine_with_vectorize_writes_the_sequential_rows_in_float64(tmp_path):
    """float64 (CPU): the vectorised local engine's rounds.csv equals the sequential one's within
    1e-10 relative in every statistic, and its checkpoint θ too; config.json names the engine."""
    import json

    import pandas as pd

    from fedmask_app.engines.local import run_local
    from fedmask_app.run.config import run_config_from_values

    shared = Path(__file__).resolve().parents[2] / "shared" / "data"
    base = {"num-clients": 20, "clients-per-round": 3, "num-rounds": 2, "max-shard-size": 12, "batch-size": 5,
            "local-epochs": 1, "precision": "float64", "eval-every": 0, "checkpoint-every": 2, "threads": 1,
            "mask-mode": "independent", "data-dir": str(shared), "output-dir": str(tmp_path)}
    rows = {}
    for vectorize in (False, True):
        name = f"v{int(vectorize)}"
        run_local(run_config_from_values({**base, "vectorize": vectorize, "run-name": name}), echo=lambda _: None)
        rows[vectorize] = pd.read_csv(tmp_path / name / "rounds.csv")
    assert json.loads((tmp_path / "v1" / "config.json").read_text())["engine"] == "local-vectorized"
    numeric = ["recovery", "recovery_weighted", "mean_sq_norm", "sq_norm_of_mean", "sigma2_hat", "mu2_hat",
               "train_loss"]
    np.testing.assert_allclose(rows[True][numeric], rows[False][numeric], rtol=1e-10, atol=0)
    assert rows[True]["cohort"].tolist() == rows[False]["cohort"].tolist()
    sequential = torch.load(tmp_path / "v0" / "checkpoint.pt", weights_only=True)["params"]
    vectorized = torch.load(tmp_path / "v1" / "checkpoint.pt", weights_only=True)["params"]
    for a, b in zip(sequential, vectorized, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-14)


def test_the_identical_shards_control_passes_through_the_vectorised_engine(tmp_path):
    import pandas as pd

    from fedmask_app.engines.local import run_local
    from fedmask_app.run.config import run_config_from_values

    shared = Path(__file__).resolve().parents[2] / "shared" / "data"
    cfg = run_config_from_values({
        "num-clients": 10, "clients-per-round": 4, "num-rounds": 1, "max-shard-size": 16, "batch-size": 8,
        "local-epochs": 1, "identical-shards": True, "vectorize": True, "eval-every": 0, "checkpoint-every": 0,
        "data-dir": str(shared), "output-dir": str(tmp_path), "run-name": "control",
    })
    run_local(cfg, echo=lambda _: None)
    rows = pd.read_csv(tmp_path / "control" / "rounds.csv")
    np.testing.assert_allclose(rows[["recovery", "recovery_weighted"]], 4.0, rtol=1e-6)


@pytest.mark.parametrize(("momentum", "weight_decay"), [(0.9, 0.0), (0.5, 0.01)])
@pytest.mark.parametrize("batch_size", [4, None])
def test_float64_momentum_and_weight_decay_match_sequential(batch_size, momentum, weight_decay):
    """Unequal shards (clients that stop early keep their buffers untouched), then a second round
    through the same persistent step: its momentum buffers start again at zero, as each
    sequential client's optimizer does."""
    model = _small_model().double()
    training = LocalTraining(epochs=2, batch_size=batch_size, lr=0.05, momentum=momentum, weight_decay=weight_decay)
    shards = _shards(SIZES, torch.float64)
    step = CudaGraphCohortStep(model, training, capture=False)
    for round_seed in (0, 1):
        torch.manual_seed(round_seed)
        theta = [p.detach() + 0.01 * torch.randn_like(p) for p in model.parameters()]
        seq = _sequential(model, theta, shards, training)
        _assert_equal_results(vectorized_local_updates(model, theta, shards, training, _generators(len(shards))),
                              seq, 1e-10)
        _assert_equal_results(vectorized_local_updates(model, theta, shards, training, _generators(len(shards)),
                                                       step=step), seq, 1e-10)
    plain = _sequential(model, theta, shards, LocalTraining(epochs=2, batch_size=batch_size, lr=0.05))
    assert _relative(seq[0].update, plain[0].update) > 1e-3  # the optimizer changed the update
