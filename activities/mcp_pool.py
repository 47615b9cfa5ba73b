"""Connections to the upstream MCP tool servers sub-agents call, one per server.

Each connection is owned by one task for its whole life: the SDK's transports use anyio
cancel scopes, which must be entered and left by the same task, while tool calls come
from many activity tasks at once.  A connection that fails is dropped and reopened by
the next call, so an upstream server that restarts costs one failed activity (sent
again: it never reached the server), not a worker restart.  Whether a failed call may
have reached its server is noted by idempotency key (`_Delivery`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx2
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from activities.contract import IDEMPOTENCY_META_KEY, ToolInfo
from luftpause.config import McpServer

__all__ = ["McpPool", "UnknownTool", "Unreachable"]

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 20.0


class UnknownTool(LookupError):
    """No configured server offers the tool."""


class Unreachable(ConnectionError):
    """The server could not be reached to send the call: it was never sent."""


def _call_key(request: httpx2.Request) -> str | None:
    """The idempotency key of a tools/call request (None: not one of ours)."""
    if request.method != "POST":
        return None
    try:
        body = request.content
    except httpx2.RequestNotRead:  # a streamed body: the SDK sends JSON whole
        return None
    if _KEY_BYTES not in body:
        return None
    try:
        key = json.loads(body)["params"]["_meta"][IDEMPOTENCY_META_KEY]
    except (ValueError, KeyError, TypeError):
        return None
    return key if isinstance(key, str) else None


_KEY_BYTES = IDEMPOTENCY_META_KEY.encode()


class _Delivery(httpx2.AsyncBaseTransport):
    """An HTTP server's transport that notes, by idempotency key, whether each tools/call
    may have reached the server: False when the connection could not be made (nothing
    was sent) or the server answered 404 (a session it no longer knows: it ran
    nothing), True once the request was sent otherwise.  A key it never saw was never
    sent.  The SDK reports all of these as one error ("Connection closed", "Session not
    found"); the workflow sends a call again only if it cannot have run."""

    def __init__(self, reached: dict[str, bool]) -> None:
        self._inner = httpx2.AsyncHTTPTransport()
        self._reached = reached

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        key = _call_key(request)
        if key is None:
            return await self._inner.handle_async_request(request)
        self._reached[key] = True
        try:
            response = await self._inner.handle_async_request(request)
        except (httpx2.ConnectError, httpx2.ConnectTimeout):
            self._reached[key] = False
            raise
        if response.status_code == 404:
            self._reached[key] = False
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


class _Connection:
    """One server's client, opened and closed by its owner task."""

    def __init__(self, server: McpServer) -> None:
        self.server = server
        self._ready: asyncio.Future[Client] | None = None
        self._stop = asyncio.Event()
        self._owner: asyncio.Task[None] | None = None
        # HTTP servers: whether a call (by idempotency key) may have reached the server.
        self.reached: dict[str, bool] | None = {} if server.command is None else None

    @contextlib.asynccontextmanager
    async def _client(self) -> AsyncIterator[Client]:
        s = self.server
        if s.command is not None:
            env = {**os.environ, **s.env} if s.env else None
            params = StdioServerParameters(command=s.command[0], args=s.command[1:], env=env)
            async with Client(params, mode=s.protocol) as client:
                yield client
            return
        assert s.url is not None
        headers = {}
        token = os.environ.get(s.token_env, "").strip() if s.token_env else ""
        if token:  # stripped: a token file's newline would be an illegal header
            headers["authorization"] = f"Bearer {token}"
        assert self.reached is not None
        # The transport does not close a client it was given: this block does.
        async with (
            httpx2.AsyncClient(
                headers=headers,
                timeout=httpx2.Timeout(30.0, read=None),
                transport=_Delivery(self.reached),
            ) as http,
            Client(streamable_http_client(s.url, http_client=http), mode=s.protocol) as client,
        ):
            yield client

    async def _own(self, ready: asyncio.Future[Client]) -> None:
        try:
            async with self._client() as client:
                ready.set_result(client)
                await self._stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(
                    ConnectionError(f"mcp server '{self.server.name}': {type(exc).__name__}: {exc}")
                )
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            if self._ready is ready:
                self._ready = None

    async def client(self) -> Client:
        if self._ready is None:
            self._stop = asyncio.Event()
            self._ready = asyncio.get_running_loop().create_future()
            self._owner = asyncio.create_task(self._own(self._ready))
        ready = self._ready
        try:
            return await asyncio.wait_for(asyncio.shield(ready), CONNECT_TIMEOUT_S)
        except (TimeoutError, ConnectionError):
            self.drop()
            raise

    def drop(self) -> None:
        """Close this connection; the next call reopens it."""
        self._ready = None
        self._stop.set()

    async def close(self) -> None:
        self.drop()
        if self._owner is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(self._owner, 5)


class McpPool:
    """The configured upstream MCP servers: list their tools, call one."""

    def __init__(self, servers: Sequence[McpServer]) -> None:
        self._conns = {s.name: _Connection(s) for s in servers}

    @property
    def servers(self) -> list[str]:
        return list(self._conns)

    async def list_tools(self) -> list[ToolInfo]:
        """Every server's tools; when two servers offer one name, the first listed wins."""
        tools: dict[str, ToolInfo] = {}
        for name, conn in self._conns.items():
            try:
                client = await conn.client()
                listing = await client.list_tools()
            except Exception:
                conn.drop()
                raise
            for tool in listing.tools:
                if tool.name in tools:
                    log.warning(
                        "tool %r of mcp server %r is shadowed by %r's",
                        tool.name,
                        name,
                        tools[tool.name].server,
                    )
                    continue
                notes = tool.annotations
                tools[tool.name] = ToolInfo(
                    server=name,
                    name=tool.name,
                    description=tool.description or "",
                    input_schema=dict(tool.input_schema or {"type": "object"}),
                    read_only=bool(notes and notes.read_only_hint),
                    destructive=bool(notes and notes.destructive_hint),
                    idempotent=bool(notes and notes.idempotent_hint),
                )
        return list(tools.values())

    async def call(
        self, server: str, tool: str, arguments: dict[str, Any], *, key: str | None = None
    ) -> tuple[str, bool]:
        """Call a tool; return its text content and whether the server reported an error.
        `key` goes in `_meta` as the call's idempotency key.  `Unreachable`: the call was
        not sent (the connection or session could not be opened); any other error may
        come after the server ran it."""
        conn = self._conns.get(server)
        if conn is None:
            raise UnknownTool(f"no mcp server named '{server}' is configured")
        try:
            client = await conn.client()
        except Exception as exc:
            raise Unreachable(f"{type(exc).__name__}: {exc}") from exc
        reached = conn.reached if key else None
        try:
            # The SDK puts the current span's `traceparent` in the request's `_meta` (the
            # MCP convention); it has no per-request HTTP headers to carry it as well.
            meta: Any = {IDEMPOTENCY_META_KEY: key} if key else None
            result = await client.call_tool(tool, arguments, meta=meta)
        except Exception as exc:
            conn.drop()
            if reached is not None and not reached.get(key or "", False):
                why = f"{type(exc).__name__}: {exc}"
                raise Unreachable(f"the call did not reach it: {why}") from exc
            raise
        finally:
            if reached is not None:
                reached.pop(key or "", None)
        parts = []
        for block in result.content:
            text = getattr(block, "text", None)
            parts.append(text if isinstance(text, str) else block.model_dump_json())
        if not parts and result.structured_content is not None:
            parts.append(json.dumps(result.structured_content))
        return "\n".join(parts), bool(result.is_error)

    async def aclose(self) -> None:
        await asyncio.gather(*(c.close() for c in self._conns.values()))
