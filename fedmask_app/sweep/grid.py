"""Grid files: a ``[base]`` table of run-config overrides, an ``[axes]`` table of lists, and
optionally ``[[cells]]`` tables that list cells explicitly (when a product of axes would make
duplicates or cells nobody wants, e.g. mask-mode = "none" x keep-prob). Every cell (each
``[[cells]]`` table, or one empty cell when there are none) times every combination of the axes is
one run, named after its cell's and axes' values."""

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
    unknown = set(grid) - {"base", "axes", "cells"}
    if unknown or not ({"axes", "cells"} & set(grid)):
        raise ConfigError(f"{path}: a grid file has a [base] table and an [axes] table and/or [[cells]] tables, "
                          f"found {sorted(grid)}")
    base, axes, cells = grid.get("base", {}), grid.get("axes", {}), grid.get("cells", [{}])
    for key, values in axes.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{path}: axis {key!r} must be a non-empty list, got {values!r}")
    if not isinstance(cells, list) or not cells or not all(isinstance(c, dict) for c in cells):
        raise ConfigError(f"{path}: cells must be [[cells]] tables of run-config values")
    keys = list(axes)
    runs, names = [], set()
    for cell in cells:
        for combo in itertools.product(*(axes[k] for k in keys)):
            values = {**cell, **dict(zip(keys, combo, strict=True))}
            name = "_".join(f"{k}={_label(v)}" for k, v in values.items())
            if name in names:
                raise ConfigError(f"{path}: two runs would be named {name!r}: make the cells differ")
            names.add(name)
            runs.append(GridRun(name=name, overrides={**base, **values, "run-name": name}))
    return runs
