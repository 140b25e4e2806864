"""Stamps of one request's way through the node, for `bench/route.py --breakdown`; off unless asked.

With CAKEMP_TRACE=<file> in the front's environment, the front stamps each request it serves
with the monotonic clock (CLOCK_MONOTONIC: one clock for every process of the machine) and
carries the stamps in the request's Hop; a device that receives a Hop with stamps adds its own,
each device of the route in turn, and the last one's Activation brings them all back to the
front, which adds its last ones and writes the request's stamps to the file, one line of
integers (ns) per request. Untraced, a Hop and an Activation carry an empty tuple (a 4-byte
count) and nothing is stamped: what is measured is the path that serves without it.

A line is FRONT_IN, then DEVICE once per device of the route, then FRONT_OUT. A prompt cut into
chunks is written once, with the stamps of its last chunk to be answered.
"""

from __future__ import annotations

import time

ENV = "CAKEMP_TRACE"
# The front, from the request's first bytes to the Hop it sends: the frame's header read, its
# payload decoded, the session's rules and admission passed, the route made (then encoded and sent).
FRONT_IN = ("read", "decoded", "admitted", "routed")
# A device: the Hop received (the socket drained), the step that runs it beginning (after the
# scheduler and any gathering wait), that step's end (bytes to tensor, the layers, tensor to
# bytes), the result about to be sent on.
DEVICE = ("received", "stepping", "stepped", "sending")
# The front again: the Activation read off the socket, the connection's task running again, the
# reply written to the master's socket.
FRONT_OUT = ("answered", "resumed", "written")

now = time.monotonic_ns


def stamp_names(count: int) -> list[str]:
    """The name of each stamp of a line of `count` stamps ("d0 received", … for devices by route order)."""
    devices, rest = divmod(count - len(FRONT_IN) - len(FRONT_OUT), len(DEVICE))
    if devices < 0 or rest:
        raise ValueError(f"a trace line of {count} stamps is not {len(FRONT_IN)} + {len(DEVICE)} per device + "
                         f"{len(FRONT_OUT)}")
    return [*FRONT_IN, *(f"d{i} {name}" for i in range(devices) for name in DEVICE), *FRONT_OUT]
