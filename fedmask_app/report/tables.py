"""Per-run and per-cell medians the way the paper reads results (PAPER.md, "The measurement
protocol"), and the table they print as.

* ``run_summary(rounds, window)``: one row per run, each statistic's median over the run's last
  ``window`` rounds (rounds num-rounds - window + 1 .. num-rounds that are present).
* ``cell_summary(runs)``: one row per cell (a configuration, i.e. every run-config key that can
  change the measurement, seed excepted), the median of its runs' values across seeds.

Short rounds: a round with fewer good replies than K_c (num_clients < clients-per-round) has a
lower ceiling for 1/ΔS and a noisier σ̂², so the recovery statistics (RECOVERY_METRICS and both
pct_below_1 columns) use *full* rounds only; ``short_rounds`` counts the window rounds left out, and
``many_short`` marks a run with more than SHORT_ROUNDS_LIMIT of its window rounds short. Test
accuracy uses every window round (the model is evaluated either way).

pct_below_1 is the share (%) of the window's full rounds with a recovery value that have 1/ΔS < 1
(what the paper reports); pct_below_1_all the same share over all the run's full rounds.

T, the number of local SGD steps per round (PAPER.md: "T = tau * ceil(n_k / bs)"): shards differ
in size, so T is shown for the *mean shard* of the cohorts in the window: n_k = mean over the
window rounds of num_examples / num_clients (rounds.csv), averaged over the cell's runs; then
T = tau for bs = "full", else tau * ceil(n_k / bs). T_min and T_max are the range over the clients
of the window's cohorts, from each client's own n_k in the run's shards.csv (report/shards.py);
NaN when the run has none (a cell: when any of its runs has none), except for bs = "full" (T = tau).

The server's curvature and flatness measurements, where a run has them: report/curvature.py;
final and best values for the masking comparison: report/comparison.py.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

from fedmask_app.report.comparison import run_finals
from fedmask_app.report.curvature import cell_measurements, measurement_columns, run_measurements
from fedmask_app.report.runs import (
    METRICS,
    NOT_CELL_KEYS,
    PAPER_WINDOW,
    REPORTED,
    bs_order,
    config_keys,
    is_config_column,
)

RECOVERY_METRICS = ("recovery", "recovery_weighted", "mu2_hat", "sigma2_hat")
SHORT_ROUNDS_LIMIT = 0.10
"""A run with more than this share of its window rounds short is flagged (many_short)."""

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


def _pct_below_1(rows: pd.DataFrame) -> float:
    recovery = rows["recovery"].dropna()
    return 100.0 * float((recovery < 1).mean()) if len(recovery) else float("nan")


def run_summary(rounds: pd.DataFrame, window: int = PAPER_WINDOW) -> pd.DataFrame:
    """One row per run: its config, rounds completed, and the window medians.

    The window is rounds max(1, num-rounds - window + 1) .. num-rounds; its rounds that are present
    count (an incomplete run may have fewer, or none: then the medians are NaN). NaN cells are
    skipped (test_accuracy when eval-every > 1). Short rounds, pct_below_1(_all), T, T_min / T_max:
    the module docstring. Also the measurement medians (curvature.run_measurements) and the final
    values (comparison.run_finals).
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
        short = present["num_clients"] < float(first["K_c"]) if not _missing(first["K_c"]) else False
        short = pd.Series(short, index=present.index)
        in_window = (present["round"] >= start) & (present["round"] <= num_rounds)
        win, full = present[in_window], present[in_window & ~short]
        shard = (win["num_examples"] / win["num_clients"].where(win["num_clients"] > 0)).mean()
        row = {
            "run": run, "run_name": first["run_name"], **config,
            "bs": first["bs"], "tau": first["tau"], "K_c": first["K_c"], "engine": first.get("engine"),
            "num_rounds": num_rounds, "rounds_completed": len(done), "last_round": max(done, default=0),
            "complete": done == list(range(1, num_rounds + 1)),
            "window": window, "window_start": start, "window_rounds": len(win),
            "full_rounds": len(full), "short_rounds": len(win) - len(full),
            "many_short": len(win) - len(full) > SHORT_ROUNDS_LIMIT * len(win),
            **{m: full[m].median() for m in RECOVERY_METRICS}, "test_accuracy": win["test_accuracy"].median(),
            "pct_below_1": _pct_below_1(full), "pct_below_1_all": _pct_below_1(present[~short]),
            "mean_shard": shard, "T": local_steps(first["tau"], first["bs"], shard),
            "shard_min": win["shard_min"].min(), "shard_max": win["shard_max"].max(),
            **run_measurements(win, full), **run_finals(group),
            "cell_id": _cell_id(config),
        }
        row["T_min"] = local_steps(first["tau"], first["bs"], row["shard_min"])
        row["T_max"] = local_steps(first["tau"], first["bs"], row["shard_max"])
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
    return [c for c in frame.columns if is_config_column(c)]


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
    """One row per cell: the cell's keys (every cell-defining run-config key), T, T_min / T_max
    (over all its runs), the median across its runs (seeds) of each reported statistic and
    measurement; n_seeds, n_runs and n_incomplete count its runs, short_rounds sums theirs and
    n_many_short counts those flagged many_short; engine lists the engines its runs used.

    Sorted as the paper's tables: alpha descending, then batch size (numeric, then "full"), then tau.
    """
    extra = varying_keys(runs)
    keys = [k for k in run_config_columns(runs) if k not in NOT_CELL_KEYS and k != "alpha"]
    out = []
    for _, group in runs.groupby("cell_id", sort=False):
        first = group.iloc[0]
        n_k = group["mean_shard"].mean()
        engines = sorted({e for e in group.get("engine", []) if isinstance(e, str)})
        row = {
            "cell": first["cell"], "bs": first["bs"], "tau": int(first["tau"]), "alpha": float(first["alpha"]),
            "T": local_steps(first["tau"], first["bs"], n_k), "n_k": n_k,
            "T_min": group["T_min"].min(skipna=False), "T_max": group["T_max"].max(skipna=False),
            **{k: first[k] for k in keys},
            **{m: group[m].median() for m in REPORTED}, "pct_below_1_all": group["pct_below_1_all"].median(),
            **cell_measurements(group),
            "n_seeds": int(group["seed"].nunique()) if "seed" in group else len(group),
            "n_runs": len(group), "n_incomplete": int((~group["complete"].astype(bool)).sum()),
            "short_rounds": int(group["short_rounds"].sum()), "n_many_short": int(group["many_short"].sum()),
            "K_c": first["K_c"], "num_rounds": int(first["num_rounds"]), "window": int(first["window"]),
            "window_rounds": int(group["window_rounds"].min()), "full_rounds": int(group["full_rounds"].min()),
            "rounds_completed": int(group["rounds_completed"].min()), "engine": "/".join(engines) or None,
        }
        out.append(row)
    cells = pd.DataFrame(out)
    return in_paper_order(cells, extra)


