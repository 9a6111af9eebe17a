"""fedmask-run: `flwr run . --stream` with the run config validated first.

It validates the merged configuration before Flower or Ray start, sizes the simulated federation
to ``num-clients`` SuperNodes, makes relative ``output-dir``/``data-dir`` absolute against the
current folder (the ServerApp runs in the SuperLink's folder, not yours), and turns off the
SuperLink's per-run dependency install (the app runs in the environment you installed it in).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from fedmask_app.cli.common import add_run_config_arguments, run_config_from_args
from fedmask_app.run.config import PROJECT_ROOT, RunConfig, toml_value


def default_gpu_fraction() -> float:
    import torch

    return 0.25 if torch.cuda.is_available() else 0.0


def run_with_flower(
    cfg: RunConfig, num_cpus: int = 1, num_gpus: float | None = None, on_line: Callable[[str], None] = print
) -> int:
    """One run through `flwr run <project> --stream`; returns flwr's exit code (0 even when the
    ServerApp failed: check the run's rounds.csv)."""
    values = cfg.to_mapping()
    values["output-dir"] = str(cfg.run_dir.parent)
    if cfg.data_dir:
        values["data-dir"] = str(Path(cfg.data_dir).expanduser().resolve())
    gpus = default_gpu_fraction() if num_gpus is None else num_gpus
    federation = (
        f"num-supernodes={cfg.num_clients} client-resources-num-cpus={num_cpus} client-resources-num-gpus={gpus}"
    )
    with tempfile.NamedTemporaryFile("w", suffix=".toml", prefix="fedmask-run-", delete=False) as f:
        f.write("".join(f"{key} = {toml_value(value)}\n" for key, value in values.items()))
        config_file = f.name
    command = ["flwr", "run", str(PROJECT_ROOT), "--stream", "--run-config", config_file,
               "--federation-config", federation]
    env = {**os.environ, "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "PYTHONUNBUFFERED": "1"}
    try:
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
            for line in proc.stdout:
                on_line(line.rstrip("\n"))
            return proc.wait()
    finally:
        Path(config_file).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fedmask-run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_config_arguments(parser)
    parser.add_argument("--num-cpus", type=int, default=1, help="CPUs per virtual client (default 1)")
    parser.add_argument("--num-gpus", type=float, default=None,
                        help="GPU fraction per virtual client (default 0.25 with CUDA, else 0)")
    args = parser.parse_intermixed_args(argv)
    cfg = run_config_from_args("fedmask-run", args)
    if cfg is None:
        return 2
    code = run_with_flower(cfg, args.num_cpus, args.num_gpus)
    from fedmask_app.run.results import is_complete

    if code != 0 or not is_complete(cfg.run_dir, cfg.num_rounds):
        print(f"fedmask-run: the run did not complete (flwr exit code {code}); see the log above", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
