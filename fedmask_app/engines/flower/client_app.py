"""Flower ClientApp: one client's round through ``ClientTask`` (model and data cached per process).

Its partition comes from the node config: ``partition-id`` in simulation, or ``data-path`` (a
shard file written by ``fedmask-export-shards``) on a real device.
"""

from __future__ import annotations

import functools
import logging

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedmask_app.deploy.shards import check_shard_matches, load_shard_file
from fedmask_app.engines.flower.fast.buffers import NpyBlocks, record_views
from fedmask_app.engines.flower.fast.ray_transport import send_from_slot, use_shared_buffers
from fedmask_app.engines.flower.fast.slots import SLOT_KEY, slot_blocks
from fedmask_app.run.client_task import ClientTask, cached_client_task
from fedmask_app.run.config import RunConfig
from strategies.masked_fedavg import message_from_reply

app = ClientApp()
log = logging.getLogger("fedmask")


@functools.lru_cache(maxsize=4)
def _run_config(items: tuple) -> RunConfig:
    return RunConfig.from_mapping(dict(items))


@functools.lru_cache(maxsize=4)
def _device_task(cfg: RunConfig, data_path: str) -> tuple[int, ClientTask]:
    shard = load_shard_file(data_path)
    check_shard_matches(shard, cfg, data_path)
    return shard.partition_id, ClientTask(cfg, shard_arrays={shard.partition_id: (shard.images, shard.labels)})


def _client(context: Context) -> tuple[RunConfig, int, ClientTask]:
    cfg = _run_config(tuple(sorted(context.run_config.items())))
    node = context.node_config
    if "data-path" in node:
        partition_id, task = _device_task(cfg, str(node["data-path"]))
        return cfg, partition_id, task
    if "partition-id" not in node:
        raise ValueError("node config has neither data-path nor partition-id")
    if int(node.get("num-partitions", cfg.num_clients)) != cfg.num_clients:
        raise ValueError(
            f"the federation has {node['num-partitions']} partitions, run-config num-clients = {cfg.num_clients}"
        )
    return cfg, int(node["partition-id"]), cached_client_task(cfg)


def _parameters(task: ClientTask) -> list:
    return [p.detach().cpu().numpy() for p in task.model.parameters()]


@functools.lru_cache(maxsize=2)
def _reply_blocks(task: ClientTask) -> NpyBlocks:
    return NpyBlocks(_parameters(task))


@functools.lru_cache(maxsize=64)
def _slot_blocks(task: ClientTask, slot: str) -> NpyBlocks | None:
    try:
        return slot_blocks(slot, _parameters(task))
    except (OSError, ValueError) as exc:  # gone (retired) or too small: reply through Ray instead
        log.warning("cannot write the update into shared-memory slot %s (%s)", slot, exc)
        return None


@app.query()
def query(msg: Message, context: Context) -> Message:
    _, partition_id, _ = _client(context)
    return Message(content=RecordDict({"node": ConfigRecord({"partition-id": partition_id})}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    through_ray = use_shared_buffers(broadcast=False)
    _, partition_id, task = _client(context)
    config = msg.content["config"]
    sync_seed = int(config["mask-seed"]) if "mask-seed" in config else None
    params = record_views(msg.content["arrays"])
    # Through Ray, Δ_k is written straight into the slot the server lent this message (the reply
    # then names the slot), or else into this process's reply buffers, which Ray copies into its
    # object store as the call returns.
    slot = str(config[SLOT_KEY]) if through_ray and SLOT_KEY in config else None
    in_slot = _slot_blocks(task, slot) if slot else None
    blocks = in_slot or (_reply_blocks(task) if through_ray else None)
    reply = task.train(partition_id, int(config["server-round"]), params, sync_seed, blocks and blocks.arrays)
    update = blocks.record_of(reply.update) if blocks else None  # None when a fault replaced arrays
    if in_slot is not None and update is not None:
        send_from_slot(update, slot, in_slot.spans)
    return Message(content=message_from_reply(reply, update), reply_to=msg)
