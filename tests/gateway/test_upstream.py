"""`gateway._http.Upstream`, the keep-alive HTTP/1.1 client that carries every proxied
turn, over real loopback sockets.

Two kinds of engine stand in for the real ones:

* ASGI apps under uvicorn (`testkit.loopback.serve`), where a well-behaved HTTP server
  is what the test needs (headers, framing, a large streamed body);
* `raw_server`, an `asyncio.start_server` that sees the bytes and the TCP connections
  themselves: which connection each request arrived on, when the client hangs up, and
  answers that are cut short, doubled, or never come.

Every test runs under a bounded wait (`bounded`), and every socket it opens is closed
before it ends (pytest turns an unclosed-socket ResourceWarning into an error).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import re
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import pytest
from starlette.types import Receive, Scope, Send

from gateway import _http
from gateway._http import Upstream, UpstreamAnswer, UpstreamError
from testkit.loopback import serve

# Every test (and so every wait in it) ends within this.
TEST_LIMIT_S = 10.0
# asyncio's selector transport reads at most this much per data_received call.
_RECV_MAX = 256 * 1024
# The most one `read()` can return: the high-water mark, plus the one socket read that
# crossed it before reading paused.
_PIECE_MAX = _http._HIGH_WATER + _RECV_MAX

BODY = b'{"model": "m", "messages": []}'


def bounded(
    test: Callable[..., Coroutine[Any, Any, None]],
) -> Callable[..., Coroutine[Any, Any, None]]:
    """Fail the test (rather than hang the run) if it takes over TEST_LIMIT_S."""

    @functools.wraps(test)
    async def run(*args: Any, **kwargs: Any) -> None:
        async with asyncio.timeout(TEST_LIMIT_S):
            await test(*args, **kwargs)

    return run


async def settle() -> None:
    """One loop iteration: transports closed just now release their sockets (asyncio
    schedules connection_lost with call_soon)."""
    await asyncio.sleep(0)


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    client = Upstream(connect_timeout=5.0)
    yield client
    client.close()
    await settle()


@pytest.fixture
async def one_slot(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Upstream]:
    """An Upstream allowed one connection at a time: a slot that leaks hangs the next
    turn, which the test's bound then reports."""
    monkeypatch.setattr(_http, "MAX_CONNECTIONS", 1)
    client = Upstream(connect_timeout=5.0)
    yield client
    client.close()
    await settle()


async def read_all(answer: UpstreamAnswer) -> bytes:
    """The whole body, then close the answer (which keeps the connection if it can)."""
    pieces = []
    try:
        while piece := await answer.read():
            pieces.append(piece)
    finally:
        answer.close()
    return b"".join(pieces)


async def fetch(upstream: Upstream, url: str, body: bytes = BODY) -> tuple[int, bytes]:
    answer = await upstream.post(url, body, [("content-type", "application/json")])
    return answer.status, await read_all(answer)


def http_answer(
    body: bytes = b'{"ok": true}', *, status: bytes = b"200 OK", extra: bytes = b""
) -> bytes:
    """A complete HTTP/1.1 answer with a Content-Length body."""
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n" + extra
        + b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )  # fmt: skip


async def lifespan(receive: Receive, send: Send) -> None:
    """The lifespan protocol for the ASGI engines below (nothing to set up)."""
    while (await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})


# --------------------------------------------------------------------------- raw server


@dataclass
class Request:
    head: bytes  # the request line and headers, through the blank line
    body: bytes


@dataclass
class Peer:
    """The engine's side of one accepted connection (`index`: accept order, from 0)."""

    index: int
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    requests: list[Request] = field(default_factory=list)

    async def request(self) -> Request | None:
        """The next request on this connection; None once the client closed it."""
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise
            return None
        except ConnectionResetError:
            return None
        length = re.search(rb"\r\ncontent-length: *(\d+)\r\n", head, re.IGNORECASE)
        body = await self.reader.readexactly(int(length[1]) if length else 0)
        self.requests.append(Request(head, body))
        return self.requests[-1]

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def client_gone(self) -> None:
        """Return when the client closes the connection (what it sends is discarded)."""
        with contextlib.suppress(ConnectionResetError):
            while await self.reader.read(64 * 1024):
                pass

    def send_fin_now(self) -> None:
        """Shut down the writing side at once (a FIN, as an engine's keep-alive timeout
        sends), without waiting for the event loop."""
        self.writer.get_extra_info("socket").shutdown(socket.SHUT_WR)


