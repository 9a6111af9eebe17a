"""A run's results folder: config.json, rounds.csv (one row per round, flushed as it goes) and
an atomic checkpoint. Both engines write through here, so their rows are identical."""

from __future__ import annotations

import csv
import json
import math
import os
import platform
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

from clients.training import as_array
from fedmask_app.run.config import ConfigError, RunConfig, pyproject_defaults
from fedmask_app.run.files import atomic_write, atomic_write_json
from fedmask_app.run.provenance import source_commit
from fedmask_app.run.schema import ALL_COLUMNS, CHECKPOINT_FILE, CONFIG_FILE, ROUNDS_FILE, SHARDS_FILE

COLUMNS = ALL_COLUMNS
PACKAGES = ("torch", "torchvision", "numpy", "flwr", "flwr-datasets", "ray", "pandas")


class ResultsError(RuntimeError):
    """The results folder is not in a state this run may write to."""


@dataclass(frozen=True)
class Checkpoint:
    server_round: int
    params: list[np.ndarray]
    state: dict  # what the round schedule carries over (e.g. the calibrated keep-prob)


# Keys that do not change a run's numbers: a resume may differ in them.
TRANSPORT_KEYS = {"resume", "fast-simulation"}  # not vectorize: it moves float32 results by rounding
# Keys that say where a run's files are, not what it computes: the folder being resumed is the
# run's own whatever the spelling of its path (fedmask-run writes absolute paths, fedmask-local
# relative ones), and the data is compared by its content hash instead of its folder.
LOCATION_KEYS = {"output-dir", "run-name", "data-dir"}
# num-rounds may grow: no round's training, draws or schedule depend on how many rounds follow it,
# so a longer run continues a shorter one (the old last round keeps what a last round adds to its
# row: an evaluation and the measurements due at the end). config.json lists the earlier lengths.
EXTENDED_FROM = "extended_from_rounds"


def _defaults_or_empty() -> dict[str, Any]:
    try:
        return pyproject_defaults()
    except ConfigError:  # no pyproject.toml beside the package: compare the keys as written
        return {}


