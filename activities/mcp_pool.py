"""Connections to the upstream MCP tool servers sub-agents call, one per server.

Each connection is owned by one task for its whole life: the SDK's transports use anyio
cancel scopes, which must be entered and left by the same task, while tool calls come
from many activity tasks at once.  A connection that fails is dropped and reopened by
the next call, so an upstream server that restarts costs one failed activity (sent
again: it never reached the server), not a worker restart.  Whether a failed call may
have reached an HTTP server is noted by idempotency key (`_Delivery`).  A stdio server
gives no such sign: a call that fails on it may have run.  But a stdio server's output
that has ended (the process exited while idle) is noted (`_Watched`), and the next call
or listing opens a new process rather than fail on the dead one: the first call after
the death was answered "Connection closed" by the SDK without being written, and a
tool that is not repeatable was told as of unknown outcome (helper-114).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any

import anyio
import httpx2
from mcp import Client
from mcp.client.stdio import StdioServerParameters, get_default_environment, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import (
    CONNECTION_CLOSED,
    INVALID_PARAMS,
    METHOD_NOT_FOUND,
    PARSE_ERROR,
    REQUEST_TIMEOUT,
    AudioContent,
    ContentBlock,
    EmbeddedResource,
    ImageContent,
    ResourceLink,
    TextContent,
    TextResourceContents,
)

from activities.contract import IDEMPOTENCY_META_KEY, ToolInfo
from activities.tool_names import function_names
from luftpause.config import McpServer

__all__ = ["CallTimedOut", "Listing", "McpPool", "ServerAnswered", "UnknownTool", "Unreachable"]

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 20.0
# One tools/list page: a server whose connection is open but which no longer answers
# it is given up after this, inside the run's 30 s listing (its opening has
# CONNECT_TIMEOUT_S).  Per page, not for all of them: a healthy server with many pages
# takes as long as it takes.
LIST_PAGE_TIMEOUT_S = 10.0
# Pages of a server's tools/list read at most (a server that hands back a cursor for
# ever would otherwise hold the listing for ever).
MAX_TOOL_PAGES = 100
# JSON-RPC errors by which a server says it did not run the call: no such tool or
# method, or arguments it refuses.  The model is told; nothing is sent again.
_REFUSED = frozenset({METHOD_NOT_FOUND, INVALID_PARAMS})
# JSON-RPC errors the SDK makes up when no answer came (the connection closed, the
# request timed out, a body it could not read): never taken for the server's answer.
_NO_ANSWER = frozenset({CONNECTION_CLOSED, REQUEST_TIMEOUT, PARSE_ERROR})


class CallTimedOut(TimeoutError):
    """A call sent and not answered within its time: cut (it may have run)."""


class UnknownTool(LookupError):
    """No configured server offers the tool."""


class ServerAnswered(RuntimeError):
    """An HTTP server answered a call with an error status and no JSON-RPC answer: the
    call failed, and may have run; the connection is sound and stays open."""


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
    """Wraps a transport of an HTTP server's client (the direct one, and each proxy one
    httpx builds from the environment) and notes, by idempotency key, whether each
    tools/call may have reached the server: False when the connection could not be
    made (nothing was sent) or the server answered 404 (a session it no longer knows:
    it ran nothing), True once the request was sent otherwise.  A key it never saw was
    never sent.  The SDK reports all of these as one error ("Connection closed",
    "Session not found"); the workflow sends a call again only if it cannot have run.
    It also notes in `replied` the calls the server answered in JSON-RPC (a JSON or
    event-stream body, or a JSON-RPC error at an error status): a JSON-RPC error the
    SDK raises for one of those is the server's, not one it made up for an HTTP error.
    And in `statuses` the error status of a call answered with one and no JSON-RPC
    (a 500 from the server, a 502 or 504 from a proxy before it): an answer to that
    request alone, on a connection that is sound."""

    def __init__(
        self,
        inner: httpx2.AsyncBaseTransport,
        reached: dict[str, bool],
        replied: set[str],
        errors: list[int],
        statuses: dict[str, int],
    ) -> None:
        self._inner = inner
        self._reached = reached
        self._replied = replied
        self._errors = errors  # the last error status of another request (the SDK drops it)
        self._statuses = statuses

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        key = _call_key(request)
        if key is None:
            response = await self._inner.handle_async_request(request)
            if response.status_code >= 400:
                self._errors[:] = [response.status_code]
            return response
        self._reached[key] = True
        try:
            response = await self._inner.handle_async_request(request)
        except (httpx2.ConnectError, httpx2.ConnectTimeout, httpx2.PoolTimeout):  # not sent
            if key in self._reached:
                self._reached[key] = False
            raise
        if key not in self._reached:
            # The call is over (cut at its tool's time, or cancelled) and its notes gone:
            # a late answer is noted nowhere.  (helper-120: a late error status raised
            # KeyError here, which closed the connection with other runs' calls on it.)
            return response
        status = response.status_code
        if status < 300:
            kind = (response.headers.get("content-type") or "").lower()
            if kind.startswith(("application/json", "text/event-stream")):
                self._replied.add(key)
            return response
        code = await _error_code(response)
        if status == 404:
            # A session or server gone, which ran nothing, unless the 404 is the server's
            # own answer that it ran nothing (2026-07-28 sends METHOD_NOT_FOUND so).
            self._reached[key] = code in _REFUSED
        if code is not None and self._reached[key]:
            self._replied.add(key)  # (a session it does not know is no answer to the call)
        elif code is None and status != 404:
            self._statuses[key] = status
        return response

    async def __aenter__(self) -> _Delivery:
        await self._inner.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self._inner.__aexit__(*exc_info)

    async def aclose(self) -> None:
        await self._inner.aclose()


async def _error_code(response: httpx2.Response) -> int | None:
    """The code of the JSON-RPC error an error status carries, if it carries one (read
    whole: it is short, and the SDK reads it from the buffer after)."""
    if not (response.headers.get("content-type") or "").startswith("application/json"):
        return None
    try:
        body = json.loads(await response.aread())
        code = body["error"]["code"] if isinstance(body, dict) else None
    except (ValueError, KeyError, TypeError, RecursionError, httpx2.HTTPError):
        return None
    return code if isinstance(code, int) and not isinstance(code, bool) else None


def _noting_delivery(
    http: httpx2.AsyncClient,
    reached: dict[str, bool],
    replied: set[str],
    errors: list[int],
    statuses: dict[str, int],
) -> httpx2.AsyncClient:
    """`http` with every transport it may use wrapped in `_Delivery`.  (Given as
    `transport=`, a transport would turn off the proxies httpx takes from
    HTTP(S)_PROXY, so the ones it built are wrapped instead.)"""
    http._transport = _Delivery(http._transport, reached, replied, errors, statuses)
    http._mounts = {
        pattern: None if t is None else _Delivery(t, reached, replied, errors, statuses)
        for pattern, t in http._mounts.items()
    }
    return http


# How long a failed call waits for its connection to close before it says whether the
# call may have reached the server: until then, requests the SDK queued may still go.
SETTLE_TIMEOUT_S = 5.0


class _Generation:
    """One opening of a server's connection: its client (once ready), what stops it,
    the task that owns it, and whether the server's output has ended (a stdio server's
    process exited: nothing sent on this opening reaches it)."""

    __slots__ = ("ended", "owner", "ready", "stop")

    def __init__(self) -> None:
        self.ready: asyncio.Future[Client] = asyncio.get_running_loop().create_future()
        self.stop = asyncio.Event()
        self.owner: asyncio.Task[None] | None = None
        self.ended = False


class _Watched:
    """A transport's read stream that notes its end on the opening (`ended`); the rest
    is the stream's own."""

    def __init__(self, stream: Any, gen: _Generation) -> None:
        self._stream = stream
        self._gen = gen

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    async def receive(self) -> Any:
        try:
            return await self._stream.receive()
        except anyio.EndOfStream:
            self._gen.ended = True
            raise

    def __aiter__(self) -> _Watched:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def __aenter__(self) -> _Watched:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


