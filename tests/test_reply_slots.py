"""The Flower engine's speed-only transport: shared-memory slots, their Ray payloads, the poll wake-up."""

from __future__ import annotations

import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from multiprocessing import shared_memory
from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedmask_app.engines.flower.fast import ray_transport
from fedmask_app.engines.flower.fast import slots as reply_slots
from fedmask_app.engines.flower.fast.slots import SLOT_KEY, SharedSlots, slot_blocks
from fedmask_app.engines.flower.fast.wakeup import wake_message_extractor
from strategies.masked_fedavg import record_from_arrays, record_views

LIKE = [np.zeros((3, 4), np.float32), np.zeros(5, np.float32), np.zeros(3, np.int64), np.zeros((0, 2), np.float32)]
VALUES = [np.arange(12, dtype=np.float32).reshape(3, 4), np.linspace(-1, 1, 5, dtype=np.float32),
          np.array([7, -8, 9]), np.zeros((0, 2), np.float32)]


@pytest.fixture
def slots(monkeypatch):
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)  # what a ServerApp sets before it builds Messages
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    pool = SharedSlots.for_model(LIKE, slots_needed=3)
    yield pool
    pool.close()


def train_messages(nodes) -> list[Message]:
    content = RecordDict({"arrays": record_from_arrays(LIKE), "config": ConfigRecord({"server-round": 4})})
    return [Message(content=content, dst_node_id=n, message_type="train") for n in nodes]


def replies_from(nodes):
    return [SimpleNamespace(metadata=SimpleNamespace(src_node_id=n)) for n in nodes]


def exists(name: str) -> bool:
    try:
        shared_memory.SharedMemory(name=name).close()
    except FileNotFoundError:
        return False
    return True


def test_each_message_gets_its_own_slot_and_keeps_its_content(slots):
    messages = train_messages([11, 12, 13])
    lent = slots.lend(messages)
    names = [m.content["config"][SLOT_KEY] for m in lent]
    assert len(set(names)) == 3 and all(exists(n) for n in names)
    for before, after in zip(messages, lent, strict=True):
        assert after.metadata.dst_node_id == before.metadata.dst_node_id
        assert after.metadata.message_type == "train"
        assert after.content["arrays"] is before.content["arrays"]  # θ's record (in the θ slot) is shared
        assert after.content["config"]["server-round"] == 4
    assert SLOT_KEY not in messages[0].content["config"]  # the strategy's shared record is not changed
    with pytest.raises(RuntimeError, match="take_back"):
        slots.lend(train_messages([14]))


def test_answered_slots_are_lent_again_and_unanswered_ones_retire(slots):
    first = {m.metadata.dst_node_id: m.content["config"][SLOT_KEY] for m in slots.lend(train_messages([1, 2, 3]))}
    slots.take_back(replies_from([1, 3]))  # node 2 timed out: its client may still write
    assert not exists(first[2])
    second = [m.content["config"][SLOT_KEY] for m in slots.lend(train_messages([1, 2, 3]))]
    assert set(second) >= {first[1], first[3]} and first[2] not in second


def test_close_unlinks_every_slot(slots):
    names = [m.content["config"][SLOT_KEY] for m in slots.lend(train_messages([1, 2]))] + [slots.theta_slot]
    slots.close()
    assert not any(exists(n) for n in names)


def test_no_slots_when_shared_memory_is_too_small(monkeypatch):
    monkeypatch.setattr(reply_slots.shutil, "disk_usage", lambda _: SimpleNamespace(free=64 << 20))
    assert SharedSlots.for_model([np.zeros(10_000_000, np.float32)], slots_needed=10) is None


def test_a_reply_in_a_slot_crosses_as_its_name_and_is_read_in_place(slots):
    name = slots.lend(train_messages([1]))[0].content["config"][SLOT_KEY]
    blocks = slot_blocks(name, LIKE)
    for target, value in zip(blocks.arrays, VALUES, strict=True):
        target[...] = value
    record = blocks.record_of(blocks.arrays)
    ray_transport.send_from_slot(record, name, blocks.spans)
    payload = ray_transport._payload(record)
    assert payload[0] == "slot" and len(pickle.dumps(payload)) < 1024
    received = record_views(ray_transport._record_from_payload(payload))
    for got, want, written in zip(received, VALUES, blocks.arrays, strict=True):
        np.testing.assert_array_equal(got, want)
        assert got.dtype == want.dtype and not got.flags.writeable
        assert got.size == 0 or np.shares_memory(got, written)
    assert ray_transport._payload(record_from_arrays(VALUES))[0] == "inline"  # any other record


def test_theta_crosses_in_its_slot_rewritten_each_round(slots):
    first, spans = slots.theta_record(VALUES)
    ray_transport.send_from_slot(first, slots.theta_slot, spans)
    payload = ray_transport._payload(first)
    assert payload[0] == "slot" and payload[1][0] == slots.theta_slot
    for got, want in zip(record_views(ray_transport._record_from_payload(payload)), VALUES, strict=True):
        np.testing.assert_array_equal(got, want)
    second, _ = slots.theta_record([2 * v for v in VALUES])
    for got, want in zip(record_views(second), VALUES, strict=True):
        np.testing.assert_array_equal(got, 2 * want)


