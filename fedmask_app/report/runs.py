"""Run folders as data: every run under some folders as one frame of per-round rows, with each
run's config columns (kebab-case run-config keys) beside them (``load_runs``).

Pure pandas and matplotlib: importing fedmask_app.report does not import torch, so the notebook
and ``fedmask-report`` start fast.
"""

from __future__ import annotations

import io
import json
import math
import warnings
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pandas as pd

from fedmask_app.run.schema import CONFIG_FILE, ROUND_COLUMNS, ROUNDS_FILE

# The statistics the paper reports per configuration (median over the window, then over seeds).
METRICS = ("recovery", "recovery_weighted", "mu2_hat", "sigma2_hat", "test_accuracy")
REPORTED = (*METRICS, "pct_below_1")
# The paper's table keys: batch size, local epochs, Dirichlet concentration.
KEYS = ("bs", "tau", "alpha")
# Columns load_runs adds to the per-round rows besides rounds.csv's and the run-config keys.
META_COLUMNS = ("run", "run_name", "bs", "tau", "K_c")
# Run-config keys that do not define a cell: the seed (the cell's median runs across it) and the
# keys that only say where or how a run executes, not what it measures.
NOT_CELL_KEYS = frozenset({
    "seed", "run-name", "output-dir", "resume", "data-dir", "device", "threads", "checkpoint-every",
    "eval-batch-size", "eval-every", "round-timeout", "min-clients", "fast-simulation",
})
PAPER_ROUNDS, PAPER_WINDOW = 200, 50
# Columns run_summary and cell_summary compute (everything else in their frames is a run-config key).
_DERIVED = frozenset({
    *META_COLUMNS, *REPORTED, "num_rounds", "rounds_completed", "last_round", "complete", "window", "window_start",
    "window_rounds", "mean_shard", "T", "cell_id", "cell", "n_k", "n_seeds", "n_runs", "n_incomplete", "bs", "tau",
    "alpha",
})


class SummaryError(ValueError):
    """Results or a reference table that cannot be read; the message names the file."""


# ---------------------------------------------------------------------------------------------
# Loading


def find_run_dirs(dirs: Iterable[str | Path]) -> list[Path]:
    """Run folders (holding rounds.csv and config.json): each dir itself, or any folder below it."""
    found: dict[Path, None] = {}
    for d in map(Path, dirs):
        if not d.is_dir():
            raise SummaryError(f"{d} is not a folder")
        if (d / ROUNDS_FILE).is_file() and (d / CONFIG_FILE).is_file():
            found.setdefault(d.resolve())
            continue
        for rounds in sorted(d.rglob(ROUNDS_FILE)):
            if (rounds.parent / CONFIG_FILE).is_file():
                found.setdefault(rounds.parent.resolve())
    return list(found)


def _read_rounds(path: Path) -> pd.DataFrame:
    text = path.read_text()
    if text and not text.endswith("\n"):  # a row being written right now (live sweep): not yet a row
        text = text[: text.rfind("\n") + 1]
    if not text.strip():
        raise SummaryError(f"{path} is empty (no header)")
    frame = pd.read_csv(io.StringIO(text), dtype={"cohort": str})
    missing = [c for c in ("round", *METRICS, "num_clients", "num_examples") if c not in frame.columns]
    if missing:
        raise SummaryError(f"{path} lacks column(s) {', '.join(missing)}")
    for column in frame.columns:
        if column != "cohort":
            frame[column] = pd.to_numeric(frame[column], errors="coerce")
    frame = frame.dropna(subset=["round"]).astype({"round": int})
    return frame.drop_duplicates("round", keep="last").sort_values("round", ignore_index=True)


def _read_config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text())["run_config"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise SummaryError(f"{path} is not a run's config.json (no 'run_config' mapping): {exc}") from exc
    if not isinstance(config, dict) or "num-rounds" not in config:
        raise SummaryError(f"{path}: run_config lacks 'num-rounds'")
    return config


def bs_label(value) -> str:
    """Batch size as the paper writes it: "32", "128", "full"."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value).strip().lower() if isinstance(value, str) else str(value)


def bs_order(label: str) -> tuple[int, float, str]:
    """Sort key: numeric batch sizes ascending, then "full"."""
    try:
        return 0, float(label), ""
    except ValueError:
        return 1, math.inf, label


def load_runs(dirs: Iterable[str | Path]) -> pd.DataFrame:
    """Per-round rows of every run under ``dirs``, with the run-config keys as columns.

    Extra columns: ``run`` (the run folder), ``run_name`` (its name), ``bs`` ("32", "full"),
    ``tau`` (local epochs) and ``K_c`` (clients per round). A run without any round yet gives one
    row with ``round`` NaN, so it is still counted (as incomplete). Folders that cannot be read are
    skipped with a warning; none at all raises SummaryError.
    """
    frames = []
    run_dirs = find_run_dirs(dirs)
    for run_dir in run_dirs:
        try:
            config = _read_config(run_dir / CONFIG_FILE)
            rounds = _read_rounds(run_dir / ROUNDS_FILE)
        except (SummaryError, OSError, pd.errors.ParserError) as exc:
            warnings.warn(f"skipping {run_dir}: {exc}", stacklevel=2)
            continue
        if rounds.empty:
            rounds = pd.DataFrame({c: [np.nan] for c in ROUND_COLUMNS})
        meta = {
            "run": str(run_dir), "run_name": run_dir.name, "bs": bs_label(config.get("batch-size")),
            "tau": config.get("local-epochs"), "K_c": config.get("clients-per-round"),
        }
        extra = {**{k: v for k, v in config.items() if k not in rounds.columns}, **meta}
        frames.append(rounds.assign(**{k: [v] * len(rounds) for k, v in extra.items()}))
    if not frames:
        where = ", ".join(map(str, dirs))
        raise SummaryError(f"no runs (folders with {ROUNDS_FILE} and {CONFIG_FILE}) under {where}")
    return pd.concat(frames, ignore_index=True)


def config_keys(rounds: pd.DataFrame) -> list[str]:
    """The run-config columns of a load_runs frame."""
    return [c for c in rounds.columns if c not in ROUND_COLUMNS and c not in META_COLUMNS]
