"""The local engine's client processes (``client-processes`` > 1): a round's clients train in
worker processes, each on its own torch threads, θ and every Δ_k in shared memory.

Why: at the paper's small batches, two one-thread processes keep two CPU cores busier than one
two-thread process does (benchmarks/cpu_speedups.py measures it), and Python threads would share
one interpreter lock. Each worker holds a ``ClientTask`` of its own (model, training set); it reads
θ from the θ segment and writes Δ_k into the reply segment of the client's place in the cohort,
so only a job tuple and a reply without its arrays cross the pipe. The engine hands the next
client to whichever worker is free and puts the replies back in cohort order: with one thread
per worker a run's rounds.csv equals that of the same run in one process with ``threads = 1``,
bit for bit (tests/test_client_pool.py).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import shutil
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait

import numpy as np

from fedmask_app.run.client_task import ClientTask, failure_line
from fedmask_app.run.config import RunConfig
from fedmask_app.run.device import given_cpus
from fedmask_app.run.shared_memory import (
    create_segment,
    packed_arrays,
    packed_nbytes,
    release_segment,
    remove_stale_segments,
    segment,
    segment_prefix,
)
from strategies.aggregate import ClientReply

# (index in the cohort, partition id, round, synchronized mask seed, keep-prob)
Job = tuple[int, int, int, int | None, float]


def pool_size(cfg: RunConfig) -> int:
    """Worker processes of ``cfg``: ``client-processes``, or one per CPU the run was given."""
    return cfg.client_processes or given_cpus()


def worker_threads(cfg: RunConfig, processes: int) -> int:
    """torch threads of each worker: ``threads``, or the CPUs given to the run shared among them."""
    return cfg.threads or max(1, given_cpus() // processes)


class ClientPoolError(RuntimeError):
    """A worker process could not start or died."""


class ClientPool:
    """``processes`` workers training ``cfg``'s clients on arrays shaped like ``like`` (θ)."""

    def __init__(self, cfg: RunConfig, like: Sequence[np.ndarray], processes: int):
        self.like = [np.asarray(p) for p in like]
        nbytes = packed_nbytes(self.like)
        segments = cfg.clients_per_round + 1
        _require_room(segments * nbytes, processes)
        remove_stale_segments()
        prefix = segment_prefix()
        self._names = [f"{prefix}theta"] + [f"{prefix}{i}" for i in range(cfg.clients_per_round)]
        self._theta, *self._replies = [packed_arrays(create_segment(n, nbytes).buf, self.like) for n in self._names]
        context = mp.get_context("spawn")  # fork would copy this process's torch thread pools
        worker_cfg = dataclasses.replace(cfg, threads=worker_threads(cfg, processes), client_processes=1)
        shapes = [(p.shape, p.dtype) for p in self.like]
        self._conns: list[Connection] = []
        self._workers: list[mp.process.BaseProcess] = []
        try:
            for _ in range(processes):
                ours, theirs = context.Pipe()
                worker = context.Process(target=_serve, args=(worker_cfg, self._names, shapes, theirs), daemon=True)
                worker.start()
                theirs.close()
                self._conns.append(ours)
                self._workers.append(worker)
            for worker, conn in zip(self._workers, self._conns, strict=True):
                message = self._receive(worker, conn, "while starting")
                if message[0] != "ready":
                    raise ClientPoolError(f"client process {worker.pid} could not start: {message[1]}")
        except BaseException:
            self.close()
            raise

    def train(
        self, cohort: Sequence[int], server_round: int, params: Sequence[np.ndarray], sync_seed: int | None,
        keep_prob: float,
    ) -> tuple[list[ClientReply], list[str]]:
        """The cohort's replies in cohort order, and a line for each client that raised."""
        for target, value in zip(self._theta, params, strict=True):
            np.copyto(target, value)
        jobs: list[Job] = [(i, pid, server_round, sync_seed, keep_prob) for i, pid in enumerate(cohort)]
        jobs.reverse()  # popped from the end: cohort order
        busy: dict[Connection, mp.process.BaseProcess] = {}
        for worker, conn in zip(self._workers, self._conns, strict=True):
            if jobs:
                self._send(worker, conn, jobs.pop(), f"in round {server_round}")
                busy[conn] = worker
        answers: dict[int, tuple[ClientReply | None, dict[int, np.ndarray], str | None]] = {}
        while busy:
            for conn in wait(list(busy) + [w.sentinel for w in busy.values()]):
                if not isinstance(conn, Connection) or conn not in busy:
                    continue  # a sentinel: the worker's pipe is closed too, _receive names the exit
                worker = busy.pop(conn)
                index, reply, replaced, failure = self._receive(worker, conn, f"in round {server_round}")
                answers[index] = (reply, replaced, failure)
                if jobs:
                    self._send(worker, conn, jobs.pop(), f"in round {server_round}")
                    busy[conn] = worker
            self._check_alive(busy, server_round)
        replies, failures = [], []
        for index in range(len(cohort)):
            reply, replaced, failure = answers[index]
            if failure is not None:
                failures.append(failure)
                continue
            update = [replaced.get(b, array) for b, array in enumerate(self._replies[index])]
            replies.append(dataclasses.replace(reply, update=update))
        return replies, failures

    def _send(self, worker: mp.process.BaseProcess, conn: Connection, job: Job, when: str) -> None:
        try:
            conn.send(job)
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise _exited(worker, when) from exc

    def _receive(self, worker: mp.process.BaseProcess, conn: Connection, when: str):
        try:
            return conn.recv()
        except (EOFError, ConnectionResetError) as exc:
            raise _exited(worker, when) from exc

    def _check_alive(self, busy: dict[Connection, mp.process.BaseProcess], server_round: int) -> None:
        for conn, worker in busy.items():
            if not worker.is_alive() and not conn.poll():
                raise _exited(worker, f"in round {server_round}")

    def close(self) -> None:
        """Stop the workers and unlink the segments."""
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for worker in self._workers:
            worker.join(10)
            if worker.is_alive():
                worker.terminate()  # a worker of this pool (never a process we did not start)
                worker.join(5)
        for conn in self._conns:
            conn.close()
        self._conns, self._workers = [], []
        self._theta, self._replies = [], []
        for name in self._names:
            release_segment(name)
        self._names = []

    def __enter__(self) -> ClientPool:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()


