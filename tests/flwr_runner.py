"""Run the app through the real `flwr run . --stream` (local SuperLink, Ray simulation) in tests, on
a SuperLink of the test's own (``PrivateSuperLink``: free ports, this FLWR_HOME), and stop exactly
the processes those runs started."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import psutil

from fedmask_app.engines.flower.superlink import PrivateSuperLink, marked_processes
from fedmask_app.run.config import toml_value

PROJECT = Path(__file__).resolve().parents[1]
SHARED_DATA = PROJECT.parent / "shared" / "data"


def write_run_config(path: Path, values: dict) -> Path:
    path.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in values.items()))
    return path


class FlowerRunner(PrivateSuperLink):
    def command(self, config_file: Path, num_supernodes: int, num_cpus: int = 1) -> list[str]:
        return self.flwr_run(config_file, f"num-supernodes={num_supernodes} client-resources-num-cpus={num_cpus}")

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

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes()]

    def kill_all(self, wait: float = 15.0) -> None:
        """SIGKILL everything this runner started, and wait until it is gone."""
        procs = self.processes()
        for proc in procs:
            try:
                proc.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=wait)


def superlink_tokens() -> set[str]:
    """The markers of every live process started under some PrivateSuperLink (fedmask-run's or a test's)."""
    return {token for _, token in marked_processes()}
