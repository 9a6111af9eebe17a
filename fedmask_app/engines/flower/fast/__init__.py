"""The Flower engine's speed-only transport for an in-process Ray simulation (run-config key
``fast-simulation``, on by default; off: Flower's public API alone, same rounds.csv).

θ and each client's Δ_k cross in shared-memory slots (``slots``) named by the messages, Flower
ArrayRecords cross Ray as slot names or out-of-band buffers (``ray_transport``), and Flower's 100 ms
message poll is woken after each push (``wakeup``). ``transport`` is the only entry point:
server_app.py and client_app.py choose it in one place each.

What it relies on beyond public APIs, and the test that fails when an upgrade breaks it:
- flwr ``Array.__new__`` + ``__dict__`` (an Array over a buffer, no bytes copy), buffers.py:
  tests/test_records.py::test_array_over_buffer_reads_as_flowers_array
- flwr ``vce_api.add_messages_to_queue`` (name, its Event argument) and Python's private
  ``Thread._target``/``_args`` and ``Event._cond``, wakeup.py (a no-op when not found):
  tests/test_reply_slots.py::test_wake_message_extractor_makes_flowers_poll_run_now
- Python's ``SharedMemory._name`` with ``resource_tracker.unregister`` (a client's exit must not
  unlink the server's slot) and ``SharedMemory._mmap`` (populate a new slot's pages at once; best
  effort), both in fedmask_app/run/shared_memory.py, which the local engine's client processes
  share: tests/test_reply_slots.py::test_a_client_process_writes_into_the_slot_and_leaves_it_to_the_server
  and tests/test_reply_slots.py::test_slots_rely_on_shared_memory_internals
"""
