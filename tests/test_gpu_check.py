"""The GPU check's pieces on a CPU: the CIFAR-10 subset file that travels with the repo tree (verified,
never taken for CIFAR-10 proper, recorded by its own hash), and benchmarks/gpu_check.sh --cpu-smoke."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from flwr_runner import PROJECT, SHARED_DATA

from fedmask_app.run import data
from fedmask_app.run.data import DataError, dataset_sha256, load_dataset, write_subset

pytestmark = pytest.mark.skipif(not (SHARED_DATA / data.FILE_NAME).is_file(), reason=f"no {SHARED_DATA}")


@pytest.fixture
def subset_dir(tmp_path: Path) -> Path:
    """A folder holding only a 600 + 100 image subset."""
    folder = tmp_path / "subset"
    folder.mkdir()
    write_subset(load_dataset(SHARED_DATA), folder / data.SUBSET_FILE_NAME, 600, 100)
    return folder


def _arrays_and_meta(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as npz:
        return {name: npz[name] for name in npz.files}


def test_a_subset_loads_verified_and_names_itself(subset_dir):
    full = load_dataset(SHARED_DATA)
    subset = load_dataset(subset_dir)
    assert subset.x_train.shape == (600, 32, 32, 3) and subset.y_test.shape == (100,)
    np.testing.assert_array_equal(subset.x_train, full.x_train[:600])
    np.testing.assert_array_equal(subset.y_test, full.y_test[:100])
    assert subset.sha256 == data.content_sha256(vars(subset)) != data.CONTENT_SHA256
    assert dataset_sha256(subset_dir) == subset.sha256
    assert dataset_sha256(SHARED_DATA) == full.sha256 == data.CONTENT_SHA256


@pytest.mark.parametrize("change", ["pixels", "subset_of"])
def test_a_corrupt_or_foreign_subset_is_refused(subset_dir, change):
    path = subset_dir / data.SUBSET_FILE_NAME
    arrays = _arrays_and_meta(path)
    if change == "pixels":
        arrays["x_train"] = arrays["x_train"].copy()
        arrays["x_train"][0, 0, 0, 0] ^= 1
    else:
        arrays["subset_of"] = np.array("0" * 64)
    np.savez(path, **arrays)
    with pytest.raises(DataError, match="corrupt" if change == "pixels" else "not of CIFAR-10"):
        load_dataset(subset_dir)


def test_a_folder_with_both_files_is_refused(subset_dir):
    (subset_dir / data.FILE_NAME).symlink_to(SHARED_DATA.resolve() / data.FILE_NAME)
    with pytest.raises(DataError, match="holds both"):
        load_dataset(subset_dir)


def test_a_run_on_a_subset_records_the_subsets_hash(subset_dir, tmp_path):
    from fedmask_app.engines.local import run_local
    from fedmask_app.run.config import run_config_from_values

    cfg = run_config_from_values({
        "model": "linear-softmax", "num-clients": 4, "clients-per-round": 2, "num-rounds": 1, "eval-every": 1,
        "checkpoint-every": 0, "data-dir": str(subset_dir), "output-dir": str(tmp_path), "run-name": "subset",
    })
    run_local(cfg, echo=lambda _: None)
    recorded = json.loads((cfg.run_dir / "config.json").read_text())["data_sha256"]
    assert recorded == load_dataset(subset_dir).sha256


@pytest.mark.slow
def test_the_gpu_check_script_completes_in_cpu_smoke_mode(subset_dir):
    env = {**os.environ, "FEDMASK_GPU_DATA_DIR": str(subset_dir), "PYTHON": sys.executable}
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--cpu-smoke"], cwd=PROJECT, env=env,
                          capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "flwr/ray modules pulled in: []" in out
    assert f"content sha256 {load_dataset(subset_dir).sha256}" in out
    assert "SKIPPED (no CUDA device)" in out
    assert "PROJECTION from measured rounds" in out and "projection float32  vectorised" in out
    assert "float32  vectorised     full-tau1 : host / device-resident seconds per round = " in out
    assert "concurrent N= 2 bs32-tau2 : " in out and "threaded N= 2 bs32-tau2 : " in out
    assert "grouped N= 2 bs32-tau2 : " in out and "x a group of one" in out
    assert "float32  grouped eval N= 2: 2 evaluations of" in out and "batched across the runs" in out
    assert "grouped N= 2 bs32-tau2  in vmap chunks of 2 clients: " in out and "x the engine's group" in out
    assert "streams-graphs: skipped (CUDA graphs and streams need a CUDA device)" in out
    assert "streams 10, K_c 10, shard 500, float32 default: finished in" in out
    assert "float32  sequential     (cpu, channels-last): wall" in out
    assert "float32  vectorised     (cpu, gemm-convs, cudnn.benchmark): wall" in out
    assert "float32  vectorised     bs32-tau2 : seconds per round without / with gemm-convs = " in out
    assert "projection bf16     vectorised-gemm      : grid 1 " in out
    assert done.stdout.rstrip().endswith("=== gpu_check: all steps passed")


def test_the_hang_harness_reports_a_run_past_its_timeout_with_its_stack(subset_dir, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(PROJECT / "benchmarks"))
    streams_graphs_hang = importlib.import_module("streams_graphs_hang")
    # 0.2 s after the imports no run has loaded its data and trained a round: it counts as hung
    streams_graphs_hang.main(["--data-dir", str(subset_dir), "--device", "cpu", "--cases", "1", "--timeout-s", "0.2"])
    out = capsys.readouterr().out
    assert "streams 10, K_c 10, shard 500, float32 default: HUNG after" in out
    assert "Timeout (0:00:00.200000)!" in out and "most recent call first" in out
    assert out.rstrip().endswith("#   streams 10, K_c 10, shard 500, float32 default")
