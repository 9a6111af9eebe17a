"""Flower ArrayRecords between Ray processes as shared buffers, not bytes inside a pickle.

Flower's Ray backend hands each Message to a ClientApp actor (and the reply back) through Ray,
which pickles it: every ``Array``'s bytes would be copied into the pickle stream, the stream
into Ray's object store, and out again on the other side, for every message. With
``ray.util.register_serializer`` the bytes travel as NumPy buffers instead: Ray writes them to
its shared-memory object store once and the reader's Arrays read them in place. On the server,
the global model that a round sends to every client is put in the store once per round
(``broadcast=True``), not once per message. A client's update written in a slot lent by the
server (``reply_slots``) crosses as the slot's name and its blocks' places in it. Real deployments
(gRPC) are untouched: nothing here runs outside a Ray process.
"""

from __future__ import annotations

import logging
import sys
import weakref

import numpy as np
from flwr.app import ArrayRecord

from fedmask_app.engines.flower.fast.buffers import record_over_buffers
from fedmask_app.engines.flower.fast.slots import segment

log = logging.getLogger("fedmask")
_registered = False
_last_broadcast: tuple[weakref.ref, object] | None = None  # (record, ObjectRef of its buffers)
_in_slot: tuple[weakref.ref, str, list[tuple[int, int]]] | None = None  # (record, slot, its blocks' spans)


def _buffers(record: ArrayRecord) -> list[tuple]:
    return [(key, a.dtype, a.shape, a.stype, np.frombuffer(a.data, dtype=np.uint8)) for key, a in record.items()]


def _record_from_payload(payload: tuple) -> ArrayRecord:
    """Arrays over Ray's read-only buffers (or a slot's), not copies of them."""
    kind, content = payload
    if kind == "slot":
        name, arrays = content
        try:
            memory = segment(name).buf
        except FileNotFoundError:  # retired: the reply came after its round gave up on it
            log.warning("reply slot %s is gone (its message timed out); the reply has no update", name)
            return ArrayRecord()
        return record_over_buffers(
            (key, dtype, shape, stype, memory[start:stop].toreadonly())
            for key, dtype, shape, stype, (start, stop) in arrays
        )
    if kind == "shared":
        import ray

        content = ray.get(content)
    return record_over_buffers(content)


def send_from_slot(record: ArrayRecord, slot: str, spans: list[tuple[int, int]]) -> None:
    """Mark ``record`` (the next reply's arrays, over ``slot`` at ``spans``) to cross as the slot's name."""
    global _in_slot
    _in_slot = (weakref.ref(record), slot, spans)


def _inline_payload(record: ArrayRecord) -> tuple:
    if _in_slot is not None and _in_slot[0]() is record:
        _, slot, spans = _in_slot
        arrays = [(key, a.dtype, a.shape, a.stype, span) for (key, a), span in zip(record.items(), spans, strict=True)]
        return "slot", (slot, arrays)
    return "inline", _buffers(record)


def _broadcast_payload(record: ArrayRecord) -> tuple:
    """The record's buffers put in the object store once, however many messages carry it.
    A record must not change after it was sent (ours never do: each round builds a new one)."""
    global _last_broadcast
    if _last_broadcast is None or _last_broadcast[0]() is not record:
        import ray

        _last_broadcast = (weakref.ref(record), ray.put(_buffers(record)))
    return "shared", _last_broadcast[1]


def use_shared_buffers(broadcast: bool) -> bool:
    """Register the serializer in this process when it is a connected Ray driver or worker;
    return whether it is registered. Cheap to call every round."""
    global _registered
    if not _registered and "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            serializer = _broadcast_payload if broadcast else _inline_payload
            ray.util.register_serializer(ArrayRecord, serializer=serializer, deserializer=_record_from_payload)
            _registered = True
    return _registered
