"""fedmask_app.run.results: a resume continues only the run its folder holds."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedmask_app.run.config import load_run_config, pyproject_defaults
from fedmask_app.run.results import (
    COLUMNS,
    EXTENDED_FROM,
    ResultsError,
    RunResults,
    config_differences,
    run_metadata,
)


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


def test_a_resume_compares_what_the_run_computes_not_where_its_files_are(tmp_path, monkeypatch):
    """output-dir spelled relative or absolute, data-dir moved: the same run; other data (another
    content hash) or another value of a key that changes the numbers: refused, nothing changed."""
    monkeypatch.chdir(tmp_path)
    cfg = load_run_config(['output-dir="results"', 'run-name="r"', 'data-dir="/somewhere/data"'])
    results = RunResults.open(cfg, run_metadata(cfg, "local", "a" * 64))[0]
    results.append_row(dict.fromkeys(COLUMNS, 1))
    saved = results.config_path.read_text()

    moved = load_run_config([f'output-dir="{tmp_path / "results"}"', 'run-name="r"', 'data-dir="/elsewhere"',
                             "resume=true"])
    RunResults.open(moved, run_metadata(moved, "local", "a" * 64))
    with pytest.raises(ResultsError, match=r"data content sha256: aaaaaaaaaaaa… -> bbbbbbbbbbbb…"):
        RunResults.open(moved, run_metadata(moved, "local", "b" * 64))
    assert results.config_path.read_text() != saved  # the accepted resume rewrote it
    written = results.config_path.read_text()
    with pytest.raises(ResultsError, match=r"num-rounds: 200 -> 3"):
        _open(tmp_path / "results", "resume=true", "num-rounds=3")
    assert results.config_path.read_text() == written


def test_a_resume_may_extend_the_run_and_config_json_lists_its_earlier_lengths(tmp_path):
    """More rounds continue the same run (nothing a round computes depends on how many follow);
    fewer are refused; config.json keeps each earlier length whose last round the run still holds."""

    def finish(results: RunResults, rounds: int) -> dict:
        results.save_checkpoint(rounds, [np.zeros(1)])
        return json.loads(results.config_path.read_text())

    results = _open(tmp_path, "num-rounds=2")
    assert EXTENDED_FROM not in finish(_open(tmp_path, "resume=true", "num-rounds=2"), 2)
    assert finish(_open(tmp_path, "resume=true", "num-rounds=5"), 5)[EXTENDED_FROM] == [2]
    assert finish(_open(tmp_path, "resume=true", "num-rounds=5"), 5)[EXTENDED_FROM] == [2]
    saved = finish(_open(tmp_path, "resume=true", "num-rounds=9"), 9)
    assert saved[EXTENDED_FROM] == [2, 5] and saved["run_config"]["num-rounds"] == 9
    with pytest.raises(ResultsError, match=r"num-rounds: 9 -> 4"):
        _open(tmp_path, "resume=true", "num-rounds=4")
    with pytest.raises(ResultsError, match=r"lr: 0\.01 -> 0\.5"):  # growing does not hide another change
        _open(tmp_path, "resume=true", "num-rounds=12", "lr=0.5")
    assert json.loads(results.config_path.read_text()) == saved

    results.save_checkpoint(3, [np.zeros(1)])  # rounds 4.. are redone: round 5 is no longer a last round
    assert json.loads(_open(tmp_path, "resume=true", "num-rounds=12").config_path.read_text())[EXTENDED_FROM] == [2]
    results.checkpoint_path.unlink()  # no checkpoint: the run starts again from round 1
    assert EXTENDED_FROM not in json.loads(_open(tmp_path, "resume=true", "num-rounds=12").config_path.read_text())


def test_config_differences_names_each_changed_key_and_ignores_transport_and_location():
    before = {**pyproject_defaults(), "lr": 0.01, "seed": 0, "output-dir": "results", "resume": False}
    assert config_differences(before, {**before, "output-dir": "/abs/results", "resume": True}) == []
    assert config_differences(before, {**before, "lr": 0.5, "seed": 1}) == ["lr: 0.01 -> 0.5", "seed: 0 -> 1"]


def test_a_corrupt_config_json_is_named_and_left_as_it_is(tmp_path):
    results = _open(tmp_path)
    results.config_path.write_text("{not json")
    with pytest.raises(ResultsError, match=r"config.json is not a readable config.json .*nothing was changed"):
        _open(tmp_path, "resume=true")
    assert results.config_path.read_text() == "{not json"
