"""Runs trained together: the cohorts of several runs as one batched computation (``fedmask-sweep
--group-runs``), engine ``local-grouped``.

Each run keeps its own round loop (run/loop.py: cohort, server step, statistics, evaluation,
results, checkpoints, resume) in a thread of its own; only local training is joint. A run's
thread hands its cohort to a ``Lockstep`` and waits; once every run still going has handed its
cohort in, one call trains them all (``clients.vectorized.grouped_local_updates``: every client of
every run stacked along vmap's dimension, each from its own run's θ), and each run goes on with its
own replies. Clients never interact, so each run's Δ_k are the ones its vectorised run alone
computes: in float64 to rounding, in float32 to the last digits (the grouped convolutions have more
groups). Why: on a GPU one run's bs-32 cohort step leaves most of the device idle
(README, "Measured on one H200"); runs of a sweep that train alike can fill it together.

Runs train together when everything their local step depends on is equal (``TRAINING_KEYS``);
seed, α, masking, aggregation, server step and measurements may differ. Importing this module
imports neither flwr nor ray.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from clients.cuda_graphs import CudaGraphCohortStep
from clients.vectorized import CohortStep, grouped_local_updates
from fedmask_app.engines.local import local_train_round, resident_on, run_local
from fedmask_app.run.client_task import ClientTask, local_training
from fedmask_app.run.config import ConfigError, RunConfig
from fedmask_app.run.device import pick_device, refuse_graphs_without_cuda
from fedmask_app.run.loop import TrainRound, run_rounds
from strategies.aggregate import ClientReply

GROUPED_ENGINE = "local-grouped"
# what a client's local step depends on besides its shard, its batch order and θ
TRAINING_KEYS = ("model", "skip-padding-taps", "local-epochs", "batch-size", "lr", "momentum", "weight-decay",
                 "augment", "precision", "device", "threads", "cuda-graphs", "gemm-convs")

Item = TypeVar("Item")
Result = TypeVar("Result")


class RunsInterrupted(RuntimeError):
    """The runs of a group were stopped from outside (Ctrl-C)."""


class Lockstep(Generic[Item, Result]):
    """Calls from the threads of ``members`` runs gathered into one: ``submit`` waits until every
    member that has not left has submitted, then one call of ``joint`` serves them all (in the
    thread of the last to arrive). A member that stops calls ``leave`` so that the others do not
    wait for it. An exception of ``joint`` is raised in every thread of that call."""

    def __init__(self, members: int, joint: Callable[[list[Item]], list[Result]]):
        self._members = members
        self._joint = joint
        self._lock = threading.Lock()
        self._pending: list[tuple[Item, Future]] = []
        self._stopped: Exception | None = None

    def submit(self, item: Item) -> Result:
        future: Future = Future()
        with self._lock:
            if self._stopped is not None:
                raise self._stopped
            self._pending.append((item, future))
            batch = self._take_when_all_in()
        if batch:
            self._serve(batch)
        return future.result()

    def stop(self, reason: Exception) -> None:
        """Every call waiting now and every later one raises ``reason``; a joint call under way
        finishes and serves its members first."""
        with self._lock:
            self._stopped = reason
            waiting, self._pending = self._pending, []
        for _, future in waiting:
            future.set_exception(reason)

    def leave(self) -> None:
        with self._lock:
            self._members -= 1
            batch = self._take_when_all_in()
        if batch:
            self._serve(batch)

    def _take_when_all_in(self) -> list[tuple[Item, Future]]:
        if not self._pending or len(self._pending) < self._members:
            return []
        batch, self._pending = self._pending, []
        return batch

    def _serve(self, batch: list[tuple[Item, Future]]) -> None:
        try:
            results = self._joint([item for item, _ in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"the joint call returned {len(results)} results for {len(batch)} calls")
        except Exception as exc:
            for _, future in batch:
                future.set_exception(exc)
            return
        for (_, future), result in zip(batch, results, strict=True):
            future.set_result(result)


@dataclass(frozen=True)
class CohortRequest:
    """One run's cohort of a round, as ``TrainCohort`` receives it."""

    task: ClientTask
    cohort: list[int]
    server_round: int
    params: list
    sync_seed: int | None
    keep_prob: float


def training_key(cfg: RunConfig) -> tuple:
    """The values of ``TRAINING_KEYS``: runs with equal keys can train together."""
    mapping = cfg.to_mapping()
    return tuple(mapping[key] for key in TRAINING_KEYS)


def refuse_ungroupable(cfg: RunConfig) -> None:
    """A run that cannot train in a group, refused by name before anything starts."""
    if not cfg.vectorize:
        raise ConfigError(f"run {cfg.name}: runs trained together (--group-runs) need vectorize = true: their "
                          "cohorts train as one vectorised computation")
    if cfg.inject_fault:
        raise ConfigError(f"run {cfg.name}: inject-fault needs a run of its own (vectorize = false): "
                          "a vectorised step trains all clients at once")


def form_groups(cfgs: Sequence[RunConfig], size: int) -> list[list[int]]:
    """Indices of ``cfgs`` in groups of at most ``size`` runs with equal ``training_key``, in the
    order the runs first appear."""
    if size < 1:
        raise ValueError(f"group size must be >= 1, got {size}")
    by_key: dict[tuple, list[list[int]]] = {}
    for index, cfg in enumerate(cfgs):
        chunks = by_key.setdefault(training_key(cfg), [[]])
        if len(chunks[-1]) == size:
            chunks.append([])
        chunks[-1].append(index)
    return sorted((chunk for chunks in by_key.values() for chunk in chunks), key=lambda chunk: chunk[0])


