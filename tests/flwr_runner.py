"""Run the app through the real `flwr run . --stream` (local SuperLink, Ray simulation) in tests,
and stop every process that run started: they all carry this session's FLWR_HOME in their
environment, which is how they are found."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from fedmask_app.run.config import toml_value

PROJECT = Path(__file__).resolve().parents[1]
SHARED_DATA = PROJECT.parent / "shared" / "data"


def write_run_config(path: Path, values: dict) -> Path:
    path.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in values.items()))
    return path


class FlowerRunner:
    def __init__(self, flwr_home: Path):
        self.flwr_home = flwr_home
        flwr_home.mkdir(parents=True, exist_ok=True)
        self.env = {
            **os.environ,
            "FLWR_HOME": str(flwr_home),
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "PYTHONUNBUFFERED": "1",
        }
        self.stop_foreign_local_superlink()

    def stop_foreign_local_superlink(self) -> None:
        """`flwr run .` reuses any local SuperLink on its fixed port, whatever FLWR_HOME says (one
        left by an earlier fedmask-run, say); its processes would escape ``kill_all``. Stop it and
        its descendants: the next `flwr run` starts a fresh one."""
        mine = set(self.processes())
        children: dict[int, list[int]] = {}
        superlinks = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
            if any(part.endswith(b"flower-superlink") for part in cmdline) and b"--simulation" in cmdline:
                superlinks.append(int(entry.name))
        for root in (pid for pid in superlinks if pid not in mine):
            tree, todo = [], [root]
            while todo:
                pid = todo.pop()
                tree.append(pid)
                todo.extend(children.get(pid, []))
            for pid in reversed(tree):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        time.sleep(1.0 if superlinks else 0.0)

    def command(self, config_file: Path, num_supernodes: int, num_cpus: int = 1) -> list[str]:
        federation = f"num-supernodes={num_supernodes} client-resources-num-cpus={num_cpus}"
        return ["flwr", "run", str(PROJECT), "--stream", "--run-config", str(config_file),
                "--federation-config", federation]

    def run(self, config_file: Path, num_supernodes: int, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.command(config_file, num_supernodes), env=self.env, cwd=PROJECT,
            capture_output=True, text=True, timeout=timeout,
        )

    def start(self, config_file: Path, num_supernodes: int, log: Path) -> subprocess.Popen:
        return subprocess.Popen(
            self.command(config_file, num_supernodes), env=self.env, cwd=PROJECT,
            stdout=log.open("w"), stderr=subprocess.STDOUT,
        )

    def processes(self) -> list[int]:
        """Pids of every process whose environment holds this FLWR_HOME (SuperLink, ServerApp, Ray)."""
        marker = f"FLWR_HOME={self.flwr_home}".encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if marker in environ.split(b"\0"):
                pids.append(int(entry.name))
        return pids

    def kill_all(self, sig: int = signal.SIGKILL, wait: float = 15.0) -> None:
        """Kill everything this FLWR_HOME started, and wait until it is gone."""
        deadline = time.monotonic() + wait
        while (pids := self.processes()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            time.sleep(0.5)
