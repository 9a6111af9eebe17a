"""One `flwr run . --stream` on a local SuperLink of its own, stopped when the run ends.

`flwr run .` reuses whatever local SuperLink listens on its ports (39091/39093 unless
``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT``/``FLWR_LOCAL_CONTROL_API_PORT`` say otherwise), whatever
``FLWR_HOME`` says, and leaves the one it started running. So every run here gets two free ports
and a ``FLWR_HOME`` of its own; every process it starts (the SuperLink, the simulation, Ray)
inherits a marker in its environment, which is how exactly those, and nothing else on the
machine, are stopped afterwards.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import psutil

from fedmask_app.run.config import PROJECT_ROOT, RunConfig, toml_value
from fedmask_app.run.provenance import COMMIT_ENV, checkout_commit

MARKER = "FEDMASK_SUPERLINK_TOKEN"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def marked_processes() -> list[tuple[psutil.Process, str]]:
    """Every other live process started under some ``PrivateSuperLink``, with its marker."""
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            token = proc.environ().get(MARKER)
        except (psutil.Error, OSError):  # gone, or another user's
            continue
        if token:
            found.append((proc, token))
    return found


def flwr_executable() -> str:
    """``flwr`` beside the running interpreter (a venv used by its full path, not activated),
    else on PATH; a clear error when neither has it."""
    beside = Path(sys.executable).with_name("flwr")
    if beside.is_file():
        return str(beside)
    found = shutil.which("flwr")
    if found is None:
        raise FileNotFoundError(
            f"the `flwr` command is neither beside {sys.executable} nor on PATH: install fedmask with "
            "`pip install -e .` in this environment (it brings flwr[simulation])"
        )
    return found


class PrivateSuperLink:
    """A context: the environment for `flwr run` that makes it start a SuperLink of its own; on
    exit every process carrying this context's marker is stopped and its FLWR_HOME removed."""

    def __init__(self, flwr_home: Path | None = None, extra_env: dict[str, str] | None = None):
        self._own_home = flwr_home is None
        self.flwr_home = Path(tempfile.mkdtemp(prefix="fedmask-flwr-")) if flwr_home is None else flwr_home
        self.flwr_home.mkdir(parents=True, exist_ok=True)
        self.token = secrets.token_hex(8)
        bin_dir = str(Path(sys.executable).parent)  # flwr starts `flower-superlink` by name
        self.env = {
            **os.environ,
            **(extra_env or {}),
            "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
            "FLWR_HOME": str(self.flwr_home),
            "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
            "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",  # the app runs in this environment
            "PYTHONUNBUFFERED": "1",
            MARKER: self.token,
        }

    def __enter__(self) -> PrivateSuperLink:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        if self._own_home:
            shutil.rmtree(self.flwr_home, ignore_errors=True)

    def processes(self) -> list[psutil.Process]:
        """Every live process started under this context (found by the marker in its environment)."""
        return [proc for proc, token in marked_processes() if token == self.token]

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM this context's processes, then SIGKILL what is left after ``grace`` seconds."""
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            procs = self.processes()
            if not procs:
                return
            for proc in procs:
                try:
                    proc.send_signal(sig)
                except psutil.Error:
                    pass
            psutil.wait_procs(procs, timeout=wait)

    def flwr_run(self, config_file: Path, federation: str) -> list[str]:
        return [flwr_executable(), "run", str(PROJECT_ROOT), "--stream", "--run-config", str(config_file),
                "--federation-config", federation]


def default_gpu_fraction() -> float:
    import torch

    return 0.25 if torch.cuda.is_available() else 0.0


def run_with_flower(
    cfg: RunConfig, num_cpus: int = 1, num_gpus: float | None = None, on_line: Callable[[str], None] = print,
    ray_address: str | None = None,
) -> int:
    """One run through `flwr run <project> --stream` on a SuperLink of its own; returns flwr's exit
    code (0 even when the ServerApp failed: check the run's rounds.csv).

    ``ray_address``: the simulation joins that Ray cluster instead of starting its own. Flower
    1.42's simulation calls ``ray.init()`` without an address (its init-args have none), and
    ``ray.init`` then reads ``RAY_ADDRESS``, which the SuperLink and its simulation process inherit."""
    values = cfg.to_mapping()
    values["output-dir"] = str(cfg.run_dir.parent)
    if cfg.data_dir:
        values["data-dir"] = str(Path(cfg.data_dir).expanduser().resolve())
    gpus = default_gpu_fraction() if num_gpus is None else num_gpus
    federation = (
        f"num-supernodes={cfg.num_clients} client-resources-num-cpus={num_cpus} client-resources-num-gpus={gpus}"
    )
    extra_env = {COMMIT_ENV: checkout_commit() or "", **({"RAY_ADDRESS": ray_address} if ray_address else {})}
    with PrivateSuperLink(extra_env=extra_env) as superlink:
        config_file = superlink.flwr_home / "run-config.toml"
        config_file.write_text("".join(f"{key} = {toml_value(value)}\n" for key, value in values.items()))
        command = superlink.flwr_run(config_file, federation)
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=superlink.env) as proc:
            for line in proc.stdout:
                on_line(line.rstrip("\n"))
            return proc.wait()
