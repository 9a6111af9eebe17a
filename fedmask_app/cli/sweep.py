"""fedmask-sweep GRID: every cell x seed of a grid file, one run after another, resumable."""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from tqdm import tqdm

from fedmask_app.engines.flower.superlink import run_with_flower
from fedmask_app.run.config import ConfigError, RunConfig, parse_overrides, run_config_from_values
from fedmask_app.run.results import is_complete
from fedmask_app.sweep.grid import GridRun, load_grid

ROUND_LINE = re.compile(r"\[fedmask\] round (\d+)/(\d+)")


def _run_flower(cfg: RunConfig, args: argparse.Namespace, on_round) -> None:
    def on_line(line: str) -> None:
        if ROUND_LINE.search(line):
            on_round(line)
        elif args.verbose:
            tqdm.write(line)

    run_with_flower(cfg, args.num_cpus, args.num_gpus, on_line)


def _run_local(cfg: RunConfig, args: argparse.Namespace, on_round) -> None:
    from fedmask_app.engines.local import run_local

    run_local(cfg, echo=lambda line: on_round(line) if ROUND_LINE.search(line) else None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fedmask-sweep", description=__doc__)
    parser.add_argument("grid", type=Path, help="grid file (conf/paper/grid1.toml, conf/mini/grid1.toml, ...)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="run-config overrides for every run")
    parser.add_argument("--engine", choices=("flower", "local"), default="flower",
                        help="flower: `flwr run --stream` per run (Ray simulation); local: one process")
    parser.add_argument("--output-dir", default=None, help="default: results/<grid file stem>")
    parser.add_argument("--num-cpus", type=int, default=1, help="flower engine: CPUs per virtual client")
    parser.add_argument("--num-gpus", type=float, default=None,
                        help="flower engine: GPU fraction per client (default 0.25 with CUDA, else 0)")
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

    complete = {run.name: is_complete(cfg.run_dir, cfg.num_rounds) for run, cfg in configs}
    pending = [(run, cfg) for run, cfg in configs if not complete[run.name]]
    print(f"[sweep] {args.grid}: {len(runs)} runs, {len(runs) - len(pending)} complete, "
          f"{len(pending)} to run ({args.engine} engine) -> {output_dir}")
    if args.dry_run:
        for run, _ in configs:
            state = "complete" if complete[run.name] else "to run"
            print(f"  {run.name}: {state}")
        return 0

    failed: list[str] = []
    execute = _run_flower if args.engine == "flower" else _run_local
    # Progress in client-epochs (rounds x K_c x tau), so the ETA weighs a tau = 5 round as five tau = 1 rounds.
    def work(cfg: RunConfig, rounds: int) -> int:
        return rounds * cfg.clients_per_round * cfg.local_epochs

    with tqdm(total=sum(work(cfg, cfg.num_rounds) for _, cfg in pending), unit="client-epoch",
              dynamic_ncols=True) as bar:
        for index, (run, cfg) in enumerate(pending, 1):
            bar.set_description(f"run {index}/{len(pending)} {run.name}")
            done_before = bar.n
            started = time.perf_counter()

            def on_round(line: str, cfg: RunConfig = cfg) -> None:
                bar.update(work(cfg, 1))
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
                bar.update(max(0, done_before + work(cfg, cfg.num_rounds) - bar.n))  # keep the ETA honest
    print(f"[sweep] done: {len(pending) - len(failed)} runs completed, {len(failed)} failed"
          + (f": {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def grid_run_config(run: GridRun, common: dict) -> RunConfig:
    """pyproject defaults <- grid base and cell <- command-line overrides, validated."""
    return run_config_from_values({**run.overrides, **common})


if __name__ == "__main__":
    sys.exit(main())
