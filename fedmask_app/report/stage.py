"""Runs compared at equal test accuracy rather than at equal rounds (``fedmask-report --at-accuracy``).

The recovery factor falls as training goes on, so two models, optimizers or data splits read at the
same round may be at different stages of training: a difference in 1/ΔS can be the stage, not the
configuration. Here each run is read where it first reaches a test accuracy: for a level a, the
first round r whose median test accuracy over rounds r − window + 1 .. r is at least a, and the
medians of the recovery statistics over the same rounds — the same window medians as
``run_summary``, over the window ending at r instead of the run's last round (full rounds only for
the recovery statistics, as there; rounds that were not evaluated are skipped). Where the window
would start before round 1 it starts there: ``window_rounds`` says how many rounds it held.

The curvature ratios read the same way (curvature_at_accuracy): per cell and level, the measured
full rounds of each run's window ending where it reaches the level, the cell's seeds together,
pooled as report/pooled.py pools a cell's last rounds, so ρ_H of two models can be set side by side
at one stage of training.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from fedmask_app.report.figures import log_recovery_axis
from fedmask_app.report.pooled import DERIVED_RATIOS, POOLED_RATIOS, pooled_summary
from fedmask_app.report.runs import full_rounds
from fedmask_app.report.tables import RECOVERY_METRICS
from fedmask_app.report.windows import format_interval, measured_full_rounds

AT_ACCURACY_COLUMNS = ("run", "run_name", "cell", "seed", "level", "round", "window_rounds", "test_accuracy",
                       *RECOVERY_METRICS, "sigma2_over_mu2")
_ACROSS_SEEDS = ("round", "test_accuracy", *RECOVERY_METRICS, "sigma2_over_mu2")
CELL_AT_ACCURACY_COLUMNS = ("cell", "level", "n_runs", "n_reached", *_ACROSS_SEEDS, "recovery_min", "recovery_max")
_INTERVALS = ("", "_low", "_high")
CURVATURE_AT_ACCURACY_COLUMNS = ("cell", "level", "n_runs", "n_reached", "round", "test_accuracy", "measured",
                                 "recovery_weighted", "sum_sq_weights", "rho_h_alone",
                                 *(f"{r}{part}" for r in [*POOLED_RATIOS, *DERIVED_RATIOS] for part in _INTERVALS))


def windowed_medians(group: pd.DataFrame, window: int) -> pd.DataFrame:
    """One run's rows (a load_runs group): per round r, the median over rounds r − window + 1 .. r
    of test accuracy (evaluated rounds) and of each recovery statistic (full rounds only), indexed by
    round; ``window_rounds``: how many of rounds 1 .. r that window holds."""
    rows = group.dropna(subset=["round"]).set_index("round").sort_index()
    if rows.empty:
        return pd.DataFrame(columns=["test_accuracy", *RECOVERY_METRICS, "window_rounds"])
    rounds = pd.RangeIndex(1, int(rows.index.max()) + 1, name="round")
    rows = rows.reindex(rounds)
    full = full_rounds(rows, group["K_c"].iloc[0])
    columns = {"test_accuracy": rows["test_accuracy"], **{m: rows[m].where(full) for m in RECOVERY_METRICS}}
    out = pd.DataFrame({name: values.rolling(window, min_periods=1).median() for name, values in columns.items()})
    out["window_rounds"] = np.minimum(rounds.to_numpy(), window)
    return out


def reaching_round(accuracy: pd.Series, level: float) -> int | None:
    """The first round (index of ``accuracy``, windowed medians) at which it is at least ``level``."""
    reached = accuracy.index[accuracy.to_numpy() >= level]
    return int(reached[0]) if len(reached) else None


def check_levels(levels: Sequence[float]) -> None:
    """Accuracy levels are fractions in (0, 1]: a ValueError names those that are not."""
    outside = [level for level in levels if not 0 < level <= 1]
    if outside:
        raise ValueError(f"levels are fractions in (0, 1], got {', '.join(map(str, outside))}")


def at_accuracy(rounds: pd.DataFrame, runs: pd.DataFrame, levels: Sequence[float], window: int) -> pd.DataFrame:
    """One row per run and level (AT_ACCURACY_COLUMNS): the first round the run's windowed median
    test accuracy reaches the level and the window medians there; round and statistics NaN for a
    run that never reaches it. ``runs``: ``run_summary(rounds, window)``, for each run's cell and seed.
    Runs in load order, levels ascending."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    check_levels(levels)
    summaries = runs.set_index("run")
    out = []
    for run, group in rounds.groupby("run", sort=False):
        medians = windowed_medians(group, window)
        summary = summaries.loc[run]
        for level in sorted(levels):
            r = reaching_round(medians["test_accuracy"], level)
            there = medians.loc[r] if r is not None else pd.Series(np.nan, index=medians.columns)
            row = {"run": run, "run_name": summary["run_name"], "cell": summary["cell"],
                   "seed": summary.get("seed", np.nan), "level": level,
                   "round": r if r is not None else np.nan, "window_rounds": there["window_rounds"],
                   "test_accuracy": there["test_accuracy"], **{m: there[m] for m in RECOVERY_METRICS}}
            row["sigma2_over_mu2"] = row["sigma2_hat"] / row["mu2_hat"] if row["mu2_hat"] else np.nan
            out.append(row)
    return pd.DataFrame(out, columns=list(AT_ACCURACY_COLUMNS))


