"""Does masking help? Cells that differ in how they train (mask-mode, keep-prob, server-step,
keep-prob-schedule, mask-granularity; runs without these keys count as none / 0.5 / fedavg /
fixed / tensor) side by side.

Per run (``run_finals``, part of run_summary): the test accuracy of the last round that has one
(final) and the best over all rounds, the last train loss, and λ_max and tr H at the last round
where they were measured. Per cell (``comparison_table``): the median across seeds of these and of
the window-median 1/ΔS, with the spread across seeds as min and max (``<column>_min``,
``<column>_max``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from fedmask_app.report.runs import bs_order

TRAINING_KEYS = ("mask-mode", "keep-prob", "server-step", "keep-prob-schedule", "mask-granularity")
FINALS = ("final_test_accuracy", "best_test_accuracy", "final_train_loss", "final_lambda_max", "final_trace")
COMPARED = (*FINALS, "recovery")
SPREAD_NOTE = "median across seeds; spread = min-max across seeds"


def _last(group: pd.DataFrame, column: str) -> float:
    if column not in group:
        return float("nan")
    values = pd.to_numeric(group.sort_values("round")[column], errors="coerce").dropna()
    return float(values.iloc[-1]) if len(values) else float("nan")


def run_finals(group: pd.DataFrame) -> dict:
    """One run's final and best values (its rounds, all of them, not only the window)."""
    done = group.dropna(subset=["round"])
    accuracy = pd.to_numeric(done.get("test_accuracy", pd.Series(dtype=float)), errors="coerce")
    return {
        "final_test_accuracy": _last(done, "test_accuracy"), "best_test_accuracy": float(accuracy.max()),
        "final_train_loss": _last(done, "train_loss"), "final_lambda_max": _last(done, "hessian_lambda_max"),
        "final_trace": _last(done, "hessian_trace"),
    }


def compares_training(runs: pd.DataFrame) -> bool:
    """Whether the runs differ in mask-mode, server-step or mask-granularity (the CLI then writes comparison.*)."""
    return any(k in runs and runs[k].map(str).nunique() > 1 for k in ("mask-mode", "server-step", "mask-granularity"))


