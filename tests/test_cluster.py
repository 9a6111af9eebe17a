"""fedmask-sweep --ray-address: a grid's runs as Ray tasks over the nodes of a (private, loopback)
two-node Ray cluster; same rows as one machine; a run on a lost node retried and resumed."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest
from flwr_runner import PROJECT, SHARED_DATA

from fedmask_app.cli import sweep

BASE = """
[base]
model = "linear-softmax"
num-clients = 6
clients-per-round = 2
max-shard-size = 16
num-rounds = {rounds}
local-epochs = {epochs}
batch-size = {batch}
eval-every = 0
threads = 1
min-clients = 2
checkpoint-every = {every}

[axes]
seed = [0, 1]
"""
RUNS = ("seed=0", "seed=1")
# Notice a lost node within a second or two (Ray's defaults take tens of seconds).
FAST_HEALTH_CHECKS = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                      "health_check_failure_threshold": 2}
ON_NODE = re.compile(r"\[sweep\] (\S+) complete in \d+s on node ([0-9a-f]+)")


def write_grid(path: Path, rounds: int, every: int = 1, epochs: int = 1, batch: int = 32) -> Path:
    path.write_text(BASE.format(rounds=rounds, every=every, epochs=epochs, batch=batch))
    return path


def data_dir() -> str:
    return f'data-dir="{SHARED_DATA}"'


def rounds_of(out: Path, run: str) -> pd.DataFrame:
    return pd.read_csv(out / run / "rounds.csv")


# ---------------------------------------------------------------- fast


def test_help_lists_the_ray_options_and_the_cli_does_not_import_ray():
    help_text = sweep.build_parser().format_help()
    for option in ("--ray-address", "--run-cpus", "--run-gpus", "--run-resources", "--shared-output",
                   "--no-shared-output", "--max-retries", "second Ray"):
        assert option in help_text
    code = ("import sys, fedmask_app.cli.sweep as s; s.build_parser().parse_args(['g.toml', '--ray-address', 'local']);"
            "sys.exit('ray' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=PROJECT, timeout=120).returncode == 0


def test_ray_options_are_checked(tmp_path, capsys):
    parser = sweep.build_parser()
    assert parser.parse_args(["g.toml", "--run-resources", '{"node_a": 1}']).run_resources == {"node_a": 1.0}
    with pytest.raises(SystemExit):
        parser.parse_args(["g.toml", "--run-resources", '["node_a"]'])
    grid = write_grid(tmp_path / "grid.toml", 2)
    assert sweep.main([str(grid), "--engine", "flower", "--ray-address", "local"]) == 2
    assert "second Ray" in capsys.readouterr().err


# ---------------------------------------------------------------- on a two-node cluster


@pytest.fixture
def two_nodes():
    """A head node (1 CPU) and a second node (1 CPU) on loopback; this process connected to them."""
    import ray

    from fedmask_app.sweep import cluster

    with cluster.private_cluster(num_cpus=1, resources={"head_node": 1}, _system_config=FAST_HEALTH_CHECKS) as c:
        second = c.add_node(**cluster.node_args(1, resources={"second_node": 1}))
        ray.init(address=c.address, log_to_driver=False)
        yield c, second


@pytest.mark.slow
def test_runs_spread_over_the_nodes_and_write_what_one_machine_writes(tmp_path, two_nodes, capsys):
    """No shared output: each task sends its run folder back; the rows equal a local run's."""
    c, second = two_nodes
    grid = write_grid(tmp_path / "grid.toml", rounds=3)
    out, reference = tmp_path / "out", tmp_path / "reference"
    args = [str(grid), "--output-dir", str(out), data_dir(), "--ray-address", c.address, "--no-shared-output",
            "--verbose"]
    assert sweep.main(args) == 0
    nodes = dict(ON_NODE.findall(capsys.readouterr().out))
    assert set(nodes) == set(RUNS)
    assert set(nodes.values()) == {c.head_node.node_id, second.node_id}, "both runs ran on one node"

    assert sweep.main([str(grid), "--engine", "local", "--output-dir", str(reference), data_dir()]) == 0
    for run in RUNS:
        assert {p.name for p in (out / run).iterdir()} == {"rounds.csv", "config.json", "checkpoint.pt", "shards.csv"}
        assert f'"output-dir": "{out}"' in (out / run / "config.json").read_text()
        pd.testing.assert_frame_equal(rounds_of(out, run).drop(columns="seconds"),
                                      rounds_of(reference, run).drop(columns="seconds"))
    assert "2 complete, 0 to run" in _dry_run(args, capsys)