@contextlib.asynccontextmanager
async def _watched_stdio(params: StdioServerParameters, gen: _Generation) -> AsyncIterator[Any]:
    """`stdio_client`, with its read stream watched for the process's end."""
    async with stdio_client(params) as (read, write):
        yield _Watched(read, gen), write


class _Connection:
    """One server's client, opened and closed by its owner task."""

    def __init__(self, server: McpServer) -> None:
        self.server = server
        self._gen: _Generation | None = None
        # HTTP servers: whether a call (by idempotency key) may have reached the server.
        self.reached: dict[str, bool] | None = {} if server.command is None else None
        self.replied: set[str] = set()  # HTTP servers: calls answered in JSON-RPC (by key)
        self.errors: list[int] = []  # HTTP servers: the last error status, for messages
        # HTTP servers: calls answered with an error status and no JSON-RPC (by key)
        self.statuses: dict[str, int] = {}

    @contextlib.asynccontextmanager
    async def _client(self, gen: _Generation) -> AsyncIterator[Client]:
        s = self.server
        if s.command is not None:
            # The SDK's safe default (HOME, PATH, ...) and the server's own: not the
            # worker's whole environment, which holds its tokens.
            env = {**get_default_environment(), **s.env} if s.env else None
            params = StdioServerParameters(command=s.command[0], args=s.command[1:], env=env)
            async with Client(_watched_stdio(params, gen), mode=s.protocol) as client:
                yield client
            return
        assert s.url is not None
        headers = {}
        token = os.environ.get(s.token_env, "").strip() if s.token_env else ""
        if token:  # stripped: a token file's newline would be an illegal header
            headers["authorization"] = f"Bearer {token}"
        assert self.reached is not None
        # A call in flight holds a connection: as many as the worker runs activities
        # (1,000), not httpx's 100, and none waits for one to come free (its 30 s wait
        # failed the call, and with it the connection and every call on it: helper-160).
        http = httpx2.AsyncClient(
            headers=headers,
            timeout=httpx2.Timeout(30.0, read=None, pool=None),
            limits=httpx2.Limits(max_connections=None, max_keepalive_connections=64),
        )
        # The transport does not close a client it was given: this block does.
        async with (
            _noting_delivery(http, self.reached, self.replied, self.errors, self.statuses),
            Client(streamable_http_client(s.url, http_client=http), mode=s.protocol) as client,
        ):
            yield client

    async def _own(self, gen: _Generation) -> None:
        self.errors.clear()
        try:
            async with self._client(gen) as client:
                gen.ready.set_result(client)
                await gen.stop.wait()
        except BaseException as exc:
            if not gen.ready.done():
                leaf = _leaf(exc)  # the SDK's task groups wrap the cause (a 401, a refusal)
                why = f"{type(leaf).__name__}: {leaf}"
                if self.errors:  # the SDK says "Server returned an error response"
                    why += f" (HTTP {self.errors[0]})"
                gen.ready.set_exception(ConnectionError(f"mcp server '{self.server.name}': {why}"))
                gen.ready.exception()  # read: no "never retrieved" when no one waits
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            if self._gen is gen:
                self._gen = None

    async def client(self) -> tuple[Client, _Generation]:
        """The open client (opened if need be) and the opening it belongs to.  An
        opening whose server's output ended (a stdio process that exited) is closed and
        a new one made: whatever was sent on it would reach no one."""
        gen = self._gen
        if gen is not None and gen.ended:
            log.warning("mcp server %r: its process exited; starting it again", self.server.name)
            self.drop(gen)
            gen = None
        if gen is None:
            gen = self._gen = _Generation()
            gen.owner = asyncio.create_task(self._own(gen))
        try:
            return await asyncio.wait_for(asyncio.shield(gen.ready), CONNECT_TIMEOUT_S), gen
        except TimeoutError:
            self.drop(gen)
            raise ConnectionError(
                f"mcp server '{self.server.name}': not open within {CONNECT_TIMEOUT_S:g} s"
            ) from None
        except ConnectionError:
            self.drop(gen)
            raise

    def drop(self, gen: _Generation | None = None) -> None:
        """Close an opening (default: the current one); the next call opens anew.  An
        opening that was replaced meanwhile leaves the new one alone."""
        gen = gen or self._gen
        if gen is None:
            return
        gen.stop.set()
        if not gen.ready.done():
            # Still opening (a server that never answers `initialize`): the owner would
            # never see `stop`, and its process or connection would stay for ever.  Its
            # waiters are answered here: an owner cancelled before it ran answers no one.
            gen.ready.set_exception(
                ConnectionError(f"mcp server '{self.server.name}': gave up opening it")
            )
            gen.ready.exception()  # read: no "never retrieved" when no one waits
            if gen.owner is not None:
                gen.owner.cancel()
        if self._gen is gen:
            self._gen = None

    async def settle(self, gen: _Generation, timeout: float = SETTLE_TIMEOUT_S) -> bool:
        """Drop an opening and wait until it is closed: nothing more goes out on it.
        False if it took longer than `timeout`."""
        self.drop(gen)
        if gen.owner is None:
            return True
        try:
            await asyncio.wait_for(asyncio.shield(gen.owner), timeout)
        except TimeoutError:
            return False
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if gen.owner.cancelled() and not (task is not None and task.cancelling()):
                return True  # the owner was cancelled (closed all the same)
            raise  # this call was: the cancellation goes on
        except Exception:
            return True  # it ended with an error: closed all the same
        return True

    async def close(self) -> None:
        gen = self._gen
        if gen is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await self.settle(gen)


