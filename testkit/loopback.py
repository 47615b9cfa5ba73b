"""Serve an ASGI app on a free loopback port inside the running event loop — the seam
tests use to put real sockets between luftpause and its fakes — or, for the fakes'
command lines, in a process of its own until it is signalled."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

import uvicorn

T = TypeVar("T")

# Bounded wait for startup: 1000 x 10 ms.
_POLLS, _POLL_S = 1000, 0.01


async def read_body(receive: Callable[[], Any]) -> tuple[bytes, Callable[[], Any]]:
    """An ASGI request's whole body, and a `receive` that hands it on to the app it
    goes to as if unread (then whatever the client sends next: its disconnect)."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    body = b"".join(chunks)
    replayed = False

    async def replay() -> Any:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return body, replay


class _SharedProcessServer(uvicorn.Server):
    """A server in a process others share (a test session, a bench): the signals are
    the process's.  uvicorn installs its handlers for a server's life and restores
    what it found, so servers stopped out of order left a stopped one's handler in
    place; sse_starlette reads that as "shutting down" and ends every SSE stream in
    the process, and the session's own SIGTERM handler was lost."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def serve(
    app: Any, *, host: str = "127.0.0.1", port: int = 0, http: Any = "auto"
) -> AsyncIterator[str]:
    """Run `app` under uvicorn on a free port of `host` (or `port`, to restart a server
    where its clients expect it), with uvicorn's `http` protocol (the gateway's:
    gateway/_server.py); yield its base URL; stop it (lifespan shutdown included) when
    the block ends."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit it (Linux): without it, an answer written in two
    # pieces on a kept-alive connection waits ~40 ms for the client's delayed ACK.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))  # (a port taken: closed here, not by the collector)
    except BaseException:
        sock.close()
        raise
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, http=http, ws="none", lifespan="on", access_log=False, log_level="warning"
    )
    server = _SharedProcessServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        for _ in range(_POLLS):
            if server.started or task.done():
                break
            await asyncio.sleep(_POLL_S)
        if task.done():
            task.result()
        if not server.started:
            raise RuntimeError("server did not start within 10 s")
        yield f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    finally:
        server.should_exit = True
        try:
            await task
        finally:
            # Also when the server failed or the wait was cancelled: a listening socket
            # left open was closed by the collector in whatever test ran then, and its
            # ResourceWarning failed that test.
            sock.close()


def serve_until_signalled(
    app: Any, *, host: str, port: int, started: Callable[[], None] = lambda: None
) -> None:
    """Serve `app` with uvicorn in this process until SIGINT or SIGTERM, then return
    normally (exit status 0): the fakes' `--port` mode.  `started` is called once the
    port is bound (a port in use exits non-zero, 3, with uvicorn's error and no
    "serving on")."""

    class _Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:
                started()

        def handle_exit(self, sig: int, frame: Any) -> None:
            # uvicorn re-raises a captured signal after shutdown (exit status 128+n); a
            # fake asked to stop has stopped cleanly, so only note the request.
            if self.should_exit:
                self.force_exit = True
            self.should_exit = True

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        ws="none",
        lifespan="on",
        access_log=False,
        log_level="warning",
        timeout_graceful_shutdown=2,
    )
    _Server(config).run()


@contextlib.contextmanager
def on_own_loop(
    opened: Callable[[], contextlib.AbstractAsyncContextManager[T]], *, timeout: float = 120
) -> Iterator[tuple[T, asyncio.AbstractEventLoop]]:
    """Enter the async context `opened()` makes on an event loop in a thread of its
    own; yield what it yields and that loop (for `asyncio.run_coroutine_threadsafe`);
    exit it there when the block ends.  For synchronous callers of async servers, such
    as hypothesis tests, which cannot run in the test's own loop."""
    started: queue.Queue[tuple[T, asyncio.AbstractEventLoop, asyncio.Event] | BaseException]
    started = queue.Queue()

    async def main() -> None:
        try:
            async with opened() as value:
                stop = asyncio.Event()
                started.put((value, asyncio.get_running_loop(), stop))
                await stop.wait()
        except BaseException as exc:  # handed to the caller's thread
            started.put(exc)
            raise

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    got = started.get(timeout=timeout)
    if isinstance(got, BaseException):
        raise got
    value, loop, stop = got
    try:
        yield value, loop
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=timeout)
