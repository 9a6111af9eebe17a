"""client-processes: the local engine's clients in worker processes write the one-thread run's numbers."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fedmask_app.engines.client_pool import ClientPool, ClientPoolError, pool_size, worker_threads
from fedmask_app.engines.local import in_client_processes, local_train_round, run_local
from fedmask_app.run.config import ConfigError, refuse_local_engine_keys, run_config_from_values
from fedmask_app.run.loop import run_rounds
from fedmask_app.run.model import initial_parameters
from fedmask_app.run.shared_memory import SEGMENT_NAME, packed_arrays, packed_nbytes
from strategies.cohort import sample_cohort

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def our_segments() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.iterdir() if SEGMENT_NAME.fullmatch(p.name)} if shm.is_dir() else set()


def test_packed_arrays_lie_aligned_one_after_another():
    like = [np.zeros((3,), np.float32), np.zeros((2, 2), np.float64), np.zeros((1,), np.float32)]
    assert packed_nbytes(like) == 64 + 64 + 4  # 12 bytes, then 32 at 64, then 4 at 128
    buffer = bytearray(packed_nbytes(like))
    arrays = packed_arrays(buffer, like)
    for array, value in zip(arrays, like, strict=True):
        assert array.shape == value.shape and array.dtype == value.dtype
    arrays[1][:] = [[1, 2], [3, 4]]
    assert np.frombuffer(bytes(buffer[64:96]), np.float64).tolist() == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="holds 100 bytes"):
        packed_arrays(bytearray(100), like)


def test_processes_and_their_threads_come_from_the_cpus_given(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    cfg = run_config_from_values({"client-processes": 3})
    assert worker_threads(cfg, 3) == 2
    assert worker_threads(cfg, 16) == 1
    assert worker_threads(run_config_from_values({"threads": 4}), 3) == 4
    assert pool_size(run_config_from_values({"client-processes": 0})) == 8  # one per CPU given
    assert pool_size(cfg) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # a Ray task of one CPU: the run trains in its own process
    assert pool_size(run_config_from_values({"client-processes": 0})) == 1


def test_the_flower_engine_refuses_local_engine_keys():
    with pytest.raises(ConfigError, match=r"client-processes = 2 is a local-engine key"):
        refuse_local_engine_keys(run_config_from_values({"client-processes": 2}))
    with pytest.raises(ConfigError, match=r"vectorize = true is a local-engine key"):
        refuse_local_engine_keys(run_config_from_values({"vectorize": True}))
    refuse_local_engine_keys(run_config_from_values({}))


def tiny(tmp_path, name: str, **overrides):
    """K = 100 clients, 3 a round, shards cut to 96 samples: a few seconds a round."""
    return run_config_from_values({
        "num-clients": 100, "clients-per-round": 3, "num-rounds": 2, "local-epochs": 1, "batch-size": 32,
        "max-shard-size": 96, "test-subset": 100, "checkpoint-every": 1, "mask-mode": "independent",
        "device": "cpu", "threads": 1, "data-dir": str(SHARED_DATA), "output-dir": str(tmp_path),
        "run-name": name, **overrides,
    })


@pytest.mark.slow
def test_client_processes_write_the_one_thread_runs_rounds_and_theta(tmp_path):
    """Two workers of one thread each against one process of one thread: every column but the
    seconds (the server's curvature measurements of round 2 included) and θ after the last round
    are equal bit for bit, with a client whose update is NaN (left out by the server) and one that
    raises (left out by the engine)."""
    nan_client = sample_cohort(0, 1, list(range(100)), 3)[1]
    raising_client = sample_cohort(0, 2, list(range(100)), 3)[0]
    faults = f"nan:{nan_client}:1,raise:{raising_client}:2"
    before = our_segments()
    runs = {}
    for processes in (1, 2):
        cfg = tiny(tmp_path, f"p{processes}", **{"client-processes": processes, "inject-fault": faults,
                                                  "curvature-every": 2, "probe-size": 16, "curvature-probes": 2,
                                                  "penalty-draws": 2})
        params = run_local(cfg, echo=lambda _: None)
        runs[processes] = (pd.read_csv(cfg.run_dir / "rounds.csv"), params)
    (one, theta_one), (two, theta_two) = runs[1], runs[2]
    assert one["num_failures"].tolist() == [1, 1] and one["num_clients"].tolist() == [2, 2]
    measured = [c for c in one.columns if c.startswith("penalty_") and one[c].notna().any()]
    assert measured, "the server's measurements of round 2 read the updates in shared memory"
    timings = [c for c in one.columns if c.endswith("seconds")]
    pd.testing.assert_frame_equal(one.drop(columns=timings), two.drop(columns=timings))
    for a, b in zip(theta_one, theta_two, strict=True):
        np.testing.assert_array_equal(a, b)
    assert our_segments() <= before  # the pool unlinked its shared memory


@pytest.mark.slow
def test_a_run_in_client_processes_stops_cleanly_and_resumes_to_the_same_rows(tmp_path):
    """Interrupted in round 3 (after round 2's checkpoint), the pool's workers and shared memory
    go; the resumed run's rows equal an uninterrupted one-process run's."""
    reference = tiny(tmp_path, "reference", **{"num-rounds": 3})
    run_local(reference, echo=lambda _: None)
    cfg = tiny(tmp_path, "resumed", **{"num-rounds": 3, "client-processes": 2})
    before = our_segments()
    with contextlib.ExitStack() as stack:
        train_round = local_train_round(cfg, in_client_processes(cfg, stack))

        def crash_in_round_3(server_round, *args):
            if server_round == 3:
                raise KeyboardInterrupt
            return train_round(server_round, *args)

        with pytest.raises(KeyboardInterrupt):
            run_rounds(cfg, "local", crash_in_round_3, echo=lambda _: None)
    assert our_segments() <= before
    run_local(tiny(tmp_path, "resumed", **{"num-rounds": 3, "client-processes": 2, "resume": True}),
              echo=lambda _: None)
    want = pd.read_csv(reference.run_dir / "rounds.csv").drop(columns=["seconds"])
    got = pd.read_csv(cfg.run_dir / "rounds.csv").drop(columns=["seconds"])
    pd.testing.assert_frame_equal(want, got)


@pytest.mark.slow
def test_a_worker_that_dies_is_named_and_the_pool_cleans_up(tmp_path):
    cfg = tiny(tmp_path, "dies", **{"client-processes": 2})
    params = [p.numpy() for p in initial_parameters(cfg.model, cfg.seed)]
    before = our_segments()
    with ClientPool(cfg, params, 2) as pool:
        replies, failures = pool.train([3, 4, 5], 1, params, None, 0.5)
        assert [r.partition_id for r in replies] == [3, 4, 5] and failures == []
        victim = pool._workers[0]  # a process this test's pool started
        victim.kill()
        victim.join(5)
        with pytest.raises(ClientPoolError, match=rf"client process {victim.pid} exited with code -9 in round 2"):
            pool.train([3, 4, 5], 2, params, None, 0.5)
    assert our_segments() <= before


@pytest.mark.slow
def test_ctrl_c_stops_fedmask_local_with_a_message_and_no_leftovers(tmp_path):
    """SIGINT to the whole process group (as a terminal's Ctrl-C): the engine and its workers stop,
    the rounds so far stay, the shared memory goes, and the message says how to resume."""
    before = our_segments()
    command = [sys.executable, "-m", "fedmask_app.cli.local", "num-rounds=50", "clients-per-round=3",
               "max-shard-size=64", "test-subset=100", "client-processes=2", "threads=1",
               f'data-dir="{SHARED_DATA}"', f'output-dir="{tmp_path}"', 'run-name="interrupted"']
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in process.stdout:
            if line.startswith("[fedmask] round 2/50"):
                break
        os.killpg(process.pid, signal.SIGINT)
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)  # the group this test started
    assert process.returncode == 130, output
    assert "fedmask-local: interrupted; the finished rounds are in" in output and "resume=true" in output
    assert "Traceback" not in output
    rounds = pd.read_csv(tmp_path / "interrupted" / "rounds.csv")
    assert rounds["round"].tolist()[:2] == [1, 2]
    assert our_segments() <= before
