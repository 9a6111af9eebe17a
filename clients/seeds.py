"""Seeds are derived, never drawn: every random stream is keyed by (run seed, purpose, round, ...)."""

from __future__ import annotations

import numpy as np

# Purpose tags keep the streams of one (seed, round, partition id) independent of each other.
# None is 0: SeedSequence drops trailing zeros, so (seed, 0) would be the stream of the bare run
# seed, which the Dirichlet partition draws from (numpy's default_rng(seed)).
COHORT = 1
BATCH_ORDER = 2
MASK = 3
SYNC_MASK = 4
SHARED_BATCH_ORDER = 5  # the identical-shards control: one order for every client
PROBE = 6  # the probe batch of the server's curvature and flatness measurements (once per run)
MEASUREMENT = 7  # the measurements' Rademacher signs and mask draws, per round
INIT = 8  # θ_0 (it was 0 until 2026-11-30, which shared the partition's stream)
AUGMENT = 9  # a client's crops and flips (augment = "crop-flip")
SHARED_AUGMENT = 10  # the identical-shards control: one draw of crops and flips for every client
PURPOSES = (COHORT, BATCH_ORDER, MASK, SYNC_MASK, SHARED_BATCH_ORDER, PROBE, MEASUREMENT, INIT, AUGMENT,
            SHARED_AUGMENT)


def derive_seed(*key: int) -> int:
    """A 63-bit seed hashed from ``key`` by numpy's SeedSequence.

    SeedSequence ignores trailing zeros, so keys must not differ only by them: every key here
    starts with (run seed, purpose tag), and all keys of one purpose have the same length.
    """
    if any(k < 0 for k in key):
        raise ValueError(f"seed key parts must be non-negative, got {key}")
    state = np.random.SeedSequence(list(key)).generate_state(1, dtype=np.uint64)[0]
    return int(state >> np.uint64(1))


def batch_order_seed(run_seed: int, server_round: int, partition_id: int | None) -> int:
    """Minibatch order of one client; ``partition_id=None`` is the identical-shards control."""
    if partition_id is None:
        return derive_seed(run_seed, SHARED_BATCH_ORDER, server_round)
    return derive_seed(run_seed, BATCH_ORDER, server_round, partition_id)


def augment_seed(run_seed: int, server_round: int, partition_id: int | None) -> int:
    """Crops and flips of one client's shard (its own stream, so augmenting leaves its batch order
    as it is); ``partition_id=None`` is the identical-shards control."""
    if partition_id is None:
        return derive_seed(run_seed, SHARED_AUGMENT, server_round)
    return derive_seed(run_seed, AUGMENT, server_round, partition_id)


def independent_mask_seed(run_seed: int, server_round: int, partition_id: int) -> int:
    """Mask seed a client derives for itself in independent mode."""
    return derive_seed(run_seed, MASK, server_round, partition_id)


def synchronized_mask_seed(run_seed: int, server_round: int) -> int:
    """The one mask seed the server broadcasts in synchronized mode."""
    return derive_seed(run_seed, SYNC_MASK, server_round)
