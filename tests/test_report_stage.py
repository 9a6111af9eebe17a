"""fedmask-report --at-accuracy: runs read where their windowed test accuracy first reaches a level
(fedmask_app/report/stage.py), checked on hand-made rounds."""

from __future__ import annotations

import math

import pandas as pd
import pytest
from test_report import NAN, PNG_MAGIC, rows, write_run

from fedmask_app import report
from fedmask_app.cli import report as report_cli


def _by_level(table: pd.DataFrame) -> pd.DataFrame:
    return table.set_index("level")


def _at_accuracy(root, levels, window: int) -> pd.DataFrame:
    rounds = report.load_runs([root])
    return report.at_accuracy(rounds, report.run_summary(rounds, window), levels, window)


def test_first_round_of_the_windowed_accuracy_and_the_medians_there(tmp_path):
    """Window 2. Accuracy [.1, .3, .2, .5, .6, .4] -> windowed [.1, .2, .25, .35, .55, .5];
    1/ΔS [8, 6, 4, 3, 2, 1] -> [8, 7, 5, 3.5, 2.5, 1.5]. Raw accuracy passes 0.3 at round 2, the
    windowed median only at round 4. σ̂² = 2·1/ΔS and ‖μ̂‖² = 3·1/ΔS (write_run) -> ratio 2/3."""
    write_run(tmp_path, "a", {}, rows([8, 6, 4, 3, 2, 1], test_accuracy=[0.1, 0.3, 0.2, 0.5, 0.6, 0.4]))
    table = _by_level(_at_accuracy(tmp_path, [0.5, 0.1, 0.3, 0.7], window=2))
    assert list(table.index) == [0.1, 0.3, 0.5, 0.7]  # ascending
    assert (table.loc[0.1, "round"], table.loc[0.1, "window_rounds"], table.loc[0.1, "recovery"]) == (1, 1, 8)
    assert (table.loc[0.3, "round"], table.loc[0.3, "window_rounds"]) == (4, 2)
    assert table.loc[0.3, "test_accuracy"] == pytest.approx(0.35)
    assert table.loc[0.3, "recovery"] == pytest.approx(3.5)
    assert table.loc[0.3, "recovery_weighted"] == pytest.approx(4.0)  # write_run: recovery + 0.5
    assert table.loc[0.3, "sigma2_over_mu2"] == pytest.approx(2 / 3)
    assert (table.loc[0.5, "round"], table.loc[0.5, "recovery"]) == (5, pytest.approx(2.5))
    never = table.loc[0.7]
    assert math.isnan(never["round"]) and math.isnan(never["recovery"]) and math.isnan(never["test_accuracy"])


def test_short_rounds_and_rounds_not_evaluated_are_skipped(tmp_path):
    """Window 3, K_c = 10. Round 2 is short (8 replies) and its 1/ΔS of 100 stays out; rounds 2 and 4
    were not evaluated. Round 3: accuracy median {.2, .4} = .3, 1/ΔS median {1, 3} = 2. Round 4:
    accuracy {.4} = .4, 1/ΔS {3, 5} = 4."""
    write_run(tmp_path, "a", {"num-rounds": 4}, rows(
        [1, 100, 3, 5], num_clients=[10, 8, 10, 10], test_accuracy=[0.2, NAN, 0.4, NAN]))
    table = _by_level(_at_accuracy(tmp_path, [0.3, 0.35], window=3))
    assert (table.loc[0.3, "round"], table.loc[0.3, "recovery"]) == (3, pytest.approx(2.0))
    assert (table.loc[0.35, "round"], table.loc[0.35, "recovery"]) == (4, pytest.approx(4.0))
    assert table.loc[0.35, "test_accuracy"] == pytest.approx(0.4)


def test_levels_and_window_are_checked():
    frame = pd.DataFrame()
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        report.at_accuracy(frame, frame, [45], window=5)
    with pytest.raises(ValueError, match="window"):
        report.at_accuracy(frame, frame, [0.4], window=0)


