"""Small HTTP helpers the gateway's modules share, and `Upstream`: the lean HTTP/1.1
client that carries proxied turns to the engines.

Why not httpx for turns: on the 2-vCPU development machine an httpx request to an
instant engine costs about 1.8 ms of CPU (httpcore's pool scans and probes every
connection per request, then anyio and h11 layers), aiohttp about 0.4 ms, and this
client about 0.1 ms; the gateway's goal is ≤ 1 ms added in all (bench/RESULTS.md).
It does only what a turn needs: POST a body, read the status and headers, hand the
body on as it arrives, keep connections alive per engine.  httptools (the C parser
uvicorn[standard] already brings) parses the answers.  The prober and /v1/decide keep
using httpx.  Unlike httpx it does not route through HTTP(S)_PROXY from the environment:
engines are reached directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import socket
import ssl
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import httptools
import httpx
from starlette.types import Message, Receive

from luftpause.config import is_address
from luftpause.net import KEEPALIVE

__all__ = [
    "MAX_CONNECTIONS",
    "MAX_IDLE_PER_ENGINE",
    "Upstream",
    "UpstreamAnswer",
    "UpstreamError",
    "describe_http_error",
    "wait_disconnect",
]


def no_answer(status: int, location: bytes | None) -> str | None:
    """Why an engine's status is no answer to a turn (None: it is one): a status HTTP
    does not have (the server could not even send it on), a redirect (luftpause posts
    to the endpoint's URL only), or an answer without a body."""
    if not 200 <= status < 600:
        return f"answered status {status}, which HTTP does not have"
    if 300 <= status < 400:
        where = f" to {location.decode('latin-1')[:200]}" if location else ""
        return (
            f"answered {status} (a redirect{where}); luftpause does not follow redirects: "
            "set the endpoint's url to where it points"
        )
    if status in (204, 205):
        return f"answered {status} without a body"
    return None


_log = logging.getLogger(__name__)


def credentials_refused(replica: str, said: str) -> str:
    """What the client is told of an engine's 401: luftpause sends the engine its own
    credentials, never the client's, so the refusal is the gateway's to fix (passed
    on, the client would take its own key for wrong: helper-133).  What the engine
    `said` goes to the gateway's log only (it may quote the key)."""
    _log.warning("engine %s answered 401 to luftpause's key: %s", replica, said[:2048])
    return (
        f"engine {replica}: refused luftpause's credentials for it (401); the gateway's "
        "operator should check the endpoint's api_key_env"
    )


def no_answer_of(response: httpx.Response) -> str | None:
    """`no_answer` of an httpx response (the probe's, /v1/decide's, count_tokens')."""
    location = response.headers.get("location")
    return no_answer(
        response.status_code, location.encode("latin-1", "replace") if location else None
    )


def describe_http_error(exc: httpx.HTTPError) -> str:
    """What went wrong talking to an engine, for `engine <replica>: <error>` and /status."""
    if isinstance(exc, httpx.ConnectTimeout):
        return "connect timeout"
    if isinstance(exc, httpx.ConnectError):
        return f"cannot connect ({exc})" if str(exc) else "cannot connect"
    if isinstance(exc, httpx.LocalProtocolError):
        # Its text quotes the offending header, which may be the endpoint's key.
        return "the request could not be sent (check the endpoint's url and api_key_env)"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def wait_disconnect(receive: Receive) -> None:
    """Return when the client hangs up (its request body already read)."""
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            return


# --------------------------------------------------------------------------- upstream

# Connections open at once across all engines (a turn beyond waits for one), and idle
# ones kept per engine between turns — the limits the httpx client had.
MAX_CONNECTIONS = 4096
MAX_IDLE_PER_ENGINE = 512
# Answer bytes buffered for a slow client before reading from the engine pauses.
_HIGH_WATER = 256 * 1024
# A request sent on an idle keep-alive connection that the engine closes unanswered
# within this time is sent again on a new one: the close crossed the request (the
# engine's keep-alive timer), so it never read it.  Closed later, the engine read it
# and gave up on it (a crash, an out-of-memory kill): sending it again would run it
# twice, or bring the same engine down twice.  A round trip to the farthest engine.
RESEND_WINDOW_S = 0.5
# ... and only when the connection had been idle this long: no engine's keep-alive
# timer is shorter (uvicorn's, SGLang's and vLLM's, 5 s; llama-server's 5 s; nginx
# 75 s), so a connection used a moment ago that closes on a request was closed by an
# engine that read it (helper-112: resent within 0.1 s of its first try).
RESEND_IDLE_S = 1.0


HAPPY_EYEBALLS_DELAY_S = 0.25


def _interleaved(infos: Sequence[tuple[object, ...]]) -> list[str]:
    """A name's addresses, families alternating from the first one's (RFC 8305 §4)."""
    hosts = list(dict.fromkeys(cast(tuple[str, int], info[4])[0] for info in infos))
    first = [h for h in hosts if (":" in h) == (":" in hosts[0])]
    other = [h for h in hosts if h not in first]
    return [h for pair in itertools.zip_longest(first, other) for h in pair if h is not None]


async def _race(
    attempt: Callable[[str], Awaitable[_Connection]], hosts: list[str], delay: float
) -> _Connection:
    """Happy Eyeballs (RFC 8305), in the event loop's terms (uvloop, which serves the
    gateway, has no `happy_eyeballs_delay`): connect to the first address, start the
    next one `delay` later or as soon as an attempt fails; the first to connect wins,
    the others are cancelled (or closed, if they connected too).  On a host whose IPv6
    route drops packets, the IPv4 address answers inside the connect timeout instead of
    the first address taking all of it."""
    pending: set[asyncio.Task[_Connection]] = set()
    error: BaseException = OSError(f"no address for {hosts!r}")
    try:
        for i, host in enumerate(hosts):
            pending.add(asyncio.ensure_future(attempt(host)))
            last = i == len(hosts) - 1
            while pending:
                done, pending = await asyncio.wait(
                    pending, timeout=None if last else delay, return_when=asyncio.FIRST_COMPLETED
                )
                won = [t.result() for t in done if t.exception() is None]
                error = next((e for t in done if (e := t.exception()) is not None), error)
                if won:
                    for extra in won[1:]:
                        extra.close()
                    return won[0]
                if not last:
                    break  # the delay passed, or an attempt failed: start the next one
        raise error
    finally:
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(BaseException):
                (await task).close()


class UpstreamError(Exception):
    """Talking to an engine failed; the message says how (`connect timeout`,
    `cannot connect (...)`, ...), for `engine <replica>: <error>`."""


@dataclass(frozen=True, slots=True)
class _Origin:
    host: str
    port: int
    tls: bool
    host_header: str
    literal: bool  # host is an IP address: no resolution, nothing to race


# URLs whose parse is kept: one per endpoint and API, far more than a pool has; past
# this (pods replaced for months under discovery) the cache starts over.
MAX_TARGETS = 4096


class _Connection(asyncio.Protocol):
    """One keep-alive connection to an engine, one exchange at a time.  httptools
    parses the answer; its body waits in `chunks` until the proxy reads it."""

    def __init__(self, origin: _Origin) -> None:
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.closed = False
        # Set while the connection waits idle in its Upstream: called if the engine
        # closes it there, so that the Upstream lets it go.
        self.on_idle_lost: Callable[[_Connection], None] | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self.idle_since: float | None = None  # loop time it went idle in its Upstream
        self._idle_for = 0.0  # how long it had been idle when the request went out
        self._begin()

    def _begin(self) -> None:
        self.busy = False
        self.status = 0  # 0 until the final (non-1xx) head is parsed
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.complete = False
        self.keep_alive = False
        self.error: UpstreamError | None = None
        self._until_close = False  # the body ends when the engine closes
        self._answered = False  # a byte of the answer arrived
        self._sent_at = 0.0  # loop time the request went out
        self._closed_after = math.inf  # seconds from then until the engine closed

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        # A turn waits for its engine's answer as long as the turn timeout (10 min): an
        # engine host gone without closing the connection (a node lost) is noticed by
        # keepalive within ~60 s, and the turn fails then (helper-181).
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                for option in KEEPALIVE:
                    sock.setsockopt(*option)

    def data_received(self, data: bytes) -> None:
        if not self.busy or self.complete:  # bytes nobody asked for: unusable
            self.keep_alive = False
            self.close()
            return
        self._answered = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"bad HTTP answer: {exc}")
            self.close()

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost ends the answer

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.on_idle_lost is not None:
            forget, self.on_idle_lost = self.on_idle_lost, None
            forget(self)
        if self.busy:
            self._closed_after = asyncio.get_running_loop().time() - self._sent_at
        if self.busy and not self.complete:
            if self.status and self._until_close and exc is None:
                self.complete = True
            elif self.status:
                self._fail(f"engine closed the connection mid-answer{_cause(exc)}")
            else:
                self._fail(f"engine closed the connection without answering{_cause(exc)}")
        self._wake()

    # -- httptools callbacks

    def on_message_begin(self) -> None:
        if self.complete:  # a second answer to one request: stop parsing, close
            raise UpstreamError("the engine sent more than one answer")

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.status:  # a chunked body's trailer fields: never forwarded as headers
            return
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:  # an interim answer (100 Continue): the real one follows
            self.headers = []
            return
        self.status = status
        names = {name for name, _ in self.headers}
        chunked = any(
            name == b"transfer-encoding" and b"chunked" in value.lower()
            for name, value in self.headers
        )
        self._until_close = (
            b"content-length" not in names and not chunked and status not in (204, 304)
        )
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.status:  # not the end of an interim answer
            self.complete = True
            self.keep_alive = self._parser.should_keep_alive()
            self._wake()

    # -- used by Upstream and UpstreamAnswer

    async def exchange(self, data: bytes) -> None:
        """Send a request; return once the answer's head is in (raise UpstreamError if
        it cannot come)."""
        self._begin()
        self.busy = True
        assert self.transport is not None
        self._sent_at = asyncio.get_running_loop().time()
        idle_since, self.idle_since = self.idle_since, None
        self._idle_for = 0.0 if idle_since is None else self._sent_at - idle_since
        self.transport.write(data)
        while not self.status:
            if self.error is not None:
                raise self.error
            await self.wait()

    @property
    def unanswered(self) -> bool:
        """Closed by the engine before a byte of the answer arrived, as the request went
        out (within RESEND_WINDOW_S) on a connection idle long enough for a keep-alive
        timer (RESEND_IDLE_S): it crossed the close and was never read."""
        return (
            self.closed
            and not self._answered
            and self._closed_after <= RESEND_WINDOW_S
            and self._idle_for >= RESEND_IDLE_S
        )

    async def wait(self) -> None:
        """Until something arrives: the head, body, the end, or an error."""
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def take(self) -> bytes:
        """Everything buffered so far, as one piece."""
        data = self.chunks.popleft() if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks.clear()
        self.buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    def reusable(self) -> bool:
        closing = self.transport is None or self.transport.is_closing()
        return (
            self.complete
            and self.keep_alive
            and not self.closed
            and not closing
            and not self.chunks
        )

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _fail(self, message: str) -> None:
        if self.error is None:
            self.error = UpstreamError(message)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def _cause(exc: Exception | None) -> str:
    return f" ({exc})" if exc is not None and str(exc) else ""


