"""A grid's runs as Ray tasks across a cluster's nodes (``fedmask-sweep GRID --ray-address ADDR``).

Each run is one Ray task that asks for the resources given (``--run-cpus``, ``--run-gpus``,
``--run-resources``) and runs the whole run with the **local engine** inside that task; the tasks
are spread over the nodes (SPREAD scheduling). With ``--group-runs N`` each group of runs trained
together (``fedmask_app/engines/run_group.py``) is one task instead, asking for those resources
once: the same groups ``fedmask-sweep`` trains one after another on one machine, here side by
side on the cluster's GPUs. Not the Flower engine: a Flower simulation starts a
Ray of its own, and a second Ray inside a Ray task is not supported. Every node needs this project
installed in the same environment and ``data-dir`` (an absolute path) holding, or able to fetch,
the data set.

Where results go, chosen with ``--shared-output`` (default) / ``--no-shared-output``:

* shared output: ``output-dir`` is a path every node sees (NFS, a cluster filesystem, or one
  machine). The task writes the run folder there as it goes, with ``resume = true``.
* no shared output: the driver ships the files of the run folder it holds (none for a fresh run)
  to the task, the task runs in a node-local temporary folder and returns the folder's files
  (rounds.csv, config.json, checkpoint.pt, shards.csv) as bytes, and the driver writes them under
  ``output-dir``. A run that fails returns what it wrote, so a later sweep resumes it.

Retries: a task whose worker or node is lost is retried by Ray (``max_retries``); an exception a
run raises is not retried (``retry_exceptions=False``) but reported. A retried task runs with
``resume = true``: with shared output it continues from the run's last checkpoint, and opening the
results truncates rounds.csv to the checkpoint's round (``RunResults.open``), so no round is ever
written twice; without shared output it starts again from the files the driver shipped (round 1
for a fresh run).

``--ray-address local`` starts a private single-node Ray in this process (loopback only, a
temporary folder of its own, stopped at the end): the same code path on one machine. To keep it on
loopback it sets Ray's private ``ray._private.ray_constants.ENABLE_RAY_CLUSTER`` (``_loopback_only``;
only for ``local`` and the tests' clusters): when a Ray upgrade drops it, reading it raises, and
tests/test_cluster.py::test_runs_spread_over_the_nodes_and_write_what_one_machine_writes fails.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import ray._private.ray_constants as ray_constants
from ray.cluster_utils import Cluster

from fedmask_app.run.config import RunConfig
from fedmask_app.run.files import atomic_write
from fedmask_app.run.schema import CHECKPOINT_FILE, CONFIG_FILE, ROUNDS_FILE, SHARDS_FILE

LOOPBACK = "127.0.0.1"
LOCAL = "local"
# The run folder's files, in the order the driver writes them back (rounds.csv last: is_complete reads it).
RUN_FILES = (CONFIG_FILE, SHARDS_FILE, CHECKPOINT_FILE, ROUNDS_FILE)
RESUMING = re.compile(r"\[fedmask\] resuming .* after round (\d+)")


@dataclass(frozen=True)
class TaskOptions:
    """What every run's task asks for, and how the sweep treats results and lost nodes."""

    cpus: float = 1.0
    gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)  # custom Ray resources, e.g. {"node_a": 1}
    shared_output: bool = True
    max_retries: int = 3  # retries after a lost worker or node, not after an error the run raised
    verbose: bool = False
    train_together: bool = False  # --group-runs: each task's runs trained together (a group of one too)


@dataclass(frozen=True)
class RunOutcome:
    """What came back for one run: where it ran, how it ended, and (no shared output) its files."""

    name: str
    node_id: str  # ray.get_runtime_context().get_node_id() of the task's node ("" if none came back)
    pid: int
    error: str | None  # "ExceptionType: message" when the run (or its task) failed
    resumed_after: int  # the checkpoint round the task started from (0: from round 1)
    seconds: float
    files: dict[str, bytes] | None = None  # no shared output: the run folder's files


# ---------------------------------------------------------------- connecting


@contextmanager
def connect(address: str, verbose: bool = False) -> Iterator[str]:
    """Connect this process to Ray for the sweep and disconnect afterwards; yield a description.

    ``address``: ``auto`` (the cluster ``ray start`` started, or RAY_ADDRESS), ``HOST:PORT``, or
    ``local`` (a private single-node Ray, see ``private_cluster``). A process that is already
    connected (``ray.init`` in a test or notebook) keeps its connection.
    """
    if ray.is_initialized():
        yield "the Ray this process is connected to"
        return
    if address == LOCAL:
        with private_cluster(num_cpus=os.cpu_count() or 1, num_gpus=_local_gpus(),
                             object_store_memory=512 * 1024**2) as cluster:
            ray.init(address=cluster.address, log_to_driver=verbose)
            yield f"a private Ray on this machine ({cluster.address})"
        return
    ray.init(address=address, log_to_driver=verbose)
    try:
        yield f"the Ray cluster at {address}"
    finally:
        ray.shutdown()