def comparison_table(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per cell (run_summary's cells): bs, tau, its training keys, n_seeds, n_incomplete, and
    for each of COMPARED the median across seeds with ``_min`` / ``_max`` (SPREAD_NOTE). Cells of one
    (bs, tau) together, as the per-cell table sorts them, and within them unmasked FedAvg first."""
    out = []
    for _, group in runs.groupby("cell_id", sort=False):
        first = group.iloc[0]
        row = {"cell": first["cell"], "bs": first.get("bs"), "tau": first.get("tau"),
               **{k: first.get(k) for k in (*TRAINING_KEYS, "penalty-target")}, "training": training_label(first),
               "n_seeds": int(group["seed"].nunique()) if "seed" in group else len(group),
               "n_incomplete": int((~group["complete"].astype(bool)).sum())}
        for column in COMPARED:
            values = pd.to_numeric(group[column], errors="coerce") if column in group else pd.Series([np.nan])
            row.update({column: values.median(), f"{column}_min": values.min(), f"{column}_max": values.max()})
        out.append(row)
    table = pd.DataFrame(out)
    if table.empty:
        return table
    def order(i: int) -> tuple:
        mask, p, step, schedule, granularity = (str(table.iloc[i][k]) for k in TRAINING_KEYS)
        setting = bs_order(str(table.iloc[i]["bs"])), str(table.iloc[i]["tau"])
        return setting, mask != "none", mask, granularity != "tensor", step != "fedavg", step, schedule != "fixed", p

    return table.iloc[sorted(range(len(table)), key=order)].reset_index(drop=True)


def training_label(row) -> str:
    """How a cell trains, briefly: "no mask", "indep. p=0.5", "sync. calibrated c=0.025",
    "indep. p=0.5 per coord.", "no mask FedExP"."""
    mask = str(row.get("mask-mode", "none"))
    parts = ["no mask" if mask == "none" else {"independent": "indep.", "synchronized": "sync."}.get(mask, mask)]
    if mask != "none":
        if str(row.get("keep-prob-schedule", "fixed")) == "calibrated":
            parts.append(f"calibrated c={float(row.get('penalty-target')):g}")
        else:
            parts.append(f"p={float(row.get('keep-prob')):g}")
        if str(row.get("mask-granularity", "tensor")) == "coordinate":
            parts.append("per coord.")
    if str(row.get("server-step", "fedavg")) != "fedavg":
        parts.append("FedExP" if row.get("server-step") == "fedexp" else str(row.get("server-step")))
    return " ".join(parts)


def format_comparison(table: pd.DataFrame) -> str:
    """comparison_table as text: bs, tau, the training label and each compared column as
    "median [min, max]"."""
    shown = table[["bs", "tau", "training", "n_seeds"]].copy()
    for column in COMPARED:
        shown[column] = [f"{m:.4g} [{lo:.4g}, {hi:.4g}]" if np.isfinite(m) else "-" for m, lo, hi in zip(
            table[column], table[f"{column}_min"], table[f"{column}_max"], strict=True)]
    return shown.to_string(index=False)


def comparison_figure(rounds: pd.DataFrame, runs: pd.DataFrame, path: str | Path | None = None) -> Figure:
    """One row of panels per (bs, tau). Left: test accuracy over rounds per cell (median across
    seeds, min-max shaded). Right: the final λ_max per cell (median across seeds, min-max error
    bars). Saved as PNG to ``path`` if given."""
    table = comparison_table(runs)
    settings = list(dict.fromkeys(zip(table["bs"], table["tau"], strict=True)))
    fig = Figure(figsize=(13, 4.2 * len(settings)), layout="constrained")
    panels = fig.subplots(len(settings), 2, width_ratios=(1.4, 1), squeeze=False)
    labelled = rounds.dropna(subset=["round"]).merge(runs[["run", "cell"]], on="run")
    labelled = labelled.assign(test_accuracy=pd.to_numeric(labelled["test_accuracy"], errors="coerce"))
    per_round = labelled.dropna(subset=["test_accuracy"]).groupby(["cell", "round"])["test_accuracy"]
    stats = per_round.agg(["median", "min", "max"]).reset_index()
    for (curves, bars), (bs, tau) in zip(panels, settings, strict=True):
        cells = table[(table["bs"] == bs) & (table["tau"] == tau)].reset_index(drop=True)
        for i, cell in cells.iterrows():
            part = stats[stats["cell"] == cell["cell"]]
            colour = f"C{i % 10}"
            curves.plot(part["round"], 100 * part["median"], color=colour, label=cell["training"])
            curves.fill_between(part["round"], 100 * part["min"], 100 * part["max"], color=colour, alpha=0.2)
        curves.set(xlabel="round", ylabel="test accuracy (%)", title=f"bs={bs} τ={tau}: test accuracy")
        curves.legend(fontsize=8)
        x = np.arange(len(cells))
        values = cells["final_lambda_max"].to_numpy(dtype=float)
        if np.isfinite(values).any():
            err = np.vstack([values - cells["final_lambda_max_min"], cells["final_lambda_max_max"] - values])
            bars.bar(x, values, yerr=np.nan_to_num(err), capsize=4, color=[f"C{i % 10}" for i in x])
        else:
            bars.text(0.5, 0.5, "no λ_max measured", ha="center", va="center", transform=bars.transAxes)
        bars.set_xticks(x, cells["training"], rotation=25, ha="right", fontsize=8)
        bars.set(ylabel="λ_max of the Hessian", title=f"bs={bs} τ={tau}: λ_max at the last measured round")
    fig.suptitle(f"Does masking help? {SPREAD_NOTE}", fontsize=10)
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig
