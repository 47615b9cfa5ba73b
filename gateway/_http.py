"""Small HTTP helpers the gateway's modules share."""

from __future__ import annotations

import httpx
from starlette.types import Message, Receive

__all__ = ["describe_http_error", "wait_disconnect"]


def describe_http_error(exc: httpx.HTTPError) -> str:
    """What went wrong talking to an engine, for `engine <replica>: <error>` and /status."""
    if isinstance(exc, httpx.ConnectTimeout):
        return "connect timeout"
    if isinstance(exc, httpx.ConnectError):
        return f"cannot connect ({exc})" if str(exc) else "cannot connect"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def wait_disconnect(receive: Receive) -> None:
    """Return when the client hangs up (its request body already read)."""
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            return