Handler = Callable[[Peer], Awaitable[None]]


@dataclass
class RawServer:
    url: str = ""
    peers: list[Peer] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)

    @property
    def accepted(self) -> int:
        """TCP connections accepted so far."""
        return len(self.peers)

    def requests_per_connection(self) -> list[int]:
        return [len(peer.requests) for peer in self.peers]


@contextlib.asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[RawServer]:
    """A loopback TCP server running `handler` for each connection; fails the test if a
    handler raised; closes every connection when the block ends."""
    state = RawServer()
    tasks: set[asyncio.Task[Any]] = set()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        peer = Peer(len(state.peers), reader, writer)
        state.peers.append(peer)
        try:
            await handler(peer)
        except asyncio.CancelledError:
            pass  # the block ended while the handler waited: end quietly
        except Exception as exc:
            state.errors.append(exc)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    state.url = f"http://127.0.0.1:{port}/v1/chat/completions"
    try:
        yield state
    finally:
        server.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()
    if state.errors:
        raise state.errors[0]


def keep_answering(answer: bytes = http_answer()) -> Handler:
    """A handler answering every request on its connection with `answer`."""

    async def handle(peer: Peer) -> None:
        while await peer.request() is not None:
            await peer.send(answer)

    return handle


# --------------------------------------------------------------------------- answers