class UpstreamAnswer:
    """An engine's answer: status and headers at once, the body as it arrives.
    `close()` it exactly once: read to the end, its connection is kept for the next
    turn; otherwise the connection is closed (mid-answer, that stops the engine)."""

    __slots__ = ("_conn", "_upstream", "headers", "status")

    def __init__(self, upstream: Upstream, conn: _Connection) -> None:
        self._upstream = upstream
        self._conn: _Connection | None = conn
        self.status = conn.status
        # Lower-cased names, in the engine's order, repeated headers kept apart.
        self.headers = conn.headers

    @property
    def complete(self) -> bool:
        """The whole body has arrived (what `read` has not returned yet is buffered)."""
        return self._conn is not None and self._conn.complete

    def header(self, name: bytes) -> bytes | None:
        """The first value of a header (name lower-case)."""
        return next((v for k, v in self.headers if k == name), None)

    async def read(self) -> bytes:
        """The next piece of the body (all that has arrived); b"" once it is complete.
        Raises UpstreamError when the engine fails before the end."""
        conn = self._conn
        assert conn is not None, "read after close"
        while not conn.chunks:
            if conn.complete:
                return b""
            if conn.error is not None:
                raise conn.error
            await conn.wait()
        return conn.take()

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._upstream.release(conn)


