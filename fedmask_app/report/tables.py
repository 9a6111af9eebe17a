"""Per-run and per-cell medians the way the paper reads results (PAPER.md, "The measurement
protocol"), and the table they print as.

* ``run_summary(rounds, window)``: one row per run, each statistic's median over the run's last
  ``window`` rounds (rounds num-rounds - window + 1 .. num-rounds that are present).
* ``cell_summary(runs)``: one row per cell (a configuration, i.e. every run-config key that can
  change the measurement, seed excepted), the median of its runs' values across seeds.

T, the number of local SGD steps per round (PAPER.md: "T = tau * ceil(n_k / bs)"): shards differ
in size, so T is shown for the *mean shard* of the cohorts in the window: n_k = mean over the
window rounds of num_examples / num_clients (rounds.csv), averaged over the cell's runs; then
T = tau for bs = "full", else tau * ceil(n_k / bs). A given client's count is tau * ceil(n_k / bs)
with its own n_k.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

from fedmask_app.report.runs import (
    _DERIVED,
    METRICS,
    NOT_CELL_KEYS,
    PAPER_ROUNDS,
    PAPER_WINDOW,
    REPORTED,
    bs_order,
    config_keys,
)

# ---------------------------------------------------------------------------------------------
# Per run and per cell


def local_steps(tau, bs: str, n_k: float) -> float:
    """T: tau for full batch, else tau * ceil(n_k / bs) (PAPER.md); NaN when n_k is unknown."""
    if bs == "full":
        return float(tau)
    if n_k is None or not np.isfinite(n_k) or bs_order(bs)[0] != 0:
        return float("nan")
    return float(tau * math.ceil(n_k / float(bs)))


def _cell_id(config: dict) -> str:
    return json.dumps({k: config[k] for k in sorted(config) if k not in NOT_CELL_KEYS}, sort_keys=True, default=str)


def run_summary(rounds: pd.DataFrame, window: int = PAPER_WINDOW) -> pd.DataFrame:
    """One row per run: its config, rounds completed, and the window medians.

    The window is rounds max(1, num-rounds - window + 1) .. num-rounds; its rounds that are present
    count (an incomplete run may have fewer, or none: then the medians are NaN). NaN cells are
    skipped (test_accuracy when eval-every > 1). pct_below_1 is the share (%) of the window rounds
    with a recovery value that have recovery < 1. mean_shard is n_k of the module docstring.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    keys = config_keys(rounds)
    out = []
    for run, group in rounds.groupby("run", sort=False):
        first = group.iloc[0]
        config = {k: first[k] for k in keys if not _missing(first[k])}
        num_rounds = int(config["num-rounds"])
        present = group.dropna(subset=["round"])
        done = sorted(present["round"].astype(int))
        start = max(1, num_rounds - window + 1)
        win = present[(present["round"] >= start) & (present["round"] <= num_rounds)]
        recovery = win["recovery"].dropna()
        shard = (win["num_examples"] / win["num_clients"].where(win["num_clients"] > 0)).mean()
        row = {
            "run": run, "run_name": first["run_name"], **config,
            "bs": first["bs"], "tau": first["tau"], "K_c": first["K_c"],
            "num_rounds": num_rounds, "rounds_completed": len(done), "last_round": max(done, default=0),
            "complete": done == list(range(1, num_rounds + 1)),
            "window": window, "window_start": start, "window_rounds": len(win),
            **{m: win[m].median() for m in METRICS},
            "pct_below_1": 100.0 * float((recovery < 1).mean()) if len(recovery) else float("nan"),
            "mean_shard": shard, "T": local_steps(first["tau"], first["bs"], shard),
            "cell_id": _cell_id(config),
        }
        out.append(row)
    runs = pd.DataFrame(out)
    runs["cell"] = cell_labels(runs)
    return runs


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def incomplete_runs(runs: pd.DataFrame) -> pd.DataFrame:
    return runs[~runs["complete"].astype(bool)]


def run_config_columns(frame: pd.DataFrame) -> list[str]:
    """The run-config columns (kebab-case keys) of a run_summary or cell_summary frame."""
    return [c for c in frame.columns if c not in _DERIVED and not c.endswith(("_ref", "_ratio"))]


def varying_keys(runs: pd.DataFrame) -> list[str]:
    """Cell-defining run-config keys besides bs, tau, alpha whose value differs between runs."""
    out = []
    for key in run_config_columns(runs):
        if key in NOT_CELL_KEYS or key in {"batch-size", "local-epochs", "alpha"}:
            continue
        if runs[key].map(lambda v: json.dumps(v, default=str)).nunique() > 1:
            out.append(key)
    return out


def cell_labels(runs: pd.DataFrame) -> pd.Series:
    """A short name per run's cell: "bs=32 τ=2 α=100", plus any other key that differs between cells."""
    extra = varying_keys(runs)

    def label(row) -> str:
        parts = [f"bs={row['bs']}", f"τ={row['tau']}", f"α={row['alpha']:g}"]
        parts += [f"{k}={row[k]}" for k in extra]
        return " ".join(parts)

    return runs.apply(label, axis=1) if len(runs) else pd.Series(dtype=str)


