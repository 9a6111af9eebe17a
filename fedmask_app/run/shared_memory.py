"""Named shared-memory segments that model-sized arrays cross between processes in.

Both engines use them: the Flower engine's Ray simulation (``engines/flower/fast/slots.py``) and
the local engine's client processes (``engines/client_pool.py``). A segment is named
``fm<creator pid>-<random>-<suffix>``, so that ``remove_stale_segments`` can tell the segments of
a process that was killed before it could unlink them. Importing this module imports neither flwr
nor ray.

Private parts of Python relied on: ``SharedMemory._name`` (``resource_tracker.unregister``: an
attaching process's exit must not unlink the creator's segment) and ``SharedMemory._mmap``
(populating a new segment's pages at once; best effort).
tests/test_reply_slots.py::test_slots_rely_on_shared_memory_internals fails when they change.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import sys
from collections.abc import Sequence
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import numpy as np

SEGMENT_NAME = re.compile(r"fm(\d+)-[0-9a-f]{6}-(\d+|theta)")  # macOS allows 31 characters
MADV_POPULATE_WRITE = 23  # Linux >= 5.14; Python 3.11's mmap module does not name it


class Segment(shared_memory.SharedMemory):
    """A SharedMemory that stays quiet when it is collected while views of it are alive.

    ``SharedMemory.__del__`` closes the mapping and, when a view (a record still held somewhere)
    exports it, prints ``BufferError: cannot close exported pointers exist``; the mapping goes
    with the process either way."""

    def __del__(self) -> None:
        with contextlib.suppress(BufferError):
            self.close()


_segments: dict[str, Segment] = {}  # the segments this process created or attached


def populate(memory: Segment) -> None:
    """Map (and allocate) every page now, in one call: writing a new 45 MB segment page by page
    took about 100 ms of page faults on the 2-core machine, populating it about 25 ms."""
    if sys.platform == "linux":
        with contextlib.suppress(AttributeError, OSError):  # an older kernel, or another layout
            memory._mmap.madvise(MADV_POPULATE_WRITE)


def segment_prefix() -> str:
    """A new name prefix of this process: ``fm<pid>-<random>-``."""
    return f"fm{os.getpid()}-{secrets.token_hex(3)}-"


def create_segment(name: str, size: int) -> Segment:
    created = Segment(name=name, create=True, size=size)
    populate(created)
    _segments[name] = created
    return created


def segment(name: str, creators_tracker: bool = False) -> Segment:
    """The named segment, attached once per process (or the one this process created).

    ``creators_tracker``: this process shares the creator's resource tracker (a multiprocessing
    child of it), whose registration of the segment is left alone."""
    attached = _segments.get(name)
    if attached is None:
        attached = Segment(name=name)
        # Python < 3.13 registers an attached POSIX segment with this process's resource
        # tracker, which would unlink it when this process exits, from under its creator.
        if os.name == "posix" and not creators_tracker:
            resource_tracker.unregister(attached._name, "shared_memory")
        populate(attached)
        _segments[name] = attached
    return attached


def release_segment(name: str) -> None:
    """Close and unlink a segment this process created."""
    created = _segments.pop(name)
    with contextlib.suppress(BufferError):  # a view of it is still alive; the mapping goes with it
        created.close()
    with contextlib.suppress(FileNotFoundError):  # removed from outside (e.g. /dev/shm cleaned by hand)
        created.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_segments(shm: Path = Path("/dev/shm")) -> int:
    """Unlink the segments of processes that no longer run. A process unlinks its segments when it
    ends, and its resource tracker does when it dies; both gone at once (SIGKILL to the whole
    process group) leaves them behind."""
    if not shm.is_dir():
        return 0
    stale = [p for p in shm.iterdir() if (m := SEGMENT_NAME.fullmatch(p.name)) and not _alive(int(m[1]))]
    for path in stale:
        path.unlink(missing_ok=True)
    return len(stale)


ALIGN = 64  # every array starts on a 64-byte boundary


def packed_nbytes(like: Sequence[np.ndarray]) -> int:
    """Bytes that ``packed_arrays`` lays arrays shaped like ``like`` out in."""
    stop = 0
    for value in like:
        stop = -(-stop // ALIGN) * ALIGN + value.nbytes
    return stop


def packed_arrays(buffer, like: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Writable arrays shaped like ``like``, one after another (64-byte aligned) in ``buffer``."""
    memory = np.frombuffer(buffer, dtype=np.uint8)
    if memory.size < packed_nbytes(like):
        raise ValueError(f"the buffer holds {memory.size} bytes, the arrays need {packed_nbytes(like)}")
    arrays, stop = [], 0
    for value in like:
        start = -(-stop // ALIGN) * ALIGN
        stop = start + value.nbytes
        arrays.append(memory[start:stop].view(value.dtype).reshape(value.shape))
    return arrays
