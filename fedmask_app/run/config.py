"""RunConfig: the run configuration, typed and validated once at start.

The one place a default lives is ``[tool.flwr.app.config]`` in pyproject.toml; ``flwr run``
merges ``--run-config`` into it and hands the result to the apps, and the local engine does the
same merge with ``load_run_config``. ``RunConfig.from_mapping`` then checks every value.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clients.augment import AUGMENTATIONS
from fedmask_app.run.data import DATASETS, DataSpec, data_spec, resolve_data_dir
from fedmask_app.run.model import MODELS

PROJECT_ROOT = Path(__file__).resolve().parents[2]
MASK_MODES = ("none", "independent", "synchronized")
AGGREGATIONS = ("weighted", "uniform")
DEVICES = ("auto", "cpu", "cuda")
SERVER_STEPS = ("fedavg", "fedexp")
SCHEDULES = ("fixed", "calibrated")
PRECISIONS = ("float32", "tf32", "bf16", "float64")
GRANULARITIES = ("tensor", "coordinate")
FAULT_KINDS = ("raise", "nan", "inf", "shape", "dtype", "hang")


class ConfigError(ValueError):
    """A run-config value that is not allowed; the message names the key, the value and the rule."""


@dataclass(frozen=True)
class FaultInjection:
    """A fault a client raises on purpose (tests): ``kind:partition-id:round``."""

    kind: str
    partition_id: int
    server_round: int


@dataclass(frozen=True)
class RunConfig:
    seed: int
    num_clients: int
    clients_per_round: int
    num_rounds: int
    alpha: float
    min_partition_size: int
    max_shard_size: int
    identical_shards: bool
    dataset: str
    model: str
    local_epochs: int
    batch_size: int | None  # None: one full-batch step per epoch
    lr: float
    momentum: float
    weight_decay: float
    augment: str
    mask_mode: str
    keep_prob: float
    aggregation: str
    server_step: str
    fedexp_epsilon: float
    keep_prob_schedule: str
    penalty_target: float
    keep_prob_min: float
    eval_every: int
    eval_from: int
    test_subset: int
    eval_batch_size: int
    data_dir: str
    output_dir: str
    run_name: str
    device: str
    precision: str
    threads: int
    client_processes: int
    client_streams: int
    fast_simulation: bool
    vectorize: bool
    cuda_graphs: bool
    skip_padding_taps: bool
    gemm_convs: bool
    min_clients: int
    round_timeout: float
    checkpoint_every: int
    resume: bool
    inject_fault: str
    curvature_every: int
    measure_from: int
    probe_size: int
    probe_file: str
    curvature_probes: int
    penalty_draws: int
    mask_granularity: str
    flatness_every: int
    flatness_probes: int
    lanczos_tol: float
    lanczos_max_iter: int

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> RunConfig:
        """Validate a flat run-config mapping (kebab-case keys, as in pyproject.toml)."""
        fields = {f.name.replace("_", "-"): f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise ConfigError(f"unknown run-config key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(fields))}")
        missing = sorted(set(fields) - set(values))
        if missing:
            raise ConfigError(f"run-config is missing {', '.join(missing)} (defaults live in pyproject.toml)")
        kwargs = {f.name: _coerce(key, values[key], f.type) for key, f in fields.items()}
        kwargs["batch_size"] = _batch_size(values["batch-size"])
        cfg = cls(**kwargs)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        _require(self.seed >= 0, "seed", self.seed, "an integer >= 0 (seeds are derived with SeedSequence)")
        _require(self.keep_prob > 0 and self.keep_prob <= 1, "keep-prob", self.keep_prob, "a probability in (0, 1]")
        _require(self.num_clients >= 1, "num-clients", self.num_clients, "an integer >= 1")
        _require(
            1 <= self.clients_per_round <= self.num_clients, "clients-per-round", self.clients_per_round,
            f"an integer from 1 to num-clients ({self.num_clients})",
        )
        _require(self.num_rounds >= 1, "num-rounds", self.num_rounds, "an integer >= 1")
        _require(math.isfinite(self.alpha) and self.alpha > 0, "alpha", self.alpha, "a Dirichlet concentration > 0")
        _require(self.max_shard_size >= 0, "max-shard-size", self.max_shard_size, "an integer >= 0 (0: no cap)")
        _require(self.min_partition_size >= 1, "min-partition-size", self.min_partition_size, "an integer >= 1")
        _require(self.dataset in DATASETS, "dataset", self.dataset, f"one of {', '.join(DATASETS)}")
        _require(self.model in MODELS, "model", self.model, f"one of {', '.join(MODELS)}")
        _require(self.local_epochs >= 1, "local-epochs", self.local_epochs, "an integer tau >= 1")
        _require(math.isfinite(self.lr) and self.lr > 0, "lr", self.lr, "a learning rate > 0")
        self._validate_local_training()
        _require(self.mask_mode in MASK_MODES, "mask-mode", self.mask_mode, f"one of {', '.join(MASK_MODES)}")
        _require(self.aggregation in AGGREGATIONS, "aggregation", self.aggregation, f"one of {', '.join(AGGREGATIONS)}")
        _require(self.eval_every >= 0, "eval-every", self.eval_every, "an integer >= 0 (0: never)")
        _require(self.eval_from >= 1, "eval-from", self.eval_from, "a round >= 1")
        _require(0 <= self.test_subset <= 10000, "test-subset", self.test_subset, "0 (all 10000) to 10000")
        _require(self.eval_batch_size >= 1, "eval-batch-size", self.eval_batch_size, "an integer >= 1")
        _require(self.device in DEVICES, "device", self.device, f"one of {', '.join(DEVICES)}")
        _require(self.precision in PRECISIONS, "precision", self.precision, f"one of {', '.join(PRECISIONS)}")
        _require(
            not (self.precision == "float64" and self.device == "cuda"), "precision", self.precision,
            "float32, tf32 or bf16 with device = 'cuda' (float64 is the CPU-only reference precision)",
        )
        _require(
            not (self.cuda_graphs and self.device == "cpu"), "cuda-graphs", self.cuda_graphs,
            "false with device = 'cpu' (CUDA graphs replay a training step on a GPU)",
        )
        self._validate_measurements()
        self._validate_server_step()
        _require(self.threads >= 0, "threads", self.threads, "an integer >= 0 (0: from the client's CPUs)")
        _require(self.client_processes >= 0, "client-processes", self.client_processes,
                 "an integer >= 0 (1: clients train in the engine's process; 0: one process per CPU)")
        _require(
            self.client_processes == 1 or not (self.vectorize or self.device == "cuda"), "client-processes",
            self.client_processes, "1 with vectorize = true or device = 'cuda' (client processes train on the CPU, "
            "one client at a time each)",
        )
        _require(self.client_streams >= 1, "client-streams", self.client_streams,
                 "an integer >= 1 (1: one client at a time)")
        _require(
            self.client_streams == 1 or not (self.vectorize or self.device == "cpu"), "client-streams",
            self.client_streams, "1 with vectorize = true or device = 'cpu' (streams train clients side by side on "
            "a GPU; the vectorised step already trains the whole cohort at once)",
        )
        _require(
            1 <= self.min_clients <= self.clients_per_round, "min-clients", self.min_clients,
            f"an integer from 1 to clients-per-round ({self.clients_per_round})",
        )
        _require(
            math.isfinite(self.round_timeout) and self.round_timeout > 0, "round-timeout", self.round_timeout,
            "seconds > 0",
        )
        _require(self.checkpoint_every >= 0, "checkpoint-every", self.checkpoint_every, "an integer >= 0 (0: never)")
        _require(
            not self.run_name or re.fullmatch(r"[A-Za-z0-9._=-]+", self.run_name) is not None,
            "run-name", self.run_name, "letters, digits and . _ = - only",
        )
        self.fault_injections()  # parses or raises
        self._validate_data_dir()

    def _validate_local_training(self) -> None:
        _require(0 <= self.momentum < 1, "momentum", self.momentum,
                 "a number in [0, 1) (heavy-ball momentum of local SGD; 0: plain SGD, the paper's protocol here)")
        _require(math.isfinite(self.weight_decay) and self.weight_decay >= 0, "weight-decay", self.weight_decay,
                 "a number >= 0 (L2 coefficient of local SGD; 0: none)")
        # Momentum buffers start at zero for every client and round; these steps outlive a client.
        _require(self.momentum == 0 or not (self.cuda_graphs and not self.vectorize), "momentum", self.momentum,
                 "0 with cuda-graphs = true and vectorize = false (the captured per-client step keeps its "
                 "optimizer across clients; use vectorize = true or cuda-graphs = false)")
        _require(self.momentum == 0 or self.client_streams == 1, "momentum", self.momentum,
                 "0 with client-streams > 1 (a stream's step keeps its optimizer across clients)")
        _require(self.augment in AUGMENTATIONS, "augment", self.augment, f"one of {', '.join(AUGMENTATIONS)}")
        _require(self.augment == "none" or not (self.vectorize or self.client_streams > 1), "augment", self.augment,
                 "'none' with vectorize = true or client-streams > 1 (those paths train on the shard as stored; "
                 "augmentation runs on the one-client-at-a-time path, either engine)")

    def _validate_server_step(self) -> None:
        _require(self.server_step in SERVER_STEPS, "server-step", self.server_step, f"one of {', '.join(SERVER_STEPS)}")
        _require(math.isfinite(self.fedexp_epsilon) and self.fedexp_epsilon >= 0, "fedexp-epsilon",
                 self.fedexp_epsilon, "a number >= 0 (FedExP's ε_0; the official code uses 0.001 on CIFAR-10)")
        _require(self.keep_prob_schedule in SCHEDULES, "keep-prob-schedule", self.keep_prob_schedule,
                 f"one of {', '.join(SCHEDULES)}")
        if self.keep_prob_schedule == "calibrated":
            _require(self.mask_mode == "synchronized", "keep-prob-schedule", self.keep_prob_schedule,
                     f"'fixed' with mask-mode = {self.mask_mode!r}: the calibrated schedule sets the keep-prob "
                     "of synchronized masks only")
            _require(math.isfinite(self.penalty_target) and self.penalty_target > 0, "penalty-target",
                     self.penalty_target, "a penalty c > 0 with keep-prob-schedule = 'calibrated'")
        _require(0 < self.keep_prob_min <= 1, "keep-prob-min", self.keep_prob_min, "a probability in (0, 1]")

    def _validate_measurements(self) -> None:
        for key, value in (("curvature-every", self.curvature_every), ("flatness-every", self.flatness_every)):
            _require(value >= 0, key, value, "an integer >= 0 (0: never)")
        _require(self.measure_from >= 1, "measure-from", self.measure_from, "a round >= 1")
        _require(self.probe_size >= 1, "probe-size", self.probe_size, "an integer >= 1 (training images)")
        for key, value in (("curvature-probes", self.curvature_probes), ("penalty-draws", self.penalty_draws),
                           ("flatness-probes", self.flatness_probes)):
            _require(value >= 2, key, value, "an integer >= 2 (a standard error needs two)")
        _require(self.mask_granularity in GRANULARITIES, "mask-granularity", self.mask_granularity,
                 f"one of {', '.join(GRANULARITIES)}")
        _require(0 < self.lanczos_tol < 1, "lanczos-tol", self.lanczos_tol, "a relative tolerance in (0, 1)")
        _require(self.lanczos_max_iter >= 2, "lanczos-max-iter", self.lanczos_max_iter, "an integer >= 2")
        if self.probe_file:
            _require(Path(self.probe_file).expanduser().is_file(), "probe-file", self.probe_file,
                     f"an existing .npz file with arrays x (N, {', '.join(map(str, self.data.image_shape))} uint8) "
                     "and y (N labels)")

    def _validate_data_dir(self) -> None:
        data_dir = resolve_data_dir(self.data_dir)
        file_name = self.data.file_name
        if (data_dir / file_name).is_file():
            return
        existing = next((p for p in [data_dir, *data_dir.parents] if p.exists()), None)
        if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(
                f"data-dir = {str(data_dir)!r} holds no {file_name} and is not writable, so it cannot be "
                "fetched there: point data-dir at a folder with the file or a writable folder"
            )

    def fault_injections(self) -> list[FaultInjection]:
        """The faults of ``inject-fault``: comma-separated ``KIND:PARTITION-ID:ROUND`` (tests only)."""
        faults = []
        for spec in filter(None, self.inject_fault.split(",")):
            match = re.fullmatch(r"([a-z]+):(\d+):(\d+)", spec.strip())
            if match is None or match.group(1) not in FAULT_KINDS:
                raise ConfigError(
                    f"inject-fault = {self.inject_fault!r} is not allowed: expected '' or comma-separated "
                    f"KIND:PARTITION-ID:ROUND with KIND one of {', '.join(FAULT_KINDS)}"
                )
            faults.append(FaultInjection(match.group(1), int(match.group(2)), int(match.group(3))))
        return faults

    def fault_for(self, partition_id: int, server_round: int) -> FaultInjection | None:
        return next(
            (f for f in self.fault_injections() if (f.partition_id, f.server_round) == (partition_id, server_round)),
            None,
        )

    def to_mapping(self) -> dict[str, Any]:
        """The flat kebab-case mapping this config was made from (``batch-size`` as in the file)."""
        out = {f.name.replace("_", "-"): getattr(self, f.name) for f in dataclasses.fields(self)}
        out["batch-size"] = "full" if self.batch_size is None else self.batch_size
        return out

    @property
    def name(self) -> str:
        """The run's folder name: ``run-name`` or one derived from what defines the run."""
        if self.run_name:
            return self.run_name
        bs = "full" if self.batch_size is None else self.batch_size
        parts = [self.model] if self.dataset == "cifar10" else [self.dataset, self.model]
        parts += [f"a{self.alpha:g}", f"bs{bs}", f"tau{self.local_epochs}", self.mask_mode]
        if self.mask_mode != "none":
            parts.append(f"p{self.keep_prob:g}")
        if self.max_shard_size:
            parts.append(f"shard{self.max_shard_size}")
        if self.identical_shards:
            parts.append("identical")
        return "_".join([*parts, f"seed{self.seed}"])

    @property
    def data(self) -> DataSpec:
        """The data set this run trains on (``dataset``)."""
        return data_spec(self.dataset)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir).expanduser().resolve() / self.name


