"""The local engine: a whole run in one process, no Flower, no Ray (CPU or CUDA).

Same cohort sampling, client code, statistics, aggregation, evaluation and results writer as
the Flower app; only the transport differs: clients are called one after another in-process,
with the model and the data resident on the device (on a GPU θ and the Δ_k too: the server
step reduces them there), side by side on CUDA streams (``client-streams``, clients/streams.py),
or trained in worker processes on the CPU (``client-processes``, engines/client_pool.py).
Importing this module imports neither flwr nor ray.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np
import torch

from clients.masking import coordinate_mask_seeds
from clients.seeds import synchronized_mask_seed
from fedmask_app.engines.client_pool import ClientPool, pool_size, worker_threads
from fedmask_app.run.client_task import ClientTask, failure_line
from fedmask_app.run.config import ConfigError, RunConfig
from fedmask_app.run.device import pick_device, refuse_graphs_without_cuda, streams_graphs_float32_warning
from fedmask_app.run.loop import TrainRound, run_rounds
from strategies.aggregate import ClientReply, ServerLr
from strategies.cohort import sample_cohort
from strategies.round import RoundOutcome, finish_round

ENGINE = "local"
VECTORIZED_ENGINE = "local-vectorized"
STREAMS_ENGINE = "local-streams"

# (cohort, round, θ, synchronized mask seed, keep-prob) -> (replies in cohort order, failure lines)
TrainCohort = Callable[[list[int], int, list[np.ndarray], int | None, float], tuple[list[ClientReply], list[str]]]


def resident_on(device: torch.device) -> bool:
    """Whether θ and the Δ_k stay on ``device`` through the round (``ClientTask(resident=...)``):
    on a GPU, to spare each round ten model-sized copies to the host and the numpy pass over them
    (``benchmarks/gpu_timing.py --residency both`` measures both ways). On a CPU the numpy pass
    is the faster (docs/cpu/gpu_timing-residency-cpu.log)."""
    return device.type == "cuda"


def one_by_one(task: ClientTask) -> TrainCohort:
    """The cohort's clients one after another in this process; a client that raises is left out,
    as in the Flower app."""

    def train_cohort(cohort, server_round, params, sync_seed, keep_prob):
        replies, failures = [], []
        if task.resident:
            params = task.on_device(params)
        for partition_id in cohort:
            try:
                replies.append(task.train(partition_id, server_round, params, sync_seed, keep_prob=keep_prob))
            except Exception as exc:
                failures.append(failure_line(partition_id, exc))
        return replies, failures

    return train_cohort


def vectorized(task: ClientTask) -> TrainCohort:
    """The whole cohort in one batched computation (faults are refused at start)."""

    def train_cohort(cohort, server_round, params, sync_seed, keep_prob):
        return task.train_cohort(cohort, server_round, params, sync_seed, keep_prob), []

    return train_cohort


def side_by_side(task: ClientTask) -> TrainCohort:
    """The cohort's clients on ``client-streams`` CUDA streams at once; a client that raises is
    left out, as in ``one_by_one`` (θ goes to the device with the replicas, clients/streams.py)."""

    def train_cohort(cohort, server_round, params, sync_seed, keep_prob):
        return task.train_streamed(cohort, server_round, params, sync_seed, keep_prob)

    return train_cohort


def in_process(cfg: RunConfig, task: ClientTask) -> TrainCohort:
    """``cfg``'s in-process way to train a cohort with ``task``: vectorised, on streams, or one by one."""
    if cfg.vectorize:
        return vectorized(task)
    return side_by_side(task) if cfg.client_streams > 1 else one_by_one(task)


def engine_name(cfg: RunConfig) -> str:
    """What config.json calls this run's engine."""
    if cfg.vectorize:
        return VECTORIZED_ENGINE
    return STREAMS_ENGINE if cfg.client_streams > 1 else ENGINE


def in_client_processes(cfg: RunConfig, stack: contextlib.ExitStack) -> TrainCohort:
    """The cohort's clients in ``client-processes`` worker processes, started at the first round
    (θ's shapes size their shared memory) and stopped when ``stack`` closes."""
    pool: ClientPool | None = None

    def train_cohort(cohort, server_round, params, sync_seed, keep_prob):
        nonlocal pool
        if pool is None:
            pool = stack.enter_context(ClientPool(cfg, params, pool_size(cfg)))
        return pool.train(cohort, server_round, params, sync_seed, keep_prob)

    return train_cohort


def local_train_round(cfg: RunConfig, train_cohort: TrainCohort) -> TrainRound:
    partition_ids = list(range(cfg.num_clients))

    def train_round(
        server_round: int, params: list[np.ndarray], keep_prob: float, server_lr: ServerLr | None
    ) -> RoundOutcome:
        cohort = sample_cohort(cfg.seed, server_round, partition_ids, cfg.clients_per_round)
        sync_seed = synchronized_mask_seed(cfg.seed, server_round) if cfg.mask_mode == "synchronized" else None
        replies, failures = train_cohort(cohort, server_round, params, sync_seed, keep_prob)
        mask_seeds = coordinate_mask_seeds(cfg.mask_mode, cfg.mask_granularity, cfg.seed, server_round, cohort)
        return finish_round(
            server_round, params, replies, failures,
            aggregation=cfg.aggregation, keep_prob=keep_prob, min_clients=cfg.min_clients, server_lr=server_lr,
            coordinate_mask_seeds=mask_seeds,
        )

    return train_round


def run_local(cfg: RunConfig, echo: Callable[[str], None] = print) -> list[np.ndarray]:
    """Run ``cfg`` to the end in this process (its clients in worker processes with
    ``client-processes`` > 1) and return the final global parameters. A configuration this engine
    cannot carry out on this machine raises ``ConfigError`` before anything is written."""
    if any(f.kind == "hang" for f in cfg.fault_injections()):
        raise ConfigError("inject-fault 'hang' needs the Flower engine: an in-process client cannot time out")
    if cfg.vectorize and cfg.inject_fault:
        raise ConfigError("inject-fault needs vectorize = false: the vectorised cohort step trains all clients at once")
    device = pick_device(cfg)
    if cfg.client_streams > 1 and device.type != "cuda":
        raise ConfigError(f"client-streams = {cfg.client_streams} needs a CUDA device; this run would train on "
                         f"{device} (set client-streams = 1)")
    refuse_graphs_without_cuda(cfg, device)
    if warning := streams_graphs_float32_warning(cfg, device):
        echo(warning)
    engine = engine_name(cfg)
    with contextlib.ExitStack() as stack:
        if pool_size(cfg) > 1:  # client-processes = 0 on one CPU trains in this process
            if device.type != "cpu":
                raise ConfigError("client-processes needs the CPU: set device = 'cpu' or client-processes = 1")
            train_cohort = in_client_processes(cfg, stack)
            processes = pool_size(cfg)
            echo(f"[fedmask] clients train in {processes} processes of {worker_threads(cfg, processes)} torch "
                 "thread(s) each")
        else:
            train_cohort = in_process(cfg, ClientTask(cfg, resident=resident_on(device)))
        return run_rounds(cfg, engine, local_train_round(cfg, train_cohort), echo=echo)
