"""The round loop both engines share: train a cohort, evaluate, write the row, checkpoint.

An engine supplies ``train_round(server_round, params) -> RoundOutcome``; the Flower ServerApp
does it with Messages, the local engine with in-process calls. Everything else is here once.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable

import numpy as np

from clients.training import as_array
from fedmask_app.run.client_task import client_shards
from fedmask_app.run.config import RunConfig
from fedmask_app.run.data import dataset_sha256, load_dataset, resolve_data_dir
from fedmask_app.run.device import model_dtype
from fedmask_app.run.evaluation import Evaluator
from fedmask_app.run.measurements import RoundMeasurements
from fedmask_app.run.model import initial_parameters
from fedmask_app.run.results import RunResults, run_metadata
from fedmask_app.run.schedule import RoundSchedule
from strategies.aggregate import ServerLr
from strategies.round import RoundFailed, RoundOutcome

# (round, θ, the round's keep-prob, FedExP's η_g from the cohort's sums or None) -> outcome
TrainRound = Callable[[int, list[np.ndarray], float, ServerLr | None], RoundOutcome]


def run_rounds(cfg: RunConfig, engine: str, train_round: TrainRound, evaluator: Evaluator | None = None,
               echo: Callable[[str], None] = print, server_has_training_data: bool = True) -> list[np.ndarray]:
    """Run rounds until ``num-rounds`` (from the last checkpoint when ``resume``); return θ.

    ``server_has_training_data``: False on a deployment's server, whose measurements then need
    ``probe-file``."""
    measurements = RoundMeasurements(cfg, server_has_training_data)  # fails before any round when it cannot
    data_sha256 = dataset_sha256(resolve_data_dir(cfg.data_dir), cfg.dataset)  # the full set's, or a subset's
    results, checkpoint = RunResults.open(cfg, run_metadata(cfg, engine, data_sha256))
    schedule = RoundSchedule(cfg, checkpoint.state if checkpoint is not None else None)
    if server_has_training_data:
        labels = load_dataset(resolve_data_dir(cfg.data_dir), cfg.dataset).y_train
        results.write_shards([len(shard) for shard in client_shards(cfg, labels)])
    if checkpoint is not None:
        params, first = checkpoint.params, checkpoint.server_round + 1
        echo(f"[fedmask] resuming {cfg.name} after round {checkpoint.server_round}")
    else:
        theta_0 = initial_parameters(cfg.model, cfg.seed, cfg.data.input_shape)
        params, first = [p.to(model_dtype(cfg)).numpy() for p in theta_0], 1
    if evaluator is None and cfg.eval_every:  # eval-every = 0: no test set to load
        evaluator = Evaluator(cfg)
    echo(f"[fedmask] {engine} engine, run {cfg.name} -> {results.run_dir}")
    for server_round in range(first, cfg.num_rounds + 1):
        started = time.perf_counter()
        try:
            keep_prob = schedule.keep_prob
            outcome = train_round(server_round, params, keep_prob, schedule.server_lr(server_round))
        except RoundFailed as exc:
            echo(f"[fedmask] run stopped in round {server_round}: {exc}. Rounds 1-{server_round - 1} "
                 f"are in {results.rounds_path}" + (" and the last checkpoint" if cfg.checkpoint_every else ""))
            raise
        theta, params = params, outcome.result.params
        schedule.observe(outcome.result)
        due = evaluator is not None and evaluator.due(server_round)
        test_loss, test_accuracy = evaluator(params) if due else (float("nan"),) * 2
        seconds = time.perf_counter() - started  # the measurements time themselves
        measured = measurements(server_round, theta, outcome)
        stats = outcome.result.stats
        results.append_row({
            "round": server_round,
            **stats,
            "test_accuracy": test_accuracy,
            "test_loss": test_loss,
            "train_loss": outcome.result.train_loss,
            "num_clients": len(outcome.result.partition_ids),
            "num_examples": outcome.result.num_examples,
            "num_failures": outcome.num_failures,
            "cohort": " ".join(map(str, outcome.result.partition_ids)),
            "seconds": round(seconds, 3),
            "server_lr": outcome.result.server_lr,
            "keep_prob_round": keep_prob if cfg.mask_mode != "none" else "",
            **measured,
        })
        echo(
            f"[fedmask] round {server_round}/{cfg.num_rounds}  1/dS={stats['recovery']:.4f} "
            f"(weighted {stats['recovery_weighted']:.4f}, ceiling {cfg.clients_per_round})  "
            f"train_loss={outcome.result.train_loss:.4f}"
            + (f"  test_acc={test_accuracy:.4f}" if test_accuracy == test_accuracy else "")
            + (f"  failures={outcome.num_failures}" if outcome.num_failures else "")
            + f"  {seconds:.1f}s"
        )
        if cfg.checkpoint_every and (server_round % cfg.checkpoint_every == 0 or server_round == cfg.num_rounds):
            results.save_checkpoint(server_round, params, schedule.state())
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    echo(f"[fedmask] done: {results.rounds_path} (peak RSS of this {engine} server process: {peak_mib:.0f} MiB)")
    return [as_array(p) for p in params]  # θ may live on the device (strategies/device_pass.py)
