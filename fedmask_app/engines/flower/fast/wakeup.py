"""Wake Flower's simulation runtime as soon as the ServerApp has pushed a round's messages.

Flower 1.42's simulation runtime hands messages from its in-memory SuperLink state to the Ray
actors from a thread that polls every 100 ms: ``vce_api.add_messages_to_queue`` waits on the run's
stop event between polls. A round's first client call thus started 0–100 ms after the push
(about 50 ms a round). The ServerApp runs in the same process, so after a push it wakes that
wait: the thread then polls at once (the wait returns False, the event is not set, and the loop
goes on as after a timeout). Nothing else in Flower waits on that event.

This reads private parts of ``threading`` (a running thread's target and arguments, an Event's
condition); when they are not as expected it does nothing, and the runtime polls as before.
"""

from __future__ import annotations

import threading

EXTRACTOR = ("flwr.server.superlink.fleet.vce.vce_api", "add_messages_to_queue")


def wake_message_extractor() -> bool:
    """Wake the simulation runtime's message poll in this process; False when none was found."""
    for thread in threading.enumerate():
        target = getattr(thread, "_target", None)
        if (getattr(target, "__module__", None), getattr(target, "__name__", None)) != EXTRACTOR:
            continue
        stop = next((arg for arg in getattr(thread, "_args", ()) if isinstance(arg, threading.Event)), None)
        condition = getattr(stop, "_cond", None)
        if not isinstance(condition, threading.Condition):
            return False
        with condition:
            condition.notify_all()
        return True
    return False
