"""The server's measurements beyond the paper's statistics, on a fixed probe batch: the curvature
of the round's updates (``curvature-every``) and the flatness of the global model
(``flatness-every``). The estimators are in fedmask_app/measure; this wires them to a run."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from clients.seeds import MEASUREMENT, PROBE, derive_seed
from clients.training import as_tensor
from fedmask_app.measure.curvature import measure_curvature
from fedmask_app.measure.flatness import measure_flatness
from fedmask_app.run.config import RunConfig
from fedmask_app.run.data import load_dataset, normalize, resolve_data_dir
from fedmask_app.run.device import compute_setup
from fedmask_app.run.model import build_model
from fedmask_app.run.schema import CURVATURE_COLUMNS, FLATNESS_COLUMNS
from strategies.aggregate import client_weights
from strategies.round import RoundOutcome

CURVATURE, FLATNESS = 0, 1  # tags of the measurements' per-round generators


class ProbeError(RuntimeError):
    """The probe batch cannot be had (a deployment's server without probe-file)."""


def probe_images(cfg: RunConfig, server_has_training_data: bool) -> tuple[np.ndarray, np.ndarray]:
    """``probe-size`` training images drawn once per run from the run seed (uint8 NHWC, labels),
    or the operator's ``probe-file`` (a deployment's server has no training data)."""
    if cfg.probe_file:
        with np.load(Path(cfg.probe_file).expanduser()) as probe:
            images, labels = probe["x"], probe["y"]
        shape = cfg.data.image_shape
        if images.ndim != 4 or images.shape[1:] != shape or len(images) != len(labels):
            raise ProbeError(f"probe-file {cfg.probe_file}: x must be (N, {', '.join(map(str, shape))}) and y (N,) "
                             f"for {cfg.data.title}, got "
                             f"{images.shape} and {labels.shape}")
        return images[: cfg.probe_size], labels[: cfg.probe_size]
    if not server_has_training_data:
        raise ProbeError("curvature-every / flatness-every need a probe batch, and a deployment's server has no "
                         "training data: give probe-file (an .npz with x and y, e.g. a few hundred training images)")
    data = load_dataset(resolve_data_dir(cfg.data_dir), cfg.dataset)
    rng = np.random.default_rng(derive_seed(cfg.seed, PROBE))
    chosen = np.sort(rng.choice(len(data.y_train), size=min(cfg.probe_size, len(data.y_train)), replace=False))
    return data.x_train[chosen], data.y_train[chosen]


class RoundMeasurements:
    """Called by the round loop after each round; returns the measurement columns (empty cells on
    rounds without a measurement)."""

    def __init__(self, cfg: RunConfig, server_has_training_data: bool = True):
        self.cfg = cfg
        self.enabled = bool(cfg.curvature_every or cfg.flatness_every)
        if not self.enabled:
            return
        self.device, self.dtype = compute_setup(cfg)
        self.model = build_model(cfg.model, cfg.skip_padding_taps, input_shape=cfg.data.input_shape).to(
            self.device, self.dtype)
        images, labels = probe_images(cfg, server_has_training_data)
        self.probe_x = normalize(images, cfg.data).to(self.device, self.dtype)
        self.probe_y = torch.from_numpy(np.asarray(labels, dtype=np.int64)).to(self.device)

    def _generator(self, purpose: int, server_round: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(
            derive_seed(self.cfg.seed, MEASUREMENT, purpose, server_round)
        )

    def _tensors(self, arrays: Sequence) -> list[torch.Tensor]:
        """numpy arrays or tensors (Δ_k left on a GPU by the local engine) on the measurement's device."""
        return [as_tensor(a).to(self.device, self.dtype) for a in arrays]

    def curvature_due(self, server_round: int) -> bool:
        every = self.cfg.curvature_every
        return every > 0 and server_round % every == 0 and server_round >= self.cfg.measure_from

    def flatness_due(self, server_round: int) -> bool:
        every = self.cfg.flatness_every
        if every == 0:
            return False
        last = server_round == self.cfg.num_rounds
        return last or (server_round % every == 0 and server_round >= self.cfg.measure_from)

    def __call__(self, server_round: int, theta: Sequence[np.ndarray], outcome: RoundOutcome) -> dict[str, object]:
        """``theta``: the global model the round started from; ``outcome``: its aggregated replies."""
        row: dict[str, object] = dict.fromkeys((*CURVATURE_COLUMNS, *FLATNESS_COLUMNS), "")
        if self.enabled and self.curvature_due(server_round):
            started = time.perf_counter()
            replies = outcome.replies
            weights = client_weights([r.num_examples for r in replies], self.cfg.aggregation)
            row.update(measure_curvature(
                self.model, self._tensors(theta), [self._tensors(r.update) for r in replies], weights,
                self.probe_x, self.probe_y, generator=self._generator(CURVATURE, server_round),
                keep_prob=self.cfg.keep_prob, probes=self.cfg.curvature_probes, draws=self.cfg.penalty_draws,
                granularity=self.cfg.mask_granularity,
            ))
            row["curvature_seconds"] = round(time.perf_counter() - started, 3)
        if self.enabled and self.flatness_due(server_round):
            started = time.perf_counter()
            row.update(measure_flatness(
                self.model, self._tensors(outcome.result.params), self.probe_x, self.probe_y,
                generator=self._generator(FLATNESS, server_round), probes=self.cfg.flatness_probes,
                tol=self.cfg.lanczos_tol, max_iter=self.cfg.lanczos_max_iter,
            ))
            row["flatness_seconds"] = round(time.perf_counter() - started, 3)
        return row
