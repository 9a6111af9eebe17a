"""fedmask_app.run.results: a resume continues only the run its folder holds."""

from __future__ import annotations

import json

import pytest

from fedmask_app.run.config import load_run_config
from fedmask_app.run.results import ResultsError, RunResults, run_metadata


def _open(tmp_path, *overrides: str) -> RunResults:
    cfg = load_run_config([f'output-dir="{tmp_path}"', 'run-name="r"', *overrides])
    return RunResults.open(cfg, run_metadata(cfg, "local", "0" * 64))[0]


def _drop_from_saved_config(results: RunResults, key: str) -> None:
    saved = json.loads(results.config_path.read_text())
    del saved["run_config"][key]
    results.config_path.write_text(json.dumps(saved))


def test_a_key_an_older_run_lacks_counts_as_its_default(tmp_path):
    """Keys come with a default that keeps what runs did before them: an older run's folder
    (config.json without the key) resumes with the key at its default, not at another value."""
    results = _open(tmp_path)
    _drop_from_saved_config(results, "cuda-graphs")
    _open(tmp_path, "resume=true")
    _drop_from_saved_config(results, "cuda-graphs")
    with pytest.raises(ResultsError, match=r"cuda-graphs: False -> True"):
        _open(tmp_path, "resume=true", "cuda-graphs=true", "device='cuda'")
    with pytest.raises(ResultsError, match=r"lr: 0\.01 -> 0\.5"):
        _open(tmp_path, "resume=true", "lr=0.5")
