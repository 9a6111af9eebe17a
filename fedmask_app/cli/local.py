"""fedmask-local: run one configuration with the local engine (one process, CPU or CUDA)."""

from __future__ import annotations

import argparse
import sys

from fedmask_app.config import ConfigError, load_run_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fedmask-local",
        description="Run fedmask without Flower's transport: same config keys, same results folder.",
    )
    parser.add_argument("--run-config", nargs="+", default=[], metavar="FILE.toml | key=value",
                        help="one .toml file, or key=value pairs (as flwr run --run-config)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="more key=value overrides")
    args = parser.parse_args(argv)
    try:
        cfg = load_run_config(args.run_config + args.overrides)
    except ConfigError as exc:
        print(f"fedmask-local: {exc}", file=sys.stderr)
        return 2
    from fedmask_app.local_engine import run_local
    from fedmask_app.results import ResultsError
    from strategies.round import RoundFailed

    try:
        run_local(cfg)
    except (RoundFailed, ResultsError) as exc:
        print(f"fedmask-local: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