@bounded
async def test_json_answer_status_repeated_headers_and_exact_body(upstream: Upstream) -> None:
    body = '{"text": "grüße ✓", "n": 1}\n'.encode()
    seen: list[tuple[Scope, bytes]] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        message = await receive()
        seen.append((scope, message.get("body", b"")))
        headers = [
            (b"content-type", b"application/json"),
            (b"set-cookie", b"a=1; Path=/"),
            (b"X-Engine", b"fake"),
            (b"set-cookie", b"b=2; Path=/"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": 201, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async with serve(app) as base:
        answer = await upstream.post(
            f"{base}/v1/chat/completions?trace=1", BODY, [("x-request-id", "abc")]
        )
        try:
            assert answer.status == 201
            # Names lower-cased, repeated headers kept apart and in order.
            assert [v for k, v in answer.headers if k == b"set-cookie"] == [
                b"a=1; Path=/",
                b"b=2; Path=/",
            ]
            assert answer.header(b"set-cookie") == b"a=1; Path=/"
            assert answer.header(b"x-engine") == b"fake"
            assert answer.header(b"content-type") == b"application/json"
            assert answer.header(b"x-absent") is None
            assert await answer.read() == body
            assert answer.complete
            assert await answer.read() == b""
        finally:
            answer.close()

    (scope, received), *_ = seen
    assert (scope["method"], scope["path"], scope["query_string"]) == (
        "POST",
        "/v1/chat/completions",
        b"trace=1",
    )
    sent_headers = dict(scope["headers"])
    assert sent_headers[b"x-request-id"] == b"abc"
    assert sent_headers[b"host"] == base.removeprefix("http://").encode()
    assert received == BODY


@bounded
async def test_request_bytes_on_the_wire(upstream: Upstream) -> None:
    async with raw_server(keep_answering()) as server:
        assert await fetch(upstream, server.url + "?a=1&b=2") == (200, b'{"ok": true}')
    host = server.url.removeprefix("http://").split("/")[0]
    assert server.peers[0].requests == [
        Request(
            head=(
                b"POST /v1/chat/completions?a=1&b=2 HTTP/1.1\r\n"
                b"host: " + host.encode() + b"\r\n"
                b"content-type: application/json\r\n"
                b"content-length: " + str(len(BODY)).encode() + b"\r\n\r\n"
            ),
            body=BODY,
        )
    ]


# The same 21 body bytes, framed two ways; both split mid-line and mid-chunk below.
FRAMINGS = {
    "chunked": (
        b"transfer-encoding: chunked\r\n",
        b"5\r\nhello\r\n10;name=value\r\n0123456789abcdef\r\n0\r\nx-trailer: t\r\n\r\n",
    ),
    "content-length": (b"content-length: 21\r\n", b"hello0123456789abcdef"),
}


@pytest.mark.parametrize("framing", FRAMINGS)
@bounded
async def test_body_is_handed_on_as_it_arrives_then_the_connection_is_kept(
    upstream: Upstream, framing: str
) -> None:
    framing_header, wire = FRAMINGS[framing]
    first_piece_read = asyncio.Event()

    async def handle(peer: Peer) -> None:
        await peer.request()
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n" + framing_header + b"\r\n"
        await peer.send(head + wire[:6])  # chunked: "5\r\nhel"
        await first_piece_read.wait()
        for at in range(6, len(wire), 3):  # the rest in 3-byte writes
            await peer.send(wire[at : at + 3])
            await asyncio.sleep(0)  # a chance to parse each fragment on its own
        await keep_answering()(peer)

    async with raw_server(handle) as server:
        answer = await upstream.post(server.url, BODY, [])
        try:
            first = await answer.read()
            # Part of the body, before the rest was even sent.
            assert first == (b"hel" if framing == "chunked" else b"hello0")
            assert not answer.complete
            first_piece_read.set()
            rest = b""
            while piece := await answer.read():
                rest += piece
        finally:
            answer.close()
        assert first + rest == b"hello0123456789abcdef"
        assert await fetch(upstream, server.url) == (200, b'{"ok": true}')
    assert server.requests_per_connection() == [2]  # one connection, reused


@bounded
async def test_body_until_close_ends_with_the_connection(upstream: Upstream) -> None:
    """No Content-Length, not chunked: the body is whatever comes until the engine
    closes; that connection cannot carry another turn."""

    async def handle(peer: Peer) -> None:
        if peer.index == 0:
            await peer.request()
            await peer.send(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil ")
            await peer.send(b"the end")
            return  # closing ends the body
        await keep_answering()(peer)

    async with raw_server(handle) as server:
        assert await fetch(upstream, server.url) == (200, b"until the end")
        assert await fetch(upstream, server.url) == (200, b'{"ok": true}')
    assert server.requests_per_connection() == [1, 1]


LARGE = 8 * 1024 * 1024
BLOCK = 64 * 1024


def large_block(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(4, "big")).digest() * (BLOCK // 32)


@pytest.mark.parametrize("framing", ["chunked", "content-length"])
@bounded
async def test_large_body_streams_in_bounded_pieces(upstream: Upstream, framing: str) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        await receive()
        headers = [(b"content-type", b"application/octet-stream")]
        if framing == "content-length":
            headers.append((b"content-length", str(LARGE).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for i in range(LARGE // BLOCK):
            await send({"type": "http.response.body", "body": large_block(i), "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    expected = hashlib.sha256(b"".join(large_block(i) for i in range(LARGE // BLOCK)))
    got = hashlib.sha256()
    sizes = []
    async with serve(app) as base:
        answer = await upstream.post(base + "/v1/chat/completions", BODY, [])
        try:
            if framing == "chunked":
                assert answer.header(b"transfer-encoding") == b"chunked"
            else:
                assert answer.header(b"content-length") == str(LARGE).encode()
            while piece := await answer.read():
                sizes.append(len(piece))
                got.update(piece)
        finally:
            answer.close()
    assert sum(sizes) == LARGE
    assert got.hexdigest() == expected.hexdigest()
    assert len(sizes) > 1, "the body came as one piece"
    assert max(sizes) <= _PIECE_MAX


@bounded
async def test_interim_answers_are_skipped(upstream: Upstream) -> None:
    async def handle(peer: Peer) -> None:
        await peer.request()
        await peer.send(b"HTTP/1.1 100 Continue\r\n\r\n")
        await peer.send(b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>\r\n\r\n")
        await peer.send(http_answer(b"final", extra=b"x-final: 1\r\n"))
        await keep_answering()(peer)

    async with raw_server(handle) as server:
        answer = await upstream.post(server.url, BODY, [])
        assert await read_all(answer) == b"final"
        assert answer.status == 200
        assert answer.header(b"x-final") == b"1"
        assert answer.header(b"link") is None  # the interim answer's headers are dropped
        assert await fetch(upstream, server.url) == (200, b'{"ok": true}')
    assert server.requests_per_connection() == [2]


# --------------------------------------------------------------------------- keep-alive


@bounded
async def test_sequential_turns_reuse_one_connection(upstream: Upstream) -> None:
    async with raw_server(keep_answering()) as server:
        for _ in range(3):
            assert await fetch(upstream, server.url) == (200, b'{"ok": true}')
    assert server.requests_per_connection() == [3]


async def test_a_turn_that_ends_after_close_closes_its_connection() -> None:
    """At shutdown the idle connections are closed; a turn still in flight then is not
    put back among them when it ends (nothing would close it: it would be collected
    open, a ResourceWarning in whatever runs next)."""
    client = Upstream(connect_timeout=5.0)
    async with raw_server(keep_answering()) as server:
        answer = await client.post(server.url, BODY, [])
        conn = answer._conn
        assert conn is not None
        client.close()  # the gateway shuts down while the answer is read
        assert await read_all(answer) == b'{"ok": true}'
        await settle()
        # (closed: its connection_lost ran, the socket is released)
        assert conn.closed and not any(client._idle.values()), "closed, not kept"


@pytest.mark.parametrize(
    "answer",
    [
        http_answer(b"bye", extra=b"connection: close\r\n"),
        b"HTTP/1.0 200 OK\r\ncontent-length: 3\r\n\r\nbye",  # 1.0: not kept by default
    ],
    ids=["connection-close", "http-1.0"],
)
@bounded
async def test_engine_not_keeping_the_connection_means_a_new_one(
    upstream: Upstream, answer: bytes
) -> None:
    closed_by_client = asyncio.Event()

    async def handle(peer: Peer) -> None:
        if peer.index == 0:
            await peer.request()
            await peer.send(answer)
            # The engine leaves its socket open: reusing it would land a request here.
            await peer.client_gone()
            closed_by_client.set()
            return
        await keep_answering()(peer)

    async with raw_server(handle) as server:
        assert await fetch(upstream, server.url) == (200, b"bye")
        assert await fetch(upstream, server.url) == (200, b'{"ok": true}')
        await closed_by_client.wait()
    assert server.requests_per_connection() == [1, 1]


@bounded
async def test_concurrent_turns_get_own_connections_and_both_are_kept(upstream: Upstream) -> None:
    both_in = asyncio.Event()

    async def handle(peer: Peer) -> None:
        while await peer.request() is not None:
            if sum(server.requests_per_connection()) >= 2:
                both_in.set()
            await both_in.wait()  # answer only once both turns are in flight
            await peer.send(http_answer())

    async with raw_server(handle) as server:
        for _ in range(2):
            results = await asyncio.gather(fetch(upstream, server.url), fetch(upstream, server.url))
            assert list(results) == [(200, b'{"ok": true}')] * 2
    assert server.requests_per_connection() == [2, 2]


@bounded
async def test_idle_connections_the_engine_closes_are_let_go(upstream: Upstream) -> None:
    """An engine that leaves (a pod discovery replaced) closes the connections kept
    for it: kept closed, they and the engine's list stayed for the process's life."""
    for _ in range(3):  # three engines, each gone after two turns at once
        async with raw_server(keep_answering()) as server:
            results = await asyncio.gather(fetch(upstream, server.url), fetch(upstream, server.url))
            assert list(results) == [(200, b'{"ok": true}')] * 2
            (kept,) = upstream._idle.values()
            assert len(kept) == 2 and not any(c.closed for c in kept)
        for _ in range(100):  # the EOFs reach connection_lost within a few iterations
            if not upstream._idle:
                break
            await settle()
        assert not upstream._idle, upstream._idle


@bounded
async def test_engine_connections_are_kept_alive_by_tcp(upstream: Upstream) -> None:
    """A turn waits for its engine as long as the turn timeout: an engine host gone
    without closing its connections is noticed by TCP keepalive (helper-181)."""
    async with raw_server(keep_answering()) as server:
        assert await fetch(upstream, server.url) == (200, b'{"ok": true}')
        ((kept,),) = upstream._idle.values()
        sock = kept.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        if hasattr(socket, "TCP_KEEPIDLE"):
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 30
        if hasattr(socket, "TCP_USER_TIMEOUT"):  # sent data unanswered (helper-183)
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 60_000


# --------------------------------------------------------------------------- stale retry


@pytest.mark.parametrize("when", ["fin-before-request", "read-then-closed"])
@bounded
async def test_stale_keep_alive_connection_is_retried_on_a_new_one(
    upstream: Upstream, when: str
) -> None:
    """The engine drops an idle connection (its keep-alive timeout) as the next turn goes
    out on it; no byte of answer came back, so the turn is sent again, on a new
    connection.  Note the second case: the engine did read that request, and gets it
    twice — the client cannot tell that apart from a request that never arrived."""

    async def handle(peer: Peer) -> None:
        if peer.index == 0:
            await peer.request()
            await peer.send(http_answer(b"first"))
            await peer.request()  # the turn sent on the stale connection ...
            return  # ... closed without a byte of answer
        await keep_answering(http_answer(b"second"))(peer)

    async with raw_server(handle) as server:
        assert await fetch(upstream, server.url, b"turn 1") == (200, b"first")
        age_idle(upstream)
        if when == "fin-before-request":
            # No await between the FIN and the request: the client cannot have seen
            # the FIN yet, and writes the turn onto the dying connection.
            server.peers[0].send_fin_now()
        assert await fetch(upstream, server.url, b"turn 2") == (200, b"second")
    assert server.requests_per_connection() == [2, 1]
    assert [r.body for r in server.peers[0].requests] == [b"turn 1", b"turn 2"]
    assert [r.body for r in server.peers[1].requests] == [b"turn 2"]


def age_idle(upstream: Upstream) -> None:
    """The idle connections as if they had waited as long as a keep-alive timer."""
    for kept in upstream._idle.values():
        for conn in kept:
            assert conn.idle_since is not None
            conn.idle_since -= _http.RESEND_IDLE_S


@bounded
async def test_a_connection_used_a_moment_ago_that_closes_on_a_turn_is_not_a_race(
    upstream: Upstream,
) -> None:
    """helper-112: an engine that read the turn and closed within 0.1 s got it twice.
    A keep-alive timer fires only on a connection idle for a while; one just used was
    closed by an engine that read the turn.  The turn fails, sent once."""

    async def handle(peer: Peer) -> None:
        if peer.index == 0:
            await peer.request()
            await peer.send(http_answer(b"first"))
            await peer.request()
            return  # closed at once, without a byte of answer
        await keep_answering(http_answer(b"a resend that should not have happened"))(peer)

    async with raw_server(handle) as server:
        assert await fetch(upstream, server.url, b"turn 1") == (200, b"first")
        with pytest.raises(UpstreamError, match="closed the connection without answering"):
            await upstream.post(server.url, b"turn 2", [])
    assert server.requests_per_connection() == [2]


@bounded
async def test_a_turn_the_engine_held_and_then_dropped_is_not_sent_again(
    upstream: Upstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine read the turn, worked on it and closed without answering (a crash, an
    out-of-memory kill): that is no keep-alive race, and sending it again would run it
    twice, or bring the engine down twice.  The turn fails."""
    monkeypatch.setattr(_http, "RESEND_WINDOW_S", 0.05)
    held = asyncio.Event()

    async def handle(peer: Peer) -> None:
        if peer.index == 0:
            await peer.request()
            await peer.send(http_answer(b"first"))
            await peer.request()
            await asyncio.sleep(0.2)  # the engine at work: longer than the window
            held.set()
            return  # closed without a byte of answer
        await keep_answering(http_answer(b"a resend that should not have happened"))(peer)

    async with raw_server(handle) as server:
        assert await fetch(upstream, server.url, b"turn 1") == (200, b"first")
        age_idle(upstream)  # idle long enough: only the window tells
        with pytest.raises(UpstreamError, match="closed the connection without answering"):
            await upstream.post(server.url, b"turn 2", [])
        assert held.is_set()
    assert server.requests_per_connection() == [2]


def closing_without_answer(*, served_first: int) -> Handler:
    """Connection 0 answers `served_first` turns, then reads one more and closes without
    answering.  If it served any (so the client retries), connection 1 does the same to
    the retry.  Any later connection answers: one retry too many would succeed."""

    async def handle(peer: Peer) -> None:
        if peer.index == 0:
            for _ in range(served_first):
                await peer.request()
                await peer.send(http_answer())
            await peer.request()
            return
        if peer.index == 1 and served_first:
            await peer.request()
            return
        await keep_answering(http_answer(b"a retry that should not have happened"))(peer)

    return handle


@bounded
async def test_the_stale_retry_happens_once(upstream: Upstream) -> None:
    async with raw_server(closing_without_answer(served_first=1)) as server:
        await fetch(upstream, server.url)
        age_idle(upstream)
        with pytest.raises(UpstreamError, match="closed the connection without answering"):
            await upstream.post(server.url, BODY, [])
        assert server.accepted == 2  # the stale one and one retry, not a third
    assert server.requests_per_connection() == [2, 1]


@bounded
async def test_a_new_connection_closed_without_answer_is_not_retried(upstream: Upstream) -> None:
    async with raw_server(closing_without_answer(served_first=0)) as server:
        with pytest.raises(UpstreamError, match="closed the connection without answering"):
            await upstream.post(server.url, BODY, [])
        assert server.accepted == 1


def second_answer_cut(cut: bytes) -> Handler:
    """Connection 0 answers one turn, then sends `cut` (a partial answer) to the next
    and closes.  Later connections answer: a wrongful retry would succeed."""

    async def handle(peer: Peer) -> None:
        if peer.index == 0:
            await peer.request()
            await peer.send(http_answer())
            await peer.request()
            await peer.send(cut)
            return
        await keep_answering(http_answer(b"a retry that should not have happened"))(peer)

    return handle


@bounded
async def test_no_retry_once_part_of_the_head_arrived(upstream: Upstream) -> None:
    async with raw_server(second_answer_cut(b"HTTP/1.1 200 OK\r\ncontent-le")) as server:
        await fetch(upstream, server.url)
        with pytest.raises(UpstreamError, match="closed the connection"):
            await upstream.post(server.url, BODY, [])
        assert server.accepted == 1
    assert server.requests_per_connection() == [2]


@bounded
async def test_no_retry_once_part_of_the_body_arrived(upstream: Upstream) -> None:
    cut = http_answer(b"x" * 100)[:-60]
    async with raw_server(second_answer_cut(cut)) as server:
        await fetch(upstream, server.url)
        answer = await upstream.post(server.url, BODY, [])
        try:
            assert answer.status == 200
            assert await answer.read() == b"x" * 40
            with pytest.raises(UpstreamError, match="closed the connection mid-answer"):
                await answer.read()
        finally:
            answer.close()
        assert server.accepted == 1
    assert server.requests_per_connection() == [2]


@bounded
async def test_a_malformed_answer_fails_and_is_not_retried(upstream: Upstream) -> None:
    gone = asyncio.Event()

    async def handle(peer: Peer) -> None:
        if peer.index == 0:
            await peer.request()
            await peer.send(b"SMTP ready\r\n\r\n")
            await peer.client_gone()
            gone.set()
            return
        await keep_answering()(peer)

    async with raw_server(handle) as server:
        with pytest.raises(UpstreamError, match="bad HTTP answer"):
            await upstream.post(server.url, BODY, [])
        await gone.wait()  # the client closed it
        assert server.accepted == 1


@bounded
async def test_a_doubled_answer_retires_the_connection(upstream: Upstream) -> None:
    """Bytes beyond the answer make the connection unusable: the next turn goes out on a
    new one (it never lands on the first)."""

    async def handle(peer: Peer) -> None:
        if peer.index == 0:
            await peer.request()
            await peer.send(http_answer(b"one") + http_answer(b"two"))
            await peer.client_gone()
            return
        await keep_answering(http_answer(b"three"))(peer)

    async with raw_server(handle) as server:
        assert await fetch(upstream, server.url) == (200, b"one")
        assert await fetch(upstream, server.url) == (200, b"three")
    assert server.requests_per_connection() == [1, 1]


# --------------------------------------------------------------------------- connecting


def closed_port_url() -> str:
    """A loopback URL nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}/v1/chat/completions"


@bounded
async def test_connection_refused_fails_at_once(one_slot: Upstream) -> None:
    """The proxy answers 502 `engine <replica>: <message>` for any UpstreamError; here
    the message says why."""
    url = closed_port_url()
    for _ in range(2):  # the second would hang if the first kept the only slot
        started = time.monotonic()
        with pytest.raises(UpstreamError, match=r"^cannot connect \(.*Connect call failed"):
            async with asyncio.timeout(2):
                await one_slot.post(url, BODY, [])
        assert time.monotonic() - started < 1.0  # refused, not timed out (limit is 5 s)


@bounded
async def test_connect_timeout_when_the_handshake_hangs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A listener whose accept queue is full drops new SYNs, so connecting hangs — on
    loopback, with no routing tricks."""
    monkeypatch.setattr(_http, "MAX_CONNECTIONS", 1)
    client = Upstream(connect_timeout=0.3)
    try:
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(0)  # Linux queues backlog + 1 = 1 connection
            port = listener.getsockname()[1]
            with socket.create_connection(("127.0.0.1", port), timeout=2):  # fills the queue
                started = time.monotonic()
                with pytest.raises(UpstreamError, match=r"^connect timeout$"):
                    await client.post(f"http://127.0.0.1:{port}/v1/chat/completions", BODY, [])
                elapsed = time.monotonic() - started
        assert 0.25 <= elapsed < 2.0  # the timeout's 0.3 s, not a refusal
        async with raw_server(keep_answering()) as server:  # the slot came back
            assert await fetch(client, server.url) == (200, b'{"ok": true}')
    finally:
        client.close()
        await settle()


@bounded
async def test_an_address_that_never_answers_is_raced_past(monkeypatch: pytest.MonkeyPatch) -> None:
    """A name with two addresses whose first drops every packet (an IPv6 route that
    does, on a dual-stack host): connections are raced as RFC 8305's Happy Eyeballs
    does, so the second address answers well inside the connect timeout rather than
    the first taking all of it."""
    client = Upstream(connect_timeout=1.5)
    try:
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(0)
            hole = listener.getsockname()[1]
            with socket.create_connection(("127.0.0.1", hole), timeout=2):  # fills the queue
                async with raw_server(keep_answering()) as server:
                    port = int(server.url.removeprefix("http://127.0.0.1:").split("/")[0])
                    stream = (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "")

                    async def resolve(host: str, *_: Any, **__: Any) -> list[Any]:
                        assert host == "dual.test"
                        return [(*stream, ("127.0.0.1", hole)), (*stream, ("127.0.0.1", port))]

                    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", resolve)
                    url = f"http://dual.test:{port}/v1/chat/completions"
                    assert await fetch(client, url) == (200, b'{"ok": true}')
    finally:
        client.close()
        await settle()


def test_a_name_is_raced_under_uvloop_too() -> None:
    """The gateway process serves on uvloop (uvicorn's choice when it is installed),
    whose create_connection has no happy_eyeballs_delay: the race is the proxy's own,
    and a name (here localhost: 127.0.0.1, and ::1 where the host has it) connects."""
    import uvloop

    async def fetch_by_name() -> tuple[int, bytes]:
        client = Upstream(connect_timeout=2.0)
        try:
            async with raw_server(keep_answering()) as server:
                return await fetch(client, server.url.replace("127.0.0.1", "localhost"))
        finally:
            client.close()
            await settle()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert isinstance(runner.get_loop(), uvloop.Loop)
        assert runner.run(fetch_by_name()) == (200, b'{"ok": true}')


@pytest.mark.parametrize(
    "url",
    ["ftp://127.0.0.1/x", "http:///x", "http://user:secret@127.0.0.1:1/x"],
    ids=["scheme", "no-host", "credentials"],
)
@bounded
async def test_urls_it_cannot_use_are_refused(upstream: Upstream, url: str) -> None:
    with pytest.raises(UpstreamError):
        await upstream.post(url, BODY, [])


# --------------------------------------------------------------------------- cancellation


@bounded
async def test_cancelled_while_waiting_for_the_head_closes_the_connection(
    one_slot: Upstream,
) -> None:
    """No timeout waits for the engine's head: cancelling (the proxy does, when its
    client leaves) is the way out, and the engine must see the connection close."""
    request_in, engine_saw_eof = asyncio.Event(), asyncio.Event()

    async def handle(peer: Peer) -> None:
        if peer.index == 0:
            await peer.request()
            request_in.set()
            await peer.client_gone()  # never answers
            engine_saw_eof.set()
            return
        await keep_answering()(peer)

    async with raw_server(handle) as server:
        turn = asyncio.create_task(one_slot.post(server.url, BODY, []))
        await request_in.wait()
        turn.cancel()
        with pytest.raises(asyncio.CancelledError):
            await turn
        await engine_saw_eof.wait()
        # The slot came back (one_slot has one), and the next turn gets a new connection.
        assert await fetch(one_slot, server.url) == (200, b'{"ok": true}')
    assert server.requests_per_connection() == [1, 1]


@bounded
async def test_cancelled_mid_body_closes_the_connection(one_slot: Upstream) -> None:
    """As the proxy does: the task streaming the body is cancelled, its `finally` closes
    the answer, and the engine sees the connection close (and stops generating)."""
    engine_saw_eof = asyncio.Event()

    async def handle(peer: Peer) -> None:
        if peer.index == 0:
            await peer.request()
            await peer.send(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n" + b"x" * 10)
            await peer.client_gone()
            engine_saw_eof.set()
            return
        await keep_answering()(peer)

    async with raw_server(handle) as server:
        answer = await one_slot.post(server.url, BODY, [])
        first_piece = asyncio.Event()

        async def stream() -> None:
            try:
                assert await answer.read() == b"x" * 10
                first_piece.set()
                await answer.read()  # 990 bytes are still to come: waits here
            finally:
                answer.close()

        streaming = asyncio.create_task(stream())
        await first_piece.wait()
        streaming.cancel()
        with pytest.raises(asyncio.CancelledError):
            await streaming
        await engine_saw_eof.wait()
        assert await fetch(one_slot, server.url) == (200, b'{"ok": true}')
    assert server.requests_per_connection() == [1, 1]


# --------------------------------------------------------------------------- header safety


@pytest.mark.parametrize(
    "headers",
    [
        [("x-note", "a\r\nx-injected: 1")],
        [("x-note", "a\nx-injected: 1")],
        [("x-note", "a\rx-injected: 1")],
        [("x-a\r\nx-injected", "1")],
        [("x-ok", "1"), ("x-note", "\r\n\r\nPOST /smuggled HTTP/1.1")],
    ],
    ids=["crlf-value", "lf-value", "cr-value", "crlf-name", "smuggled-request"],
)
@bounded
async def test_a_line_break_in_a_header_is_refused_before_sending(
    one_slot: Upstream, headers: list[tuple[str, str]]
) -> None:
    async with raw_server(keep_answering()) as server:
        with pytest.raises(UpstreamError, match="line break"):
            await one_slot.post(server.url, BODY, headers)
        assert server.accepted == 0  # nothing connected, nothing sent
        # Refused before taking a slot: the next turn (one_slot has one) goes through.
        assert await fetch(one_slot, server.url) == (200, b'{"ok": true}')
    (request,) = server.peers[0].requests
    assert b"injected" not in request.head and b"smuggled" not in request.head


@bounded
async def test_a_header_that_is_not_latin1_is_refused(one_slot: Upstream) -> None:
    async with raw_server(keep_answering()) as server:
        with pytest.raises(UpstreamError, match="not Latin-1"):
            await one_slot.post(server.url, BODY, [("x-note", "✓")])
        assert server.accepted == 0
        assert await fetch(one_slot, server.url) == (200, b'{"ok": true}')


# --------------------------------------------------------------------------- backpressure

# The engine counts as stalled once it sent nothing more for QUIET_S (checked 10 times).
QUIET_S, QUIET_POLLS = 0.5, 10


@bounded
async def test_a_slow_reader_pauses_the_engine(upstream: Upstream) -> None:
    """While nobody reads the body, the client buffers at most about its high-water
    mark; the rest waits in the kernel and the engine stalls.  No event says "nothing
    more will arrive", so the stall is seen as the engine making no progress for
    QUIET_S (a broken client would take the whole body in far less)."""
    total, block = 96 * 1024 * 1024, b"z" * BLOCK
    sent = 0
    all_sent = asyncio.Event()

    async def handle(peer: Peer) -> None:
        nonlocal sent
        await peer.request()
        await peer.send(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % total)
        for _ in range(total // BLOCK):
            peer.writer.write(block)
            await peer.writer.drain()
            sent += BLOCK
        all_sent.set()
        await keep_answering()(peer)

    async with raw_server(handle) as server:
        answer = await upstream.post(server.url, BODY, [])
        try:
            quiet_polls, last_sent = 0, -1
            while not all_sent.is_set() and quiet_polls < QUIET_POLLS:
                await asyncio.sleep(QUIET_S / QUIET_POLLS)
                quiet_polls = quiet_polls + 1 if sent == last_sent else 0
                last_sent = sent
            assert not all_sent.is_set(), "the client took the whole body unread"
            first = await answer.read()
            assert 0 < len(first) <= _PIECE_MAX
            received, largest = len(first), len(first)
            while piece := await answer.read():
                received += len(piece)
                largest = max(largest, len(piece))
        finally:
            answer.close()
        assert received == total
        assert largest <= _PIECE_MAX
        assert await fetch(upstream, server.url) == (200, b'{"ok": true}')
    assert server.requests_per_connection() == [2]


async def test_chunked_trailers_are_not_forwarded_as_headers() -> None:
    answer = (
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nx-head: h\r\n\r\n"
        b"3\r\nabc\r\n0\r\nx-trailer: t\r\n\r\n"
    )

    handled = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(answer)  # head, body and trailer in one write
            await writer.drain()
            await reader.read()  # until the client closes
        finally:
            writer.close()
            await writer.wait_closed()
            handled.set()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    upstream = Upstream(connect_timeout=2.0)
    try:
        got = await upstream.post(f"http://127.0.0.1:{port}/v1/chat/completions", b"{}", [])
        body = b""
        while chunk := await got.read():
            body += chunk
        assert body == b"abc"
        names = [name for name, _ in got.headers]
        assert b"x-head" in names and b"x-trailer" not in names
        got.close()
    finally:
        upstream.close()
        await asyncio.wait_for(handled.wait(), 5)
        server.close()
        await server.wait_closed()