class Upstream:
    """Keep-alive HTTP/1.1 (or HTTPS) connections to the engines, for proxied turns."""

    def __init__(self, *, connect_timeout: float) -> None:
        self._connect_timeout = connect_timeout
        self._targets: dict[str, tuple[_Origin, str]] = {}
        self._idle: dict[_Origin, list[_Connection]] = {}
        self._slots = asyncio.Semaphore(MAX_CONNECTIONS)
        self._tls: ssl.SSLContext | None = None
        self._closed = False  # close() ran: a turn that ends later closes its connection

    async def post(
        self, url: str, body: bytes, headers: Sequence[tuple[str, str]], *, query: bytes = b""
    ) -> UpstreamAnswer:
        """Send `body` to `url` (with the client's `query` string, as it came); return
        once the engine's status and headers are in.  Cancelled meanwhile, the
        connection is closed (the engine sees the client go).  Raises UpstreamError
        when the engine cannot be reached or answers nothing."""
        origin, target = self._target(url)
        if query:  # (not in the URL: the cache of parsed URLs stays one per endpoint)
            target += ("&" if "?" in target else "?") + query.decode("latin-1")
        head = [f"POST {target} HTTP/1.1", f"host: {origin.host_header}"]
        head += [f"{name}: {value}" for name, value in headers]
        head.append(f"content-length: {len(body)}")
        text = "\r\n".join(head)
        if text.count("\n") != len(head) - 1 or text.count("\r") != len(head) - 1:
            raise UpstreamError("a request header contains a line break")
        try:
            data = (text + "\r\n\r\n").encode("latin-1") + body
        except UnicodeEncodeError:
            raise UpstreamError("a request header is not Latin-1") from None
        await self._slots.acquire()
        conn = self._idle_connection(origin)
        try:
            if conn is not None:
                try:
                    await conn.exchange(data)
                except UpstreamError:
                    if not conn.unanswered:
                        raise
                    # The engine closed this idle connection as the request went out,
                    # without a byte of answer: its keep-alive timeout, most likely, so
                    # it never read the request.  Once more, on a new connection.
                    # (Closed later, it did read it: that failure is the turn's.)
                    conn = None
            if conn is None:
                conn = await self._connect(origin)
                await conn.exchange(data)
        except BaseException:
            if conn is not None:
                conn.close()
            self._slots.release()
            raise
        return UpstreamAnswer(self, conn)

    def release(self, conn: _Connection) -> None:
        """An exchange is over: keep the connection if it can carry another, else close."""
        self._slots.release()
        conn.busy = False
        idle = self._idle.setdefault(conn.origin, [])
        if len(idle) >= MAX_IDLE_PER_ENGINE:
            idle[:] = [c for c in idle if not c.closed]  # the engine closed some
        if conn.reusable() and len(idle) < MAX_IDLE_PER_ENGINE and not self._closed:
            idle.append(conn)
            conn.on_idle_lost = self._lost_idle
            conn.idle_since = asyncio.get_running_loop().time()
        else:
            if not idle:
                del self._idle[conn.origin]
            conn.close()

    def _lost_idle(self, conn: _Connection) -> None:
        """The engine closed an idle connection (its keep-alive timeout, or it left):
        let it go, and the engine's list once it is empty (an engine discovery replaced
        keeps nothing here)."""
        idle = self._idle.get(conn.origin)
        if idle is None or conn not in idle:
            return
        idle.remove(conn)
        if not idle:
            del self._idle[conn.origin]

    def close(self) -> None:
        """Close the idle connections; turns in flight close their own when they end
        (kept after this, one would stay open until collected)."""
        self._closed = True
        idles = list(self._idle.values())
        self._idle.clear()
        for idle in idles:
            for conn in idle:
                conn.on_idle_lost = None
                conn.close()

    def _idle_connection(self, origin: _Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()  # the most recently used: least likely to time out
            conn.on_idle_lost = None
            if not idle:
                del self._idle[origin]
            if not conn.closed:
                return conn
        return None

    async def _connect(self, origin: _Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        tls = self._tls_context() if origin.tls else None

        async def attempt(host: str) -> _Connection:
            _, conn = await loop.create_connection(
                lambda: _Connection(origin),
                host,
                origin.port,
                ssl=tls,
                server_hostname=origin.host if tls is not None else None,
            )
            return conn

        try:
            async with asyncio.timeout(self._connect_timeout):
                if origin.literal:
                    return await attempt(origin.host)
                infos = await loop.getaddrinfo(origin.host, origin.port, type=socket.SOCK_STREAM)
                return await _race(attempt, _interleaved(infos), HAPPY_EYEBALLS_DELAY_S)
        except TimeoutError:
            raise UpstreamError("connect timeout") from None
        except OSError as exc:
            raise UpstreamError(
                f"cannot connect ({exc})" if str(exc) else "cannot connect"
            ) from None

    def _target(self, url: str) -> tuple[_Origin, str]:
        known = self._targets.get(url)
        if known is None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise UpstreamError(f"not an http(s) URL: {url!r}")
            if parts.username is not None or parts.password is not None:
                raise UpstreamError("credentials in the endpoint URL are not supported")
            tls = parts.scheme == "https"
            origin = _Origin(
                host=parts.hostname,
                port=parts.port or (443 if tls else 80),
                tls=tls,
                host_header=parts.netloc,
                literal=is_address(parts.hostname),
            )
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            if len(self._targets) >= MAX_TARGETS:
                self._targets.clear()  # engines come and go (discovery): start over
            known = self._targets[url] = (origin, target)
        return known

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = httpx.create_ssl_context()  # the CA bundle httpx trusts, too
        return self._tls
