"""The server's per-round choices that carry over from round to round: the keep-prob of the
calibrated schedule (``keep-prob-schedule``) and the FedExP step (``server-step``)."""

from __future__ import annotations

from fedmask_app.run.config import RunConfig
from strategies.aggregate import CohortResult, ServerLr
from strategies.server_step import calibrated_keep_prob, fedexp_step, weighted_sums


class RoundSchedule:
    """``keep_prob`` is this round's p (round 1: ``keep-prob``; calibrated: from the last round's
    B_w); ``observe`` takes a round's result; ``state`` goes into the checkpoint so that a resume
    continues the schedule."""

    def __init__(self, cfg: RunConfig, state: dict | None = None):
        self.cfg = cfg
        self.keep_prob = float((state or {}).get("keep-prob", cfg.keep_prob))

    def server_lr(self, server_round: int) -> ServerLr | None:
        if self.cfg.server_step == "fedexp":
            return fedexp_step(self.cfg.aggregation, self.cfg.fedexp_epsilon, server_round)
        return None

    def observe(self, result: CohortResult) -> None:
        if self.cfg.keep_prob_schedule == "calibrated":
            _, b_w = weighted_sums(result.sums, self.cfg.aggregation)
            self.keep_prob = calibrated_keep_prob(b_w, self.cfg.penalty_target, self.cfg.keep_prob_min)

    def state(self) -> dict:
        return {"keep-prob": self.keep_prob}
