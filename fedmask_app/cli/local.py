"""fedmask-local: run one configuration with the local engine (one process, CPU or CUDA; with
``client-processes`` its clients train in worker processes on the CPU)."""

from __future__ import annotations

import argparse
import sys

from fedmask_app.cli.common import add_run_config_arguments, run_config_from_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fedmask-local",
        description="Run fedmask without Flower's transport: same config keys, same results folder.",
    )
    add_run_config_arguments(parser)
    cfg = run_config_from_args("fedmask-local", parser.parse_intermixed_args(argv))
    if cfg is None:
        return 2
    from fedmask_app.engines.client_pool import ClientPoolError
    from fedmask_app.engines.local import run_local
    from fedmask_app.run.config import ConfigError
    from fedmask_app.run.results import ResultsError
    from strategies.round import RoundFailed

    try:
        run_local(cfg)
    except ConfigError as exc:  # what this engine cannot carry out here (the values themselves were valid)
        print(f"fedmask-local: {exc}", file=sys.stderr)
        return 2
    except (RoundFailed, ResultsError, ClientPoolError) as exc:
        print(f"fedmask-local: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"fedmask-local: interrupted; the finished rounds are in {cfg.run_dir / 'rounds.csv'}"
              + (" and resume=true continues from the last checkpoint" if cfg.checkpoint_every else ""),
              file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
