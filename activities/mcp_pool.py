"""Connections to the upstream MCP tool servers sub-agents call, one per server.

Each connection is owned by one task for its whole life: the SDK's transports use anyio
cancel scopes, which must be entered and left by the same task, while tool calls come
from many activity tasks at once.  A connection that fails is dropped and reopened by
the next call, so an upstream server that restarts costs one failed (and retried)
activity, not a worker restart.
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

__all__ = ["McpPool", "UnknownTool"]

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 20.0


class UnknownTool(LookupError):
    """No configured server offers the tool."""


class _Connection:
    """One server's client, opened and closed by its owner task."""

    def __init__(self, server: McpServer) -> None:
        self.server = server
        self._ready: asyncio.Future[Client] | None = None
        self._stop = asyncio.Event()
        self._owner: asyncio.Task[None] | None = None

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
        # The transport does not close a client it was given: this block does.
        async with (
            httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30.0, read=None)) as http,
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
                )
        return list(tools.values())

    async def call(
        self, server: str, tool: str, arguments: dict[str, Any], *, key: str | None = None
    ) -> tuple[str, bool]:
        """Call a tool; return its text content and whether the server reported an error.
        `key` goes in `_meta` as the call's idempotency key."""
        conn = self._conns.get(server)
        if conn is None:
            raise UnknownTool(f"no mcp server named '{server}' is configured")
        client = await conn.client()
        try:
            # The SDK puts the current span's `traceparent` in the request's `_meta` (the
            # MCP convention); it has no per-request HTTP headers to carry it as well.
            meta: Any = {IDEMPOTENCY_META_KEY: key} if key else None
            result = await client.call_tool(tool, arguments, meta=meta)
        except Exception:
            conn.drop()
            raise
        parts = []
        for block in result.content:
            text = getattr(block, "text", None)
            parts.append(text if isinstance(text, str) else block.model_dump_json())
        if not parts and result.structured_content is not None:
            parts.append(json.dumps(result.structured_content))
        return "\n".join(parts), bool(result.is_error)

    async def aclose(self) -> None:
        await asyncio.gather(*(c.close() for c in self._conns.values()))
