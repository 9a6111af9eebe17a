"""MaskedFedAvg: Flower's Message-API FedAvg with seeded cohorts over partition ids, masked
updates and the paper's statistics every round; and the message layout it reads and writes.

Message layout
- train (server -> client): "arrays" ArrayRecord θ (keys "0".."B-1", parameter order) and
  "config" ConfigRecord {"server-round", "keep-prob" (this round's p), and "mask-seed" in
  synchronized mode}.
- train reply: "update" ArrayRecord Δ_k = θ − θ_k, unmasked, same keys; "metrics" MetricRecord
  {"num-examples", "train-loss", "partition-id"}; with per-tensor masks, "mask" ConfigRecord
  {"keep": list[bool], one m^(b) per tensor}. Coordinate masks are not sent: the server
  regenerates each client's from its mask seed (``clients.masking.coordinate_mask_seeds``). The
  server applies (m/p) when it averages and computes the statistics on the unmasked Δ_k.
- query (once per run): the reply's "node" ConfigRecord {"partition-id"} maps partitions to nodes.

Arrays are Flower's own .npy layout (``stype = "numpy.ndarray"``), so any Flower code reads these
records with ``Array.numpy()``; ``record_from_arrays`` writes each array with one copy and
``record_views`` reads them in place (``ArrayRecord.from_numpy_ndarrays``/``to_numpy_ndarrays``
copy twice and once more).

This is the one module of strategies/ that imports flwr; its settings come in as plain values.
"""

from __future__ import annotations

import functools
import io
import logging
import math
import time
from collections.abc import Iterable, Sequence

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from numpy.lib import format as npy

from clients.masking import coordinate_mask_seeds
from clients.seeds import synchronized_mask_seed
from strategies.aggregate import ClientReply, ServerLr
from strategies.cohort import sample_cohort
from strategies.round import RoundOutcome, finish_round

log = logging.getLogger("fedmask")


def npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """The .npy 1.0 header of a C-ordered array."""
    header = io.BytesIO()
    npy.write_array_header_1_0(header, {"descr": npy.dtype_to_descr(dtype), "fortran_order": False, "shape": shape})
    return header.getvalue()


def array_from_numpy(value: np.ndarray) -> Array:
    """An Array holding ``value`` as .npy bytes, copied once into their final place."""
    value = np.asarray(value)
    if not value.flags.c_contiguous:
        value = value.copy(order="C")
    data = b"".join((npy_header(value.dtype, value.shape), value.reshape(-1).view(np.uint8)))
    return Array(dtype=str(value.dtype), shape=tuple(value.shape), stype="numpy.ndarray", data=data)


def record_from_arrays(arrays: Sequence[np.ndarray]) -> ArrayRecord:
    """Keys "0".."B-1" in order, as ``ArrayRecord.from_numpy_ndarrays`` names them."""
    return ArrayRecord({str(i): array_from_numpy(a) for i, a in enumerate(arrays)})


@functools.lru_cache(maxsize=1024)
def _parse_header(header: bytes) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, fortran_order, dtype) of an .npy header; a model's headers repeat every round."""
    stream = io.BytesIO(header)
    version = npy.read_magic(stream)
    read_header = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
    return read_header(stream)


def array_view(array: Array) -> np.ndarray:
    """An ndarray over the Array's .npy bytes, without copying them (read-only over bytes)."""
    if array.stype != "numpy.ndarray":
        raise TypeError(f"array of stype {array.stype!r}, expected 'numpy.ndarray'")
    data = array.data
    version = data[6:8]
    if data[:6] != npy.MAGIC_PREFIX or version not in (b"\x01\x00", b"\x02\x00"):
        return array.numpy()  # not .npy 1.0/2.0 (3.0 only differs for non-ASCII field names)
    if version == b"\x01\x00":
        offset = 10 + int.from_bytes(data[8:10], "little")
    else:
        offset = 12 + int.from_bytes(data[8:12], "little")
    shape, fortran_order, dtype = _parse_header(bytes(data[:offset]))
    if dtype.hasobject:
        raise TypeError("array holds Python objects, which are never unpickled")
    flat = np.frombuffer(data, dtype=dtype, count=math.prod(shape), offset=offset)
    return flat.reshape(shape, order="F" if fortran_order else "C")


def record_views(record: ArrayRecord) -> list[np.ndarray]:
    """The record's arrays in key order, read-only views over its bytes (see ``array_view``)."""
    return [array_view(a) for a in record.values()]


class FederationError(RuntimeError):
    """The federation does not match the run configuration."""


def reply_from_message(content: RecordDict) -> ClientReply:
    metrics = content["metrics"]
    mask = content["mask"]["keep"] if "mask" in content else None
    return ClientReply(
        partition_id=int(metrics["partition-id"]),
        num_examples=int(metrics["num-examples"]),
        train_loss=float(metrics["train-loss"]),
        update=record_views(content["update"]),
        keep=None if mask is None else [bool(m) for m in mask],
    )


def message_from_reply(reply: ClientReply, update: ArrayRecord | None = None) -> RecordDict:
    """The reply's content; ``update`` is Δ_k's record when the caller already has one."""
    content = RecordDict({
        "update": record_from_arrays(reply.update) if update is None else update,
        "metrics": MetricRecord({
            "num-examples": reply.num_examples,
            "train-loss": reply.train_loss,
            "partition-id": reply.partition_id,
        }),
    })
    if reply.keep is not None:
        content["mask"] = ConfigRecord({"keep": list(reply.keep)})
    return content


