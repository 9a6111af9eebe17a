"""One round's server side after the replies are in: drop the bad ones, aggregate the rest."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from strategies.aggregate import (
    ClientReply,
    CohortResult,
    NonFiniteUpdates,
    ServerLr,
    aggregate_cohort,
    reply_problem,
)

log = logging.getLogger("fedmask")


class RoundFailed(RuntimeError):
    """Too few good replies to go on."""


@dataclass
class RoundOutcome:
    result: CohortResult
    failures: list[str] = field(default_factory=list)  # one reason per client left out
    replies: list[ClientReply] = field(default_factory=list)  # the aggregated ones, in partition-id order

    @property
    def num_failures(self) -> int:
        return len(self.failures)


def finish_round(
    server_round: int,
    global_params: Sequence[np.ndarray],
    replies: Sequence[ClientReply],
    failures: Sequence[str],
    *,
    aggregation: str,
    keep_prob: float,
    min_clients: int,
    server_lr: ServerLr | None = None,
    coordinate_mask_seeds: Mapping[int, int] | None = None,
) -> RoundOutcome:
    """Leave out replies of the wrong layout or with NaN/Inf, then aggregate the good ones.

    ``failures`` are reasons already known (a client raised or timed out). Raises RoundFailed
    when fewer than ``min_clients`` good replies remain. ``coordinate_mask_seeds`` (partition id
    -> mask seed): the masks are per coordinate and regenerated here (``aggregate_cohort``).
    """
    shapes = [p.shape for p in global_params]
    dtypes = [p.dtype for p in global_params]
    failures = list(failures)
    good = []
    for reply in replies:
        problem = reply_problem(reply, shapes, dtypes)
        if problem is None:
            good.append(reply)
        else:
            failures.append(f"partition {reply.partition_id}: {problem}")
    result = None
    while result is None:
        if len(good) < min_clients:
            _log(server_round, failures)
            raise RoundFailed(
                f"round {server_round}: {len(good)} good replies, min-clients is {min_clients}; "
                f"left out: {'; '.join(failures) or 'none'}"
            )
        try:
            result = aggregate_cohort(global_params, good, aggregation, keep_prob, server_lr, coordinate_mask_seeds)
        except NonFiniteUpdates as exc:
            failures.extend(f"partition {pid}: update holds NaN or Inf" for pid in exc.partition_ids)
            good = [r for r in good if r.partition_id not in exc.partition_ids]
    _log(server_round, failures)
    return RoundOutcome(result, failures, sorted(good, key=lambda r: r.partition_id))


def _log(server_round: int, failures: Sequence[str]) -> None:
    for reason in failures:
        log.warning("round %d: left out %s", server_round, reason)
