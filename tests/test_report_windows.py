"""report/windows.py: curvature ratios window by window, one run or several pooled, checked against
sums done by hand."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from test_report import NAN, PNG_MAGIC, rows, write_run, write_shards

from fedmask_app import report
from fedmask_app.cli import report as report_cli


def _measured(q_mean, q_clients, flags, accuracy, num_clients=(10,) * 6) -> list[dict]:
    """Six rounds, 1/ΔS_w = recovery + 0.5 = round + 1.5; Q sums and penalties (sync = 2 q_mean,
    ind = 2 q_clients, each predicted as half of it) where given, NaN elsewhere."""
    q_mean, q_clients = np.array(q_mean, float), np.array(q_clients, float)
    return rows([1, 2, 3, 4, 5, 6], num_clients=list(num_clients), q_mean=list(q_mean), q_clients=list(q_clients),
                rho_h_flag=flags, penalty_sync=list(2 * q_mean), penalty_ind=list(2 * q_clients),
                penalty_sync_pred=list(q_mean), penalty_ind_pred=list(q_clients), test_accuracy=accuracy,
                recovery_weighted=[r + 1.5 for r in range(1, 7)], cohort=[" ".join(map(str, range(10)))] * 6)


@pytest.fixture
def two_seeds(tmp_path):
    """Seed 0 measured rounds 2, 3, 5 and the short round 6 (9 of 10 clients); seed 1 rounds 4 and 6.
    Seed 0 has a shards.csv (ten shards of 50: W2 = 0.1), seed 1 none."""
    s0 = write_run(tmp_path, "s0", {"seed": 0}, _measured(
        [NAN, 100, 2, NAN, 4, 50], [NAN, 1, 1, NAN, 1, 1], ["", "ok", "ok", "", "denominator_not_significant", "ok"],
        [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], num_clients=(10,) * 5 + (9,)))
    s1 = write_run(tmp_path, "s1", {"seed": 1}, _measured(
        [NAN, NAN, NAN, 1, NAN, 3], [NAN, NAN, NAN, 2, NAN, 1], ["", "", "", "ok", "", "ok"],
        [0.1, 0.2, 0.7, 0.8, 0.9, 1.0]))
    write_shards(s0, [50] * 10)
    return s0, s1


def test_window_ratios_pool_the_runs_measured_full_rounds(two_seeds):
    """Rounds 3-6: seed 0's rounds 3 and 5 (round 6 is short), seed 1's 4 and 6. rho_H = (2 + 4 + 1 + 3) /
    (1 + 1 + 2 + 1) = 2, and so each ratio of penalties; 1/ΔS_w median of [4.5, 6.5, 5.5, 7.5] = 6; test
    accuracy over every round of the window, both runs: median of [0.3 .. 0.6, 0.7 .. 1.0] = 0.65.
    Rounds 1-2: seed 0's round 2 alone (100 / 1), its interval that one round's."""
    table = report.window_ratios(list(two_seeds), np.random.default_rng(0), windows=[(3, 6), (1, 2)])
    pooled, early = table.to_dict("records")
    assert [pooled[k] for k in ("start", "end", "runs", "measured", "rho_h_alone")] == [3, 6, 2, 4, 3]
    for ratio in report.POOLED_RATIOS:
        assert pooled[ratio] == pytest.approx(2.0)
    assert pooled["rho_h_low"] <= 2.0 <= pooled["rho_h_high"] <= 4.0  # the rounds' own: 2, 4, 0.5, 3
    assert pooled["recovery_weighted"] == pytest.approx(6.0)
    assert pooled["rho_h_excess"] == pytest.approx((2.0 - 1) / (6.0 - 1))
    assert pooled["sum_sq_weights"] == pytest.approx(0.1)  # seed 0's rounds; seed 1's are NaN
    assert pooled["disagreement_curvature"] == pytest.approx((1 / 2.0 - 0.1) / (1 / 6.0 - 0.1))
    assert pooled["disagreement_curvature_low"] == pytest.approx((1 / pooled["rho_h_high"] - 0.1) / (1 / 6.0 - 0.1))
    assert pooled["test_accuracy"] == pytest.approx(0.65)
    assert (early["measured"], early["rho_h"], early["rho_h_low"], early["rho_h_high"]) == (1, 100.0, 100.0, 100.0)
    assert early["recovery_weighted"] == pytest.approx(3.5) and early["test_accuracy"] == pytest.approx(0.15)


def test_one_run_alone_and_a_window_without_measurements(two_seeds):
    """Seed 1 alone over rounds 3-6: (1 + 3) / (2 + 1); over rounds 1-2 it measured nothing."""
    table = report.window_ratios([two_seeds[1]], np.random.default_rng(0), windows=[(3, 6), (1, 2)])
    alone, nothing = table.to_dict("records")
    assert alone["runs"] == 1 and alone["measured"] == 2 and alone["rho_h"] == pytest.approx(4 / 3)
    assert alone["expansion_sync"] == pytest.approx(2.0)
    assert nothing["measured"] == 0 and nothing["rho_h_alone"] == 0
    assert all(math.isnan(nothing[c]) for c in ("rho_h", "rho_h_low", "rho_h_high", "recovery_weighted"))


def test_one_generator_draws_window_by_window_ratio_by_ratio(two_seeds):
    """The intervals come from the generator in order (window, then ratio in POOLED_RATIOS order): the same
    draws give the same ends, a table drawn first shifts the next one's, and a ratio subset that is a
    prefix draws what the full call draws for it."""
    runs = list(two_seeds)
    both = report.window_ratios(runs, np.random.default_rng(3), windows=[(3, 6), (1, 6)])
    rng = np.random.default_rng(3)
    first = report.window_ratios(runs, rng, windows=[(3, 6)])
    second = report.window_ratios(runs, rng, windows=[(1, 6)])
    ends = ["rho_h_low", "rho_h_high", "rho_direct_low", "rho_direct_high"]
    assert first[ends].iloc[0].tolist() == both[ends].iloc[0].tolist()
    assert second[ends].iloc[0].tolist() == both[ends].iloc[1].tolist()
    fresh = report.window_ratios(runs, np.random.default_rng(3), windows=[(1, 6)])
    assert fresh[ends].iloc[0].tolist() != second[ends].iloc[0].tolist()
    prefix = report.window_ratios(runs, np.random.default_rng(3), windows=[(3, 6)], ratios=["rho_h", "rho_direct"])
    assert prefix[ends].iloc[0].tolist() == first[ends].iloc[0].tolist()
    assert "expansion_sync" not in prefix and "rho_h_excess" in prefix
    without_rho_h = report.window_ratios(runs, np.random.default_rng(3), ratios=["rho_direct"])
    assert "rho_h" not in without_rho_h and "rho_h_excess" not in without_rho_h


def test_window_ratios_bad_input(tmp_path, two_seeds):
    with pytest.raises(report.SummaryError, match=r"nowhere is not a run folder \(no rounds.csv\)"):
        report.window_ratios([two_seeds[0], tmp_path / "nowhere"], np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"unknown ratio.*rho_x"):
        report.window_ratios(list(two_seeds), np.random.default_rng(0), ratios=["rho_h", "rho_x"])


def test_format_windows_and_pooled_windows(two_seeds):
    table = report.window_ratios(list(two_seeds), np.random.default_rng(0), windows=[(3, 6)])
    header, line = report.format_windows(table, "bs 32, seeds 0 and 1").splitlines()
    assert header.startswith("bs 32, seeds 0 and 1 | rounds | 1/dS_w | rho_H | rho_direct |")
    assert line.startswith("    3-6 |  6.00 |  2.00 (")
    assert line.endswith("| 0.650 | rho_H measurable alone in 3 of 4 rounds")
    assert report.format_interval(table.to_dict("records")[0], "rho_h").startswith(" 2.00 (")
    two_windows = report.window_ratios(list(two_seeds), np.random.default_rng(0), windows=[(3, 6), (1, 2)])
    excess = f"{two_windows['rho_h_excess'].iloc[1]:.1f}"
    assert report.format_excess(two_windows) == (  # (2 - 1) / (6 - 1) in rounds 3-6
        f"rho_H - 1 over 1/dS_w - 1: rounds 3-6 0.2, rounds 1-2 {excess}")
    assert report.format_excess(two_windows.iloc[:1], "pooled").startswith("pooled: rounds 3-6 ")
    pooled = report.format_pooled_windows(table, "seeds 0 and 1")
    assert pooled.startswith("seeds 0 and 1 pooled, their 4 measured rounds in 3-6: 1/dS_w 6.00, rho_H  2.00 (")
    assert "measured/predicted  2.00 (" in pooled and pooled.endswith("(ind)")
    short = report.window_ratios(list(two_seeds), np.random.default_rng(0), windows=[(3, 6)],
                                 ratios=["rho_h", "rho_direct"])
    assert "measured/predicted" not in report.format_pooled_windows(short, "seeds 0 and 1")


def test_cell_windows_pool_each_cells_seeds_with_a_stream_of_its_own(tmp_path, two_seeds, capsys):
    """Seeds 0 and 1 form one cell (bs 32, tau 2); a full-batch cell measured rounds 3 and 4; a cell that
    never measured gets no rows. Each cell's table is window_ratios of its runs from a fresh generator,
    the second cell's too (a shared generator would shift its intervals)."""
    full = write_run(tmp_path, "full", {"batch-size": "full", "local-epochs": 1}, _measured(
        [NAN, NAN, 8, 3, NAN, NAN], [NAN, NAN, 2, 1, NAN, NAN], ["", "", "ok", "ok", "", ""], [0.5] * 6))
    write_run(tmp_path, "plain", {"local-epochs": 5}, rows([1] * 6))
    rounds = report.load_runs([tmp_path])
    table = report.cell_windows(rounds, report.run_summary(rounds, window=4), [(3, 6), (1, 2)])
    assert table[["bs", "start", "end", "measured"]].values.tolist() == [["32", 3, 6, 4], ["32", 1, 2, 1],
                                                                           ["full", 3, 6, 2], ["full", 1, 2, 0]]
    assert list(table["T"]) == [32, 32, 1, 1] and list(table["runs"]) == [2, 2, 1, 1]
    assert table.iloc[2]["rho_h"] == pytest.approx(11 / 3)
    for runs, cell in ((list(two_seeds), "32"), ([full], "full")):
        alone = report.window_ratios(runs, np.random.default_rng(0), windows=[(3, 6), (1, 2)])
        assert table[table["bs"] == cell].reset_index(drop=True)[alone.columns].equals(alone)

    out = tmp_path / "report"
    argv = [str(tmp_path), "--window", "4", "--out", str(out), "--curvature-windows", "3-6", "1-2"]
    assert report_cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "curvature pooled per cell in each window" in printed and "2.00 (" in printed
    written = pd.read_csv(out / "curvature_windows.csv")
    assert written["rho_h"].tolist()[:3] == pytest.approx([2.0, 100.0, 11 / 3]) and math.isnan(written["rho_h"][3])
    assert (out / "curvature_windows.png").read_bytes().startswith(PNG_MAGIC)


def test_curvature_windows_bad_or_empty(tmp_path, two_seeds, capsys):
    for bad in ("50-5", "0-10", "151", "a-b"):
        with pytest.raises(SystemExit):
            report_cli.main([str(tmp_path), "--curvature-windows", bad])
        assert "--curvature-windows: a window is FIRST-LAST" in capsys.readouterr().err
    assert report.parse_window("151-200") == (151, 200) and report.parse_window("7-7") == (7, 7)
    out = tmp_path / "report"
    assert report_cli.main([str(tmp_path), "--window", "4", "--out", str(out), "--curvature-windows", "7-9"]) == 0
    assert "no run has curvature measurements in these windows" in capsys.readouterr().err
    assert not (out / "curvature_windows.csv").exists() and not (out / "curvature_windows.png").exists()
    assert (out / "summary.csv").exists()