def refuse_local_engine_keys(cfg: RunConfig) -> None:
    """The Flower engine's check: keys that only the local engine carries out are refused, not ignored."""
    if cfg.client_processes != 1:
        raise ConfigError(
            f"client-processes = {cfg.client_processes} is a local-engine key (fedmask-local): the Flower engine "
            "trains as many clients at once as its backend's client resources allow (num-cpus); set it to 1"
        )
    if cfg.client_streams != 1:
        raise ConfigError(
            f"client-streams = {cfg.client_streams} is a local-engine key (fedmask-local): the Flower engine "
            "trains each client in its own ClientApp call; set it to 1"
        )
    if cfg.vectorize:
        raise ConfigError("vectorize = true is a local-engine key (fedmask-local): the Flower engine trains "
                          "each client in its own ClientApp call; set it to false")


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key} = {value!r} is not allowed: expected {allowed}")


def _coerce(key: str, value: Any, annotation: str) -> Any:
    kinds = {"int": int, "float": float, "bool": bool, "str": str}
    kind = kinds.get(annotation)
    if kind is None:  # batch-size, parsed on its own
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{key} = {value!r} is not allowed: expected a value of type {annotation}")
    return value


def _batch_size(value: Any) -> int | None:
    if value == "full":
        return None
    try:
        size = int(value) if not isinstance(value, bool | float) else -1
    except (TypeError, ValueError):
        size = -1
    if size < 1:
        raise ConfigError(f'batch-size = {value!r} is not allowed: expected a positive integer or "full"')
    return size


