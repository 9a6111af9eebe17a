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
from collections.abc import Sequence

import numpy as np
from flwr.app import Array, ArrayRecord
from numpy.lib import format as npy


def array_from_numpy(value: np.ndarray) -> Array:
    """An Array holding ``value`` as .npy bytes, copied once into their final place."""
    value = np.asarray(value)
    if not value.flags.c_contiguous:
        value = value.copy(order="C")
    header = io.BytesIO()
    npy.write_array_header_1_0(header, npy.header_data_from_array_1_0(value))
    data = b"".join((header.getvalue(), value.reshape(-1).view(np.uint8)))
    return Array(dtype=str(value.dtype), shape=tuple(value.shape), stype="numpy.ndarray", data=data)


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
    """A read-only ndarray over the Array's .npy bytes, without copying them."""
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
