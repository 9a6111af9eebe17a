"""Runs trained together (fedmask_app/engines/run_group.py, ``fedmask-sweep --group-runs``): each
run's cohort, trained in one batched computation with the other runs' cohorts, gives the Δ_k, rows
and θ its vectorised run alone gives."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from clients.cuda_graphs import CudaGraphCohortStep
from clients.training import LocalTraining
from clients.vectorized import grouped_local_updates, vectorized_local_updates
from fedmask_app.engines.local import run_local
from fedmask_app.engines.run_group import Lockstep, form_groups, run_group
from fedmask_app.run.config import ConfigError, run_config_from_values
from tests.test_vectorized import _generators, _relative, _shards, _small_model

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
STATS = ["recovery", "recovery_weighted", "mean_sq_norm", "sq_norm_of_mean", "sigma2_hat", "mu2_hat", "train_loss"]


def _theta(model, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.1 for p in model.parameters()]


@pytest.mark.parametrize("chunk_size", [None, 2])
@pytest.mark.parametrize("buffered", [False, True])
def test_groups_from_their_own_theta_train_as_each_cohort_alone(buffered, chunk_size):
    """Two cohorts, each from a θ of its own and with shards of unequal size, in one call: every
    Δ_k and train loss is the one the cohort's own vectorised call gives (float64), on the eager
    step and on the CUDA-graph step's persistent buffers (no capture on a CPU), all five clients in
    one vmapped call or in chunks of two (chunks that cut across the groups)."""
    model = _small_model().double()
    training = LocalTraining(epochs=2, batch_size=4, lr=0.1)
    thetas = [_theta(model, 1), _theta(model, 2)]
    shards = [_shards((5, 9, 12), torch.float64, seed=1), _shards((7, 4), torch.float64, seed=2)]
    gens = [_generators(3), [torch.Generator().manual_seed(500 + k) for k in range(2)]]
    step = CudaGraphCohortStep(model, training, capture=False, chunk_size=chunk_size) if buffered else None
    together = grouped_local_updates(model, thetas, shards, training, gens, chunk_size=chunk_size, step=step)
    gens = [_generators(3), [torch.Generator().manual_seed(500 + k) for k in range(2)]]
    for theta, group_shards, group_gens, results in zip(thetas, shards, gens, together, strict=True):
        alone = vectorized_local_updates(model, theta, group_shards, training, group_gens)
        assert len(results) == len(alone)
        for a, b in zip(results, alone, strict=True):
            assert a.num_examples == b.num_examples
            assert _relative(a.update, b.update) <= 1e-12
            assert a.train_loss == pytest.approx(b.train_loss, rel=1e-12)
    # the groups really started from different θ: the same shard from θ_2 gives another Δ
    swapped = vectorized_local_updates(model, thetas[1], shards[0], training, _generators(3))
    assert _relative(together[0][0].update, swapped[0].update) > 1e-3


def test_lockstep_serves_every_member_once_all_are_in_and_lets_finished_members_leave():
    batches: list[list[int]] = []

    def joint(items: list[int]) -> list[int]:
        batches.append(sorted(items))
        return [10 * i for i in items]

    lockstep: Lockstep[int, int] = Lockstep(3, joint)
    answers: dict[int, list[int]] = {}

    def member(index: int, calls: int) -> None:
        try:
            answers[index] = [lockstep.submit(index) for _ in range(calls)]
        finally:
            lockstep.leave()

    threads = [threading.Thread(target=member, args=(i, calls)) for i, calls in enumerate((1, 3, 2))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads)
    assert batches == [[0, 1, 2], [1, 2], [1]]
    assert answers == {0: [0], 1: [10, 10, 10], 2: [20, 20]}


def test_an_error_of_the_joint_call_reaches_every_member_of_that_call():
    def joint(items):
        raise RuntimeError("out of memory")

    lockstep: Lockstep[int, int] = Lockstep(2, joint)
    raised: list[str] = []

    def member(index: int) -> None:
        try:
            lockstep.submit(index)
        except RuntimeError as exc:
            raised.append(str(exc))
        finally:
            lockstep.leave()

    threads = [threading.Thread(target=member, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert raised == ["out of memory", "out of memory"]


def test_a_stopped_lockstep_fails_the_waiting_member_and_every_later_call():
    lockstep: Lockstep[int, int] = Lockstep(2, lambda items: items)
    outcome: list[str] = []

    def member() -> None:
        try:
            lockstep.submit(1)
        except RuntimeError as exc:
            outcome.append(str(exc))

    waiting = threading.Thread(target=member)
    waiting.start()
    while not lockstep._pending:  # the member is waiting for the other one
        time.sleep(0.01)
    lockstep.stop(RuntimeError("interrupted"))
    waiting.join(timeout=30)
    assert outcome == ["interrupted"]
    with pytest.raises(RuntimeError, match="interrupted"):
        lockstep.submit(2)


def _values(**overrides) -> dict:
    return {"num-clients": 20, "clients-per-round": 3, "num-rounds": 2, "max-shard-size": 12, "batch-size": 5,
            "local-epochs": 1, "precision": "float64", "eval-every": 1, "test-subset": 50, "checkpoint-every": 2,
            "threads": 1, "vectorize": True, "data-dir": str(SHARED), **overrides}


def test_runs_trained_together_write_the_rows_and_theta_of_each_run_alone(tmp_path):
    """float64 (CPU): three runs of other seeds, α, masking and length trained together write the
    rounds.csv (every statistic and the evaluation within 1e-10) and the final θ each vectorised
    run alone writes; config.json names the engine."""
    runs = {"a": {"seed": 0, "mask-mode": "independent"},
            "b": {"seed": 1, "mask-mode": "synchronized", "alpha": 1.0, "num-rounds": 3, "checkpoint-every": 3},
            "c": {"seed": 2, "aggregation": "uniform", "num-rounds": 1, "checkpoint-every": 1}}
    alone = [run_config_from_values(_values(**o, **{"run-name": n, "output-dir": str(tmp_path / "alone")}))
             for n, o in runs.items()]
    together = [run_config_from_values(_values(**o, **{"run-name": n, "output-dir": str(tmp_path / "together")}))
                for n, o in runs.items()]
    for cfg in alone:
        run_local(cfg, echo=lambda _: None)
    lines: list[str] = []
    assert run_group(together, [lines.append] * 3) == [None, None, None]
    assert sum("] round " in line for line in lines) == 2 + 3 + 1
    for a, b in zip(alone, together, strict=True):
        rows_a, rows_b = pd.read_csv(a.run_dir / "rounds.csv"), pd.read_csv(b.run_dir / "rounds.csv")
        assert rows_b["round"].tolist() == list(range(1, a.num_rounds + 1))
        assert rows_b["cohort"].tolist() == rows_a["cohort"].tolist()
        columns = [*STATS, "test_accuracy", "test_loss"]
        np.testing.assert_allclose(rows_b[columns], rows_a[columns], rtol=1e-10, atol=0)
        theta_a = torch.load(a.run_dir / "checkpoint.pt", weights_only=True)["params"]
        theta_b = torch.load(b.run_dir / "checkpoint.pt", weights_only=True)["params"]
        for x, y in zip(theta_a, theta_b, strict=True):
            torch.testing.assert_close(y, x, rtol=1e-10, atol=1e-14)
        assert json.loads((b.run_dir / "config.json").read_text())["engine"] == "local-grouped"
    # and the runs' seeds really changed their rows
    assert not np.allclose(pd.read_csv(alone[0].run_dir / "rounds.csv")["recovery"][:1],
                           pd.read_csv(alone[1].run_dir / "rounds.csv")["recovery"][:1])


def test_groups_are_formed_from_runs_that_train_alike_and_others_are_refused(tmp_path):
    def cfg(**o):
        return run_config_from_values(_values(**{"output-dir": str(tmp_path), **o}))

    cfgs = [cfg(seed=0), cfg(seed=0, **{"batch-size": "full"}), cfg(seed=1), cfg(seed=2), cfg(seed=1, alpha=1.0),
            cfg(seed=1, **{"batch-size": "full"})]
    assert form_groups(cfgs, 2) == [[0, 2], [1, 5], [3, 4]]
    assert form_groups(cfgs, 1) == [[i] for i in range(6)]
    with pytest.raises(ConfigError, match="need vectorize = true"):
        run_group([cfg(vectorize=False)])
    with pytest.raises(ConfigError, match="need equal model, skip-padding-taps, local-epochs, batch-size"):
        run_group([cfg(seed=0), cfg(seed=1, lr=0.1)])
    assert not any(tmp_path.iterdir())  # refused before anything was written


@pytest.mark.slow
def test_a_sweep_with_group_runs_trains_its_runs_together(tmp_path, capsys):
    from fedmask_app.cli import sweep  # imports flwr: the GPU image has none (gpu_check.sh runs without it)

    out = tmp_path / "out"
    common = ["conf/tiny/grid.toml", "--output-dir", str(out), f'data-dir="{SHARED}"', "threads=1"]
    assert sweep.main([*common, "--engine", "local", "--group-runs", "2"]) == 2
    assert "need vectorize = true" in capsys.readouterr().err
    assert sweep.main([*common, "--group-runs", "2", "vectorize=true"]) == 2  # the Flower engine
    assert "add --engine local" in capsys.readouterr().err
    assert not out.exists()

    grouped = [*common, "--engine", "local", "--group-runs", "2", "vectorize=true", "model='linear-softmax'"]
    assert sweep.main([*grouped, "--dry-run"]) == 0
    listing = capsys.readouterr().out
    for seed in (0, 1):
        assert f"batch-size=32_seed={seed}: to run (group 1)" in listing
        assert f"batch-size=full_seed={seed}: to run (group 2)" in listing
    assert sweep.main(grouped) == 0
    printed = capsys.readouterr()
    assert "2 group(s) of up to 2 runs trained together" in printed.out
    assert "runs trained together are meant for GPUs" in printed.out
    assert "4 runs completed, 0 failed" in printed.out
    for folder in out.iterdir():
        assert len(pd.read_csv(folder / "rounds.csv")) == 3
        assert json.loads((folder / "config.json").read_text())["engine"] == "local-grouped"
