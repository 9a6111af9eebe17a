"""The curvature ratios of one run, or of several runs pooled, window by window over training.

report/pooled.py reads a cell in the paper's window; this reads any windows of any runs: for each
window (first and last round), the runs' measured full rounds in it (full: num_clients = K_c;
measured: a curvature column has a value) pooled as pooled_ratio pools them, beside the median
1/ΔS_w of those rounds and the median test accuracy of every round of the window. The README's
curvature blocks print these tables; ``fedmask-report --curvature-windows`` prints and writes one
per cell (cell_windows).

One generator, passed in, draws every interval in order (window by window, ratio by ratio in
POOLED_RATIOS order): two tables drawn from one generator one after the other give the same
numbers each time, and a table's intervals depend on what was drawn before it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from fedmask_app.report.pooled import (
    DERIVED_RATIOS,
    POOLED_RATIOS,
    median_sum_sq_weights,
    pooled_ratios,
    rho_h_alone,
    rho_h_derived,
)
from fedmask_app.report.runs import SummaryError, full_rounds, load_runs
from fedmask_app.report.tables import in_paper_order, local_steps

WINDOWS = ((5, 50), (51, 100), (101, 150), (151, 200))


def window_ratios(run_dirs: Sequence[str | Path], rng: np.random.Generator,
                  windows: Sequence[tuple[int, int]] = WINDOWS,
                  ratios: Sequence[str] = tuple(POOLED_RATIOS)) -> pd.DataFrame:
    """One row per window of ``run_dirs`` (run folders) pooled: ``start``, ``end``, ``runs``,
    ``measured`` (the runs' measured full rounds in it), ``recovery_weighted`` (their median
    1/ΔS_w), each of ``ratios`` (POOLED_RATIOS keys) with ``<ratio>_low`` / ``<ratio>_high``,
    ``sum_sq_weights`` (their median W₂), DERIVED_RATIOS with their ends (rho_h_derived, when rho_h is
    among ``ratios``),
    ``rho_h_alone`` (measured rounds whose ρ_H is measurable alone: flag "ok") and
    ``test_accuracy`` (median over every round of the window, all runs)."""
    for run_dir in run_dirs:
        if not (Path(run_dir) / "rounds.csv").is_file():
            raise SummaryError(f"{run_dir} is not a run folder (no rounds.csv)")
    rounds = load_runs(run_dirs)
    if rounds["run"].nunique() != len(run_dirs):
        raise SummaryError(f"read {rounds['run'].nunique()} runs from {len(run_dirs)} folders: {list(run_dirs)}")
    return rounds_window_ratios(rounds, rng, windows, ratios)


def measured_full_rounds(rounds: pd.DataFrame) -> pd.DataFrame:
    """The rows of ``rounds`` (report.load_runs rows) that are full rounds (num_clients = K_c) and carry a
    curvature measurement (a value in a POOLED_RATIOS column): the rounds the pooled ratios read."""
    rounds = rounds.dropna(subset=["round"])
    columns = sorted({c for pair in POOLED_RATIOS.values() for c in pair} & set(rounds.columns))
    full = [full_rounds(rows, rows["K_c"].iloc[0]) for _, rows in rounds.groupby("run", sort=False)]
    return rounds[pd.concat(full) & rounds[columns].notna().any(axis=1)] if columns and full else rounds.iloc[:0]


def rounds_window_ratios(rounds: pd.DataFrame, rng: np.random.Generator,
                         windows: Sequence[tuple[int, int]] = WINDOWS,
                         ratios: Sequence[str] = tuple(POOLED_RATIOS)) -> pd.DataFrame:
    """window_ratios of the runs in ``rounds`` (report.load_runs rows), all of them pooled."""
    unknown = [r for r in ratios if r not in POOLED_RATIOS]
    if unknown:
        raise ValueError(f"unknown ratio(s) {unknown}; known: {list(POOLED_RATIOS)}")
    rounds = rounds.dropna(subset=["round"])
    measured = measured_full_rounds(rounds)
    out = []
    for start, end in windows:
        rows = measured[measured["round"].between(start, end)]
        row = {"start": start, "end": end, "runs": rounds["run"].nunique(), "measured": len(rows),
               "recovery_weighted": rows["recovery_weighted"].median(), "sum_sq_weights": median_sum_sq_weights(rows)}
        row.update(pooled_ratios(rows, ratios, rng))
        if "rho_h" in ratios:
            row.update(rho_h_derived(row))
        row["rho_h_alone"] = rho_h_alone(rows)
        row["test_accuracy"] = rounds.loc[rounds["round"].between(start, end), "test_accuracy"].median()
        out.append(row)
    return pd.DataFrame(out)


def cell_windows(rounds: pd.DataFrame, runs: pd.DataFrame, windows: Sequence[tuple[int, int]],
                 seed: int = 0) -> pd.DataFrame:
    """Per cell of ``runs`` (report.run_summary) that has measured rounds, its seeds' window_ratios
    in ``windows``, each row led by the cell's label, keys and T (as in report.pooled_cells). Each
    cell draws from a generator of its own seeded with ``seed``, so a cell's intervals do not
    depend on which other runs are read with it."""
    out = []
    for _, group in runs.groupby("cell_id", sort=False):
        table = rounds_window_ratios(rounds[rounds["run"].isin(group["run"])], np.random.default_rng(seed), windows)
        if not table["measured"].any():
            continue
        first = group.iloc[0]
        keys = {"cell": first["cell"], "bs": first["bs"], "tau": first["tau"], "alpha": first["alpha"],
                "T": local_steps(first["tau"], first["bs"], group["mean_shard"].mean())}
        out.append(table.assign(**keys)[[*keys, *table.columns]])
    if not out:
        return pd.DataFrame()
    return in_paper_order(pd.concat(out, ignore_index=True))  # stable: a cell's windows stay in order


def parse_window(text: str) -> tuple[int, int]:
    """A window as the command line writes it, "FIRST-LAST" (rounds, 1 <= FIRST <= LAST)."""
    first, _, last = text.partition("-")
    if not (first.isdigit() and last.isdigit()) or not 1 <= int(first) <= int(last):
        raise ValueError(f"a window is FIRST-LAST, two rounds with 1 <= FIRST <= LAST (e.g. 151-200), got {text!r}")
    return int(first), int(last)


def format_interval(row: Mapping, ratio: str) -> str:
    """``ratio`` of a window_ratios row (a record) and its interval, as the README's blocks print
    them: " 1.23 ( 1.10- 1.37)"."""
    return f"{row[ratio]:5.2f} ({row[f'{ratio}_low']:5.2f}-{row[f'{ratio}_high']:5.2f})"


def format_windows(table: pd.DataFrame, label: str) -> str:
    """A window_ratios table (with every POOLED_RATIOS ratio) as text, one line per window under a
    header that starts with ``label`` (e.g. "bs 128, tau 1, seed 0")."""
    lines = [f"{label} | rounds | 1/dS_w | rho_H | rho_direct | measured/predicted penalty: sync, ind | test acc."]
    for row in table.to_dict("records"):
        lines.append(f"  {row['start']:3}-{row['end']} | {row['recovery_weighted']:5.2f}"
                     f" | {format_interval(row, 'rho_h')} | {format_interval(row, 'rho_direct')}"
                     f" | {format_interval(row, 'expansion_sync')}, {format_interval(row, 'expansion_ind')}"
                     f" | {row['test_accuracy']:.3f} | rho_H measurable alone in {row['rho_h_alone']}"
                     f" of {row['measured']} rounds")
    return "\n".join(lines)


def format_excess(table: pd.DataFrame, label: str = "rho_H - 1 over 1/dS_w - 1") -> str:
    """A window_ratios table's rho_h_excess on one line after ``label``: "LABEL: rounds 5-50 2.1,
    rounds 51-100 6.4"."""
    windows = (f"rounds {row['start']}-{row['end']} {row['rho_h_excess']:.1f}" for row in table.to_dict("records"))
    return f"{label}: " + ", ".join(windows)