def in_paper_order(cells: pd.DataFrame, extra: Sequence[str] = ()) -> pd.DataFrame:
    """``cells`` sorted as the paper's tables: by the ``extra`` keys, then alpha descending, batch size
    (numeric, then "full") and tau."""
    if cells.empty:
        return cells
    order = cells.assign(_a=-cells["alpha"].astype(float), _b=cells["bs"].map(bs_order))
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
# Printing

_FORMATS = {
    "recovery": "{:.3f}", "recovery_weighted": "{:.3f}", "mu2_hat": "{:.3g}", "sigma2_hat": "{:.3g}",
    "test_accuracy": "{:.3f}", "pct_below_1": "{:.1f}", "pct_below_1_all": "{:.1f}", "T": "{:.0f}",
    "T_min": "{:.0f}", "T_max": "{:.0f}", "alpha": "{:g}", "n_k": "{:.0f}",
}


def _fmt(column: str):
    if column.endswith("_ratio"):
        pattern = "{:.3f}"
    elif column.endswith(("_measured", "_flagged")):
        pattern = "{:.0f}"
    elif "_" in column and column.removesuffix("_ref") not in _FORMATS:
        pattern = "{:.3g}"  # a measurement or another statistic
    else:
        pattern = _FORMATS.get(column.removesuffix("_ref"), "{}")

    def fmt(value) -> str:
        if isinstance(value, float | np.floating) and math.isnan(value):
            return "-"
        if isinstance(value, bool | np.bool_ | int | np.integer) and pattern == "{:.3g}":
            return str(value)
        return pattern.format(value) if isinstance(value, int | float | np.number) else str(value)

    return fmt


def table_columns(cells: pd.DataFrame, measurements: bool = True) -> list[str]:
    """The per-cell table: keys, T and its range, the paper's statistics, pct_below_1_all,
    short_rounds, n_seeds, then (``measurements``) the curvature and flatness columns that have values."""
    main = ["bs", "tau", "T", "T_min", "T_max", "alpha", *varying_keys(cells), *REPORTED, "pct_below_1_all",
            "short_rounds", "n_seeds"]
    main = [c for c in main if c in cells]
    return [*main, *measurement_columns(cells)] if measurements else main


def format_table(cells: pd.DataFrame, columns: Sequence[str] | None = None) -> str:
    """The cell table as text, in cell_summary's order; a note column flags cells with incomplete
    runs, with short rounds left out of the recovery statistics, and with runs flagged many_short."""
    columns = list(columns or table_columns(cells))
    shown = cells[columns].copy()
    notes = [[] for _ in range(len(cells))]
    for i, (_, cell) in enumerate(cells.iterrows()):
        if cell.get("n_incomplete", 0):
            notes[i].append(f"{cell['n_incomplete']}/{cell['n_runs']} runs incomplete")
        if cell.get("short_rounds", 0):
            notes[i].append(f"{cell['short_rounds']} short rounds left out")
        if cell.get("n_many_short", 0):
            notes[i].append(f"{cell['n_many_short']} run(s) > {SHORT_ROUNDS_LIMIT:.0%} short")
    if any(notes):
        shown["note"] = ["; ".join(n) for n in notes]
    return shown.to_string(index=False, na_rep="-", formatters={c: _fmt(c) for c in columns})


def table_note(cells: pd.DataFrame) -> str:
    """What the table's columns are (the CLI prints it above the table)."""
    lines = [
        "per run: median over the window rounds; per cell: median across seeds. recovery, recovery_weighted, "
        "mu2_hat, sigma2_hat and pct_below_1(_all) use full rounds only (num_clients = K_c); short_rounds counts "
        "the window rounds with fewer good replies, left out (summed over a cell's runs); test_accuracy "
        "(a fraction) uses every window round.",
        "pct_below_1 = % of the window's full rounds with recovery < 1 (the paper's); pct_below_1_all = the same "
        "over all the run's full rounds.",
        "T = local SGD steps per round for the mean shard n_k of the window's cohorts (tau for bs=full, else "
        "tau*ceil(n_k/bs)); T_min-T_max = the range over the clients of the window's cohorts, from each run's "
        "shards.csv ('-' where a run has none).",
    ]
    if measurement_columns(cells):
        lines.append("curvature/flatness columns: median over the window rounds where measured (ρ_H, ρ_direct, "
                     "penalties: full rounds only); *_se = median per-round standard error; *_flagged = window "
                     "measurements whose ratio is not meaningful (denominator ≤ 0 or not significant) of *_measured.")
    return "\n".join(lines)