@dataclass(frozen=True)
class Listing:
    """The tools of the servers reached, and why each other one was not."""

    tools: list[ToolInfo]
    unreachable: dict[str, str]  # server -> the error


class McpPool:
    """The configured upstream MCP servers: list their tools, call one."""

    def __init__(self, servers: Sequence[McpServer]) -> None:
        self._conns = {s.name: _Connection(s) for s in servers}
        self._unoffered: set[tuple[str, str]] = set()  # no_approval names warned about
        # Each server's tool names as it last listed them: while it is down they still
        # decide which server owns a name and what the others' tools are called.
        self._last: dict[str, list[str]] = {}

    @property
    def servers(self) -> list[str]:
        return list(self._conns)

    async def list_tools(self, wanted: Collection[str] | None = None) -> list[ToolInfo]:
        """Every server's tools, in the order of the servers and of their listings.  When
        two servers offer one name, the first listed keeps it and each later one's is
        offered as `<server>__<name>` (activities/tool_names.py).  A server that cannot
        be reached fails the listing, unless `wanted` names the tools needed (by name,
        or by the function name a listing gave them) and the servers reached offer them
        all (one server down no longer hides every other server's tools from runs that
        do not need it), under names that a server down cannot change as far as its last
        listing tells: it owns no name asked for and changes no function name asked for
        (a server that added a name since this process last listed it may own it).
        A tool that engines would refuse by its name gets one they take."""
        return (await self.listing(wanted)).tools

    async def listing(self, wanted: Collection[str] | None = None) -> Listing:
        """`list_tools`, with the servers that could not be reached (`wanted` empty:
        whatever the servers reached offer)."""
        tools: list[ToolInfo] = []
        down: dict[str, str] = {}
        # (server, name) in the servers' order: what decides owners and function names.
        # A server down counts with the names it listed last; one never listed makes
        # every name first seen after it unsure (it may offer it), and every alias.
        every: list[tuple[str, str]] = []
        first: set[str] = set()
        never_listed = False
        unsure: set[str] = set()

        def count(server: str, tool: str) -> None:
            if tool not in first and never_listed:
                unsure.add(tool)
            first.add(tool)
            every.append((server, tool))

        async def fetch(name: str, conn: _Connection) -> list[Any]:
            gen = None
            try:
                client, gen = await conn.client()
                return await _every_tool(client, name)
            except TimeoutError:
                # A page not answered in time: the connection stays, with the other
                # runs' calls on it (helper-118: dropped, it cut them off); the next
                # listing asks again, for a page's time at most.
                raise
            except Exception:
                if gen is not None:  # (an opening that failed was dropped by client())
                    conn.drop(gen)
                raise

        # Every server at once: one after another, two servers that accept and never
        # answer took 2 x CONNECT_TIMEOUT_S, past the listing's own timeout, so a run
        # naming a third server's tools never started (helper-114).  The answers are
        # read in the servers' order, which decides owners and function names.
        servers = list(self._conns.items())
        results = await asyncio.gather(
            *(fetch(name, conn) for name, conn in servers), return_exceptions=True
        )
        for (name, conn), result in zip(servers, results, strict=True):
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result  # (a cancellation: the listing's own goes on)
            if isinstance(result, Exception):
                exc = result
                if wanted is None:
                    raise exc
                down[name] = f"{type(exc).__name__}: {exc}"
                if name not in self._last:
                    never_listed = True
                for tool_name in self._last.get(name, ()):
                    count(name, tool_name)
                continue
            listed = result
            names: list[str] = []
            seen: set[str] = set()
            for tool in listed:
                if tool.name in seen:
                    log.warning("mcp server %r lists tool %r twice", name, tool.name)
                    continue
                names.append(tool.name)
                seen.add(tool.name)
                count(name, tool.name)
                notes = tool.annotations
                read_only = bool(notes and notes.read_only_hint)
                waived = {"*", tool.name} & set(conn.server.no_approval)
                tools.append(
                    ToolInfo(
                        server=name,
                        name=tool.name,
                        description=tool.description or "",
                        input_schema=dict(tool.input_schema or {"type": "object"}),
                        read_only=read_only,
                        # MCP's default: a tool not read-only may be destructive unless
                        # its server says it is not (`destructiveHint` defaults to true).
                        destructive=not read_only
                        and not waived
                        and (notes is None or notes.destructive_hint is not False),
                        idempotent=bool(notes and notes.idempotent_hint),
                        timeout_s=conn.server.tool_timeout_s,
                    )
                )
            self._last[name] = names
            for waived_name in sorted(set(conn.server.no_approval) - set(names) - {"*"}):
                if (name, waived_name) not in self._unoffered:  # once, not every run
                    self._unoffered.add((name, waived_name))
                    log.warning(
                        "mcp server %r: no_approval names %r, which it does not offer "
                        "(it offers %s)",
                        name,
                        waived_name,
                        ", ".join(names) or "no tools",
                    )
        owner: dict[str, str] = {}
        for server, tool_name in every:
            owner.setdefault(tool_name, server)
        aliases = function_names(every, qualified=[(s, n) for s, n in every if owner[n] != s])
        tools = [
            replace(t, function=aliases[(t.server, t.name)]) if (t.server, t.name) in aliases else t
            for t in tools
        ]
        if down:
            # A name a server down may own is not sure: the run must not get another
            # server's tool of that name (another implementation, other approvals)
            # because the first was down.  While a server never listed is down, no
            # tool offered under an alias is sure either, by its alias or by its own
            # name: that server's names could change the alias, which is what the
            # model and approveTools know it by.
            sure = {
                t.name
                for t in tools
                if owner[t.name] == t.server and not (never_listed and t.function)
            } - unsure
            if not never_listed:
                sure |= {t.function for t in tools if t.function}
            missing = sorted(n for n in set(wanted or ()) if n not in sure)
            if missing:
                raise ConnectionError(
                    f"no server reached before those down offers {', '.join(missing)}; "
                    "unreachable: " + "; ".join(f"'{n}' ({why})" for n, why in down.items())
                )
            log.info("listing tools without unreachable mcp servers %s", ", ".join(down))
        return Listing(tools, down)

    async def call(
        self,
        server: str,
        tool: str,
        arguments: dict[str, Any],
        *,
        key: str | None = None,
        timeout: float | None = None,
    ) -> tuple[str, bool]:
        """Call a tool; return its text content and whether the server reported an error.
        `key` goes in `_meta` as the call's idempotency key.  `Unreachable`: the call was
        not sent (the connection or session could not be opened); `CallTimedOut`: sent,
        and not answered within `timeout` seconds (the time to open the connection not
        counted), so cut: the SDK tells the server to cancel it, and the connection
        stays; any other error may come after the server ran it."""
        conn = self._conns.get(server)
        if conn is None:
            raise UnknownTool(f"no mcp server named '{server}' is configured on this worker")
        try:
            client, gen = await conn.client()
        except Exception as exc:
            raise Unreachable(f"{type(exc).__name__}: {exc}") from exc
        reached = conn.reached if key else None
        bound = asyncio.timeout(timeout)
        try:
            # The SDK puts the current span's `traceparent` in the request's `_meta` (the
            # MCP convention); it has no per-request HTTP headers to carry it as well.
            meta: Any = {IDEMPOTENCY_META_KEY: key} if key else None
            async with bound:
                result = await client.call_tool(tool, arguments, meta=meta)
        except Exception as exc:
            if bound.expired():
                assert timeout is not None
                raise CallTimedOut(f"no answer within {timeout:g} s") from None
            # Said by the server (a stdio server's errors all are; an HTTP server's if
            # it answered this call in JSON-RPC), or made up by the SDK.
            said = conn.reached is None or (reached is not None and key in conn.replied)
            answer = _answered(exc, reached, key, said)
            if answer is not None:
                return answer, True  # the connection is sound: it stays open
            status = conn.statuses.get(key) if key else None
            if status is not None:
                # An HTTP error answered this request alone: the connection stays, with
                # the other runs' calls on it (helper-114: one call's 500 closed it and
                # cut them off).  The server may have run the call: not Unreachable.
                raise ServerAnswered(
                    f"the server answered HTTP {status} to the call, without a JSON-RPC "
                    "answer; it may have run it"
                ) from exc
            # Closed, the connection sends nothing more: a request of this call the SDK
            # still had queued (another call's failure closed the session under it)
            # either went out before, and was noted, or never will.
            settled = await conn.settle(gen)
            if settled and reached is not None and not reached.get(key or "", False):
                why = f"{type(exc).__name__}: {exc}"
                raise Unreachable(f"the call did not reach it: {why}") from exc
            raise
        finally:
            if reached is not None:
                reached.pop(key or "", None)
                conn.replied.discard(key or "")
                conn.statuses.pop(key or "", None)
        parts = [_text_of(block) for block in result.content]
        if not parts and result.structured_content is not None:
            parts.append(json.dumps(result.structured_content))
        return "\n".join(parts), bool(result.is_error)

    async def aclose(self) -> None:
        await asyncio.gather(*(c.close() for c in self._conns.values()))


