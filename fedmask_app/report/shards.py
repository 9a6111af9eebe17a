"""A run's client shard sizes: the optional file ``shards.csv`` next to rounds.csv.

rounds.csv has only each round's summed ``num_examples`` and its ``cohort`` (the partition ids of
the good replies), so a client's own n_k, and with it its number of local steps
T = tau * ceil(n_k / bs), comes from this file. Format (one row per client of the partition, the
sizes the run trained on, i.e. after max-shard-size)::

    partition_id,num_examples
    0,512
    1,37
    ...

The run writes it once, at the start (``fedmask_app.run.results.RunResults.write_shards``, where
the server has the training set: simulation and the local engine). The report reads it with
``read_shards`` and turns each round's cohort into the smallest and largest shard of the round
(``cohort_shard_range``) and the sum of its squared aggregation weights (``cohort_sum_sq_weights``).
Without the file those are NaN.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from fedmask_app.run.schema import SHARDS_FILE

SHARDS_COLUMNS = ("partition_id", "num_examples")


def read_shards(run_dir: str | Path) -> pd.Series | None:
    """num_examples indexed by partition_id, or None when the run has no shards.csv.

    Raises ValueError (naming the file) for a file that is not that table."""
    path = Path(run_dir) / SHARDS_FILE
    if not path.is_file():
        return None
    try:
        table = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not a CSV table: {exc}") from exc
    if any(c not in table.columns for c in SHARDS_COLUMNS):
        raise ValueError(f"{path} lacks the columns {', '.join(SHARDS_COLUMNS)} (found: {', '.join(table.columns)})")
    ids = pd.to_numeric(table["partition_id"], errors="coerce")
    sizes = pd.to_numeric(table["num_examples"], errors="coerce")
    if ids.isna().any() or sizes.isna().any() or (sizes < 0).any() or ids.duplicated().any():
        raise ValueError(f"{path}: partition ids must be unique integers and sizes integers >= 0")
    return pd.Series(sizes.to_numpy(dtype=float), index=ids.astype(int).to_numpy(), name="num_examples")


def _cohort_sizes(cohort, sizes: pd.Series) -> np.ndarray:
    """The n_k of one round's cohort ("3 17 42"), empty for a round with no cohort. Raises
    ValueError for a partition id that shards.csv does not list."""
    ids = [int(i) for i in str(cohort).split()] if isinstance(cohort, str) else []
    unknown = [i for i in ids if i not in sizes.index]
    if unknown:
        raise ValueError(f"{SHARDS_FILE} lists no partition id(s) {unknown[:5]} of the cohorts")
    return sizes.loc[ids].to_numpy()


def cohort_shard_range(cohorts: pd.Series, sizes: pd.Series) -> tuple[pd.Series, pd.Series]:
    """Per round, the smallest and largest n_k of its cohort ("3 17 42"); NaN for a round with no
    cohort. Raises ValueError for a partition id that shards.csv does not list."""
    low, high = [], []
    for cohort in cohorts:
        n = _cohort_sizes(cohort, sizes)
        low.append(float(n.min()) if n.size else np.nan)
        high.append(float(n.max()) if n.size else np.nan)
    return pd.Series(low, index=cohorts.index), pd.Series(high, index=cohorts.index)


def cohort_sum_sq_weights(cohorts: pd.Series, sizes: pd.Series) -> pd.Series:
    """Per round, W₂ = Σ_k w_k² over its cohort with the aggregation's weights w_k = n_k / Σ_j n_j
    (1/K_c for equal shards): what 1/ΔS_w and ρ_H would be the inverse of if every client sent the
    same update. NaN for a round with no cohort or no examples. Raises ValueError as
    cohort_shard_range does."""
    out = []
    for cohort in cohorts:
        n = _cohort_sizes(cohort, sizes)
        out.append(float(np.sum((n / n.sum()) ** 2)) if n.size and n.sum() > 0 else np.nan)
    return pd.Series(out, index=cohorts.index)
