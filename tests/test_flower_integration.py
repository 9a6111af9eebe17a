"""The app through the real `flwr run` (Ray simulation) on real CIFAR-10 with ResNet-18/GN."""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from flwr_runner import SHARED_DATA, FlowerRunner, write_run_config

from fedmask_app.engines.flower.fast.slots import SLOT_NAME
from fedmask_app.engines.local import run_local
from fedmask_app.run.config import load_run_config
from fedmask_app.run.results import COLUMNS
from strategies.cohort import sample_cohort

pytestmark = pytest.mark.slow

NOT_COMPARED = ["seconds"]


@pytest.fixture(scope="module")
def flower(tmp_path_factory):
    runner = FlowerRunner(tmp_path_factory.mktemp("flwr-home"))
    yield runner
    runner.kill_all()
    assert runner.processes() == [], "processes of the test's Flower runs are still alive"


def tiny(tmp_path, **overrides) -> dict:
    """K = 100 clients with the paper's ~500-sample shards, 3 a round: seconds per round on a CPU."""
    return {
        "num-clients": 100, "clients-per-round": 3, "num-rounds": 2, "local-epochs": 1, "batch-size": 32,
        "test-subset": 200, "checkpoint-every": 0, "data-dir": str(SHARED_DATA),
        "output-dir": str(tmp_path), "run-name": "run", **overrides,
    }


def run_flower(flower: FlowerRunner, tmp_path, name: str, **overrides) -> tuple[pd.DataFrame, str]:
    values = tiny(tmp_path, **{"run-name": name, **overrides})
    done = flower.run(write_run_config(tmp_path / f"{name}.toml", values), values["num-clients"])
    log = done.stdout + done.stderr
    path = tmp_path / name / "rounds.csv"
    rows = pd.read_csv(path) if path.exists() else pd.DataFrame()
    return rows, log


def reply_slots_in_shared_memory() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.iterdir() if SLOT_NAME.fullmatch(p.name)} if shm.is_dir() else set()


def test_rounds_csv_determinism_and_local_engine_agree(flower, tmp_path):
    overrides = {"mask-mode": "independent", "keep-prob": 0.5, "threads": 1}
    slots_before = reply_slots_in_shared_memory()
    first, log = run_flower(flower, tmp_path, "first", **overrides)
    assert "clients write their updates into shared-memory slots" in log
    assert reply_slots_in_shared_memory() <= slots_before  # the server unlinked its slots
    assert list(first.columns) == list(COLUMNS), log
    assert first["round"].tolist() == [1, 2], log
    assert (first["num_clients"] == 3).all() and (first["num_failures"] == 0).all()
    assert first["recovery"].between(0, 3 + 1e-9).all()
    assert first["test_accuracy"].notna().all()
    assert "[fedmask] round 2/2" in log and "1/dS=" in log

    second, _ = run_flower(flower, tmp_path, "second", **overrides)
    pd.testing.assert_frame_equal(first.drop(columns=NOT_COMPARED), second.drop(columns=NOT_COMPARED))

    values = tiny(tmp_path, **{**overrides, "run-name": "local"})
    run_local(load_run_config([str(write_run_config(tmp_path / "local.toml", values))]), echo=lambda _: None)
    local = pd.read_csv(tmp_path / "local" / "rounds.csv")
    pd.testing.assert_frame_equal(first.drop(columns=NOT_COMPARED), local.drop(columns=NOT_COMPARED))


def test_identical_shards_control_gives_the_ceiling(flower, tmp_path):
    rows, log = run_flower(
        flower, tmp_path, "control", **{"identical-shards": True, "clients-per-round": 4, "mask-mode": "synchronized"}
    )
    assert rows["round"].tolist() == [1, 2], log
    for column in ("recovery", "recovery_weighted"):
        assert np.allclose(rows[column], 4.0, rtol=1e-9, atol=0), rows[column].tolist()
    assert np.allclose(rows["sigma2_hat"], 0.0, atol=1e-9 * rows["mean_sq_norm"].max())


def test_faulty_clients_are_left_out_and_counted(flower, tmp_path):
    kinds = ["raise", "nan", "inf", "shape", "dtype", "hang"]
    targets = [sample_cohort(0, r, range(100), 3)[0] for r in range(1, 7)]
    faults = ",".join(f"{kind}:{pid}:{r}" for r, (kind, pid) in enumerate(zip(kinds, targets, strict=True), 1))
    rows, log = run_flower(
        flower, tmp_path, "faults", **{"num-rounds": 6, "inject-fault": faults, "round-timeout": 40.0}
    )
    assert rows["round"].tolist() == [1, 2, 3, 4, 5, 6], log
    assert rows["num_failures"].tolist() == [1] * 6
    assert rows["num_clients"].tolist() == [2] * 6
    for r, pid in enumerate(targets, 1):
        assert str(pid) not in rows.loc[r - 1, "cohort"].split()
    assert all(math.isfinite(v) for v in rows["recovery"])
    for reason in ("InjectedFault", "NaN or Inf", "shape", "dtype", "no reply within round-timeout"):
        assert reason in log, reason


def test_too_few_good_replies_stop_the_run_and_keep_its_rounds(flower, tmp_path):
    pid = sample_cohort(0, 2, range(100), 2)[0]
    rows, log = run_flower(
        flower, tmp_path, "stop",
        **{"clients-per-round": 2, "num-rounds": 3, "min-clients": 2, "inject-fault": f"raise:{pid}:2"},
    )
    assert rows["round"].tolist() == [1], log
    assert "run stopped in round 2" in log and "min-clients is 2" in log


def test_sigkill_then_resume_matches_an_uninterrupted_run(flower, tmp_path):
    values = tiny(tmp_path, **{"num-rounds": 5, "checkpoint-every": 1, "run-name": "killed", "threads": 1})
    config = write_run_config(tmp_path / "killed.toml", values)
    rounds = tmp_path / "killed" / "rounds.csv"
    proc = flower.start(config, 100, tmp_path / "killed.log")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if rounds.exists() and len(rounds.read_text().splitlines()) >= 3:  # header + 2 rounds
            break
        time.sleep(0.1)
    flower.kill_all()  # SIGKILL: SuperLink, ServerApp, Ray workers, the CLI
    proc.wait(timeout=30)
    interrupted = pd.read_csv(rounds)
    assert 2 <= len(interrupted) < 5, "the run was not interrupted mid-way"

    done = flower.run(write_run_config(config, {**values, "resume": True}), 100)
    resumed = pd.read_csv(rounds)
    assert resumed["round"].tolist() == [1, 2, 3, 4, 5], done.stdout + done.stderr

    reference = tiny(tmp_path, **{"num-rounds": 5, "run-name": "reference", "threads": 1})
    run_local(load_run_config([str(write_run_config(tmp_path / "reference.toml", reference))]), echo=lambda _: None)
    uninterrupted = pd.read_csv(tmp_path / "reference" / "rounds.csv")
    pd.testing.assert_frame_equal(resumed.drop(columns=NOT_COMPARED), uninterrupted.drop(columns=NOT_COMPARED))
