"""FedExP and the calibrated keep-prob through the local engine: η_g and p_t recorded per round
follow their equations from the rows, and a resume continues the schedule."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fedmask_app.engines.local import in_process, local_train_round, run_local
from fedmask_app.run.client_task import ClientTask
from fedmask_app.run.config import ConfigError, run_config_from_values
from fedmask_app.run.loop import run_rounds
from strategies.server_step import calibrated_keep_prob, fedexp_epsilon

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def small(tmp_path, **overrides):
    return run_config_from_values({
        "num-clients": 8, "clients-per-round": 3, "num-rounds": 4, "max-shard-size": 8, "batch-size": 4,
        "local-epochs": 1, "eval-every": 0, "checkpoint-every": 1, "threads": 1, "aggregation": "uniform",
        "data-dir": str(SHARED_DATA), "output-dir": str(tmp_path), **overrides,
    })


def test_fedexp_records_its_step_from_the_rounds_statistics(tmp_path):
    cfg = small(tmp_path, **{"server-step": "fedexp", "run-name": "fedexp"})
    run_local(cfg, echo=lambda _: None)
    rows = pd.read_csv(cfg.run_dir / "rounds.csv")
    k = cfg.clients_per_round
    eps = np.array([fedexp_epsilon(cfg.fedexp_epsilon, r) for r in rows["round"]])
    want = np.maximum(1.0, rows["mean_sq_norm"] / (2 * (rows["sq_norm_of_mean"] + k * eps)))
    np.testing.assert_allclose(rows["server_lr"], want, rtol=1e-9)
    assert (rows["server_lr"] > 1).any()  # it extrapolated at least once
    shards = pd.read_csv(cfg.run_dir / "shards.csv")  # the report's T range reads it
    assert shards["partition_id"].tolist() == list(range(8)) and shards["num_examples"].between(1, 8).all()


def test_calibrated_keep_prob_follows_the_last_rounds_proxy_and_survives_a_resume(tmp_path):
    values = {"mask-mode": "synchronized", "keep-prob-schedule": "calibrated", "penalty-target": 1e-4,
              "keep-prob-min": 0.05, "keep-prob": 0.5, "run-name": "calibrated"}
    cfg = small(tmp_path, **values)
    reference_cfg = small(tmp_path, **{**values, "run-name": "reference"})
    run_local(reference_cfg, echo=lambda _: None)
    reference = pd.read_csv(reference_cfg.run_dir / "rounds.csv")
    assert reference["keep_prob_round"].iloc[0] == 0.5
    for t in range(1, len(reference)):
        want = calibrated_keep_prob(reference["sq_norm_of_mean"].iloc[t - 1], 1e-4, 0.05)
        assert reference["keep_prob_round"].iloc[t] == pytest.approx(want, rel=1e-12)

    train_round = local_train_round(cfg, in_process(cfg, ClientTask(cfg)))

    def crash_in_round_3(server_round, *args):
        if server_round == 3:
            raise KeyboardInterrupt  # the process dies after round 2's checkpoint
        return train_round(server_round, *args)

    with pytest.raises(KeyboardInterrupt):
        run_rounds(cfg, "local", crash_in_round_3, echo=lambda _: None)
    run_local(small(tmp_path, **{**values, "resume": True}), echo=lambda _: None)
    resumed = pd.read_csv(cfg.run_dir / "rounds.csv")
    pd.testing.assert_frame_equal(resumed.drop(columns="seconds"), reference.drop(columns="seconds"))


@pytest.mark.parametrize("mode", ["none", "independent"])
def test_the_calibrated_schedule_refuses_other_mask_modes_by_name(tmp_path, mode):
    with pytest.raises(ConfigError, match="synchronized masks only"):
        small(tmp_path, **{"mask-mode": mode, "keep-prob-schedule": "calibrated", "penalty-target": 1e-3})


def test_measurements_are_due_only_when_asked_for(tmp_path):
    from fedmask_app.run.measurements import RoundMeasurements

    due = RoundMeasurements(small(tmp_path, **{"num-rounds": 10}))
    assert not any(due.curvature_due(r) or due.flatness_due(r) for r in range(1, 11))
    due = RoundMeasurements(small(tmp_path, **{"num-rounds": 10, "curvature-every": 2, "flatness-every": 4,
                                               "measure-from": 5, "probe-size": 4}))
    assert [r for r in range(1, 11) if due.curvature_due(r)] == [6, 8, 10]
    assert [r for r in range(1, 11) if due.flatness_due(r)] == [8, 10]