async def _every_tool(client: Client, server: str) -> list[Any]:
    """A server's tools, every page of them (`nextCursor`), each page answered within
    LIST_PAGE_TIMEOUT_S (TimeoutError naming the server)."""

    async def page(cursor: str | None) -> Any:
        try:
            async with asyncio.timeout(LIST_PAGE_TIMEOUT_S):
                return await (
                    client.list_tools() if cursor is None else client.list_tools(cursor=cursor)
                )
        except TimeoutError:
            raise TimeoutError(
                f"mcp server '{server}': no tools/list answer within {LIST_PAGE_TIMEOUT_S:g} s"
            ) from None

    listing = await page(None)
    tools = list(listing.tools)
    cursors: set[str] = set()
    while listing.next_cursor is not None:
        if listing.next_cursor in cursors or len(cursors) >= MAX_TOOL_PAGES:
            log.warning(
                "mcp server %r: tools/list stopped after %d pages (a cursor came back)",
                server,
                len(cursors) + 1,
            )
            break
        cursors.add(listing.next_cursor)
        listing = await page(listing.next_cursor)
        tools += listing.tools
    return tools


def _answered(
    exc: Exception, reached: dict[str, bool] | None, key: str | None, said: bool
) -> str | None:
    """What the model is told of a call the server answered with an error (None: no
    answer came, the call failed on the way).  Such an answer is not sent again:
    - a JSON-RPC error by which the server says it ran nothing (no such tool or method,
      arguments it refuses), unless an HTTP 404 said it, which `_Delivery` notes as a
      session or a server gone (sent again once it is back);
    - any other JSON-RPC error the server `said` (an internal error, its own codes),
      but those the SDK makes up when no answer came: the call failed in the server,
      which answered on a connection that is sound (closing it would cut off other
      runs' calls on it), and may have run part of it, as a tool's `isError` says;
    - a result the SDK refused for not matching the tool's own output schema: the tool
      ran and answered, and would answer the same."""
    if isinstance(exc, MCPError) and exc.code in _REFUSED:
        if reached is not None and reached.get(key or "") is False:
            return None
        return f"Error: {exc.message}" + _error_data(exc.data)
    if isinstance(exc, MCPError) and said and exc.code not in _NO_ANSWER:
        return f"Error: {exc.message}" + _error_data(exc.data)
    if isinstance(exc, RuntimeError) and _from(exc, "validate_tool_result"):
        return f"Error: the tool's answer was refused: {exc}"
    return None


