"""The gateway's HTTP/1.1 server protocol: uvicorn's httptools one, with a bound on a request's
head (its request line and headers).

httptools parses a head of any size: it keeps what it has read of a header until the
header ends, so one connection sending header lines without end held the whole of them
in memory before any route (or token check) ran (4 such connections: 2 GB).  uvicorn's
h11 protocol stops at 16 KiB, but parses more slowly on every request.  Here a head that
has grown past `MAX_HEAD_BYTES` without ending is answered 431 and the connection
closed (what else arrives on it is dropped unread).  A request's body is not counted:
the routes bound it (`max_request_bytes`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["MAX_HEAD_BYTES", "BoundedHead"]

# A request head larger than this is refused (431): 4x h11's default, and nginx's
# (4 x 8 KiB), for bearer tokens, traceparent/baggage and a harness's own headers.
MAX_HEAD_BYTES = 64 * 1024
# How long a refused connection is kept open, its bytes dropped, before it is closed.
LINGER_S = 2.0


class BoundedHead(HttpToolsProtocol):
    """`HttpToolsProtocol` that refuses a request head over `MAX_HEAD_BYTES` (431)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head = 0  # bytes read of the request head in progress; -1: in its body
        self._refused = False  # answered 431: what else arrives is dropped unread

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head = 0

    def on_headers_complete(self) -> None:
        self._head = -1
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        # Counted after parsing, so that the body following a head in the same read is
        # not counted: a head still open took (at most) all of this read.  A read is at
        # most 256 KiB (asyncio's), so that is what a head can hold past the bound.
        if self._head >= 0 and not self.transport.is_closing():
            self._head += len(data)
            if self._head > MAX_HEAD_BYTES:
                self._refuse_head()

    def _refuse_head(self) -> None:
        message = f"the request's head (request line and headers) is over {MAX_HEAD_BYTES} bytes"
        body = json.dumps({"error": {"message": message}}).encode()
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n"
            b"connection: close\r\n\r\n" + body
        )
        # Closing at once, with the client's bytes unread, would reset the connection,
        # and a reset can drop the answer before the client reads it: end the sending
        # side, drop what still arrives, close after a while (nginx's lingering close).
        self._refused = True
        self.transport.write_eof()
        asyncio.get_running_loop().call_later(LINGER_S, self.transport.close)
