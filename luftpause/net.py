"""Socket options the gateway and the worker share."""

from __future__ import annotations

import socket

__all__ = ["KEEPALIVE"]

# TCP keepalive that notices a peer host gone without closing its connections (a node
# lost, a network partition) within about a minute of silence: idle 30 s, then three
# probes 10 s apart.  A live peer's kernel answers the probes however long its process
# takes, so a slow answer is never cut by it.
KEEPALIVE = [
    (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
    *(
        (socket.IPPROTO_TCP, getattr(socket, name), value)
        for name, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3))
        if hasattr(socket, name)  # Linux; macOS has only some of them
    ),
]
