"""λ_max of the global model against the edge of stability, round by round.

Full-batch gradient descent with step η is stable along a direction of curvature λ only while
λ < 2/η; trained at a fixed step, networks sharpen until λ_max reaches 2/η and then hover there (the
edge of stability, Cohen et al., ICLR 2021). Where a round is one such step of the global model
(batch-size full, local-epochs 1, plain SGD, no masks, no augmentation), it moves θ by
η_g · lr · Σ_k w_k ∇l_k(θ), so its edge is 2 / (lr · η_g), η_g the round's server_lr. Other rounds
(minibatches, several local steps, momentum, weight decay, masks) have no such single threshold:
NaN. Every run has the edge of one local step instead: SGD with step η, heavy-ball momentum β and
weight decay λ_wd is stable along a direction of curvature λ only while η(λ + λ_wd) < 2(1 + β), so
its step edge is 2(1 + β)/η − λ_wd; exact for full-batch local steps, a reference for minibatch
ones (whose own stability depends on the minibatches' curvature, not the full loss's). λ_max itself
(flatness-every) is measured on the probe batch, not on the cohort's data.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from fedmask_app.report.runs import CONFIG_DEFAULTS, full_rounds

SHARPNESS_NOTE = ("(lambda_max of the global model on the probe batch) against the edge of stability "
                  "2 / (lr * server_lr), where a round is one plain full-batch step, and a local SGD step's "
                  "edge 2 (1 + momentum) / lr - weight-decay")
SHARPNESS_COLUMNS = ("run_name", "model", "lr", "edge", "step_edge", "measured", "first_round", "lambda_max_first",
                     "lambda_max_max", "lambda_max_last", "first_round_at_edge", "first_round_at_step_edge")


def _config(rounds: pd.DataFrame, key: str) -> pd.Series:
    """A run-config column of rounds; where the frame lacks it, its CONFIG_DEFAULTS value (as load_runs
    fills in for older runs), NaN for a key without one."""
    return rounds[key] if key in rounds else pd.Series(CONFIG_DEFAULTS.get(key, np.nan), index=rounds.index)


def one_gd_step(rounds: pd.DataFrame) -> pd.Series:
    """Per row of load_runs' rounds: whether its round is one plain full-batch gradient step."""
    plain = (_config(rounds, "momentum").eq(0) & _config(rounds, "weight-decay").eq(0)
             & _config(rounds, "mask-mode").eq("none") & _config(rounds, "augment").eq("none"))
    return rounds["bs"].eq("full") & rounds["tau"].eq(1) & plain


def stability_edge(rounds: pd.DataFrame) -> pd.Series:
    """Per row, 2 / (lr · server_lr) where the round is one plain full-batch gradient step (one_gd_step),
    server_lr 1 where not recorded; NaN elsewhere, and where the run records no lr."""
    server_lr = pd.to_numeric(rounds["server_lr"], errors="coerce").fillna(1.0) if "server_lr" in rounds else 1.0
    edge = 2.0 / (pd.to_numeric(_config(rounds, "lr"), errors="coerce") * server_lr)
    return edge.where(one_gd_step(rounds))


def step_edge(rounds: pd.DataFrame) -> pd.Series:
    """Per row, the edge of one local SGD step: 2 (1 + momentum) / lr − weight-decay (NaN without an lr)."""
    number = {key: pd.to_numeric(_config(rounds, key), errors="coerce") for key in ("lr", "momentum", "weight-decay")}
    return 2.0 * (1.0 + number["momentum"]) / number["lr"] - number["weight-decay"]


def _first_round_at(rows: pd.DataFrame, edge: pd.Series) -> float:
    reached = rows.loc[rows["hessian_lambda_max"] >= edge, "round"]
    return reached.iloc[0] if len(reached) else np.nan


