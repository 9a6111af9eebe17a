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

NAN = float("nan")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PROJECT = Path(__file__).resolve().parents[1]


def write_run(root: Path, name: str, config: dict, rows: list[dict], tail: str = "") -> Path:
    """A run folder as fedmask_app.run.results writes it: config.json and rounds.csv (NaN -> empty cell)."""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    run_config = {
        "seed": 0, "num-clients": 100, "clients-per-round": 10, "num-rounds": 6, "alpha": 100.0, "model": "tiny",
        "local-epochs": 2, "batch-size": 32, "mask-mode": "none", "eval-every": 1, "data-dir": "/data",
        "output-dir": str(root), "run-name": name, "resume": True, **config,
    }
    (run_dir / "config.json").write_text(json.dumps({"run_config": run_config, "run_name": name}))
    with (run_dir / "rounds.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=report.ROUND_COLUMNS, lineterminator="\n")
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


@pytest.mark.slow
def test_tiny_sweep_then_notebook(tmp_path):
    """fedmask-sweep conf/tiny/grid.toml (local engine), then notebooks/analysis.ipynb end to end."""
    import nbformat
    from nbclient import NotebookClient

    from fedmask_app.cli import sweep

    if not (SHARED_DATA / "cifar10.npz").is_file():
        pytest.skip(f"no data set at {SHARED_DATA}")
    results, figures = tmp_path / "results", tmp_path / "figures"
    rc = sweep.main([str(PROJECT / "conf" / "tiny" / "grid.toml"), "--engine", "local",
                     "--output-dir", str(results), f'data-dir="{SHARED_DATA}"', "threads=1"])
    assert rc == 0
    assert len(list(results.glob("*/rounds.csv"))) == 4

    notebook = nbformat.read(PROJECT / "notebooks" / "analysis.ipynb", as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), \
        "commit the notebook with outputs cleared"
    saved = {k: os.environ.get(k) for k in ("FEDMASK_RESULTS", "FEDMASK_FIGURES")}
    os.environ.update(FEDMASK_RESULTS=str(results), FEDMASK_FIGURES=str(figures))
    try:
        NotebookClient(notebook, kernel_name="python3", timeout=600,
                       resources={"metadata": {"path": str(PROJECT / "notebooks")}}).execute()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    pngs = sorted(p.name for p in figures.glob("*.png"))
    assert pngs == ["fig1.png", "per_round.png", "recovery_vs_r.png"]
    assert all((figures / name).read_bytes()[:8] == PNG_MAGIC for name in pngs)
