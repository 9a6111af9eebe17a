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

from fedmask_app.report.shards import cohort_shard_range, cohort_sum_sq_weights, read_shards
from fedmask_app.run.schema import CONFIG_FILE, ROUND_COLUMNS, ROUNDS_FILE, SHARDS_FILE

# The statistics the paper reports per configuration (median over the window, then over seeds).
METRICS = ("recovery", "recovery_weighted", "mu2_hat", "sigma2_hat", "test_accuracy")
REPORTED = (*METRICS, "pct_below_1")
# The paper's table keys: batch size, local epochs, Dirichlet concentration.
KEYS = ("bs", "tau", "alpha")
# Columns load_runs adds to the per-round rows besides rounds.csv's and the run-config keys:
# engine is config.json's "engine"; shard_min / shard_max the round's smallest and largest n_k and
# sum_sq_weights its Σ_k w_k² with w_k = n_k / Σ n (from shards.csv, NaN without it).
META_COLUMNS = ("run", "run_name", "bs", "tau", "K_c", "engine", "shard_min", "shard_max", "sum_sq_weights")
# Run-config keys that do not define a cell: the seed (the cell's median runs across it) and the
# keys that only say where or how a run executes, not what it measures.
# (vectorize: the vectorised cohort step equals the sequential one; client-streams: the sequential
# clients' steps, several at once; cuda-graphs: the same step replayed from a CUDA graph;
# skip-padding-taps: the same function, computed without the taps that read zero padding;
# curvature-every / flatness-every: how often the server measures, not what.)
NOT_CELL_KEYS = frozenset({
    "seed", "run-name", "output-dir", "resume", "data-dir", "device", "threads", "client-processes", "client-streams",
    "checkpoint-every", "eval-batch-size", "eval-every", "eval-from", "round-timeout", "min-clients",
    "fast-simulation", "vectorize", "cuda-graphs", "skip-padding-taps", "gemm-convs", "curvature-every",
    "flatness-every",
})
# Values of run-config keys that older runs lack: what such a run did (each key came with a default
# that keeps the earlier behaviour), so that old and new runs of one configuration share a cell.
# "precision" is derived from the older bool key "bf16" (True: "bf16", else "float32"), which it replaces.
CONFIG_DEFAULTS = {
    "mask-mode": "none", "keep-prob": 0.5, "server-step": "fedavg", "keep-prob-schedule": "fixed",
    "fedexp-epsilon": 0.001, "penalty-target": 0.0, "keep-prob-min": 0.1, "probe-size": 128, "probe-file": "",
    "curvature-probes": 8, "penalty-draws": 16, "mask-granularity": "tensor", "flatness-probes": 8,
    "lanczos-tol": 0.001, "lanczos-max-iter": 20, "eval-from": 1, "momentum": 0.0, "weight-decay": 0.0,
    "augment": "none", "dataset": "cifar10",
}
PAPER_ROUNDS, PAPER_WINDOW = 200, 50
# Single-word columns run_summary and cell_summary compute or show apart. Run-config keys are
# kebab-case (RunConfig's field names with "-" for "_"), so no key contains "_": every column with
# an underscore is a statistic, every other column not named here is a run-config key.
_DERIVED = frozenset({"run", "bs", "tau", "complete", "window", "T", "cell", "engine"})


def is_config_column(name: str) -> bool:
    """Whether a column of a load_runs / run_summary / cell_summary frame is a run-config key."""
    return "_" not in name and name not in _DERIVED and name not in ROUND_COLUMNS


def normalize_config(config: dict) -> dict:
    """config with CONFIG_DEFAULTS for the keys it lacks and "precision" in place of "bf16"."""
    out = {**CONFIG_DEFAULTS, **config}
    bf16 = out.pop("bf16", False)
    out.setdefault("precision", "bf16" if bf16 is True or str(bf16).lower() == "true" else "float32")
    return out


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
    for column in frame.columns:  # the *_flag columns (measure/curvature.py) stay text
        if column != "cohort" and not column.endswith("_flag"):
            frame[column] = pd.to_numeric(frame[column], errors="coerce")
    frame = frame.dropna(subset=["round"]).astype({"round": int})
    return frame.drop_duplicates("round", keep="last").sort_values("round", ignore_index=True)


