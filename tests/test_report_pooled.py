"""report/pooled.py: ratios pooled over a window's measured rounds, checked against sums done by hand."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from test_report import NAN, rows, write_run

from fedmask_app import report
from fedmask_app.cli import report as report_cli
from fedmask_app.report.pooled import pooled_summary
from strategies.stats import cohort_statistics


def test_pooled_ratio_is_the_ratio_of_sums():
    rng = np.random.default_rng(0)
    ratio, low, high = report.pooled_ratio(np.array([1.0, 2.0, 3.0]), np.array([1.0, 1.0, 2.0]), rng)
    assert ratio == pytest.approx(6 / 4)
    assert 0.5 * 1 <= low <= ratio <= high <= 2.0  # every round's own ratio lies in [1, 2]


def test_pooled_ratio_of_proportional_rounds_has_no_spread():
    """Every round's numerator is 3x its denominator: every resample's ratio is 3."""
    den = np.array([0.5, 2.0, 7.0, 1e-3])
    assert report.pooled_ratio(3 * den, den, np.random.default_rng(1)) == pytest.approx((3.0, 3.0, 3.0))


def test_pooled_ratio_with_cancelling_denominators_says_nothing():
    """Denominators that sum to 0 (and resamples that sum to <= 0): the ratio is NaN, the upper end +inf."""
    ratio, low, high = report.pooled_ratio(np.array([1.0, 1.0]), np.array([1.0, -1.0]), np.random.default_rng(2))
    assert math.isnan(ratio) and high == math.inf and low == pytest.approx(1.0)  # resample [1, 1]: 2 / 2


def test_pooled_ratio_edge_cases():
    assert all(math.isnan(v) for v in report.pooled_ratio(np.array([]), np.array([]), np.random.default_rng(0)))
    with pytest.raises(ValueError, match="paired rounds"):
        report.pooled_ratio(np.ones(3), np.ones(2), np.random.default_rng(0))


def test_excess_over_euclidean():
    """(rho - 1) / (1/dS_w - 1): 1 when rho_H equals the Euclidean factor, 0 when nothing survives beyond
    rho 1, NaN when the Euclidean factor has no excess (1/dS_w <= 1)."""
    assert report.excess_over_euclidean(2.5, 2.5) == pytest.approx(1.0)
    assert report.excess_over_euclidean(1.0, 3.0) == 0.0
    assert report.excess_over_euclidean(5.0, 2.0) == pytest.approx(4.0)
    assert report.excess_over_euclidean(math.inf, 2.0) == math.inf
    assert math.isnan(report.excess_over_euclidean(2.0, 1.0)) and math.isnan(report.excess_over_euclidean(2.0, 0.8))
    assert math.isnan(report.excess_over_euclidean(math.nan, 2.0))


def _kappa(updates, weights, hessian) -> float:
    """disagreement_curvature of hand-made updates: rho_H = Q(mean) / sum_k w_k^2 Q(Delta_k) with Q(v) = v'Hv
    done here, 1/dS_w from strategies.stats, W2 = sum_k w_k^2."""
    updates, w = np.array(updates, float), np.array(weights, float) / np.sum(weights)
    mean = w @ updates
    rho_h = (mean @ hessian @ mean) / sum(wk**2 * (u @ hessian @ u) for wk, u in zip(w, updates, strict=True))
    euclidean = cohort_statistics([[u] for u in updates], list(weights))["recovery_weighted"]
    return report.disagreement_curvature(rho_h, euclidean, float(np.sum(w**2)))


def test_disagreement_curvature_against_its_equation():
    """kappa = [sum_k Q(e_k) / sum_k |e_k|^2] / [Q(mean) / |mean|^2], e_k = Delta_k - mean, with equal weights."""
    h = np.diag([4.0, 1.0, 0.5])
    # the mean along the sharp axis, the disagreement along the flat one: kappa = 1 / 4
    assert _kappa([[1.0, 1.0, 0.0], [1.0, -1.0, 0.0]], [1, 1], h) == pytest.approx(0.25)
    # and the other way round: a flat mean, a sharp disagreement
    assert _kappa([[1.0, 0.0, 1.0], [-1.0, 0.0, 1.0]], [1, 1], h) == pytest.approx(4.0 / 0.5)
    # orthogonal updates on a diagonal H: the disagreement and the mean see the same curvature
    assert _kappa([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], [1, 1], h) == pytest.approx(1.0)
    rng = np.random.default_rng(0)
    updates = rng.normal(size=(5, 3))
    mean = updates.mean(axis=0)
    spread = updates - mean
    by_hand = (np.einsum("ki,ij,kj->", spread, h, spread) / np.sum(spread**2)) / ((mean @ h @ mean) / (mean @ mean))
    assert _kappa(updates, [1] * 5, h) == pytest.approx(by_hand)
    # H = I: rho_H is 1/dS_w, so kappa is 1 whatever the updates and weights
    assert _kappa(updates, [3, 1, 4, 1, 5], np.eye(3)) == pytest.approx(1.0)


def test_disagreement_curvature_puts_rho_h_back_together():
    """rho_H = 1 / (W2 + kappa (dS_w - W2)) for unequal weights too; the equality and cancelling cases say nothing."""
    h, w = np.diag([2.0, 1.0, 0.25]), np.array([5.0, 3.0, 2.0])
    updates = np.array([[1.0, 0.5, -0.2], [0.8, -0.3, 0.6], [1.2, 0.1, 0.4]])
    wn = w / w.sum()
    mean = wn @ updates
    rho_h = (mean @ h @ mean) / sum(a**2 * (u @ h @ u) for a, u in zip(wn, updates, strict=True))
    euclidean = cohort_statistics([[u] for u in updates], list(w))["recovery_weighted"]
    kappa = _kappa(updates, w, h)
    w2 = float(np.sum(wn**2))
    assert 1 / (w2 + kappa * (1 / euclidean - w2)) == pytest.approx(rho_h)
    assert math.isnan(_kappa([[1.0, 2.0, 3.0]] * 3, [1, 1, 1], h))  # equality: no disagreement to weigh
    assert math.isnan(_kappa([[1.0, 0.0, 2.0], [-1.0, 0.0, -2.0]], [1, 1], h))  # cancelling: mean 0, rho_H 0
    assert report.disagreement_curvature(math.inf, 2.0, 0.1) == pytest.approx(-0.1 / 0.4)  # a zero clients' sum
    assert math.isnan(report.disagreement_curvature(-1.0, 2.0, 0.1))  # rho_H not positive
    assert math.isnan(report.disagreement_curvature(2.0, 2.0, math.nan))  # no shard sizes


def test_pooled_summary_reads_rounds_together():
    """Ratios of sums, each ratio's interval from its own generator (the same whether or not the other
    ratios' columns are there), the median 1/dS_w, rho_H's excess over it and the rounds with rho_H alone."""
    rounds = pd.DataFrame({"recovery_weighted": [2.0, 3.0, 5.0], "q_mean": [3.0, 3.0, 3.0],
                           "q_clients": [1.0, 2.0, 3.0], "rho_h_flag": ["ok", "small", "ok"],
                           "penalty_sync": [2.0, 2.0, 2.0], "penalty_ind": [1.0, 1.0, 1.0]})
    summary = pooled_summary(rounds, seed=3)
    assert summary["recovery_weighted"] == 3.0 and summary["rho_h_alone"] == 2
    assert summary["rho_h"] == pytest.approx(9 / 6) and summary["rho_direct"] == pytest.approx(2.0)
    assert summary["rho_direct_low"] == summary["rho_direct_high"] == pytest.approx(2.0)
    assert summary["rho_h_excess"] == pytest.approx((9 / 6 - 1) / (3.0 - 1))
    assert math.isnan(summary["disagreement_curvature"])  # no sum_sq_weights column
    assert math.isnan(summary["expansion_sync"])  # no predicted penalty
    weighted = pooled_summary(rounds.assign(sum_sq_weights=[0.1, 0.2, 0.1]), seed=3)
    assert weighted["sum_sq_weights"] == pytest.approx(0.1)
    assert weighted["disagreement_curvature"] == pytest.approx((6 / 9 - 0.1) / (1 / 3.0 - 0.1))
    kappa_ends = [weighted["disagreement_curvature_low"], weighted["disagreement_curvature_high"]]
    by_hand = [(1 / summary[f"rho_h_{end}"] - 0.1) / (1 / 3.0 - 0.1) for end in ("high", "low")]
    assert kappa_ends == pytest.approx(by_hand)
    alone = pooled_summary(rounds[["recovery_weighted", "q_mean", "q_clients"]], seed=3)
    assert alone["rho_h_alone"] == 0 and math.isnan(alone["rho_direct"])
    assert (alone["rho_h_low"], alone["rho_h_high"]) == (summary["rho_h_low"], summary["rho_h_high"])


def _measured(q_mean, q_clients, flags, num_clients=(10,) * 6) -> list[dict]:
    """Six rounds, 1/ΔS_w = recovery + 0.5; Q sums and penalties (sync = 2 q_mean, ind = 2 q_clients, each
    predicted as half of it) where given, NaN elsewhere."""
    q_mean, q_clients = np.array(q_mean, float), np.array(q_clients, float)
    return rows([1, 2, 3, 4, 5, 6], num_clients=list(num_clients), q_mean=list(q_mean), q_clients=list(q_clients),
                rho_h_flag=flags, penalty_sync=list(2 * q_mean), penalty_ind=list(2 * q_clients),
                penalty_sync_pred=list(q_mean), penalty_ind_pred=list(q_clients))


def test_pooled_cells_sum_a_cells_window_rounds_over_its_seeds(tmp_path, capsys):
    """Window 4: rounds 3-6. Seed 0 measured rounds 2 (outside the window), 3, 5 and the short round 6;
    seed 1 rounds 4 and 6. Pooled: q_mean 2 + 4 + 1 + 3 = 10 over q_clients 1 + 1 + 2 + 1 = 5 -> 2;
    1/ΔS_w median over rounds 3, 5 (seed 0), 4, 6 (seed 1): [3.5, 5.5, 4.5, 6.5] -> 5.0. A cell that never
    measured gets no row; full batch sorts after bs 32."""
    write_run(tmp_path, "s0", {"seed": 0}, _measured(
        [NAN, 100, 2, NAN, 4, 50], [NAN, 1, 1, NAN, 1, 1], ["", "ok", "ok", "", "denominator_not_significant", "ok"],
        num_clients=(10,) * 5 + (9,)))
    write_run(tmp_path, "s1", {"seed": 1}, _measured(
        [NAN, NAN, NAN, 1, NAN, 3], [NAN, NAN, NAN, 2, NAN, 1], ["", "", "", "ok", "", "ok"]))
    write_run(tmp_path, "full", {"batch-size": "full", "local-epochs": 1}, _measured(
        [NAN, NAN, 8, NAN, NAN, NAN], [NAN, NAN, 2, NAN, NAN, NAN], ["", "", "ok", "", "", ""]))
    write_run(tmp_path, "plain", {"local-epochs": 5}, rows([1] * 6))
    rounds = report.load_runs([tmp_path])
    cells = report.pooled_cells(rounds, report.run_summary(rounds, window=4))
    assert list(cells["bs"]) == ["32", "full"] and list(cells["T"]) == [2 * 16, 1]  # n_k 500 at bs 32
    bs32 = cells.iloc[0]
    assert (bs32["n_runs"], bs32["rounds"], bs32["measured_rounds"], bs32["rho_h_alone"]) == (2, "3-6", 4, 3)
    assert bs32["recovery_weighted"] == pytest.approx(5.0)
    assert bs32["rho_h"] == pytest.approx(2.0) and bs32["rho_direct"] == pytest.approx(2.0)
    assert bs32["expansion_sync"] == pytest.approx(2.0) and bs32["expansion_ind"] == pytest.approx(2.0)
    assert bs32["rho_h_low"] <= 2.0 <= bs32["rho_h_high"] and bs32["rho_h_high"] <= 4.0  # the rounds' own: 2, 4, 0.5, 3
    assert bs32["rho_h_excess"] == pytest.approx((2.0 - 1) / (5.0 - 1))
    assert bs32["rho_h_excess_high"] == pytest.approx((bs32["rho_h_high"] - 1) / 4)
    assert cells.iloc[1]["rho_h"] == pytest.approx(4.0) and cells.iloc[1]["rho_h_low"] == pytest.approx(4.0)
    assert cells.iloc[1]["rho_h_excess"] == pytest.approx((4.0 - 1) / (3.5 - 1))  # its round 3: 1/dS_w 3.5

    alone = report.load_runs([tmp_path / "s0", tmp_path / "s1"])  # the cell read without the others
    again = report.pooled_cells(alone, report.run_summary(alone, window=4)).iloc[0]
    assert again[["rho_h_low", "rho_h_high"]].tolist() == bs32[["rho_h_low", "rho_h_high"]].tolist()

    out = tmp_path / "report"
    assert report_cli.main([str(tmp_path), "--window", "4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "curvature pooled over each cell's window" in printed and "2.00 (" in printed
    written = pd.read_csv(out / "curvature_pooled.csv")
    assert written["rho_h"].tolist() == pytest.approx([2.0, 4.0])


def test_no_measured_rounds_no_pooled_table(tmp_path, capsys):
    write_run(tmp_path, "plain", {}, rows([1] * 6))
    rounds = report.load_runs([tmp_path])
    assert report.pooled_cells(rounds, report.run_summary(rounds, window=4)).empty
    assert report_cli.main([str(tmp_path), "--window", "4", "--out", str(tmp_path / "r")]) == 0
    assert "pooled" not in capsys.readouterr().out and not (tmp_path / "r" / "curvature_pooled.csv").exists()