@pytest.mark.slow
def test_groups_of_runs_trained_together_are_tasks_spread_over_the_nodes(tmp_path, two_nodes, capsys):
    """--group-runs 3 with --ray-address, four runs: each group is one task (its runs on one node,
    the two groups on different nodes), the group of one trained as a group too (engine
    local-grouped, as on one machine), and every run's rows equal those of the same groups trained
    together on one machine."""
    c, second = two_nodes
    grid = write_grid(tmp_path / "grid.toml", rounds=3).read_text().replace("seed = [0, 1]", "seed = [0, 1, 2, 3]")
    (tmp_path / "grid.toml").write_text(grid)
    out, reference = tmp_path / "out", tmp_path / "reference"
    common = [str(tmp_path / "grid.toml"), data_dir(), "vectorize=true", "--group-runs", "3"]
    args = [*common, "--output-dir", str(out), "--ray-address", c.address, "--no-shared-output", "--verbose"]
    assert sweep.main(args) == 0
    printed = capsys.readouterr().out
    assert "2 group(s) of up to 3 runs trained together" in printed
    nodes = dict(ON_NODE.findall(printed))
    assert nodes["seed=0"] == nodes["seed=1"] == nodes["seed=2"] != nodes["seed=3"], nodes
    assert {nodes["seed=0"], nodes["seed=3"]} == {c.head_node.node_id, second.node_id}

    assert sweep.main([*common, "--engine", "local", "--output-dir", str(reference)]) == 0
    for run in (f"seed={seed}" for seed in range(4)):
        assert '"engine": "local-grouped"' in (out / run / "config.json").read_text()
        pd.testing.assert_frame_equal(rounds_of(out, run).drop(columns="seconds"),
                                      rounds_of(reference, run).drop(columns="seconds"))


def _dry_run(args: list[str], capsys) -> str:
    capsys.readouterr()
    assert sweep.main([*args, "--dry-run"]) == 0
    return capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("grouped", [False, True], ids=["one-run-a-task", "a-group-a-task"])
def test_a_run_on_a_lost_node_is_retried_and_resumes_from_its_checkpoint(tmp_path, two_nodes, capsys, grouped):
    """Shared output: the second node dies mid-run; Ray retries its task on the head, which resumes
    from the checkpoint (rounds past it are dropped), and every round is written once. Grouped
    (--group-runs 2, four runs): the lost task's two runs are retried together, each resumed."""
    c, second = two_nodes
    rounds = 60
    grid = write_grid(tmp_path / "grid.toml", rounds=rounds, every=5, epochs=2, batch=4)
    names = RUNS
    grouping: list[str] = []
    if grouped:
        grid.write_text(grid.read_text().replace("seed = [0, 1]", "seed = [0, 1, 2, 3]"))
        names, grouping = tuple(f"seed={seed}" for seed in range(4)), ["vectorize=true", "--group-runs", "2"]
    out = tmp_path / "out"
    args = [str(grid), "--output-dir", str(out), data_dir(), *grouping, "--ray-address", c.address, "--verbose"]
    result: list[int] = []
    sweeping = threading.Thread(target=lambda: result.append(sweep.main(args)), daemon=True)
    sweeping.start()

    worker, lost = _task_on(second, timeout=120)
    assert len(lost) == (2 if grouped else 1)
    rows = _wait_for_rows(out / lost[0] / "rounds.csv", 12, timeout=120)
    worker.suspend()  # stop it mid-run, then lose its node
    stopped_at = {run: len(pd.read_csv(out / run / "rounds.csv")) for run in lost}
    c.remove_node(second, allow_graceful=False)
    worker.kill()  # a stopped worker does not notice its raylet is gone
    worker.wait(30)
    assert rows <= stopped_at[lost[0]] and max(stopped_at.values()) < rounds, "the run was not stopped mid-way"

    # Generous: on a loaded 2-core machine the retried runs take minutes, and a sweep thread left
    # running would still hold the cluster when the next test starts its own.
    sweeping.join(timeout=900)
    assert not sweeping.is_alive(), "the sweep did not finish within 900 s of the node's loss"
    assert result == [0]
    printed = capsys.readouterr().out
    for name in names:
        assert rounds_of(out, name)["round"].tolist() == list(range(1, rounds + 1))
    for run in lost:
        resumed = re.search(rf"\[sweep\] {re.escape(run)} complete in \d+s on node (\w+) \(pid \d+\), "
                            r"resumed after round (\d+)", printed)
        assert resumed, printed
        assert resumed.group(1) == c.head_node.node_id
        assert 5 <= int(resumed.group(2)) <= stopped_at[run] and int(resumed.group(2)) % 5 == 0

    reference = tmp_path / "reference"
    assert sweep.main([str(grid), "--engine", "local", "--output-dir", str(reference), data_dir(), *grouping]) == 0
    for run in lost:
        pd.testing.assert_frame_equal(rounds_of(out, run).drop(columns="seconds"),
                                      rounds_of(reference, run).drop(columns="seconds"))


def _task_on(node, timeout: float) -> tuple[psutil.Process, list[str]]:
    """The worker process of ``node`` that runs a sweep task, and the task's runs (from its process
    title, ``ray::fedmask-run:<run>`` or ``ray::fedmask-runs:<run>+<run>...``)."""
    raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in raylet.children():
            try:
                title = " ".join(child.cmdline())
            except psutil.Error:
                continue
            if match := re.match(r"ray::fedmask-runs?:(\S+)", title):
                return child, match.group(1).split("+")
        time.sleep(0.05)
    raise AssertionError(f"no sweep task started on the second node within {timeout}s")


def _wait_for_rows(path: Path, rows: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and (count := len(path.read_text().splitlines()) - 1) >= rows:
            return count
        time.sleep(0.005)
    raise AssertionError(f"{path} did not reach {rows} rows within {timeout}s")
