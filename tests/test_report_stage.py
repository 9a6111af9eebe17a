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
