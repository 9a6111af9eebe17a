"""Flower ClientApp: one client's round through ``ClientTask`` (model and data cached per process).

Its partition comes from the node config: ``partition-id`` in simulation, or ``data-path`` (a
shard file written by ``fedmask-export-shards``) on a real device.
"""

from __future__ import annotations

import functools

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedmask_app.deploy.shards import check_shard_matches, load_shard_file
from fedmask_app.run.client_task import ClientTask, cached_client_task
from fedmask_app.run.config import RunConfig
from strategies.masked_fedavg import message_from_reply, record_views

app = ClientApp()


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


@app.query()
def query(msg: Message, context: Context) -> Message:
    _, partition_id, _ = _client(context)
    return Message(content=RecordDict({"node": ConfigRecord({"partition-id": partition_id})}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    cfg, partition_id, task = _client(context)
    config = msg.content["config"]
    sync_seed = int(config["mask-seed"]) if "mask-seed" in config else None
    params = record_views(msg.content["arrays"])
    # The reply path, chosen here: in a Ray simulation with fast-simulation on, Δ_k is written
    # straight into the slot the server lent (or reusable reply buffers); else a new record.
    buffers = None
    if cfg.fast_simulation:
        from fedmask_app.engines.flower.fast.transport import ReplyBuffers

        buffers = ReplyBuffers.in_ray(config, params)
    keep_prob = float(config["keep-prob"]) if "keep-prob" in config else None
    reply = task.train(partition_id, int(config["server-round"]), params, sync_seed, buffers and buffers.arrays,
                       keep_prob=keep_prob)
    update = buffers.record(reply.update) if buffers else None  # None: message_from_reply builds one
    return Message(content=message_from_reply(reply, update), reply_to=msg)
