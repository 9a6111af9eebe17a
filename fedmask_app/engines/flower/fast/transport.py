"""The speed-only transport of a Ray simulation, server side and client side.

Server: θ is written into a shared-memory slot once a round, each train message is lent a reply
slot, Flower's simulation runtime is woken right after the push, and replies are polled every
10 ms (InMemoryGrid sleeps 100 ms between polls, so the round's last reply waited 50 ms on average
to be noticed). Client: Δ_k is written straight into the lent slot, or else into reusable reply
buffers that Ray copies into its object store as the call returns.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable, Sequence

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid
from flwr.superlink.grid import InMemoryGrid

from fedmask_app.engines.flower.fast.buffers import NpyBlocks
from fedmask_app.engines.flower.fast.ray_transport import register_in_ray, send_from_slot
from fedmask_app.engines.flower.fast.slots import SLOT_KEY, SharedSlots, slot_blocks
from fedmask_app.engines.flower.fast.wakeup import wake_message_extractor
from strategies.masked_fedavg import record_from_arrays

log = logging.getLogger("fedmask")
POLL_SECONDS = 0.01


class FastServerTransport:
    """``PlainTransport``'s interface (server_app.py) over shared-memory slots; in-process
    simulation grids only (``applies_to``)."""

    def __init__(self, clients_per_round: int):
        self.clients_per_round = clients_per_round
        self.slots: SharedSlots | None = None
        self._slots_tried = False

    @staticmethod
    def applies_to(grid: Grid) -> bool:
        return isinstance(grid, InMemoryGrid)

    def global_record(self, params: Sequence[np.ndarray]) -> ArrayRecord:
        if register_in_ray() and not self._slots_tried:  # Ray may start after the first round began
            self._slots_tried = True
            self.slots = SharedSlots.for_model(params, self.clients_per_round)
            if self.slots is not None:
                print(f"[fedmask] θ and updates cross in shared-memory slots of {self.slots.nbytes >> 20} MiB")
        if self.slots is None:
            return record_from_arrays(params)
        record, spans = self.slots.theta_record(params)
        send_from_slot(record, self.slots.theta_slot, spans)
        return record

    def exchange(self, grid: Grid, messages: Iterable[Message], timeout: float) -> list[Message]:
        if self.slots is not None:
            messages = self.slots.lend(messages)
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
                time.sleep(POLL_SECONDS)
        return replies

    def end_round(self, replies: Sequence[Message]) -> None:
        """After aggregation, also when the round failed: answered slots are free, the rest retire."""
        if self.slots is not None:
            self.slots.take_back(replies)

    def close(self) -> None:
        if self.slots is not None:
            self.slots.close()


@functools.lru_cache(maxsize=2)
def _reply_buffers(like: tuple[tuple[tuple[int, ...], np.dtype], ...]) -> NpyBlocks:
    return NpyBlocks([np.empty(shape, dtype) for shape, dtype in like])


@functools.lru_cache(maxsize=64)
def _slot(slot: str, like: tuple[tuple[tuple[int, ...], np.dtype], ...]) -> NpyBlocks | None:
    try:
        return slot_blocks(slot, [np.empty(shape, dtype) for shape, dtype in like])
    except (OSError, ValueError) as exc:  # gone (retired), too small, or not this machine's memory
        log.warning("cannot write the update into shared-memory slot %s (%s): it crosses Ray instead", slot, exc)
        return None


class ReplyBuffers:
    """Client side: where Δ_k is written (``arrays``) and the reply record over it (``record``)."""

    def __init__(self, config: ConfigRecord, like: Sequence[np.ndarray]):
        shapes = tuple((tuple(p.shape), np.dtype(p.dtype)) for p in like)
        self.slot = str(config[SLOT_KEY]) if SLOT_KEY in config else None
        in_slot = _slot(self.slot, shapes) if self.slot else None
        self._in_slot = in_slot is not None
        self.blocks = in_slot if in_slot is not None else _reply_buffers(shapes)

    @classmethod
    def in_ray(cls, config: ConfigRecord, like: Sequence[np.ndarray]) -> ReplyBuffers | None:
        """Buffers for this reply when this process is a Ray worker, else None (plain path)."""
        return cls(config, like) if register_in_ray() else None

    @property
    def arrays(self) -> list[np.ndarray]:
        return self.blocks.arrays

    def record(self, update: Sequence[np.ndarray]) -> ArrayRecord | None:
        """The reply's record over the buffers, or None when ``update`` is not in them (a fault
        replaced arrays): then the caller sends its own record."""
        record = self.blocks.record_of(update)
        if record is not None and self._in_slot:
            send_from_slot(record, self.slot, self.blocks.spans)
        return record
