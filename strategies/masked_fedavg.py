"""MaskedFedAvg: Flower's Message-API FedAvg with seeded cohorts over partition ids, block-masked
updates and the paper's statistics every round.

Message layout
- train (server -> client): "arrays" ArrayRecord θ (keys "0".."B-1", parameter order) and
  "config" ConfigRecord {"server-round", and "mask-seed" in synchronized mode}.
- train reply: "update" ArrayRecord Δ_k = θ − θ_k, unmasked, same keys; "metrics" MetricRecord
  {"num-examples", "train-loss", "partition-id"}; with masking on, "mask" ConfigRecord {"keep":
  list[bool], one m^(b) per block}. The server applies (m^(b)/p) when it averages and computes
  the statistics on the unmasked Δ_k.
- query (once per run): the reply's "node" ConfigRecord {"partition-id"} maps partitions to nodes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from clients.seeds import synchronized_mask_seed
from fedmask_app.engines.flower.fast.buffers import record_from_arrays, record_views
from fedmask_app.run.config import RunConfig
from strategies.aggregate import ClientReply
from strategies.cohort import sample_cohort
from strategies.round import RoundOutcome, finish_round

log = logging.getLogger("fedmask")


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
    """FedAvg whose cohorts, masks and statistics follow PAPER.md (see the module docstring)."""

    def __init__(self, cfg: RunConfig):
        super().__init__(
            fraction_train=cfg.clients_per_round / cfg.num_clients,
            fraction_evaluate=0.0,  # the global model is evaluated on the server
            min_train_nodes=cfg.clients_per_round,
            min_available_nodes=cfg.num_clients,
        )
        self.cfg = cfg
        self.node_of_partition: dict[int, int] = {}
        self._round_arrays: ArrayRecord | None = None
        self._round_cohort: dict[int, int] = {}  # node id -> partition id of this round's cohort
        self.last_outcome: RoundOutcome | None = None

    def discover_partitions(self, grid: Grid) -> dict[int, int]:
        """Ask every node once for its partition id; wait up to round-timeout for num-clients nodes."""
        deadline = time.monotonic() + self.cfg.round_timeout
        node_ids = list(grid.get_node_ids())
        while len(node_ids) < self.cfg.num_clients and time.monotonic() < deadline:
            time.sleep(1.0)
            node_ids = list(grid.get_node_ids())
        if len(node_ids) < self.cfg.num_clients:
            raise FederationError(
                f"run-config num-clients = {self.cfg.num_clients} but only {len(node_ids)} nodes connected: "
                f"in simulation pass --federation-config \"num-supernodes={self.cfg.num_clients}\""
            )
        queries = [
            Message(content=RecordDict({"config": ConfigRecord()}), dst_node_id=n, message_type=MessageType.QUERY)
            for n in node_ids
        ]
        mapping: dict[int, int] = {}
        for reply in grid.send_and_receive(queries, timeout=self.cfg.round_timeout):
            if reply.has_error():
                log.warning("node %d did not say its partition: %s", reply.metadata.src_node_id, reply.error.reason)
                continue
            mapping.setdefault(int(reply.content["node"]["partition-id"]), reply.metadata.src_node_id)
        expected = set(range(self.cfg.num_clients))
        if set(mapping) != expected:
            raise FederationError(
                f"nodes report partitions {sorted(mapping)[:20]}..., expected each of 0..{self.cfg.num_clients - 1} "
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
            self.cfg.seed, server_round, list(self.node_of_partition), self.cfg.clients_per_round
        )
        config["server-round"] = server_round
        if self.cfg.mask_mode == "synchronized":
            config["mask-seed"] = synchronized_mask_seed(self.cfg.seed, server_round)
        self._round_arrays = arrays
        self._round_cohort = {self.node_of_partition[pid]: pid for pid in cohort}
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return self._construct_messages(record, list(self._round_cohort), MessageType.TRAIN)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Leave out failed or malformed replies, then θ ← θ − Σ w_k Δ̃_k and the statistics."""
        if self._round_arrays is None:
            raise RuntimeError("aggregate_train called before configure_train")
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
                failures.append(f"partition {pid}: no reply within round-timeout ({self.cfg.round_timeout:g}s)")
        global_params = record_views(self._round_arrays)
        outcome = finish_round(
            server_round, global_params, good, failures,
            aggregation=self.cfg.aggregation, keep_prob=self.cfg.keep_prob, min_clients=self.cfg.min_clients,
        )
        self.last_outcome = outcome
        metrics = MetricRecord({
            **{k: float(v) for k, v in outcome.result.stats.items()},
            "train-loss": outcome.result.train_loss,
            "num-examples": outcome.result.num_examples,
            "num-failures": outcome.num_failures,
        })
        return record_from_arrays(outcome.result.params), metrics
