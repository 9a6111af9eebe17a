"""One client's round as both engines run it: its shard, its batch order and mask seeds, local training.

A ``ClientTask`` is built once per process (model, data set, partition) and reused for every
round and every partition that process serves; weights are loaded into the model in place.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import numpy as np
import torch

from clients.augment import crop_flip
from clients.cuda_graphs import CudaGraphCohortStep, CudaGraphStep
from clients.masking import client_block_mask
from clients.seeds import augment_seed, batch_order_seed
from clients.streams import StreamedClients
from clients.training import LocalResult, LocalTraining, as_array, as_tensor, local_update
from clients.vectorized import vectorized_local_updates
from fedmask_app.run.config import FaultInjection, RunConfig
from fedmask_app.run.data import DataSpec, load_dataset, normalize, resolve_data_dir
from fedmask_app.run.device import compute_setup
from fedmask_app.run.model import build_model
from fedmask_app.run.partition import dirichlet_partition, identical_shards
from strategies.aggregate import ClientReply


def normalized_black(spec: DataSpec) -> torch.Tensor:
    """The crops' padding: torchvision's RandomCrop pads the stored image with black (0) before it
    is normalised, so one value per channel."""
    return normalize(np.zeros((1, 1, 1, spec.image_shape[2]), np.uint8), spec).flatten()


class InjectedFault(RuntimeError):
    """A failure a test asked for through ``inject-fault``."""


def client_shards(cfg: RunConfig, labels: np.ndarray) -> list[np.ndarray]:
    """The K shards of this run (index arrays into the training set), each cut to its first
    ``max-shard-size`` samples when that is set."""
    make = identical_shards if cfg.identical_shards else dirichlet_partition
    shards = make(labels, cfg.num_clients, cfg.alpha, cfg.seed, cfg.min_partition_size)
    return [s[: cfg.max_shard_size] for s in shards] if cfg.max_shard_size else shards


def local_training(cfg: RunConfig) -> LocalTraining:
    return LocalTraining(epochs=cfg.local_epochs, batch_size=cfg.batch_size, lr=cfg.lr, momentum=cfg.momentum,
                         weight_decay=cfg.weight_decay, bf16=cfg.precision == "bf16")


def client_mask(cfg: RunConfig, server_round: int, partition_id: int, sync_seed: int | None, num_blocks: int,
                keep_prob: float | None = None):
    """The per-tensor mask this client draws and sends (at the round's ``keep_prob``, else the
    configured one), or None when masking is off or per coordinate (``client_block_mask``)."""
    if cfg.mask_granularity == "coordinate":
        return None  # the server regenerates coordinate masks (coordinate_mask_seeds)
    p = cfg.keep_prob if keep_prob is None else keep_prob
    return client_block_mask(cfg.mask_mode, p, num_blocks, cfg.seed, server_round, partition_id, sync_seed)


class ClientTask:
    """Model, data and shards of one process; ``train`` runs one client's round."""

    def __init__(self, cfg: RunConfig, shard_arrays: dict[int, tuple[np.ndarray, np.ndarray]] | None = None,
                 cache_shards: bool = True, resident: bool = False):
        """``cache_shards = False``: a shard is normalised anew for each round it trains (a client
        process, which would otherwise keep every shard it ever trained: ~600 MB at the paper's size).
        ``resident``: replies carry Δ_k as tensors on the device, which the server step reduces
        there (the local engine on a GPU: strategies/device_pass.py), instead of numpy arrays."""
        self.cfg = cfg
        self.cache_shards = cache_shards
        self.resident = resident
        self.device, self.dtype = compute_setup(cfg)
        self.model = build_model(cfg.model, cfg.skip_padding_taps, cfg.gemm_convs, cfg.data.input_shape).to(
            self.device, self.dtype)
        self.num_blocks = len(list(self.model.parameters()))
        self._given_shards = shard_arrays  # deployment: a device's own shard file
        self._shards: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # cuda-graphs: one captured step per process (per replica with client streams), reused by
        # every client (or cohort) it trains
        graphs, vectorize, streams = cfg.cuda_graphs, cfg.vectorize, cfg.client_streams > 1
        self._step = CudaGraphStep(self.model, local_training(cfg)) if graphs and not (vectorize or streams) else None
        self._cohort_step = CudaGraphCohortStep(self.model, local_training(cfg)) if graphs and vectorize else None
        self._streamed = (
            StreamedClients(self.model, local_training(cfg), cfg.client_streams,
                            (lambda replica: CudaGraphStep(replica, local_training(cfg))) if graphs else None)
            if streams else None
        )

    @functools.cached_property
    def _crop_fill(self) -> torch.Tensor:
        return normalized_black(self.cfg.data)

    @functools.cached_property
    def _partition(self) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
        data = load_dataset(resolve_data_dir(self.cfg.data_dir), self.cfg.dataset)
        return data.x_train, data.y_train, client_shards(self.cfg, data.y_train)

    def shard(self, partition_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalised images and labels of one client, on the device, cached."""
        if partition_id in self._shards:
            return self._shards[partition_id]
        if self._given_shards is not None:
            if partition_id not in self._given_shards:
                raise ValueError(f"this node has no shard for partition {partition_id}")
            images, labels = self._given_shards[partition_id]
        else:
            x_train, y_train, shards = self._partition
            if not 0 <= partition_id < len(shards):
                raise ValueError(f"partition id {partition_id} outside 0..{len(shards) - 1}")
            images, labels = x_train[shards[partition_id]], y_train[shards[partition_id]]
        shard = (
            normalize(images, self.cfg.data).to(self.device, self.dtype),
            torch.from_numpy(np.asarray(labels, dtype=np.int64)).to(self.device),
        )
        if self.cache_shards:
            self._shards[partition_id] = shard
        return shard

    def train(
        self, partition_id: int, server_round: int, global_params: list[np.ndarray], sync_seed: int | None,
        out: list[np.ndarray] | None = None, keep_prob: float | None = None,
    ) -> ClientReply:
        """One client's round; with ``out`` (arrays shaped like the parameters), Δ_k is written
        into them and the reply's update is that list."""
        fault = self.cfg.fault_for(partition_id, server_round)
        if fault:
            _raise_or_hang(fault, self.cfg.round_timeout)
        images, labels = self.shard(partition_id)
        generator = self._batch_order(server_round, partition_id)
        result = local_update(self.model, global_params, images, labels, local_training(self.cfg), generator, out,
                              self._step, self._augment(server_round, partition_id))
        update = _with_fault(fault, list(out) if out is not None else self._update(result.update))
        return self._reply(partition_id, server_round, sync_seed, keep_prob, result.num_examples, result.train_loss,
                           update)

    def train_cohort(
        self, partition_ids: list[int], server_round: int, global_params: list[np.ndarray], sync_seed: int | None,
        keep_prob: float | None = None,
    ) -> list[ClientReply]:
        """Every client of the cohort in one batched computation (``vectorize``): each reply is the
        one ``train`` gives, up to float rounding (clients/vectorized.py)."""
        shards, generators = self.cohort_inputs(partition_ids, server_round)
        results = vectorized_local_updates(self.model, global_params, shards, local_training(self.cfg), generators,
                                           step=self._cohort_step)
        return self.cohort_replies(partition_ids, server_round, sync_seed, keep_prob, results)

    def cohort_inputs(self, partition_ids: list[int], server_round: int
                      ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Generator]]:
        """The cohort's shards and batch-order generators, as the vectorised step takes them."""
        return ([self.shard(pid) for pid in partition_ids],
                [self._batch_order(server_round, pid) for pid in partition_ids])

    def cohort_replies(self, partition_ids: list[int], server_round: int, sync_seed: int | None,
                       keep_prob: float | None, results: list[LocalResult]) -> list[ClientReply]:
        """The cohort's replies from its clients' local results, in cohort order."""
        return [
            self._reply(pid, server_round, sync_seed, keep_prob, r.num_examples, r.train_loss, self._update(r.update))
            for pid, r in zip(partition_ids, results, strict=True)
        ]

    def train_streamed(
        self, partition_ids: list[int], server_round: int, global_params: list, sync_seed: int | None,
        keep_prob: float | None = None,
    ) -> tuple[list[ClientReply], list[str]]:
        """The cohort's clients side by side on ``client-streams`` CUDA streams (clients/streams.py):
        the replies ``train`` gives, in cohort order, and a line for each client that raised."""
        if self._streamed is None:
            raise ValueError("train_streamed needs client-streams > 1")
        trained, failures = [], []
        for pid in partition_ids:
            fault = self.cfg.fault_for(pid, server_round)
            try:
                if fault:
                    _raise_or_hang(fault, self.cfg.round_timeout)
            except InjectedFault as exc:  # left out, as one_by_one leaves out a client that raises
                failures.append(failure_line(pid, exc))
                continue
            trained.append(pid)
        shards = [self.shard(pid) for pid in trained]
        generators = [self._batch_order(server_round, pid) for pid in trained]
        results = self._streamed.local_updates(global_params, shards, generators) if trained else []
        replies = []
        for pid, r in zip(trained, results, strict=True):
            update = _with_fault(self.cfg.fault_for(pid, server_round), self._update(r.update))
            replies.append(self._reply(pid, server_round, sync_seed, keep_prob, r.num_examples, r.train_loss, update))
        return replies, failures

    def on_device(self, params: list[np.ndarray]) -> list[torch.Tensor]:
        """θ as tensors on this task's device, for every client of the round: copied there when it is
        on the host (θ_0, a resumed θ); the device pass leaves each new θ there."""
        return [as_tensor(p).to(self.device) for p in params]

    def _update(self, tensors: list[torch.Tensor]) -> list:
        return [t.detach() for t in tensors] if self.resident else [as_array(t) for t in tensors]

    def _stream_key(self, partition_id: int) -> int | None:
        """The partition id that keys a client's random streams; None in the identical-shards control,
        where every client draws the same batch order and augmentation."""
        return None if self.cfg.identical_shards else partition_id

    def _batch_order(self, server_round: int, partition_id: int) -> torch.Generator:
        seed = batch_order_seed(self.cfg.seed, server_round, self._stream_key(partition_id))
        return torch.Generator().manual_seed(seed)

    def _augment(self, server_round: int, partition_id: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """``augment = "crop-flip"``: the shard's crops and flips, drawn each epoch from a generator of
        this client and round (shared by every client in the identical-shards control); else None."""
        if self.cfg.augment == "none":
            return None
        seed = augment_seed(self.cfg.seed, server_round, self._stream_key(partition_id))
        generator = torch.Generator().manual_seed(seed)
        return functools.partial(crop_flip, generator=generator, fill=self._crop_fill)

    def _reply(self, partition_id: int, server_round: int, sync_seed: int | None, keep_prob: float | None,
               num_examples: int, train_loss: float, update: list[np.ndarray]) -> ClientReply:
        return ClientReply(
            partition_id=partition_id,
            num_examples=num_examples,
            train_loss=train_loss,
            update=update,
            keep=client_mask(self.cfg, server_round, partition_id, sync_seed, self.num_blocks, keep_prob),
        )


def failure_line(partition_id: int, exc: Exception) -> str:
    """How a round reports a client that raised: it is left out of the aggregate."""
    return f"partition {partition_id}: {type(exc).__name__}: {exc}"


def _with_fault(fault: FaultInjection | None, update: list) -> list:
    """``update``, or host copies of it corrupted as ``fault`` asks."""
    return _corrupt(fault, [as_array(block) for block in update]) if fault else update


def _raise_or_hang(fault: FaultInjection, round_timeout: float) -> None:
    if fault.kind == "raise":
        raise InjectedFault(f"injected failure in partition {fault.partition_id}, round {fault.server_round}")
    if fault.kind == "hang":
        time.sleep(2 * round_timeout)  # past the server's deadline, then the reply is ignored


def _corrupt(fault: FaultInjection, update: list[np.ndarray]) -> list[np.ndarray]:
    if fault.kind in ("nan", "inf"):
        update[0] = np.full_like(update[0], np.nan if fault.kind == "nan" else np.inf)
    elif fault.kind == "shape":
        update[0] = update[0].reshape(-1)[:-1]
    elif fault.kind == "dtype":
        update[0] = update[0].astype(np.float64)
    return update


@functools.lru_cache(maxsize=2)
def cached_client_task(cfg: RunConfig) -> ClientTask:
    """One ClientTask per process and run configuration."""
    return ClientTask(cfg)
