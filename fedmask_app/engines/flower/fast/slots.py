"""Shared-memory slots that the clients of a Ray simulation write their updates into.

Through Ray, a ResNet-18 reply (45 MB) takes 20–30 ms from the actor's return to the server on
the 2-core machine (Ray copies it into its object store, then the server maps it), and Flower's
Ray backend gives that actor its next message only afterwards: 4 such waits a round per actor.
Instead the server lends every train message a slot, a shared-memory segment laid out like
``NpyBlocks``; the client writes Δ_k there, and its reply's ArrayRecord crosses Ray as the slot's
name (``ray_transport``). The server reads Δ_k in place.

A slot is lent to one message from push until the round is aggregated. When its message got a
reply, the client has finished writing and the slot is lent again next round; when it got none
(timed out: the client may still write), the slot is retired and never lent again.
Deployments (gRPC) never see a slot: only the in-process simulation grid lends them.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import sys
from collections.abc import Iterable, Sequence
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict

from fedmask_app.engines.flower.fast.buffers import NpyBlocks, npy_nbytes

log = logging.getLogger("fedmask")

SLOT_KEY = "reply-slot"  # train config key: the name of the segment to write Δ_k into
SLOT_NAME = re.compile(r"fm(\d+)-[0-9a-f]{6}-\d+")  # fm<server pid>-<random>-<n>: short, macOS allows 31 chars

_segments: dict[str, shared_memory.SharedMemory] = {}  # the segments this process created or attached
MADV_POPULATE_WRITE = 23  # Linux >= 5.14; Python 3.11's mmap module does not name it


def _populate(memory: shared_memory.SharedMemory) -> None:
    """Map (and allocate) every page now, in one call: on the 2-core development machine, writing a
    new 45 MB segment page by page took about 100 ms of page faults, populating it about 25 ms.
    Best effort."""
    if sys.platform == "linux":
        try:
            memory._mmap.madvise(MADV_POPULATE_WRITE)
        except (AttributeError, OSError):  # an older kernel, or another SharedMemory layout
            pass


def segment(name: str) -> shared_memory.SharedMemory:
    """The named segment, attached once per process (or the one this process created)."""
    attached = _segments.get(name)
    if attached is None:
        attached = shared_memory.SharedMemory(name=name)
        # Python < 3.13 registers an attached POSIX segment with this process's resource
        # tracker, which would unlink it when this process exits, from under the server.
        if os.name == "posix":
            resource_tracker.unregister(attached._name, "shared_memory")
        _populate(attached)
        _segments[name] = attached
    return attached


def slot_blocks(name: str, like: Sequence[np.ndarray]) -> NpyBlocks:
    """Client side: ``NpyBlocks`` shaped like ``like`` over the named slot."""
    return NpyBlocks(like, buffer=segment(name).buf)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_slots(shm: Path = Path("/dev/shm")) -> int:
    """Unlink the slots of servers that no longer run. A server unlinks its slots when it ends,
    and its resource tracker does when it dies; both gone at once (SIGKILL to the whole process
    group) leaves them behind."""
    if not shm.is_dir():
        return 0
    stale = [p for p in shm.iterdir() if (m := SLOT_NAME.fullmatch(p.name)) and not _alive(int(m[1]))]
    for path in stale:
        path.unlink(missing_ok=True)
    return len(stale)


class ReplySlots:
    """Server side: lends each train message a slot and takes the slots back after the round."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self._prefix = f"fm{os.getpid()}-{secrets.token_hex(3)}-"
        self._free: list[str] = []
        self._lent: dict[int, str] = {}  # destination node id -> slot
        self._owned: list[str] = []
        self._created = 0

    @classmethod
    def for_model(cls, params: Sequence[np.ndarray], slots_needed: int) -> ReplySlots | None:
        """Slots sized for ``params``, or None when shared memory cannot hold ``slots_needed``
        of them with room to spare (a small /dev/shm, as in Docker's default 64 MB)."""
        removed = remove_stale_slots()
        if removed:
            log.warning("removed %d reply slots left in /dev/shm by a server that was killed", removed)
        nbytes = npy_nbytes([np.asarray(p) for p in params])
        if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free < 1.5 * slots_needed * nbytes:
            log.warning("/dev/shm has no room for %d replies of %d MiB: replies travel through Ray's object "
                        "store instead", slots_needed, nbytes >> 20)
            return None
        return cls(nbytes)

    def _new_slot(self) -> str:
        name = f"{self._prefix}{self._created}"
        self._created += 1
        created = shared_memory.SharedMemory(name=name, create=True, size=self.nbytes)
        _populate(created)
        _segments[name] = created
        self._owned.append(name)
        return name

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
        slot = _segments.pop(name)
        try:
            slot.close()
        except BufferError:  # a view of it is still alive somewhere; the mapping goes with the process
            pass
        try:
            slot.unlink()
        except FileNotFoundError:  # removed from outside (e.g. /dev/shm cleaned by hand)
            pass
        self._owned.remove(name)

    def close(self) -> None:
        """Unlink every slot (a client still holding one keeps its mapping until it exits)."""
        for name in list(self._owned):
            self._release(name)
        self._free.clear()
        self._lent.clear()