def pyproject_defaults(project_root: Path = PROJECT_ROOT) -> dict[str, Any]:
    """``[tool.flwr.app.config]`` of the app's pyproject.toml, flattened."""
    path = project_root / "pyproject.toml"
    if not path.is_file():
        raise ConfigError(f"{path} not found: run from a fedmask checkout (pip install -e .)")
    with path.open("rb") as f:
        return _flatten(tomllib.load(f)["tool"]["flwr"]["app"]["config"])


def _flatten(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in table.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, Mapping):
            flat.update(_flatten(value, name))
        else:
            flat[name] = value
    return flat


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """``flwr run --run-config`` values: .toml files and ``key=value`` pairs (TOML values), applied
    in order. (flwr run itself takes either one file or pairs; the local engine takes both.)"""
    overrides: dict[str, Any] = {}
    for arg in args:
        if arg.endswith(".toml"):
            path = Path(arg).expanduser()
            if not path.is_file():
                raise ConfigError(f"run-config file {path} not found")
            with path.open("rb") as f:
                overrides.update(_flatten(tomllib.load(f)))
            continue
        pairs = re.findall(r"(\S+?)=('[^']*'|\"[^\"]*\"|\S+)", arg)
        if not pairs:
            raise ConfigError(f"{arg!r} is neither a .toml file nor key=value")
        for key, raw in pairs:
            try:
                overrides.update(tomllib.loads(f"{key} = {raw}"))
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"{key}={raw} is not a TOML value (quote strings: {key}='\"{raw}\"')") from exc
    return overrides


def run_config_from_values(overrides: Mapping[str, Any], project_root: Path = PROJECT_ROOT) -> RunConfig:
    """pyproject defaults merged with ``overrides`` (kebab-case keys), validated."""
    values = pyproject_defaults(project_root)
    unknown = sorted(set(overrides) - set(values))
    if unknown:
        raise ConfigError(f"unknown run-config key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(values))}")
    return RunConfig.from_mapping({**values, **overrides})


def load_run_config(args: list[str] | None = None, project_root: Path = PROJECT_ROOT) -> RunConfig:
    """pyproject defaults merged with command-line overrides: what ``flwr run`` would hand the apps."""
    return run_config_from_values(parse_overrides(args or []), project_root)


def toml_value(value: Any) -> str:
    """A run-config value written as TOML (for run-config files handed to ``flwr run``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)