def _cell(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return ""
    return value


def read_rows(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def config_differences(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``key: before -> now`` for each run-config key in which ``now`` would compute another run
    than ``before`` did (transport and location keys aside). A key ``before`` lacks came later,
    with a default that keeps what the earlier run did."""
    before = {**_defaults_or_empty(), **before}
    keys = (set(before) | set(now)) - TRANSPORT_KEYS - LOCATION_KEYS
    if _extends(before, now):
        keys.discard("num-rounds")
    return [f"{k}: {before.get(k)!r} -> {now.get(k)!r}" for k in sorted(keys) if before.get(k) != now.get(k)]


def _extends(before: dict[str, Any], now: dict[str, Any]) -> bool:
    old, new = before.get("num-rounds"), now.get("num-rounds")
    return isinstance(old, int) and isinstance(new, int) and new > old


def stored_metadata(config_path: Path) -> dict[str, Any] | None:
    """A run folder's config.json, or None when it has none; ResultsError names a file that is not JSON."""
    if not config_path.is_file():
        return None
    try:
        return json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ResultsError(f"{config_path} is not a readable config.json ({exc}): move that run folder away "
                           "or choose another output-dir (nothing was changed)") from exc


def stored_differences(run_dir: Path, run_config: dict[str, Any]) -> list[str]:
    """``config_differences`` between the run ``run_dir`` holds (its config.json) and
    ``run_config``; empty when the folder holds no config.json."""
    stored = stored_metadata(run_dir / CONFIG_FILE)
    return [] if stored is None else config_differences(stored.get("run_config", {}), run_config)


def rounds_written(run_dir: Path) -> int:
    """How many rounds the folder's rounds.csv holds (a resume redoes those after its checkpoint)."""
    return len(read_rows(run_dir / ROUNDS_FILE))


def is_complete(run_dir: Path, num_rounds: int) -> bool:
    """True when rounds.csv holds rounds 1..num_rounds."""
    rows = read_rows(run_dir / ROUNDS_FILE)
    return [int(r["round"]) for r in rows] == list(range(1, num_rounds + 1))


def run_metadata(cfg: RunConfig, engine: str, data_sha256: str) -> dict[str, Any]:
    versions = {}
    for package in PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "run_config": cfg.to_mapping(),
        "run_name": cfg.name,
        "engine": engine,
        "model": cfg.model,
        "data_sha256": data_sha256,
        "git_commit": source_commit(),
        "packages": versions,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def _with_extensions(meta: dict[str, Any], stored: dict[str, Any] | None, resumed_after: int) -> dict[str, Any]:
    """``meta`` listing the run's earlier num-rounds whose last round it keeps: those up to the
    checkpoint it resumes after (a run redone from an earlier round has no such row any more)."""
    if stored is None:
        return meta
    earlier = [*stored.get(EXTENDED_FROM, []), stored.get("run_config", {}).get("num-rounds")]
    kept = [n for n in earlier if isinstance(n, int) and n <= resumed_after and n < meta["run_config"]["num-rounds"]]
    return {**meta, EXTENDED_FROM: kept} if kept else meta


class RunResults:
    """The folder ``<output-dir>/<run-name>/`` of one run."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.rounds_path = run_dir / ROUNDS_FILE
        self.config_path = run_dir / CONFIG_FILE
        self.checkpoint_path = run_dir / CHECKPOINT_FILE

    @classmethod
    def open(cls, cfg: RunConfig, meta: dict[str, Any]) -> tuple[RunResults, Checkpoint | None]:
        """Prepare the folder for a fresh run, or for ``resume`` from its last checkpoint.

        A fresh run refuses a folder that already holds rounds, so nothing written is lost.
        """
        results = cls(cfg.run_dir)
        results.run_dir.mkdir(parents=True, exist_ok=True)
        checkpoint = None
        if cfg.resume:
            stored = results._check_same_run(meta)
            checkpoint = results.load_checkpoint()
            last = checkpoint.server_round if checkpoint else 0
            meta = _with_extensions(meta, stored, last)
            results._keep_rounds_up_to(last)
        elif read_rows(results.rounds_path):
            raise ResultsError(
                f"{results.rounds_path} already holds rounds: pass resume=true to continue that run, "
                "or choose another run-name/output-dir (nothing was changed)"
            )
        else:
            results._keep_rounds_up_to(0)
            results.checkpoint_path.unlink(missing_ok=True)
        atomic_write_json(results.config_path, meta)
        return results, checkpoint

    def _check_same_run(self, meta: dict[str, Any]) -> dict[str, Any] | None:
        """A resume must continue the run that the folder holds, not another configuration (or a
        shorter one); returns the folder's config.json."""
        stored = stored_metadata(self.config_path)
        if stored is None:
            return None
        changed = config_differences(stored.get("run_config", {}), meta["run_config"])
        if stored.get("data_sha256") and meta.get("data_sha256") and stored["data_sha256"] != meta["data_sha256"]:
            changed.append(f"data content sha256: {stored['data_sha256'][:12]}… -> {meta['data_sha256'][:12]}…")
        if changed:
            raise ResultsError(f"cannot resume {self.run_dir}: it holds a run with another configuration "
                               f"({', '.join(changed)})")
        return stored

    def _keep_rounds_up_to(self, last_round: int) -> None:
        """Rewrite rounds.csv with the header and the rows of rounds <= last_round."""
        rows = [r for r in read_rows(self.rounds_path) if int(r["round"]) <= last_round]

        def write(f) -> None:
            import io

            text = io.StringIO()
            writer = csv.DictWriter(text, fieldnames=COLUMNS, lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
            f.write(text.getvalue().encode())

        atomic_write(self.rounds_path, write)

    def write_shards(self, sizes: list[int]) -> None:
        """shards.csv: the sizes the clients train on (partition id i holds sizes[i] examples), for
        the report's range of local steps T."""

        def write(f) -> None:
            f.write(("partition_id,num_examples\n" + "".join(f"{i},{int(n)}\n" for i, n in enumerate(sizes))).encode())

        atomic_write(self.run_dir / SHARDS_FILE, write)

    def append_row(self, row: dict[str, Any]) -> None:
        """Append one round and flush it to disk before the next round starts."""
        missing = set(COLUMNS) - set(row)
        if missing:
            raise ValueError(f"row lacks {sorted(missing)}")
        with self.rounds_path.open("a", newline="") as f:
            csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n").writerow(
                {k: _cell(row[k]) for k in COLUMNS}
            )
            f.flush()
            os.fsync(f.fileno())

    def save_checkpoint(self, server_round: int, params: list, state: dict | None = None) -> None:
        """The global model after ``server_round`` and the schedule's state; every random draw is
        derived from (seed, round, partition id), so that is all a resume needs."""
        state = {"round": server_round, "params": [torch.from_numpy(np.ascontiguousarray(as_array(p))) for p in params],
                 "schedule": dict(state or {})}
        atomic_write(self.checkpoint_path, lambda f: torch.save(state, f))

    def load_checkpoint(self) -> Checkpoint | None:
        if not self.checkpoint_path.is_file():
            return None
        state = torch.load(self.checkpoint_path, weights_only=True)
        return Checkpoint(int(state["round"]), [t.numpy() for t in state["params"]], dict(state.get("schedule", {})))