def cell_at_accuracy(table: pd.DataFrame) -> pd.DataFrame:
    """One row per cell and level (CELL_AT_ACCURACY_COLUMNS) from ``at_accuracy``'s rows: the median
    across the cell's runs (seeds) that reach the level of the round, test accuracy and statistics
    there, and the range of their 1/ΔS; n_reached of n_runs reached it (all NaN when none did).
    Cells in order of first appearance, levels ascending."""
    out = []
    for (cell, level), group in table.groupby(["cell", "level"], sort=False):
        reached = group[group["round"].notna()]
        out.append({"cell": cell, "level": level, "n_runs": len(group), "n_reached": len(reached),
                    **{c: reached[c].median() for c in _ACROSS_SEEDS},
                    "recovery_min": reached["recovery"].min(), "recovery_max": reached["recovery"].max()})
    return pd.DataFrame(out, columns=list(CELL_AT_ACCURACY_COLUMNS))


def curvature_at_accuracy(rounds: pd.DataFrame, table: pd.DataFrame, seed: int = 0) -> pd.DataFrame:
    """One row per cell and level (CURVATURE_AT_ACCURACY_COLUMNS) of ``table`` (``at_accuracy``'s rows
    for ``rounds``): each of the cell's runs that reaches the level gives its measured full rounds
    (windows.measured_full_rounds) in rounds round − window_rounds + 1 .. round, where it first
    reaches it, and those rounds, its seeds together, give each POOLED_RATIOS ratio with its 95%
    interval (a generator seeded with ``seed`` anew for each cell, level and ratio, as in
    pooled_cells), the median 1/ΔS_w and W₂ over them, DERIVED_RATIOS and how many had a ρ_H measurable
    alone.
    ``round`` and ``test_accuracy``: medians across the runs that reach the level. Ratios NaN where no
    measured round falls in those windows; cells without a measured round at any level left out."""
    measured = measured_full_rounds(rounds)
    out = []
    for (cell, level), group in table.groupby(["cell", "level"], sort=False):
        reached = group[group["round"].notna()]
        in_windows = [measured[(measured["run"] == run["run"])
                               & measured["round"].between(run["round"] - run["window_rounds"] + 1, run["round"])]
                      for _, run in reached.iterrows()]
        rows = pd.concat(in_windows) if in_windows else measured.iloc[:0]
        row = {"cell": cell, "level": level, "n_runs": len(group), "n_reached": len(reached),
               "round": reached["round"].median(), "test_accuracy": reached["test_accuracy"].median(),
               "measured": len(rows), **pooled_summary(rows, seed)}
        out.append(row)
    frame = pd.DataFrame(out, columns=list(CURVATURE_AT_ACCURACY_COLUMNS))
    has_any = frame.groupby("cell", sort=False)["measured"].transform("sum") > 0
    return frame[has_any].reset_index(drop=True)


def format_curvature_at_accuracy(table: pd.DataFrame) -> str:
    """A curvature_at_accuracy table as text: each ratio as "value (low-high)"."""
    shown = table[["cell", "level", "n_reached", "n_runs", "round", "test_accuracy", "measured"]].copy()
    shown.insert(2, "reached", [f"{a} of {b}" for a, b in zip(shown.pop("n_reached"), shown.pop("n_runs"),
                                                                 strict=True)])
    shown["round"] = shown["round"].map(lambda v: f"{v:.0f}" if pd.notna(v) else "-")
    shown["test_accuracy"] = shown["test_accuracy"].map(lambda v: f"{v:.3f}")
    shown["1/dS_w"] = table["recovery_weighted"].map(lambda v: f"{v:.3f}")
    records = table.to_dict("records")
    for ratio in [*POOLED_RATIOS, *DERIVED_RATIOS]:
        shown[ratio] = [format_interval(r, ratio).strip() for r in records]
    return shown.to_string(index=False)


def recovery_accuracy_figure(rounds: pd.DataFrame, table: pd.DataFrame, window: int,
                             path: str | Path | None = None) -> Figure:
    """Per run, the windowed median 1/ΔS (y, log scale) against the windowed median test accuracy
    (x) round by round, with the rounds where it first reaches each level of ``table`` (``at_accuracy``)
    marked. Saved as PNG to ``path`` if given."""
    fig = Figure(figsize=(8.5, 5.2), layout="constrained")
    ax = fig.add_subplot()
    shown = []
    for i, (run, group) in enumerate(rounds.groupby("run", sort=False)):
        medians = windowed_medians(group, window).dropna(subset=["test_accuracy", "recovery"])
        shown += list(medians["recovery"][medians["recovery"] > 0])
        rows = table[table["run"] == run]
        marks = rows[rows["round"].notna()]
        colour = f"C{i % 10}"
        ax.plot(100 * medians["test_accuracy"], medians["recovery"], color=colour, linewidth=1.2,
                label=f"{rows['cell'].iloc[0]}, seed {rows['seed'].iloc[0]}")
        ax.scatter(100 * marks["test_accuracy"], marks["recovery"], color=colour, edgecolor="black", zorder=3, s=30)
    for level in sorted(table["level"].unique()):
        ax.axvline(100 * level, color="grey", linestyle=":", linewidth=0.8)
    if shown:
        log_recovery_axis(ax, min(shown) / 1.2, max(shown) * 1.2)
    ax.set_xlabel(f"test accuracy (%), median of the last {window} rounds")
    ax.set_ylabel(f"recovery factor 1/ΔS, median of the last {window} full rounds")
    ax.set_title("Recovery at equal test accuracy (dots: first round at each dotted level)", fontsize=10)
    ax.legend(fontsize=8)
    if path is not None:
        FigureCanvasAgg(fig).print_png(str(path))
    return fig
