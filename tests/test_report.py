"""fedmask-report and fedmask_app.report on hand-made run folders whose medians are computed by hand;
the slow test makes a tiny sweep and runs notebooks/analysis.ipynb on it."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from flwr_runner import SHARED_DATA

from fedmask_app import report
from fedmask_app.cli import report as report_cli


def write_shards(run_dir, sizes) -> None:
    """shards.csv as the run writes it (RunResults.write_shards)."""
    (Path(run_dir) / "shards.csv").write_text(
        "partition_id,num_examples\n" + "".join(f"{i},{n}\n" for i, n in enumerate(sizes))
    )

NAN = float("nan")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PROJECT = Path(__file__).resolve().parents[1]


def write_run(root: Path, name: str, config: dict, rows: list[dict], tail: str = "", engine: str | None = None,
              drop: tuple[str, ...] = ()) -> Path:
    """A run folder as fedmask_app.run.results writes it: config.json and rounds.csv (NaN -> empty cell).
    Row keys beyond ROUND_COLUMNS become extra columns; ``drop`` leaves run-config keys out (older runs)."""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    run_config = {
        "seed": 0, "num-clients": 100, "clients-per-round": 10, "num-rounds": 6, "alpha": 100.0, "model": "tiny",
        "local-epochs": 2, "batch-size": 32, "mask-mode": "none", "eval-every": 1, "data-dir": "/data",
        "output-dir": str(root), "run-name": name, "resume": True, **config,
    }
    run_config = {k: v for k, v in run_config.items() if k not in drop}
    meta = {"run_config": run_config, "run_name": name, **({"engine": engine} if engine else {})}
    (run_dir / "config.json").write_text(json.dumps(meta))
    extra = list(dict.fromkeys(k for row in rows for k in row if k not in report.ROUND_COLUMNS))
    with (run_dir / "rounds.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*report.ROUND_COLUMNS, *extra], lineterminator="\n")
        writer.writeheader()
        for row in rows:
            full = {"recovery_weighted": row["recovery"] + 0.5, "mean_sq_norm": 1.0, "sq_norm_of_mean": 0.5,
                    "sigma2_hat": 2 * row["recovery"], "mu2_hat": 3 * row["recovery"], "test_accuracy": 0.5,
                    "test_loss": 1.0, "train_loss": 1.0, "num_clients": 10, "num_examples": 5000,
                    "num_failures": 0, "cohort": "0 1 2", "seconds": 1.0, **row}
            writer.writerow({k: "" if isinstance(v, float) and math.isnan(v) else v for k, v in full.items()})
        f.write(tail)
    return run_dir


def rows(recoveries, **columns) -> list[dict]:
    """Rounds 1..len(recoveries); columns give per-round lists for other columns."""
    return [{"round": i + 1, "recovery": r, **{k: v[i] for k, v in columns.items()}} for i, r in enumerate(recoveries)]


@pytest.fixture
def runs_root(tmp_path: Path) -> Path:
    """num-rounds 6, window 4 -> rounds 3..6.

    Cell bs=32 tau=2: seed 0 complete, window recovery [0.5, 2, 3, 4] (median 2.5, 25 % below 1),
    test accuracy [0.3, NaN, 0.5, 0.6] (median 0.5), n_k = mean(4900, 4900, 5100, 5100) / 10 = 500;
    seed 1 incomplete (rounds 1-4), window recovery [0.8, 1.2] (median 1.0, 50 %), n_k = 480.
    Cell medians: recovery (2.5 + 1.0) / 2 = 1.75, pct_below_1 37.5, n_k 490 -> T = 2 * ceil(490/32) = 32.
    Cell bs=full tau=5: T = 5; one run, recovery [9, 9, 8, 7] -> 8.5; a row half written at the end.
    """
    root = tmp_path / "results"
    write_run(root, "bs32_seed0", {"seed": 0}, rows(
        [5, 5, 0.5, 2, 3, 4], test_accuracy=[0.1, 0.2, 0.3, NAN, 0.5, 0.6],
        num_examples=[1, 1, 4900, 4900, 5100, 5100]))
    write_run(root, "bs32_seed1", {"seed": 1}, rows([5, 5, 0.8, 1.2], num_examples=[1, 1, 4800, 4800]))
    write_run(root / "nested", "bsfull_seed0", {"batch-size": "full", "local-epochs": 5}, rows(
        [1, 1, 9, 9, 8, 7]), tail="7,0.1,0.2")
    return root


def test_reading_results_does_not_import_torch():
    code = "import sys, fedmask_app.report, fedmask_app.cli.report; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_window_median_pct_below_1_and_incomplete_runs(runs_root):
    rounds = report.load_runs([runs_root])
    assert sorted(rounds["run_name"].unique()) == ["bs32_seed0", "bs32_seed1", "bsfull_seed0"]
    assert rounds[rounds["run_name"] == "bsfull_seed0"]["round"].max() == 6  # the half-written row is dropped
    runs = report.run_summary(rounds, window=4).set_index("run_name")

    seed0, seed1, full = runs.loc["bs32_seed0"], runs.loc["bs32_seed1"], runs.loc["bsfull_seed0"]
    assert seed0["complete"] and full["complete"] and not seed1["complete"]
    assert (seed0["window_start"], seed0["window_rounds"], seed0["rounds_completed"]) == (3, 4, 6)
    assert (seed1["window_rounds"], seed1["rounds_completed"]) == (2, 4)
    assert seed0["recovery"] == pytest.approx(2.5)
    assert seed0["recovery_weighted"] == pytest.approx(3.0)
    assert seed0["sigma2_hat"] == pytest.approx(5.0) and seed0["mu2_hat"] == pytest.approx(7.5)
    assert seed0["test_accuracy"] == pytest.approx(0.5)  # the NaN of round 4 is skipped
    assert seed0["pct_below_1"] == pytest.approx(25.0)
    assert seed0["pct_below_1_all"] == pytest.approx(100 / 6)  # rounds 1-6: [5, 5, 0.5, 2, 3, 4]
    assert seed0["short_rounds"] == 0 and not seed0["many_short"]
    assert math.isnan(seed0["T_min"]) and full["T_min"] == full["T_max"] == 5  # no shards.csv; full batch: tau
    assert "rho_h" not in runs.columns  # no measurement columns in these runs
    assert seed1["recovery"] == pytest.approx(1.0) and seed1["pct_below_1"] == pytest.approx(50.0)
    assert seed0["mean_shard"] == pytest.approx(500.0) and seed0["T"] == 2 * 16
    assert full["recovery"] == pytest.approx(8.5) and full["T"] == 5


def test_cell_median_across_seeds_and_T(runs_root):
    runs = report.run_summary(report.load_runs([runs_root]), window=4)
    cells = report.cell_summary(runs).set_index("bs")
    assert list(cells.index) == ["32", "full"]  # numeric batch sizes first, then full
    bs32 = cells.loc["32"]
    assert (bs32["tau"], bs32["alpha"], bs32["n_seeds"], bs32["n_runs"], bs32["n_incomplete"]) == (2, 100.0, 2, 2, 1)
    assert bs32["recovery"] == pytest.approx(1.75)
    assert bs32["pct_below_1"] == pytest.approx(37.5)
    assert bs32["pct_below_1_all"] == pytest.approx((100 / 6 + 25) / 2)  # seed 1: [5, 5, 0.8, 1.2] -> 25 %
    assert bs32["n_k"] == pytest.approx(490.0) and bs32["T"] == 2 * math.ceil(490 / 32)
    assert cells.loc["full", "T"] == 5 and cells.loc["full", "n_seeds"] == 1


def test_window_longer_than_run_and_run_without_rounds(tmp_path):
    write_run(tmp_path, "a", {"num-rounds": 3}, rows([2, 4, 6]))
    write_run(tmp_path, "b", {"num-rounds": 3, "seed": 1}, [])
    runs = report.run_summary(report.load_runs([tmp_path]), window=50).set_index("run_name")
    assert runs.loc["a", "window_start"] == 1 and runs.loc["a", "recovery"] == pytest.approx(4.0)
    assert runs.loc["b", "rounds_completed"] == 0 and not runs.loc["b", "complete"]
    assert math.isnan(runs.loc["b", "recovery"])


def test_cells_split_on_defining_keys_only(tmp_path):
    write_run(tmp_path / "x", "r0", {"seed": 0, "device": "cpu"}, rows([1, 2, 3, 4, 5, 6]))
    write_run(tmp_path / "y", "r1", {"seed": 1, "device": "cuda"}, rows([1, 2, 3, 4, 5, 8]))
    write_run(tmp_path / "y", "r2", {"seed": 0, "mask-mode": "synchronized"}, rows([1, 2, 3, 4, 5, 6]))
    cells = report.cell_summary(report.run_summary(report.load_runs([tmp_path]), window=2))
    assert sorted(cells["n_seeds"]) == [1, 2]
    assert "mask-mode" in cells.columns  # the key that differs is shown
    assert set(cells["cell"]) == {"bs=32 τ=2 α=100 mask-mode=none", "bs=32 τ=2 α=100 mask-mode=synchronized"}
    assert cells.set_index("mask-mode").loc["none", "recovery"] == pytest.approx((5.5 + 6.5) / 2)


def test_decomposition_curve_is_the_recovery_identity():
    # with the server-side estimators, (K r + 1)/(r + 1) = K B / A = 1/ΔS exactly (all K clients reporting)
    k, a, b = 10, 2.0, 0.7
    sigma2 = (a - b) / (1 - 1 / k)
    assert report.decomposition_curve((a - sigma2) / sigma2, k) == pytest.approx(k * b / a)


def test_report_cli_writes_summary_figure_and_ratios(runs_root, tmp_path, capsys):
    reference = tmp_path / "paper.csv"
    reference.write_text("bs,tau,alpha,recovery,test_accuracy\n32,2,100,1.19,0.5\nfull,1,100,8.96,0.3\n")
    out = tmp_path / "report"
    assert report_cli.main([str(runs_root), "--window", "4", "--out", str(out), "--reference", str(reference)]) == 0
    captured = capsys.readouterr()
    assert "incomplete run" in captured.err and "bs32_seed1" in captured.err
    assert "match no cell" in captured.err  # full, tau=1 is not in the results
    assert "reduced protocol: 6 rounds, window 4" in captured.out

    table = pd.read_csv(out / "summary.csv", dtype={"bs": str}).set_index("bs")
    assert len(table) == 2
    assert table.loc["32", "recovery"] == pytest.approx(1.75)
    assert table.loc["32", "recovery_ref"] == pytest.approx(1.19)
    assert table.loc["32", "recovery_ratio"] == pytest.approx(1.75 / 1.19)
    assert table.loc["32", "test_accuracy_ratio"] == pytest.approx(0.5 / 0.5)
    assert math.isnan(table.loc["full", "recovery_ratio"])  # no reference row for full, tau=5
    assert "mu2_hat_ratio" not in table.columns
    assert (out / "fig1.png").read_bytes()[:8] == PNG_MAGIC


def test_report_default_out_is_first_dir(runs_root, capsys):
    assert report_cli.main([str(runs_root), "--window", "2"]) == 0
    assert (runs_root / "summary.csv").is_file() and (runs_root / "fig1.png").read_bytes()[:8] == PNG_MAGIC


def test_report_errors(tmp_path, runs_root, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert report_cli.main([str(empty)]) == 2
    assert "no runs" in capsys.readouterr().err

    assert report_cli.main([str(tmp_path / "missing")]) == 2
    assert "is not a folder" in capsys.readouterr().err

    bad = tmp_path / "bad.csv"
    bad.write_text("batch,tau,recovery\n32,2,1.19\n")
    assert report_cli.main([str(runs_root), "--reference", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "bs" in err and "alpha" in err

    no_metric = tmp_path / "no_metric.csv"
    no_metric.write_text("bs,tau,alpha,accuracy\n32,2,100,0.5\n")
    assert report_cli.main([str(runs_root), "--reference", str(no_metric)]) == 2
    assert "none of the metric columns" in capsys.readouterr().err

    with pytest.raises(SystemExit):
        report_cli.main([str(runs_root), "--window", "0"])


def test_the_table_prints_a_share_below_1_to_a_tenth_of_a_percent(tmp_path):
    """One round of 8 below 1 is 12.5 % of the run, shown as such (not rounded to a whole 12): in a
    200-round run one such round is 0.5 %, which a whole-percent format showed as 0."""
    write_run(tmp_path, "one", {"num-rounds": 8}, rows([5, 5, 0.5, 5, 5, 5, 5, 5]))
    cells = report.cell_summary(report.run_summary(report.load_runs([tmp_path]), window=4))
    assert cells.loc[0, "pct_below_1_all"] == pytest.approx(12.5)
    header, first = report.format_table(cells).splitlines()[:2]
    values = dict(zip(header.split(), first.split(), strict=False))  # the last column, note, holds spaces
    assert (values["pct_below_1"], values["pct_below_1_all"]) == ("0.0", "12.5")


def test_short_rounds_are_left_out_of_the_recovery_statistics_and_counted(tmp_path, capsys):
    """Window rounds 3-6; rounds 4 and 6 have 8 and 9 of K_c = 10 good replies.

    Full window rounds 3 and 5: recovery [0.5, 3] -> 1.75, recovery_weighted [1, 3.5] -> 2.25,
    sigma2 [1, 6] -> 3.5, mu2 [1.5, 9] -> 5.25, pct_below_1 50 %; all full rounds 1, 2, 3, 5:
    [5, 5, 0.5, 3] -> pct_below_1_all 25 %. test_accuracy over every window round [.3, .4, .5, .6] -> 0.45.
    2 short of 4 window rounds > 10 %: many_short. Seed 1 has no short round: the cell counts 2.
    """
    write_run(tmp_path, "short", {"seed": 0}, rows(
        [5, 5, 0.5, 0.2, 3, 9], num_clients=[10, 10, 10, 8, 10, 9], test_accuracy=[0.1, 0.2, 0.3, 0.4, 0.5, 0.6]))
    write_run(tmp_path, "fine", {"seed": 1}, rows([5, 5, 1, 1, 1, 1]))
    runs = report.run_summary(report.load_runs([tmp_path]), window=4).set_index("run_name")
    short = runs.loc["short"]
    assert (short["window_rounds"], short["full_rounds"], short["short_rounds"]) == (4, 2, 2)
    assert short["many_short"] and not runs.loc["fine", "many_short"]
    assert short["recovery"] == pytest.approx(1.75) and short["recovery_weighted"] == pytest.approx(2.25)
    assert short["sigma2_hat"] == pytest.approx(3.5) and short["mu2_hat"] == pytest.approx(5.25)
    assert short["pct_below_1"] == pytest.approx(50.0) and short["pct_below_1_all"] == pytest.approx(25.0)
    assert short["test_accuracy"] == pytest.approx(0.45)

    cells = report.cell_summary(runs.reset_index())
    assert (cells.loc[0, "short_rounds"], cells.loc[0, "n_many_short"]) == (2, 1)
    assert cells.loc[0, "recovery"] == pytest.approx((1.75 + 1) / 2)
    assert "2 short rounds left out" in report.format_table(cells)
    assert "full rounds only" in report.table_note(cells)

    assert report_cli.main([str(tmp_path), "--window", "4"]) == 0
    err = capsys.readouterr().err
    assert "short" in err and "2 of its 4 window rounds had fewer than K_c = 10" in err


def test_one_short_round_in_ten_is_not_many(tmp_path):
    write_run(tmp_path, "a", {"num-rounds": 10}, rows([2] * 10, num_clients=[10] * 9 + [9]))
    run = report.run_summary(report.load_runs([tmp_path]), window=10).iloc[0]
    assert run["short_rounds"] == 1 and not run["many_short"]  # 10 % is not more than 10 %


def test_T_range_from_shards_csv(tmp_path, capsys):
    """bs 32, tau 2, window rounds 3-6. Seed 0: shards [20, 100, 1000, 3000, 64], window cohorts use
    clients 0, 1, 2, 4 (client 3 only before the window) -> n_k 20..1000 -> T 2*1 = 2 .. 2*32 = 64.
    Seed 1: shards [40, 50, 60, 70, 80], cohorts "3 4" -> 70..80 -> T 6 .. 6. Cell: 2 .. 64.
    α = 0.1 cell: one run without shards.csv -> NaN. Full batch: T = tau = 5 either way."""
    a = write_run(tmp_path, "a", {"seed": 0}, rows([1] * 6, cohort=["3", "3", "0 1", "1 2", "2 4", "1 4"]))
    b = write_run(tmp_path, "b", {"seed": 1}, rows([1] * 6, cohort=["3 4"] * 6))
    write_shards(a, [20, 100, 1000, 3000, 64])
    write_shards(b, [40, 50, 60, 70, 80])
    write_run(tmp_path, "c", {"alpha": 0.1}, rows([1] * 6))
    write_run(tmp_path, "d", {"batch-size": "full", "local-epochs": 5}, rows([1] * 6))
    assert (a / "shards.csv").read_text().splitlines()[:2] == ["partition_id,num_examples", "0,20"]
    assert list(report.read_shards(a)) == [20, 100, 1000, 3000, 64]

    rounds = report.load_runs([tmp_path])
    assert list(rounds[rounds["run_name"] == "a"]["shard_max"]) == [3000, 3000, 100, 1000, 1000, 100]
    # W2 = sum of (n_k / sum n)^2: one client 1; "0 1" (20, 100) (1/6)^2 + (5/6)^2; "3 4" (70, 80) by hand
    w2 = rounds.groupby("run_name")["sum_sq_weights"].apply(list)
    assert w2["a"][:3] == pytest.approx([1.0, 1.0, 26 / 36])
    assert w2["b"] == pytest.approx([(70**2 + 80**2) / 150**2] * 6)
    assert rounds[rounds["run_name"] == "c"]["sum_sq_weights"].isna().all()  # no shards.csv
    runs = report.run_summary(rounds, window=4).set_index("run_name")
    assert (runs.loc["a", "T_min"], runs.loc["a", "T_max"]) == (2, 64)
    assert (runs.loc["b", "T_min"], runs.loc["b", "T_max"]) == (6, 6)
    assert math.isnan(runs.loc["c", "T_min"]) and (runs.loc["d", "T_min"], runs.loc["d", "T_max"]) == (5, 5)
    cells = report.cell_summary(runs.reset_index()).set_index("cell")
    bs32 = cells.loc["bs=32 τ=2 α=100"]
    assert (bs32["T_min"], bs32["T_max"]) == (2, 64)
    assert math.isnan(cells.loc["bs=32 τ=2 α=0.1", "T_max"])

    (a / "shards.csv").write_text("partition_id,num_examples\n0,20\n")  # lacks the cohorts' other clients
    with pytest.warns(UserWarning, match="shards.csv not used"):
        rounds = report.load_runs([a])
    assert rounds["shard_min"].isna().all() and rounds["sum_sq_weights"].isna().all()
    assert report_cli.main([str(tmp_path / "c"), "--window", "4"]) == 0
    assert "without a usable shards.csv" in capsys.readouterr().err


def test_protocol_note_names_every_deviation(tmp_path):
    write_run(tmp_path, "a", {"num-rounds": 6, "test-subset": 1000, "model": "resnet18-gn", "bf16": True,
                              "max-shard-size": 500, "clients-per-round": 5, "aggregation": "uniform"},
              rows([1] * 6, num_clients=[5] * 6), engine="vectorized")
    cells = report.cell_summary(report.run_summary(report.load_runs([tmp_path]), window=4))
    note = report.protocol_note(cells)
    for part in ("reduced protocol: 6 rounds, window 4", "1 seed(s) per cell (paper 3)",
                 "test accuracy on 1000 of the 10000 test images", "model resnet18-gn (ResNet-18/GN with "
                 "torchvision's ImageNet stem", "precision bf16", "engine vectorized",
                 "shards capped at 500 examples", "K_c = 5 a round (paper 10)", "uniform aggregation",
                 "local training is plain SGD"):
        assert part in note, part
    assert "K = " not in note and "lr " not in note and "masks" not in note

    paper = pd.DataFrame([{"num_rounds": 200, "window": 50, "n_seeds": 3, "test-subset": 0, "precision": "float32",
                           "model": "resnet18-gn-cifar", "engine": "flower", "max-shard-size": 0, "num-clients": 100,
                           "clients-per-round": 10, "lr": 0.01, "aggregation": "weighted", "mask-mode": "none",
                           "server-step": "fedavg", "identical-shards": False}])
    assert report.protocol_deviations(paper) == [
        "model resnet18-gn-cifar (ResNet-18/GN with a 3×3/1 CIFAR stem, no max-pool) (paper: ResNet-18/GN, stem not "
        "stated)",
        "engine flower", report.protocol.LOCAL_TRAINING]
    assert report.protocol_note(paper).startswith("paper protocol: 200 rounds, window 50. Differs from the paper")
    with_momentum = paper.assign(momentum=[0.9])
    assert report.protocol_deviations(with_momentum)[-1] == (
        "local training is SGD with momentum 0.9 (project default: plain SGD; the paper states lr only)")
    both = pd.concat([paper.assign(momentum=0.0), paper.assign(momentum=0.5, **{"weight-decay": 5e-4})])
    assert report.protocol_deviations(both)[-1].startswith("local training is SGD with momentum 0.5 and weight "
                                                           "decay 0.0005")
    augmented = pd.concat([paper.assign(augment="none"), paper.assign(augment="crop-flip")])
    assert report.protocol_deviations(augmented)[-1] == (
        "local training is SGD with augmentation crop-flip (random 4-pixel-padded crops and horizontal flips) "
        "(project default: plain SGD; the paper states lr only)")
    assert report.protocol_deviations(paper.assign(augment="none"))[-1] == report.protocol.LOCAL_TRAINING


def test_older_runs_share_a_cell_with_runs_that_spell_out_the_new_keys(tmp_path):
    write_run(tmp_path, "old", {"seed": 0, "bf16": False}, rows([1] * 6), drop=("mask-mode",))
    write_run(tmp_path, "new", {"seed": 1, "precision": "float32", "server-step": "fedavg", "fedexp-epsilon": 0.001,
                                "keep-prob-schedule": "fixed", "vectorize": True,
                                "gemm-convs": True}, rows([3] * 6))
    write_run(tmp_path, "bf16", {"seed": 0, "bf16": True}, rows([5] * 6))
    cells = report.cell_summary(report.run_summary(report.load_runs([tmp_path]), window=4)).set_index("precision")
    assert cells.loc["float32", "n_seeds"] == 2 and cells.loc["float32", "recovery"] == pytest.approx(2.0)
    assert cells.loc["bf16", "n_seeds"] == 1 and "bf16" not in cells.columns


def _measured(**columns) -> list[dict]:
    """Six rounds with measurement columns (NaN where not measured); round 6 is short (9 replies)."""
    return rows([1, 1, 1, 1, 1, 1], num_clients=[10] * 5 + [9], **columns)


def test_curvature_medians_over_measured_rounds_only(tmp_path, capsys):
    """Window rounds 3-6. rho_h measured on 3, 5 and the short round 6: [1.2, 2.0] -> 1.6 (full rounds);
    rho_h_flag: 3 ok, 4 not significant (its value 100 is left out), 5 ok (6 short: left out) -> 3 measured,
    1 flagged; rho_h_se [0.1, 0.3] -> 0.2.
    hessian_lambda_max on 3, 5, 6 (a model measurement: short rounds count) [10, 30, 50] -> 30; final 50.
    A second seed of an older run has none of the columns: the cell's median is seed 0's."""
    write_run(tmp_path, "new", {"seed": 0}, _measured(
        rho_h=[NAN, NAN, 1.2, 100.0, 2.0, 9.0], rho_h_se=[NAN, NAN, 0.1, 50.0, 0.3, 0.2],
        rho_h_flag=["", "", "ok", "denominator_not_significant", "ok", "ok"],
        hessian_lambda_max=[NAN, NAN, 10.0, NAN, 30.0, 50.0], server_lr=[1, 1, 2, 2, 2, 4]))
    write_run(tmp_path, "old", {"seed": 1}, rows([1] * 6))
    unmeasured = write_run(tmp_path / "u", "unmeasured", {}, _measured(rho_h=[NAN] * 6, rho_h_flag=[""] * 6))
    alone = report.run_summary(report.load_runs([unmeasured]), window=4).iloc[0]  # flags: an all-empty column
    assert (alone["rho_h_measured"], alone["rho_h_flagged"]) == (0, 0) and math.isnan(alone["rho_h"])
    runs = report.run_summary(report.load_runs([tmp_path / "new", tmp_path / "old"]), window=4).set_index("run_name")
    new, old = runs.loc["new"], runs.loc["old"]
    assert new["rho_h"] == pytest.approx(1.6) and new["rho_h_se"] == pytest.approx(0.2)
    assert (new["rho_h_measured"], new["rho_h_flagged"]) == (3, 1)
    assert new["hessian_lambda_max"] == pytest.approx(30.0) and new["final_lambda_max"] == pytest.approx(50.0)
    assert new["server_lr"] == pytest.approx(2.0)  # [2, 2, 2, 4]
    assert math.isnan(old["rho_h"]) and math.isnan(old["final_lambda_max"])
    cells = report.cell_summary(runs.reset_index())
    assert cells.loc[0, "rho_h"] == pytest.approx(1.6) and cells.loc[0, "rho_h_flagged"] == 1
    assert "penalty_sync" not in cells  # no run has it
    shown = report.table_columns(cells)
    assert {"rho_h", "rho_h_se", "rho_h_measured", "rho_h_flagged", "hessian_lambda_max", "server_lr"} <= set(shown)

    out = tmp_path / "report"
    assert report_cli.main([str(tmp_path / "new"), str(tmp_path / "old"), "--window", "4", "--out", str(out)]) == 0
    assert "curvature and flatness" in capsys.readouterr().out
    assert (out / "curvature.png").read_bytes()[:8] == PNG_MAGIC
    assert not (out / "comparison.png").exists()  # the runs do not differ in mask-mode or server-step

    plain = write_run(tmp_path / "p", "plain", {}, _measured(rho_h=[NAN] * 6, rho_h_flag=[""] * 6, server_lr=[1] * 6))
    cells = report.cell_summary(report.run_summary(report.load_runs([plain]), window=4))
    assert report.measurement_columns(cells) == []  # FedAvg's η_g = 1 and zero flag counts say nothing
    assert report_cli.main([str(plain), "--window", "4", "--out", str(out)]) == 0
    assert "curvature and flatness" not in capsys.readouterr().out


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_curvature_figure_is_a_png(tmp_path, sign):
    """All penalties positive: log-log; one negative: symlog."""
    cells = pd.DataFrame([
        {"cell": "A", "recovery_weighted": 1.2, "rho_h": 1.5, "rho_h_se": 0.2, "rho_direct": 1.4, "rho_direct_se": 0.3,
         "penalty_sync": 2e-3, "penalty_sync_se": 1e-4, "penalty_sync_pred": 2.2e-3,
         "penalty_ind": sign * 1e-3, "penalty_ind_se": 1e-4, "penalty_ind_pred": 1.1e-3},
        {"cell": "B", "recovery_weighted": 4.0, "rho_h": 3.0, "rho_h_se": NAN, "rho_direct": NAN, "rho_direct_se": NAN,
         "penalty_sync": NAN, "penalty_sync_se": NAN, "penalty_sync_pred": NAN,
         "penalty_ind": NAN, "penalty_ind_se": NAN, "penalty_ind_pred": NAN},
    ])
    fig = report.curvature_figure(cells, tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:8] == PNG_MAGIC
    assert fig.axes[1].get_xscale() == ("log" if sign > 0 else "symlog")


def test_curvature_rounds_are_the_measured_full_rounds_with_flagged_ratios_left_out(tmp_path):
    """Rounds 3, 4, 5 measured and 6 measured but short (9 replies): round 6 is left out (its ceiling
    is lower), round 4's not-significant rho_h and its s.e. become NaN while its penalties stay; a
    run that never measured draws no column, and the figure has one column of two panels per run."""
    write_run(tmp_path, "new", {"seed": 0}, _measured(
        rho_h=[NAN, NAN, 1.2, 100.0, 2.0, 9.0], rho_h_se=[NAN, NAN, 0.1, 50.0, 0.3, 0.2],
        rho_h_flag=["", "", "ok", "denominator_not_significant", "ok", "ok"],
        penalty_sync=[NAN, NAN, 2e-3, 3e-3, 1e-3, 1e-3], penalty_sync_pred=[NAN, NAN, 4e-3, 3e-3, 1e-3, 1e-3]))
    write_run(tmp_path, "old", {"seed": 1}, rows([1] * 6))
    rounds = report.load_runs([tmp_path])
    measured = report.measured_rounds(rounds[rounds["run_name"] == "new"])
    assert list(measured["round"]) == [3, 4, 5]
    assert list(measured["rho_h"].fillna(-1)) == [1.2, -1, 2.0]
    assert measured["rho_h_se"].isna().tolist() == [False, True, False]
    assert list(measured["penalty_sync"] / measured["penalty_sync_pred"]) == pytest.approx([0.5, 1.0, 1.0])
    assert report.measured_rounds(rounds[rounds["run_name"] == "old"]).empty

    fig = report.curvature_rounds_figure(rounds, tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:8] == PNG_MAGIC
    assert len(fig.axes) == 2 and fig.axes[0].get_title() == "new"


def test_comparison_orders_cells_fedavg_first_then_by_mask(tmp_path):
    """Unmasked FedAvg, unmasked FedExP, then each mask mode with per-tensor masks before coordinate
    masks; runs that differ only in mask-granularity are a comparison too."""
    cells = {
        "coord": {"mask-mode": "independent", "mask-granularity": "coordinate"},
        "fedexp": {"server-step": "fedexp", "keep-prob": 0.8},
        "tensor": {"mask-mode": "independent", "mask-granularity": "tensor"},
        "fedavg": {"server-step": "fedavg", "keep-prob": 0.8},
    }
    for name, config in cells.items():
        write_run(tmp_path, name, config, rows([1] * 6, test_accuracy=[.1] * 6))
    runs = report.run_summary(report.load_runs([tmp_path]), window=4)
    table = report.comparison_table(runs)
    order = list(zip(table["mask-mode"], table["server-step"].fillna("fedavg"), table["mask-granularity"],
                     strict=True))
    assert order == [("none", "fedavg", "tensor"), ("none", "fedexp", "tensor"),
                     ("independent", "fedavg", "tensor"), ("independent", "fedavg", "coordinate")]
    masked = runs[runs["mask-mode"] == "independent"]
    assert report.compares_training(masked)


@pytest.mark.parametrize(("config", "label"), [
    ({"mask-mode": "none", "server-step": "fedavg"}, "no mask"),
    ({"mask-mode": "none", "server-step": "fedexp"}, "no mask FedExP"),
    ({"mask-mode": "independent", "keep-prob": 0.8, "mask-granularity": "tensor"}, "indep. p=0.8"),
    ({"mask-mode": "independent", "keep-prob": 0.5, "mask-granularity": "coordinate"}, "indep. p=0.5 per coord."),
    ({"mask-mode": "synchronized", "keep-prob-schedule": "calibrated", "penalty-target": 0.025},
     "sync. calibrated c=0.025"),
])
def test_training_label_names_how_a_cell_trains(config, label):
    assert report.comparison.training_label(config) == label


def test_comparison_table_and_figure(tmp_path, capsys):
    """Cell FedAvg: an older run without mask-mode/keep-prob keys (seed 0) and one with them (seed 1):
    test accuracy [.2 .. .5] and [.1, .3, .6, .4, .5, .45] -> final 0.5 / 0.45 (median 0.475, min 0.45,
    max 0.5), best 0.5 / 0.6 (median 0.55); train loss last 0.7 / 0.9 -> 0.8; recovery 2 / 4 -> 3.
    Cell synchronized p=0.5: one seed, final accuracy 0.6, λ_max last measured 7 (round 4; 6 is empty)."""
    common = {"train_loss": [1, 1, 1, 1, 1, 0.7]}
    write_run(tmp_path, "old", {"seed": 0}, rows([2] * 6, test_accuracy=[.2, .2, .3, .4, .5, .5], **common),
              drop=("mask-mode",))
    write_run(tmp_path, "new", {"seed": 1, "keep-prob": 0.5, "server-step": "fedavg"}, rows(
        [4] * 6, test_accuracy=[.1, .3, .6, .4, .5, .45], train_loss=[1, 1, 1, 1, 1, 0.9]))
    write_run(tmp_path, "masked", {"mask-mode": "synchronized"}, rows(
        [1] * 6, test_accuracy=[.1, .2, .3, .4, .5, .6], hessian_lambda_max=[NAN, 9, NAN, 7, NAN, NAN]))
    runs = report.run_summary(report.load_runs([tmp_path]), window=4)
    assert report.compares_training(runs)
    table = report.comparison_table(runs)
    assert list(table["mask-mode"]) == ["none", "synchronized"]  # unmasked FedAvg first
    fedavg, masked = table.iloc[0], table.iloc[1]
    assert (fedavg["n_seeds"], fedavg["keep-prob"], fedavg["server-step"]) == (2, 0.5, "fedavg")
    assert fedavg["final_test_accuracy"] == pytest.approx(0.475)
    assert (fedavg["final_test_accuracy_min"], fedavg["final_test_accuracy_max"]) == pytest.approx((0.45, 0.5))
    assert fedavg["best_test_accuracy"] == pytest.approx(0.55)
    assert fedavg["final_train_loss"] == pytest.approx(0.8) and fedavg["recovery"] == pytest.approx(3.0)
    assert (fedavg["recovery_min"], fedavg["recovery_max"]) == (2.0, 4.0)
    assert math.isnan(fedavg["final_lambda_max"])
    assert masked["final_test_accuracy"] == pytest.approx(0.6) and masked["final_lambda_max"] == pytest.approx(7.0)

    out = tmp_path / "report"
    assert report_cli.main([str(tmp_path), "--window", "4", "--out", str(out)]) == 0
    assert "masking comparison" in capsys.readouterr().out
    written = pd.read_csv(out / "comparison.csv")
    assert written["final_test_accuracy"].tolist() == pytest.approx([0.475, 0.6])
    assert (out / "comparison.png").read_bytes()[:8] == PNG_MAGIC
    assert not (out / "curvature.png").exists()  # no run has rho_h


def run_notebook(results: Path, figures: Path, at_accuracy: str = "") -> str:
    """notebooks/analysis.ipynb, committed without outputs, executed on ``results``; figures go to ``figures``;
    ``at_accuracy``: its FEDMASK_AT_ACCURACY levels (default: its own). Returns what its cells printed."""
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(PROJECT / "notebooks" / "analysis.ipynb", as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), \
        "commit the notebook with outputs cleared"
    saved = {k: os.environ.get(k) for k in ("FEDMASK_RESULTS", "FEDMASK_FIGURES", "FEDMASK_AT_ACCURACY")}
    os.environ.update(FEDMASK_RESULTS=str(results), FEDMASK_FIGURES=str(figures), FEDMASK_AT_ACCURACY=at_accuracy)
    try:
        NotebookClient(notebook, kernel_name="python3", timeout=600,
                       resources={"metadata": {"path": str(PROJECT / "notebooks")}}).execute()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return "".join(out.get("text", "") for cell in notebook.cells for out in cell.get("outputs", []))


def test_notebook_shows_the_committed_curvature_runs(tmp_path):
    """notebooks/analysis.ipynb on docs/mini-curvature/runs (real measurements, nothing trained here)
    draws both curvature figures and prints the pooled ratios, and at test accuracy 0.3 (its windowed median
    reached by three runs between rounds 20 and 25, where the measurements are) the same ratios at equal
    accuracy."""
    printed = run_notebook(PROJECT / "docs" / "mini-curvature" / "runs", tmp_path, at_accuracy="0.3")
    assert "pooled over each cell's window" in printed and "rho_direct" in printed and "rho_h_excess" in printed
    assert "at equal test accuracy, levels [0.3]" in printed and "1 of 1" in printed
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert {"curvature.png", "curvature_rounds.png", "fig1.png"} <= set(pngs)
    assert all((tmp_path / name).read_bytes()[:8] == PNG_MAGIC for name in pngs)


@pytest.mark.slow
def test_tiny_sweep_then_notebook(tmp_path):
    """fedmask-sweep conf/tiny/grid.toml (local engine), then notebooks/analysis.ipynb end to end."""
    from fedmask_app.cli import sweep

    if not (SHARED_DATA / "cifar10.npz").is_file():
        pytest.skip(f"no data set at {SHARED_DATA}")
    results, figures = tmp_path / "results", tmp_path / "figures"
    rc = sweep.main([str(PROJECT / "conf" / "tiny" / "grid.toml"), "--engine", "local",
                     "--output-dir", str(results), f'data-dir="{SHARED_DATA}"', "threads=1"])
    assert rc == 0
    assert len(list(results.glob("*/rounds.csv"))) == 4

    run_notebook(results, figures)
    pngs = sorted(p.name for p in figures.glob("*.png"))
    assert pngs == ["fig1.png", "per_round.png", "recovery_vs_accuracy.png", "recovery_vs_r.png"]
    assert all((figures / name).read_bytes()[:8] == PNG_MAGIC for name in pngs)
