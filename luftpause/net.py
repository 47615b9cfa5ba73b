"""Socket options the gateway and the worker share."""

from __future__ import annotations

import socket

__all__ = ["KEEPALIVE"]

# TCP keepalive that notices a peer host gone without closing its connections (a node
# lost, a network partition) within about a minute of silence: idle 30 s, then three
# probes 10 s apart.  A live peer's kernel answers the probes however long its process
# takes, so a slow answer is never cut by it.  Linux sends no probes while sent data
# is unacknowledged: a request written on a kept connection to a host already gone
# waited out retransmission, about 15 minutes (helper-183), so data unacknowledged
# for 60 s ends the connection too (TCP_USER_TIMEOUT, in milliseconds).  So does a
# live peer that leaves what we send unread for 60 s with its window full (helper-184):
# the gateway reads a request's body at once, and engines do.
KEEPALIVE = [
    (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
    *(
        (socket.IPPROTO_TCP, getattr(socket, name), value)
        for name, value in (
            ("TCP_KEEPIDLE", 30),
            ("TCP_KEEPINTVL", 10),
            ("TCP_KEEPCNT", 3),
            ("TCP_USER_TIMEOUT", 60_000),
        )
        if hasattr(socket, name)  # Linux; macOS has only some of them
    ),
]
