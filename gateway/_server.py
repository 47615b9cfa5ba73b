"""The gateway's HTTP/1.1 server protocol: uvicorn's httptools one, with a bound on what
a request may send that is not its body.

httptools parses a head of any size: it keeps what it has read of a header until the
header ends, so one connection sending header lines without end held the whole of them
in memory before any route (or token check) ran (4 such connections: 2 GB).  A chunked
body's trailer section is parsed the same way, after the head (helper-72).  uvicorn's
h11 protocol stops at 16 KiB, but parses more slowly on every request.

Here, per request, the reads that carry none of its body are counted: while its head is
open, and after it while no body arrives (a trailer without end).  Past `MAX_HEAD_BYTES`
an open head is answered 431 and the connection closed (what else arrives on it is
dropped unread); a body phase that stalls in framing is cut off.  A read in which a
request begins or ends (pipelined requests) is not counted, so a head can grow one read
(at most 256 KiB) past the bound.  Bodies are bounded by the routes (`max_request_bytes`).
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from httptools import HttpParserCallbackError
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["MAX_HEAD_BYTES", "BoundedHead"]

# A request head larger than this is refused (431): 4x h11's default, and nginx's
# (4 x 8 KiB), for bearer tokens, traceparent/baggage and a harness's own headers.
MAX_HEAD_BYTES = 64 * 1024
# How long a refused connection is kept open, its bytes dropped, before it is closed.
LINGER_S = 2.0


class BoundedHead(HttpToolsProtocol):
    """`HttpToolsProtocol` that bounds a request's bytes outside its body (see above)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase = "idle"  # "head": the request's head is open; "body": after it
        self._counted = 0  # bytes of the request's reads that carried none of its body
        self._edge = False  # a request began or ended in this read
        self._body = False  # this read carried body
        self._refused = False  # answered 431: what else arrives is dropped unread

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._phase, self._counted, self._edge = "head", 0, True

    def on_headers_complete(self) -> None:
        # After uvicorn's: a URL it refuses there (httptools' parse_url is stricter
        # than the parser) is still the head's error, not a body's (helper-131: a
        # pipelined one was answered in the place of the request before it).
        super().on_headers_complete()
        self._phase, self._counted = "body", 0

    def on_body(self, body: bytes) -> None:
        self._body = True
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._phase, self._edge = "idle", True
        super().on_message_complete()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self._edge = self._body = False
        super().data_received(data)
        if self._phase == "idle" or self._edge or self.transport.is_closing():
            return
        if self._body:
            self._counted = 0
            return
        self._counted += len(data)
        if self._counted > MAX_HEAD_BYTES:
            self._refuse()

    def _refuse(self) -> None:
        if self._phase == "body":
            # This request is being answered: no second answer can be written beside
            # it.  The connection is cut.
            self._refused = True
            self.transport.close()
            return
        self._answer_and_close(
            b"431 Request Header Fields Too Large",
            f"the request's head (request line and headers) is over {MAX_HEAD_BYTES} bytes",
        )

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes that are no HTTP/1.1 request (a control character
        in a header, a malformed request line): as every error of the gateway's, JSON
        that names what was wrong (the parser's reason: uvicorn calls this while it
        handles the parser's error), not "Invalid HTTP request received." as text
        (helper-125)."""
        reason = sys.exc_info()[1]
        if isinstance(reason, HttpParserCallbackError) and reason.__context__ is not None:
            reason = reason.__context__  # what the callback raised (a URL it refused)
        self._answer_and_close(
            b"400 Bad Request", f"the request is not valid HTTP/1.1: {reason or msg}"
        )

    def _answer_and_close(self, status: bytes, message: str) -> None:
        """Answer `{"error": {"message": ...}}` with this status and close; what else
        arrives on the connection is dropped unread."""
        self._refused = True
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if cycle.response_started or self.pipeline or self._phase != "body":
                # An earlier request is owed its answer (it is being written, or its
                # app is still at work: the bad bytes are a later request's), and no
                # second one can be written beside it.  The connection is cut.
                self.transport.close()
                return
            # The bad bytes are in the body of the request this cycle serves (a bad
            # chunk size), and its app has not answered: this answer stands for it,
            # and the app sees the client gone, as uvicorn's connection_lost says it
            # (helper-128: the connection was cut unanswered).
            cycle.disconnected = True
            cycle.message_event.set()
        body = json.dumps({"error": {"message": message}}).encode()
        self.transport.write(
            b"HTTP/1.1 " + status + b"\r\n"
            b"content-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n"
            b"connection: close\r\n\r\n" + body
        )
        # Closing at once, with the client's bytes unread, would reset the connection,
        # and a reset can drop the answer before the client reads it: end the sending
        # side, drop what still arrives, close after a while (nginx's lingering close).
        # Reading may be paused (a large body read, a pipelined request): resumed, or
        # the bytes stay unread and the close is a reset all the same (helper-130).
        self.flow.resume_reading()
        self.transport.write_eof()
        asyncio.get_running_loop().call_later(LINGER_S, self.transport.close)