def _leaf(exc: BaseException) -> BaseException:
    """The first error an exception group holds, however deep (itself if none)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _error_data(data: object) -> str:
    """A JSON-RPC error's data, for the model (short: it explains, it is no answer)."""
    if data is None:
        return ""
    text = data if isinstance(data, str) else json.dumps(data, default=str)
    return f" ({text[:2000]})"


def _from(exc: BaseException, function: str) -> bool:
    """Whether `exc` was raised in a function of this name (the SDK's own checks raise
    plain RuntimeErrors)."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == function:
            return True
        tb = tb.tb_next
    return False


def _text_of(block: ContentBlock) -> str:
    """A content block as the model reads it: text as it is; an image, audio or binary
    resource as a note of what it was (its base64 would only fill the context); a text
    resource as its text; a link as its URI."""
    if isinstance(block, TextContent):
        return block.text
    if isinstance(block, (ImageContent, AudioContent)):
        return f"[{block.type} {block.mime_type}, {_decoded_size(block.data)} bytes, not shown]"
    if isinstance(block, EmbeddedResource):
        inner = block.resource
        if isinstance(inner, TextResourceContents):
            return f"[resource {inner.uri}]\n{inner.text}"
        mime = inner.mime_type or ""
        return f"[resource {inner.uri}, {mime}, {_decoded_size(inner.blob)} bytes, not shown]"
    if isinstance(block, ResourceLink):
        return f"[resource link {block.uri}: {block.name}]"
    return str(block.model_dump_json(by_alias=True, exclude_none=True))


def _decoded_size(base64: str) -> int:
    return len(base64) * 3 // 4
