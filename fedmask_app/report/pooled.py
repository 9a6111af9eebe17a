"""The curvature measurements' ratios pooled over a cell's window, with resampling intervals.

One round's ρ_H is noisy: at full batch its denominator Σ_k w_k² Q(Δ_k) is often within 2 standard
errors of 0, and such a round's ratio is flagged and left out of the window medians
(report/curvature.py), a selection that leans high. Pooling reads every measured round instead: a
ratio is the sum of its numerator over the sum of its denominator across the window's measured full
rounds (num_clients = K_c) of every run in the cell, its seeds together, with a 95% interval from
resampling those rounds with replacement (RESAMPLES times, a generator seeded with ``seed`` anew
for each cell and ratio, so a cell's numbers do not depend on which other runs are read with it).

POOLED_RATIOS, numerator over denominator:
* rho_h = Σ Q(Δ̄) / Σ Σ_k w_k² Q(Δ_k), the Hessian-weighted recovery factor;
* rho_direct = Σ P_sync / Σ P_ind, the directly measured penalties' ratio;
* expansion_sync, expansion_ind = Σ measured / Σ second-order predicted penalty (1: the expansion
  holds).
Beside them the median 1/ΔS_w over the same rounds, the Euclidean factor they are read against,
and two readings of ρ_H against it (DERIVED_RATIOS), each with the interval of ρ_H's ends, that
median held fixed:
* rho_h_excess = (ρ_H − 1) / (1/ΔS_w − 1): ρ_H's excess over 1 as a multiple of the Euclidean
  factor's (1: the proxy is right; above 1: it understates how much penalty survives averaging);
* disagreement_curvature κ = (1/ρ_H − W₂) / (ΔS_w − W₂), W₂ = Σ_k w_k² (the rounds' median): the
  curvature along the clients' disagreement relative to the mean update's (disagreement_curvature
  says how; 1: the proxy is right; below 1: the disagreement is flatter). The excess multiple's
  denominator vanishes as 1/ΔS_w nears 1 and κ's as 1/ΔS_w nears 1/W₂ (its ceiling K_c with equal
  shards), so each reads best where the other does not.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from fedmask_app.report.runs import full_rounds
from fedmask_app.report.tables import in_paper_order, local_steps

POOLED_RATIOS = {
    "rho_h": ("q_mean", "q_clients"),
    "rho_direct": ("penalty_sync", "penalty_ind"),
    "expansion_sync": ("penalty_sync", "penalty_sync_pred"),
    "expansion_ind": ("penalty_ind", "penalty_ind_pred"),
}
DERIVED_RATIOS = ("rho_h_excess", "disagreement_curvature")
RESAMPLES = 2000
LEVEL = 0.95
POOLED_NOTE = (f"numerator and denominator each summed over the window's measured full rounds, seeds together; "
               f"{LEVEL:.0%} interval from resampling those rounds {RESAMPLES} times")


def pooled_ratio(numerator: np.ndarray, denominator: np.ndarray, rng: np.random.Generator,
                 resamples: int = RESAMPLES, level: float = LEVEL) -> tuple[float, float, float]:
    """Σ numerator / Σ denominator over paired rounds, and the central ``level`` interval of that
    ratio over ``resamples`` resamplings of the rounds (the outer order statistics, so never
    narrower than the percentiles).

    A denominator summing to ≤ 0 makes the ratio meaningless (as a round's flag says): the ratio is
    then NaN, and such a resample counts as +∞, so the interval's upper end is ∞ when more than the
    tail's share of resamples has one. NaNs when there is no round."""
    numerator, denominator = np.asarray(numerator, float), np.asarray(denominator, float)
    if numerator.shape != denominator.shape or numerator.ndim != 1:
        raise ValueError(f"numerator and denominator must be paired rounds, got shapes {numerator.shape} "
                         f"and {denominator.shape}")
    if numerator.size == 0:
        return float("nan"), float("nan"), float("nan")
    idx = rng.integers(0, numerator.size, size=(resamples, numerator.size))
    boot_num, boot_den = numerator[idx].sum(axis=1), denominator[idx].sum(axis=1)
    boot = np.full(resamples, np.inf)
    np.divide(boot_num, boot_den, out=boot, where=boot_den > 0)
    ratio = numerator.sum() / denominator.sum() if denominator.sum() > 0 else float("nan")
    tail = 100 * (1 - level) / 2
    low = np.percentile(boot, tail, method="lower")
    high = np.percentile(boot, 100 - tail, method="higher")
    return float(ratio), float(low), float(high)


def excess_over_euclidean(rho: float, euclidean: float) -> float:
    """(ρ − 1) / (1/ΔS_w − 1); NaN when 1/ΔS_w ≤ 1, where the Euclidean factor has no excess to compare with."""
    return (rho - 1) / (euclidean - 1) if euclidean > 1 else float("nan")


def disagreement_curvature(rho_h: float, recovery_weighted: float, sum_sq_weights: float) -> float:
    """κ = (1/ρ_H − W₂) / (ΔS_w − W₂) with W₂ = Σ_k w_k² and ΔS_w = 1 / (1/ΔS_w).

    With Δ̄ = Σ_k w_k Δ_k, 1/ρ_H − W₂ = [Σ_k w_k² Q(Δ_k) − W₂ Q(Δ̄)] / Q(Δ̄): what the clients' sum
    holds beyond the W₂ Q(Δ̄) that identical updates would give, relative to the mean update's
    Q; ΔS_w − W₂ is the same in the Euclidean norm. So ρ_H = 1 / (W₂ + κ (ΔS_w − W₂)): the
    curvature-weighted factor is the Euclidean one with the disagreement's share scaled by κ. With
    equal weights (w_k = 1/K_c) and e_k = Δ_k − Δ̄, κ = [Σ_k Q(e_k) / Σ_k ‖e_k‖²] / [Q(Δ̄) / ‖Δ̄‖²],
    the curvature along the clients' disagreement per unit squared norm over the mean update's;
    unequal weights add cross terms of the order of the shard sizes' spread. κ = 1: the Euclidean
    proxy is exact (as with H = I); below 1 the disagreement lies in flatter directions than the
    mean update and more of the penalty survives averaging than 1/ΔS_w says; above 1, less.

    NaN where there is no disagreement to weigh (ΔS_w ≤ W₂) or ρ_H is not positive; ρ_H = ∞ (a
    zero clients' sum) gives −W₂ / (ΔS_w − W₂)."""
    if not (rho_h > 0 and recovery_weighted > 0 and sum_sq_weights > 0):
        return float("nan")
    euclidean = 1 / recovery_weighted - sum_sq_weights
    return (1 / rho_h - sum_sq_weights) / euclidean if euclidean > 0 else float("nan")


def pooled_ratios(rows: pd.DataFrame, ratios: Sequence[str], rng: np.random.Generator) -> dict[str, float]:
    """Each of ``ratios`` (POOLED_RATIOS keys) pooled over ``rows`` (pooled_ratio of the rows that have
    both its columns), as ``<ratio>``, ``<ratio>_low``, ``<ratio>_high``; NaNs where no row has them.
    ``rng`` draws the intervals in ``ratios`` order."""
    out = {}
    for ratio in ratios:
        num, den = POOLED_RATIOS[ratio]
        pair = rows[[num, den]].dropna() if {num, den} <= set(rows) else rows.iloc[:0, :0]
        values = pooled_ratio(pair[num].to_numpy(), pair[den].to_numpy(), rng) if len(pair) else (np.nan,) * 3
        out.update(zip((ratio, f"{ratio}_low", f"{ratio}_high"), values, strict=True))
    return out


def rho_h_derived(row: dict) -> dict[str, float]:
    """DERIVED_RATIOS and their ends from a pooled row's rho_h and its ends, against its
    ``recovery_weighted`` (and ``sum_sq_weights``, NaN when absent): excess_over_euclidean rises
    with ρ_H and disagreement_curvature falls, so κ's low end is ρ_H's high end's."""
    euclidean, w2 = row["recovery_weighted"], row.get("sum_sq_weights", float("nan"))
    out = {}
    for part, other in (("", ""), ("_low", "_high"), ("_high", "_low")):
        out[f"rho_h_excess{part}"] = excess_over_euclidean(row[f"rho_h{part}"], euclidean)
        out[f"disagreement_curvature{part}"] = disagreement_curvature(row[f"rho_h{other}"], euclidean, w2)
    return out


def median_sum_sq_weights(rows: pd.DataFrame) -> float:
    """The median W₂ = Σ_k w_k² of ``rows`` (load_runs' sum_sq_weights), NaN without the column."""
    return float(rows["sum_sq_weights"].median()) if "sum_sq_weights" in rows else float("nan")


def rho_h_alone(rows: pd.DataFrame) -> int:
    """How many of ``rows`` had a ρ_H measurable alone (rho_h_flag "ok")."""
    return int((rows["rho_h_flag"] == "ok").sum()) if "rho_h_flag" in rows else 0


def pooled_summary(rows: pd.DataFrame, seed: int = 0) -> dict[str, float]:
    """Measured rounds ``rows`` read together: the median 1/ΔS_w over them (``recovery_weighted``),
    rho_h_alone, each of POOLED_RATIOS with its interval (a generator seeded with ``seed`` anew for
    each ratio, so one ratio's interval does not depend on which others are drawn), the median W₂
    (``sum_sq_weights``) and DERIVED_RATIOS with their ends."""
    row = {"recovery_weighted": rows["recovery_weighted"].median(), "sum_sq_weights": median_sum_sq_weights(rows),
           "rho_h_alone": rho_h_alone(rows)}
    for ratio in POOLED_RATIOS:
        row.update(pooled_ratios(rows, [ratio], np.random.default_rng(seed)))
    return row | rho_h_derived(row)


def window_measured_rounds(rounds: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """Every run's window rounds (report.run_summary's window) that are full and carry a curvature
    measurement (a Q sum or a penalty), with the run's cell_id; measurement columns as numbers."""
    columns = sorted({c for pair in POOLED_RATIOS.values() for c in pair} & set(rounds.columns))
    if not columns:
        return rounds.iloc[:0].assign(cell_id=pd.Series(dtype=str))
    parts = []
    for _, run in runs.iterrows():
        rows = rounds[rounds["run"] == run["run"]].dropna(subset=["round"])
        in_window = (rows["round"] >= run["window_start"]) & (rows["round"] <= run["num_rounds"])
        rows = rows[in_window & full_rounds(rows, run["K_c"])].copy()
        for column in [*columns, "recovery_weighted"]:
            rows[column] = pd.to_numeric(rows[column], errors="coerce")
        parts.append(rows[rows[columns].notna().any(axis=1)].assign(cell_id=run["cell_id"]))
    return pd.concat(parts, ignore_index=True) if parts else rounds.iloc[:0].assign(cell_id=pd.Series(dtype=str))


def pooled_cells(rounds: pd.DataFrame, runs: pd.DataFrame, seed: int = 0) -> pd.DataFrame:
    """One row per cell of ``runs`` (report.run_summary) that has measured rounds: its keys, T (local
    steps a round for its mean shard, as in cell_summary), its runs and measured rounds, the window's
    rounds, the median 1/ΔS_w over those rounds, how many of them had a ρ_H measurable alone (flag
    "ok"), each of POOLED_RATIOS with ``<ratio>_low`` / ``<ratio>_high``, the median W₂
    (``sum_sq_weights``) and DERIVED_RATIOS with their ends (rho_h_derived)."""
    measured = window_measured_rounds(rounds, runs)
    out = []
    for cell_id, group in runs.groupby("cell_id", sort=False):
        rows = measured[measured["cell_id"] == cell_id]
        if rows.empty:
            continue
        first = group.iloc[0]
        row = {
            "cell": first["cell"], "bs": first["bs"], "tau": first["tau"], "alpha": first["alpha"],
            "T": local_steps(first["tau"], first["bs"], group["mean_shard"].mean()),
            "n_runs": len(group), "measured_rounds": len(rows),
            "rounds": "/".join(sorted({f"{a}-{b}" for a, b in
                                       zip(group["window_start"], group["num_rounds"], strict=True)})),
            **pooled_summary(rows, seed),
        }
        out.append(row)
    return in_paper_order(pd.DataFrame(out))


def format_pooled(cells: pd.DataFrame) -> str:
    """The pooled table as text: each ratio as "value (low-high)"."""
    shown = cells[["cell", "T", "n_runs", "rounds", "measured_rounds", "recovery_weighted", "rho_h_alone"]].copy()
    shown["recovery_weighted"] = shown["recovery_weighted"].map(lambda v: f"{v:.3f}")
    shown["T"] = shown["T"].map(lambda v: f"{v:.0f}")
    for ratio in [*POOLED_RATIOS, *DERIVED_RATIOS]:
        shown[ratio] = [f"{v:.2f} ({lo:.2f}-{hi:.2f})" for v, lo, hi in
                        cells[[ratio, f"{ratio}_low", f"{ratio}_high"]].itertuples(index=False)]
    return shown.to_string(index=False)
