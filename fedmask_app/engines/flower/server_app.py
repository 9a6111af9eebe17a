"""Flower ServerApp: the shared round loop (run/loop.py), each round carried out by MaskedFedAvg
over Messages."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message
from flwr.serverapp import Grid, ServerApp
from flwr.superlink.grid import InMemoryGrid

from fedmask_app.run.config import RunConfig, refuse_local_engine_keys
from fedmask_app.run.loop import run_rounds
from strategies.aggregate import ServerLr
from strategies.masked_fedavg import MaskedFedAvg, record_from_arrays
from strategies.round import RoundOutcome

ENGINE = "flower"
# A simulation's SuperNodes all exist when the ServerApp starts: a federation smaller than
# num-clients fails after this many seconds, not after round-timeout.
SIMULATION_NODE_WAIT = 10.0

app = ServerApp()



class PlainTransport:
    """Messages through Flower's public Grid API alone."""

    def global_record(self, params: Sequence[np.ndarray]) -> ArrayRecord:
        return record_from_arrays(params)

    def exchange(self, grid: Grid, messages: Iterable[Message], timeout: float) -> list[Message]:
        return list(grid.send_and_receive(messages, timeout=timeout))

    def end_round(self, replies: Sequence[Message]) -> None:
        pass

    def close(self) -> None:
        pass


def open_transport(cfg: RunConfig, grid: Grid):
    """The one place the transport is chosen: the speed-only one (fast/) in an in-process Ray
    simulation when ``fast-simulation`` is on, else Flower's public API alone."""
    if cfg.fast_simulation:
        from fedmask_app.engines.flower.fast.transport import FastServerTransport

        if FastServerTransport.applies_to(grid):
            return FastServerTransport(cfg.clients_per_round)
    return PlainTransport()


class FlowerRounds:
    """``train_round`` for the shared loop: one round's messages out, replies in, the outcome back."""

    def __init__(self, cfg: RunConfig, grid: Grid, transport: PlainTransport, simulation: bool):
        self.grid = grid
        self.transport = transport
        self.round_timeout = cfg.round_timeout
        self.strategy = MaskedFedAvg(
            seed=cfg.seed, num_clients=cfg.num_clients, clients_per_round=cfg.clients_per_round,
            mask_mode=cfg.mask_mode, keep_prob=cfg.keep_prob, aggregation=cfg.aggregation,
            min_clients=cfg.min_clients, round_timeout=cfg.round_timeout,
            node_wait=SIMULATION_NODE_WAIT if simulation else None, mask_granularity=cfg.mask_granularity,
        )

    def __call__(
        self, server_round: int, params: list[np.ndarray], keep_prob: float, server_lr: ServerLr | None
    ) -> RoundOutcome:
        arrays = self.transport.global_record(params)
        config = ConfigRecord({"keep-prob": keep_prob})
        messages = self.strategy.configure_train(server_round, arrays, config, self.grid)
        replies: list[Message] = []
        try:
            replies = self.transport.exchange(self.grid, messages, self.round_timeout)
            return self.strategy.round_outcome(server_round, replies, server_lr)
        finally:
            self.transport.end_round(replies)


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = RunConfig.from_mapping(context.run_config)
    refuse_local_engine_keys(cfg)
    transport = open_transport(cfg, grid)
    try:
        # A simulation's server reads the training set (the probe batch of the measurements); a
        # deployment's server has none.
        simulation = isinstance(grid, InMemoryGrid)
        rounds = FlowerRounds(cfg, grid, transport, simulation)
        run_rounds(cfg, ENGINE, rounds, server_has_training_data=simulation)
    finally:
        transport.close()