def cell_summary(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per cell: the cell's keys, T, and the median across its runs (seeds) of each reported
    statistic; n_seeds, n_runs and n_incomplete count its runs.

    Sorted as the paper's tables: alpha descending, then batch size (numeric, then "full"), then tau.
    """
    extra = varying_keys(runs)
    out = []
    for _, group in runs.groupby("cell_id", sort=False):
        first = group.iloc[0]
        n_k = group["mean_shard"].mean()
        row = {
            "cell": first["cell"], "bs": first["bs"], "tau": int(first["tau"]), "alpha": float(first["alpha"]),
            "T": local_steps(first["tau"], first["bs"], n_k), "n_k": n_k, **{k: first[k] for k in extra},
            **{m: group[m].median() for m in REPORTED},
            "n_seeds": int(group["seed"].nunique()) if "seed" in group else len(group),
            "n_runs": len(group), "n_incomplete": int((~group["complete"].astype(bool)).sum()),
            "K_c": first["K_c"], "num_rounds": int(first["num_rounds"]), "window": int(first["window"]),
            "window_rounds": int(group["window_rounds"].min()),
            "rounds_completed": int(group["rounds_completed"].min()),
        }
        out.append(row)
    cells = pd.DataFrame(out)
    if cells.empty:
        return cells
    order = cells.assign(_a=-cells["alpha"], _b=cells["bs"].map(bs_order))
    try:
        order = order.sort_values([*extra, "_a", "_b", "tau"], kind="stable")
    except TypeError:  # a key with values of mixed types: sort it as text
        order = order.assign(**{k: order[k].map(str) for k in extra}).sort_values([*extra, "_a", "_b", "tau"])
    return cells.loc[order.index].reset_index(drop=True)


def cell_rounds(rounds: pd.DataFrame, runs: pd.DataFrame, columns: Sequence[str] = METRICS) -> pd.DataFrame:
    """Per cell and round, the median across the cell's runs of ``columns`` (for per-round plots)."""
    labelled = rounds.dropna(subset=["round"]).merge(runs[["run", "cell"]], on="run")
    return labelled.groupby(["cell", "round"], sort=False)[list(columns)].median().reset_index()


# ---------------------------------------------------------------------------------------------
# Printing and Fig. 1

_FORMATS = {
    "recovery": "{:.3f}", "recovery_weighted": "{:.3f}", "mu2_hat": "{:.3g}", "sigma2_hat": "{:.3g}",
    "test_accuracy": "{:.3f}", "pct_below_1": "{:.0f}", "T": "{:.0f}", "alpha": "{:g}", "n_k": "{:.0f}",
}


def _fmt(column: str):
    pattern = "{:.3f}" if column.endswith("_ratio") else _FORMATS.get(column.removesuffix("_ref"), "{}")

    def fmt(value) -> str:
        if isinstance(value, float | np.floating) and math.isnan(value):
            return "-"
        return pattern.format(value) if isinstance(value, int | float | np.number) else str(value)

    return fmt


def table_columns(cells: pd.DataFrame) -> list[str]:
    extra = run_config_columns(cells)
    return ["bs", "tau", "T", "alpha", *extra, *REPORTED, "n_seeds"]


def format_table(cells: pd.DataFrame, columns: Sequence[str] | None = None) -> str:
    """The cell table as text, in cell_summary's order; a note column flags cells with incomplete runs."""
    columns = list(columns or table_columns(cells))
    shown = cells[columns].copy()
    if "n_incomplete" in cells:
        notes = [f"{n}/{r} runs incomplete" if n else "" for n, r in zip(
            cells["n_incomplete"], cells["n_runs"], strict=True)]
        if any(notes):
            shown["note"] = notes
    return shown.to_string(index=False, na_rep="-", formatters={c: _fmt(c) for c in columns})


def protocol_note(cells: pd.DataFrame) -> str:
    """"paper protocol" or "reduced protocol: N rounds, window W" (what fig1's title says)."""
    rounds = sorted(cells["num_rounds"].unique())
    window = int(cells["window"].iloc[0])
    n = f"{rounds[0]}" if len(rounds) == 1 else f"{rounds[0]}-{rounds[-1]}"
    if rounds[0] >= PAPER_ROUNDS and window == PAPER_WINDOW:
        return f"paper protocol: {n} rounds, window {window}"
    start = max(1, int(rounds[-1]) - window + 1)
    covered = f"rounds {start}-{rounds[-1]}" if len(rounds) == 1 else f"window {window}"
    return (f"reduced protocol: {n} rounds, window {window} ({covered}); "
            f"the paper's is {PAPER_ROUNDS} rounds, window {PAPER_WINDOW}")
