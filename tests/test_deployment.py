"""Real deployment on loopback: a TLS SuperLink with SuperNode authentication, SuperNodes that each
train on their own shard file, and `flwr run` against them -- all started through deploy/*.sh.

Every process the deploy scripts start carries this test's FEDMASK_DEPLOY_DIR in its environment
(Flower's own children inherit it), which is how the teardown finds and checks them.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from flwr_runner import SHARED_DATA, write_run_config

from fedmask_app.cli import export_shards
from fedmask_app.deploy.shards import check_shard_matches, load_shard_file
from fedmask_app.run.client_task import client_shards
from fedmask_app.run.config import load_run_config
from fedmask_app.run.data import CONTENT_SHA256, FILE_NAME, load_dataset
from fedmask_app.run.results import COLUMNS

PROJECT = Path(__file__).resolve().parents[1]
DEPLOY = PROJECT / "deploy"
FEDERATION = "fedmask-test"
# Uncapped, the shards of a 2-client run hold 25000 images each: two rounds of ResNet-18 on them
# take minutes on a 2-core CPU. The test run caps them with max-shard-size.
SHARD_IMAGES = 256

needs_data = pytest.mark.skipif(not (SHARED_DATA / FILE_NAME).is_file(), reason=f"no {SHARED_DATA / FILE_NAME}")


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# --- fedmask-export-shards -------------------------------------------------------------------


@needs_data
def test_export_shards_are_the_simulation_shards(tmp_path):
    overrides = ["num-clients=3", "clients-per-round=3", "alpha=0.5", "seed=7", f"data-dir='{SHARED_DATA}'"]
    check_export(tmp_path / "full", overrides, max_shard_size=0)
    check_export(tmp_path / "capped", [*overrides, "max-shard-size=1000"], max_shard_size=1000)


def check_export(out: Path, overrides: list[str], max_shard_size: int) -> None:
    out.mkdir()
    (out / "shard-9.npz").write_bytes(b"stale")  # from an export with more clients: removed
    assert export_shards.main([str(out), *overrides]) == 0

    cfg = load_run_config(overrides)
    data = load_dataset(SHARED_DATA.resolve())
    expected = client_shards(cfg, data.y_train)
    manifest = json.loads((out / "shards.json").read_text())
    assert manifest["config"] == {
        "dataset": "cifar10", "seed": 7, "num-clients": 3, "alpha": 0.5, "min-partition-size": 10,
        "max-shard-size": max_shard_size, "identical-shards": False,
    }
    assert manifest["data-sha256"] == CONTENT_SHA256
    assert [p["partition-id"] for p in manifest["partitions"]] == [0, 1, 2]
    assert sorted(p.name for p in out.iterdir()) == ["shard-0.npz", "shard-1.npz", "shard-2.npz", "shards.json"]
    for pid, indices in enumerate(expected):
        shard = load_shard_file(out / f"shard-{pid}.npz")
        labels = shard.labels
        assert shard.partition_id == pid and shard.config == manifest["config"]
        check_shard_matches(shard, cfg, out)
        np.testing.assert_array_equal(labels, data.y_train[indices])
        np.testing.assert_array_equal(shard.images, data.x_train[indices])
        entry = manifest["partitions"][pid]
        assert entry["size"] == len(indices) and (not max_shard_size or len(indices) == max_shard_size)
        assert entry["indices-sha256"] == hashlib.sha256(indices.astype("<i8").tobytes()).hexdigest()
        assert entry["label-counts"] == np.bincount(labels, minlength=10).tolist()


def test_a_shard_of_another_partition_is_refused(tmp_path):
    overrides = ["num-clients=3", "clients-per-round=2", "max-shard-size=50", f'data-dir="{SHARED_DATA}"']
    assert export_shards.main([str(tmp_path), *overrides]) == 0
    shard = load_shard_file(tmp_path / "shard-1.npz")
    other = load_run_config([*overrides, "seed=1"])
    with pytest.raises(ValueError, match=r"another partition \(seed: shard 0, run 1\)"):
        check_shard_matches(shard, other, tmp_path / "shard-1.npz")


def test_export_shards_config_error_exits_2(tmp_path, capsys):
    assert export_shards.main([str(tmp_path / "out"), "num-clients=0"]) == 2
    assert "num-clients = 0 is not allowed" in capsys.readouterr().err
    assert export_shards.main([str(tmp_path / "out"), "no-such-key=1"]) == 2
    assert "unknown run-config key" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# --- deployment ------------------------------------------------------------------------------


class Deployment:
    """The deploy scripts run with this test's state folder, FLWR_HOME and free ports."""

    def __init__(self, tmp_path: Path):
        self.dir = tmp_path / "deploy"
        self.flwr_home = tmp_path / "flwr-home"
        superlink_port, *self.runtime_ports = free_ports(4)
        self.env = {
            **os.environ,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "FLWR_HOME": str(self.flwr_home),
            "FEDMASK_DEPLOY_DIR": str(self.dir),
            "FEDMASK_SUPERLINK_HOST": "127.0.0.1",
            "FEDMASK_SUPERLINK_PORT": str(superlink_port),
            "FEDMASK_FEDERATION": FEDERATION,
            "FEDMASK_STOP_TIMEOUT": "10",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "PYTHONUNBUFFERED": "1",
        }

    def run(self, *args: str, timeout: float = 120, check: bool = True, env: dict | None = None):
        """Run a command (a deploy script, flwr, ...) in a session of its own and wait for it; then end
        whatever it left in that session (the daemons the scripts start live in sessions of their own).
        Output goes through a file: a leftover child holding a pipe open cannot block the wait."""
        self.dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile("w+", dir=self.dir) as log:
            proc = subprocess.Popen(
                list(args), cwd=PROJECT, env={**self.env, **(env or {})}, text=True,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
            try:
                proc.wait(timeout=timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            log.seek(0)
            out = log.read()
        if timed_out:
            raise AssertionError(f"{' '.join(args)} did not finish in {timeout}s:\n{out}")
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {proc.returncode}:\n{out}")
        return proc.returncode, out

    def script(self, name: str, *args: str, **kwargs):
        return self.run(str(DEPLOY / name), *args, **kwargs)

    def processes(self) -> dict[int, str]:
        """Live processes (not zombies) whose environment holds this FEDMASK_DEPLOY_DIR."""
        marker = f"FEDMASK_DEPLOY_DIR={self.dir}".encode()
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if marker not in (entry / "environ").read_bytes().split(b"\0"):
                    continue
                stat = (entry / "stat").read_text()
                if stat[stat.rindex(")") + 2] == "Z":
                    continue
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
            except (OSError, ValueError):
                continue
        return found

    def logs(self) -> str:
        parts = []
        for log in sorted((self.dir / "logs").glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()
            parts.append(f"--- {log.name} (last 40 lines)\n" + "\n".join(lines[-40:]))
        return "\n".join(parts)


@pytest.fixture
def deployment(tmp_path):
    for tool in ("openssl", "ssh-keygen", "setsid", "pgrep"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not installed")
    dep = Deployment(tmp_path)
    try:
        yield dep
    finally:
        dep.script("stop.sh", timeout=60, check=False)
        deadline = time.monotonic() + 15
        while (left := dep.processes()) and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in left:  # stop.sh missed something: do not leave it behind, but fail
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert not left, f"processes left after deploy/stop.sh: {left}"


@needs_data
@pytest.mark.slow
def test_two_rounds_over_tls_with_supernode_auth(deployment, tmp_path):
    dep = deployment
    started = time.monotonic()
    config = write_run_config(tmp_path / "run.toml", {
        "num-clients": 2, "clients-per-round": 2, "num-rounds": 2, "local-epochs": 1, "batch-size": 128,
        "max-shard-size": SHARD_IMAGES, "test-subset": 200, "threads": 1, "checkpoint-every": 0, "round-timeout": 300.0,
        "data-dir": str(SHARED_DATA), "output-dir": str(tmp_path / "results"), "run-name": "deploy",
    })

    # Shards of the run config, exactly as the simulation cuts them (checked index for index by
    # test_export_shards_are_the_simulation_shards); each SuperNode gets one through data-path.
    exported = tmp_path / "shards"
    cli = shutil.which("fedmask-export-shards", path=dep.env["PATH"])
    command = [cli] if cli else [sys.executable, "-m", "fedmask_app.cli.export_shards"]
    dep.run(*command, str(exported), "--run-config", str(config), timeout=180)
    manifest = json.loads((exported / "shards.json").read_text())
    assert [p["partition-id"] for p in manifest["partitions"]] == [0, 1]
    shard_sizes = [len(load_shard_file(exported / f"shard-{pid}.npz").labels) for pid in (0, 1)]
    assert shard_sizes == [p["size"] for p in manifest["partitions"]] == [SHARD_IMAGES] * 2

    # CA + server certificate, TLS SuperLink with SuperNode auth, the connection in FLWR_HOME.
    dep.script("make-certs.sh", timeout=60)
    dep.script("start-superlink.sh", timeout=90)
    ca = dep.dir / "certs" / "ca.crt"
    port = int(dep.env["FEDMASK_SUPERLINK_PORT"])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:  # TLS, certificate of our CA
        context = ssl.create_default_context(cafile=str(ca))
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            assert tls.version() in ("TLSv1.2", "TLSv1.3")
    flwr_config = (dep.flwr_home / "config.toml").read_text()
    assert f"[superlink.{FEDERATION}]" in flwr_config and str(ca) in flwr_config

    # Two registered SuperNode keys and one that is never registered.
    for name in ("sn0", "sn1"):
        dep.script("add-supernode.sh", name, timeout=60)
    dep.script("add-supernode.sh", "rogue", "--no-register", timeout=60)

    # The unregistered key is refused: flower-supernode logs exit code 305 and exits non-zero.
    code, out = dep.script("start-supernode.sh", "rogue", str(exported / "shard-0.npz"),
                           str(dep.runtime_ports[2]), check=False, timeout=90, env={"FEDMASK_FOREGROUND": "1"})
    assert code != 0 and "Exit Code: 305" in out, out

    for name, pid, port in (("sn0", 0, dep.runtime_ports[0]), ("sn1", 1, dep.runtime_ports[1])):
        dep.script("start-supernode.sh", name, str(exported / f"shard-{pid}.npz"), str(port), timeout=90)

    # Both registered SuperNodes come online (the refused one never does).
    deadline, online = time.monotonic() + 60, 0
    while time.monotonic() < deadline:
        _, out = dep.run("flwr", "supernode", "list", FEDERATION, "--format", "json", timeout=60)
        nodes = json.JSONDecoder().raw_decode(out[out.index("{"):])[0]["nodes"]
        online = sum(node.get("status") == "online" for node in nodes)
        if online == 2:
            break
        time.sleep(1)
    assert online == 2 and len(nodes) == 2, f"{nodes}\n{dep.logs()}"

    code, out = dep.run("flwr", "run", str(PROJECT), FEDERATION, "--stream", "--run-config", str(config),
                        timeout=420, check=False)
    assert code == 0, f"flwr run exited {code}:\n{out}\n{dep.logs()}"

    rounds = tmp_path / "results" / "deploy" / "rounds.csv"
    assert rounds.is_file(), f"{out}\n{dep.logs()}"
    with rounds.open(newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert tuple(reader.fieldnames) == COLUMNS
    assert [int(r["round"]) for r in rows] == [1, 2]
    for row in rows:
        assert int(row["num_clients"]) == 2
        assert int(row["num_failures"]) == 0
        assert row["cohort"] == "0 1"
        assert int(row["num_examples"]) == sum(shard_sizes)
        assert np.isfinite(float(row["train_loss"])) and 0 <= float(row["test_accuracy"]) <= 1
    print(f"deployment test body: {time.monotonic() - started:.1f}s")