def test_per_cell_medians_across_the_seeds_that_reach_a_level(tmp_path):
    """Window 1. Cell "cnn": seeds 0, 1, 2 reach 0.4 at rounds 2, 3, 4 with 1/ΔS 6, 4, 2 (median
    round 3, 1/ΔS 4, range 2-6); only seeds 0 and 1 reach 0.5, at rounds 3 and 4 with 1/ΔS 5 and 3
    (median 4). Cell "resnet" (one seed) never reaches 0.5: its row there is NaN, n_reached 0."""
    accuracy = {0: [.3, .4, .5, .5], 1: [.3, .3, .4, .5], 2: [.3, .3, .3, .4]}
    recovery = {0: [8, 6, 5, 5], 1: [8, 8, 4, 3], 2: [8, 8, 8, 2]}
    for seed in accuracy:
        write_run(tmp_path, f"cnn_{seed}", {"model": "cnn-fedavg", "seed": seed, "num-rounds": 4},
                  rows(recovery[seed], test_accuracy=accuracy[seed]))
    write_run(tmp_path, "resnet", {"model": "resnet18-gn", "num-rounds": 4}, rows([3, 2, 2, 2],
                                                                                  test_accuracy=[.3, .4, .4, .4]))
    cells = report.cell_at_accuracy(_at_accuracy(tmp_path, [0.4, 0.5], window=1))
    assert list(cells.columns) == list(report.CELL_AT_ACCURACY_COLUMNS)
    cells = cells.assign(model=cells["cell"].str.extract(r"model=(\S+)")[0]).set_index(["model", "level"])
    assert len(cells) == 4
    cnn = cells.loc[("cnn-fedavg", 0.4)]
    assert (cnn["n_runs"], cnn["n_reached"], cnn["round"], cnn["recovery"]) == (3, 3, 3, 4)
    assert (cnn["recovery_min"], cnn["recovery_max"], cnn["test_accuracy"]) == (2, 6, pytest.approx(0.4))
    assert cnn["sigma2_over_mu2"] == pytest.approx(2 / 3)
    cnn = cells.loc[("cnn-fedavg", 0.5)]
    assert (cnn["n_runs"], cnn["n_reached"], cnn["round"], cnn["recovery"]) == (3, 2, 3.5, 4)
    resnet = cells.loc[("resnet18-gn", 0.5)]
    assert resnet["n_reached"] == 0 and math.isnan(resnet["round"]) and math.isnan(resnet["recovery_max"])
    assert cells.loc[("resnet18-gn", 0.4), "round"] == 2


def test_report_cli_at_accuracy_table_and_figure(tmp_path, capsys):
    """Two models of 6 and 4 rounds, window 1: the CNN reaches 0.4 at round 3 (1/ΔS 4), ResNet at
    round 2 (1/ΔS 2); 0.55: ResNet at round 4, the CNN never."""
    results = tmp_path / "results"
    write_run(results, "cnn", {"model": "cnn-fedavg"}, rows([6, 5, 4, 3, 3, 3], test_accuracy=[.2, .3, .4, .5, .5, .5]))
    write_run(results, "resnet", {"model": "resnet18-gn", "num-rounds": 4}, rows([3, 2, 2, 1],
                                                                                 test_accuracy=[.3, .4, .5, .6]))
    out = tmp_path / "report"
    assert report_cli.main([str(results), "--window", "1", "--out", str(out), "--at-accuracy", "0.4", "0.55"]) == 0
    printed = capsys.readouterr().out
    assert "reduced protocol: 4-6 rounds, window 1 (each run's last 1 rounds)" in printed
    assert "at equal test accuracy" in printed and "model=cnn-fedavg" in printed and "model=resnet18-gn" in printed
    table = pd.read_csv(out / "at_accuracy.csv").set_index(["run_name", "level"])
    assert len(table) == 4
    assert list(pd.read_csv(out / "at_accuracy.csv").columns) == [c for c in report.AT_ACCURACY_COLUMNS if c != "run"]
    assert (table.loc[("cnn", 0.4), "round"], table.loc[("cnn", 0.4), "recovery"]) == (3, 4)
    assert (table.loc[("resnet", 0.4), "round"], table.loc[("resnet", 0.4), "recovery"]) == (2, 2)
    assert math.isnan(table.loc[("cnn", 0.55), "round"]) and table.loc[("resnet", 0.55), "round"] == 4
    assert (out / "recovery_vs_accuracy.png").read_bytes()[:8] == PNG_MAGIC
    cells = pd.read_csv(out / "at_accuracy_cells.csv")
    assert list(cells.columns) == list(report.CELL_AT_ACCURACY_COLUMNS) and len(cells) == 4
    assert "per cell, the median across the seeds" in printed


def test_report_cli_refuses_a_percentage_before_writing_anything(tmp_path, capsys):
    write_run(tmp_path / "results", "a", {}, rows([1] * 6))
    out = tmp_path / "report"
    with pytest.raises(SystemExit):
        report_cli.main([str(tmp_path / "results"), "--out", str(out), "--at-accuracy", "45"])
    assert "--at-accuracy levels are fractions in (0, 1], got 45.0" in capsys.readouterr().err
    assert not out.exists()


def _curvature_rows(accuracy, q_mean, q_clients, num_clients=(10,) * 6) -> list[dict]:
    """Six rounds, 1/ΔS_w = recovery + 0.5 = round + 0.5 (write_run), with Q sums (penalties: sync = 2 q_mean, ind =
    2 q_clients, each predicted as half of it) where given, NaN elsewhere."""
    return rows([1, 2, 3, 4, 5, 6], test_accuracy=accuracy, num_clients=list(num_clients), q_mean=q_mean,
                q_clients=q_clients, rho_h_flag=["ok" if q == q else "" for q in q_mean],
                penalty_sync=[2 * q for q in q_mean], penalty_ind=[2 * q for q in q_clients],
                penalty_sync_pred=q_mean, penalty_ind_pred=q_clients)


