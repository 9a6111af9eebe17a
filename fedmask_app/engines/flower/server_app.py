"""Flower ServerApp: the shared round loop, with rounds carried out by MaskedFedAvg over Messages."""

from __future__ import annotations

import time
from collections.abc import Iterable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message
from flwr.serverapp import Grid, ServerApp
from flwr.superlink.grid import InMemoryGrid

from fedmask_app.engines.flower.fast.buffers import record_from_arrays
from fedmask_app.engines.flower.fast.ray_transport import use_shared_buffers
from fedmask_app.engines.flower.fast.slots import ReplySlots
from fedmask_app.engines.flower.fast.wakeup import wake_message_extractor
from fedmask_app.run.config import RunConfig
from fedmask_app.run.loop import run_rounds
from strategies.masked_fedavg import MaskedFedAvg
from strategies.round import RoundOutcome

ENGINE = "flower"

app = ServerApp()

SIMULATION_POLL_SECONDS = 0.01


def send_and_receive(grid: Grid, messages: Iterable[Message], timeout: float) -> list[Message]:
    """``grid.send_and_receive``, but an in-process simulation grid is polled every 10 ms.

    InMemoryGrid sleeps 100 ms between polls, so the round's last reply waited 50 ms on average
    for the server to notice it. Deployments keep Flower's own polling.
    """
    if not isinstance(grid, InMemoryGrid):
        return list(grid.send_and_receive(messages, timeout=timeout))
    pending = set(grid.push_messages(messages))
    wake_message_extractor()
    deadline = time.monotonic() + timeout
    replies: list[Message] = []
    while pending:
        arrived = list(grid.pull_messages(pending))
        replies.extend(arrived)
        pending.difference_update(m.metadata.reply_to_message_id for m in arrived)
        if pending:
            if time.monotonic() >= deadline:
                break
            time.sleep(SIMULATION_POLL_SECONDS)
    return replies


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = RunConfig.from_mapping(context.run_config)
    strategy = MaskedFedAvg(cfg)
    arrays: ArrayRecord | None = None
    slots: ReplySlots | None = None
    slots_tried = False

    def train_round(server_round: int, params: list[np.ndarray]) -> RoundOutcome:
        nonlocal arrays, slots, slots_tried
        through_ray = use_shared_buffers(broadcast=True)  # Ray may start after the first round began
        if arrays is None:  # first round of this process (fresh or resumed)
            arrays = record_from_arrays(params)
        if through_ray and not slots_tried and isinstance(grid, InMemoryGrid):
            slots_tried = True
            slots = ReplySlots.for_model(params, cfg.clients_per_round)
            if slots is not None:
                print(f"[fedmask] clients write their updates into shared-memory slots of {slots.nbytes >> 20} MiB")
        messages = strategy.configure_train(server_round, arrays, ConfigRecord(), grid)
        if slots is not None:
            messages = slots.lend(messages)
        replies: list[Message] = []
        try:
            replies = send_and_receive(grid, messages, timeout=cfg.round_timeout)
            arrays, _ = strategy.aggregate_train(server_round, replies)
        finally:  # also when the round failed: slots without a reply retire
            if slots is not None:
                slots.take_back(replies)
        return strategy.last_outcome

    try:
        run_rounds(cfg, ENGINE, train_round)
    finally:
        if slots is not None:
            slots.close()
