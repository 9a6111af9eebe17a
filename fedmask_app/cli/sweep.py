"""fedmask-sweep GRID: every cell x seed of a grid file, one run after another, resumable.

With --group-runs N (local engine, vectorize=true) runs that train alike go N at a time, their
cohorts trained as one batched computation (fedmask_app/engines/run_group.py).

With --ray-address the runs are Ray tasks spread across a cluster's nodes instead, several at a
time, each on the local engine (fedmask_app/sweep/cluster.py; ray is imported only then); with
--group-runs too, each group of runs trained together is one task."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from fedmask_app.engines.flower.superlink import run_with_flower
from fedmask_app.engines.run_group import form_groups, refuse_ungroupable, run_on_local_engine
from fedmask_app.run.config import (
    ConfigError,
    RunConfig,
    parse_overrides,
    refuse_local_engine_keys,
    run_config_from_values,
)
from fedmask_app.run.device import pick_device, refuse_graphs_without_cuda
from fedmask_app.run.results import ResultsError, is_complete, rounds_written, stored_differences
from fedmask_app.sweep.grid import GridRun, load_grid

if TYPE_CHECKING:
    from fedmask_app.sweep.cluster import RunOutcome

ROUND_LINE = re.compile(r"\[fedmask\] round (\d+)/(\d+)")


def _run_flower(cfg: RunConfig, args: argparse.Namespace, on_round) -> None:
    def on_line(line: str) -> None:
        if ROUND_LINE.search(line):
            on_round(line)
        elif args.verbose:
            tqdm.write(line)

    run_with_flower(cfg, args.num_cpus, args.num_gpus, on_line)


RAY_HELP = """\
On a Ray cluster (--ray-address): every run is one Ray task asking for --run-cpus/--run-gpus
(/--run-resources), spread over the nodes, each running the whole run on the local engine (not
Flower: a Flower simulation inside a Ray task would start a second Ray). With --group-runs N each
group of runs trained together is one task, asking for those resources once. Every node needs this
project installed and the data at data-dir (give an absolute path). Complete runs are skipped and
incomplete ones resumed as without Ray; a run whose worker or node is lost is retried by Ray
(--max-retries), a run that raises is reported, not retried.

Choosing where results go:
  --shared-output (default): output-dir is a path every node sees (NFS or another shared
      filesystem, or one machine). Runs write there as they go; a lost run resumes from its last
      checkpoint (checkpoint-every), and rounds.csv never holds a round twice.
  --no-shared-output: nodes share no filesystem with this machine. Each task runs in a node-local
      temporary folder and sends the run folder's files (rounds.csv, config.json, checkpoint.pt,
      shards.csv) back here, where they are written under output-dir; a lost run starts again from
      round 1 (or from the files here, for a run an earlier sweep left incomplete).