def test_a_client_process_writes_into_the_slot_and_leaves_it_to_the_server(slots):
    name = slots.lend(train_messages([1]))[0].content["config"][SLOT_KEY]
    client = (
        "import numpy as np\n"
        "from fedmask_app.engines.flower.fast.slots import slot_blocks\n"
        f"blocks = slot_blocks({name!r}, [np.zeros(5, np.float32)] * 2)\n"
        "blocks.arrays[1][...] = np.arange(5)\n"
    )
    subprocess.run([sys.executable, "-c", client], check=True, timeout=120)
    assert exists(name)  # the client's exit did not unlink it (its resource tracker let go of it)
    np.testing.assert_array_equal(slot_blocks(name, [np.zeros(5, np.float32)] * 2).arrays[1], np.arange(5))


@pytest.mark.slow
def test_a_real_ray_task_replies_through_a_slot(slots, monkeypatch):
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("a Ray session is running in this process")
    monkeypatch.setattr(ray_transport, "_registered", False)
    name = slots.lend(train_messages([1]))[0].content["config"][SLOT_KEY]
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        assert ray_transport.register_in_ray()

        @ray.remote
        def negate_into_slot(record: ArrayRecord, slot: str) -> ArrayRecord:
            ray_transport.register_in_ray()
            blocks = slot_blocks(slot, LIKE)
            for target, value in zip(blocks.arrays, record_views(record), strict=True):
                np.negative(value, out=target)
            reply = blocks.record_of(blocks.arrays)
            ray_transport.send_from_slot(reply, slot, blocks.spans)
            return reply

        received = record_views(ray.get(negate_into_slot.remote(record_from_arrays(VALUES), name)))
        memory = np.frombuffer(reply_slots.segment(name).buf, dtype=np.uint8)
        for got, want in zip(received, VALUES, strict=True):
            np.testing.assert_array_equal(got, -want)
            assert got.size == 0 or np.shares_memory(got, memory)
    finally:
        ray.util.deregister_serializer(ArrayRecord)
        ray.shutdown()
    assert exists(name)


class FakeLinkState:
    """The one LinkState method Flower's message poll calls; counts the polls."""

    def __init__(self):
        self.polls = 0
        self.polled = threading.Event()
        self.waiting: list[str] = []

    def get_message_ins(self, node_id: int, limit: int):
        self.polls += 1
        self.polled.set()
        taken, self.waiting = self.waiting[:limit], self.waiting[limit:]
        return taken


def test_wake_message_extractor_makes_flowers_poll_run_now():
    from flwr.server.superlink.fleet.vce.vce_api import add_messages_to_queue

    assert wake_message_extractor() is False  # no simulation runtime in this process
    state, delivered, stop = FakeLinkState(), queue.Queue(), threading.Event()
    thread = threading.Thread(target=add_messages_to_queue, args=(state, delivered, {7: 0}, stop))
    thread.start()
    try:
        assert state.polled.wait(5)
        time.sleep(0.01)  # now inside its 100 ms wait
        state.waiting.append("message")
        woken = time.monotonic()
        assert wake_message_extractor() is True
        assert delivered.get(timeout=5) == "message"
        assert time.monotonic() - woken < 0.08  # before its own 100 ms poll would have come
        assert thread.is_alive() and not stop.is_set()
    finally:
        stop.set()
        thread.join(5)


def test_slots_of_killed_servers_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    names = [f"fm{dead_pid}-abc123-0", f"fm{dead_pid}-abc123-1", f"fm{os.getpid()}-abc123-0", "fm-other", "psm_1"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    assert reply_slots.remove_stale_slots(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])  # live servers' and others' stay


def test_a_reply_naming_a_retired_slot_arrives_without_an_update():
    payload = ("slot", ("fm1-abcdef-0", [("0", "float32", (5,), "numpy.ndarray", (0, 148))]))
    assert len(ray_transport._record_from_payload(payload)) == 0  # then left out: "0 arrays, expected ..."


def test_slots_rely_on_shared_memory_internals(slots):
    """The private attributes slots.py uses (fast/__init__.py lists them) are still there."""
    theta = reply_slots.segment(slots.theta_slot)
    assert isinstance(theta._name, str) and theta._name.lstrip("/") == slots.theta_slot
    assert hasattr(theta._mmap, "madvise")


def test_a_client_that_cannot_open_its_slot_replies_through_ray(monkeypatch, caplog):
    """A Ray worker on another machine (or after the slot retired) cannot open the slot it was
    lent: its reply falls back to its own buffers and crosses Ray inline, with a warning."""
    from fedmask_app.engines.flower.fast import transport

    monkeypatch.setattr(transport, "register_in_ray", lambda: True)  # as in a Ray worker
    config = ConfigRecord({"server-round": 1, SLOT_KEY: "fm1-abcdef-7"})  # no such segment here
    buffers = transport.ReplyBuffers.in_ray(config, LIKE)
    for target, value in zip(buffers.arrays, VALUES, strict=True):
        target[...] = value
    record = buffers.record(buffers.arrays)
    assert "cannot write the update into shared-memory slot fm1-abcdef-7" in caplog.text
    payload = ray_transport._payload(record)
    assert payload[0] == "inline"
    for got, want in zip(record_views(ray_transport._record_from_payload(payload)), VALUES, strict=True):
        np.testing.assert_array_equal(got, want)