def sharpness_rows(rounds: pd.DataFrame) -> pd.DataFrame:
    """The rounds that measured λ_max, by run and round, with ``edge`` (stability_edge) and ``step_edge``."""
    if "hessian_lambda_max" not in rounds:
        return rounds.iloc[:0].assign(edge=pd.Series(dtype=float), step_edge=pd.Series(dtype=float))
    rows = rounds.assign(hessian_lambda_max=pd.to_numeric(rounds["hessian_lambda_max"], errors="coerce"),
                         edge=stability_edge(rounds), step_edge=step_edge(rounds))
    return rows[rows["hessian_lambda_max"].notna()].sort_values(["run", "round"], kind="stable")


def sharpness_table(rounds: pd.DataFrame) -> pd.DataFrame:
    """One row per run that measured λ_max (SHARPNESS_COLUMNS): its model and lr, the median edge and step edge
    over those rounds (NaN where its rounds have none), how many were measured and the first, λ_max at the
    first, largest and last, and the first measured round with λ_max at or above each edge (NaN: none)."""
    out = []
    for _, rows in sharpness_rows(rounds).groupby("run", sort=False):
        lam = rows["hessian_lambda_max"]
        out.append({"run_name": rows["run_name"].iloc[0], "model": _config(rows, "model").iloc[0],
                    "lr": _config(rows, "lr").iloc[0], "edge": rows["edge"].median(),
                    "step_edge": rows["step_edge"].median(), "measured": len(rows),
                    "first_round": rows["round"].iloc[0],
                    "lambda_max_first": lam.iloc[0], "lambda_max_max": lam.max(), "lambda_max_last": lam.iloc[-1],
                    "first_round_at_edge": _first_round_at(rows, rows["edge"]),
                    "first_round_at_step_edge": _first_round_at(rows, rows["step_edge"])})
    return pd.DataFrame(out, columns=list(SHARPNESS_COLUMNS))


def sharpness_figure(rounds: pd.DataFrame, path: str | Path | None = None) -> Figure:
    """One column per run that measured λ_max: top, λ_max at its measured rounds, the edge 2/(lr·η_g) where
    defined and a local step's edge where it differs (log scale); bottom, 1/ΔS_w at every full round. Saved as
    PNG if ``path``."""
    measured = sharpness_rows(rounds)
    names = list(dict.fromkeys(measured["run"]))
    fig = Figure(figsize=(max(6.0, 4.8 * len(names)), 6.5), layout="constrained")
    axes = fig.subplots(2, max(1, len(names)), squeeze=False, sharex="col")
    for j, run in enumerate(names):
        top, bottom = axes[0, j], axes[1, j]
        rows = measured[measured["run"] == run]
        top.plot(rows["round"], rows["hessian_lambda_max"], "o-", markersize=3.5, linewidth=1, label="λ_max")
        every = rounds[rounds["run"] == run].dropna(subset=["round"]).sort_values("round")
        edge, local = stability_edge(every), step_edge(every)
        if edge.notna().any():
            top.plot(every["round"], edge, "--", color="grey", linewidth=1, label="2 / (lr · η_g)")
        if local.notna().any() and not np.allclose(local, edge, equal_nan=True):
            top.plot(every["round"], local, ":", color="grey", linewidth=1, label="a local step's edge")
        top.set_yscale("log")
        top.set_ylabel("top Hessian eigenvalue (probe batch)")
        first = rows.iloc[0]
        top.set_title(f"{first['run_name']}: {first.get('model', '?')}, lr {first.get('lr', '?')}", fontsize=8)
        top.legend(fontsize=7)
        full = every[full_rounds(every, every["K_c"].iloc[0])]
        bottom.plot(full["round"], pd.to_numeric(full["recovery_weighted"], errors="coerce"), "-", linewidth=1,
                    color="C0")
        bottom.set_xlabel("round")
        bottom.set_ylabel("1/ΔS_w")
    if not names:
        axes[0, 0].text(0.5, 0.5, "no run measured λ_max", ha="center", va="center", transform=axes[0, 0].transAxes)
    fig.suptitle("Sharpness against the edge of stability (full rounds for 1/ΔS_w)", fontsize=10)
    if path is not None:
        FigureCanvasAgg(fig).print_png(str(path))
    return fig