class MaskedFedAvg(FedAvg):
    """FedAvg whose cohorts, masks and statistics follow PAPER.md (see the module docstring).

    ``round_outcome`` is the round's result as a value (the ServerApp's loop uses it);
    ``aggregate_train`` is the same step behind Flower's Strategy interface.
    """

    def __init__(
        self, *, seed: int, num_clients: int, clients_per_round: int, mask_mode: str, keep_prob: float,
        aggregation: str, min_clients: int, round_timeout: float, node_wait: float | None = None,
        mask_granularity: str = "tensor",
    ):
        """``node_wait``: how long to wait for ``num_clients`` nodes to connect (default
        ``round_timeout``: a deployment's SuperNodes join over time; a simulation's are all there
        at once, so its ServerApp passes a few seconds)."""
        super().__init__(
            fraction_train=clients_per_round / num_clients,
            fraction_evaluate=0.0,  # the global model is evaluated on the server
            min_train_nodes=clients_per_round,
            min_available_nodes=num_clients,
        )
        self.seed = seed
        self.num_clients = num_clients
        self.clients_per_round = clients_per_round
        self.mask_mode = mask_mode
        self.mask_granularity = mask_granularity
        self.keep_prob = keep_prob
        self.aggregation = aggregation
        self.min_clients = min_clients
        self.round_timeout = round_timeout
        self.node_wait = round_timeout if node_wait is None else node_wait
        self.node_of_partition: dict[int, int] = {}
        self._round_arrays: ArrayRecord | None = None
        self._round_keep_prob = keep_prob
        self._round_cohort: dict[int, int] = {}  # node id -> partition id of this round's cohort

    def discover_partitions(self, grid: Grid) -> dict[int, int]:
        """Ask every node once for its partition id; wait up to ``node_wait`` for num-clients nodes."""
        deadline = time.monotonic() + self.node_wait
        node_ids = list(grid.get_node_ids())
        while len(node_ids) < self.num_clients and time.monotonic() < deadline:
            time.sleep(1.0)
            node_ids = list(grid.get_node_ids())
        if len(node_ids) < self.num_clients:
            raise FederationError(
                f"run-config num-clients = {self.num_clients} but only {len(node_ids)} nodes connected: "
                f"in simulation pass --federation-config \"num-supernodes={self.num_clients}\""
            )
        queries = [
            Message(content=RecordDict({"config": ConfigRecord()}), dst_node_id=n, message_type=MessageType.QUERY)
            for n in node_ids
        ]
        mapping: dict[int, int] = {}
        for reply in grid.send_and_receive(queries, timeout=self.round_timeout):
            if reply.has_error():
                log.warning("node %d did not say its partition: %s", reply.metadata.src_node_id, reply.error.reason)
                continue
            mapping.setdefault(int(reply.content["node"]["partition-id"]), reply.metadata.src_node_id)
        expected = set(range(self.num_clients))
        if set(mapping) != expected:
            raise FederationError(
                f"nodes report partitions {sorted(mapping)[:20]}..., expected each of 0..{self.num_clients - 1} "
                "once: check num-supernodes / each SuperNode's data-path"
            )
        self.node_of_partition = mapping
        return mapping

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        if not self.node_of_partition:
            self.discover_partitions(grid)
        cohort = sample_cohort(
            self.seed, server_round, list(self.node_of_partition), self.clients_per_round
        )
        config["server-round"] = server_round
        if self.mask_mode == "synchronized":
            config["mask-seed"] = synchronized_mask_seed(self.seed, server_round)
        self._round_arrays = arrays
        self._round_keep_prob = float(config.get("keep-prob", self.keep_prob))
        self._round_cohort = {self.node_of_partition[pid]: pid for pid in cohort}
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return [
            Message(content=record, dst_node_id=node, message_type=MessageType.TRAIN) for node in self._round_cohort
        ]

    def round_outcome(
        self, server_round: int, replies: Iterable[Message], server_lr: ServerLr | None = None
    ) -> RoundOutcome:
        """Leave out failed or malformed replies, then θ ← θ − η_g Σ w_k Δ̃_k (η_g = 1, or
        ``server_lr`` of the cohort's sums) and the statistics. Raises RoundFailed when fewer than
        ``min_clients`` good replies remain."""
        if self._round_arrays is None:
            raise RuntimeError("round_outcome called before configure_train")
        failures, good = [], []
        answered = set()
        for msg in replies:
            node = msg.metadata.src_node_id
            answered.add(node)
            pid = self._round_cohort.get(node, -1)
            if msg.has_error():
                failures.append(f"partition {pid}: client error: {msg.error.reason}")
                continue
            try:
                good.append(reply_from_message(msg.content))
            except (KeyError, TypeError, ValueError) as exc:
                failures.append(f"partition {pid}: malformed reply ({type(exc).__name__}: {exc})")
        for node, pid in self._round_cohort.items():
            if node not in answered:
                failures.append(f"partition {pid}: no reply within round-timeout ({self.round_timeout:g}s)")
        return finish_round(
            server_round, record_views(self._round_arrays), good, failures,
            aggregation=self.aggregation, keep_prob=self._round_keep_prob, min_clients=self.min_clients,
            server_lr=server_lr,
            coordinate_mask_seeds=coordinate_mask_seeds(
                self.mask_mode, self.mask_granularity, self.seed, server_round, sorted(self._round_cohort.values())
            ),
        )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Flower's Strategy interface to ``round_outcome``: the new θ and the round's metrics."""
        outcome = self.round_outcome(server_round, replies)
        metrics = MetricRecord({
            **{k: float(v) for k, v in outcome.result.stats.items()},
            "train-loss": outcome.result.train_loss,
            "num-examples": outcome.result.num_examples,
            "num-failures": outcome.num_failures,
        })
        return record_from_arrays(outcome.result.params), metrics
