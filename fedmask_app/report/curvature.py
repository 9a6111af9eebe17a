"""The server's curvature and flatness measurements (fedmask_app/measure) in the report: per-run
window medians, per-cell medians across seeds, and the curvature figure.

The measurements run every N rounds, so these rounds.csv columns are empty on most rounds (and
absent from older runs): a run's value is the median over the window rounds where the column has a
value, NaN if none has; a column no run has is left out.

* Columns that compare the mean update with the client updates (MEASURES_COHORT: Q sums, ρ_H, the
  direct penalties, ρ_direct and their predictions) are taken over the window's *full* rounds only
  (num_clients = K_c), like the recovery factor: a short round has a lower ceiling.
* Columns of the model or the server step (MEASURES_MODEL: λ_max, tr H, FedExP's η_g, the round's
  keep-prob) are taken over all window rounds.
* ``*_se`` columns are standard errors of one round's estimate; their window median is "a typical
  round's standard error", not the standard error of the median.
* The ratio flags (FLAGS: "ok", "denominator_nonpositive", "denominator_not_significant") give
  ``<ratio>_measured`` (window full rounds with a flag) and ``<ratio>_flagged`` (those not "ok",
  whose ratio and its standard error are left out of the medians); a cell sums them over its runs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from fedmask_app.report.figures import log_recovery_axis
from fedmask_app.report.runs import full_rounds

MEASURES_COHORT = (
    "q_mean", "q_mean_se", "q_clients", "q_clients_se", "rho_h", "rho_h_se", "penalty_sync", "penalty_sync_se",
    "penalty_ind", "penalty_ind_se", "rho_direct", "rho_direct_se", "penalty_sync_pred", "penalty_ind_pred",
)
MEASURES_MODEL = ("hessian_lambda_max", "hessian_trace", "hessian_trace_se", "server_lr", "keep_prob_round")
MEASURES = (*MEASURES_COHORT, *MEASURES_MODEL)
FLAGS = {"rho_h_flag": "rho_h", "rho_direct_flag": "rho_direct"}
FLAG_OK = "ok"
# Flag counts a run and a cell report.
FLAG_COUNTS = tuple(f"{ratio}_{kind}" for ratio in FLAGS.values() for kind in ("measured", "flagged"))


def run_measurements(window: pd.DataFrame, full: pd.DataFrame) -> dict:
    """A run's window medians of the measurement columns it has, and its flag counts.

    ``window``: the run's window rounds; ``full``: those of them with num_clients = K_c."""
    out = {}
    full = without_flagged_ratios(full)
    for columns, rows in ((MEASURES_COHORT, full), (MEASURES_MODEL, window)):
        for column in columns:
            if column in rows:
                out[column] = pd.to_numeric(rows[column], errors="coerce").median()
    for flag, ratio in FLAGS.items():
        if flag in full:
            flags = [f for f in map(_flag, full[flag]) if f]
            out[f"{ratio}_measured"] = len(flags)
            out[f"{ratio}_flagged"] = sum(f != FLAG_OK for f in flags)
    return out


def without_flagged_ratios(rows: pd.DataFrame) -> pd.DataFrame:
    """A copy of ``rows`` with each ratio flagged not meaningful, and its standard error, set to NaN
    (measure/ writes such a ratio NaN already; older runs may hold a value)."""
    rows = rows.copy()
    for flag, ratio in FLAGS.items():
        if flag in rows:
            bad = rows[flag].map(lambda v: _flag(v) not in ("", FLAG_OK)).astype(bool)
            rows.loc[bad, [c for c in (ratio, f"{ratio}_se") if c in rows]] = np.nan
    return rows


def _flag(value) -> str:
    """A flag cell as text, "" when empty (an all-empty column reads as float NaN)."""
    return value.strip() if isinstance(value, str) else ""


def cell_measurements(group: pd.DataFrame) -> dict:
    """A cell's median across its runs of each measurement column, and its runs' summed flag counts."""
    out = {c: group[c].median() for c in MEASURES if c in group}
    out.update({c: group[c].sum(min_count=1) for c in FLAG_COUNTS if c in group})
    return out


