"""fedmask-sweep: one run after another, failures reported, complete runs skipped, resume after a kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest
from flwr_runner import PROJECT, SHARED_DATA, superlink_tokens

from fedmask_app.cli import sweep
from fedmask_app.run.provenance import checkout_commit
from strategies.cohort import sample_cohort

pytestmark = pytest.mark.slow

BASE = """
[base]
num-clients = 100
clients-per-round = 2
max-shard-size = 64
num-rounds = {rounds}
local-epochs = 1
test-subset = 100
checkpoint-every = 1
threads = 1
min-clients = 2
"""


def write_grid(path, rounds: int, axes: str):
    path.write_text(BASE.format(rounds=rounds) + "\n[axes]\n" + axes)
    return path


def data_dir() -> str:
    return f'data-dir="{SHARED_DATA}"'


def test_failed_run_is_reported_and_the_rest_goes_on_then_complete_runs_are_skipped(tmp_path, capsys):
    pid = sample_cohort(1, 1, range(100), 2)[0]
    grid = write_grid(tmp_path / "grid.toml", 2, f'seed = [1]\ninject-fault = ["", "raise:{pid}:1"]\n')
    out = tmp_path / "out"
    args = [str(grid), "--engine", "local", "--output-dir", str(out), data_dir()]
    assert sweep.main(args) == 1
    printed = capsys.readouterr()
    good = out / "seed=1_inject-fault=" / "rounds.csv"
    assert pd.read_csv(good)["round"].tolist() == [1, 2]
    assert f"seed=1_inject-fault=raise-{pid}-1 FAILED" in printed.out + printed.err
    assert "seed=1_inject-fault= complete" in printed.out + printed.err
    assert "1 runs completed, 1 failed" in printed.out

    assert sweep.main([*args, "--dry-run"]) == 0
    listing = capsys.readouterr().out
    assert "2 runs, 1 complete, 1 to run" in listing
    assert "seed=1_inject-fault=: complete" in listing

    before = good.read_text()
    assert sweep.main([*args, "lr=0.5"]) == 2  # the same folders, another configuration: refused
    refused = capsys.readouterr()
    assert "holds 2 of this grid's run folders with runs of another configuration; nothing was run" in refused.err
    assert "seed=1_inject-fault=: lr: 0.01 -> 0.5" in refused.err
    assert good.read_text() == before and "[sweep]" not in refused.out


def test_a_killed_sweep_resumes_where_it_stopped(tmp_path):
    grid = write_grid(tmp_path / "grid.toml", 4, "seed = [3]\n")
    out = tmp_path / "out"
    command = [sys.executable, "-m", "fedmask_app.cli.sweep", str(grid), "--engine", "local",
               "--output-dir", str(out), data_dir()]
    rounds = out / "seed=3" / "rounds.csv"
    proc = subprocess.Popen(command, cwd=PROJECT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (rounds.exists() and len(rounds.read_text().splitlines()) >= 3):
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert 2 <= len(pd.read_csv(rounds)) < 4, "the sweep was not interrupted mid-way"

    assert subprocess.run(command, cwd=PROJECT, capture_output=True, timeout=600).returncode == 0
    resumed = pd.read_csv(rounds)
    assert resumed["round"].tolist() == [1, 2, 3, 4]

    reference = tmp_path / "reference"
    assert sweep.main([str(grid), "--engine", "local", "--output-dir", str(reference), data_dir()]) == 0
    uninterrupted = pd.read_csv(reference / "seed=3" / "rounds.csv")
    pd.testing.assert_frame_equal(resumed.drop(columns="seconds"), uninterrupted.drop(columns="seconds"))


def test_a_grid_given_more_rounds_extends_its_complete_runs(tmp_path, capsys):
    """Run 2 rounds, then the same grid with num-rounds=4: the run goes on from its round-2
    checkpoint and its rounds are those of a 4-round run from scratch."""
    grid = write_grid(tmp_path / "grid.toml", 2, "seed = [5]\n")
    out, reference = tmp_path / "out", tmp_path / "reference"
    assert sweep.main([str(grid), "--engine", "local", "--output-dir", str(out), data_dir()]) == 0
    capsys.readouterr()
    assert sweep.main([str(grid), "--engine", "local", "--output-dir", str(out), data_dir(), "num-rounds=4",
                       "--dry-run"]) == 0
    assert "seed=5: to run (2 of 4 rounds written)" in capsys.readouterr().out
    assert sweep.main([str(grid), "--engine", "local", "--output-dir", str(out), data_dir(), "num-rounds=4"]) == 0
    assert "1 runs, 0 complete, 1 to run" in capsys.readouterr().out
    extended = pd.read_csv(out / "seed=5" / "rounds.csv")
    assert extended["round"].tolist() == [1, 2, 3, 4]
    assert json.loads((out / "seed=5" / "config.json").read_text())["extended_from_rounds"] == [2]

    assert sweep.main([str(grid), "--engine", "local", "--output-dir", str(reference), data_dir(), "num-rounds=4"]) == 0
    from_scratch = pd.read_csv(reference / "seed=5" / "rounds.csv")
    pd.testing.assert_frame_equal(extended.drop(columns="seconds"), from_scratch.drop(columns="seconds"))


def test_flower_engine_runs_a_grid_through_flwr(tmp_path):
    """Each run starts a SuperLink of its own and stops it: the sweep leaves no processes behind."""
    grid = write_grid(tmp_path / "grid.toml", 2, "seed = [0]\n")
    before = superlink_tokens()
    assert sweep.main([str(grid), "--output-dir", str(tmp_path / "out"), data_dir()]) == 0
    assert superlink_tokens() <= before
    rows = pd.read_csv(tmp_path / "out" / "seed=0" / "rounds.csv")
    assert rows["round"].tolist() == [1, 2]
    assert (rows["num_clients"] == 2).all()
    # Flower ran an installed copy without .git: the commit came from the checkout through fedmask-sweep
    commit = json.loads((tmp_path / "out" / "seed=0" / "config.json").read_text())["git_commit"]
    assert checkout_commit() is not None and commit == checkout_commit()
    # what the Flower run recorded is the configuration the sweep asked for: complete, not foreign
    assert sweep.main([str(grid), "--output-dir", str(tmp_path / "out"), data_dir(), "--dry-run"]) == 0


def test_the_default_output_folder_names_the_grid_files_folder():
    assert sweep.default_output_dir(PROJECT / "conf" / "paper" / "grid1.toml") == "results/paper/grid1"
    assert sweep.default_output_dir(PROJECT / "conf" / "mini" / "grid1.toml") == "results/mini/grid1"


def test_a_run_folder_with_an_unreadable_config_json_stops_the_sweep_by_name(tmp_path, capsys):
    grid = write_grid(tmp_path / "grid.toml", 2, "seed = [5]\n")
    broken = tmp_path / "out" / "seed=5" / "config.json"
    broken.parent.mkdir(parents=True)
    broken.write_text("{not json")
    assert sweep.main([str(grid), "--engine", "local", "--output-dir", str(tmp_path / "out"), data_dir()]) == 2
    assert f"{broken} is not a readable config.json" in capsys.readouterr().err
    assert broken.read_text() == "{not json"