@pytest.fixture
def curvature_seeds(tmp_path):
    """Window 3, cell "cnn" two seeds, cell "resnet" without curvature measurements.

    Seed 0: accuracy [.1, .2, .4, .5, .5, .5] -> windowed [.1, .15, .2, .4, .5, .5]: 0.4 at round 4
    (rounds 2-4), 0.5 at round 5 (rounds 3-5). Measured rounds 2, 4 (Q 6/1, 4/2) and 5 (short: 9 clients).
    Seed 1: accuracy [.4] * 6: 0.4 at round 1 (round 1 alone, measured: Q 3/3), never 0.5. Measured also
    round 3, outside its 0.4 window."""
    write_run(tmp_path, "cnn_s0", {"model": "cnn-fedavg", "seed": 0}, _curvature_rows(
        [.1, .2, .4, .5, .5, .5], [NAN, 6, NAN, 4, 100, NAN], [NAN, 1, NAN, 2, 1, NAN],
        num_clients=(10,) * 4 + (9, 10)))
    write_run(tmp_path, "cnn_s1", {"model": "cnn-fedavg", "seed": 1}, _curvature_rows(
        [.4] * 6, [3, NAN, 50, NAN, NAN, NAN], [3, NAN, 1, NAN, NAN, NAN]))
    write_run(tmp_path, "resnet", {"model": "resnet18-gn"}, rows([3] * 6, test_accuracy=[.4] * 6))
    rounds = report.load_runs([tmp_path])
    table = report.at_accuracy(rounds, report.run_summary(rounds, 3), [0.4, 0.5], window=3)
    return rounds, table


def test_curvature_at_accuracy_pools_each_runs_own_window(curvature_seeds):
    """Level 0.4: seed 0's rounds 2 and 4, seed 1's round 1: rho_H = (6 + 4 + 3) / (1 + 2 + 3) = 13/6, and
    so rho_direct; the expansion 2 (measured = 2 x predicted); 1/ΔS_w median of [2.5, 4.5, 1.5] = 2.5.
    Level 0.5: seed 0 alone, rounds 3-5, of which round 4 is measured and round 5 is short: 4 / 2."""
    rounds, table = curvature_seeds
    cells = report.curvature_at_accuracy(rounds, table)
    assert list(cells.columns) == list(report.CURVATURE_AT_ACCURACY_COLUMNS)
    assert cells["cell"].str.contains("model=cnn-fedavg").all()  # resnet: no measurement, left out
    at = cells.set_index("level")
    low = at.loc[0.4]
    assert (low["n_runs"], low["n_reached"], low["measured"], low["rho_h_alone"]) == (2, 2, 3, 3)
    assert low["round"] == pytest.approx(2.5) and low["test_accuracy"] == pytest.approx(0.4)
    assert low["rho_h"] == pytest.approx(13 / 6) and low["rho_direct"] == pytest.approx(13 / 6)
    assert low["expansion_sync"] == pytest.approx(2.0) and low["expansion_ind"] == pytest.approx(2.0)
    assert low["rho_h_low"] <= 13 / 6 <= low["rho_h_high"]
    assert low["recovery_weighted"] == pytest.approx(2.5)
    assert low["rho_h_excess"] == pytest.approx((13 / 6 - 1) / (2.5 - 1))
    high = at.loc[0.5]
    assert (high["n_reached"], high["measured"], high["round"]) == (1, 1, 5)
    assert (high["rho_h"], high["rho_h_low"], high["rho_h_high"]) == (2.0, 2.0, 2.0)


def test_curvature_at_accuracy_of_a_level_no_run_reaches_is_nan(curvature_seeds):
    rounds, _ = curvature_seeds
    cells = report.curvature_at_accuracy(rounds, report.at_accuracy(
        rounds, report.run_summary(rounds, 3), [0.4, 0.9], window=3)).set_index("level")
    never = cells.loc[0.9]
    assert (never["n_reached"], never["measured"]) == (0, 0)
    assert math.isnan(never["rho_h"]) and math.isnan(never["round"]) and math.isnan(never["rho_h_excess"])


def test_report_cli_writes_curvature_at_accuracy(curvature_seeds, tmp_path, capsys):
    out = tmp_path / "report"
    assert report_cli.main([str(tmp_path), "--window", "3", "--out", str(out), "--at-accuracy", "0.4", "0.5"]) == 0
    printed = capsys.readouterr().out
    assert "curvature at equal test accuracy" in printed and "2 of 2" in printed
    written = pd.read_csv(out / "curvature_at_accuracy.csv")
    assert list(written.columns) == list(report.CURVATURE_AT_ACCURACY_COLUMNS)
    assert written.set_index("level").loc[0.4, "rho_h"] == pytest.approx(13 / 6)
