"""The app through the real `flwr run` (Ray simulation) on real CIFAR-10 with ResNet-18/GN."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import psutil
import pytest
from flwr_runner import SHARED_DATA, FlowerRunner, superlink_tokens, write_run_config

from fedmask_app.cli import run as fedmask_run
from fedmask_app.engines.flower.fast.slots import SLOT_NAME
from fedmask_app.engines.local import run_local
from fedmask_app.run.config import load_run_config
from fedmask_app.run.results import COLUMNS
from strategies.cohort import sample_cohort

pytestmark = pytest.mark.slow

NOT_COMPARED = ["seconds"]




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
    assert "θ and updates cross in shared-memory slots" in log
    assert reply_slots_in_shared_memory() <= slots_before  # the server unlinked its slots
    assert list(first.columns) == list(COLUMNS), log
    assert first["round"].tolist() == [1, 2], log
    assert (first["num_clients"] == 3).all() and (first["num_failures"] == 0).all()
    assert first["recovery"].between(0, 3 + 1e-9).all()
    assert first["test_accuracy"].notna().all()
    assert "[fedmask] round 2/2" in log and "1/dS=" in log

    second, _ = run_flower(flower, tmp_path, "second", **overrides)
    pd.testing.assert_frame_equal(first.drop(columns=NOT_COMPARED), second.drop(columns=NOT_COMPARED))

    public, log = run_flower(flower, tmp_path, "public-api", **overrides, **{"fast-simulation": False})
    assert "shared-memory slots" not in log  # Flower's public API alone
    pd.testing.assert_frame_equal(first.drop(columns=NOT_COMPARED), public.drop(columns=NOT_COMPARED))

    values = tiny(tmp_path, **{**overrides, "run-name": "local"})
    run_local(load_run_config([str(write_run_config(tmp_path / "local.toml", values))]), echo=lambda _: None)
    local = pd.read_csv(tmp_path / "local" / "rounds.csv")
    pd.testing.assert_frame_equal(first.drop(columns=NOT_COMPARED), local.drop(columns=NOT_COMPARED))


def test_fashion_mnist_trains_through_flower_as_through_the_local_engine(flower, tmp_path, fashion_mnist_dir):
    overrides = {"dataset": "fashion-mnist", "model": "cnn-fedavg", "data-dir": str(fashion_mnist_dir), "threads": 1}
    rows, log = run_flower(flower, tmp_path, "fashion", **overrides)
    assert rows["round"].tolist() == [1, 2] and rows["test_accuracy"].notna().all(), log
    values = tiny(tmp_path, **{**overrides, "run-name": "fashion-local"})
    run_local(load_run_config([str(write_run_config(tmp_path / "fashion-local.toml", values))]), echo=lambda _: None)
    local = pd.read_csv(tmp_path / "fashion-local" / "rounds.csv")
    pd.testing.assert_frame_equal(rows.drop(columns=NOT_COMPARED), local.drop(columns=NOT_COMPARED))


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


def _ray_store_and_server_memory(flower: FlowerRunner) -> tuple[float, float, float]:
    """(object store MiB, spilled MiB) from Ray's own `ray memory --stats-only`, and the anonymous
    memory (RssAnon, MiB) of the process that runs the ServerApp and the simulation runtime."""
    gcs, server = None, None
    for proc in flower.processes():
        try:
            cmdline = proc.cmdline()
        except psutil.Error:
            continue
        gcs = gcs or next((a.split("=", 1)[1] for a in cmdline if a.startswith("--gcs-address=")), None)
        if any(a.endswith("flwr-simulation") for a in cmdline):
            server = proc
    assert gcs and server, "no Ray session or simulation process found among the run's processes"
    stats = subprocess.run([str(Path(sys.executable).with_name("ray")), "memory", "--address", gcs, "--stats-only"],
                           capture_output=True, text=True, timeout=120).stdout
    store = re.search(r"Plasma memory usage (\d+) MiB", stats)
    assert store, stats
    spilled = re.search(r"Spilled (\d+) MiB", stats)
    rss_anon = next(int(line.split()[1]) for line in Path(f"/proc/{server.pid}/status").read_text().splitlines()
                    if line.startswith("RssAnon:"))
    return float(store[1]), float(spilled[1]) if spilled else 0.0, rss_anon / 1024


@pytest.mark.parametrize("fast", [True, False], ids=["fast-simulation", "flower-public-api"])
def test_ray_object_store_and_server_memory_stay_bounded(flower, tmp_path, fast):
    """45 rounds of 10 clients: Ray's object store holds no more from round 30 on than from round 5
    on plus two model sizes, nothing is spilled, and the server's anonymous memory grows < 200 MB.
    (A ray.put of θ in the Ray serializer once leaked ~85 MB a round.) Each window is 5 samples
    taken one after another from that round on (the fast run ends soon after round 30, so no more
    fit). With shared-memory slots the store's median must not grow.
    With Flower's public API, messages in flight hold 0-14 model-sized objects at any moment
    (samples 0-640 MiB in one window, no trend), so a median can land high by chance (once 469
    against an early window of 0-255): there the late window's smallest sample, the store's floor,
    is held to the early window's largest plus two model sizes. A leak raises the floor with it:
    ~85 MB a round puts it 2 GB higher by round 30."""
    values = tiny(tmp_path, **{
        "run-name": f"memory-{fast}", "num-rounds": 45, "clients-per-round": 10, "max-shard-size": 32,
        "eval-every": 0, "fast-simulation": fast,
    })
    rounds = tmp_path / values["run-name"] / "rounds.csv"
    proc = flower.start(write_run_config(tmp_path / "memory.toml", values), 100, tmp_path / "memory.log")
    samples: dict[int, list[tuple[float, float, float]]] = {}
    try:
        for at in (5, 30):
            deadline = time.monotonic() + 600
            while not (rounds.exists() and len(rounds.read_text().splitlines()) > at):
                assert proc.poll() is None, (tmp_path / "memory.log").read_text()[-3000:]
                assert time.monotonic() < deadline, f"the run did not reach round {at}"
                time.sleep(0.1)
            samples[at] = [_ray_store_and_server_memory(flower) for _ in range(5)]
        assert proc.wait(timeout=300) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    model_mib = 44.7
    store5, anon5 = (float(np.median([s[i] for s in samples[5]])) for i in (0, 2))
    store30, anon30 = (float(np.median([s[i] for s in samples[30]])) for i in (0, 2))
    print(f"object store {store5:.0f} -> {store30:.0f} MiB, server RssAnon {anon5:.0f} -> {anon30:.0f} MiB", samples)
    if fast:  # nothing model-sized goes through the store: it must stay where it was
        assert store30 <= store5 + 2 * model_mib, samples
    else:  # messages in flight come and go (0-14 of them at a time): the floor must not rise
        assert min(s[0] for s in samples[30]) <= max(s[0] for s in samples[5]) + 2 * model_mib, samples
    assert all(spilled == 0 for s in samples.values() for _, spilled, _ in s), samples
    assert anon30 - anon5 < 200 / 1.048576, samples
    assert pd.read_csv(rounds)["round"].tolist() == list(range(1, 46))


def test_runs_leave_a_simulation_they_did_not_start_alone(flower, tmp_path):
    """A simulation started outside the suite (its own FLWR_HOME and SuperLink) keeps running while
    fedmask-run and the tests' runner do their runs, and finishes; fedmask-run's own SuperLink is
    gone when it returns."""
    outside = FlowerRunner(tmp_path / "outside-home")  # stands for a user's run in another shell
    values = tiny(tmp_path, **{"run-name": "outside", "num-rounds": 6})
    rounds = tmp_path / "outside" / "rounds.csv"
    proc = outside.start(write_run_config(tmp_path / "outside.toml", values), 100, tmp_path / "outside.log")
    try:
        deadline = time.monotonic() + 300
        while not (rounds.exists() and len(rounds.read_text().splitlines()) > 1):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "outside.log").read_text()[-3000:]
            time.sleep(0.2)
        before = superlink_tokens()
        inside = tiny(tmp_path, **{"run-name": "cli", "max-shard-size": 32})
        assert fedmask_run.main([str(write_run_config(tmp_path / "cli.toml", inside))]) == 0
        assert superlink_tokens() <= before, "fedmask-run left its SuperLink's processes behind"
        rows, log = run_flower(flower, tmp_path, "runner", **{"max-shard-size": 32})
        assert rows["round"].tolist() == [1, 2], log
        assert proc.poll() is None or proc.returncode == 0
        assert proc.wait(timeout=600) == 0, (tmp_path / "outside.log").read_text()[-3000:]
        assert pd.read_csv(rounds)["round"].tolist() == [1, 2, 3, 4, 5, 6]
    finally:
        outside.kill_all()


def test_a_federation_smaller_than_num_clients_fails_fast_in_simulation(flower, tmp_path):
    """10 SuperNodes for num-clients = 100: the run stops after seconds with the reason, not after
    round-timeout (3600 s here)."""
    values = tiny(tmp_path, **{"run-name": "small", "round-timeout": 3600.0})
    started = time.monotonic()
    done = flower.run(write_run_config(tmp_path / "small.toml", values), num_supernodes=10, timeout=300)
    log = done.stdout + done.stderr
    assert "num-clients = 100 but only 10 nodes connected" in log, log[-3000:]
    assert time.monotonic() - started < 240
    assert not (tmp_path / "small" / "rounds.csv").exists() or len(pd.read_csv(tmp_path / "small" / "rounds.csv")) == 0