def _read_config(path: Path) -> tuple[dict, str | None]:
    """The run-config mapping (normalize_config'd) and the engine the run used (None if not recorded)."""
    try:
        meta = json.loads(path.read_text())
        config = meta["run_config"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise SummaryError(f"{path} is not a run's config.json (no 'run_config' mapping): {exc}") from exc
    if not isinstance(config, dict) or "num-rounds" not in config:
        raise SummaryError(f"{path}: run_config lacks 'num-rounds'")
    engine = meta.get("engine")
    return normalize_config(config), engine if isinstance(engine, str) else None


def _shard_columns(run_dir: Path, rounds: pd.DataFrame) -> dict[str, pd.Series]:
    """Per round, the smallest and largest shard of the cohort and the sum of its squared
    aggregation weights (shards.csv), or NaN (with a warning if the file is there but cannot be used)."""
    nan = pd.Series(np.nan, index=rounds.index)
    try:
        sizes = read_shards(run_dir)
        if sizes is None or "cohort" not in rounds:
            return {"shard_min": nan, "shard_max": nan, "sum_sq_weights": nan}
        low, high = cohort_shard_range(rounds["cohort"], sizes)
        return {"shard_min": low, "shard_max": high, "sum_sq_weights": cohort_sum_sq_weights(rounds["cohort"], sizes)}
    except (ValueError, OSError) as exc:
        warnings.warn(f"{run_dir}: {SHARDS_FILE} not used: {exc}", stacklevel=3)
        return {"shard_min": nan, "shard_max": nan, "sum_sq_weights": nan}


def full_rounds(rows: pd.DataFrame, k_c: object) -> pd.Series:
    """Which of one run's rows are full rounds (num_clients = K_c: every cohort client replied), the
    rounds the recovery statistics and the cohort measurements use; with K_c unknown, every row
    that has a reply count."""
    k_c = pd.to_numeric(pd.Series([k_c]), errors="coerce").iloc[0]
    return rows["num_clients"] >= k_c if np.isfinite(k_c) else rows["num_clients"].notna()


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
    ``tau`` (local epochs), ``K_c`` (clients per round), ``engine`` (config.json's, None if absent),
    ``shard_min`` / ``shard_max`` (the smallest and largest shard of the round's cohort) and
    ``sum_sq_weights`` (its Σ_k w_k², w_k = n_k / Σ n), the last three from the run's optional
    shards.csv, NaN without it. The config is normalize_config'd: CONFIG_DEFAULTS for keys older
    runs lack, "precision" for "bf16". A run without any round yet gives one row with ``round``
    NaN, so it is still counted (as incomplete). Folders that cannot be read are skipped with a
    warning; none at all raises SummaryError.
    """
    frames = []
    run_dirs = find_run_dirs(dirs)
    for run_dir in run_dirs:
        try:
            config, engine = _read_config(run_dir / CONFIG_FILE)
            rounds = _read_rounds(run_dir / ROUNDS_FILE)
        except (SummaryError, OSError, pd.errors.ParserError) as exc:
            warnings.warn(f"skipping {run_dir}: {exc}", stacklevel=2)
            continue
        if rounds.empty:
            rounds = pd.DataFrame({c: [np.nan] for c in ROUND_COLUMNS})
        meta = {
            "run": str(run_dir), "run_name": run_dir.name, "bs": bs_label(config.get("batch-size")),
            "tau": config.get("local-epochs"), "K_c": config.get("clients-per-round"), "engine": engine,
        }
        meta.update(_shard_columns(run_dir, rounds))
        extra = {**{k: v for k, v in config.items() if k not in rounds.columns}, **meta}
        frames.append(rounds.assign(**{k: v if isinstance(v, pd.Series) else [v] * len(rounds)
                                       for k, v in extra.items()}))
    if not frames:
        where = ", ".join(map(str, dirs))
        raise SummaryError(f"no runs (folders with {ROUNDS_FILE} and {CONFIG_FILE}) under {where}")
    return pd.concat(frames, ignore_index=True)


def config_keys(rounds: pd.DataFrame) -> list[str]:
    """The run-config columns of a load_runs frame (is_config_column)."""
    return [c for c in rounds.columns if is_config_column(c)]
