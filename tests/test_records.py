"""The message layout's records (masked_fedavg) and the fast path's (buffers, ray_transport): the same
arrays as Flower's own conversions."""

from __future__ import annotations

import time

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from fedmask_app.engines.flower.fast import ray_transport
from fedmask_app.engines.flower.fast.buffers import NpyBlocks, array_over_buffer
from strategies.masked_fedavg import array_view, record_from_arrays, record_views

ARRAYS = [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.array(3.5, dtype=np.float32),
    np.arange(10, dtype=np.int64),
    np.asfortranarray(np.arange(15, dtype=np.float64).reshape(3, 5)),
    np.zeros((0, 3), dtype=np.float32),
    np.arange(24, dtype=np.float64).reshape(4, 6)[:, ::2],
]


def _assert_same(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g, w)


def test_record_from_arrays_reads_back_with_flowers_own_conversion():
    _assert_same(record_from_arrays(ARRAYS).to_numpy_ndarrays(), ARRAYS)


def test_record_views_read_flowers_records():
    _assert_same(record_views(ArrayRecord.from_numpy_ndarrays(ARRAYS)), ARRAYS)


def test_bytes_equal_flowers_for_c_ordered_arrays():
    c_ordered = [a for a in ARRAYS if a.flags.c_contiguous]
    ours, flowers = record_from_arrays(c_ordered), ArrayRecord.from_numpy_ndarrays(c_ordered)
    assert list(ours) == list(flowers)
    assert all(ours[k].data == flowers[k].data for k in ours)


def test_views_share_the_bytes_and_are_read_only():
    record = record_from_arrays([np.ones(1000, np.float32)])
    (view,) = record_views(record)
    assert not view.flags.writeable
    assert np.shares_memory(view, np.frombuffer(record["0"].data, dtype=np.uint8))


def test_npy_blocks_send_their_arrays_without_a_copy():
    like = [a for a in ARRAYS if a.flags.c_contiguous]
    blocks = NpyBlocks(like)
    for target, value in zip(blocks.arrays, like, strict=True):
        target[...] = value
    record = blocks.record_of(blocks.arrays)
    _assert_same(record_views(record), like)
    _assert_same(record.to_numpy_ndarrays(), like)  # Flower reads the memoryview as .npy bytes
    assert all(np.shares_memory(v, a) for v, a in zip(record_views(record), blocks.arrays, strict=True) if a.size)
    assert [record[k].data.tobytes() for k in record] == [a.data for a in record_from_arrays(like).values()]


def test_npy_blocks_refuse_arrays_that_are_not_theirs():
    blocks = NpyBlocks([np.zeros(3, np.float32), np.zeros(2, np.float32)])
    replaced = [np.full(3, np.nan, np.float32), blocks.arrays[1]]  # what a fault injection does
    assert blocks.record_of(replaced) is None
    assert blocks.record_of(blocks.arrays[:1]) is None


def test_object_arrays_are_refused():
    header = b"\x93NUMPY\x01\x00" + (76).to_bytes(2, "little")
    text = b"{'descr': '|O', 'fortran_order': False, 'shape': (1,), }"
    data = header + text.ljust(75) + b"\n" + b"\0" * 8
    with pytest.raises(TypeError, match="objects"):
        array_view(Array(dtype="object", shape=(1,), stype="numpy.ndarray", data=data))


def test_other_serialisations_are_refused():
    with pytest.raises(TypeError, match="stype"):
        array_view(Array(dtype="float32", shape=(1,), stype="torch.Tensor", data=b"1234"))


def test_array_over_buffer_reads_as_flowers_array():
    """Fails when a Flower upgrade changes Array's attributes (array_over_buffer sets them directly)."""
    value = np.arange(6, dtype=np.float32).reshape(2, 3)
    bytes_array = record_from_arrays([value])["0"]
    over = array_over_buffer(bytes_array.dtype, bytes_array.shape, bytes_array.stype, bytearray(bytes_array.data))
    public = [{k for k in vars(a) if not k.startswith("_")} for a in (over, bytes_array)]
    assert public[0] == public[1] == {"dtype", "shape", "stype", "data"}
    np.testing.assert_array_equal(over.numpy(), value)
    np.testing.assert_array_equal(array_view(over), value)


def test_ray_payload_round_trip_without_copies():
    record = record_from_arrays(ARRAYS)
    kind, buffers = ray_transport._payload(record)
    assert kind == "inline"
    assert all(np.shares_memory(buf, np.frombuffer(record[key].data, np.uint8)) for key, *_, buf in buffers)
    rebuilt = ray_transport._record_from_payload((kind, buffers))
    assert isinstance(rebuilt, ArrayRecord) and list(rebuilt) == list(record)
    _assert_same(record_views(rebuilt), ARRAYS)
    _assert_same(rebuilt.to_numpy_ndarrays(), ARRAYS)  # Flower's Array.numpy reads the memoryview


def test_nothing_is_registered_outside_ray(monkeypatch):
    monkeypatch.setattr(ray_transport, "_registered", False)
    import sys

    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            pytest.skip("a Ray session is running in this process")
    assert ray_transport.register_in_ray() is False


@pytest.mark.slow
def test_records_cross_a_real_ray_task_and_leave_nothing_in_the_object_store(monkeypatch):
    """Through Ray a task's reply record comes back intact, and once the records are dropped Ray's
    object store is empty again (a ray.put inside the serializer once pinned every θ for good)."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("a Ray session is running in this process")
    from ray._private.internal_api import memory_summary  # what `ray memory --stats-only` prints

    monkeypatch.setattr(ray_transport, "_registered", False)
    # This session's own address: without one, memory_summary looks for any Ray on the machine and
    # refuses when another process (a sweep beside the tests) runs one too.
    address = ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False).address_info["gcs_address"]
    try:
        assert ray_transport.register_in_ray()

        @ray.remote
        def negate(record: ArrayRecord) -> ArrayRecord:
            ray_transport.register_in_ray()
            return record_from_arrays([-a for a in record_views(record)])

        big = [np.full(1 << 20, i, np.float32) for i in range(4)]  # 16 MiB: past Ray's inline limit
        for _ in range(3):
            record = record_from_arrays(big)
            first, second = ray.get([negate.remote(record), negate.remote(record)])
            _assert_same(record_views(first), [-a for a in big])
            _assert_same(second.to_numpy_ndarrays(), [-a for a in big])
        del record, first, second
        deadline = time.monotonic() + 10
        while "0 objects" not in (summary := memory_summary(address, stats_only=True)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "Plasma memory usage 0 MiB, 0 objects" in summary, summary
    finally:
        ray.util.deregister_serializer(ArrayRecord)
        ray.shutdown()