def measurement_columns(frame: pd.DataFrame) -> list[str]:
    """The measurement columns of a run or cell frame that say something, and the flag counts of
    the ratios among them. A column says something when it holds a value; server_lr only when one
    differs from FedAvg's η_g = 1, which every run without a server step writes."""

    def informative(column: str) -> bool:
        values = frame[column].dropna() if column in frame else pd.Series(dtype=float)
        return bool(len(values)) and (column != "server_lr" or bool((values != 1.0).any()))

    measured = [c for c in MEASURES if informative(c)]
    return [*measured, *(c for c in FLAG_COUNTS if c in frame and c.rsplit("_", 1)[0] in measured)]


def has_curvature(frame: pd.DataFrame) -> bool:
    """Whether any row (of load_runs' rounds, say) has a ρ_H value (the CLI then writes curvature.png)."""
    return "rho_h" in frame and bool(frame["rho_h"].notna().any())


ERROR_BAR_NOTE = ("error bars: the median over the window (per run, then across seeds) of the per-round standard "
                  "error; 1/ΔS_w is exact (no bar)")


def measured_rounds(group: pd.DataFrame) -> pd.DataFrame:
    """One run's full rounds (num_clients = K_c) that have a ρ_H column value or a penalty, by round,
    with a flagged ratio and its standard error set to NaN (as in the window medians)."""
    rows = group.dropna(subset=["round"]).sort_values("round")
    rows = without_flagged_ratios(rows[full_rounds(rows, group["K_c"].iloc[0])])
    columns = [c for c in ("rho_h", "penalty_sync", "penalty_ind") if c in rows]
    for column in [*MEASURES_COHORT, "recovery_weighted"]:
        if column in rows:
            rows[column] = pd.to_numeric(rows[column], errors="coerce")
    return rows[rows[columns].notna().any(axis=1)] if columns else rows.iloc[:0]


