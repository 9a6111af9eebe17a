"""Grid files: a ``[base]`` table of run-config overrides and an ``[axes]`` table of lists; every
combination of the axes is one run, named after its cell and seed."""

from __future__ import annotations

import itertools
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedmask_app.run.config import ConfigError


@dataclass(frozen=True)
class GridRun:
    name: str  # e.g. "batch-size=32_local-epochs=2_seed=0"
    overrides: dict[str, Any]  # base + this cell's axis values


def _label(value: Any) -> str:
    """An axis value as it appears in a folder name (characters other than A-Z a-z 0-9 . _ - become -)."""
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return re.sub(r"[^A-Za-z0-9._-]", "-", text)


def load_grid(path: Path) -> list[GridRun]:
    if not path.is_file():
        raise ConfigError(f"grid file {path} not found")
    with path.open("rb") as f:
        grid = tomllib.load(f)
    unknown = set(grid) - {"base", "axes"}
    if unknown or "axes" not in grid:
        raise ConfigError(f"{path}: a grid file has a [base] table and an [axes] table, found {sorted(grid)}")
    base, axes = grid.get("base", {}), grid["axes"]
    for key, values in axes.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{path}: axis {key!r} must be a non-empty list, got {values!r}")
    keys = list(axes)
    runs = []
    for combo in itertools.product(*(axes[k] for k in keys)):
        cell = dict(zip(keys, combo, strict=True))
        name = "_".join(f"{k}={_label(v)}" for k, v in cell.items())
        runs.append(GridRun(name=name, overrides={**base, **cell, "run-name": name}))
    return runs