def _exited(worker: mp.process.BaseProcess, when: str) -> ClientPoolError:
    worker.join(5)
    return ClientPoolError(f"client process {worker.pid} exited with code {worker.exitcode} {when}")


def _require_room(nbytes: int, processes: int) -> None:
    shm = "/dev/shm"
    if os.path.isdir(shm) and shutil.disk_usage(shm).free < nbytes:
        raise ClientPoolError(
            f"client-processes = {processes} needs {nbytes >> 20} MiB of shared memory for θ and the cohort's "
            f"updates, and {shm} has {shutil.disk_usage(shm).free >> 20} MiB free (in Docker: --shm-size); "
            "or set client-processes = 1"
        )


def _serve(cfg: RunConfig, names: list[str], shapes: list[tuple[tuple[int, ...], np.dtype]], conn: Connection) -> None:
    """A worker: train each job's client from θ into its reply segment until told to stop (None)."""
    try:
        like = [np.empty(shape, dtype) for shape, dtype in shapes]
        theta, *replies = [packed_arrays(segment(name, creators_tracker=True).buf, like) for name in names]
        task = ClientTask(cfg, cache_shards=False)
    except Exception as exc:  # reported to the engine, which stops the run with it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    try:
        _train_jobs(task, theta, replies, conn)
    except (KeyboardInterrupt, EOFError):  # Ctrl-C reaches the whole process group; EOF: the engine is gone
        pass


def _train_jobs(task: ClientTask, theta: list[np.ndarray], replies: list[list[np.ndarray]], conn: Connection) -> None:
    while (job := conn.recv()) is not None:
        index, partition_id, server_round, sync_seed, keep_prob = job
        out = replies[index]
        try:
            reply = task.train(partition_id, server_round, theta, sync_seed, out=out, keep_prob=keep_prob)
        except Exception as exc:  # a failing client is left out, as in the sequential engine
            conn.send((index, None, {}, failure_line(partition_id, exc)))
            continue
        # arrays a fault put in place of the segment's views travel through the pipe
        replaced = {b: u for b, (u, a) in enumerate(zip(reply.update, out, strict=True)) if u is not a}
        conn.send((index, dataclasses.replace(reply, update=[]), replaced, None))
