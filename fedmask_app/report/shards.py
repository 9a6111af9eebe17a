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
(``cohort_shard_range``). Without the file those are NaN.
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


def cohort_shard_range(cohorts: pd.Series, sizes: pd.Series) -> tuple[pd.Series, pd.Series]:
    """Per round, the smallest and largest n_k of its cohort ("3 17 42"); NaN for a round with no
    cohort. Raises ValueError for a partition id that shards.csv does not list."""
    low, high = [], []
    for cohort in cohorts:
        ids = [int(i) for i in str(cohort).split()] if isinstance(cohort, str) else []
        unknown = [i for i in ids if i not in sizes.index]
        if unknown:
            raise ValueError(f"{SHARDS_FILE} lists no partition id(s) {unknown[:5]} of the cohorts")
        n = sizes.loc[ids].to_numpy() if ids else np.array([np.nan])
        low.append(float(n.min()))
        high.append(float(n.max()))
    return pd.Series(low, index=cohorts.index), pd.Series(high, index=cohorts.index)
