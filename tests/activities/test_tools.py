"""The tool activity against a real MCP server over loopback: what reaches the model."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Annotated, Any, Literal

import pytest
from mcp.server.mcpserver import MCPServer
from mcp_types import ToolAnnotations
from pydantic import Field
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities import ToolActivities, ToolInput, mcp_pool
from activities.contract import NOT_SENT
from activities.mcp_pool import McpPool, Unreachable
from activities.tools import TOOL_OUTPUT_MAX_CHARS
from luftpause.config import McpServer
from testkit.loopback import serve
from tests.workflows.harness import FakeMcpProcess


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
