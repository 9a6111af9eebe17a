"""A reference table (e.g. the paper's numbers) joined to the per-cell medians."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from fedmask_app.report.runs import (
    KEYS,
    REPORTED,
    SummaryError,
    bs_label,
    bs_order,
)

# ---------------------------------------------------------------------------------------------
# Reference tables


def read_reference(path: str | Path) -> pd.DataFrame:
    """A CSV with columns bs, tau, alpha and any of REPORTED; one row per (bs, tau, alpha)."""
    path = Path(path)
    try:
        ref = pd.read_csv(path, dtype={"bs": str})
    except FileNotFoundError as exc:
        raise SummaryError(f"reference file {path} not found") from exc
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise SummaryError(f"reference file {path} is not a CSV table: {exc}") from exc
    ref.columns = [str(c).strip() for c in ref.columns]
    missing = [k for k in KEYS if k not in ref.columns]
    metrics = [m for m in REPORTED if m in ref.columns]
    if missing or not metrics:
        problems = []
        if missing:
            problems.append(f"lacks the key column(s) {', '.join(missing)}")
        if not metrics:
            problems.append(f"has none of the metric columns {', '.join(REPORTED)}")
        raise SummaryError(
            f"reference file {path} {' and '.join(problems)} (columns found: {', '.join(ref.columns)})"
        )
    try:
        ref = ref[[*KEYS, *metrics]].assign(
            bs=ref["bs"].map(lambda v: bs_label(float(v)) if bs_order(str(v).strip())[0] == 0 else bs_label(v)),
            tau=pd.to_numeric(ref["tau"], errors="raise").astype(int),
            alpha=pd.to_numeric(ref["alpha"], errors="raise").astype(float),
        )
        for m in metrics:
            ref[m] = pd.to_numeric(ref[m], errors="raise")
    except (ValueError, TypeError) as exc:
        raise SummaryError(f"reference file {path}: a key or metric value is not a number: {exc}") from exc
    duplicated = ref[ref.duplicated(list(KEYS), keep=False)]
    if not duplicated.empty:
        raise SummaryError(f"reference file {path} has more than one row for "
                           f"{duplicated[list(KEYS)].drop_duplicates().to_dict('records')}")
    return ref


def join_reference(cells: pd.DataFrame, ref: pd.DataFrame) -> pd.DataFrame:
    """cells with <metric>_ref and <metric>_ratio = ours / reference for every reference metric."""
    metrics = [m for m in REPORTED if m in ref.columns]
    ref = ref.rename(columns={m: f"{m}_ref" for m in metrics})
    joined = cells.merge(ref, on=list(KEYS), how="left", validate="many_to_one")
    for m in metrics:
        joined[f"{m}_ratio"] = joined[m] / joined[f"{m}_ref"]
    return joined


def unmatched_reference(cells: pd.DataFrame, ref: pd.DataFrame) -> pd.DataFrame:
    """Reference rows with no cell in the results."""
    keys = list(KEYS)
    merged = ref[keys].merge(cells[keys].drop_duplicates(), on=keys, how="left", indicator=True)
    return merged[merged["_merge"] == "left_only"][keys]
