"""testkit.loopback.serve: servers inside a test session's process."""

from __future__ import annotations

import contextlib
import gc
import signal
import warnings

import pytest
from fastapi import FastAPI

from testkit.loopback import serve


async def test_servers_stopped_in_any_order_leave_the_processs_signal_handlers() -> None:
    """uvicorn installs its handlers for a server's life and restores what it found, so
    two servers stopped out of order left the first one's handler installed after both
    had stopped; sse_starlette reads a stopped server's handler as "shutting down" and
    ends every SSE stream in the process (an MCP client then never gets its answer),
    and the session's SIGTERM no longer unwound it.  In-process servers take no
    signals."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    first, second = contextlib.AsyncExitStack(), contextlib.AsyncExitStack()
    await first.enter_async_context(serve(FastAPI()))
    await second.enter_async_context(serve(FastAPI()))
    await first.aclose()  # out of order: the first stops while the second still runs
    await second.aclose()
    assert {sig: signal.getsignal(sig) for sig in before} == before


async def test_a_server_that_cannot_take_its_port_leaves_no_socket_open() -> None:
    """A port taken (a restart where the old server still listens): the new listening
    socket was left to the collector, whose ResourceWarning then failed whichever test
    it ran in."""
    async with serve(FastAPI()) as url:
        taken = int(url.rsplit(":", 1)[1])
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with pytest.raises(OSError):
                async with serve(FastAPI(), port=taken):
                    pass
            gc.collect()
    assert not [w for w in seen if issubclass(w.category, ResourceWarning)], seen
