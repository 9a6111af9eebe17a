"""Which clients train in a round: drawn over partition ids, never over Flower's node ids."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from clients.seeds import COHORT, derive_seed


def sample_cohort(run_seed: int, server_round: int, partition_ids: Sequence[int], k: int) -> list[int]:
    """K_c partition ids drawn uniformly without replacement, seeded by (run seed, round); sorted."""
    pool = sorted(partition_ids)
    if not 0 < k <= len(pool):
        raise ValueError(f"cannot draw a cohort of {k} from {len(pool)} clients")
    rng = np.random.default_rng(derive_seed(run_seed, COHORT, server_round))
    return sorted(int(pid) for pid in rng.choice(pool, size=k, replace=False))
