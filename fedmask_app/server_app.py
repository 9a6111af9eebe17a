"""Flower ServerApp: the shared round loop, with rounds carried out by MaskedFedAvg over Messages."""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp

from fedmask_app.config import RunConfig
from fedmask_app.run_loop import run_rounds
from strategies.masked_fedavg import MaskedFedAvg
from strategies.round import RoundOutcome

ENGINE = "flower"

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = RunConfig.from_mapping(context.run_config)
    strategy = MaskedFedAvg(cfg)
    arrays: ArrayRecord | None = None

    def train_round(server_round: int, params: list[np.ndarray]) -> RoundOutcome:
        nonlocal arrays
        if arrays is None:  # first round of this process (fresh or resumed)
            arrays = ArrayRecord.from_numpy_ndarrays(params)
        messages = strategy.configure_train(server_round, arrays, ConfigRecord(), grid)
        replies = grid.send_and_receive(messages, timeout=cfg.round_timeout)
        arrays, _ = strategy.aggregate_train(server_round, replies)
        return strategy.last_outcome

    run_rounds(cfg, ENGINE, train_round)