def curvature_rounds_figure(rounds: pd.DataFrame, path: str | Path | None = None) -> Figure:
    """Round by round, one column per run that measured: top, 1/ΔS_w (Euclidean, exact), ρ_H ± s.e.
    and ρ_direct ± s.e. at the measured full rounds (flagged ratios left out); bottom, the measured
    direct penalty over its second-order prediction (1−p)/(2p)·Q, synchronized and independent
    masks, ± the penalty's s.e. over the prediction. Saved as PNG if ``path``."""
    runs = [(name, measured_rounds(group)) for name, group in rounds.groupby("run_name", sort=False)]
    runs = [(name, rows) for name, rows in runs if len(rows)]
    fig = Figure(figsize=(max(6.0, 4.8 * len(runs)), 7.5), layout="constrained")
    axes = fig.subplots(2, max(1, len(runs)), squeeze=False, sharex="col")
    for j, (name, rows) in enumerate(runs):
        top, bottom = axes[0, j], axes[1, j]
        x = rows["round"].to_numpy(dtype=float)
        shown = []
        for i, (column, se, label) in enumerate((("recovery_weighted", None, "1/ΔS_w (Euclidean)"),
                                                  ("rho_h", "rho_h_se", "ρ_H (Hessian)"),
                                                  ("rho_direct", "rho_direct_se", "ρ_direct (measured)"))):
            if column not in rows:
                continue
            y = rows[column].to_numpy(dtype=float)
            err = rows[se].to_numpy(dtype=float) if se and se in rows else None
            top.errorbar(x + (i - 1) * 0.4, y, yerr=err, fmt="o-" if se is None else "o", markersize=3.5,
                         linewidth=1, capsize=2, color=f"C{i}", label=label)
            spread = np.nan_to_num(err) if err is not None else 0.0
            shown += [v for v in (*(y - spread), *(y + spread)) if np.isfinite(v)]
        if shown and min(shown) > 0:
            log_recovery_axis(top, min(shown) / 1.2, max(shown) * 1.2)
        top.axhline(1, color="grey", linestyle=":", linewidth=1)
        top.set_title(name, fontsize=8)
        top.set_ylabel("share of the penalty that survives averaging")
        top.legend(fontsize=7)
        for i, (mode, label) in enumerate((("sync", "synchronized"), ("ind", "independent"))):
            measured, predicted, se = f"penalty_{mode}", f"penalty_{mode}_pred", f"penalty_{mode}_se"
            if measured not in rows or predicted not in rows:
                continue
            pred = rows[predicted].to_numpy(dtype=float)
            ratio = rows[measured].to_numpy(dtype=float) / pred
            err = rows[se].to_numpy(dtype=float) / np.abs(pred) if se in rows else None
            bottom.errorbar(x + (i - 0.5) * 0.4, ratio, yerr=err, fmt="os"[i], markersize=3.5, capsize=2,
                            color=f"C{i + 3}", label=label)
        bottom.axhline(1, color="grey", linestyle=":", linewidth=1)
        bottom.set_xlabel("round")
        bottom.set_ylabel("measured penalty / second-order prediction")
        if bottom.get_legend_handles_labels()[0]:
            bottom.legend(fontsize=7)
    if not runs:
        axes[0, 0].text(0.5, 0.5, "no run measured curvature", ha="center", va="center",
                        transform=axes[0, 0].transAxes)
    fig.suptitle("Curvature over rounds (full rounds only; error bars: that round's standard error)", fontsize=10)
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def curvature_figure(cells: pd.DataFrame, path: str | Path | None = None) -> Figure:
    """Left: per cell, 1/ΔS_w (Euclidean), ρ_H (Hessian-weighted) and ρ_direct (measured penalties)
    side by side, with ERROR_BAR_NOTE's error bars. Right: the measured direct penalty against its
    second-order prediction (1−p)/(2p)·Q, synchronized (o) and independent (s) masks, one colour per
    cell, with y = x; log-log when every value is positive, else symlog. Saved as PNG if ``path``."""
    fig = Figure(figsize=(13, 5.2), layout="constrained")
    bars, scatter = fig.subplots(1, 2, width_ratios=(1.3, 1))
    labels = list(cells["cell"]) if "cell" in cells else [str(i) for i in range(len(cells))]
    x = np.arange(len(cells))
    series = (("recovery_weighted", None, "1/ΔS_w (Euclidean)"), ("rho_h", "rho_h_se", "ρ_H (Hessian)"),
              ("rho_direct", "rho_direct_se", "ρ_direct (measured penalties)"))
    width = 0.8 / len(series)
    for i, (column, se, name) in enumerate(series):
        if column not in cells:
            continue
        err = cells[se].to_numpy(dtype=float) if se in cells else None
        bars.bar(x + (i - 1) * width, cells[column].to_numpy(dtype=float), width, yerr=err, capsize=3,
                 label=name, color=f"C{i}")
    bars.axhline(1, color="grey", linestyle=":", linewidth=1)
    bars.set_xticks(x, labels, rotation=25, ha="right", fontsize=8)
    bars.set_ylabel("share of the penalty that survives averaging (R_shr / R_ind)")
    bars.legend(fontsize=8)
    bars.set_title("Recovery: Euclidean, Hessian-weighted, measured", fontsize=10)

    points = []
    for mode, marker in (("sync", "o"), ("ind", "s")):
        measured, predicted, se = f"penalty_{mode}", f"penalty_{mode}_pred", f"penalty_{mode}_se"
        if measured not in cells or predicted not in cells:
            continue
        for j, (_, row) in enumerate(cells.iterrows()):
            xv, yv = float(row[predicted]), float(row[measured])
            if not (np.isfinite(xv) and np.isfinite(yv)):
                continue
            err = float(row[se]) if se in cells and np.isfinite(row[se]) else None
            scatter.errorbar(xv, yv, yerr=err, fmt=marker, color=f"C{j % 10}", capsize=3, markeredgecolor="black",
                             label=f"{labels[j]} ({'synchronized' if mode == 'sync' else 'independent'})")
            points += [xv, yv]
    if points:
        values = np.asarray(points)
        low, high = values.min(), values.max()
        if low > 0:
            scatter.set_xscale("log")
            scatter.set_yscale("log")
            line = np.geomspace(low / 1.5, high * 1.5, 50)
        else:
            nonzero = np.abs(values[values != 0])
            thresh = float(nonzero.min()) if len(nonzero) else 1.0
            scatter.set_xscale("symlog", linthresh=thresh)
            scatter.set_yscale("symlog", linthresh=thresh)
            pad = 0.1 * (high - low) or 1.0
            line = np.linspace(low - pad, high + pad, 200)
        scatter.plot(line, line, color="black", linewidth=1, label="y = x")
        scatter.legend(fontsize=7, loc="upper left")
    else:
        scatter.text(0.5, 0.5, "no direct penalty measured", ha="center", va="center", transform=scatter.transAxes)
    scatter.set_xlabel("second-order prediction (1−p)/(2p)·Q")
    scatter.set_ylabel("measured penalty E[l(θ − Δ̃)] − l(θ')")
    scatter.set_title("Direct penalty vs prediction (o synchronized, s independent)", fontsize=10)
    fig.suptitle(f"Curvature: per run the window median, per cell the median across seeds\n{ERROR_BAR_NOTE}",
                 fontsize=10)
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def curvature_windows_figure(table: pd.DataFrame, path: str | Path | None = None) -> Figure:
    """A cell_windows table (report/windows.py) drawn window by window, one colour per cell, x the
    window's middle round: left, ρ_H with its 95% interval (filled) against 1/ΔS_w (open, dashed);
    right, κ (disagreement_curvature) with its interval against 1, the Euclidean proxy. κ's axis
    spans its values and 0 to 1.5; an interval that runs past it is cut off. Saved as PNG if
    ``path``."""
    fig = Figure(figsize=(13, 5.2), layout="constrained")
    recovery, kappa = fig.subplots(1, 2)
    cells = list(dict.fromkeys(table["cell"]))
    widths = (table["end"] - table["start"]).to_numpy(dtype=float)
    nudge = 0.25 * (float(np.nanmin(widths)) + 1 if len(widths) else 1.0) / max(1, len(cells))
    shown, kappas = [], []
    for i, cell in enumerate(cells):
        rows = table[table["cell"] == cell]
        x = (rows["start"] + rows["end"]).to_numpy(dtype=float) / 2 + (i - (len(cells) - 1) / 2) * nudge
        colour, label = f"C{i % 10}", f"{cell}, T {rows['T'].iloc[0]:.0f}"
        for axis, column, values in ((recovery, "rho_h", shown), (kappa, "disagreement_curvature", kappas)):
            y = rows[column].to_numpy(dtype=float)
            ends = np.abs(np.vstack([y - rows[f"{column}_low"].to_numpy(dtype=float),
                                     rows[f"{column}_high"].to_numpy(dtype=float) - y]))
            axis.errorbar(x, y, yerr=np.nan_to_num(ends), fmt="o-", markersize=4, linewidth=1, capsize=3,
                          color=colour, label=label)
            values += [v for v in y if np.isfinite(v)]
        euclidean = rows["recovery_weighted"].to_numpy(dtype=float)
        recovery.plot(x, euclidean, "o--", markersize=4, linewidth=1, color=colour, markerfacecolor="white")
        shown += [v for v in euclidean if np.isfinite(v)]
    if shown and min(shown) > 0:
        log_recovery_axis(recovery, min(shown) / 1.2, max(shown) * 1.2)
    recovery.axhline(1, color="grey", linestyle=":", linewidth=1)
    recovery.set_xlabel("window (its middle round)")
    recovery.set_ylabel("ρ_H (filled, 95% interval) and 1/ΔS_w (open, dashed)")
    recovery.set_title("Curvature-weighted against Euclidean recovery, window by window", fontsize=10)
    recovery.legend(fontsize=7)
    kappa.axhline(1, color="black", linestyle=":", linewidth=1, label="κ = 1: the Euclidean proxy")
    if kappas:
        kappa.set_ylim(min(0.0, min(kappas)) - 0.1, max(1.5, max(kappas)) + 0.25)
    kappa.set_xlabel("window (its middle round)")
    kappa.set_ylabel("κ: curvature along the disagreement / along the mean update")
    kappa.set_title("Where the clients disagree: κ < 1 flatter, κ > 1 sharper than the mean update", fontsize=10)
    kappa.legend(fontsize=7)
    fig.suptitle("Curvature per cell in each window (seeds pooled; intervals from resampling the measured rounds)",
                 fontsize=10)
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig
