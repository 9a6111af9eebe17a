"""The server's evaluation of the global model on the test set."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from clients.training import load_parameters
from fedmask_app.run.config import RunConfig
from fedmask_app.run.data import load_dataset, normalize, resolve_data_dir
from fedmask_app.run.device import compute_setup
from fedmask_app.run.model import build_model


class Evaluator:
    """Test-set loss and accuracy of a global model (the first ``test-subset`` images, or all)."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.device, self.dtype = compute_setup(cfg)
        self.model = build_model(cfg.model, cfg.skip_padding_taps, input_shape=cfg.data.input_shape).to(
            self.device, self.dtype)
        data = load_dataset(resolve_data_dir(cfg.data_dir), cfg.dataset)
        n = cfg.test_subset or len(data.y_test)
        self.images = normalize(data.x_test[:n], cfg.data).to(self.device, self.dtype)
        self.labels = torch.from_numpy(data.y_test[:n]).to(self.device)

    def due(self, server_round: int) -> bool:
        return evaluation_due(server_round, self.cfg.num_rounds, self.cfg.eval_every, self.cfg.eval_from)

    @torch.no_grad()
    def __call__(self, params: list[np.ndarray]) -> tuple[float, float]:
        """(test loss, test accuracy). The sums stay on the device until the end (one wait for a GPU,
        not two a batch); the loss adds each batch's sum in float64, in batch order."""
        load_parameters(self.model, params)
        self.model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        correct = torch.zeros((), dtype=torch.int64, device=self.device)
        for start in range(0, len(self.labels), self.cfg.eval_batch_size):
            x = self.images[start : start + self.cfg.eval_batch_size]
            y = self.labels[start : start + self.cfg.eval_batch_size]
            logits = self.model(x)
            loss_sum += nn.functional.cross_entropy(logits, y, reduction="sum").double()
            correct += (logits.argmax(1) == y).sum()
        n = len(self.labels)
        loss = loss_sum.item() / n
        return (loss if math.isfinite(loss) else float("nan")), correct.item() / n


def evaluation_due(server_round: int, num_rounds: int, every: int, first: int) -> bool:
    """Whether round ``server_round`` of ``num_rounds`` evaluates: every ``every``-th round from round
    ``first`` on, and the last round (``every`` = 0: never). The paper reports test accuracy as a
    median over rounds 151–200: ``first = 151`` evaluates just those (with ``every = 1``)."""
    return every > 0 and (server_round == num_rounds or (server_round % every == 0 and server_round >= first))