def train_together(step: CohortStep, requests: list[CohortRequest]) -> list[list[ClientReply]]:
    """Every request's cohort in one ``grouped_local_updates``; each run's replies, in request order."""
    inputs = [r.task.cohort_inputs(r.cohort, r.server_round) for r in requests]
    results = grouped_local_updates(step.model, [r.params for r in requests], [shards for shards, _ in inputs],
                                    step.training, [generators for _, generators in inputs], step=step)
    return [r.task.cohort_replies(r.cohort, r.server_round, r.sync_seed, r.keep_prob, run_results)
            for r, run_results in zip(requests, results, strict=True)]


class TrainingGroup:
    """Runs whose cohorts train together: one ``ClientTask`` per run, one cohort step for all, and
    the ``Lockstep`` that gathers their cohorts. ``train_round(i)`` is run i's ``TrainRound``; a
    thread that stops calling it calls ``leave``. ``shard_arrays``: every run's shards given
    (benchmarks), else each run's own partition of CIFAR-10. ``chunk_clients``: clients per vmapped
    call (benchmarks); None: one cohort's worth on a CPU, all of them on a GPU."""

    def __init__(self, cfgs: Sequence[RunConfig], shard_arrays: dict | None = None, chunk_clients: int | None = None):
        if not cfgs:
            raise ConfigError("a group needs at least one run")
        for cfg in cfgs:
            refuse_ungroupable(cfg)
        if len({training_key(cfg) for cfg in cfgs}) > 1:
            raise ConfigError("runs trained together need equal " + ", ".join(TRAINING_KEYS) + "; these differ")
        if len({cfg.run_dir for cfg in cfgs}) < len(cfgs):
            raise ConfigError("two runs of the group write to the same run folder")
        device = pick_device(cfgs[0])
        refuse_graphs_without_cuda(cfgs[0], device)
        self.tasks = [ClientTask(cfg, shard_arrays, resident=resident_on(device)) for cfg in cfgs]
        model, training = self.tasks[0].model, local_training(cfgs[0])
        # On a CPU oneDNN's backward of a grouped convolution falls off a cliff past ~20 groups (30
        # clients at once: 0.12x one at a time, docs/cpu/vectorized-30-clients.log); vmap in chunks
        # of one cohort keeps it to the vectorised run's own speed.
        if chunk_clients is None and device.type == "cpu":
            chunk_clients = max(cfg.clients_per_round for cfg in cfgs)
        step = (CudaGraphCohortStep(model, training, chunk_size=chunk_clients) if cfgs[0].cuda_graphs
                else CohortStep(model, training, chunk_clients))
        self._lockstep: Lockstep[CohortRequest, list[ClientReply]] = Lockstep(
            len(cfgs), lambda requests: train_together(step, requests))

    def train_round(self, index: int) -> TrainRound:
        task = self.tasks[index]

        def train_cohort(cohort: list[int], server_round: int, params: list[np.ndarray], sync_seed: int | None,
                         keep_prob: float) -> tuple[list[ClientReply], list[str]]:
            return self._lockstep.submit(CohortRequest(task, cohort, server_round, params, sync_seed, keep_prob)), []

        return local_train_round(task.cfg, train_cohort)

    def leave(self) -> None:
        self._lockstep.leave()

    def stop(self, reason: Exception) -> None:
        """Every run's next (or waiting) cohort raises ``reason``: the runs end after the joint step under way."""
        self._lockstep.stop(reason)


def run_group(cfgs: Sequence[RunConfig], echoes: Sequence[Callable[[str], None]] | None = None,
              chunk_clients: int | None = None) -> list[Exception | None]:
    """Run ``cfgs`` to the end with their cohorts trained together; what each run raised (None: it
    finished). A run that stops leaves the others going. A set of runs that cannot train together
    raises ``ConfigError`` before anything is written. ``chunk_clients``: see ``TrainingGroup``."""
    if not cfgs:
        return []
    group = TrainingGroup(cfgs, chunk_clients=chunk_clients)
    echoes = echoes or [print] * len(cfgs)
    errors: list[Exception | None] = [None] * len(cfgs)

    def run(index: int) -> None:
        try:
            run_rounds(cfgs[index], GROUPED_ENGINE, group.train_round(index), echo=echoes[index])
        except Exception as exc:  # reported to the caller; the other runs go on
            errors[index] = exc
        finally:
            group.leave()

    # daemon: a second Ctrl-C ends the process without waiting for them
    threads = [threading.Thread(target=run, args=(i,), name=f"fedmask-run-{cfg.name}", daemon=True)
               for i, cfg in enumerate(cfgs)]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            thread.join()
    except KeyboardInterrupt:  # Ctrl-C: let every run end cleanly after the joint step under way
        group.stop(RunsInterrupted("interrupted (Ctrl-C) while training together"))
        for thread in threads:
            thread.join()
        raise
    return errors


def run_on_local_engine(cfgs: Sequence[RunConfig], echoes: Sequence[Callable[[str], None]], together: bool
                        ) -> list[Exception | None]:
    """Run ``cfgs`` on the local engine — trained together (``run_group``; a group of one too, so
    that every run of a ``--group-runs`` sweep is engine ``local-grouped``) or, ``together`` false,
    the one run alone (``run_local``) — and return what each run raised (None: it finished). An
    error before the runs start (a group that cannot form) is every run's."""
    try:
        if together:
            return run_group(cfgs, echoes)
        (cfg,), (echo,) = cfgs, echoes
        run_local(cfg, echo=echo)
    except Exception as exc:
        return [exc] * len(cfgs)
    return [None]
