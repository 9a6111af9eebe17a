"""Flower ArrayRecords between Ray processes as shared buffers, not bytes inside a pickle.

Flower's Ray backend hands each Message to a ClientApp actor (and the reply back) through Ray,
which pickles it: every ``Array``'s bytes would be copied into the pickle stream, the stream into
Ray's object store, and out again on the other side. With ``ray.util.register_serializer``
(public Ray API) a record crosses as one of two payloads:

- "slot": a record laid out in a shared-memory slot (``slots``: θ, or a client's Δ_k) crosses
  as the slot's name and its blocks' places; the reader's Arrays are views on the slot.
- "inline": any other record crosses as NumPy buffers, which Ray's pickle-5 path moves without
  copying them into the stream; the reader's Arrays are views on Ray's copy.

No payload holds an ObjectRef: ``ray.put`` inside a custom serializer leaves the object pinned in
the driver for good (measured: one 45 MB object a put, never freed; the leak of ~85 MB a round
that the θ broadcast once caused). Real deployments (gRPC) are untouched: nothing here runs
outside a Ray process.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref

import numpy as np
from flwr.app import ArrayRecord

from fedmask_app.engines.flower.fast.buffers import record_over_buffers
from fedmask_app.engines.flower.fast.slots import segment

log = logging.getLogger("fedmask")
_registered = False
_lock = threading.Lock()
# id(record) -> (record, slot, its blocks' spans): records that lie in a slot and cross as its name
_in_slot: dict[int, tuple[weakref.ref, str, list[tuple[int, int]]]] = {}


def send_from_slot(record: ArrayRecord, slot: str, spans: list[tuple[int, int]]) -> None:
    """Mark ``record`` (laid out over ``slot`` at ``spans``) to cross Ray as the slot's name."""
    key = id(record)
    with _lock:
        _in_slot[key] = (weakref.ref(record, lambda _: _in_slot.pop(key, None)), slot, spans)


def _payload(record: ArrayRecord) -> tuple:
    entry = _in_slot.get(id(record))
    if entry is not None and entry[0]() is record:
        _, slot, spans = entry
        arrays = [(key, a.dtype, a.shape, a.stype, span) for (key, a), span in zip(record.items(), spans, strict=True)]
        return "slot", (slot, arrays)
    return "inline", [
        (key, a.dtype, a.shape, a.stype, np.frombuffer(a.data, dtype=np.uint8)) for key, a in record.items()
    ]


def _record_from_payload(payload: tuple) -> ArrayRecord:
    """Arrays over the slot's buffer or Ray's read-only buffers, not copies of them."""
    kind, content = payload
    if kind == "slot":
        name, arrays = content
        try:
            memory = segment(name).buf
        except FileNotFoundError:  # retired: the reply came after its round gave up on it
            log.warning("slot %s is gone (its message timed out); the record arrives empty", name)
            return ArrayRecord()
        return record_over_buffers(
            (key, dtype, shape, stype, memory[start:stop].toreadonly())
            for key, dtype, shape, stype, (start, stop) in arrays
        )
    return record_over_buffers(content)


def register_in_ray() -> bool:
    """Register the serializer in this process when it is a connected Ray driver or worker;
    return whether it is registered. Cheap to call every round (Flower's simulation may start
    Ray after the ServerApp's first round began)."""
    global _registered
    if not _registered and "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.util.register_serializer(ArrayRecord, serializer=_payload, deserializer=_record_from_payload)
            _registered = True
    return _registered