"""


def _resources(text: str) -> dict[str, float]:
    """--run-resources: a JSON object of custom Ray resources, e.g. '{"node_a": 1}'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 for v in value.values()
    ):
        raise argparse.ArgumentTypeError('expected a JSON object of amounts >= 0, e.g. \'{"node_a": 1}\'')
    return {str(k): float(v) for k, v in value.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedmask-sweep", description=__doc__, epilog=RAY_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("grid", type=Path, help="grid file (conf/paper/grid1.toml, conf/mini/grid1.toml, ...)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="run-config overrides for every run")
    parser.add_argument("--engine", choices=("flower", "local"), default=None,
                        help="flower (default): `flwr run --stream` per run (Ray simulation); local: one process; "
                             "with --ray-address always local")
    parser.add_argument("--output-dir", default=None,
                        help="default: results/<the grid file's folder>/<its stem>, e.g. results/paper/grid1")
    parser.add_argument("--num-cpus", type=int, default=1, help="flower engine: CPUs per virtual client")
    parser.add_argument("--num-gpus", type=float, default=None,
                        help="flower engine: GPU fraction per client (default 0.25 with CUDA, else 0)")
    parser.add_argument("--group-runs", type=int, default=1, metavar="N",
                        help="local engine, vectorize=true: train up to N runs together, their cohorts as one "
                             "batched computation (runs with equal model, batch-size, local-epochs, lr, precision, "
                             "device, threads, cuda-graphs, skip-padding-taps and gemm-convs); default 1: one run at a "
                             "time. With "
                             "--ray-address each group is one Ray task")
    parser.add_argument("--dry-run", action="store_true", help="list the runs and their state, run nothing")
    parser.add_argument("--verbose", action="store_true",
                        help="flower engine: show Flower's own log lines; Ray: each run's node and log lines")
    on_ray = parser.add_argument_group("on a Ray cluster (see below)")
    on_ray.add_argument("--ray-address", default=None, metavar="ADDR",
                     help="run the grid's runs as Ray tasks: HOST:PORT of the cluster's head, auto (the cluster "
                          "`ray start` started on this machine, or RAY_ADDRESS), or local (a private single-node "
                          "Ray in this process, stopped at the end)")
    on_ray.add_argument("--run-cpus", type=float, default=1.0, help="CPUs each run's task asks for (default 1)")
    on_ray.add_argument("--run-gpus", type=float, default=0.0,
                     help="GPUs each run's task asks for, a fraction shares one; with 0 (default) Ray hides the "
                          "node's GPUs from the task, so device=auto trains on the CPU")
    on_ray.add_argument("--run-resources", type=_resources, default={}, metavar="JSON",
                     help='custom Ray resources each run\'s task asks for, e.g. \'{"node_a": 1}\'')
    on_ray.add_argument("--shared-output", action=argparse.BooleanOptionalAction, default=True,
                     help="output-dir is on a filesystem every node shares (default); --no-shared-output: "
                          "tasks send their run folder's files back to be written here")
    on_ray.add_argument("--max-retries", type=int, default=3,
                     help="times Ray retries a run whose worker or node was lost (default 3)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)
    if args.ray_address and args.engine == "flower":
        print("fedmask-sweep: --ray-address runs each run on the local engine inside a Ray task "
              "(a Flower simulation there would start a second Ray): drop --engine flower", file=sys.stderr)
        return 2
    args.engine = "local" if args.ray_address else args.engine or "flower"
    if args.group_runs != 1 and (args.engine != "local" or args.group_runs < 1):
        print("fedmask-sweep: --group-runs N (N >= 1) trains runs together on the local engine: "
              "add --engine local (or --ray-address)", file=sys.stderr)
        return 2

    try:
        runs = load_grid(args.grid)
        output_dir = args.output_dir or default_output_dir(args.grid)
        common = {**parse_overrides(args.overrides), "output-dir": str(Path(output_dir).resolve()), "resume": True}
        configs = [(run, grid_run_config(run, common)) for run in runs]
        for _, cfg in configs:
            if args.engine == "flower":
                refuse_local_engine_keys(cfg)
            if not args.ray_address:  # on a cluster the runs' nodes may have GPUs this machine lacks
                refuse_graphs_without_cuda(cfg)
            if args.group_runs > 1:
                refuse_ungroupable(cfg)
    except ConfigError as exc:
        print(f"fedmask-sweep: {exc}", file=sys.stderr)
        return 2

    try:
        foreign = {run.name: diffs for run, cfg in configs
                   if (diffs := stored_differences(cfg.run_dir, cfg.to_mapping()))}
    except ResultsError as exc:
        print(f"fedmask-sweep: {exc}", file=sys.stderr)
        return 2
    if foreign:
        print(f"fedmask-sweep: {output_dir} holds {len(foreign)} of this grid's run folders with runs of another "
              "configuration; nothing was run or changed. Choose another --output-dir, or move those folders:",
              file=sys.stderr)
        for name, diffs in foreign.items():
            print(f"  {name}: {', '.join(diffs)}", file=sys.stderr)
        return 2

    complete = {run.name: is_complete(cfg.run_dir, cfg.num_rounds) for run, cfg in configs}
    pending = [(run, cfg) for run, cfg in configs if not complete[run.name]]
    where = f"local engine in Ray tasks at {args.ray_address}" if args.ray_address else f"{args.engine} engine"
    groups = form_groups([cfg for _, cfg in pending], args.group_runs) if args.group_runs > 1 else []
    if groups:
        where += f", {len(groups)} group(s) of up to {args.group_runs} runs trained together"
    print(f"[sweep] {args.grid}: {len(runs)} runs, {len(runs) - len(pending)} complete, "
          f"{len(pending)} to run ({where}) -> {output_dir}")
    if args.group_runs > 1 and any(_trains_on_cpu(cfg, args) for _, cfg in pending):
        print("[sweep] note: runs trained together are meant for GPUs; on a CPU they are slower than one run at a "
              "time (README, Runs trained together)")
    if args.dry_run:
        group_of = {pending[i][0].name: number for number, group in enumerate(groups, 1) for i in group}
        for run, cfg in configs:
            written = rounds_written(cfg.run_dir)
            state = ("complete" if complete[run.name] else
                     f"to run ({written} of {cfg.num_rounds} rounds written)" if written else "to run")
            print(f"  {run.name}: {state}" + (f" (group {group_of[run.name]})" if run.name in group_of else ""))
        return 0

    try:
        failed = _sweep_on_ray(pending, groups, args) if args.ray_address else _sweep_here(pending, groups, args)
    except ConnectionError as exc:  # ray.init found no cluster at --ray-address
        print(f"fedmask-sweep: {exc}", file=sys.stderr)
        return 2
    print(f"[sweep] done: {len(pending) - len(failed)} runs completed, {len(failed)} failed"
          + (f": {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def _sweep_here(pending: list[tuple[GridRun, RunConfig]], groups: list[list[int]], args: argparse.Namespace
                ) -> list[str]:
    """One run after another in this process (local engine) or through `flwr run` (flower); with
    ``groups`` (--group-runs: indices into ``pending``), one group of runs trained together after another."""
    failed: list[str] = []
    batches = [[pending[i] for i in group] for group in groups] if groups else [[item] for item in pending]

    # Progress in client-epochs (rounds x K_c x tau), so the ETA weighs a tau = 5 round as five tau = 1 rounds;
    # a run resumed or extended plans the rounds it has not written.
    def work(cfg: RunConfig, rounds: int) -> int:
        return rounds * cfg.clients_per_round * cfg.local_epochs

    to_write = {cfg.name: max(0, cfg.num_rounds - rounds_written(cfg.run_dir)) for _, cfg in pending}
    with tqdm(total=sum(work(cfg, to_write[cfg.name]) for _, cfg in pending), unit="client-epoch",
              dynamic_ncols=True) as bar:
        for index, batch in enumerate(batches, 1):
            names = " + ".join(run.name for run, _ in batch)
            bar.set_description(f"{'group' if groups else 'run'} {index}/{len(batches)} {names}")
            done_before = bar.n
            started = time.perf_counter()

            def on_round(line: str, cfg: RunConfig) -> None:
                bar.update(work(cfg, 1))
                tqdm.write(f"[{cfg.name}] {line}" if groups else line)

            def echo_for(cfg: RunConfig):
                return lambda line: on_round(line, cfg) if ROUND_LINE.search(line) else None

            if args.engine == "flower":
                errors = [_attempt(lambda cfg=batch[0][1]: _run_flower(cfg, args, lambda line: on_round(line, cfg)))]
            else:
                errors = run_on_local_engine([cfg for _, cfg in batch], [echo_for(cfg) for _, cfg in batch],
                                             together=bool(groups))
            for (run, cfg), error in zip(batch, errors, strict=True):
                if error is not None:  # report it and go on with the next run
                    tqdm.write(f"[sweep] {run.name} raised {type(error).__name__}: {error}")
                if is_complete(cfg.run_dir, cfg.num_rounds):
                    tqdm.write(f"[sweep] {run.name} complete in {time.perf_counter() - started:.0f}s")
                else:
                    failed.append(run.name)
                    tqdm.write(f"[sweep] {run.name} FAILED: rounds.csv is incomplete; see its output above")
            planned = sum(work(cfg, to_write[cfg.name]) for _, cfg in batch)
            bar.update(max(0, done_before + planned - bar.n))  # keep the ETA honest after a failure
    return failed


def _trains_on_cpu(cfg: RunConfig, args: argparse.Namespace) -> bool:
    if args.ray_address:  # the task's node decides; with --run-gpus 0 Ray hides its GPUs
        return cfg.device == "cpu" or (args.run_gpus == 0 and cfg.device == "auto")
    try:
        return pick_device(cfg).type == "cpu"
    except RuntimeError:  # device = "cuda" without one: the run reports it
        return False


def _attempt(call) -> Exception | None:
    try:
        call()
    except Exception as exc:
        return exc
    return None


def _sweep_on_ray(pending: list[tuple[GridRun, RunConfig]], groups: list[list[int]], args: argparse.Namespace
                  ) -> list[str]:
    """Every run, or with ``groups`` every group of runs trained together, as a Ray task
    (fedmask_app/sweep/cluster.py), each run reported as its task ends; the failed runs."""
    from fedmask_app.sweep import cluster  # imports ray, so only here

    options = cluster.TaskOptions(cpus=args.run_cpus, gpus=args.run_gpus, resources=args.run_resources,
                                  shared_output=args.shared_output, max_retries=args.max_retries,
                                  verbose=args.verbose, train_together=bool(groups))
    by_name = {cfg.name: (run, cfg) for run, cfg in pending}
    failed: list[str] = []
    with cluster.connect(args.ray_address, args.verbose) as where:
        tqdm.write(f"[sweep] on {where}, {'shared' if args.shared_output else 'no shared'} output")
        if warning := cluster.missing_resources(options):
            tqdm.write(f"[sweep] warning: {warning}")
        with tqdm(total=len(pending), unit="run", dynamic_ncols=True) as bar:
            batches = [[pending[i][1] for i in group] for group in groups] or [[cfg] for _, cfg in pending]
            for outcome in cluster.run_all(batches, options):
                run, cfg = by_name[outcome.name]
                if not _report_run(run, cfg, outcome, args.verbose):
                    failed.append(run.name)
                bar.update(1)
    return failed


def _report_run(run: GridRun, cfg: RunConfig, outcome: RunOutcome, verbose: bool) -> bool:
    """Print how a Ray task's run ended (its node with --verbose); True when the run is complete."""
    if outcome.error:
        tqdm.write(f"[sweep] {run.name} raised {outcome.error}")
    where = f" on node {outcome.node_id} (pid {outcome.pid})" if verbose and outcome.node_id else ""
    resumed = f", resumed after round {outcome.resumed_after}" if outcome.resumed_after else ""
    if is_complete(cfg.run_dir, cfg.num_rounds):
        tqdm.write(f"[sweep] {run.name} complete in {outcome.seconds:.0f}s{where}{resumed}")
        return True
    tqdm.write(f"[sweep] {run.name} FAILED{where}: rounds.csv is incomplete; see its output above")
    return False


def default_output_dir(grid: Path) -> str:
    """results/<folder>/<stem> of the grid file: conf/paper/grid1.toml and conf/mini/grid1.toml
    write to different folders."""
    return str(Path("results") / grid.resolve().parent.name / grid.stem)


def grid_run_config(run: GridRun, common: dict) -> RunConfig:
    """pyproject defaults <- grid base and cell <- command-line overrides, validated."""
    return run_config_from_values({**run.overrides, **common})


if __name__ == "__main__":
    sys.exit(main())
