"""Model arrays to and from Flower ArrayRecords with one copy each way at most.

The bytes are Flower's own layout (an .npy file per array, ``stype = "numpy.ndarray"``), so any
Flower code reads these records with ``Array.numpy()``; we just skip its extra copies:
``ArrayRecord.from_numpy_ndarrays`` writes through a growing BytesIO and ``to_numpy_ndarrays``
copies every array out of its bytes, where ``record_views`` reads them in place.
"""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord
from numpy.lib import format as npy


def _npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """The .npy 1.0 header of a C-ordered array."""
    header = io.BytesIO()
    npy.write_array_header_1_0(header, {"descr": npy.dtype_to_descr(dtype), "fortran_order": False, "shape": shape})
    return header.getvalue()


def array_from_numpy(value: np.ndarray) -> Array:
    """An Array holding ``value`` as .npy bytes, copied once into their final place."""
    value = np.asarray(value)
    if not value.flags.c_contiguous:
        value = value.copy(order="C")
    data = b"".join((_npy_header(value.dtype, value.shape), value.reshape(-1).view(np.uint8)))
    return Array(dtype=str(value.dtype), shape=tuple(value.shape), stype="numpy.ndarray", data=data)


def array_over_buffer(dtype: str, shape: tuple[int, ...], stype: str, buffer) -> Array:
    """An Array whose ``data`` is a memoryview on ``buffer`` (.npy layout), not a bytes copy.

    Everything that reads an Array's bytes (``Array.numpy``, ``array_view``, hashing) accepts a
    memoryview; gRPC does not, so such Arrays only travel through Ray (fedmask_app/ray_transport.py).
    """
    array = Array.__new__(Array)  # Array() insists on bytes, which would cost a copy
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
        stop = start + len(_npy_header(value.dtype, value.shape)) + value.nbytes
        spans.append((start, stop))
    return spans


def npy_nbytes(like: Sequence[np.ndarray]) -> int:
    """Bytes that ``NpyBlocks(like)`` lays its blocks out in."""
    spans = npy_spans(like)
    return spans[-1][1] if spans else 0


class NpyBlocks:
    """One reusable .npy-laid-out buffer per model block, for writing a reply in place.

    The blocks lie one after another (``spans``) in ``buffer`` (any writable buffer of at least
    ``spans[-1][1]`` bytes, e.g. a shared-memory segment) or in a new one. ``arrays`` are writable
    views of the blocks' data parts; ``record_of(update)`` is an ArrayRecord over the blocks when
    ``update`` is exactly those views (no copy), else None. Such a record is valid until the
    blocks are next written: a Ray actor's reply is copied into the object store when its call
    returns, before the next call.
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
            header = _npy_header(value.dtype, value.shape)
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
