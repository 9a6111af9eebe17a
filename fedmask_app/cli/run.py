"""fedmask-run: `flwr run . --stream` with the run config validated first.

It validates the merged configuration before Flower or Ray start, sizes the simulated federation
to ``num-clients`` SuperNodes, makes relative ``output-dir``/``data-dir`` absolute against the
current folder (the ServerApp runs in the SuperLink's folder, not yours), turns off the
SuperLink's per-run dependency install (the app runs in the environment you installed it in),
and runs on a local SuperLink of its own (free ports, its own FLWR_HOME) that it stops when the
run ends: a SuperLink you started yourself, or another fedmask-run, is never touched.
"""

from __future__ import annotations

import argparse
import re
import sys

from fedmask_app.cli.common import add_run_config_arguments, run_config_from_args
from fedmask_app.engines.flower.superlink import run_with_flower
from fedmask_app.run.config import ConfigError, refuse_local_engine_keys
from fedmask_app.run.device import refuse_graphs_without_cuda

# Flower lines that say nothing true about a fedmask-run: it sizes the federation itself and runs
# on a private FLWR_HOME that it creates and removes.
FLOWER_NOISE = re.compile(
    r"default simulated SuperNodes changed from|To change federation size, use|flwr federation simulation-config"
    r"|Flower configuration not found\. Created default configuration"
)


def print_line(line: str) -> None:
    if not FLOWER_NOISE.search(line):
        print(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fedmask-run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_config_arguments(parser)
    parser.add_argument("--num-cpus", type=int, default=1, help="CPUs per virtual client (default 1)")
    parser.add_argument("--num-gpus", type=float, default=None,
                        help="GPU fraction per virtual client (default 0.25 with CUDA, else 0)")
    parser.add_argument("--ray-address", default=None, metavar="ADDR",
                        help="run the simulation's virtual clients on this existing Ray cluster (host:port of its "
                             "head, or 'auto'); every node needs this environment with fedmask installed")
    args = parser.parse_intermixed_args(argv)
    cfg = run_config_from_args("fedmask-run", args)
    if cfg is None:
        return 2
    try:
        refuse_local_engine_keys(cfg)
        if not args.ray_address:  # a cluster's nodes may have GPUs this machine lacks
            refuse_graphs_without_cuda(cfg)
    except ConfigError as exc:
        print(f"fedmask-run: {exc}", file=sys.stderr)
        return 2
    try:
        code = run_with_flower(cfg, args.num_cpus, args.num_gpus, on_line=print_line, ray_address=args.ray_address)
    except FileNotFoundError as exc:
        print(f"fedmask-run: {exc}", file=sys.stderr)
        return 2
    from fedmask_app.run.results import is_complete

    if code != 0 or not is_complete(cfg.run_dir, cfg.num_rounds):
        print(f"fedmask-run: the run did not complete (flwr exit code {code}); see the log above", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
