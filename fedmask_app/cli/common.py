"""What the console scripts share: reading a run configuration from the command line."""

from __future__ import annotations

import argparse
import sys

from fedmask_app.run.config import ConfigError, RunConfig, load_run_config


def add_run_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="*", metavar="FILE.toml | key=value",
                        help="run-config overrides: .toml files and key=value pairs (TOML values), in order")
    parser.add_argument("--run-config", nargs="+", default=[], metavar="FILE.toml | key=value",
                        help="the same, spelled as for flwr run")


def run_config_from_args(prog: str, args: argparse.Namespace) -> RunConfig | None:
    """The validated configuration, or None after printing why it is not valid."""
    try:
        return load_run_config(args.run_config + args.config)
    except ConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return None