def _local_gpus() -> int:
    import torch

    return torch.cuda.device_count()


@contextmanager
def private_cluster(num_cpus: float, num_gpus: float = 0, resources: dict[str, float] | None = None,
                    **head_args: Any) -> Iterator[Cluster]:
    """A ``ray.cluster_utils.Cluster`` whose head node runs in this process's machine, on loopback
    only, with a temporary folder of its own (so no other ``ray.init()`` on the machine finds it);
    add nodes with ``cluster.add_node(**node_args(...))``. On exit this process disconnects from
    it and every node is stopped (nothing else on the machine is touched)."""
    saved = _loopback_only(tempfile.mkdtemp(prefix="fmray-", dir="/tmp" if Path("/tmp").is_dir() else None))
    # Copies: Ray writes into a _system_config it is given (its spilling folder, under this temp folder).
    head_args = {k: dict(v) if isinstance(v, dict) else v for k, v in head_args.items()}
    cluster = None
    try:
        cluster = Cluster(initialize_head=True,
                          head_node_args={**node_args(num_cpus, num_gpus, resources), "include_dashboard": False,
                                          **head_args})
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()  # Cluster.shutdown refuses to stop the node this process is connected to
        if cluster is not None:
            cluster.shutdown()
        _restore(saved)


def node_args(num_cpus: float, num_gpus: float = 0, resources: dict[str, float] | None = None) -> dict[str, Any]:
    """Arguments of ``Cluster.add_node`` for a node of a private cluster (loopback)."""
    return {"num_cpus": num_cpus, "num_gpus": num_gpus, "resources": dict(resources or {}),
            "node_ip_address": LOOPBACK}


def _loopback_only(temp_dir: str) -> dict[str, Any]:
    """Make Ray in this process (and the processes it starts) use loopback and ``temp_dir``; return
    what to restore. Ray otherwise binds to the machine's outward address and writes the cluster's
    address where every ``ray.init()`` on the machine looks."""
    saved = {"env": {k: os.environ.get(k) for k in ("RAY_TMPDIR", ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR)},
             "enable_cluster": ray_constants.ENABLE_RAY_CLUSTER, "temp_dir": temp_dir}
    os.environ["RAY_TMPDIR"] = temp_dir
    os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False  # read at call time by ray._private.services.get_node_ip_address
    return saved


def _restore(saved: dict[str, Any]) -> None:
    for key, value in saved["env"].items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    ray_constants.ENABLE_RAY_CLUSTER = saved["enable_cluster"]
    for _ in range(20):  # a process of the stopped nodes may still be writing its last log lines
        shutil.rmtree(saved["temp_dir"], ignore_errors=True)
        time.sleep(0.25)
        if not Path(saved["temp_dir"]).exists():
            break


def missing_resources(options: TaskOptions) -> str | None:
    """A sentence when no live node offers what a run asks for (its tasks would wait for one)."""
    wanted = {"CPU": options.cpus, "GPU": options.gpus, **options.resources}
    wanted = {k: v for k, v in wanted.items() if v > 0}
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    if any(all(node.get(k, 0) >= v for k, v in wanted.items()) for node in nodes):
        return None
    return f"no node of the cluster offers {wanted}; the runs wait until one joins"


# ---------------------------------------------------------------- the task


def execute_runs(names: list[str], mappings: list[dict[str, Any]], together: bool, shared_output: bool,
                 files: list[dict[str, bytes]] | None, verbose: bool) -> list[RunOutcome]:
    """The body of a Ray task: run ``mappings`` (RunConfig mappings, run folders ``names``) with
    the local engine — one run alone, or ``together`` as a group (``run_on_local_engine``) — and say
    where they ran. Errors of the runs are returned, not raised (so they are not retried)."""
    started = time.perf_counter()
    node_id, pid = ray.get_runtime_context().get_node_id(), os.getpid()
    mappings = [{**mapping, "resume": True} for mapping in mappings]
    if shared_output:
        ended = _run(names, mappings, together, verbose)
        return [RunOutcome(name, node_id, pid, error, resumed, time.perf_counter() - started)
                for name, (error, resumed) in zip(names, ended, strict=True)]
    with tempfile.TemporaryDirectory(prefix="fedmask-run-") as temp:
        ended = _run_in(Path(temp), names, mappings, together, files or [{} for _ in names], verbose)
    return [RunOutcome(name, node_id, pid, error, resumed, time.perf_counter() - started, out)
            for name, (error, resumed, out) in zip(names, ended, strict=True)]


