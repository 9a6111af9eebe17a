"""Client shards: per-class Dirichlet(α) partition, or identical shards for the correctness control.

``dirichlet_partition`` draws exactly what flwr-datasets' ``DirichletPartitioner`` (self_balancing
off, shuffle on) draws for the same seed -- tests/test_partition.py checks it index for index --
but needs numpy alone, so the local engine runs where neither flwr nor datasets is installed.
One difference: flwr-datasets gives up after 10 redraws that leave a client below the minimum
size (it fails at α = 0.1, seed 2); we redraw up to ``MAX_REDRAWS`` times.
"""

from __future__ import annotations

import numpy as np

MAX_REDRAWS = 1000


def dirichlet_partition(
    labels: np.ndarray, num_clients: int, alpha: float, seed: int, min_size: int = 10
) -> list[np.ndarray]:
    """Indices of each client's shard: for every class c, proportions q_c ~ Dir(α·1_K) split the
    samples of c among the K clients; the whole draw is repeated until every client has at least
    ``min_size`` samples; each shard is then shuffled."""
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    rng = np.random.default_rng(seed)
    alphas = np.full(num_clients, float(alpha))
    for _ in range(MAX_REDRAWS + 1):
        shards: list[list[int]] = [[] for _ in range(num_clients)]
        for c in np.unique(labels):
            class_indices = np.nonzero(labels == c)[0]
            cuts = (np.cumsum(rng.dirichlet(alphas)) * len(class_indices)).astype(int)[:-1]
            for shard, part in zip(shards, np.split(class_indices, cuts), strict=True):
                shard.extend(part.tolist())
        if min(len(s) for s in shards) >= min_size:
            break
    else:
        raise ValueError(
            f"no Dirichlet(alpha={alpha}) partition over {num_clients} clients gave every client "
            f"min-partition-size={min_size} samples in {MAX_REDRAWS} redraws: lower min-partition-size"
        )
    for shard in shards:
        rng.shuffle(shard)
    return [np.asarray(s, dtype=np.int64) for s in shards]


def identical_shards(labels: np.ndarray, num_clients: int, alpha: float, seed: int, min_size: int) -> list[np.ndarray]:
    """The correctness control: every client holds client 0's shard of the Dirichlet partition."""
    shard = dirichlet_partition(labels, num_clients, alpha, seed, min_size)[0]
    return [shard] * num_clients
