"""Which code made a run: the git commit config.json records.

Flower runs the app from an installed copy without ``.git``, so fedmask-run (and fedmask-sweep's
Flower engine) passes the checkout's commit to it in ``FEDMASK_GIT_COMMIT``; a plain `flwr run`
records none."""

from __future__ import annotations

import os
import subprocess

from fedmask_app.run.config import PROJECT_ROOT

COMMIT_ENV = "FEDMASK_GIT_COMMIT"


def checkout_commit() -> str | None:
    """The git commit of the checkout this code runs from, or None (an installed copy, no git)."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def source_commit() -> str | None:
    """This checkout's commit, else the one the launcher passed in ``FEDMASK_GIT_COMMIT``."""
    return checkout_commit() or os.environ.get(COMMIT_ENV) or None
