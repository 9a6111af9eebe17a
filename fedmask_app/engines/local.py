"""The local engine: a whole run in one process, no Flower, no Ray (CPU or CUDA).

Same cohort sampling, client code, statistics, aggregation, evaluation and results writer as
the Flower app; only the transport differs: clients are called one after another in-process,
with the model and the data resident on the device. Importing this module imports neither
flwr nor ray.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from clients.masking import coordinate_mask_seeds
from clients.seeds import synchronized_mask_seed
from fedmask_app.run.client_task import ClientTask
from fedmask_app.run.config import RunConfig
from fedmask_app.run.loop import TrainRound, run_rounds
from strategies.aggregate import ServerLr
from strategies.cohort import sample_cohort
from strategies.round import RoundOutcome, finish_round

ENGINE = "local"
VECTORIZED_ENGINE = "local-vectorized"


def local_train_round(cfg: RunConfig, task: ClientTask) -> TrainRound:
    partition_ids = list(range(cfg.num_clients))

    def train_round(
        server_round: int, params: list[np.ndarray], keep_prob: float, server_lr: ServerLr | None
    ) -> RoundOutcome:
        cohort = sample_cohort(cfg.seed, server_round, partition_ids, cfg.clients_per_round)
        sync_seed = synchronized_mask_seed(cfg.seed, server_round) if cfg.mask_mode == "synchronized" else None
        replies, failures = [], []
        if cfg.vectorize:  # the whole cohort in one batched computation (faults are refused at start)
            replies = task.train_cohort(cohort, server_round, params, sync_seed, keep_prob)
        else:
            for partition_id in cohort:
                try:
                    replies.append(task.train(partition_id, server_round, params, sync_seed, keep_prob=keep_prob))
                except Exception as exc:  # a failing client is left out, as in the Flower app
                    failures.append(f"partition {partition_id}: {type(exc).__name__}: {exc}")
        mask_seeds = coordinate_mask_seeds(cfg.mask_mode, cfg.mask_granularity, cfg.seed, server_round, cohort)
        return finish_round(
            server_round, params, replies, failures,
            aggregation=cfg.aggregation, keep_prob=keep_prob, min_clients=cfg.min_clients, server_lr=server_lr,
            coordinate_mask_seeds=mask_seeds,
        )

    return train_round


def run_local(cfg: RunConfig, echo: Callable[[str], None] = print) -> list[np.ndarray]:
    """Run ``cfg`` to the end in this process and return the final global parameters."""
    if any(f.kind == "hang" for f in cfg.fault_injections()):
        raise ValueError("inject-fault 'hang' needs the Flower engine: an in-process client cannot time out")
    if cfg.vectorize and cfg.inject_fault:
        raise ValueError("inject-fault needs vectorize = false: the vectorised cohort step trains all clients at once")
    engine = VECTORIZED_ENGINE if cfg.vectorize else ENGINE
    return run_rounds(cfg, engine, local_train_round(cfg, ClientTask(cfg)), echo=echo)
