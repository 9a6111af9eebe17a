"""Shared-memory slots that θ and the clients' updates cross a Ray simulation in.

Through Ray, a ResNet-18 record (45 MB) is copied into Ray's object store and mapped again on the
other side, for every message: 20–30 ms per reply on the 2-core machine, and Flower's Ray backend
hands that actor its next message only afterwards. Instead the server keeps shared-memory
segments laid out like ``NpyBlocks``:

- one θ slot, which it writes the round's global model into once; every train message's arrays
  then cross Ray as that slot's name, and clients read θ in place;
- one reply slot lent to each train message (its name in the config, ``SLOT_KEY``); the client
  writes Δ_k there and its reply crosses Ray as the slot's name. The server reads Δ_k in place.

A reply slot is lent from push until the round is aggregated. When its message got a reply, the
client has finished writing and the slot is lent again next round; when it got none (timed out:
the client may still write), the slot retires and is never lent again. A late client may still
read the θ slot while the next round's θ is written into it: its reply is dropped either way.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable, Sequence

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from fedmask_app.engines.flower.fast.buffers import NpyBlocks, npy_nbytes
from fedmask_app.run.shared_memory import SEGMENT_NAME as SLOT_NAME
from fedmask_app.run.shared_memory import (
    create_segment,
    release_segment,
    remove_stale_segments,
    segment,
    segment_prefix,
)

log = logging.getLogger("fedmask")

SLOT_KEY = "reply-slot"  # train config key: the name of the segment to write Δ_k into
__all__ = ["SLOT_KEY", "SLOT_NAME", "SharedSlots", "remove_stale_slots", "segment", "slot_blocks"]
remove_stale_slots = remove_stale_segments  # the slots of servers that no longer run


def slot_blocks(name: str, like: Sequence[np.ndarray]) -> NpyBlocks:
    """``NpyBlocks`` shaped like ``like`` over the named slot."""
    return NpyBlocks(like, buffer=segment(name).buf)


class SharedSlots:
    """Server side: the θ slot, and reply slots lent to each train message and taken back after
    the round."""

    def __init__(self, like: Sequence[np.ndarray]):
        self.like = [np.asarray(p) for p in like]
        self.nbytes = npy_nbytes(self.like)
        self._prefix = segment_prefix()
        self._free: list[str] = []
        self._lent: dict[int, str] = {}  # destination node id -> slot
        self._owned: list[str] = []
        self._created = 0
        self.theta_slot = self._new_slot("theta")
        self._theta = slot_blocks(self.theta_slot, self.like)

    @classmethod
    def for_model(cls, params: Sequence[np.ndarray], slots_needed: int) -> SharedSlots | None:
        """Slots sized for ``params``, or None when shared memory cannot hold θ and
        ``slots_needed`` replies with room to spare (a small /dev/shm, as in Docker's 64 MB)."""
        removed = remove_stale_slots()
        if removed:
            log.warning("removed %d reply slots left in /dev/shm by a server that was killed", removed)
        nbytes = npy_nbytes([np.asarray(p) for p in params])
        if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free < 1.5 * (slots_needed + 1) * nbytes:
            log.warning("/dev/shm has no room for θ and %d replies of %d MiB: records travel through Ray's "
                        "object store instead", slots_needed, nbytes >> 20)
            return None
        return cls(params)

    def _new_slot(self, suffix: str | None = None) -> str:
        if suffix is None:
            suffix = str(self._created)
            self._created += 1
        name = f"{self._prefix}{suffix}"
        create_segment(name, self.nbytes)
        self._owned.append(name)
        return name

    def theta_record(self, params: Sequence[np.ndarray]) -> tuple[ArrayRecord, list[tuple[int, int]]]:
        """θ written into the θ slot; the record over it and its blocks' places in the slot."""
        return self._theta.record_holding(params), self._theta.spans

    def lend(self, messages: Iterable[Message]) -> list[Message]:
        """The messages again, each config naming the slot its client writes Δ_k into."""
        if self._lent:
            raise RuntimeError("slots are still lent: call take_back after each round")
        lent = []
        for message in messages:
            name = self._free.pop() if self._free else self._new_slot()
            node = message.metadata.dst_node_id
            self._lent[node] = name
            content = RecordDict(dict(message.content.items()))
            content["config"] = ConfigRecord({**message.content["config"], SLOT_KEY: name})
            lent.append(Message(content=content, dst_node_id=node, message_type=message.metadata.message_type))
        return lent

    def take_back(self, replies: Iterable[Message]) -> None:
        """After the round's aggregation: answered slots are free again; the others retire."""
        answered = {reply.metadata.src_node_id for reply in replies}
        for node, name in self._lent.items():
            if node in answered:
                self._free.append(name)
            else:
                self._release(name)
        self._lent.clear()

    def _release(self, name: str) -> None:
        release_segment(name)
        self._owned.remove(name)

    def close(self) -> None:
        """Unlink every slot (a client still holding one keeps its mapping until it exits)."""
        self._theta = None
        for name in list(self._owned):
            self._release(name)
        self._free.clear()
        self._lent.clear()