def format_pooled_windows(table: pd.DataFrame, label: str) -> str:
    """A window_ratios table of several runs as text, one sentence-like line per window starting
    with ``label`` (e.g. "seeds 0 and 1"); the expansion ratios when the table has them."""
    lines = []
    for row in table.to_dict("records"):
        line = (f"{label} pooled, their {row['measured']} measured rounds in {row['start']}-{row['end']}:"
                f" 1/dS_w {row['recovery_weighted']:.2f}, rho_H {format_interval(row, 'rho_h')},"
                f" rho_direct {format_interval(row, 'rho_direct')}")
        if "expansion_sync" in row and "expansion_ind" in row:
            line += (f", measured/predicted {format_interval(row, 'expansion_sync')} (sync),"
                     f" {format_interval(row, 'expansion_ind')} (ind)")
        lines.append(line)
    return "\n".join(lines)


def format_cell_windows(table: pd.DataFrame) -> str:
    """A cell_windows table as text: each ratio as "value (low-high)"."""
    shown = table[["cell", "T", "runs", "start", "end", "measured", "recovery_weighted", "rho_h_alone"]].copy()
    shown.insert(3, "rounds", [f"{a}-{b}" for a, b in zip(shown.pop("start"), shown.pop("end"), strict=True)])
    shown["T"] = shown["T"].map(lambda v: f"{v:.0f}")
    shown["recovery_weighted"] = shown["recovery_weighted"].map(lambda v: f"{v:.3f}")
    records = table.to_dict("records")
    for ratio in [*POOLED_RATIOS, *DERIVED_RATIOS]:
        shown[ratio] = [f"{r[ratio]:.2f} ({r[f'{ratio}_low']:.2f}-{r[f'{ratio}_high']:.2f})" for r in records]
    shown["test_accuracy"] = table["test_accuracy"].map(lambda v: f"{v:.3f}")
    return shown.to_string(index=False)
