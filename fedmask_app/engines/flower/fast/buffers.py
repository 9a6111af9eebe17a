"""Flower Arrays over buffers that are not bytes: shared memory, Ray's object store, reply buffers.

The bytes keep Flower's .npy layout (``strategies.masked_fedavg``), so any reader of the record
sees ordinary Arrays; only their ``data`` is a memoryview instead of a bytes copy. Such Arrays
only travel through Ray (``ray_transport``): gRPC insists on bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord

from strategies.masked_fedavg import npy_header


def array_over_buffer(dtype: str, shape: tuple[int, ...], stype: str, buffer) -> Array:
    """An Array whose ``data`` is a memoryview on ``buffer`` (.npy layout), not a bytes copy.

    Private part relied on: ``Array.__new__`` + ``__dict__`` (``Array()`` insists on bytes, which
    would cost a copy). tests/test_records.py::test_array_over_buffer_reads_as_flowers_array fails
    when a Flower upgrade changes Array's attributes.
    """
    array = Array.__new__(Array)
    array.__dict__.update(dtype=dtype, shape=tuple(shape), stype=stype, data=memoryview(buffer))
    return array


def record_over_buffers(arrays: Iterable[tuple[str, str, tuple[int, ...], str, Any]]) -> ArrayRecord:
    """An ArrayRecord of ``array_over_buffer`` Arrays from (key, dtype, shape, stype, buffer)."""
    record = ArrayRecord()  # item by item: ArrayRecord(dict) re-creates each Array, which needs bytes
    for key, dtype, shape, stype, buffer in arrays:
        record[key] = array_over_buffer(dtype, shape, stype, buffer)
    return record


NPY_ALIGN = 64  # every block starts on a 64-byte boundary (the .npy headers are 64-byte multiples)


def npy_spans(like: Sequence[np.ndarray]) -> list[tuple[int, int]]:
    """(start, stop) of each block's .npy bytes when the blocks are laid out one after another."""
    spans, stop = [], 0
    for value in like:
        start = -(-stop // NPY_ALIGN) * NPY_ALIGN
        stop = start + len(npy_header(value.dtype, value.shape)) + value.nbytes
        spans.append((start, stop))
    return spans


def npy_nbytes(like: Sequence[np.ndarray]) -> int:
    """Bytes that ``NpyBlocks(like)`` lays its blocks out in."""
    spans = npy_spans(like)
    return spans[-1][1] if spans else 0


class NpyBlocks:
    """One .npy-laid-out buffer per model block, for writing a record's arrays in place.

    The blocks lie one after another (``spans``) in ``buffer`` (any writable buffer of at least
    ``npy_nbytes(like)`` bytes, e.g. a shared-memory segment) or in a new one. ``arrays`` are
    writable views of the blocks' data parts; ``record_of(update)`` is an ArrayRecord over the
    blocks when ``update`` is exactly those views (no copy), else None. Such a record is valid
    until the blocks are next written.
    """

    def __init__(self, like: Sequence[np.ndarray], buffer=None):
        like = [np.asarray(value) for value in like]
        self.spans = npy_spans(like)
        size = npy_nbytes(like)
        if buffer is None:
            memory = np.empty(size, dtype=np.uint8)
        else:
            memory = np.frombuffer(buffer, dtype=np.uint8)
            if memory.size < size:
                raise ValueError(f"the buffer holds {memory.size} bytes, the blocks need {size}")
        self._buffers: list[np.ndarray] = []
        self.arrays: list[np.ndarray] = []
        for value, (start, stop) in zip(like, self.spans, strict=True):
            header = npy_header(value.dtype, value.shape)
            block = memory[start:stop]
            block[: len(header)] = np.frombuffer(header, dtype=np.uint8)
            self._buffers.append(block)
            self.arrays.append(block[len(header) :].view(value.dtype).reshape(value.shape))

    def record_of(self, update: Sequence[np.ndarray]) -> ArrayRecord | None:
        if len(update) != len(self.arrays) or any(u is not a for u, a in zip(update, self.arrays, strict=True)):
            return None
        return record_over_buffers(
            (str(i), str(a.dtype), a.shape, "numpy.ndarray", buffer)
            for i, (a, buffer) in enumerate(zip(self.arrays, self._buffers, strict=True))
        )

    def record_holding(self, values: Sequence[np.ndarray]) -> ArrayRecord:
        """Copy ``values`` into the blocks and return the record over them."""
        for target, value in zip(self.arrays, values, strict=True):
            np.copyto(target, value)
        record = self.record_of(self.arrays)
        assert record is not None
        return record
