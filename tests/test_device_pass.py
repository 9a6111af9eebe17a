"""The cohort pass on torch tensors (strategies/device_pass.py) against the numpy pass: the local
engine on a GPU leaves Δ_k on the device, and every server-side result must be the one the numpy
pass gives (here on CPU tensors; tests/test_cuda.py repeats the round on a GPU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import fedmask_app.engines.local as local
import strategies.cohort_pass as cohort_pass
from fedmask_app.run.config import run_config_from_values
from strategies.aggregate import ClientReply, aggregate_cohort, reply_problem
from strategies.cohort import sample_cohort
from strategies.cohort_pass import CoordinateMasks, ServerStep, reduce_cohort
from strategies.round import finish_round
from strategies.server_step import fedexp_step

SHAPES = [(7, 5), (3,), (2, 2, 3), (1,)]
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def _cohort(k: int, dtype=np.float32, seed: int = 0):
    rng = np.random.default_rng(seed)
    updates = [[rng.standard_normal(s).astype(dtype) for s in SHAPES] for _ in range(k)]
    weights = [float(n) for n in rng.integers(1, 50, size=k)]
    theta = [rng.standard_normal(s).astype(dtype) for s in SHAPES]
    return updates, weights, theta


def _on_torch(updates):
    return [[torch.from_numpy(b.copy()) for b in u] for u in updates]


def _assert_same(torch_result, numpy_result, dtype):
    (t_sums, t_params), (n_sums, n_params) = torch_result, numpy_result
    for name in ("sum_sq_norms", "weighted_sum_sq_norms", "sq_norm_of_sum", "sq_norm_of_weighted_sum"):
        assert getattr(t_sums, name) == pytest.approx(getattr(n_sums, name), rel=1e-13), name
    assert t_sums.sq_norms == pytest.approx(n_sums.sq_norms, rel=1e-13)
    assert (t_sums.cohort_size, t_sums.total_weight, t_sums.weights) == (
        n_sums.cohort_size, n_sums.total_weight, n_sums.weights)
    if n_params is None:
        assert t_params is None
        return
    for got, want in zip(t_params, n_params, strict=True):  # θ − step stays on the updates' device
        assert isinstance(got, torch.Tensor) and got.numpy().dtype == want.dtype and tuple(got.shape) == want.shape
        if dtype == np.float32:  # float64 sums in another order, then one rounding to float32: one ulp apart
            np.testing.assert_allclose(got.numpy(), want, rtol=2.0 * np.finfo(dtype).eps, atol=0)
        else:  # no wider type to round from: another summation order moves the result by a few ulps of the
            # largest value summed (seen: 4 ulps of a 0.24 entry, 1.1e-16, on a CPU whose SIMD sums differ)
            np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=8.0 * np.finfo(dtype).eps * np.abs(want).max())


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("step_kind", ["none", "weighted", "uniform", "block masks", "coordinate masks"])
def test_torch_updates_give_the_numpy_pass_results(dtype, step_kind):
    updates, weights, theta = _cohort(5, dtype)
    rng = np.random.default_rng(1)
    coefs = [[float(rng.random() < 0.5) * 2.0 * w / sum(weights) for _ in SHAPES] for w in weights]
    step = {
        "none": None,
        "weighted": ServerStep(theta),
        "uniform": ServerStep(theta, weighted=False),
        "block masks": ServerStep(theta, block_coefs=coefs),
        "coordinate masks": ServerStep(theta, block_coefs=[[2.0 * w / sum(weights)] * len(SHAPES) for w in weights],
                                       coordinate_masks=CoordinateMasks([11, 12, 13, 11, 14], 0.5)),
    }[step_kind]
    _assert_same(reduce_cohort(_on_torch(updates), weights, step), reduce_cohort(updates, weights, step), dtype)


def test_theta_on_the_device_gives_the_host_thetas_step():
    """From round 2 on the local engine's θ is the last pass's tensor output: the same step."""
    updates, weights, theta = _cohort(4, seed=2)
    on_device = [torch.from_numpy(t.copy()) for t in theta]
    _assert_same(reduce_cohort(_on_torch(updates), weights, ServerStep(on_device)),
                 reduce_cohort(updates, weights, ServerStep(theta)), np.float32)


def test_numpy_and_torch_updates_mix():
    """A faulty client's update is corrupted on the host: the pass moves it to the others' device."""
    updates, weights, theta = _cohort(4)
    mixed = _on_torch(updates[:2]) + updates[2:]
    _assert_same(reduce_cohort(mixed, weights, ServerStep(theta)),
                 reduce_cohort(updates, weights, ServerStep(theta)), np.float32)


def test_float64_accumulation_of_float32_tensors():
    big, one = torch.tensor([2.0**24]), torch.tensor([1.0])
    sums, params = reduce_cohort([[big], [one], [-big]], [1.0, 1.0, 1.0],
                                 ServerStep([np.zeros(1, np.float32)], weighted=False))
    assert sums.sq_norm_of_sum == 1.0  # float32 sums would lose the 1
    np.testing.assert_allclose(params[0], [-1.0 / 3.0], rtol=1e-7)


def test_identical_tensors_give_k_squared_over_k_and_orthogonal_ones_give_one():
    update = [torch.linspace(-1, 1, 11)]
    sums, _ = reduce_cohort([update] * 10, [1.0] * 10)
    assert sums.sq_norm_of_sum / sums.sum_sq_norms == pytest.approx(10.0, rel=1e-12)
    basis = torch.eye(4)
    sums, _ = reduce_cohort([[basis[k]] for k in range(4)], [1.0] * 4)
    assert sums.sq_norm_of_sum / sums.sum_sq_norms == pytest.approx(1.0, rel=1e-12)


@pytest.mark.parametrize(("updates", "step", "match"), [
    ([[torch.ones(2)], [torch.ones(3)]], None, "sizes"),
    ([[torch.ones(2)], [torch.ones(2)]], ServerStep([np.ones(3)]), "values"),
])
def test_bad_tensor_input_is_refused_by_name(updates, step, match):
    with pytest.raises(ValueError, match=match):
        reduce_cohort(updates, [1.0, 1.0], step)


def _replies(updates, counts, keeps=None):
    return [ClientReply(pid, n, 0.1 * pid, u, None if keeps is None else keeps[pid])
            for pid, (u, n) in enumerate(zip(updates, counts, strict=True))]


@pytest.mark.parametrize("kind", ["fedavg", "block masks", "coordinate masks", "fedexp"])
def test_a_round_on_torch_updates_is_the_numpy_round(kind):
    updates, weights, theta = _cohort(4, seed=5)
    counts = [int(w) for w in weights]
    keeps = [[bool((k + b) % 2) for b in range(len(SHAPES))] for k in range(4)] if kind == "block masks" else None
    options = {"aggregation": "weighted", "keep_prob": 0.5, "min_clients": 2,
               "server_lr": fedexp_step("weighted", 1e-3, 3) if kind == "fedexp" else None,
               "coordinate_mask_seeds": {pid: 40 + pid for pid in range(4)} if kind == "coordinate masks" else None}
    on_torch = finish_round(3, theta, _replies(_on_torch(updates), counts, keeps), [], **options)
    on_numpy = finish_round(3, theta, _replies(updates, counts, keeps), [], **options)
    assert on_torch.result.stats == pytest.approx(on_numpy.result.stats, rel=1e-12)
    assert on_torch.result.server_lr == pytest.approx(on_numpy.result.server_lr, rel=1e-12)
    for got, want in zip(on_torch.result.params, on_numpy.result.params, strict=True):
        np.testing.assert_allclose(got, want, rtol=2.0 * np.finfo(np.float32).eps, atol=0)


def test_bad_torch_replies_are_left_out_by_name():
    updates, weights, theta = _cohort(4, seed=6)
    replies = _replies(_on_torch(updates), [int(w) for w in weights])
    replies[1].update[0] = torch.full(SHAPES[0], float("nan"))
    replies[2].update[2] = replies[2].update[2].double()
    outcome = finish_round(1, theta, replies, [], aggregation="weighted", keep_prob=1.0, min_clients=2)
    assert outcome.result.partition_ids == [0, 3]
    assert outcome.failures == ["partition 2: array 2 has dtype float64, expected float32",
                                "partition 1: update holds NaN or Inf"]
    expected = aggregate_cohort(theta, [_replies(updates, [int(w) for w in weights])[k] for k in (0, 3)],
                                "weighted", 1.0)
    assert outcome.result.stats == pytest.approx(expected.stats, rel=1e-12)


def test_reply_problem_reads_torch_dtypes():
    reply = ClientReply(0, 3, 0.0, [torch.zeros(2, dtype=torch.float32)], None)
    assert reply_problem(reply, [(2,)], [np.dtype(np.float32)]) is None
    assert reply_problem(reply, [(2,)], [np.dtype(np.float64)]) == "array 0 has dtype float32, expected float64"
    assert reply_problem(reply, [(3,)], [np.dtype(np.float32)]) == "array 0 has shape torch.Size([2]), expected (3,)"
    assert reply_problem(reply, [(2,)], [torch.float32]) is None  # θ itself on the device
    assert reply_problem(reply, [(2,)], [torch.float64]) == "array 0 has dtype float32, expected float64"


@pytest.mark.slow
@pytest.mark.parametrize("vectorize", [False, True])
def test_a_resident_local_run_writes_the_host_runs_rows(tmp_path, monkeypatch, vectorize):
    """The local engine with θ and Δ_k kept as tensors (as on a GPU; here CPU tensors, float64)
    against the same run with numpy replies: every statistic, the curvature measurements of
    round 2, θ after the last round and the checkpoint agree to float64 rounding; from round 2 on
    the resident run's θ is the device pass's tensor output; the sequential run has a client whose
    update is NaN and one that raises (vectorised runs refuse faults)."""
    faults = "" if vectorize else (f"nan:{sample_cohort(0, 1, list(range(100)), 3)[1]}:1,"
                                   f"raise:{sample_cohort(0, 2, list(range(100)), 3)[0]}:2")
    runs, device_passes = {}, []  # per device pass with a step: whether θ came in as tensors
    reduce = cohort_pass.reduce_on_device
    monkeypatch.setattr(cohort_pass, "reduce_on_device",
                        lambda *a: device_passes.append(isinstance(a[2].params[0], torch.Tensor)) or reduce(*a))
    for resident in (False, True):
        monkeypatch.setattr(local, "resident_on", lambda _device, resident=resident: resident)
        cfg = run_config_from_values({
            "num-clients": 100, "clients-per-round": 3, "num-rounds": 2, "local-epochs": 1, "batch-size": 32,
            "max-shard-size": 64, "test-subset": 100, "checkpoint-every": 1, "mask-mode": "independent",
            "device": "cpu", "precision": "float64", "threads": 1, "vectorize": vectorize, "inject-fault": faults,
            "curvature-every": 2, "probe-size": 16, "curvature-probes": 2, "penalty-draws": 2,
            "data-dir": str(SHARED_DATA), "output-dir": str(tmp_path), "run-name": f"resident-{resident}",
        })
        params = local.run_local(cfg, echo=lambda _: None)
        runs[resident] = (pd.read_csv(cfg.run_dir / "rounds.csv"), params)
        saved = torch.load(cfg.run_dir / "checkpoint.pt", weights_only=True)["params"]
        assert isinstance(params[0], np.ndarray)  # run_local hands back host arrays
        assert all(np.array_equal(t.numpy(), p) for t, p in zip(saved, params, strict=True))
    # only the resident run reduces on the device: a pass a round, and round 1's again without the NaN;
    # round 1 starts from the host's θ_0, round 2 from the tensors round 1's pass left on the device
    assert device_passes == ([False, True] if vectorize else [False, False, True])
    (host, theta_host), (resident, theta_resident) = runs[False], runs[True]
    assert host["num_failures"].tolist() == ([0, 0] if vectorize else [1, 1])
    numeric = [c for c in host.columns if host[c].dtype.kind == "f" and not c.endswith("seconds")]
    assert {"recovery", "sigma2_hat", "test_loss", "penalty_sync"} <= set(numeric)
    pd.testing.assert_frame_equal(host[numeric], resident[numeric], rtol=1e-10, atol=0)
    text = [c for c in host.columns if c not in numeric and not c.endswith("seconds")]
    pd.testing.assert_frame_equal(host[text], resident[text])
    for a, b in zip(theta_host, theta_resident, strict=True):
        # relative to each tensor's scale: an entry near 0 left by cancelling terms keeps only their rounding
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12 * np.abs(a).max())