def _run_in(temp: Path, names: list[str], mappings: list[dict[str, Any]], together: bool,
            files: list[dict[str, bytes]], verbose: bool) -> list[tuple[str | None, int, dict[str, bytes]]]:
    """Run with ``temp`` as output-dir, each run starting from its ``files``; return each run
    folder's files as the driver's output-dir holds them."""
    for name, run_files in zip(names, files, strict=True):
        run_dir = temp / name
        run_dir.mkdir(parents=True)
        for file_name, data in run_files.items():
            (run_dir / file_name).write_bytes(data)
    ended = _run(names, [{**mapping, "output-dir": str(temp)} for mapping in mappings], together, verbose)
    for name, mapping in zip(names, mappings, strict=True):  # config.json names the folder it is written to
        _retarget(temp / name / CONFIG_FILE, mapping["output-dir"])
    return [(error, resumed, read_run_files(temp / name)) for name, (error, resumed) in zip(names, ended, strict=True)]


def _run(names: list[str], mappings: list[dict[str, Any]], together: bool, verbose: bool
         ) -> list[tuple[str | None, int]]:
    """Run with the local engine, one run alone or ``together``; for each run (the error or None,
    the round it resumed after)."""
    from fedmask_app.engines.run_group import run_on_local_engine

    resumed = [0] * len(names)

    def echo_for(index: int):
        def echo(line: str) -> None:
            if match := RESUMING.search(line):
                resumed[index] = int(match.group(1))
            if verbose:
                print(f"[{names[index]}] {line}" if len(names) > 1 else line, flush=True)
        return echo

    try:
        cfgs = [RunConfig.from_mapping(mapping) for mapping in mappings]
    except Exception as exc:  # reported by the driver, as a failing run on one machine is
        errors: list[Exception | None] = [exc] * len(names)
    else:
        errors = run_on_local_engine(cfgs, [echo_for(i) for i in range(len(names))], together)
    if verbose:
        for error in errors:
            if error is not None:
                traceback.print_exception(error)
    return [(None if error is None else f"{type(error).__name__}: {error}", after)
            for error, after in zip(errors, resumed, strict=True)]


def _retarget(config_path: Path, output_dir: str) -> None:
    """Set the output-dir recorded in a run folder's config.json (when it has one)."""
    import json

    from fedmask_app.run.files import atomic_write_json

    if config_path.is_file():
        meta = json.loads(config_path.read_text())
        meta.setdefault("run_config", {})["output-dir"] = output_dir
        atomic_write_json(config_path, meta)


def read_run_files(run_dir: Path) -> dict[str, bytes]:
    """The run folder's files that exist, by name."""
    return {name: (run_dir / name).read_bytes() for name in RUN_FILES if (run_dir / name).is_file()}


def write_run_files(run_dir: Path, files: dict[str, bytes]) -> None:
    """Write files a task returned into the run folder, each atomically, rounds.csv last."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in RUN_FILES:
        if name in files:
            atomic_write(run_dir / name, lambda f, data=files[name]: f.write(data))


# ---------------------------------------------------------------- the driver


_task = ray.remote(execute_runs)


def task_name(cfgs: list[RunConfig], together: bool) -> str:
    """``fedmask-run:<run>``, or ``fedmask-runs:<run>+<run>...`` for runs trained together (``ray
    list tasks`` and the workers' process titles show it)."""
    return "fedmask-runs:" + "+".join(c.name for c in cfgs) if together else f"fedmask-run:{cfgs[0].name}"


def submit(cfgs: list[RunConfig], options: TaskOptions) -> ray.ObjectRef:
    """One Ray task for ``cfgs``: a run, or runs trained together (``--group-runs``)."""
    files = None if options.shared_output else [read_run_files(cfg.run_dir) for cfg in cfgs]
    return _task.options(
        name=task_name(cfgs, options.train_together), num_cpus=options.cpus, num_gpus=options.gpus,
        resources=dict(options.resources), max_retries=options.max_retries, retry_exceptions=False,
        scheduling_strategy="SPREAD",
    ).remote([cfg.name for cfg in cfgs], [cfg.to_mapping() for cfg in cfgs], options.train_together,
             options.shared_output, files, options.verbose)


def run_all(batches: list[list[RunConfig]], options: TaskOptions) -> Iterator[RunOutcome]:
    """Submit every batch (a run, or runs trained together) as a task, then yield each run's
    outcome as its task ends (without shared output, once its files are written under output-dir)."""
    pending = {submit(batch, options): (batch, time.perf_counter()) for batch in batches}
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        batch, submitted = pending.pop(done[0])
        for cfg, outcome in zip(batch, _outcomes(done[0], batch, submitted), strict=True):
            if outcome.files is not None:
                write_run_files(cfg.run_dir, outcome.files)
            yield outcome


def _outcomes(ref: ray.ObjectRef, batch: list[RunConfig], submitted: float) -> list[RunOutcome]:
    """The task's outcomes, or ones that carry the error of a task Ray gave up on (retries spent,
    a node-side import error, ...)."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return [RunOutcome(cfg.name, "", 0, f"{type(exc).__name__}: {first}", 0, time.perf_counter() - submitted)
                for cfg in batch]
