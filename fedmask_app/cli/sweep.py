"""fedmask-sweep GRID: every cell x seed of a grid file, one run after another, resumable."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from fedmask_app.config import PROJECT_ROOT, ConfigError, RunConfig, load_run_config, parse_overrides
from fedmask_app.grid import GridRun, load_grid
from fedmask_app.results import is_complete

ROUND_LINE = re.compile(r"\[fedmask\] round (\d+)/(\d+)")


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def _run_flower(cfg: RunConfig, args: argparse.Namespace, on_round) -> None:
    """One run through `flwr run . --stream` (the local SuperLink, Ray simulation)."""
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        for key, value in cfg.to_mapping().items():
            f.write(f"{key} = {_toml_value(value)}\n")
        config_file = f.name
    federation = (
        f"num-supernodes={cfg.num_clients} client-resources-num-cpus={args.num_cpus} "
        f"client-resources-num-gpus={args.num_gpus}"
    )
    env = {**os.environ, "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
    command = ["flwr", "run", str(PROJECT_ROOT), "--stream", "--run-config", config_file,
               "--federation-config", federation]
    try:
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
            for line in proc.stdout:
                match = ROUND_LINE.search(line)
                if match:
                    on_round(line.strip())
                elif args.verbose:
                    tqdm.write(line.rstrip())
            proc.wait()
    finally:
        Path(config_file).unlink(missing_ok=True)


def _run_local(cfg: RunConfig, args: argparse.Namespace, on_round) -> None:
    from fedmask_app.local_engine import run_local

    run_local(cfg, echo=lambda line: on_round(line) if ROUND_LINE.search(line) else None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fedmask-sweep", description=__doc__)
    parser.add_argument("grid", type=Path, help="grid file (conf/paper/grid1.toml, conf/mini/grid1.toml, ...)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="run-config overrides for every run")
    parser.add_argument("--engine", choices=("flower", "local"), default="flower",
                        help="flower: `flwr run --stream` per run (Ray simulation); local: one process")
    parser.add_argument("--output-dir", default=None, help="default: results/<grid file stem>")
    parser.add_argument("--num-cpus", type=int, default=1, help="flower engine: CPUs per virtual client")
    parser.add_argument("--num-gpus", type=float, default=0.0, help="flower engine: GPU fraction per client")
    parser.add_argument("--dry-run", action="store_true", help="list the runs and their state, run nothing")
    parser.add_argument("--verbose", action="store_true", help="flower engine: show Flower's own log lines")
    args = parser.parse_intermixed_args(argv)

    try:
        runs = load_grid(args.grid)
        output_dir = args.output_dir or str(Path("results") / args.grid.stem)
        common = {**parse_overrides(args.overrides), "output-dir": str(Path(output_dir).resolve()), "resume": True}
        configs = [(run, grid_run_config(run, common)) for run in runs]
    except ConfigError as exc:
        print(f"fedmask-sweep: {exc}", file=sys.stderr)
        return 2

    pending = [(run, cfg) for run, cfg in configs if not is_complete(cfg.run_dir, cfg.num_rounds)]
    print(f"[sweep] {args.grid}: {len(runs)} runs, {len(runs) - len(pending)} complete, "
          f"{len(pending)} to run ({args.engine} engine) -> {output_dir}")
    if args.dry_run:
        for run, cfg in configs:
            state = "complete" if is_complete(cfg.run_dir, cfg.num_rounds) else "to run"
            print(f"  {run.name}: {state}")
        return 0

    failed: list[str] = []
    execute = _run_flower if args.engine == "flower" else _run_local
    with tqdm(total=sum(cfg.num_rounds for _, cfg in pending), unit="round", dynamic_ncols=True) as bar:
        for index, (run, cfg) in enumerate(pending, 1):
            bar.set_description(f"run {index}/{len(pending)} {run.name}")
            done_before = bar.n
            started = time.perf_counter()

            def on_round(line: str) -> None:
                bar.update(1)
                tqdm.write(line)

            try:
                execute(cfg, args, on_round)
            except Exception as exc:  # report it and go on with the next run
                tqdm.write(f"[sweep] {run.name} raised {type(exc).__name__}: {exc}")
            if is_complete(cfg.run_dir, cfg.num_rounds):
                tqdm.write(f"[sweep] {run.name} complete in {time.perf_counter() - started:.0f}s")
            else:
                failed.append(run.name)
                tqdm.write(f"[sweep] {run.name} FAILED: rounds.csv is incomplete; see its output above")
                bar.update(max(0, done_before + cfg.num_rounds - bar.n))  # keep the ETA honest
    print(f"[sweep] done: {len(pending) - len(failed)} runs completed, {len(failed)} failed"
          + (f": {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def grid_run_config(run: GridRun, common: dict) -> RunConfig:
    """pyproject defaults <- grid base and cell <- command-line overrides, validated."""
    pairs = {**run.overrides, **common}
    return load_run_config([f"{k}={_toml_value(v)}" for k, v in pairs.items()])


if __name__ == "__main__":
    sys.exit(main())
