"""λ_max against the edge of stability (fedmask_app/report/sharpness.py) on hand-made runs."""

from __future__ import annotations

import math

import pandas as pd
import pytest
from test_report import NAN, PNG_MAGIC, PROJECT, rows, run_notebook, write_run

from fedmask_app import report
from fedmask_app.cli import report as report_cli


def _rounds(**config) -> pd.DataFrame:
    """One round of a run with these run-config columns, as load_runs gives them."""
    base = {"bs": "full", "tau": 1, "lr": 0.01, "momentum": 0.0, "weight-decay": 0.0, "mask-mode": "none",
            "augment": "none", "server_lr": 1.0}
    return pd.DataFrame([{**base, **config}])


def test_the_edge_is_two_over_the_rounds_step():
    assert report.stability_edge(_rounds()).iloc[0] == pytest.approx(200.0)
    assert report.stability_edge(_rounds(lr=0.003)).iloc[0] == pytest.approx(2 / 0.003)
    assert report.stability_edge(_rounds(server_lr=2.0)).iloc[0] == pytest.approx(100.0)  # θ moves η_g·lr·g
    assert report.stability_edge(_rounds(server_lr=NAN)).iloc[0] == pytest.approx(200.0)  # not recorded: 1
    assert report.stability_edge(_rounds().drop(columns=["momentum", "augment"])).iloc[0] == pytest.approx(200.0)
    assert math.isnan(report.stability_edge(_rounds().drop(columns=["lr"])).iloc[0])  # a run that records no lr


@pytest.mark.parametrize("config", [{"bs": "32"}, {"tau": 2}, {"momentum": 0.9}, {"weight-decay": 5e-4},
                                    {"mask-mode": "synchronized"}, {"augment": "crop-flip"}])
def test_no_edge_where_a_round_is_not_one_plain_full_batch_step(config):
    assert math.isnan(report.stability_edge(_rounds(**config)).iloc[0])


def test_a_local_steps_edge_is_two_one_plus_momentum_over_lr_less_weight_decay():
    assert report.step_edge(_rounds()).iloc[0] == pytest.approx(200.0)
    assert report.step_edge(_rounds(bs="32", tau=2, server_lr=2.0)).iloc[0] == pytest.approx(200.0)  # any batch, τ, η_g
    assert report.step_edge(_rounds(momentum=0.9)).iloc[0] == pytest.approx(2 * 1.9 / 0.01)  # heavy ball: 2(1+β)/η
    assert report.step_edge(_rounds(**{"weight-decay": 5e-4})).iloc[0] == pytest.approx(200.0 - 5e-4)  # η(λ+wd) < 2
    assert report.step_edge(_rounds().drop(columns=["momentum", "weight-decay"])).iloc[0] == pytest.approx(200.0)
    assert math.isnan(report.step_edge(_rounds().drop(columns=["lr"])).iloc[0])


def _sharp_runs(root):
    """lr 0.1 (edge 20): lambda_max 5, 15, 25, 18 at rounds 2, 4, 6, 8 -> at the edge first at round 6;
    lr 0.01 (edge 200): never; a bs-32 run at lr 0.1: no round edge, its local step's edge 20 first reached
    at round 6; a run that measured nothing."""
    measured = [NAN, 5.0, NAN, 15.0, NAN, 25.0, NAN, 18.0]
    write_run(root, "fast", {"batch-size": "full", "local-epochs": 1, "lr": 0.1, "num-rounds": 8},
              rows([3.0] * 8, hessian_lambda_max=measured))
    write_run(root, "slow", {"batch-size": "full", "local-epochs": 1, "lr": 0.01, "num-rounds": 8},
              rows([3.0] * 8, hessian_lambda_max=measured))
    write_run(root, "minibatch", {"lr": 0.1, "num-rounds": 8}, rows([3.0] * 8, hessian_lambda_max=measured))
    write_run(root, "unmeasured", {"num-rounds": 8}, rows([3.0] * 8))


def test_sharpness_table_finds_the_first_round_at_the_edge(tmp_path):
    _sharp_runs(tmp_path)
    table = report.sharpness_table(report.load_runs([tmp_path])).set_index("run_name")
    assert list(table.columns) == list(report.SHARPNESS_COLUMNS)[1:]
    assert sorted(table.index) == ["fast", "minibatch", "slow"]
    fast, slow, minibatch = table.loc["fast"], table.loc["slow"], table.loc["minibatch"]
    assert fast["edge"] == pytest.approx(20.0) and fast["first_round_at_edge"] == 6
    assert (fast["measured"], fast["first_round"]) == (4, 2)
    assert (fast["lambda_max_first"], fast["lambda_max_max"], fast["lambda_max_last"]) == (5.0, 25.0, 18.0)
    assert fast["step_edge"] == pytest.approx(20.0) and fast["first_round_at_step_edge"] == 6
    assert slow["edge"] == pytest.approx(200.0) and math.isnan(slow["first_round_at_edge"])
    assert slow["step_edge"] == pytest.approx(200.0) and math.isnan(slow["first_round_at_step_edge"])
    assert math.isnan(minibatch["edge"]) and math.isnan(minibatch["first_round_at_edge"])
    assert minibatch["step_edge"] == pytest.approx(20.0) and minibatch["first_round_at_step_edge"] == 6


def test_report_writes_sharpness_only_when_lambda_max_was_measured(tmp_path, capsys):
    _sharp_runs(tmp_path / "runs")
    assert report_cli.main([str(tmp_path / "runs"), "--out", str(tmp_path / "out")]) == 0
    assert "sharpness" in capsys.readouterr().out
    written = pd.read_csv(tmp_path / "out" / "sharpness.csv")
    assert list(written.columns) == list(report.SHARPNESS_COLUMNS) and len(written) == 3
    assert (tmp_path / "out" / "sharpness_rounds.png").read_bytes().startswith(PNG_MAGIC)

    assert report_cli.main([str(tmp_path / "runs" / "unmeasured"), "--out", str(tmp_path / "none")]) == 0
    assert not (tmp_path / "none" / "sharpness.csv").exists()
    assert not (tmp_path / "none" / "sharpness_rounds.png").exists()


def test_notebook_shows_the_committed_sharpness_runs(tmp_path):
    """notebooks/analysis.ipynb on docs/mini-cnn-sharpness/runs (real lambda_max measurements) prints the
    table and draws the figure: lr 0.03 reaches 2/lr = 66.67 at round 65, lr 0.1 at round 10."""
    printed = run_notebook(PROJECT / "docs" / "mini-cnn-sharpness" / "runs", tmp_path)
    table = printed.split("edge 2 (1 + momentum) / lr - weight-decay:\n", 1)[1]
    assert "first_round_at_edge" in table and "66.67" in table
    by_run = {line.split()[0]: line.split() for line in table.splitlines()[1:4]}
    assert by_run["lr=0.03_seed=0"][-2:] == ["65", "65"] and by_run["lr=0.1_seed=0"][-2:] == ["10", "10"]
    assert by_run["lr=0.01_seed=0"][-2:] == ["NaN", "NaN"]  # plain full-batch steps: the two edges are one
    assert (tmp_path / "sharpness_rounds.png").read_bytes().startswith(PNG_MAGIC)
