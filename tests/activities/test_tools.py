"""The tool activity against a real MCP server over loopback: what reaches the model."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import mcp_types as types
import pytest
from mcp.server.lowlevel import Server
from mcp.server.mcpserver import MCPServer
from mcp.shared.exceptions import MCPError
from mcp_types import INTERNAL_ERROR, INVALID_PARAMS, METHOD_NOT_FOUND, ToolAnnotations
from pydantic import Field
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities import ToolActivities, ToolInput, mcp_pool
from activities.contract import (
    NOT_SENT,
    TOOL_TIMED_OUT,
    ToolsWanted,
    chosen_tools,
    unknown_tools,
)
from activities.mcp_pool import McpPool, Unreachable
from activities.tools import TOOL_OUTPUT_MAX_CHARS
from luftpause.config import McpServer
from luftpause.temporal_dev import free_port
from testkit.loopback import read_body, serve
from tests.workflows.harness import FakeMcpProcess, until


def _server() -> MCPServer:
    mcp: MCPServer = MCPServer("sizes")
    calls: list[int] = []

    @mcp.tool()
    async def page(chars: Annotated[int, Field(ge=0)]) -> str:
        """A document of this many characters, as a fetch of a large page answers."""
        calls.append(chars)
        return "é" * chars

    mcp.calls = calls  # type: ignore[attr-defined]
    return mcp


async def test_a_long_answer_is_cut_with_a_note_and_a_short_one_is_kept() -> None:
    server = _server()
    app = server.streamable_http_app(streamable_http_path="/mcp", host="127.0.0.1")
    async with serve(app) as url:
        pool = McpPool([McpServer(name="s", url=f"{url}/mcp")])
        tools = ToolActivities(pool)
        env = ActivityEnvironment()
        try:
            schema = (await env.run(tools.list_tools))[0].input_schema

            def call(chars: int) -> ToolInput:
                args = f'{{"chars": {chars}}}'
                return ToolInput(run_id="r", server="s", tool="page", arguments=args,
                                 input_schema=schema, call_id=f"c{chars}")  # fmt: skip

            short = await env.run(tools.call_tool, call(TOOL_OUTPUT_MAX_CHARS))
            assert short.content == "é" * TOOL_OUTPUT_MAX_CHARS and not short.is_error
            # 3 MB of UTF-8: uncut, past Temporal's 2 MB payload limit, the activity
            # would fail after the call ran, and every retry would run it again.
            long = await env.run(tools.call_tool, call(1_500_000))
            assert long.content.startswith("é" * TOOL_OUTPUT_MAX_CHARS + "\n[luftpause: ")
            assert long.content.endswith("cut to its first 100,000 of 1,500,000 characters]")
            assert len(long.content.encode()) < 2 * TOOL_OUTPUT_MAX_CHARS + 200
            assert long.executed and not long.is_error
            assert server.calls == [TOOL_OUTPUT_MAX_CHARS, 1_500_000]  # type: ignore[attr-defined]
        finally:
            await pool.aclose()


async def test_a_tool_waits_for_approval_unless_its_server_or_the_operator_says_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # MCP's defaults: destructiveHint is true unless said otherwise, and means nothing
    # for a read-only tool.  `no_approval` is the operator's word over the hints.
    mcp: MCPServer = MCPServer("hints")
    notes = {
        "unmarked": None,
        "marked_safe": ToolAnnotations(destructive_hint=False),
        "read_only": ToolAnnotations(read_only_hint=True),
        "marked_destructive": ToolAnnotations(destructive_hint=True),
        "not_read_only": ToolAnnotations(read_only_hint=False),
        "waived": ToolAnnotations(destructive_hint=True),
    }
    for name, hints in notes.items():
        mcp.add_tool(lambda: "ok", name=name, annotations=hints)
    app = mcp.streamable_http_app(streamable_http_path="/mcp", host="127.0.0.1")
    async with serve(app) as url:
        for waived, waits in (
            (["waived", "wavied"], {"unmarked", "marked_destructive", "not_read_only"}),
            (["*"], set()),
        ):
            pool = McpPool([McpServer(name="s", url=f"{url}/mcp", no_approval=waived)])
            try:
                for _ in range(2):  # as two runs do
                    listed = {t.name: t for t in await ActivityEnvironment().run(
                        ToolActivities(pool).list_tools
                    )}  # fmt: skip
            finally:
                await pool.aclose()
            assert set(listed) == set(notes)
            assert {n for n, t in listed.items() if t.destructive} == waits, waived
            assert {n for n, t in listed.items() if t.read_only} == {"read_only"}
    # A misspelt name is said, once.
    (said,) = [r.getMessage() for r in caplog.records if "no_approval" in r.getMessage()]
    assert "no_approval names 'wavied', which it does not offer" in said


# ------------------------------------------------- what may have reached the server


def _pool(server: FakeMcpProcess, protocol: Literal["auto", "legacy", "2026-07-28"]) -> McpPool:
    return McpPool([McpServer(name="s", url=f"http://127.0.0.1:{server.port}/mcp",
                              protocol=protocol)])  # fmt: skip


def _lookup(schema: dict[str, Any], call_id: str) -> ToolInput:
    return ToolInput(run_id="r", server="s", tool="lookup", arguments='{"query": "q"}',
                     input_schema=schema, call_id=call_id)  # fmt: skip


@pytest.mark.parametrize("protocol", ["auto", "legacy", "2026-07-28"])
async def test_a_call_that_cannot_have_reached_its_server_says_so(
    tmp_path: Path, protocol: Literal["auto", "legacy", "2026-07-28"]
) -> None:
    # The SDK reports a refused connection as "Connection closed" and a restarted
    # server's unknown session as "Session not found", like a call cut mid-way; the
    # workflow sends a call again only if it cannot have run (NOT_SENT).
    server = FakeMcpProcess(tmp_path, time_scale=100)
    server.start()
    pool = _pool(server, protocol)
    tools = ToolActivities(pool)
    env = ActivityEnvironment()
    try:
        listed = {t.name: t for t in await env.run(tools.list_tools)}
        assert listed["lookup"].repeatable and not listed["delete_record"].repeatable
        schema = listed["lookup"].input_schema
        assert not (await env.run(tools.call_tool, _lookup(schema, "c1"))).is_error
        server.child.kill()
        for n in (2, 3):  # on the connection it had, then on a new one
            with pytest.raises(ApplicationError) as down:
                await env.run(tools.call_tool, _lookup(schema, f"c{n}"))
            assert down.value.type == NOT_SENT, down.value
        server.start()
        served = await env.run(tools.call_tool, _lookup(schema, "c4"))
        assert not served.is_error and served.executed
        server.child.kill()
        server.start()  # the same port, a new server: the old session is unknown there
        outcomes = []
        for n in (5, 6):
            try:
                outcomes.append(
                    not (await env.run(tools.call_tool, _lookup(schema, f"c{n}"))).is_error
                )
            except ApplicationError as exc:
                outcomes.append(exc.type)
        # Legacy sessions: the first call meets "Session not found" (not run there);
        # the stateless revision has no session to lose.
        assert outcomes in ([NOT_SENT, True], [True, True]), outcomes
        assert outcomes[0] == NOT_SENT or protocol != "legacy"
        received = server.counts()["received"]
        assert [r["count"] for r in received] == [(1 if outcomes[0] is True else 0) + 1]
    finally:
        await pool.aclose()
        server.child.kill()


@pytest.mark.parametrize("protocol", ["auto", "legacy", "2026-07-28"])
async def test_a_call_cut_while_its_server_runs_it_may_have_run(
    tmp_path: Path, protocol: Literal["auto", "legacy", "2026-07-28"]
) -> None:
    server = FakeMcpProcess(tmp_path, time_scale=0.2)  # lookup: 2.5-7.5 s
    server.start()
    pool = _pool(server, protocol)
    tools = ToolActivities(pool)
    env = ActivityEnvironment()
    try:
        schema = next(t for t in await env.run(tools.list_tools) if t.name == "lookup").input_schema
        call = asyncio.ensure_future(env.run(tools.call_tool, _lookup(schema, "m1")))
        for _ in range(600):  # until the server has begun it (bounded: 30 s)
            if server.counts()["started"]:
                break
            await asyncio.sleep(0.05)
        server.child.kill()
        with pytest.raises(ApplicationError) as cut:
            await call
        assert cut.value.type == "McpUnavailable", cut.value
    finally:
        await pool.aclose()
        server.child.kill()


@pytest.mark.parametrize("protocol", ["legacy", "2026-07-28"])
async def test_a_call_another_calls_failure_cut_off_is_never_sent_if_it_says_so(
    tmp_path: Path, protocol: Literal["legacy", "2026-07-28"], monkeypatch: pytest.MonkeyPatch
) -> None:
    # helper-67: parallel calls share a session; one call's failure closes it, and the
    # others are told "Connection closed" while the SDK may still send their queued
    # POSTs as it closes.  Read too early, "never sent" was wrong (46 of 223 calls in
    # 20 s): the workflow would have sent them twice.  Whatever the interleaving, a call
    # said not to have reached the server must not have been sent.
    sent: set[str] = set()
    handle = mcp_pool._Delivery.handle_async_request

    async def noted(self: Any, request: Any) -> Any:
        key = mcp_pool._call_key(request)
        response = await handle(self, request)  # a connect error raises: not sent
        if key is not None and response.status_code != 404:
            sent.add(key)
        return response

    monkeypatch.setattr(mcp_pool._Delivery, "handle_async_request", noted)
    server = FakeMcpProcess(tmp_path, time_scale=1000)
    server.start()
    pool = _pool(server, protocol)
    said_unsent: list[str] = []
    rng = random.Random(7)
    try:
        for n in range(40):  # bounded: about 4 s
            await pool.call("s", "lookup", {"query": "warm"})

            async def cut() -> None:
                await asyncio.sleep(0.003)
                pool._conns["s"].drop()  # what another call's failure does

            async def call(i: int, n: int = n) -> None:
                await asyncio.sleep(rng.uniform(0, 0.006))
                key = f"k{n}-{i}"
                try:
                    await pool.call("s", "delete_record", {"record_id": key}, key=key)
                except Unreachable:
                    said_unsent.append(key)
                except Exception:
                    pass  # may have reached it: the workflow says "unknown"

            await asyncio.gather(cut(), *(call(i) for i in range(6)))
    finally:
        await pool.aclose()  # every opening closed: nothing more can be sent
        server.child.kill()
    assert said_unsent, "the interleavings never cut a call off before it was sent"
    assert not sent & set(said_unsent), sorted(sent & set(said_unsent))


async def test_an_http_server_is_reached_through_the_proxy_the_environment_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # helper-67: handing httpx a transport of our own turned off the proxies it takes
    # from HTTP(S)_PROXY; a deployment reaching its tool servers through one lost them.
    seen: list[bytes] = []

    async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await reader.readline())  # the request line, in absolute form
        writer.write(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(proxy, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    for name in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{port}")
    pool = McpPool([McpServer(name="s", url="http://mcp.invalid/mcp", protocol="legacy")])
    try:
        with pytest.raises(Unreachable):
            await pool.call("s", "lookup", {"query": "q"}, key="k")
    finally:
        await pool.aclose()
        server.close()
        await server.wait_closed()
    assert seen and seen[0].startswith(b"POST http://mcp.invalid/mcp "), seen


# ------------------------------------------------- what upstream servers answer


def _paged_server(names: list[str], per_page: int) -> Server[Any]:
    """A low-level server that lists its tools `per_page` at a time (`nextCursor`)."""

    async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        start = int(params.cursor) if params is not None and params.cursor else 0
        end = start + per_page
        return types.ListToolsResult(
            tools=[types.Tool(name=n, input_schema={"type": "object"}) for n in names[start:end]],
            next_cursor=str(end) if end < len(names) else None,
        )

    async def call_tool(ctx: Any, params: Any) -> types.CallToolResult:
        return types.CallToolResult(content=[types.TextContent(type="text", text=params.name)])

    return Server("paged", on_list_tools=list_tools, on_call_tool=call_tool)


@pytest.mark.parametrize("protocol", ["legacy", "2026-07-28"])
async def test_every_page_of_a_servers_tools_is_listed(
    protocol: Literal["legacy", "2026-07-28"],
) -> None:
    # The SDK's list_tools returns one page: tools past it were invisible (helper-77).
    names = [f"t{i}" for i in range(7)]
    app = _paged_server(names, 3).streamable_http_app(streamable_http_path="/mcp", host="127.0.0.1")
    async with serve(app) as url:
        pool = McpPool([McpServer(name="s", url=f"{url}/mcp", protocol=protocol)])
        try:
            assert [t.name for t in await pool.list_tools()] == names
            assert await pool.call("s", "t6", {}) == ("t6", False)
        finally:
            await pool.aclose()


async def test_an_empty_cursor_is_a_cursor() -> None:
    # A cursor is an opaque string, "" too: read as none, page one was asked again and
    # its tools listed twice (helper-144).
    async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        cursor = params.cursor if params is not None else None
        name, after = ("first", "") if cursor is None else ("second", None)
        tool = types.Tool(name=name, input_schema={"type": "object"})
        return types.ListToolsResult(tools=[tool], next_cursor=after)

    server: Server[Any] = Server("paged", on_list_tools=list_tools)
    app = server.streamable_http_app(streamable_http_path="/mcp", host="127.0.0.1")
    async with serve(app) as url:
        pool = McpPool([McpServer(name="s", url=f"{url}/mcp")])
        try:
            assert [t.name for t in await pool.list_tools()] == ["first", "second"]
        finally:
            await pool.aclose()


_READ_ONLY = types.ToolAnnotations(read_only_hint=True)
_READING = {"type": "object", "properties": {"celsius": {"type": "number"}}}


class _Mail:
    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.may_end = asyncio.Event()


def _answering_server(ran: list[str], mail: _Mail) -> Server[Any]:
    """forecast: refuses a city it does not know (invalid params); reading: answers
    against its own output schema; screenshot: an image, a text resource and a link,
    as browser tools answer."""

    async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        city = {"type": "object", "properties": {"city": {"type": "string"}}}
        return types.ListToolsResult(
            tools=[
                types.Tool(name="forecast", input_schema=city, annotations=_READ_ONLY),
                types.Tool(name="old_tool", input_schema={"type": "object"}),
                types.Tool(
                    name="reading",
                    input_schema={"type": "object"},
                    output_schema=_READING,
                    annotations=_READ_ONLY,
                ),
                types.Tool(
                    name="screenshot", input_schema={"type": "object"}, annotations=_READ_ONLY
                ),
                types.Tool(name="search", input_schema={"type": "object"}, annotations=_READ_ONLY),
                types.Tool(name="send_mail", input_schema={"type": "object"}),
            ]
        )

    async def call_tool(ctx: Any, params: Any) -> types.CallToolResult:
        ran.append(params.name)
        if params.name == "forecast":
            raise MCPError(INVALID_PARAMS, "unknown city 'Atlantis'", {"known": ["Oslo"]})
        if params.name == "old_tool":  # (2026-07-28 answers this with HTTP 404)
            raise MCPError(METHOD_NOT_FOUND, "tool 'old_tool' is gone")
        if params.name == "search":
            raise MCPError(INTERNAL_ERROR, "index is rebuilding")
        if params.name == "send_mail":  # another run's call, in flight meanwhile
            mail.started.set()
            await mail.may_end.wait()
            return types.CallToolResult(content=[types.TextContent(type="text", text="sent")])
        if params.name == "reading":
            warm = {"celsius": "warm"}
            return types.CallToolResult(
                content=[types.TextContent(type="text", text=json.dumps(warm))],
                structured_content=warm,
            )
        return types.CallToolResult(
            content=[
                types.ImageContent(type="image", data="A" * 4000, mime_type="image/png"),
                types.EmbeddedResource(
                    type="resource",
                    resource=types.TextResourceContents(uri="file:///a.txt", text="the page"),
                ),
                types.ResourceLink(type="resource_link", uri="file:///b.png", name="b.png"),
            ]
        )

    return Server("answers", on_list_tools=list_tools, on_call_tool=call_tool)


@pytest.mark.parametrize("protocol", ["legacy", "2026-07-28"])
async def test_an_error_the_server_answers_reaches_the_model_once(
    protocol: Literal["legacy", "2026-07-28"],
) -> None:
    # A JSON-RPC error (invalid params) and a result the SDK refuses against the tool's
    # output schema were read as a lost connection: a read-only tool ran again and
    # again for 15 minutes, then the run failed; the connection was dropped each time
    # (a stdio server lost its state). The server had answered (helper-77).
    ran: list[str] = []
    mail = _Mail()
    app = _answering_server(ran, mail).streamable_http_app(
        streamable_http_path="/mcp", host="127.0.0.1"
    )
    async with serve(app) as url:
        pool = McpPool([McpServer(name="s", url=f"{url}/mcp", protocol=protocol)])
        tools = ToolActivities(pool)
        env = ActivityEnvironment()
        try:
            listed = {t.name: t for t in await env.run(tools.list_tools)}

            def call(tool: str, arguments: str, call_id: str) -> ToolInput:
                schema = listed[tool].input_schema
                return ToolInput(
                    run_id="r", server="s", tool=tool, arguments=arguments,
                    input_schema=schema, call_id=call_id,
                )  # fmt: skip

            opened = pool._conns["s"]._gen
            refused = await env.run(tools.call_tool, call("forecast", '{"city": "Atlantis"}', "1"))
            assert refused.is_error and refused.executed
            assert refused.content == 'Error: unknown city \'Atlantis\' ({"known": ["Oslo"]})'
            wrong = await env.run(tools.call_tool, call("reading", "{}", "2"))
            assert wrong.is_error and wrong.content.startswith(
                "Error: the tool's answer was refused: Invalid structured content"
            ), wrong.content
            gone = await env.run(tools.call_tool, call("old_tool", "{}", "4"))
            assert gone.is_error and gone.content == "Error: tool 'old_tool' is gone"
            # An internal error (any code but those the SDK makes up for no answer)
            # is the server's answer too; another run's call on the connection goes
            # on meanwhile (the connection was closed under it, helper-99).
            sending = asyncio.ensure_future(
                ActivityEnvironment().run(tools.call_tool, call("send_mail", "{}", "5"))
            )
            await asyncio.wait_for(mail.started.wait(), 10)
            busy = await env.run(tools.call_tool, call("search", "{}", "6"))
            assert busy.is_error and busy.executed
            assert busy.content == "Error: index is rebuilding"
            mail.may_end.set()
            sent = await sending
            assert (sent.content, sent.is_error) == ("sent", False)
            assert ran == ["forecast", "reading", "old_tool", "send_mail", "search"]  # once each
            assert pool._conns["s"]._gen is opened  # the connection was kept
            shown = await env.run(tools.call_tool, call("screenshot", "{}", "3"))
            assert shown.content.split("\n") == [
                "[image image/png, 3000 bytes, not shown]",
                "[resource file:///a.txt]",
                "the page",
                "[resource link file:///b.png: b.png]",
            ]
        finally:
            await pool.aclose()


async def test_a_stdio_server_gets_its_own_environment_not_the_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With any `env` set, a stdio server got the worker's whole environment, its
    # LUFTPAUSE_TOKEN and every other secret included (helper-77).
    monkeypatch.setenv("LUFTPAUSE_TOKEN", "secret")
    script = Path(__file__).with_name("env_server.py")
    pool = McpPool(
        [McpServer(name="s", command=[sys.executable, str(script)], env={"REGION": "eu"})]
    )
    try:
        seen = json.loads((await pool.call("s", "environment", {}))[0])
        assert seen["REGION"] == "eu" and "LUFTPAUSE_TOKEN" not in seen
        assert seen["PATH"] == os.environ["PATH"]  # the SDK's safe default stays
    finally:
        await pool.aclose()


async def test_a_stdio_server_that_died_while_idle_is_started_again_for_the_next_call() -> None:
    # The SDK answered the first call after the death "Connection closed" without
    # writing it, and the pool took that as a call that may have run: a tool that is
    # not repeatable was told to the model as of unknown outcome (helper-114).
    script = Path(__file__).with_name("env_server.py")
    pool = McpPool([McpServer(name="s", command=[sys.executable, str(script)])])
    try:
        first = int((await pool.call("s", "pid", {}, key="r/1"))[0])
        conn = pool._conns["s"]
        gen = conn._gen
        assert gen is not None and not gen.ended
        os.kill(first, signal.SIGKILL)
        await until(lambda: gen.ended, "the pool sees the server's output end")
        second = int((await pool.call("s", "pid", {}, key="r/2"))[0])
        assert second != first and conn._gen is not gen
        # And listing, the other way in, does the same.
        os.kill(second, signal.SIGKILL)
        await until(lambda: conn._gen is not None and conn._gen.ended, "the second end seen")
        assert {t.name for t in await pool.list_tools()} == {"environment", "pid"}
    finally:
        await pool.aclose()


async def test_a_tool_engines_would_refuse_by_name_is_offered_by_one_they_take() -> None:
    # `files.read` or `files/delete` in a request's tools: OpenAI answers 400 to the whole
    # turn, and every run offered the server's tools failed on its first turn.
    script = Path(__file__).with_name("named_server.py")
    pool = McpPool([McpServer(name="named", command=[sys.executable, str(script)])])
    try:
        tools = {t.name: t for t in await pool.list_tools()}
        offered = {name: t.openai_tool()["function"]["name"] for name, t in tools.items()}
        assert offered["files/delete"] == "files_delete"
        assert offered["2fa-check"] == "t_2fa_check"
        assert offered["files_read"] == "files_read"  # its own: `files.read` gets another
        assert offered["files.read"].startswith("files_read_")
        assert len(set(offered.values())) == len(offered)
        assert all(re.fullmatch(r"[A-Za-z][A-Za-z0-9_]{0,63}", n) for n in offered.values())
        assert tools["files.read"].function == offered["files.read"]
        assert tools["files_read"].function == ""  # a name that needs none keeps none
        # A call goes to the server by the tool's own name.
        assert await pool.call("named", "files.read", {"path": "a"}) == ("contents of a", False)
    finally:
        await pool.aclose()


async def test_an_opening_that_times_out_leaves_no_process_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A server that never answered `initialize` kept its process (or connection) for
    # ever: each timed-out attempt left one more (helper-77).
    monkeypatch.setattr(mcp_pool, "CONNECT_TIMEOUT_S", 0.5)
    script = Path(__file__).with_name("stuck_server.py")
    pids = []
    for attempt in range(2):
        pid_file = tmp_path / f"pid{attempt}"
        server = McpServer(name="s", command=[sys.executable, str(script), str(pid_file)])
        pool = McpPool([server])
        try:
            with pytest.raises(Unreachable, match=r"mcp server 's': not open within 0\.5 s"):
                await pool.call("s", "anything", {})
            pids.append(int(pid_file.read_text()))
            for _ in range(200):  # bounded: 10 s
                if not _alive(pids[-1]):
                    break
                await asyncio.sleep(0.05)
            assert not _alive(pids[-1]), "the server's process was left running"
        finally:
            await pool.aclose()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_a_run_that_names_its_tools_needs_only_the_servers_that_offer_them() -> None:
    # One server refusing connections failed every listing, so even a run limited to
    # another server's tools waited 15 minutes and failed (helper-77).
    names = ["lookup", "search"]
    app = _paged_server(names, 10).streamable_http_app(
        streamable_http_path="/mcp", host="127.0.0.1"
    )
    async with serve(app) as url:
        gone = McpServer(name="gone", url=f"http://127.0.0.1:{free_port()}/mcp")
        up = McpServer(name="up", url=f"{url}/mcp")
        pool = McpPool([up, gone])
        tools = ToolActivities(pool)
        env = ActivityEnvironment()
        shadowing = McpPool([gone, up])
        try:
            listed = await env.run(tools.list_tools, ToolsWanted(["lookup"]))
            assert [(t.server, t.name) for t in listed] == [("up", "lookup"), ("up", "search")]
            # Listed after a server that is down, "lookup" may be that server's (the first
            # listed wins): the run does not get the other's in its place (helper-78).
            with pytest.raises(ConnectionError, match="before those down offers lookup"):
                await shadowing.list_tools(["lookup"])
            # Every tool (no names), or a tool no server reached offers: the listing
            # fails (and is tried again), naming the server that is down.
            for wanted in (None, ToolsWanted(None), ToolsWanted(["lookup", "gone_tool"])):
                with pytest.raises(ApplicationError, match=r"listing tools: .*gone") as failed:
                    await env.run(tools.list_tools, *([wanted] if wanted else []))
                assert not failed.value.non_retryable
            with pytest.raises(ApplicationError, match="down offers gone_tool"):
                await env.run(tools.list_tools, ToolsWanted(["gone_tool"]))
        finally:
            await pool.aclose()
            await shadowing.aclose()


async def test_a_name_two_servers_offer_reaches_each_by_its_function_name() -> None:
    def server(label: str, names: list[str]) -> Any:
        async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
            return types.ListToolsResult(
                tools=[types.Tool(name=n, input_schema={"type": "object"}) for n in names]
            )

        async def call_tool(ctx: Any, params: Any) -> types.CallToolResult:
            text = f"{label}:{params.name}"
            return types.CallToolResult(content=[types.TextContent(type="text", text=text)])

        s = Server(label, on_list_tools=list_tools, on_call_tool=call_tool)
        return s.streamable_http_app(streamable_http_path="/mcp", host="127.0.0.1")

    async with serve(server("b", ["lookup", "extra", "files.read"])) as b_url:
        b = McpServer(name="b", url=f"{b_url}/mcp")
        async with serve(server("a", ["lookup", "search", "files_read"])) as a_url:
            a = McpServer(name="a", url=f"{a_url}/mcp")
            pool = McpPool([a, b])
            never_saw_a = McpPool([a, b])
            a_last = McpPool([b, a])
            listed = await pool.list_tools()
            offered = [(t.server, t.name, t.offered) for t in listed]
            assert offered[:5] == [
                ("a", "lookup", "lookup"),
                ("a", "search", "search"),
                ("a", "files_read", "files_read"),
                ("b", "lookup", "b__lookup"),
                ("b", "extra", "extra"),
            ]
            assert offered[5][2].startswith("files_read_")  # `files.read`: the name is a's
            pick = [(t.server, t.name) for t in chosen_tools(listed, ["lookup", "extra"])]
            assert pick == [("a", "lookup"), ("b", "extra")]
            assert [t.server for t in chosen_tools(listed, ["b__lookup"])] == ["b"]
            assert unknown_tools(listed, ["b__lookup", "a__lookup", "lookup"]) == ["a__lookup"]
            assert await pool.call("b", "lookup", {}) == ("b:lookup", False)
        try:
            # `a` is down now.  Its names, as it listed them last, still decide who owns
            # `lookup` and what b's tools are called: the same names as with it up.
            listed = await pool.list_tools(["b__lookup", offered[5][2]])
            assert [(t.server, t.offered) for t in listed] == [(s, o) for s, _, o in offered[3:]]
            # A name it owns may be its own tool: not another server's in its place.
            for wanted in ("lookup", "files_read"):
                with pytest.raises(ConnectionError, match=f"down offers {wanted}"):
                    await pool.list_tools([wanted])
            # Never listed, a server down could own any name listed after it, and
            # change any alias: those are not sure.
            for wanted in ("b__lookup", "extra"):
                with pytest.raises(ConnectionError, match=f"down offers {wanted}"):
                    await never_saw_a.list_tools([wanted])
            # Listed after b, it owns none of b's names, but its `files_read` would make
            # b's `files.read` another alias than `files_read` (helper-87): not sure
            # either, even by its own name.  b's `lookup` is.
            assert [t.name for t in await a_last.list_tools(["lookup"])] == [
                "lookup",
                "extra",
                "files.read",
            ]
            with pytest.raises(ConnectionError, match=r"down offers files\.read"):
                await a_last.list_tools(["files.read"])
        finally:
            await pool.aclose()
            await never_saw_a.aclose()
            await a_last.aclose()


async def test_an_opening_given_up_answers_everyone_waiting_for_it_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Cancelled before it ran, an opening's owner answered no one: every caller waiting
    # on it sat out the whole connect timeout (helper-78).
    monkeypatch.setattr(mcp_pool, "CONNECT_TIMEOUT_S", 30.0)
    server = McpServer(name="s", command=[sys.executable, "-c", "import time; time.sleep(30)"])
    pool = McpPool([server])
    conn = pool._conns["s"]
    try:
        waiter = asyncio.create_task(conn.client())
        await asyncio.sleep(0)  # the opening exists; its owner has not run yet
        conn.drop()
        with pytest.raises(ConnectionError, match="gave up opening it"):
            await asyncio.wait_for(waiter, 5)
    finally:
        await pool.aclose()


async def test_a_server_that_refuses_the_token_says_so() -> None:
    # A 401 read "ExceptionGroup: unhandled errors in a TaskGroup (1 sub-exception)", as
    # a refused connection did (helper-77).
    async def refuse(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"www-authenticate", b"Bearer")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b"no"})

    async with serve(refuse) as url:
        pool = McpPool([McpServer(name="s", url=f"{url}/mcp")])
        try:
            with pytest.raises(Unreachable) as refused:
                await pool.call("s", "anything", {})
            assert "401" in str(refused.value) and "TaskGroup" not in str(refused.value)
        finally:
            await pool.aclose()


@pytest.mark.parametrize("protocol", ["legacy", "2026-07-28"])
async def test_one_calls_http_error_leaves_the_other_calls_on_the_connection(
    protocol: Literal["legacy", "2026-07-28"],
) -> None:
    # helper-114: an HTTP 500 to one call (a proxy's 502/504, a handler that crashed)
    # closed the server's one connection, cutting off another run's call in flight
    # there: the server cancelled it and the model was told its outcome was unknown.
    mcp: MCPServer = MCPServer("srv")
    started, release = asyncio.Event(), asyncio.Event()
    events: list[str] = []

    @mcp.tool(annotations=ToolAnnotations(destructive_hint=False))
    async def slow(tag: str) -> str:
        events.append("start")
        started.set()
        try:
            await release.wait()
        except asyncio.CancelledError:
            events.append("cancelled")
            raise
        return "slow done"

    @mcp.tool()
    async def boom() -> str:
        return "never"

    inner = mcp.streamable_http_app(streamable_http_path="/mcp", host="127.0.0.1")

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await inner(scope, receive, send)
        body, replay = await read_body(receive)
        if b'"boom"' in body:
            start = [(b"content-type", b"text/plain")]
            await send({"type": "http.response.start", "status": 500, "headers": start})
            await send({"type": "http.response.body", "body": b"upstream error"})
            return None
        return await inner(scope, replay, send)

    async with serve(app) as url:
        pool = McpPool([McpServer(name="s", url=f"{url}/mcp", protocol=protocol)])
        try:
            await pool.list_tools()
            first = asyncio.ensure_future(pool.call("s", "slow", {"tag": "A"}, key="runA/c1"))
            await started.wait()
            with pytest.raises(mcp_pool.ServerAnswered, match="answered HTTP 500"):
                await pool.call("s", "boom", {}, key="runB/c1")
            release.set()
            assert await asyncio.wait_for(first, 10) == ("slow done", False)
            assert events == ["start"]  # never cancelled
        finally:
            release.set()
            await pool.aclose()


async def test_a_call_to_a_server_this_worker_lacks_goes_to_another_worker() -> None:
    # A rolling deploy that adds a server: the run listed its tools on a worker that has
    # it, this call came to one that has not.  Never sent, and retryable (another
    # worker of the queue may have it), not a failure of the run (helper-114).
    tools = ToolActivities(McpPool([]))
    call = ToolInput(run_id="r", server="s2", tool="t", arguments="{}", input_schema={},
                     call_id="c")  # fmt: skip
    with pytest.raises(ApplicationError) as err:
        await ActivityEnvironment().run(tools.call_tool, call)
    assert err.value.type == NOT_SENT and not err.value.non_retryable
    assert "no mcp server named 's2' is configured on this worker" in str(err.value)


async def test_the_servers_are_listed_at_once_not_one_after_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # helper-114: two servers that accept a connection and never answer took
    # CONNECT_TIMEOUT_S each in turn, past the listing's own 30 s, so a run naming a
    # third server's tools never started.  Listed at once, the second hung server is
    # asked while the first still hangs.
    monkeypatch.setattr(mcp_pool, "CONNECT_TIMEOUT_S", 3.0)
    asked = [asyncio.Event(), asyncio.Event()]
    held: list[asyncio.StreamWriter] = []

    def hanging(i: int) -> Any:
        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            held.append(writer)  # read nothing back: an initialize never answered
            asked[i].set()

        return accept

    hung = [await asyncio.start_server(hanging(i), "127.0.0.1", 0) for i in range(2)]
    app = _paged_server(["lookup"], 10).streamable_http_app(
        streamable_http_path="/mcp", host="127.0.0.1"
    )
    async with serve(app) as url:
        # "up" first: a tool listed after a server never listed may be that one's
        servers = [McpServer(name="up", url=f"{url}/mcp")] + [
            McpServer(name=f"hung{i}", url=f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}/mcp")
            for i, s in enumerate(hung)
        ]
        pool = McpPool(servers)
        try:
            listing = asyncio.ensure_future(pool.listing(["lookup"]))
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in asked)), 2.0)
            got = await asyncio.wait_for(listing, 10)
            assert [(t.server, t.name) for t in got.tools] == [("up", "lookup")]
            assert set(got.unreachable) == {"hung0", "hung1"}
        finally:
            await pool.aclose()
            for writer in held:
                writer.close()
            for s in hung:
                s.close()


async def test_a_server_hung_on_tools_list_is_given_up_a_page_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # helper-117: listing at once fixed servers that never open, not one whose
    # connection is open and which stopped answering tools/list: it held every
    # listing.  Each page has LIST_PAGE_TIMEOUT_S.  The connection stays (helper-118:
    # dropped, it cut off the calls other runs had in flight on it), and a listing cut
    # off from outside (the activity's timeout, a cancel) leaves it too.
    monkeypatch.setattr(mcp_pool, "LIST_PAGE_TIMEOUT_S", 1.0)
    hang, entered, release = asyncio.Event(), asyncio.Event(), asyncio.Event()

    def server(names: list[str], hanging: asyncio.Event | None) -> Any:
        async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
            if hanging is not None and hanging.is_set():
                entered.set()
                await asyncio.Event().wait()  # overloaded: never answers tools/list
            tools = [types.Tool(name=n, input_schema={"type": "object"}) for n in names]
            return types.ListToolsResult(tools=tools)

        async def call_tool(ctx: Any, params: Any) -> types.CallToolResult:
            await release.wait()
            return types.CallToolResult(content=[types.TextContent(type="text", text="done")])

        return Server("s", on_list_tools=list_tools, on_call_tool=call_tool).streamable_http_app(
            streamable_http_path="/mcp", host="127.0.0.1"
        )

    async with serve(server(["lookup"], None)) as up, serve(server(["other"], hang)) as stuck:
        pool = McpPool(
            [McpServer(name="up", url=f"{up}/mcp"), McpServer(name="stuck", url=f"{stuck}/mcp")]
        )
        try:
            assert len((await pool.listing(["lookup"])).tools) == 2  # both open now
            hang.set()
            got = await asyncio.wait_for(pool.listing(["lookup"]), 10)
            assert [t.name for t in got.tools] == ["lookup"]
            assert "no tools/list answer within 1 s" in got.unreachable["stuck"]
            # A call in flight on the hung server's connection outlives a listing cut
            # off from outside.
            gen = pool._conns["stuck"]._gen
            call = asyncio.ensure_future(pool.call("stuck", "other", {}, key="k1"))
            entered.clear()
            listing = asyncio.ensure_future(pool.listing(["lookup"]))
            await asyncio.wait_for(entered.wait(), 5)  # its tools/list hangs now
            listing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listing
            assert pool._conns["stuck"]._gen is gen and gen is not None and not gen.stop.is_set()
            release.set()
            assert await asyncio.wait_for(call, 10) == ("done", False)
            hang.clear()  # back: listed on the same connection
            got = await asyncio.wait_for(pool.listing(["lookup"]), 10)
            assert {t.name for t in got.tools} == {"lookup", "other"} and not got.unreachable
        finally:
            hang.clear()
            release.set()
            await asyncio.wait_for(pool.aclose(), 10)


@pytest.mark.parametrize("protocol", ["legacy", "2026-07-28"])
async def test_a_call_past_its_tools_time_is_cut_and_its_connection_kept(
    protocol: Literal["legacy", "2026-07-28"],
) -> None:
    # `ToolInput.timeout_s`: the call alone, not the opening of its connection, is
    # bounded; the server is told to cancel it, and the other calls keep the connection.
    cancelled = asyncio.Event()
    mcp: MCPServer = MCPServer("slow")

    async def hang() -> str:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    mcp.add_tool(hang, name="hang")
    mcp.add_tool(lambda: "quick", name="quick")
    app = mcp.streamable_http_app(streamable_http_path="/mcp", host="127.0.0.1")
    async with serve(app) as url:
        pool = McpPool([McpServer(name="s", url=f"{url}/mcp", protocol=protocol)])
        try:
            assert await pool.call("s", "quick", {}, key="r/0") == ("quick", False)
            gen = pool._conns["s"]._gen
            with pytest.raises(mcp_pool.CallTimedOut, match=r"no answer within 0\.3 s"):
                await pool.call("s", "hang", {}, key="r/1", timeout=0.3)
            await asyncio.wait_for(cancelled.wait(), 10)  # the server let it go
            assert await pool.call("s", "quick", {}, key="r/2") == ("quick", False)
            assert pool._conns["s"]._gen is gen  # the same connection
            # The activity says it so that the run tells the model.
            call = ToolInput(run_id="r", server="s", tool="hang", arguments="{}",
                             call_id="c3", timeout_s=0.3)  # fmt: skip
            with pytest.raises(ApplicationError) as err:
                await ActivityEnvironment().run(ToolActivities(pool).call_tool, call)
            assert err.value.type == TOOL_TIMED_OUT and not err.value.non_retryable
        finally:
            await pool.aclose()


async def test_a_late_error_answer_to_a_cut_call_leaves_the_other_calls_alone() -> None:
    # On a legacy session the cut call's POST is still open: its late error answer (a
    # 500 with a JSON-RPC error) found the call's notes gone and raised KeyError in the
    # transport, which closed the connection and another run's call with it (helper-120).
    mcp: MCPServer = MCPServer("srv")
    started, release, answered = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def slow() -> str:
        started.set()
        await release.wait()
        return "slow done"

    mcp.add_tool(slow, name="slow")
    mcp.add_tool(lambda: "never", name="late")
    mcp.add_tool(lambda: "quick", name="quick")
    inner = mcp.streamable_http_app(streamable_http_path="/mcp", host="127.0.0.1")

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await inner(scope, receive, send)
        body, replay = await read_body(receive)
        if b'"late"' not in body:
            return await inner(scope, replay, send)
        await asyncio.sleep(0.6)  # past the call's 0.3 s
        error = {"code": -32603, "message": "boom"}
        out = json.dumps({"jsonrpc": "2.0", "id": json.loads(body)["id"], "error": error})
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 500, "headers": headers})
        await send({"type": "http.response.body", "body": out.encode()})
        answered.set()
        return None

    async with serve(app) as url:
        pool = McpPool([McpServer(name="s", url=f"{url}/mcp", protocol="legacy")])
        try:
            other = asyncio.ensure_future(pool.call("s", "slow", {}, key="runA/c1"))
            await started.wait()
            conn = pool._conns["s"]
            gen = conn._gen
            with pytest.raises(mcp_pool.CallTimedOut):
                await pool.call("s", "late", {}, key="runB/c1", timeout=0.3)
            await asyncio.wait_for(answered.wait(), 10)
            assert await pool.call("s", "quick", {}, key="runC/c1") == ("quick", False)
            release.set()
            assert await asyncio.wait_for(other, 10) == ("slow done", False)
            assert conn._gen is gen  # the same connection throughout
            assert not conn.reached and not conn.replied and not conn.statuses  # no notes left
        finally:
            release.set()
            await pool.aclose()


@pytest.mark.parametrize("protocol", ["legacy", "2026-07-28"])
async def test_more_calls_in_flight_than_httpx_pools_all_reach_the_server(protocol: str) -> None:
    # With httpx's default pool (100 connections, 30 s to wait for one) the 101st call
    # in flight to one server waited, then failed, and its failure closed the whole
    # connection: every call on it cut at 30 s, outcome unknown (helper-160).  The
    # worker runs up to 1,000 activities at once.
    n = 105
    started: list[int] = []
    everyone = asyncio.Event()
    mcp: MCPServer = MCPServer("wide")

    @mcp.tool()
    async def work(i: int) -> str:
        started.append(i)
        if len(started) == n:
            everyone.set()
        await asyncio.wait_for(everyone.wait(), 60)  # none answers before all are in
        return f"done {i}"

    app = mcp.streamable_http_app(streamable_http_path="/mcp", host="127.0.0.1")
    async with serve(app) as url:
        pool = McpPool([McpServer(name="s", url=f"{url}/mcp", protocol=protocol)])
        try:
            calls = (pool.call("s", "work", {"i": i}, key=f"r/c{i}") for i in range(n))
            results = await asyncio.wait_for(asyncio.gather(*calls), 90)
        finally:
            await pool.aclose()
    assert sorted(started) == list(range(n))
    assert results == [(f"done {i}", False) for i in range(n)]


async def test_a_servers_long_error_is_cut_in_the_activitys_failure() -> None:
    # A server that answers tools/list with a 3 MB error message: the activity's
    # failure quoted it whole, and a run's failure carries its message twice, past what
    # Temporal takes (2 MB).
    async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        raise MCPError(INTERNAL_ERROR, "index is rebuilding: " + "x" * 3_000_000)

    server: Server[Any] = Server("long", on_list_tools=list_tools)
    app = server.streamable_http_app(streamable_http_path="/mcp", host="127.0.0.1")
    async with serve(app) as url:
        pool = McpPool([McpServer(name="s", url=f"{url}/mcp")])
        try:
            with pytest.raises(ApplicationError) as failed:
                await ActivityEnvironment().run(ToolActivities(pool).list_tools)
        finally:
            await pool.aclose()
    message = failed.value.message
    assert "index is rebuilding" in message and failed.value.type == "McpUnavailable"
    assert len(message) < 8_100, len(message)
    note = r"\[luftpause: cut here, of 3,0\d\d,\d\d\d characters\]$"
    assert re.search(note, message), message[-99:]


async def test_an_error_body_nested_too_deep_names_no_code() -> None:
    # (It raised RecursionError out of the delivery's note of the answer, a failure of
    # the call no rule expects: helper-180's kind.)
    import httpx2

    from activities.mcp_pool import _error_code

    deep = ("[" * 5000 + "]" * 5000).encode()
    response = httpx2.Response(500, headers={"content-type": "application/json"}, content=deep)
    assert await _error_code(response) is None
    rpc = json.dumps({"jsonrpc": "2.0", "id": 1, "error": {"code": -32601, "message": "no"}})
    answer = httpx2.Response(404, headers={"content-type": "application/json"}, content=rpc)
    assert await _error_code(answer) == -32601
