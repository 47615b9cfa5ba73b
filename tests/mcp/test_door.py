"""The MCP door, driven by the official client in both protocol generations against
the real stack (Temporal dev server, gateway with fake engines, worker, fake MCP)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import re
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import httpx
import httpx2
import jsonschema
import pydantic_core
import pytest
from hypothesis import given, settings, strategies
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolResult, ElicitResult, EmptyResult, TextContent

from gateway._approval import message
from gateway.mcp_door import RESULT_ANSWER_CHARS, answer_shares, view, views
from luftpause.config import McpServer
from luftpause.temporal_dev import DevServer, free_port
from testkit._fake_text import _MAX_REPLY_TOKENS, LONG_ARGS_END, LONG_REPLY_TOKENS
from testkit.fake_mcp import FakeMcpSettings, FakeMcpState
from testkit.fake_mcp import create_app as create_mcp
from testkit.loopback import serve
from tests.mcp.tasks_client import (
    CreateOnly,
    GetTaskResult,
    TaskCreated,
    TaskIdParams,
    TasksClient,
    TasksGet,
    TasksUpdate,
    UpdateParams,
    cancel_task,
    follow,
)
from tests.workflows.harness import (
    MODEL,
    TIME_SCALE,
    Stack,
    connect,
    gateway_app,
    run_worker,
    stack,
    start_fakes,
    state_is,
    task_with,
    until,
)
from workflows import PendingApproval, RunError, Runs, RunStatus, Totals

MODES = ["legacy", "2026-07-28"]


def result(r: Any) -> Any:
    assert not r.is_error, r.content
    return r.structured_content


def error_text(r: Any) -> str:
    assert r.is_error, r.structured_content
    return " ".join(getattr(c, "text", "") for c in r.content)


async def spawn(c: Client, **kw: Any) -> str:
    return str(result(await c.call_tool("spawn", {"model": MODEL, **kw}))["handle"])


async def test_one_tool_server_down_hides_only_its_own_tools(temporal_address: str) -> None:
    # `tools` failed whole while any server was down, and so did every spawn that named
    # tools, though a run that names its tools needs only the servers that offer them.
    gone = McpServer(name="gone", url=f"http://127.0.0.1:{free_port()}/mcp")
    async with (
        stack(temporal_address, mcp_servers=[gone]) as s,
        Client(s.mcp_door, mode="2026-07-28") as c,
    ):
        listed = result(await c.call_tool("tools", {}))
        assert {t["name"] for t in listed["tools"]} >= {"lookup", "delete_record"}
        assert list(listed["unreachable"]) == ["gone"]
        assert "onnect" in listed["unreachable"]["gone"]
        handle = await spawn(c, task=task_with(1, "up"), tools=["lookup"])
        done = result(await c.call_tool("await", {"handles": [handle], "timeout": 60}))
        assert done["runs"][0]["state"] == "Completed" and done["runs"][0]["toolCalls"] == 1
        # A name no server reached offers may be the one that is down's: said so.
        refused = await c.call_tool("spawn", {"model": MODEL, "task": "x", "tools": ["nope"]})
        assert refused.is_error
        text = error_text(refused)
        assert text.startswith("Error executing tool spawn: a tool server is unreachable: ")
        assert "offers nope" in text and "unreachable: 'gone'" in text


async def test_a_tool_two_servers_offer_is_reached_on_each(temporal_address: str) -> None:
    # When two servers offered one name, the first listed won and the other's tool could
    # not be reached at all.  It is now offered as `<server>__<name>`.
    twin_state = FakeMcpState()
    async with contextlib.AsyncExitStack() as es:
        twin_url = await es.enter_async_context(
            serve(create_mcp(FakeMcpSettings(time_scale=TIME_SCALE), twin_state))
        )
        twin = McpServer(name="twin", url=f"{twin_url}/mcp")
        s = await es.enter_async_context(stack(temporal_address, mcp_servers=[twin]))
        c = await es.enter_async_context(Client(s.mcp_door, mode="2026-07-28"))
        listed = result(await c.call_tool("tools", {}))["tools"]
        by_function = {t["function"]: t for t in listed}
        assert (by_function["lookup"]["server"], by_function["twin__lookup"]["server"]) == (
            "fake",
            "twin",
        )
        assert by_function["twin__delete_record"]["name"] == "delete_record"
        # By its function name, the twin's tool; by its own, the first server's.
        handle = await spawn(c, task=task_with(1, "twin"), tools=["twin__delete_record"])
        await until(lambda: _state(c, handle, "AwaitingApproval"), "the run waits")
        (st,) = result(await c.call_tool("status", {"handles": [handle]}))["runs"]
        assert st["pendingApproval"]["tool"] == "delete_record"
        assert st["pendingApproval"]["server"] == "twin"
        result(await c.call_tool("approve", {"handle": handle, "allow": True}))
        done = result(await c.call_tool("await", {"handles": [handle], "timeout": 60}))
        assert done["runs"][0]["state"] == "Completed"
        assert sum(twin_state.counts.values()) == 1 and not s.mcp.counts
        refused = await c.call_tool(
            "spawn", {"model": MODEL, "task": "x", "tools": ["fake__lookup"]}
        )
        assert "unknown tool(s) 'fake__lookup'" in error_text(refused)


@pytest.mark.parametrize("mode", MODES)
async def test_spawn_six_and_await_all_any_and_timeout(temporal_address: str, mode: str) -> None:
    async with stack(temporal_address, mcp_time_scale=5) as s, Client(s.mcp_door, mode=mode) as c:
        tools = result(await c.call_tool("tools", {}))["tools"]
        assert {t["name"] for t in tools} >= {"lookup", "deep_search", "delete_record"}
        by_name = {t["name"]: t for t in tools}
        assert by_name["delete_record"]["destructive"] is True
        assert by_name["lookup"]["function"] == "lookup"  # a name engines take is kept
        assert (by_name["delete_record"]["repeatable"], by_name["lookup"]["repeatable"]) == (
            False,
            True,
        )
        assert by_name["lookup"]["timeoutS"] == 300.0  # the server's tool_timeout_s

        # Their tool calls held at the server until the short await has answered: on a
        # loaded machine the first run ended before the sixth was spawned (helper-223).
        s.mcp.gate.clear()
        handles = [await spawn(c, task=task_with(2, f"six{i}"), tools=["lookup"]) for i in range(6)]
        # A short timeout returns states without answers.
        short = result(await c.call_tool("await", {"handles": handles, "timeout": 0.05}))
        s.mcp.gate.set()
        assert short["done"] is False
        assert all(r["state"] == "Running" and "answer" not in r for r in short["runs"])

        first = result(await c.call_tool("await", {"handles": handles, "mode": "any"}))
        assert first["done"] is True
        assert any(r["state"] == "Completed" for r in first["runs"])

        every = result(await c.call_tool("await", {"handles": handles, "timeout": 120}))
        assert every["done"] is True
        for run in every["runs"]:
            assert run["state"] == "Completed" and run["answer"]
            assert (run["toolCalls"], run["failedToolCalls"]) == (2, 0)
            # Not "no children": await leaves the details to status.
            assert not {"children", "usage", "subtree"} & run.keys(), run


async def test_a_spawn_no_worker_will_take_says_so(temporal_address: str) -> None:
    # A worker on another task queue than the gateway's (`luftpause worker --task-queue`)
    # left every run waiting in Temporal, and spawn answered as if all were well
    # (helper-113).  Its answer now says no worker polls the queue, until one does.
    async with stack(temporal_address, worker=False) as s, Client(s.mcp_door) as c:
        alone = result(await c.call_tool("spawn", {"model": MODEL, "task": "x"}))
        assert alone["warning"] == (
            f"no worker polls task queue '{s.task_queue}': the run starts when one does "
            "(is `luftpause worker` running, on the gateway's [temporal] task_queue?)"
        )
        async with run_worker(s.client, s.task_queue, s.gateway_url, f"{s.mcp_url}/mcp"):
            await until(s.runs._worker_polls, "the worker polls")
            taken = result(await c.call_tool("spawn", {"model": MODEL, "task": "y"}))
            assert "warning" not in taken
            await c.call_tool("await", {"handles": [alone["handle"], taken["handle"]]})


@pytest.mark.parametrize("mode", MODES)
async def test_cancel_a_tree_and_budgets_in_status(temporal_address: str, mode: str) -> None:
    async with stack(temporal_address) as s, Client(s.mcp_door, mode=mode) as c:
        parent = await spawn(
            c, task=task_with(1, "tree"), tools=["delete_record"], budgetToolCalls=50
        )
        await until(lambda: _state(c, parent, "AwaitingApproval"), "parent waits")
        child = await spawn(c, task=task_with(1, "kid"), tools=["delete_record"], parent=parent)
        await until(lambda: _state(c, child, "AwaitingApproval"), "child waits")
        (st,) = result(await c.call_tool("status", {"handles": [parent]}))["runs"]
        assert [k["handle"] for k in st["children"]] == [child]
        assert st["budget"]["limits"]["toolCalls"] == 50
        assert "exceeded" not in st["budget"]
        assert st["pendingApproval"]["tool"] == "delete_record"
        cancelled = result(await c.call_tool("cancel", {"handle": parent}))
        assert cancelled["state"] == "Cancelled"
        (kid,) = result(await c.call_tool("await", {"handles": [child], "timeout": 30}))["runs"]
        assert kid["state"] == "Cancelled"


@pytest.mark.parametrize("mode", MODES)
async def test_a_run_call_the_client_cancels_cancels_its_run(
    temporal_address: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Esc in a harness cancels the `run` call (notifications/cancelled; a 2026-07-28
    # client closes the request instead, helper-144: its run went on): the run it
    # started is cancelled too, not left waiting for an approval nobody will give.  A
    # call closed while the gateway is stopping is the gateway's cut, not the client's:
    # there the run goes on, to be found by the handle its progress named; a client
    # that asked for no progress never had it, and its run is cancelled (helper-148).
    import gateway.mcp_door as door_module

    cut: list[bool] = []  # a run call's end, as the door saw it
    asked = door_module._client_cancelled

    def client_cancelled(ctx: Any) -> bool:
        cut.append(asked(ctx))
        return cut[-1]

    monkeypatch.setattr(door_module, "_client_cancelled", client_cancelled)
    async with stack(temporal_address) as s, Client(s.mcp_door, mode=mode) as c:
        before = set(await s.runs.list())
        told: list[str] = []

        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            told.append(message or "")

        async def started() -> list[str]:
            return sorted(set(await s.runs.list()) - before)

        async def waiting(progress: bool) -> tuple[str, asyncio.Future[Any]]:
            """A run call whose run waits for approval (and its handle was told)."""
            args = {"task": task_with(1, "gone"), "tools": ["delete_record"]}
            callback = on_progress if progress else None
            call = asyncio.ensure_future(c.call_tool("run", args, progress_callback=callback))
            (handle,) = await until(started, "the run started")
            before.add(handle)
            await until(lambda: state_is(s, handle, "AwaitingApproval"), "it waits")
            if progress:
                await until(lambda: any(handle in m for m in told), "its handle was told")
            return handle, call

        async def cut_off(calls: list[asyncio.Future[Any]]) -> None:
            n = len(cut) + len(calls)
            for call in calls:
                call.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await call
            await until(lambda: len(cut) == n, "the door saw the calls end")

        first, call = await waiting(progress=True)
        await cut_off([call])
        # The gateway takes no turns once it drains: both wait before it.
        (told_one, told_call), (untold, untold_call) = [await waiting(p) for p in (True, False)]
        s.drain()
        await cut_off([told_call, untold_call])
        handles = [first, told_one, untold]
        assert sum(s.mcp.counts.values()) == 0  # the destructive call never ran
        if mode == "legacy":  # notifications/cancelled: the client asked, whoever stops
            # (False here, after an mcp upgrade: the SDK moved what _client_cancelled
            # reads, its private session._request_outbound.cancel_requested; mcp 2.3
            # gives a tool's Context no public way to it, helper-239.)
            assert cut == [True, True, True], "the door did not see notifications/cancelled"
            expected = ["Cancelled", "Cancelled", "Cancelled"]
        else:  # a request closed: the client's leaving, unless the gateway stops
            assert cut == [False, False, False]
            expected = ["Cancelled", "AwaitingApproval", "Cancelled"]
        ended = [
            (await s.runs.wait([h], timeout=30))[0] if e == "Cancelled" else await s.runs.status(h)
            for h, e in zip(handles, expected, strict=True)
        ]
        assert [st.state for st in ended] == expected, ended
        await s.runs.request_cancel(handles[1])


@pytest.mark.parametrize(
    ("via", "stopping"), [("run", False), ("run", True), ("task", False), ("spawn", False)]
)
async def test_a_run_call_cut_while_its_parent_takes_the_child_cancels_the_child(
    temporal_address: str, monkeypatch: pytest.MonkeyPatch, via: str, stopping: bool
) -> None:
    """With a parent, a run starts when the parent's worker takes it (up to 30 s, and
    the server keeps the request for a worker that comes later): a run call cut
    meanwhile cut its spawn, and the child started later ran to its end, its handle
    never given (helper-144).  The request is withdrawn, so the child never starts (or,
    taken first, is cancelled): for a task's `run` too, and when the gateway is
    stopping (its handle reached no client: helper-145)."""
    import gateway.mcp_door as door_module

    picked: list[str] = []
    sending = asyncio.Event()
    send = Runs._send_spawn

    def new_handle() -> str:
        picked.append(f"run-{uuid.uuid4().hex[:20]}")
        return picked[-1]

    async def sent(self: Runs, *args: Any, **kw: Any) -> Any:
        sending.set()
        return await send(self, *args, **kw)

    monkeypatch.setattr(door_module, "new_handle", new_handle)
    # Cut as the request is sent (one cut before it, waiting its turn, sends nothing:
    # test_a_spawn_cut_while_it_waits_its_turn_leaves_the_line_unsent).
    monkeypatch.setattr(Runs, "_send_spawn", sent)
    async with (
        stack(temporal_address, worker=False) as s,
        Client(s.mcp_door, mode="2026-07-28") as c,
        httpx.AsyncClient(timeout=60) as http,
    ):
        mcp = f"{s.mcp_url}/mcp"
        async with run_worker(s.client, s.task_queue, s.gateway_url, mcp):
            parent = await spawn(c, task=task_with(1, "par"), tools=["delete_record"])
            await until(lambda: state_is(s, parent, "AwaitingApproval"), "the parent waits")
        # No worker: the parent cannot take the child until one comes back.
        args = {"task": task_with(0, "kid"), "parent": parent}
        call = asyncio.ensure_future(
            c.call_tool(via, args)
            if via in ("run", "spawn")
            else Modern(http, s.mcp_door).tool("run", args, TASKS_CAPS)
        )
        await asyncio.wait_for(sending.wait(), 30)
        if stopping:
            s.drain()
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
        async with run_worker(s.client, s.task_queue, s.gateway_url, mcp):
            child = picked[-1]
            assert picked == [parent, child]
            # The worker takes what the parent was left: the child's request, and a
            # cancel after it; the child is not among its children, or cancelled.
            await s.runs.request_cancel(parent)
            (done,) = await s.runs.wait([parent], timeout=60)
            assert done.state == "Cancelled", done
            assert [c.state for c in done.children if c.handle == child] in ([], ["Cancelled"])
            with contextlib.suppress(RunError):  # no run with the handle: never started
                ended = await s.runs.status(child)
                assert ended.state == "Cancelled" and ended.parent == parent, ended
            # (The door withdrew the request, rather than waiting up to 30 s to cancel.)
            signals = [
                e.workflow_execution_signaled_event_attributes
                async for e in s.client.get_workflow_handle(parent).fetch_history_events()
                if e.HasField("workflow_execution_signaled_event_attributes")
            ]
            assert "withdraw_child" in [a.signal_name for a in signals]


@dataclasses.dataclass
class _Line:
    """Eight spawn calls to one parent, each held as it is sent (`release` lets them
    go on): the calls after them wait their turn at the door's gate."""

    parent: str
    args: dict[str, Any]
    sent: list[str] = dataclasses.field(default_factory=list)  # children, as each is sent
    release: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    holders: list[asyncio.Future[Any]] = dataclasses.field(default_factory=list)
    door_runs: list[Runs] = dataclasses.field(default_factory=list)  # the door's own Runs

    def gate(self) -> Any:
        return self.door_runs[0]._gates.get(self.parent)

    async def waiting(self, n: int) -> None:
        """Until `n` spawns wait their turn behind the eight sent (its users: both)."""
        await until(lambda: self.gate() is not None and self.gate().users == 8 + n, f"{n} wait")


@contextlib.asynccontextmanager
async def _line(s: Stack, c: Client, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[_Line]:
    parent = await spawn(c, task=task_with(1, "par"), tools=["delete_record"])
    await until(lambda: state_is(s, parent, "AwaitingApproval"), "the parent waits")
    line = _Line(parent, {"model": MODEL, "task": task_with(0, "kid"), "parent": parent})
    send = Runs._send_spawn

    async def held(self: Runs, parent: str, handle: str, *args: Any, **kw: Any) -> Any:
        line.door_runs[:] = [self]
        line.sent.append(handle)
        await line.release.wait()
        return await send(self, parent, handle, *args, **kw)

    monkeypatch.setattr(Runs, "_send_spawn", held)
    line.holders = [asyncio.ensure_future(c.call_tool("spawn", line.args)) for _ in range(8)]
    try:
        await until(lambda: len(line.sent) == 8, "eight are sent")
        yield line
    finally:
        line.release.set()
        await asyncio.gather(*line.holders, return_exceptions=True)


class _Heard:
    """The progress of a line test's calls: `reported`, (asked for, message) as the door
    sent each (`spy`, once the line is set up); `told`, (value, total, message) as the
    asking client heard each (`on_progress`, its callback).  Progress every 0.2 s."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import gateway.mcp_door as door_module

        monkeypatch.setattr(door_module, "PROGRESS_EVERY_S", 0.2)
        self.reported: list[tuple[bool, str | None]] = []
        self.told: list[tuple[float, float | None, str | None]] = []
        self._monkeypatch = monkeypatch

    def spy(self) -> None:
        from mcp.server.mcpserver import Context

        report, reported = Context.report_progress, self.reported

        async def spy(ctx: Any, progress: float, total: Any = None, message: Any = None) -> None:
            asked = (ctx.request_context.meta or {}).get("progress_token") is not None
            reported.append((asked, message))
            await report(ctx, progress, total, message)

        self._monkeypatch.setattr(Context, "report_progress", spy)

    async def on_progress(self, progress: float, total: float | None, message: str | None) -> None:
        self.told.append((progress, total, message))


@pytest.mark.parametrize("mode", MODES)
async def test_a_spawn_waiting_its_turn_sends_progress_if_asked(
    temporal_address: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A burst of hundreds at one parent takes minutes, and a client gives up a call
    # with no sign of life (the TypeScript SDK after 60 s): a spawn waiting its turn
    # says so, every PROGRESS_EVERY_S, then as it is sent; only to a call that asked
    # (helper-248: none said anything).
    heard = _Heard(monkeypatch)
    reported, told = heard.reported, heard.told

    async with stack(temporal_address) as s, Client(s.mcp_door, mode=mode) as c:
        async with _line(s, c, monkeypatch) as line:
            heard.spy()
            quiet = asyncio.ensure_future(c.call_tool("spawn", line.args))  # no token
            await line.waiting(1)
            asked = asyncio.ensure_future(
                c.call_tool("spawn", line.args, progress_callback=heard.on_progress)
            )
            await line.waiting(2)
            await until(lambda: len(told) >= 3, "progress while it waits")
            line.release.set()
            handles = [result(await call)["handle"] for call in (quiet, asked)]
        assert len(set(handles)) == 2 and line.sent[8:] == handles, (handles, line.sent)
    p = line.parent
    messages = [m for _, _, m in told]
    sent = f"sent to parent run '{p}', for it to take the child"
    ahead = [f"waiting its turn at parent run '{p}': {n} ahead of it" for n in (1, 0)]
    assert set(messages[:3]) == {ahead[0]}, messages
    # Then (released) it moves up, and is sent: said as its turn comes, once a
    # round trip to Temporal was begun (the door's own note of it, not the client's,
    # which the call's result may overtake).
    assert messages == sorted(messages, key=[*ahead, sent].index), messages
    assert sent in [m for _, m in reported], reported
    values = [v for v, _, _ in told]
    assert all(a < b for a, b in itertools.pairwise(values)), values
    assert {total for _, total, _ in told} == {None}
    assert reported and all(a for a, _ in reported), reported  # none to the quiet one


@pytest.mark.parametrize("mode", MODES)
async def test_a_run_waiting_its_turn_sends_progress_rising_into_its_wait(
    temporal_address: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A `run` with a parent (spawn + await in one call) said nothing while its child
    # waited its turn, minutes in a burst, and a client gives up a call with no sign
    # of life (the TypeScript SDK after 60 s) (helper-258).  It says what a `spawn`
    # says, below 1 of a total of 2, then its wait's progress from 1: MCP's progress
    # must rise through the request.  Only to a call that asked.
    heard = _Heard(monkeypatch)
    reported, told = heard.reported, heard.told

    async with stack(temporal_address) as s, Client(s.mcp_door, mode=mode) as c:
        async with _line(s, c, monkeypatch) as line:
            heard.spy()
            quiet = asyncio.ensure_future(c.call_tool("run", line.args))  # no token
            await line.waiting(1)
            asked = asyncio.ensure_future(
                c.call_tool("run", line.args, progress_callback=heard.on_progress)
            )
            await line.waiting(2)
            await until(lambda: len(told) >= 3, "progress while it waits")
            line.release.set()
            ran = [result(await call) for call in (quiet, asked)]
        handles = [r["handle"] for r in ran]
        assert line.sent[8:] == handles, (handles, line.sent)
        assert [r["state"] for r in ran] == ["Completed", "Completed"], ran
        await s.runs.request_cancel(line.parent)
    p, handle = line.parent, handles[1]
    ahead = [f"waiting its turn at parent run '{p}': {n} ahead of it" for n in (1, 0)]
    sent = f"sent to parent run '{p}', for it to take the child"
    waited = f"0 of 1 runs ended (run {handle})"
    messages = [m for _, _, m in told]
    assert set(messages[:3]) == {ahead[0]}, messages
    assert messages[-1] == waited, messages
    assert messages == sorted(messages, key=[*ahead, sent, waited].index), messages
    values = [v for v, _, _ in told]
    assert all(a < b for a, b in itertools.pairwise(values)), told
    # The line below 1, the wait from 1, of 2 throughout.
    assert all((v < 1) == (m != waited) for v, _, m in told), told
    assert {total for _, total, _ in told} == {2}, told
    line_said = [a for a, m in reported if m in (*ahead, sent)]
    assert line_said and all(line_said), reported  # none to the quiet one


@pytest.mark.parametrize("mode", MODES)
async def test_a_spawn_cut_while_it_waits_its_turn_leaves_the_line_unsent(
    temporal_address: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A cut call's spawn stayed in line, and in its turn was sent, for the parent to
    # refuse it as withdrawn: a turn and a round trip at the parent that is the
    # bottleneck (helper-248).  Cut while it waits, it leaves the line, unsent; the
    # spawns behind it move up, and the gate's count is whole.
    async with stack(temporal_address) as s, Client(s.mcp_door, mode=mode) as c:
        async with _line(s, c, monkeypatch) as line:
            first = asyncio.ensure_future(c.call_tool("spawn", line.args))
            await line.waiting(1)
            cut = asyncio.ensure_future(c.call_tool("spawn", line.args))
            await line.waiting(2)
            last = asyncio.ensure_future(c.call_tool("spawn", line.args))
            await line.waiting(3)
            cut.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await cut
            await line.waiting(2)  # it left the line; the others stay in it
            gate = line.gate()
            assert (gate._value, gate.tripped) == (0, None), (gate._value, gate.tripped)
            line.release.set()
            handles = [result(await call)["handle"] for call in (first, last)]
            await asyncio.gather(*line.holders)
        assert line.sent[8:] == handles, (handles, line.sent)  # the cut one never sent
        assert len(line.sent) == 10, line.sent
        await until(lambda: line.door_runs[0]._gates == {}, "the gate is dropped")
        kids = (await s.runs.status(line.parent)).children
        assert sorted(k.handle for k in kids) == sorted(line.sent), kids
        await s.runs.request_cancel(line.parent)


@pytest.mark.parametrize("mode", MODES)
async def test_a_spawn_failed_at_its_turn_sends_no_progress_after_its_result(
    temporal_address: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its turn came as the gate tripped: the spawn failed at once, unsent, in the loop
    # pass its progress woke in, and asyncio.wait_for (Python 3.11) kept the progress
    # going with the cancel its call's end sent it swallowed: every PROGRESS_EVERY_S,
    # for ever, after the result, saying it was sent (helper-252).
    import gateway.mcp_door as door_module

    monkeypatch.setattr(door_module, "PROGRESS_EVERY_S", 0.05)
    told: list[str | None] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        told.append(message)

    def following() -> list[asyncio.Task[Any]]:
        return [
            t
            for t in asyncio.all_tasks()
            if getattr(t.get_coro(), "__name__", "") == "_follow_turn"
        ]

    async with stack(temporal_address) as s, Client(s.mcp_door, mode=mode) as c:
        async with _line(s, c, monkeypatch) as line:
            call = asyncio.ensure_future(
                c.call_tool("spawn", line.args, progress_callback=on_progress)
            )
            await line.waiting(1)
            await until(lambda: told, "progress while it waits")
            line.gate().tripped = "parent run stuck (as a send not taken trips it)"
            line.release.set()
            assert "no child was started" in error_text(await call)
        ended = len(told)
        await until(lambda: not following(), "the progress stops with the call", polls=40)
        await asyncio.sleep(0.2)  # four of its periods: nothing more comes
        assert len(told) == ended, told
        # Nor was it said to be sent: it was not (helper-252: its turn said so first).
        assert told and all(m and m.startswith("waiting its turn") for m in told), told
        await s.runs.request_cancel(line.parent)


async def test_a_run_cut_as_the_gateway_stops_before_its_handle_was_given_is_cancelled(
    temporal_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run call cut as the gateway stops leaves its run going, to be found again by
    the handle its progress named; cut before that progress went out (helper-147: a
    worker check came first), no client knew the run: it is cancelled."""
    from mcp.server.mcpserver import Context

    naming = asyncio.Event()
    report = Context.report_progress
    handles: list[str] = []

    async def stuck(self: Any, progress: float, total: Any = None, message: Any = None) -> None:
        if message and (named := re.search(r"\(run (run-[0-9a-f]+)\)", message)):
            handles.append(named[1])
            naming.set()
            await asyncio.Event().wait()  # the handle never goes out
        await report(self, progress, total, message)

    monkeypatch.setattr(Context, "report_progress", stuck)
    async with stack(temporal_address) as s, Client(s.mcp_door, mode="2026-07-28") as c:

        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            pass  # (asked for: a request with a progress token)

        args = {"task": task_with(1, "x"), "tools": ["delete_record"]}
        call = asyncio.ensure_future(c.call_tool("run", args, progress_callback=on_progress))
        await asyncio.wait_for(naming.wait(), 30)
        (handle,) = handles
        s.drain()
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
        (ended,) = await s.runs.wait([handle], timeout=30)
        assert ended.state == "Cancelled", ended


async def test_an_answer_cut_at_max_tokens_says_so(temporal_address: str) -> None:
    # helper-114: a turn stopped at maxTokens (finish_reason "length") became the run's
    # answer as if whole: a text tool call cut mid-arguments, or "" from a reasoning
    # model cut while thinking.  The answer says it was cut.
    async with stack(temporal_address) as s, Client(s.mcp_door, mode="legacy") as c:
        cut = result(await c.call_tool("run", {"task": task_with(0, "cut"), "maxTokens": 2}))
        assert cut["state"] == "Completed" and cut["answerCut"] is True
        # (Above the fake engine's longest reply: the task's random part sets a reply of
        # 40 to 256 tokens, and one of exactly the default 256 was cut, 1 run in 217.)
        room = {"task": task_with(0, "whole"), "maxTokens": 2 * _MAX_REPLY_TOKENS}
        whole = result(await c.call_tool("run", room))
        assert whole["state"] == "Completed" and whole["answerCut"] is False
        assert len(whole["answer"]) > len(cut["answer"])


def _compact(value: Any) -> str:
    """JSON as the door's text copy writes its structured content: no indentation."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@pytest.mark.parametrize("mode", MODES)
async def test_an_await_past_max_chars_shows_each_answers_start_and_answer_reads_the_rest(
    temporal_address: str, mode: str
) -> None:
    # An await returned every answer whole (up to 32,768 tokens each, 1,000 runs), past
    # what harnesses take: Claude Code refuses a result over 25,000 tokens whole.  The
    # answers now share maxChars max-min fairly; the `answer` tool reads the rest.
    async with stack(temporal_address) as s, Client(s.mcp_door, mode=mode) as c:
        room = 2 * LONG_REPLY_TOKENS
        handles = [
            *[
                await spawn(c, task=f"{task_with(0, f'long{i}')} [fake: long]", maxTokens=room)
                for i in range(3)
            ],
            # (Room for their replies too: at the default 256 one reply in 217 is cut.)
            *[await spawn(c, task=task_with(0, f"short{i}"), maxTokens=room) for i in range(2)],
        ]
        asked = [*handles, handles[0]]  # a handle given twice: shown alike, counted once
        call = await c.call_tool("await", {"handles": asked, "timeout": 120, "maxChars": 3000})
        awaited = result(call)
        # The text copy is the structured content itself, compact (the SDK indented it).
        (text,) = call.content
        assert text.text == _compact(awaited)
        statuses = {st.handle: st for st in await s.runs.statuses(handles)}
        whole = {h: statuses[h].answer or "" for h in handles}
        assert all(len(whole[h]) == 4 * LONG_REPLY_TOKENS for h in handles[:3])
        shown = {r["handle"]: r for r in awaited["runs"]}
        assert [r["handle"] for r in awaited["runs"]] == asked
        assert awaited["runs"][0] == awaited["runs"][-1]
        shares = answer_shares([len(whole[h]) for h in handles], 3000)
        assert [len(shown[h]["answer"]) for h in handles] == shares
        assert sum(shares) == 3000  # the answers are longer together: the budget is spent
        for h in handles:
            run = shown[h]
            assert run["state"] == "Completed" and whole[h].startswith(run["answer"])
            assert run["answerCut"] is False  # (the model's own max_tokens: not that)
            cut = len(run["answer"]) < len(whole[h])
            assert run.get("answerChars") == (len(whole[h]) if cut else None), run
            assert run.get("answerNextOffset") == (len(run["answer"]) if cut else None), run
        assert ["answerChars" in shown[h] for h in handles[:3]] == [True] * 3

        # The rest, page by page, to exactly the whole answer.
        for h in handles[:3]:
            read, offset, pages = shown[h]["answer"], shown[h]["answerNextOffset"], 0
            while offset is not None:
                args = {"handle": h, "offset": offset, "maxChars": 1000}
                page = result(await c.call_tool("answer", args))
                assert (page["handle"], page["offset"]) == (h, offset)
                assert page["totalChars"] == len(whole[h]) and len(page["text"]) <= 1000
                read, offset, pages = read + page["text"], page["nextOffset"], pages + 1
            left = len(whole[h]) - len(shown[h]["answer"])
            assert read == whole[h] and pages == -(-left // 1000)
        # From the start, and at the end (nothing left, nothing past it).
        first = result(await c.call_tool("answer", {"handle": handles[3]}))
        assert (first["text"], first["nextOffset"]) == (whole[handles[3]], None)
        end = len(whole[handles[3]])
        last = result(await c.call_tool("answer", {"handle": handles[3], "offset": end}))
        assert (last["text"], last["nextOffset"]) == ("", None)

        # status shares its maxChars alike; without it, the default shows them whole.
        listed = result(await c.call_tool("status", {"handles": handles, "maxChars": 3000}))
        assert [len(r["answer"]) for r in listed["runs"]] == shares
        listed = result(await c.call_tool("status", {"handles": handles}))
        assert [r["answer"] for r in listed["runs"]] == [whole[h] for h in handles]
        assert not any("answerChars" in r for r in listed["runs"])


def _nulls(value: Any, at: str = "") -> list[str]:
    """Where a result holds a null, but for what is data rather than its fields: a
    budget's `limits` and `used` (null: no bound on that) and a tool call's arguments."""
    if value is None:
        return [at]
    if isinstance(value, dict):
        return [
            n
            for k, v in value.items()
            if k not in ("limits", "used", "arguments")
            for n in _nulls(v, f"{at}.{k}")
        ]
    if isinstance(value, list):
        return [n for i, v in enumerate(value) for n in _nulls(v, f"{at}[{i}]")]
    return []


async def test_run_results_leave_out_what_is_null_and_still_fit_their_schemas(
    temporal_address: str,
) -> None:
    # Every field was there, null ones too: 274 characters for a finished run in an
    # await, 123 without them; an await of 1,000 runs passed every harness's bound
    # whatever maxChars (helper-230).  A field that is null is now left out, in the
    # structured content and its text copy alike; false and 0 stay.
    async with stack(temporal_address) as s, Client(s.mcp_door, mode="2026-07-28") as c:
        schemas = {t.name: t.output_schema for t in (await c.list_tools()).tools}
        seen: list[dict[str, Any]] = []

        async def call(tool: str, args: dict[str, Any]) -> Any:
            got = await c.call_tool(tool, args)
            shown = result(got)
            (text,) = got.content
            assert text.text == _compact(shown)
            assert _nulls(shown) == [], (tool, _nulls(shown))
            # What MCP asks: structured content conforms to the tool's output schema.
            schema = schemas[tool]
            assert schema is not None, tool
            jsonschema.validators.validator_for(schema)(schema).validate(shown)
            seen.append(shown)
            return shown

        # A run held at its tool calls, with a child; and one with a budget.
        s.mcp.gate.clear()
        args = {"model": MODEL, "task": task_with(2, "held"), "tools": ["lookup"]}
        spawned = await call("spawn", args)
        held = spawned["handle"]
        assert "warning" not in spawned  # a worker polls: nothing to warn of
        args = {"model": MODEL, "task": task_with(0, "kid"), "parent": held}
        kid = (await call("spawn", args))["handle"]
        args = {"model": MODEL, "task": task_with(0, "bounded"), "budgetTokens": 100_000}
        bounded = (await call("spawn", args))["handle"]
        (running,) = (await call("await", {"handles": [held], "timeout": 0.05}))["runs"]
        assert running["state"] == "Running" and "answer" not in running
        assert "answerCut" not in running  # (only once it has ended)
        assert (running["toolCalls"], running["failedToolCalls"]) == (0, 0)
        awaited = await call("await", {"handles": [kid, bounded], "timeout": 120})
        child, budgeted = awaited["runs"]
        assert (child["state"], child["parent"]) == ("Completed", held)
        assert child["answer"] and "error" not in child and "pendingApproval" not in child
        # await leaves the details to status: absent, not "none".
        assert not {"children", "usage", "subtree"} & (child.keys() | budgeted.keys())
        assert budgeted["budget"]["limits"] == {
            "tokens": 100_000,
            "toolCalls": None,
            "seconds": None,
        }
        assert "exceeded" not in budgeted["budget"] and "parent" not in budgeted
        listed = (await call("status", {"handles": [held, kid, bounded]}))["runs"]
        assert [k["handle"] for k in listed[0]["children"]] == [kid]
        assert listed[1]["children"] == [] and listed[1]["usage"]["turns"] == 1
        s.mcp.gate.set()
        ran = await call("run", {"model": MODEL, "task": task_with(0, "ran")})
        assert ran["state"] == "Completed" and ran["answerCut"] is False
        assert "answerChars" not in ran and "answerNextOffset" not in ran
        await call("await", {"handles": [held], "timeout": 120})
        assert len(seen) == 8


@pytest.mark.parametrize("mode", MODES)
async def test_a_run_with_a_small_max_chars_shows_its_answers_start(
    temporal_address: str, mode: str
) -> None:
    asked: list[str] = []

    async def on_elicit(context: Any, params: Any) -> ElicitResult:
        asked.append(params.message)
        return ElicitResult(action="accept", content={"allow": True})

    async with (
        stack(temporal_address) as s,
        Client(s.mcp_door, mode=mode, elicitation_callback=on_elicit) as c,
    ):
        args = {"task": f"{task_with(0, 'long')} [fake: long]", "maxTokens": 2 * LONG_REPLY_TOKENS}
        call = await c.call_tool("run", {**args, "maxChars": 1000})
        run = result(call)
        (text,) = call.content
        assert text.text == _compact(run)
        (st,) = await s.runs.statuses([run["handle"]])
        assert st.answer is not None and len(st.answer) == 4 * LONG_REPLY_TOKENS
        assert run["answer"] == st.answer[:1000] and run["answerChars"] == len(st.answer)
        assert run["answerNextOffset"] == 1000
        rest = {"handle": run["handle"], "offset": 1000, "maxChars": 1_000_000}
        page = result(await c.call_tool("answer", rest))
        assert run["answer"] + page["text"] == st.answer and page["nextOffset"] is None

        # Through an approval's question (on 2026-07-28, a round that ends the call with
        # an input-required result, and the client's call again): bounded alike.
        args |= {"task": f"{task_with(1, 'asks')} [fake: long]", "tools": ["delete_record"]}
        run = result(await c.call_tool("run", {**args, "maxChars": 1000}))
        assert len(asked) == 1 and (run["state"], run["toolCalls"]) == ("Completed", 1)
        assert len(run["answer"]) == 1000 and run["answerChars"] == 4 * LONG_REPLY_TOKENS


def _json_chars(text: str) -> int:
    """The characters `text` takes in a result: inside a JSON string, as its text copy
    (and its structured content, JSON too) writes it: pydantic_core's JSON, as the door
    and the MCP SDK write it."""
    return len(pydantic_core.to_json(text).decode()) - 2


def _fitting(text: str, chars: int) -> str:
    """The longest start of `text` that takes at most `chars` characters in a result."""
    lo, hi = 0, len(text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if _json_chars(text[:mid]) <= chars else (lo, mid - 1)
    return text[:lo]


async def test_a_quote_heavy_answer_spends_max_chars_on_its_escapes(
    temporal_address: str,
) -> None:
    # maxChars counted the answer's own characters, but a client reads the result's
    # JSON, where each quote or backslash is 2 and a control character 6: a
    # quote-heavy answer at maxChars 1,000 took some 1,600 there, a control-heavy one up
    # to 6,000.  The answer's share is now spent on what it takes in the JSON;
    # answerChars and answerNextOffset stay in its own characters, where `answer` reads.
    # (The fake engine answers a task's `Labels:` line's first label, then filler.  The
    # line is in the task task_with picks, as the engine hashes it: appended after, it
    # made 1 to 3 tool calls in 4 tasks of 5, and one of delete_record waited for an
    # approval this client is never asked, the run with no answer.)
    label = '"\\' * 300 + "\x01" * 40 + 'say "hi"\\' * 20
    task = task_with(0, f"quotes [fake: long]\nLabels: {label}\n")
    async with stack(temporal_address) as s, Client(s.mcp_door, mode="2026-07-28") as c:
        args = {"task": task, "maxTokens": 2 * LONG_REPLY_TOKENS, "maxChars": 1000}
        call = await c.call_tool("run", args)
        run = result(call)
        (st,) = await s.runs.statuses([run["handle"]])
        whole = st.answer
        assert whole is not None and whole.startswith(label), run
        assert run["toolCalls"] == 0, run
        (text,) = call.content
        assert isinstance(text, TextContent) and text.text == _compact(run)
        shown = run["answer"]
        # The longest start that takes at most 1,000 characters in the JSON.
        assert whole.startswith(shown) and _json_chars(shown) <= 1000
        assert _json_chars(whole[: len(shown) + 1]) > 1000
        assert len(shown) < 700  # (600 of them are quotes and backslashes)
        assert (run["answerChars"], run["answerNextOffset"]) == (len(whole), len(shown))
        # `answer` pages alike from answerNextOffset, to exactly the whole answer.
        read, offset = shown, run["answerNextOffset"]
        while offset is not None:
            args = {"handle": run["handle"], "offset": offset, "maxChars": 1000}
            page = result(await c.call_tool("answer", args))
            assert _json_chars(page["text"]) <= 1000 and page["text"], page
            assert page["offset"] == offset and page["totalChars"] == len(whole)
            read, offset = read + page["text"], page["nextOffset"]
            assert offset is None or offset == len(read)
        assert read == whole
        # With room, whole, as before.
        (listed,) = result(await c.call_tool("status", {"handles": [run["handle"]]}))["runs"]
        assert listed["answer"] == whole and "answerChars" not in listed


@pytest.mark.parametrize("mode", MODES)
async def test_a_pending_calls_long_arguments_are_bounded_and_the_question_says_so(
    temporal_address: str, mode: str
) -> None:
    # A run awaiting approval showed its call's arguments whole in every result: a
    # file-writing call's 100,000 characters of content in each await/status/run.  Its
    # arguments' JSON is bounded by maxChars now as an answer is, `argumentsChars`
    # saying how long it is; and the question asked the user cut it at 500 characters
    # without a word (and escaped « to \u00ab).
    asked: list[str] = []

    async def dismiss(context: Any, params: Any) -> ElicitResult:
        asked.append(params.message)
        return ElicitResult(action="cancel")

    caller = {"x-luftpause-caller": f"long-args-{mode}-{time.time_ns()}"}
    async with (
        stack(temporal_address) as s,
        _client(s.mcp_door, mode, caller, elicitation_callback=dismiss) as c,
    ):
        args = {
            "model": MODEL,
            "task": f"{task_with(1, 'writes')} [fake: long-args]",
            "tools": ["delete_record"],
            "maxTokens": 2 * LONG_REPLY_TOKENS,
        }
        call = await c.call_tool("run", {**args, "maxChars": 1000})
        run = result(call)
        assert run["state"] == "AwaitingApproval", run
        (st,) = await s.runs.statuses([run["handle"]])
        assert st.pending_approval is not None
        whole = _compact(st.pending_approval.arguments)
        assert whole.endswith(f'{LONG_ARGS_END}"}}') and len(whole) > 4 * LONG_REPLY_TOKENS

        def bounded(r: dict[str, Any]) -> None:
            pending = r["pendingApproval"]
            assert pending["tool"] == "delete_record", pending
            # (Their start is a JSON string in the result: its quotes count twice.)
            assert pending["arguments"] == _fitting(whole, 1000)
            assert pending["argumentsChars"] == len(whole)

        bounded(run)
        (text,) = call.content
        assert isinstance(text, TextContent)
        assert text.text == _compact(run) and len(text.text) < 2000  # (whole: past 4,000)
        # The question: the start of the same JSON, said to be one, and how long it is.
        assert len(asked) == 1, asked
        note = (
            f"… ({len(whole):,} characters in all; `status` of this run with maxChars "
            f"{len(whole)} or more shows them whole). Allow it?"
        )
        assert asked[0].endswith(f"{whole[:500]}{note}"), asked[0][-300:]

        (shown,) = result(
            await c.call_tool("status", {"handles": [run["handle"]], "maxChars": 1000})
        )["runs"]
        bounded(shown)
        # Shown once, an await on the same approval waits on: to its timeout here.
        waited = result(
            await c.call_tool("await", {"handles": [run["handle"]], "timeout": 1, "maxChars": 1000})
        )
        bounded(waited["runs"][0])
        # Within the default maxChars, the arguments whole, as an object.
        (shown,) = result(await c.call_tool("status", {"handles": [run["handle"]]}))["runs"]
        assert shown["pendingApproval"]["arguments"] == st.pending_approval.arguments
        assert "argumentsChars" not in shown["pendingApproval"]
        result(await c.call_tool("approve", {"handle": run["handle"], "allow": False}))


async def test_answers_and_pending_arguments_share_max_chars(temporal_address: str) -> None:
    # A run has at most one long text, its answer or its pending call's arguments: one
    # result's runs share maxChars over them (`answer_shares`), a handle given twice
    # counted once.
    async with stack(temporal_address) as s, Client(s.mcp_door, mode="2026-07-28") as c:
        room = 2 * LONG_REPLY_TOKENS
        long = await spawn(c, task=f"{task_with(0, 'long')} [fake: long]", maxTokens=room)
        short = await spawn(c, task=task_with(0, "short"), maxTokens=room)
        asks = await spawn(
            c,
            task=f"{task_with(1, 'asks')} [fake: long-args]",
            tools=["delete_record"],
            maxTokens=room,
        )
        await until(lambda: _state(c, asks, "AwaitingApproval"), "it waits")
        await until(lambda: _state(c, long, "Completed"), "the long one ends")
        await until(lambda: _state(c, short, "Completed"), "the short one ends")
        statuses = {st.handle: st for st in await s.runs.statuses([long, short, asks])}
        pending = statuses[asks].pending_approval
        assert pending is not None
        lengths = [
            len(statuses[long].answer or ""),
            len(statuses[short].answer or ""),
            len(_compact(pending.arguments)),
        ]
        shares = answer_shares(lengths, 3000)
        assert shares[1] == lengths[1] and shares[0] < lengths[0] and shares[2] < lengths[2]
        asked = [long, short, asks, asks]
        listed = result(await c.call_tool("status", {"handles": asked, "maxChars": 3000}))["runs"]
        assert [r["handle"] for r in listed] == asked and listed[2] == listed[3]
        assert [len(r["answer"]) for r in listed[:2]] == shares[:2]
        assert "answer" not in listed[2]
        shown = _fitting(_compact(pending.arguments), shares[2])
        assert listed[2]["pendingApproval"]["arguments"] == shown
        assert listed[2]["pendingApproval"]["argumentsChars"] == lengths[2]
        result(await c.call_tool("approve", {"handle": asks, "allow": False}))


def _asking(arguments: Any) -> RunStatus:
    """A run awaiting approval of a write_file call with these arguments."""
    pending = PendingApproval("call_1", "write_file", arguments, "fs")
    return RunStatus(
        handle="run-x", state="AwaitingApproval", task="t", model=MODEL,
        service_class="batch", caller="c", parent=None, root="run-x", children=[],
        usage=Totals(), subtree=Totals(), pending_approval=pending,
    )  # fmt: skip


def test_an_approval_question_says_when_it_shows_only_the_arguments_start() -> None:
    # The question cut the arguments' JSON at 500 characters without a word: a user
    # could allow a call having seen only its start.  (Every path asks with it: legacy
    # elicitation, 2026-07-28 input requests, the Tasks extension's statusMessage.)
    preview = 500  # (_approval.PREVIEW_CHARS)

    content = "«" + "x" * 12_000
    text = message(_asking({"path": "a.txt", "content": content}))
    whole = _compact({"path": "a.txt", "content": content})
    assert text == (
        f"Sub-agent run-x wants to call write_file (of fs) with {whole[:preview]}… "
        f"({len(whole):,} characters in all; `status` of this run with maxChars "
        f"{len(whole)} or more shows them whole). Allow it?"
    )
    assert "12,0" in text and "\\u00ab" not in text
    # Whole, as it is, when it fits.
    short = {"path": "ä.txt"}
    assert message(_asking(short)) == (
        f"Sub-agent run-x wants to call write_file (of fs) with {_compact(short)}. Allow it?"
    )
    exact = {"c": "y" * (preview - len('{"c":""}'))}
    assert len(_compact(exact)) == preview
    assert "characters in all" not in message(_asking(exact))
    # Past the preview but under the least maxChars the door takes (1,000): the question
    # names that least, not a maxChars a `status` call would be refused.
    over = {"c": "y" * (preview + 100 - len('{"c":""}'))}
    assert len(_compact(over)) == preview + 100
    assert message(_asking(over)).endswith(
        "(600 characters in all; `status` of this run with maxChars 1000 or more shows "
        "them whole). Allow it?"
    )


def test_pending_arguments_share_max_chars_by_their_compact_json_length() -> None:
    # A result's text copy writes the arguments as compact JSON, « as itself: 2,000
    # characters here.  Counted as json.dumps writes them (6 for each «, 11,931), they
    # would look longer than the answer beside them and cut it, the two fitting.
    asks = _asking({"content": "«" * 1986})
    assert asks.pending_approval is not None
    assert len(_compact(asks.pending_approval.arguments)) == 2000
    answered = dataclasses.replace(
        _asking(None), handle="run-y", state="Completed", answer="a" * 2050, pending_approval=None
    )
    shown = views([asks, answered], 4050)
    assert shown[0].pendingApproval is not None and shown[0].pendingApproval.argumentsChars is None
    assert shown[0].pendingApproval.arguments == asks.pending_approval.arguments
    assert shown[1].answer == answered.answer and shown[1].answerChars is None


def test_pending_arguments_past_their_share_spend_it_on_their_escaped_json() -> None:
    # Cut arguments are their JSON's start as a JSON string: every quote in them is
    # escaped again, and 1,000 of maxChars took some 1,600 characters in the result.
    content = json.dumps([{"k": "v", "n": i} for i in range(500)])
    asks = _asking({"path": "a.json", "content": content})
    assert asks.pending_approval is not None
    whole = _compact(asks.pending_approval.arguments)
    (shown,) = views([asks], 1000)
    pending = shown.pendingApproval
    assert pending is not None and pending.argumentsChars == len(whole)
    assert isinstance(pending.arguments, str) and whole.startswith(pending.arguments)
    assert _json_chars(pending.arguments) <= 1000
    assert _json_chars(whole[: len(pending.arguments) + 1]) > 1000
    # Whole, they are an object: their JSON as it is, no escapes added.
    (shown,) = views([asks], len(whole))
    assert shown.pendingApproval is not None and shown.pendingApproval.argumentsChars is None


def test_errors_share_max_chars_and_status_shows_one_whole() -> None:
    # A run's error (up to some 10,000 characters) was outside maxChars: 1,000 failed
    # runs made an await of 10 MB.  Errors share it with the answers now, their start
    # shown and errorChars their whole length.
    long = 'engine said: {"error": "bad"}\n' * 340  # 10,200, 11,900 in the JSON
    failed = [
        dataclasses.replace(_asking(None), handle=f"run-{i}", state="Failed", error=long)
        for i in range(1000)
    ]
    failed = [dataclasses.replace(f, pending_approval=None) for f in failed]
    short = dataclasses.replace(failed[0], handle="run-short", error="budget exceeded")
    shown = views([short, *failed], RESULT_ANSWER_CHARS, detail=False)
    text = pydantic_core.to_json({"runs": [v.model_dump() for v in shown]}).decode()
    assert len(text) < 200_000  # (was past 11,000,000)
    assert sum(_json_chars(v.error or "") for v in shown) <= RESULT_ANSWER_CHARS
    assert shown[0].error == "budget exceeded" and shown[0].errorChars is None
    for v in shown[1:]:
        assert v.error and long.startswith(v.error) and v.errorChars == len(long)
    # `status` of the one run with a larger maxChars shows it whole.
    whole = view(failed[0], max_chars=_json_chars(long))
    assert (whole.error, whole.errorChars) == (long, None)
    cut = view(failed[0], max_chars=_json_chars(long) - 1)
    assert cut.errorChars == len(long) and cut.error is not None and len(cut.error) < len(long)


@settings(max_examples=300, deadline=None)
@given(
    strategies.text(
        strategies.one_of(
            strategies.sampled_from(
                [*map(chr, range(0x21)), '"', "\\", "a", "é", "\x7f", "\u2028", "\u2029", "😀"]
            ),
            # (Any other character but a lone surrogate, which pydantic_core refuses.)
            strategies.characters(exclude_categories=["Cs"]),
        ),
        max_size=40,
    ),
    strategies.integers(min_value=0, max_value=250),
)
def test_a_texts_start_fits_its_characters_as_the_results_json_writes_them(
    text: str, chars: int
) -> None:
    from gateway.mcp_door import json_chars, json_start

    assert json_chars(text) == _json_chars(text)  # as pydantic_core writes the result
    start = json_start(text, chars)
    assert text.startswith(start) and _json_chars(start) <= chars
    assert start == text or _json_chars(text[: len(start) + 1]) > chars  # the longest


def test_an_approval_question_names_the_max_chars_that_shows_long_arguments_whole() -> None:
    # A file-writing call's 100,000 characters of content: the question said "`status`
    # shows them whole", but `status` with its default maxChars shows their start.
    st = _asking({"path": "a.txt", "content": "x" * 100_000})
    assert st.pending_approval is not None
    n = len(_compact(st.pending_approval.arguments))
    assert view(st).pendingApproval.argumentsChars == n  # type: ignore[union-attr]
    shown = view(st, max_chars=n).pendingApproval
    assert shown is not None and shown.arguments == st.pending_approval.arguments
    assert message(st).endswith(
        f"… ({n:,} characters in all; `status` of this run with maxChars {n} or more "
        "shows them whole). Allow it?"
    )


@pytest.mark.parametrize("mode", MODES)
async def test_bad_max_chars_and_offsets_get_clear_tool_errors(
    temporal_address: str, mode: str
) -> None:
    async with stack(temporal_address) as s, Client(s.mcp_door, mode=mode) as c:
        done = await spawn(c, task=task_with(0, "done"))
        await c.call_tool("await", {"handles": [done]})
        (st,) = await s.runs.statuses([done])
        assert st.answer is not None
        waiting = await spawn(c, task=task_with(1, "waits"), tools=["delete_record"])
        await until(lambda: _state(c, waiting, "AwaitingApproval"), "it waits")
        cases: list[tuple[str, dict[str, Any], str]] = [
            (
                "await",
                {"handles": [done], "maxChars": 999},
                "maxChars: Input should be greater than or equal to 1000",
            ),
            (
                "status",
                {"handles": [done], "maxChars": 1_000_001},
                "maxChars: Input should be less than or equal to 1000000",
            ),
            ("run", {"task": "x", "maxChars": "5000"}, "maxChars: Input should be a valid integer"),
            ("await", {"handles": [done], "maxChars": 1e4}, "maxChars: Input should be a valid"),
            ("answer", {"handle": done, "maxChars": 10}, "maxChars: Input should be greater"),
            ("answer", {"handle": done, "offset": -1}, "offset: Input should be greater than"),
            ("answer", {"handle": done, "offset": "3"}, "offset: Input should be a valid integer"),
            (
                "answer",
                {"handle": done, "offset": len(st.answer) + 1},
                f"offset {len(st.answer) + 1} is past the answer's end: it has "
                f"{len(st.answer)} characters",
            ),
            ("answer", {"handle": "run-nope"}, "no run with handle 'run-nope'"),
            ("answer", {"handle": waiting}, f"run {waiting} has no answer: it is AwaitingApproval"),
        ]
        for tool, args, needle in cases:
            text = error_text(await c.call_tool(tool, args))
            assert needle in text, (tool, args, text[:300])
        cancelled = result(await c.call_tool("cancel", {"handle": waiting}))
        assert cancelled["state"] == "Cancelled"
        text = error_text(await c.call_tool("answer", {"handle": waiting}))
        assert f"run {waiting} has no answer: it is Cancelled" in text, text


async def test_answer_of_a_run_without_one_quotes_its_error_within_max_chars(
    temporal_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # helper-249: `answer` of a run with no answer quoted the run's whole error (up to
    # some 10,000 characters), past the maxChars every other result holds to.  Its
    # start fits maxChars now, as the result's JSON writes it, and the rest says how
    # long it is and the maxChars with which `status` shows it whole.
    from gateway.mcp_door import json_start
    from workflows import Runs

    long = 'engine said: {"error": "bad"}\n' * 340  # 10,200, 11,900 in the JSON
    real = Runs.status

    async def failed(self: Runs, handle: str, **kw: Any) -> RunStatus:
        st = await real(self, handle, **kw)
        return dataclasses.replace(st, state="Failed", error=long)

    async with stack(temporal_address) as s, Client(s.mcp_door, mode="legacy") as c:
        over = await spawn(c, task=task_with(0, "over"), budgetTokens=1)
        await c.call_tool("await", {"handles": [over]})
        monkeypatch.setattr(Runs, "status", failed)
        text = error_text(await c.call_tool("answer", {"handle": over, "maxChars": 1000}))
        start = json_start(long, 1000)
        assert text.endswith(
            f"run {over} has no answer: it is Failed: {start}… (the start of its error, "
            f"{len(long):,} characters in all; `status` of this run with maxChars "
            f"{_json_chars(long)} or more shows it whole)"
        ), text
        assert _json_chars(text) < 1000 + 300, text  # (was 12,000)
        # Within maxChars, the error is quoted whole.
        text = error_text(await c.call_tool("answer", {"handle": over}))
        assert text.endswith(f"run {over} has no answer: it is Failed ({long})"), text[-300:]
    # What the message says of `status` holds.
    st = dataclasses.replace(_asking(None), state="Failed", error=long, pending_approval=None)
    assert view(st, max_chars=_json_chars(long)).error == long


@settings(max_examples=300, deadline=None)
@given(
    strategies.lists(strategies.integers(min_value=0, max_value=5_000), max_size=12),
    strategies.integers(min_value=0, max_value=20_000),
)
def test_answers_share_the_budget_max_min_fairly(lengths: list[int], budget: int) -> None:
    shown = answer_shares(lengths, budget)
    assert shown == answer_shares(lengths, budget)  # deterministic
    assert len(shown) == len(lengths) and sum(shown) <= budget
    assert all(0 <= n <= length for n, length in zip(shown, lengths, strict=True))
    cut = [n for n, length in zip(shown, lengths, strict=True) if n < length]
    if cut:
        # No answer is cut while budget is left, and a cut one gets the fair share:
        # as much as any other answer shows (one character less, where it does not divide).
        assert sum(shown) == budget
        assert max(shown) - min(cut) <= 1
    else:
        assert shown == lengths


def test_answers_share_the_budget_examples() -> None:
    assert answer_shares([], 1000) == []
    assert answer_shares([100, 5000, 300], 1000) == [100, 600, 300]  # the short ones whole
    assert answer_shares([5000, 5000, 5000], 1000) == [334, 333, 333]  # the first one more
    assert answer_shares([400, 400], 1000) == [400, 400]
    assert answer_shares([0, 2000], 1000) == [0, 1000]
    # An answer exactly its share is whole, and gives the next none of it (helper-223's
    # mutants: `<` for `<=`; the spare character to the first in order, not the shortest).
    assert answer_shares([5, 6], 11) == [5, 6]
    assert answer_shares([1000, 2000], 2001) == [1000, 1001]
    assert answer_shares([6000, 5000, 5000], 1000) == [334, 333, 333]


def test_a_tasks_result_bounds_the_answer_as_run_does() -> None:
    # tasks/get builds `run`'s result from the run alone (`view`): with the default bound.
    from gateway.mcp_door import DoorDeps, create_mcp_server, view
    from workflows import RunStatus, Totals

    async def unused(*args: Any) -> Any:
        raise AssertionError("not used")

    door = create_mcp_server(
        DoorDeps(runs=unused, upstream_tools=unused, decide=unused, models=lambda: [MODEL])
    )
    answer = "é" * (RESULT_ANSWER_CHARS + 5)
    status = RunStatus(
        handle="run-x", state="Completed", task="t", model=MODEL, service_class="batch",
        caller="c", parent=None, root="run-x", children=[], usage=Totals(),
        subtree=Totals(), answer=answer,
    )  # fmt: skip
    got = door.tool_result("run", view(status))
    structured = got["structuredContent"]
    assert structured["answer"] == answer[:RESULT_ANSWER_CHARS]
    assert structured["answerChars"] == RESULT_ANSWER_CHARS + 5
    assert structured["answerNextOffset"] == RESULT_ANSWER_CHARS
    assert got["content"] == [{"type": "text", "text": _compact(structured)}]
    # A CallToolResult the tool made itself keeps its own text (helper-223: the compact
    # copy overwrote it).
    own = CallToolResult(
        content=[TextContent(type="text", text="run failed: the engine said 400")],
        structured_content=structured,
        is_error=True,
    )
    kept = door.tool_result("run", own)
    assert kept["content"] == [{"type": "text", "text": "run failed: the engine said 400"}]
    assert kept["isError"] is True and kept["structuredContent"] == structured


async def test_a_field_that_does_not_apply_is_left_out_as_the_http_api_leaves_it_out() -> None:
    # helper-250: `decide` without labels (a classifier's) returned "mass": null where
    # POST /v1/decide leaves `mass` out; and a run still going showed "answerCut": false,
    # which the README lists for finished runs only (there is no answer yet to cut).
    from gateway.mcp_door import DoorDeps, create_mcp_server, view
    from workflows import RunStatus, Totals

    async def unused(*args: Any) -> Any:
        raise AssertionError("not used")

    async def decide(text: str, labels: list[str] | None, *rest: Any) -> tuple[int, Any]:
        body = {"label": "b", "probabilities": {"a": 0.25, "b": 0.75}, "unscored": []}
        return 200, body | ({"mass": 0.5} if labels else {})

    door = create_mcp_server(
        DoorDeps(runs=unused, upstream_tools=unused, decide=decide, models=lambda: [MODEL])
    )
    async with Client(door) as c:
        classified = await c.call_tool("decide", {"input": "x"})
        scored = await c.call_tool("decide", {"input": "x", "labels": ["a", "b"]})
    assert classified.structured_content == {
        "label": "b",
        "probabilities": {"a": 0.25, "b": 0.75},
        "unscored": [],
    }
    assert scored.structured_content is not None and scored.structured_content["mass"] == 0.5

    def run(state: str, cut: bool) -> dict[str, Any]:
        status = RunStatus(
            handle="run-x", state=state, task="t", model=MODEL, service_class="batch",
            caller="c", parent=None, root="run-x", children=[], usage=Totals(),
            subtree=Totals(), answer="a" if state == "Completed" else None, answer_cut=cut,
        )  # fmt: skip
        structured: dict[str, Any] = door.tool_result("run", view(status))["structuredContent"]
        return structured

    assert "answerCut" not in run("Running", False)
    assert run("Completed", False)["answerCut"] is False
    assert run("Completed", True)["answerCut"] is True
    assert run("Cancelled", False)["answerCut"] is False


async def test_a_cancelled_run_calls_cancel_fails_quietly(caplog: pytest.LogCaptureFixture) -> None:
    # With Temporal away at the client's cancel, reaching the run store fails: that is
    # logged and the call still ends as cancelled, not with the store's error.
    from mcp.server.mcpserver.exceptions import ToolError

    from gateway.mcp_tasks import cancel_quietly

    async def away() -> Any:
        raise ToolError("run store (Temporal at 127.0.0.1:1) is unreachable")

    with caplog.at_level(logging.WARNING, logger="gateway.mcp_tasks"):
        await cancel_quietly(away, "run-x")
    assert "could not cancel run run-x" in caplog.text
    assert "unreachable" in caplog.text


@pytest.mark.parametrize("mode", MODES)
async def test_approve_and_decide(temporal_address: str, mode: str) -> None:
    async with stack(temporal_address) as s, Client(s.mcp_door, mode=mode) as c:
        handle = await spawn(c, task=task_with(1, "appr"), tools=["delete_record"])
        await until(lambda: _state(c, handle, "AwaitingApproval"), "it waits")
        done = result(await c.call_tool("approve", {"handle": handle, "allow": True}))
        assert "pendingApproval" not in done
        (run,) = result(await c.call_tool("await", {"handles": [handle]}))["runs"]
        assert run["state"] == "Completed" and run["toolCalls"] == 1
        assert sum(s.mcp.counts.values()) == 1

        decided = result(
            await c.call_tool("decide", {"input": "Is this spam?", "labels": ["yes", "no"]})
        )
        assert decided["label"] in ("yes", "no")
        assert abs(sum(decided["probabilities"].values()) - 1) < 1e-6
        classified = result(await c.call_tool("decide", {"input": "great product"}))
        assert classified["label"] in ("negative", "positive")


@pytest.mark.parametrize("mode", MODES)
async def test_a_string_that_reads_as_json_is_taken_as_the_string(
    temporal_address: str, mode: str
) -> None:
    # The SDK JSON-decodes a string given for a parameter not typed exactly `str`, for
    # clients that send a list as its JSON text: a system prompt of '{"format": ...}'
    # was refused as no string and one of "null" dropped (helper-179).  A string
    # parameter takes any string; a list sent as JSON text is still decoded.
    async with stack(temporal_address) as s, Client(s.mcp_door, mode=mode) as c:
        for system in ['{"format": "json"}', '["be brief"]', "null", "true"]:
            handle = await spawn(c, task=task_with(0, "json"), system=system)
            first = (await s.runs.transcript(handle))[0]
            assert first == {"role": "system", "content": system}, first
        listed = result(await c.call_tool("status", {"model": "[1]"}))
        assert listed["runs"] == []
        by_text = result(await c.call_tool("status", {"handles": json.dumps([handle])}))
        assert [r["handle"] for r in by_text["runs"]] == [handle]


@pytest.mark.parametrize("mode", MODES)
async def test_malformed_calls_get_clear_tool_errors(temporal_address: str, mode: str) -> None:
    async with stack(temporal_address) as s, Client(s.mcp_door, mode=mode) as c:
        cases: list[tuple[str, dict[str, Any], str]] = [
            ("spawn", {"task": "x", "model": "gpt-9"}, "unknown model 'gpt-9'"),
            # (helper-150: within the characters, past the bytes Temporal carries)
            (
                "spawn",
                {"task": "漢" * 50_000, "system": "字" * 50_000},
                "task and system: 600,004 bytes as Temporal encodes them",
            ),
            ("spawn", {"task": "x", "tools": ["nope"]}, "unknown tool(s) 'nope'"),
            ("spawn", {"task": "x", "parent": "run-nope"}, "no run with handle 'run-nope'"),
            # A blank parent started a run outside the tree; a blank task asked nothing.
            (
                "spawn",
                {"task": "x", "parent": "  "},
                "parent: Value error, give a running run's handle, or leave parent out for "
                "a run of its own (it is only whitespace)",
            ),
            ("run", {"task": " \n\t"}, "task: Value error, give the sub-agent's task (it is only"),
            (
                "spawn",
                {"task": "x", "maxToolCalls": -1},
                "tool spawn: maxToolCalls: Input should be greater than or equal to 0",
            ),
            ("spawn", {"task": 5}, "tool spawn: task: Input should be a valid string"),
            (
                "spawn",
                {"task": "x", "maxToolcalls": 3},
                "tool spawn: unknown argument(s) 'maxToolcalls'; it takes task, model,",
            ),
            ("run", {"task": "x", "budget": 3}, "run: unknown argument(s) 'budget'"),
            ("await", {"handles": ["run-nope"]}, "no run with handle 'run-nope'"),
            ("await", {"handles": []}, "handles"),
            ("await", {"handles": ["a"], "timeout": 601}, "timeout"),
            ("await", {"handles": ["a"], "timeout": 0}, "timeout: Input should be greater than 0"),
            ("run", {"task": "x", "timeout": -1}, "timeout: Input should be greater than 0"),
            ("await", {"handles": ["a"], "mode": "some"}, "mode"),
            ("approve", {"handle": "run-nope", "allow": True}, "no run with handle"),
            ("cancel", {"handle": "run-nope"}, "no run with handle"),
            ("decide", {"input": "x", "labels": ["one"]}, "2 to 20"),
            ("decide", {"input": "x", "labels": [f"l{i}" for i in range(21)]}, "2 to 20"),
            ("decide", {"input": "x", "labels": ["a", "b", "a"]}, "repeated: 'a'"),
            ("decide", {"input": "x", "labels": ["a", "b"], "model": "gpt-9"}, "gpt-9"),
            # Bounds found by helper-62: past Temporal's payload limit (a bare "Error
            # executing tool"), a budget timer that overflows (a run that never runs),
            # echoes of a megabyte (past the client's SSE event limit), coerced booleans.
            ("spawn", {"task": "x" * 200_001}, "task: String should have at most 200000"),
            ("run", {"task": "x", "system": "y" * 200_001}, "system: String should have at most"),
            (
                "spawn",
                {"task": "x", "budgetSeconds": 1e300},
                "budgetSeconds: Input should be less than or equal to 2592000",
            ),
            (
                "spawn",
                {"task": "x", "parent": "p" * 10_000},
                "parent: String should have at most 200",
            ),
            (
                "spawn",
                {"task": "x", "model": "m" * 1_000_000},
                "model: String should have at most 1024",
            ),
            # (as a request's or a file's model: helper-147, 1024 there and 200 here)
            (
                "decide",
                {"input": "x", "model": "m" * 1025},
                "model: String should have at most 1024",
            ),
            ("status", {"model": "m" * 1025}, "model: String should have at most 1024"),
            (
                "approve",
                {"handle": "run-nope", "allow": "yes"},
                "allow: Input should be a valid bool",
            ),
            ("status", {"handles": ["run-a"] * 1001}, "handles: List should have at most 1000"),
            # helper-126: values of another type were taken ("yes" as true, true as 1).
            (
                "spawn",
                {"task": "x", "parallelToolCalls": "yes"},
                "parallelToolCalls: Input should be a valid boolean",
            ),
            ("spawn", {"task": "x", "maxToolCalls": True}, "maxToolCalls: Input should be a valid"),
            ("run", {"task": "x", "maxTokens": "12"}, "maxTokens: Input should be a valid integer"),
            ("run", {"task": "x", "budgetTokens": 1.5}, "budgetTokens: Input should be a valid"),
            # helper-155: a run with 10**309 started, and its every status then failed.
            (
                "spawn",
                {"task": "x", "budgetTokens": 10**309},
                "budgetTokens: Input should be less than or equal to 1000000000000000",
            ),
            (
                "run",
                {"task": "x", "budgetToolCalls": 10**10},
                "budgetToolCalls: Input should be less than or equal to 1000000000",
            ),
            # helper-144: and the seconds (true as a budget of one second).
            ("spawn", {"task": "x", "budgetSeconds": True}, "budgetSeconds: Input should be a"),
            ("run", {"task": "x", "budgetSeconds": "5"}, "budgetSeconds: Input should be a"),
            ("run", {"task": "x", "timeout": True}, "timeout: Input should be a valid number"),
            ("await", {"handles": ["run-a"], "timeout": "5"}, "timeout: Input should be a valid"),
            # helper-126: list items a refusal repeats, a megabyte each.
            ("spawn", {"task": "x", "tools": ["t" * 1_100_000]}, "String should have at most 256"),
            (
                "spawn",
                {"task": "x", "approveTools": ["t" * 1_100_000]},
                "String should have at most 256",
            ),
            ("run", {"task": "x", "tools": ["t" * 1_100_000]}, "String should have at most 256"),
            ("spawn", {"task": "x", "tools": ["t"] * 1001}, "List should have at most 1000"),
            (
                "decide",
                {"input": "x", "labels": ["l" * 1_100_000, "m" * 1_100_000]},
                "String should have at most 1000",
            ),
            (
                "approve",
                {"handle": "run-nope", "allow": True, "callId": "c" * 1_100_000},
                "callId: String should have at most 65536",
            ),
        ]
        for tool, args, needle in cases:
            text = error_text(await c.call_tool(tool, args))
            assert needle in text, (tool, args, text[:300])
            assert "pydantic" not in text and "validation error" not in text, text[:300]
            assert len(text) < 2000, (tool, text[:300])  # what was wrong, not the input back
        # A tool that is not there is a protocol error (-32602), as MCP lists it, naming
        # the tools that are.
        with pytest.raises(MCPError) as err:
            await c.call_tool("spwan", {"task": "x"})
        assert err.value.code == -32602
        assert str(err.value.message).startswith("Unknown tool: spwan; the tools are: spawn,")
        handle = await spawn(c, task=task_with(0, "noop"))
        await c.call_tool("await", {"handles": [handle]})
        text = error_text(await c.call_tool("approve", {"handle": handle, "allow": True}))
        assert f"approve: run '{handle}' has" in text and "no pending approval" in text, text
        # An answer meant for another call than the pending one is refused.
        waiting = await spawn(c, task=task_with(1, "cid"), tools=["delete_record"])
        await until(lambda: _state(c, waiting, "AwaitingApproval"), "the run waits")
        args = {"handle": waiting, "allow": True, "callId": "call_other"}
        assert "not 'call_other'" in error_text(await c.call_tool("approve", args))
        (pending,) = await s.runs.statuses([waiting])
        assert pending.pending_approval is not None
        args["callId"] = pending.pending_approval.call_id
        assert result(await c.call_tool("approve", args))["state"] != "AwaitingApproval"


async def test_fan_out_of_sixteen_takes_about_the_slowest(temporal_address: str) -> None:
    # 16 runs with 3 lookups of 0.5-1.5 s each (time scale 1): one alone takes 2-5 s.
    async with stack(temporal_address, mcp_time_scale=1) as s, Client(s.mcp_door) as c:
        started = time.monotonic()
        handles = [
            await spawn(c, task=task_with(3, f"fan{i}"), tools=["lookup"]) for i in range(16)
        ]
        runs = result(await c.call_tool("await", {"handles": handles, "timeout": 300}))["runs"]
        wall = time.monotonic() - started
        assert all(r["state"] == "Completed" for r in runs)
        statuses = await s.runs.statuses(handles)
        durations = [
            _seconds(st.started_at, st.ended_at) for st in statuses if st.ended_at is not None
        ]
        slowest, total = max(durations), sum(durations)
        print(
            f"\nfan-out of 16: {wall:.1f} s wall, slowest run {slowest:.1f} s, "
            f"sum of runs {total:.1f} s, wall/slowest {wall / slowest:.2f}"
        )
        assert wall < total / 4  # in parallel, not one after another
        assert wall < slowest * 3  # 1.6 measured here; spawning 16 one by one is in it


def _seconds(a: str, b: str) -> float:
    from datetime import datetime

    return (datetime.fromisoformat(b) - datetime.fromisoformat(a)).total_seconds()


async def _listed(c: Client, handle: str) -> bool:
    """Whether `status` without handles (this caller's recent runs) lists the run."""
    return handle in [r["handle"] for r in result(await c.call_tool("status", {}))["runs"]]


async def _state(c: Client, handle: str, state: str) -> bool:
    (st,) = result(await c.call_tool("status", {"handles": [handle]}))["runs"]
    return bool(st["state"] == state)


ANSWERS = {
    "allow": ElicitResult(action="accept", content={"allow": True}),
    "refuse": ElicitResult(action="accept", content={"allow": False}),
    # The form's Decline button: the user's no (MCP: "explicitly declined").
    "decline": ElicitResult(action="decline"),
    # Accept with the box left as shown: a client may leave out a field the user did
    # not change, and the schema's default is false, a no (helper-208: dropped, and
    # the call answered AwaitingApproval as if the user had not answered).
    "untouched": ElicitResult(action="accept", content={}),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("answer", list(ANSWERS))
async def test_an_approval_answered_through_elicitation(
    temporal_address: str, mode: str, answer: str
) -> None:
    asked: list[str] = []
    allow = answer == "allow"

    async def on_elicit(context: Any, params: Any) -> ElicitResult:
        asked.append(params.message)
        return ANSWERS[answer]

    caller = {"x-luftpause-caller": f"elicit-{mode}-{answer}-{time.time_ns()}"}
    async with (
        stack(temporal_address) as s,
        _client(s.mcp_door, mode, caller, elicitation_callback=on_elicit) as c,
    ):
        run = result(
            await c.call_tool(
                "run", {"model": MODEL, "task": task_with(1, "elicit"), "tools": ["delete_record"]}
            )
        )
        assert run["state"] == "Completed"
        assert (run["toolCalls"], run["failedToolCalls"]) == (1, 0 if allow else 1)
        assert len(asked) == 1 and "delete_record" in asked[0]
        assert sum(s.mcp.counts.values()) == (1 if allow else 0)
        # `run` spawned exactly one run, however many rounds the call took.
        listed = result(await c.call_tool("status", {}))["runs"]
        assert [r["handle"] for r in listed] == [run["handle"]]


@pytest.mark.parametrize("mode", MODES)
async def test_an_approval_answer_that_is_not_the_form_allows_nothing(
    temporal_address: str, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Both generations read an answer alike, and strictly: "true" is not the boolean
    # the form asks for.  Legacy sessions took it (the SDK's own validation coerced
    # it), 2026-07-28 rounds dropped it without a word (helper-208).  Now neither
    # takes it, and the gateway logs it; the run still waits, for `approve`.
    asked: list[Any] = []

    async def on_elicit(context: Any, params: Any) -> ElicitResult:
        asked.append(params)
        return ElicitResult(action="accept", content={"allow": "true"})

    caller = {"x-luftpause-caller": f"malformed-{mode}-{time.time_ns()}"}
    async with (
        stack(temporal_address) as s,
        _client(s.mcp_door, mode, caller, elicitation_callback=on_elicit) as c,
    ):
        task = task_with(1, "malformed")
        with caplog.at_level(logging.WARNING, logger="gateway.mcp_door"):
            run = result(
                await c.call_tool("run", {"model": MODEL, "task": task, "tools": ["delete_record"]})
            )
        handle = run["handle"]
        assert run["state"] == "AwaitingApproval" and run["pendingApproval"] is not None
        assert sum(s.mcp.counts.values()) == 0
        assert f"the answer to run {handle}'s approval was not taken" in caplog.text
        assert "{'allow': 'true'}" in caplog.text
        # One question, the same form on both generations: `allow` optional, false
        # unless the user ticks it.
        (params,) = asked
        assert params.requested_schema["properties"]["allow"]["default"] is False
        assert "allow" not in params.requested_schema.get("required", [])
        result(await c.call_tool("approve", {"handle": handle, "allow": True}))
        (done,) = result(await c.call_tool("await", {"handles": [handle]}))["runs"]
        assert done["state"] == "Completed" and done["failedToolCalls"] == 0
        assert sum(s.mcp.counts.values()) == 1


@pytest.mark.parametrize("mode", MODES)
async def test_without_the_approve_tool_only_the_users_answer_approves(
    temporal_address: str, mode: str
) -> None:
    # Any client could call `approve`, the calling model included: in a harness that
    # lets luftpause's tools run unasked, an approval meant for a person was the
    # model's to give.  With `[mcp] approve_tool = false` it is not listed, a call of
    # it is refused saying why, and the user's answer in their client still approves.
    async def on_elicit(context: Any, params: Any) -> ElicitResult:
        return ElicitResult(action="accept", content={"allow": True})

    user = {"x-luftpause-caller": f"people-only-{mode}-{time.time_ns()}"}
    async with (
        stack(temporal_address, mcp={"approve_tool": False}) as s,
        Client(s.mcp_door, mode=mode) as c,
        _client(s.mcp_door, mode, user, elicitation_callback=on_elicit) as asking,
    ):
        listed = {t.name for t in (await c.list_tools()).tools}
        assert "approve" not in listed
        assert listed >= {"spawn", "await", "run", "status", "cancel", "tools", "decide"}
        handle = await spawn(c, task=task_with(1, "people"), tools=["delete_record"])
        await until(lambda: _state(c, handle, "AwaitingApproval"), "it waits")
        with pytest.raises(MCPError) as err:
            await c.call_tool("approve", {"handle": handle, "allow": True})
        assert err.value.code == -32602
        # What it says to do can be done: `await` takes a handle (`run` starts a run of
        # its own), and tasks/get asks, tasks/update only answers (helper-241).
        assert str(err.value.message).startswith(
            "Unknown tool: approve (approvals here are the user's alone ([mcp] approve_tool "
            "= false): `await` of the run asks the user in a client that shows forms "
            "(elicitation), as a task's tasks/get does; or cancel the run); the tools are: "
        ), err.value.message
        assert "the tools are: spawn," in str(err.value.message)
        assert await _state(c, handle, "AwaitingApproval")
        assert sum(s.mcp.counts.values()) == 0
        # The user, asked while their client's `await` covers the run, allows the call.
        waited = result(await asking.call_tool("await", {"handles": [handle], "timeout": 60}))
        (run,) = waited["runs"]
        assert run["state"] == "Completed" and (run["toolCalls"], run["failedToolCalls"]) == (1, 0)
        assert sum(s.mcp.counts.values()) == 1


async def test_without_the_approve_tool_a_task_says_who_answers_and_tasks_update_does(
    temporal_address: str,
) -> None:
    # A task a client cannot show the question for said to call `approve`, a tool the
    # operator turned off: it says now that the user answers, and how.  tasks/update is
    # the user's answer through their client, and still approves; but only from a
    # client that declared form elicitation, one the question could be put to.
    async with (
        stack(temporal_address, mcp={"approve_tool": False}) as s,
        httpx.AsyncClient(timeout=60) as http,
    ):
        door = Modern(http, s.mcp_door)
        spec = {"model": MODEL, "task": task_with(1, "task-people"), "tools": ["delete_record"]}
        y = (await door.tool("spawn", spec))["structuredContent"]["handle"]
        await until(lambda: state_is(s, y, "AwaitingApproval"), "it waits")
        task = (await door.request("tasks/get", {"taskId": y}, TASKS_CAPS))["result"]
        assert task["status"] == "working" and "delete_record" in task["statusMessage"]
        assert "approve(" not in task["statusMessage"], task["statusMessage"]
        assert task["statusMessage"].endswith(
            "(waiting for an answer from the user: `await` of this run asks them in a "
            "client that shows forms (elicitation); or cancel the task)"
        ), task["statusMessage"]
        allow = {"action": "accept", "content": {"allow": True}}
        # This client was shown no question, yet the key is the handle and the call id
        # `status` shows: its answer is a program's, not a person's, and is refused
        # (helper-241: it approved the call, a delete no one was asked about).
        (shown,) = (await door.tool("status", {"handles": [y]}))["structuredContent"]["runs"]
        made_up = f"approve:{y}:{shown['pendingApproval']['callId']}"
        refused = await door.request(
            "tasks/update", {"taskId": y, "inputResponses": {made_up: allow}}, TASKS_CAPS
        )
        assert refused.get("error", {}).get("code") == -32602, refused
        assert "approve_tool = false" in refused["error"]["message"], refused
        assert await state_is(s, y, "AwaitingApproval")
        assert sum(s.mcp.counts.values()) == 0
        asked = (await door.request("tasks/get", {"taskId": y}, {**TASKS_CAPS, **FORM}))["result"]
        (key,) = asked["inputRequests"]
        assert key == made_up
        answer = await door.request(
            "tasks/update", {"taskId": y, "inputResponses": {key: allow}}, {**TASKS_CAPS, **FORM}
        )
        assert "error" not in answer, answer
        (done,) = await s.runs.wait([y], timeout=60)
        assert done.state == "Completed" and done.usage.failed_tool_calls == 0
        assert sum(s.mcp.counts.values()) == 1


def test_every_path_reads_an_approval_answer_alike() -> None:
    # One reading for legacy elicitation, 2026-07-28 input responses and Tasks: a
    # JSON boolean, or the form's default (false) when the field is left out; any
    # other content answers nothing, so it can never allow a call.
    from gateway._approval import answer

    assert answer("accept", {"allow": True}) is True
    assert answer("accept", {"allow": False}) is False
    assert answer("accept", {}) is False
    assert answer("decline", None) is False
    # ... and a field it does not ask for (a typo of the one it does) is no default no.
    odd = ({"allow": "true"}, {"allow": 1}, {"allow": None}, None, "allow", {"Allow": True})
    for content in odd:
        assert answer("accept", content) is None, content
    assert answer("cancel", {"allow": True}) is None


async def test_the_rounds_of_an_await_carry_its_deadline_whole(
    temporal_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 2026-07-28: each input-required round hands the call's deadline on in
    # request_state.  It was the round's start plus what was left at its end, so each
    # round's own time came off the call twice: await(timeout=4) with three approvals
    # answered at once returned after 2.3 s (helper-179).
    from gateway.mcp_door import _State

    carried: list[float] = []
    dump = _State.dump

    def recorded(self: _State) -> str:
        assert self.deadline is not None
        carried.append(self.deadline)
        return dump(self)

    monkeypatch.setattr(_State, "dump", recorded)

    async def on_elicit(context: Any, params: Any) -> ElicitResult:
        return ANSWERS["allow"]

    async with (
        stack(temporal_address) as s,
        Client(s.mcp_door, mode="2026-07-28", elicitation_callback=on_elicit) as c,
    ):
        handle = await spawn(c, task=task_with(3, "deadline"), tools=["delete_record"])
        started = time.time()
        waited = result(await c.call_tool("await", {"handles": [handle], "timeout": 60}))
        assert waited["done"] and sum(s.mcp.counts.values()) == 3
    assert len(carried) == 3, carried  # a round for each approval
    # The same deadline each round, the call's own: its start plus its timeout.
    assert max(carried) - min(carried) < 0.05, carried
    assert started < carried[0] - 60 + 0.05, (started, carried)


async def test_a_question_nobody_answers_does_not_hold_await_past_its_timeout(
    temporal_address: str,
) -> None:
    # Legacy sessions are asked mid-call; a user who never answers must not hold the
    # call past the timeout its caller chose (it would hit the client's own timeout).
    released = asyncio.Event()
    asked: list[str] = []

    async def on_elicit(context: Any, params: Any) -> ElicitResult:
        asked.append(params.message)
        await released.wait()
        return ANSWERS["allow"]

    caller = {"x-luftpause-caller": f"unanswered-{time.time_ns()}"}
    async with (
        stack(temporal_address) as s,
        _client(s.mcp_door, "legacy", caller, elicitation_callback=on_elicit) as c,
    ):
        handle = await spawn(c, task=task_with(1, "unanswered"), tools=["delete_record"])
        call = c.call_tool("await", {"handles": [handle], "timeout": 2})
        try:
            waited = result(await asyncio.wait_for(call, 30))
        finally:
            released.set()
        (st,) = waited["runs"]
        assert len(asked) == 1 and st["state"] == "AwaitingApproval"
        assert not waited["done"]


@pytest.mark.parametrize("client", ["no-forms-legacy", "no-forms-2026-07-28", "dismissed"])
async def test_a_wait_that_only_an_approval_can_end_answers_once_it_is_seen(
    temporal_address: str, client: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A client that cannot answer forms is asked nothing, and one that dismissed the
    # question is not asked again: a `run` whose run waited on an approval held the
    # call to its timeout, 10 minutes by default, its caller unable to `approve`
    # meanwhile (helper-155).  The call answers once every run it waits on that has
    # not ended waits on an approval, each with its pendingApproval.  Once so shown,
    # a wait on the same approval waits on, for an answer from elsewhere (helper-158:
    # a caller polling `await` woke every round).
    import gateway.mcp_door

    monkeypatch.setattr(gateway.mcp_door, "PROGRESS_EVERY_S", 0.3)
    asked: list[str] = []

    async def dismiss(context: Any, params: Any) -> ElicitResult:
        asked.append(params.message)
        return ElicitResult(action="cancel")

    mode = "legacy" if client == "dismissed" else client.removeprefix("no-forms-")
    kw: dict[str, Any] = {"elicitation_callback": dismiss} if client == "dismissed" else {}
    caller = {"x-luftpause-caller": f"blocked-{client}-{time.time_ns()}"}
    async with stack(temporal_address) as s, _client(s.mcp_door, mode, caller, **kw) as c:
        args = {"model": MODEL, "task": task_with(1, "blocked"), "tools": ["delete_record"]}
        # (Bounded below the call's own timeout, which the call waited for.)
        r = result(await asyncio.wait_for(c.call_tool("run", {**args, "timeout": 300}), 120))
        assert r["state"] == "AwaitingApproval", r
        assert r["pendingApproval"]["tool"] == "delete_record"
        assert len(asked) == (1 if client == "dismissed" else 0)
        beat, beats = asyncio.Event(), []

        async def on_progress(done: float, total: float | None, message: str | None) -> None:
            beats.append(done)
            if len(beats) == 2:  # the wait went on past the round that asked (dismissed)
                beat.set()

        waiting = asyncio.ensure_future(
            c.call_tool(
                "await", {"handles": [r["handle"]], "timeout": 120}, progress_callback=on_progress
            )
        )
        try:
            await asyncio.wait_for(beat.wait(), 60)
            result(await c.call_tool("approve", {"handle": r["handle"], "allow": True}))
            waited = result(await asyncio.wait_for(waiting, 60))
        finally:
            waiting.cancel()
        assert waited["done"] and waited["runs"][0]["state"] == "Completed", waited
        assert sum(s.mcp.counts.values()) == 1


async def test_a_run_with_more_approvals_than_rounds_answers_with_its_handle(
    temporal_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One input-required round per approval: a run needing more than the client allows
    # (the official client gives up after 10) broke the call, the run left waiting on
    # an approval with no handle given.  Past INPUT_ROUNDS_MAX rounds the call answers
    # with the run as it is; `approve` and `await` go on from there.
    import gateway.mcp_door

    monkeypatch.setattr(gateway.mcp_door, "INPUT_ROUNDS_MAX", 2)
    answered: list[str] = []

    async def on_elicit(context: Any, params: Any) -> ElicitResult:
        answered.append(params.message)
        return ANSWERS["allow"]

    async with (
        stack(temporal_address) as s,
        Client(s.mcp_door, mode="2026-07-28", elicitation_callback=on_elicit) as c,
    ):
        task = task_with(3, "many")  # three delete_record calls, each to be approved
        r = result(await c.call_tool("run", {"task": task, "tools": ["delete_record"]}))
        assert r["state"] == "AwaitingApproval" and r["pendingApproval"] is not None, r
        assert len(answered) == 2 and sum(s.mcp.counts.values()) == 2
        result(await c.call_tool("approve", {"handle": r["handle"], "allow": True}))
        (done,) = result(await c.call_tool("await", {"handles": [r["handle"]]}))["runs"]
        assert done["state"] == "Completed" and sum(s.mcp.counts.values()) == 3


async def test_the_rounds_of_a_run_call_survive_a_gateway_restart(temporal_address: str) -> None:
    # A 2026-07-28 run waiting for an approval carries its state in the sealed
    # request state; sealed with a key of the process, a round after a restart was
    # refused (-32602 "Invalid or expired requestState") and the user's answer lost.
    # The operator token keys it now, so the next gateway opens it.
    queue = f"restart-{time.time_ns()}"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    asked, restarted = asyncio.Event(), asyncio.Event()

    async def on_elicit(context: Any, params: Any) -> ElicitResult:
        asked.set()
        await restarted.wait()  # the user answers after the gateway came back
        return ANSWERS["allow"]

    async with contextlib.AsyncExitStack() as es:
        fakes = await start_fakes(es)
        mcp = f"{fakes.mcp_url}/mcp"

        def gateway() -> Any:
            return gateway_app(fakes.engines, temporal=temporal_address, queue=queue,
                               mcp_url=mcp, token="op")  # fmt: skip

        client = await connect(temporal_address)
        await es.enter_async_context(run_worker(client, queue, url, mcp, token="op"))
        first = contextlib.AsyncExitStack()
        await first.enter_async_context(serve(gateway(), port=port))
        op = {"authorization": b"Bearer op"}
        c = await es.enter_async_context(
            _client(f"{url}/mcp", "2026-07-28", op, elicitation_callback=on_elicit)
        )
        args = {"task": task_with(1, "restart"), "tools": ["delete_record"]}
        call = asyncio.ensure_future(c.call_tool("run", args))
        await asyncio.wait_for(asked.wait(), 60)
        await first.aclose()  # the gateway restarts between two rounds of the call
        await es.enter_async_context(serve(gateway(), port=port))
        restarted.set()
        done = result(await asyncio.wait_for(call, 60))
        assert done["state"] == "Completed" and done["toolCalls"] == 1, done
        assert sum(fakes.mcp.counts.values()) == 1


async def test_progress_goes_on_while_a_question_is_open(
    temporal_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A legacy await that asks the user sent no progress while the question was open:
    # a client that gives up a call without progress (Claude Code after about 5
    # minutes) cut the call while its user read the question.
    import gateway.mcp_door

    monkeypatch.setattr(gateway.mcp_door, "PROGRESS_EVERY_S", 0.2)
    progress: list[float] = []
    beats = asyncio.Event()

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append(done)
        if len(progress) >= 3:
            beats.set()

    async def on_elicit(context: Any, params: Any) -> ElicitResult:
        progress.clear()  # only what comes while the question is open counts
        await asyncio.wait_for(beats.wait(), 10)  # the user reads, the call goes on
        return ANSWERS["allow"]

    caller = {"x-luftpause-caller": f"reading-{time.time_ns()}"}
    async with (
        stack(temporal_address) as s,
        _client(s.mcp_door, "legacy", caller, elicitation_callback=on_elicit) as c,
    ):
        handle = await spawn(c, task=task_with(1, "reading"), tools=["delete_record"])
        await until(lambda: _state(c, handle, "AwaitingApproval"), "it waits")
        r = await c.call_tool(
            "await", {"handles": [handle], "timeout": 60}, progress_callback=on_progress
        )
        (st,) = result(r)["runs"]
        assert st["state"] == "Completed" and st["toolCalls"] == 1
        assert all(a < b for a, b in itertools.pairwise(progress))  # still rising


@pytest.mark.parametrize("moot_by", ["another_run_ended", "answered_elsewhere"])
async def test_an_open_question_does_not_hold_await_once_it_has_no_point(
    temporal_address: str, moot_by: str
) -> None:
    # helper-66: a legacy await waited on its open question (up to its timeout) after
    # another covered run had ended (mode any), or after `approve` answered the call.
    released = asyncio.Event()
    asked = asyncio.Event()

    async def on_elicit(context: Any, params: Any) -> ElicitResult:
        asked.set()
        await released.wait()  # a user who has not answered yet
        return ANSWERS["refuse"]

    caller = {"x-luftpause-caller": f"moot-{moot_by}-{time.time_ns()}"}
    async with (
        stack(temporal_address) as s,
        _client(s.mcp_door, "legacy", caller, elicitation_callback=on_elicit) as c,
        _client(s.mcp_door, "legacy", caller) as other,  # the same caller, another session
    ):
        a = await spawn(c, task=task_with(1, "moot-a"), tools=["delete_record"])
        b = await spawn(c, task=task_with(1, "moot-b"), tools=["delete_record"])
        await until(lambda: _state(c, b, "AwaitingApproval"), "b waits for approval")
        handles = [a] if moot_by == "answered_elsewhere" else [a, b]
        call = asyncio.ensure_future(
            c.call_tool("await", {"handles": handles, "mode": "any", "timeout": 600})
        )
        try:
            await asyncio.wait_for(asked.wait(), 60)
            if moot_by == "another_run_ended":
                await other.call_tool("cancel", {"handle": b})
            else:
                await other.call_tool("approve", {"handle": a, "allow": True})
            # Bounded: before, the call ended only at its 600 s timeout.
            waited = result(await asyncio.wait_for(call, 60))
        finally:
            released.set()
            call.cancel()
        assert waited["done"] is True
        states = {r["handle"]: r["state"] for r in waited["runs"]}
        if moot_by == "another_run_ended":
            assert states[b] == "Cancelled"
        else:
            assert states[a] == "Completed" and sum(s.mcp.counts.values()) == 1


async def test_an_await_asks_a_worker_about_each_run_once_a_round(
    temporal_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every query is a workflow task on a worker: an await of many runs used to ask
    # about each one twice a second.  A client that cannot be asked about approvals
    # now has rounds of up to PROGRESS_EVERY_S (or until a run ends).
    from temporalio.client import WorkflowHandle

    asked: list[str] = []
    query = WorkflowHandle.query

    async def counted(self: Any, *args: Any, **kw: Any) -> Any:
        asked.append(self.id)
        return await query(self, *args, **kw)

    async with stack(temporal_address) as s, Client(s.mcp_door, mode="legacy") as c:
        handles = [
            await spawn(c, task=task_with(1, f"quiet{i}"), tools=["delete_record"])
            for i in range(3)
        ]
        for h in handles:
            await until(lambda h=h: _state(c, h, "AwaitingApproval"), "it waits")
        monkeypatch.setattr(WorkflowHandle, "query", counted)
        waited = result(await c.call_tool("await", {"handles": handles, "timeout": 6}))
        assert [r["state"] for r in waited["runs"]] == ["AwaitingApproval"] * 3
        # Rounds end at 5 s and at 6 s, after a first look: at most three per run.
        assert sorted(set(asked)) == sorted(handles)
        assert len(asked) <= 3 * len(handles), asked
        for h in handles:
            await c.call_tool("approve", {"handle": h, "allow": False})


@pytest.mark.parametrize("mode", [*MODES, "task"])
async def test_a_run_that_failed_or_was_cancelled_is_a_tool_error_with_its_view(
    temporal_address: str, mode: str
) -> None:
    # `run` returned a run that ended Failed or Cancelled as a success (isError false,
    # answer null): a harness showed it as done, and a model could take the null answer
    # for nothing to say.  It is an error now, its view kept as structuredContent; a
    # run's task (the Tasks extension) ends with the same result.
    tasks = TasksClient()
    extensions = [tasks] if mode == "task" else []
    # 75,000 tokens of prompt, past the fake engine's 56,000-token KV pool: its 400.
    too_big = {"model": MODEL, "task": "x" * 200_000, "system": "y" * 100_000}
    async with (
        stack(temporal_address, mcp_time_scale=1) as s,  # (a lookup takes about 1 s)
        Client(s.mcp_door, mode="legacy" if mode == "legacy" else "2026-07-28",
               extensions=extensions) as c,
    ):  # fmt: skip
        failed = await c.call_tool("run", too_big)
        assert failed.is_error, failed.content
        view = failed.structured_content
        assert view is not None and view["state"] == "Failed", view
        assert "does not fit the KV pool" in view["error"], view["error"]
        assert "answer" not in view and view["handle"].startswith("run-")
        assert "does not fit the KV pool" in error_text(failed)  # its text copy says why
        # Stopped by its own budget: Cancelled, no answer, an error as well.
        over = {"model": MODEL, "task": task_with(0, "over"), "budgetTokens": 1}
        stopped = await c.call_tool("run", over)
        assert stopped.is_error, stopped.content
        assert stopped.structured_content is not None
        assert stopped.structured_content["state"] == "Cancelled"
        assert stopped.structured_content["error"].startswith("budget exceeded: tokens ")
        done = await c.call_tool("run", {"model": MODEL, "task": task_with(0, "fine")})
        assert not done.is_error and result(done)["state"] == "Completed"
        assert result(done)["answer"]
        if mode != "task":  # (a task has no call timeout: it is followed to the run's end)
            # A call whose timeout came with its run still going is no error.
            slow = {"model": MODEL, "task": task_with(1, "slow"), "tools": ["lookup"]}
            going = await c.call_tool("run", slow | {"timeout": 0.2})
            assert not going.is_error and result(going)["state"] == "Running"
    if mode == "task":
        assert len(tasks.task_ids) == 3 and tasks.seen.count("completed") == 3, tasks.seen


@pytest.mark.parametrize("mode", MODES)
async def test_caller_header_and_bearer_token(temporal_address: str, mode: str) -> None:
    async with stack(temporal_address, token="s3cret") as s:
        # A caller is any UTF-8 name; its sub-agents' turns carry it through the proxy.
        caller = "team-jürgen"
        headers = {"authorization": b"Bearer s3cret", "x-luftpause-caller": caller.encode()}
        async with _client(s.mcp_door, mode, headers) as c:
            handle = await spawn(c, task=task_with(0, "who"))
            (st,) = await s.runs.statuses([handle])
            assert st.caller == caller
            (st,) = await s.runs.wait([handle], timeout=60)
            assert st.state == "Completed" and st.usage.turns == 1
        # Without the token the door answers 401 and runs nothing.
        async with httpx.AsyncClient() as http:
            r = await http.post(s.mcp_door, json={"jsonrpc": "2.0", "id": 1, "method": "ping"})
        assert r.status_code == 401
        assert r.json() == {"error": {"message": "missing or wrong bearer token"}}


@pytest.mark.parametrize("mode", MODES)
async def test_a_callers_own_token_sees_and_touches_only_its_runs(
    temporal_address: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TEAM_A_TOKEN", "tok-a")
    monkeypatch.setenv("TEAM_B_TOKEN", "tok-b")
    callers = [
        {"name": "team-a", "token_env": "TEAM_A_TOKEN"},
        {"name": "team-b", "token_env": "TEAM_B_TOKEN"},
    ]
    async with stack(temporal_address, token="op", callers=callers) as s:
        a = {"authorization": b"Bearer tok-a"}
        async with _client(s.mcp_door, mode, a) as c:
            handle = await spawn(c, task=task_with(1, "mine"), tools=["delete_record"])
            await until(lambda: _state(c, handle, "AwaitingApproval"), "it waits")
            (st,) = await s.runs.statuses([handle])
            assert st.caller == "team-a"  # the token's caller, with no header sent
            await until(lambda: _listed(c, handle), "listed (Temporal's list may lag)")

        b = {"authorization": b"Bearer tok-b"}
        unknown = f"no run with handle '{handle}'"
        async with _client(s.mcp_door, mode, b) as c:
            for name, args in [
                ("status", {"handles": [handle]}),
                ("await", {"handles": [handle], "timeout": 1}),
                ("cancel", {"handle": handle}),
                ("approve", {"handle": handle, "allow": True}),
                ("spawn", {"task": "x", "model": MODEL, "parent": handle}),
            ]:
                assert unknown in error_text(await c.call_tool(name, args)), name
            assert not await _listed(c, handle)
        (st,) = await s.runs.statuses([handle])
        assert st.state == "AwaitingApproval" and st.children == []  # nothing was done

        # A caller's token cannot speak for another caller; the operator's can.
        async with httpx.AsyncClient() as http:
            r = await http.post(
                s.mcp_door,
                json={"jsonrpc": "2.0", "id": 1, "method": "ping"},
                headers={**a, "x-luftpause-caller": "team-b"},
            )
            assert r.status_code == 403
            assert r.json()["error"]["message"] == (
                "x-luftpause-caller says 'team-b', but this token is caller 'team-a''s: "
                "leave the header out, or name that caller"
            )
            # A session opened with a's token is no session to b's (nor the operator's).
            accept = {"accept": "application/json, text/event-stream"}
            hello = {
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "t", "version": "0"},
            }
            opened = await http.post(
                s.mcp_door,
                json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": hello},
                headers={**a, **accept},
            )
            assert opened.status_code == 200
            session = {"mcp-session-id": opened.headers["mcp-session-id"], **accept}
            ping = {"jsonrpc": "2.0", "id": 2, "method": "ping"}
            for token, code in (
                (b"Bearer tok-b", 404),
                (b"Bearer op", 404),
                (b"Bearer tok-a", 200),
            ):
                r = await http.post(
                    s.mcp_door, json=ping, headers={**session, "authorization": token}
                )
                assert r.status_code == code, token
        operator = {"authorization": b"Bearer op", "x-luftpause-caller": b"team-a"}
        async with _client(s.mcp_door, mode, operator) as c:
            (run,) = result(await c.call_tool("status", {"handles": [handle]}))["runs"]
            assert run["state"] == "AwaitingApproval"
            denied = result(await c.call_tool("approve", {"handle": handle, "allow": False}))
            assert "pendingApproval" not in denied


@contextlib.asynccontextmanager
async def _client(url: str, mode: str, headers: dict[str, Any], **kw: Any) -> AsyncIterator[Client]:
    http = httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30.0, read=None))
    async with http, Client(streamable_http_client(url, http_client=http), mode=mode, **kw) as c:
        yield c


async def test_a_task_for_run_polled_to_completion_with_an_approval(
    temporal_address: str,
) -> None:
    async def on_elicit(context: Any, params: Any) -> ElicitResult:
        return ElicitResult(action="accept", content={"allow": True})

    tasks = TasksClient()
    async with (
        stack(temporal_address) as s,
        Client(
            s.mcp_door, mode="2026-07-28", extensions=[tasks], elicitation_callback=on_elicit
        ) as c,
    ):
        args = {"model": MODEL, "task": task_with(1, "task"), "tools": ["delete_record"]}
        call = await c.call_tool("run", args)
        run = result(call)
        assert [t.text for t in call.content] == [_compact(run)]  # as the call's own
        (task_id,) = tasks.task_ids
        # The task is the run: its id is the handle, and the workflow holds its state.
        assert run["handle"] == task_id and run["state"] == "Completed"
        assert "input_required" in tasks.seen and tasks.seen[-1] == "completed"
        # Kept while it runs (null), and for the dev server's retention (a day) past its
        # end once it ended.
        assert tasks.created[0].ttl_ms is None
        assert [t.ttl_ms for t in tasks.polls[:-1]] == [None] * (len(tasks.polls) - 1)
        done = tasks.polls[-1]
        lived = datetime.fromisoformat(done.last_updated_at) - datetime.fromisoformat(
            done.created_at
        )
        assert done.ttl_ms == (lived + timedelta(days=1)) // timedelta(milliseconds=1)
        assert (run["toolCalls"], run["failedToolCalls"]) == (1, 0)
        assert sum(s.mcp.counts.values()) == 1
        (st,) = await s.runs.statuses([task_id])
        assert st.state == "Completed" and st.answer == run["answer"]

        # tasks/cancel cancels the run.
        cancelling = TasksClient(on_created=cancel_task)
        async with Client(s.mcp_door, mode="2026-07-28", extensions=[cancelling]) as c2:
            r = await c2.call_tool("run", args)
        assert r.is_error and "task cancelled" in error_text(r)
        (st,) = await s.runs.statuses(cancelling.task_ids)
        assert st.state == "Cancelled"

        # Bad arguments are a tool error, and no task (or run) is made.
        r = await c.call_tool("run", {"task": "x", "model": "gpt-9"})
        assert "unknown model 'gpt-9'" in error_text(r)
        r = await c.call_tool("run", {"task": "  ", "parent": "\t"})  # (as the tools read it)
        assert "task: Value error, give the sub-agent's task" in error_text(r), error_text(r)
        assert "parent: Value error, give a running run's handle" in error_text(r)
        # tasks/get shows the run by itself: a maxChars it would not hold is refused.
        r = await c.call_tool("run", {"model": MODEL, "task": "x", "maxChars": 1000})
        assert "run: maxChars is not kept for a task" in error_text(r), error_text(r)
        assert len(tasks.task_ids) == 1

        # A client without the extension gets the plain synchronous result.
        async with Client(s.mcp_door, mode="2026-07-28") as plain:
            r = await plain.call_tool("run", {"model": MODEL, "task": task_with(0, "sync")})
        assert result(r)["state"] == "Completed"


async def test_a_task_whose_status_cannot_be_read_at_its_start_is_returned(
    temporal_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run exists before its task is answered; a status read that fails just then
    answered -32603 with no task id, and a client would start the run again (helper-144).
    The task is returned all the same, working."""
    from workflows import Runs, RunUnavailable

    read = Runs.status
    failing = [True]

    async def status(self: Runs, handle: str, **kw: Any) -> Any:
        if failing.pop() if failing else False:
            raise RunUnavailable("no worker polls the task queue just now")
        return await read(self, handle, **kw)

    monkeypatch.setattr(Runs, "status", status)
    async with stack(temporal_address) as s, httpx.AsyncClient(timeout=60) as http:
        door = Modern(http, s.mcp_door)
        spec = {"model": MODEL, "task": task_with(0, "blip")}
        created = await door.tool("run", spec, TASKS_CAPS)
        assert created["resultType"] == "task" and created["status"] == "working", created
        assert not failing  # the read failed
        handle = created["taskId"]
        # The run exists (by its description: Temporal's list may lag a start by a
        # moment, and did once in a loaded make test).
        assert (await s.runs.status(handle)).handle == handle

        async def ended() -> Any:
            got = await door.request("tasks/get", {"taskId": handle}, TASKS_CAPS)
            return got["result"] if got["result"]["status"] == "completed" else None

        task = await until(ended, "the task completed")
        assert task["result"]["structuredContent"]["state"] == "Completed"


async def test_a_task_outlives_the_gateway_that_created_it(temporal_address: str) -> None:
    """The gateway keeps no task state: a task made before a gateway restart is polled,
    answered and finished through the gateway that replaces it."""

    async def on_elicit(context: Any, params: Any) -> ElicitResult:
        return ElicitResult(action="accept", content={"allow": True})

    queue = f"test-{uuid.uuid4().hex[:12]}"
    port = free_port()
    gateway_url = f"http://127.0.0.1:{port}"
    async with contextlib.AsyncExitStack() as es:
        fakes = await start_fakes(es)
        engines, mcp_url, mcp_state = fakes.engines, fakes.mcp_url, fakes.mcp

        def gateway() -> Any:
            return gateway_app(
                engines, temporal=temporal_address, queue=queue, mcp_url=f"{mcp_url}/mcp"
            )

        client = await connect(temporal_address)
        await es.enter_async_context(run_worker(client, queue, gateway_url, f"{mcp_url}/mcp"))
        created = CreateOnly()
        args = {"model": MODEL, "task": task_with(1, "restart"), "tools": ["delete_record"]}
        async with serve(gateway(), port=port):
            async with Client(f"{gateway_url}/mcp", mode="2026-07-28", extensions=[created]) as c:
                with pytest.raises(TaskCreated):
                    await c.call_tool("run", args)
            (task_id,) = created.task_ids
            assert created.seen == ["working"]
        # The first gateway is gone (its process state with it); a new one takes the port.
        seen: list[str] = []
        async with (
            serve(gateway(), port=port),
            Client(
                f"{gateway_url}/mcp",
                mode="2026-07-28",
                extensions=[TasksClient()],
                elicitation_callback=on_elicit,
            ) as c,
        ):
            r = await follow(c.session, task_id, 0.2, seen)
        run = result(r)
        assert run["handle"] == task_id and run["state"] == "Completed"
        assert "input_required" in seen and seen[-1] == "completed"
        assert (run["toolCalls"], run["failedToolCalls"]) == (1, 0)
        assert sum(mcp_state.counts.values()) == 1  # the approved call ran once


@pytest.mark.parametrize("mode", MODES)
async def test_a_long_await_sends_progress(temporal_address: str, mode: str) -> None:
    progress: list[tuple[float, float | None, str | None]] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append((done, total, message))

    async with stack(temporal_address, mcp_time_scale=2) as s, Client(s.mcp_door, mode=mode) as c:
        # Runs of 0, 1, 2 and 3 calls (0.25-0.75 s each) end at different times.
        handles = [
            await spawn(c, task=task_with(n, f"progress{n}"), tools=["lookup"]) for n in range(4)
        ]
        r = await c.call_tool(
            "await", {"handles": handles, "timeout": 60}, progress_callback=on_progress
        )
        assert result(r)["done"] is True
    assert progress, "no progress notification arrived"
    assert all(total == 4 for _, total, _ in progress)
    counts = [done for done, _, _ in progress]
    assert all(a < b for a, b in itertools.pairwise(counts))  # MCP: progress rises
    assert counts[-1] < 4  # the last run's end is the result
    assert progress[-1][2] == f"{int(counts[-1])} of 4 runs ended"


@pytest.mark.parametrize("mode", MODES)
async def test_an_await_for_any_counts_progress_to_the_first_end(
    temporal_address: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gateway.mcp_door

    monkeypatch.setattr(gateway.mcp_door, "PROGRESS_EVERY_S", 0.2)  # heartbeats too
    progress: list[tuple[float, float | None, str | None]] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append((done, total, message))

    async with stack(temporal_address, mcp_time_scale=2) as s, Client(s.mcp_door, mode=mode) as c:
        # Runs of 2 and 3 calls (0.5-0.75 s each): the first ends after a heartbeat.
        handles = [await spawn(c, task=task_with(n, f"any{n}"), tools=["lookup"]) for n in (2, 3)]
        r = await c.call_tool(
            "await",
            {"handles": handles, "mode": "any", "timeout": 60},
            progress_callback=on_progress,
        )
        assert result(r)["done"] is True
    assert progress, "no progress notification arrived"
    # Of 1, not of 2: a bar that jumped from 0 of 2 to done said half the wait was left.
    assert {(total, message) for _, total, message in progress} == {
        (1, "waiting for the first of 2 runs to end")
    }
    counts = [done for done, _, _ in progress]
    assert all(a < b < 1 for a, b in itertools.pairwise(counts))


async def test_a_run_call_names_its_run_at_once_and_another_session_can_find_it(
    temporal_address: str,
) -> None:
    # helper-132: `run` gave its run's handle only at the run's end, and a legacy
    # session's `status` listed only that session's runs: a `run` call a gateway
    # restart cut left a run going that no MCP call could find, await or cancel.
    progress: list[str | None] = []
    values: list[tuple[float, float | None]] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append(message)
        values.append((done, total))

    async with (
        stack(temporal_address) as s,
        Client(s.mcp_door, mode="legacy") as c,
        Client(s.mcp_door, mode="legacy") as other,  # another session: another caller
    ):
        args = {"task": task_with(1, "named"), "tools": ["lookup"]}
        handle = result(await c.call_tool("run", args, progress_callback=on_progress))["handle"]
        assert progress and progress[0] == f"0 of 1 runs ended (run {handle})", progress
        # Without a parent there is no line to wait in: one step, from 0 of 1 (helper-259;
        # with a parent the call counts 2, its turn at the parent first).
        assert values[0][0] == 0 and {total for _, total in values} == {1}, values

        async def listed(**filters: Any) -> set[str]:
            return {r["handle"] for r in result(await other.call_tool("status", filters))["runs"]}

        assert handle not in await listed()  # the default list is the session's own
        await until(lambda: _covers(listed(allCallers=True), {handle}), "every caller's")
        r = await other.call_tool("status", {"handles": [handle], "allCallers": True})
        assert "allCallers filter the default list: give them without handles" in error_text(r)


def test_a_carried_deadline_is_held_to_the_longest_wait() -> None:
    # 2026-07-28 clients hand request_state back: one that pushed the deadline out
    # would otherwise wait as long as it liked.
    from gateway.mcp_door import _State

    assert _State().seconds_left(1000.0, 30.0) == 30.0  # the first round: the timeout
    carried = _State.load(_State(deadline=1020.0).dump())
    assert carried.seconds_left(1000.0, 30.0) == 20.0
    assert _State(deadline=1e12).seconds_left(1000.0, 30.0) == 600.0


def test_a_budget_passed_by_late_work_shows_over_not_exceeded() -> None:
    """`exceeded` is what stopped a subtree; a use past a limit that stopped nothing
    (work below that ended after the run closed) is `over`, in the MCP view as well."""
    from gateway.mcp_door import view
    from workflows import RunStatus, Totals
    from workflows.contract import Budget, BudgetStatus

    def ended(budget: BudgetStatus) -> RunStatus:
        return RunStatus(
            handle="run-x", state="Completed", task="t", model=MODEL, service_class="batch",
            caller="c", parent=None, root="run-x", children=[], usage=Totals(),
            subtree=Totals(), budget=budget, started_at="2026-11-30T10:00:00+00:00",
            ended_at="2026-11-30T10:01:00+00:00",
        )  # fmt: skip

    limits = Budget(tokens=100, tool_calls=4, seconds=10.0)
    cases = [
        (Budget(tokens=100, tool_calls=4, seconds=10.0), None),  # at a limit is not past it
        (Budget(tokens=130, tool_calls=5, seconds=12.0), "tokens 130/100"),
        (Budget(tokens=90, tool_calls=5, seconds=12.0), "tool_calls 5/4"),
        (Budget(tokens=90, tool_calls=3, seconds=10.01), "seconds 10.1/10"),
    ]
    for used, over in cases:
        assert BudgetStatus(limits, used).past_a_limit() == over, used
    b = BudgetStatus(limits, Budget(tokens=130), over="tokens 130/100")
    shown = view(ended(b)).model_dump()["budget"]
    assert "exceeded" not in shown and shown["over"] == "tokens 130/100"
    assert shown["used"]["tokens"] == 130
    # A run started with a budget past the door's bounds (before them) still renders.
    huge = view(ended(BudgetStatus(Budget(tokens=10**309), Budget(tokens=5)))).model_dump()
    assert huge["budget"]["limits"]["tokens"] == 10**309


def test_an_ended_runs_task_is_completed_with_what_run_returns() -> None:
    # What the `run` call itself returns, a failed run's and a budget-stopped run's
    # included (SEP-2663 keeps `failed` for JSON-RPC errors); a run cancelled on request
    # is a cancelled task.
    from gateway.mcp_tasks import TasksExtension
    from workflows import RunStatus, Totals
    from workflows.contract import Budget, BudgetStatus

    def status(state: str, error: str | None, budget: BudgetStatus | None = None) -> RunStatus:
        return RunStatus(
            handle="run-x", state=state, task="t", model=MODEL, service_class="batch",
            caller="c", parent=None, root="run-x", children=[], usage=Totals(),
            subtree=Totals(), error=error, budget=budget,
            started_at="2026-11-30T10:00:00+00:00", ended_at="2026-11-30T10:01:00+00:00",
        )  # fmt: skip

    async def no_runs() -> Any:
        raise AssertionError("not used")

    async def no_start(arguments: Any, ctx: Any) -> Any:
        raise AssertionError("not used")

    ext = TasksExtension(
        no_runs, no_start, lambda st: {"state": st.state, "error": st.error}, lambda exc: None
    )
    failed = ext._task(status("Failed", "engine gone"), ctx=None, retention=timedelta(hours=1))
    assert (failed["status"], failed["pollIntervalMs"]) == ("completed", 500)
    # Kept for the namespace's retention from its end (a minute after its creation)...
    assert failed["ttlMs"] == 60_000 + 3_600_000
    # ... and to its end alone when the retention could not be read (it may be gone);
    # a run that has not ended is kept for as long as it goes on: null.
    assert ext._task(status("Completed", None), ctx=None)["ttlMs"] == 60_000
    for going in ("Running", "AwaitingApproval", "Stopping"):
        task = ext._task(status(going, None), ctx=None, retention=timedelta(hours=1))
        assert task["ttlMs"] is None, going
    assert failed["result"] == {"state": "Failed", "error": "engine gone"}
    over = BudgetStatus(Budget(tokens=600), Budget(tokens=900), "tokens 900/600")
    stopped = ext._task(status("Cancelled", "budget exceeded: tokens 900/600", over), ctx=None)
    assert stopped["status"] == "completed"
    assert stopped["result"] == {"state": "Cancelled", "error": "budget exceeded: tokens 900/600"}
    stopping = ext._task(status("Stopping", "budget exceeded: tokens 900/600", over), ctx=None)
    assert stopping["status"] == "working" and "result" not in stopping  # not ended yet
    cancelled = ext._task(status("Cancelled", "cancelled"), ctx=None, retention=timedelta(days=1))
    assert cancelled["status"] == "cancelled" and "result" not in cancelled
    assert cancelled["ttlMs"] == 60_000 + 86_400_000
    assert cancelled["statusMessage"] == "cancelled"


async def test_a_tasks_retention_is_read_once_and_again_later_while_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The namespace's retention is one per door: read at the first ended task, kept;
    unread (the describe failed), read again only after RETENTION_RETRY_S."""
    import gateway.mcp_tasks as mcp_tasks
    from gateway.mcp_tasks import TasksExtension

    class Namespace:
        def __init__(self) -> None:
            self.answers: list[timedelta | None] = [None, timedelta(hours=2), None]

        async def retention(self) -> timedelta | None:
            return self.answers.pop(0)

    async def never(*args: Any) -> Any:
        raise AssertionError("not called")

    ext = TasksExtension(never, start_run=never, result=never, unavailable=lambda e: None)
    ns: Any = Namespace()
    assert await ext._kept(ns) is None and await ext._kept(ns) is None
    assert len(ns.answers) == 2  # not read again within RETENTION_RETRY_S
    monkeypatch.setattr(mcp_tasks, "RETENTION_RETRY_S", 0.0)
    assert await ext._kept(ns) == timedelta(hours=2)
    assert await ext._kept(ns) == timedelta(hours=2) and len(ns.answers) == 1  # kept


async def test_polls_during_the_retentions_first_read_wait_for_it() -> None:
    # A poll that came while another read the retention took None, and showed an ended
    # task as already past its ttlMs (helper-227).
    from gateway.mcp_tasks import TasksExtension

    class Namespace:
        def __init__(self) -> None:
            self.asked, self.began, self.answered = 0, asyncio.Event(), asyncio.Event()

        async def retention(self) -> timedelta | None:
            self.asked += 1
            self.began.set()
            await self.answered.wait()
            return timedelta(days=1)

    async def never(*args: Any) -> Any:
        raise AssertionError("not called")

    ext = TasksExtension(never, start_run=never, result=never, unavailable=lambda e: None)
    ns: Any = Namespace()
    first = asyncio.create_task(ext._kept(ns))
    await ns.began.wait()  # the first read is under way
    second = asyncio.create_task(ext._kept(ns))
    await asyncio.sleep(0)  # (one turn of the loop: the second runs to where it waits)
    ns.answered.set()
    assert await asyncio.gather(first, second) == [timedelta(days=1)] * 2
    assert ns.asked == 1


async def test_a_retention_the_namespace_will_not_give_is_none_not_an_error() -> None:
    # Any failure (not only an RPCError) of a hint must not fail a task's poll.
    from workflows import Runs

    class Service:
        async def describe_namespace(self, request: Any, **kwargs: Any) -> Any:
            raise RuntimeError("connection gone")

    runs = Runs.__new__(Runs)
    runs._client = cast(Any, SimpleNamespace(namespace="default", workflow_service=Service()))
    assert await runs.retention() is None


async def test_a_run_closed_unseen_ends_when_temporal_closed_it() -> None:
    # With no worker to answer, a cancelled (or terminated) run's status had no end, so
    # its task's lastUpdatedAt was its creation and its ttlMs ran out from there.
    from temporalio.client import WorkflowExecutionStatus
    from temporalio.service import RPCError, RPCStatusCode

    from workflows import Runs

    class Handle:
        async def query(self, *args: Any) -> Any:
            raise RPCError("no poller seen", RPCStatusCode.FAILED_PRECONDITION, b"")

    runs = Runs.__new__(Runs)
    runs._handle = lambda handle: cast(Any, Handle())  # type: ignore[method-assign]
    started = datetime(2026, 12, 4, 9, 0, tzinfo=UTC)
    closed = datetime(2026, 12, 6, 9, 0, tzinfo=UTC)
    desc = SimpleNamespace(
        id="run-x", status=WorkflowExecutionStatus.CANCELED, start_time=started, close_time=closed
    )
    status = await runs._recorded_status(cast(Any, desc), 0.1)
    assert (status.state, status.started_at, status.ended_at) == (
        "Cancelled",
        started.isoformat(),
        closed.isoformat(),
    )


class Modern:
    """Raw 2026-07-28 requests to the door (what an SDK client does not send)."""

    def __init__(self, http: httpx.AsyncClient, url: str) -> None:
        self.http, self.url = http, url

    async def request(
        self, method: str, params: dict[str, Any], caps: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        meta = {
            "io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "1"},
            "io.modelcontextprotocol/clientCapabilities": caps or {},
        }
        headers = {
            "accept": "application/json, text/event-stream",
            "mcp-protocol-version": "2026-07-28",
            "mcp-method": method,
        }
        if "name" in params or "taskId" in params:
            headers["mcp-name"] = params.get("name") or params["taskId"]
        body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": {**params, "_meta": meta}}
        r = await self.http.post(self.url, json=body, headers=headers)
        text = r.text
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            text = [ln[5:] for ln in text.splitlines() if ln.startswith("data:")][-1]
        answer: dict[str, Any] = json.loads(text)
        return answer

    async def tool(
        self, name: str, arguments: dict[str, Any], caps: dict[str, Any] | None = None, **kw: Any
    ) -> dict[str, Any]:
        answer = await self.request(
            "tools/call", {"name": name, "arguments": arguments, **kw}, caps
        )
        result: dict[str, Any] = answer["result"]
        return result


TASKS_CAPS = {"extensions": {"io.modelcontextprotocol/tasks": {}}}
FORM = {"elicitation": {"form": {}}}


async def test_approval_answers_count_only_for_questions_the_door_asked(
    temporal_address: str,
) -> None:
    # An input response whose key was never issued (no call id, another run) approves
    # nothing: the user was not shown that call.
    async with stack(temporal_address) as s, httpx.AsyncClient(timeout=60) as http:
        door = Modern(http, s.mcp_door)
        spec = {"model": MODEL, "task": task_with(1, "keys"), "tools": ["delete_record"]}
        x = (await door.tool("spawn", spec))["structuredContent"]["handle"]
        y = (await door.tool("spawn", spec))["structuredContent"]["handle"]
        for h in (x, y):
            await until(lambda h=h: state_is(s, h, "AwaitingApproval"), f"{h} waits")
        allow = {"action": "accept", "content": {"allow": True}}

        # `await` over x asks about x; its next round answers x "later" and y "allow".
        first = await door.tool("await", {"handles": [x], "timeout": 2}, FORM)
        assert first["resultType"] == "input_required"
        (asked,) = first["inputRequests"]
        assert asked.startswith(f"approve:{x}:")
        y_call = (await s.runs.status(y)).pending_approval
        assert y_call is not None
        await door.tool(
            "await",
            {"handles": [x], "timeout": 2},  # as in the first round: the state is bound to it
            FORM,
            requestState=first["requestState"],
            inputResponses={
                asked: {"action": "cancel"},
                f"approve:{y}:{y_call.call_id}": allow,
                f"approve:{y}": allow,
            },
        )
        # Tasks: keys without the call id, or of another task, are ignored too.
        for key in (f"approve:{y}", y, f"approve:{x}:{y_call.call_id}"):
            answer = await door.request(
                "tasks/update", {"taskId": y, "inputResponses": {key: allow}}, TASKS_CAPS
            )
            assert "error" not in answer, answer
        for h in (x, y):
            st = await s.runs.status(h)
            assert st.state == "AwaitingApproval" and st.usage.tool_calls == 0, st
        assert sum(s.mcp.counts.values()) == 0

        # A client that did not declare the extension may not use tasks/*.
        for method, params in (
            ("tasks/get", {"taskId": y}),
            ("tasks/update", {"taskId": y, "inputResponses": {}}),
            ("tasks/cancel", {"taskId": y}),
        ):
            answer = await door.request(method, params)
            assert answer["error"]["code"] == -32021, answer
        # One that did but cannot answer forms sees the question's text, not a form, in a
        # task that is working: input_required must list requests it could answer.
        task = (await door.request("tasks/get", {"taskId": y}, TASKS_CAPS))["result"]
        assert task["status"] == "working" and "inputRequests" not in task
        assert "delete_record" in task["statusMessage"]
        assert f"approve(handle='{y}'" in task["statusMessage"]
        again = (await door.request("tasks/get", {"taskId": y}, {**TASKS_CAPS, **FORM}))["result"]
        (key,) = again["inputRequests"]
        # Nothing changed between the two reads: the task says when it last did.
        assert again["lastUpdatedAt"] == task["lastUpdatedAt"] >= task["createdAt"]
        # Dismissed: not asked again under that key, which MCP forbids and a client
        # skips (helper-144: the task stayed input_required for ever); the approve
        # tool, or a late answer to the key, still answers it.
        dismissed = await door.request(
            "tasks/update",
            {"taskId": y, "inputResponses": {key: {"action": "cancel"}}},
            {**TASKS_CAPS, **FORM},
        )
        assert "error" not in dismissed, dismissed
        later = (await door.request("tasks/get", {"taskId": y}, {**TASKS_CAPS, **FORM}))["result"]
        assert later["status"] == "working" and "inputRequests" not in later, later
        assert f"approve(handle='{y}'" in later["statusMessage"]
        assert await state_is(s, y, "AwaitingApproval")
        # A malformed response to a key never issued is ignored, as any such key is
        # (helper-155: the answer before it was applied, and the update refused).
        responses = {key: allow, f"approve:{y}:never-issued": {"action": "accept"}}
        answer = await door.request(
            "tasks/update", {"taskId": y, "inputResponses": responses}, TASKS_CAPS
        )
        assert "error" not in answer, answer
        await until(lambda: state_is(s, y, "Completed"), "y ran once allowed")
        assert sum(s.mcp.counts.values()) == 1

        # A handle given twice is read once and shown twice, in order.
        shown = (await door.tool("status", {"handles": [x, y, x]}))["structuredContent"]
        assert [r["handle"] for r in shown["runs"]] == [x, y, x]
        # `await` lets calls run (the answers to its questions): it is not read-only.
        tools = (await door.request("tools/list", {}))["result"]["tools"]
        (listed,) = [t for t in tools if t["name"] == "await"]
        assert listed["annotations"]["readOnlyHint"] is False
        # Allowing runs the call that waited for a person: a client that asks before
        # destructive tools asks before this one (helper-208).
        (listed,) = [t for t in tools if t["name"] == "approve"]
        assert listed["annotations"]["destructiveHint"] is True
        # Reading an answer's rest changes nothing: a client may call it unasked.
        (listed,) = [t for t in tools if t["name"] == "answer"]
        assert listed["annotations"]["readOnlyHint"] is True
        assert set(listed["inputSchema"]["properties"]) == {"handle", "offset", "maxChars"}
        for name in ("await", "run", "status", "answer"):
            (listed,) = [t for t in tools if t["name"] == name]
            bounds = listed["inputSchema"]["properties"]["maxChars"]
            assert (bounds["minimum"], bounds["maximum"], bounds["default"]) == (
                1000,
                1_000_000,
                RESULT_ANSWER_CHARS,
            )
        # The tools whose results maxChars bounds tell Claude Code to keep them inline
        # up to 200,000 characters, not save one past 50,000 to a file; no other does.
        meta = {t["name"]: t.get("_meta") for t in tools}
        assert {n for n, m in meta.items() if m} == {"await", "run", "status", "answer"}
        assert all(m == {"anthropic/maxResultSizeChars": 200_000} for m in meta.values() if m), meta
        # Every schema says an argument not named is refused, as it is (helper-126).
        assert all(t["inputSchema"]["additionalProperties"] is False for t in tools)
        # Descriptions without the source's indentation, which every client's prompt
        # carried (helper-224).
        lines = [ln for t in tools for ln in t["description"].splitlines()[1:]]
        assert lines and not any(ln.startswith(" ") for ln in lines), lines
        await s.runs.request_cancel(x)


async def test_an_approval_answer_no_worker_can_take_is_not_acknowledged(
    temporal_address: str,
) -> None:
    # tasks/update read the pending approval from the run's status; with no worker to
    # answer the status query it showed none, and the answer was acknowledged and
    # dropped (the client, told it was delivered, never sends it again).
    async with (
        stack(temporal_address, worker=False) as s,
        httpx.AsyncClient(timeout=60) as http,
    ):
        door = Modern(http, s.mcp_door)
        spec = {"model": MODEL, "task": task_with(1, "nokeytaker"), "tools": ["delete_record"]}
        y = (await door.tool("spawn", spec))["structuredContent"]["handle"]
        allow = {"action": "accept", "content": {"allow": True}}
        # Every response is read before any is applied: a malformed one (any key of the
        # task may be outstanding, the run unread) refuses the update whole, before the
        # answer ahead of it is sent (helper-155: that one was applied first).
        responses = {f"approve:{y}:call_1": allow, f"approve:{y}:call_2": {"action": "accept"}}
        answer = await door.request(
            "tasks/update", {"taskId": y, "inputResponses": responses}, TASKS_CAPS
        )
        assert answer["error"]["code"] == -32602, answer
        assert (
            f"input response 'approve:{y}:call_2': expected content" in answer["error"]["message"]
        )
        answer = await door.request(
            "tasks/update", {"taskId": y, "inputResponses": {f"approve:{y}:call_1": allow}},
            TASKS_CAPS,
        )  # fmt: skip
        assert answer["error"]["code"] == -32603, answer
        assert "no worker polls task queue" in answer["error"]["message"]
        assert f"run '{y}' cannot take the answer" in answer["error"]["message"]
        # The task itself reads as working: what it waits on is not known, and it says
        # so (a poll asks a worker 2 s at most: it asked 10 s, at every poll).
        task = (await door.request("tasks/get", {"taskId": y}, TASKS_CAPS))["result"]
        assert task["status"] == "working", task
        assert task["statusMessage"] == "status unavailable: no worker answered within 2 s"
        await s.runs.request_cancel(y)


async def test_an_approval_answer_temporal_cuts_short_is_said_so_not_acknowledged(
    temporal_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Temporal answers the approve update, or a poll for its outcome, with
    # DEADLINE_EXCEEDED or CANCELLED: the SDK's own error, no RPCError, went up as it
    # was, and the answer was said to find the run store unreachable, or was a bare
    # tool error (helper-219).  Each way of answering says the run may not have it.
    from temporalio.client import WorkflowHandle

    from tests.workflows.test_spawn_retry import _CANCELLED, _DEADLINE

    async with stack(temporal_address) as s, httpx.AsyncClient(timeout=60) as http:
        door = Modern(http, s.mcp_door)
        spec = {"model": MODEL, "task": task_with(1, "cutshort"), "tools": ["delete_record"]}
        y = (await door.tool("spawn", spec))["structuredContent"]["handle"]
        await until(lambda: state_is(s, y, "AwaitingApproval"), "y waits")
        first = await door.tool("await", {"handles": [y], "timeout": 2}, FORM)
        (asked,) = first["inputRequests"]
        allow = {"action": "accept", "content": {"allow": True}}
        said = (
            f"run '{y}' did not say it took the answer: Temporal cut the call short "
            "(context deadline exceeded); it may have taken it, or take it later (status tells)"
        )
        for error in (_DEADLINE, _CANCELLED):

            async def cut(self: Any, *args: Any, error: Exception = error, **kw: Any) -> Any:
                raise error

            monkeypatch.setattr(WorkflowHandle, "execute_update", cut)
            r = await door.tool("approve", {"handle": y, "allow": True})
            text = r["content"][0]["text"]
            assert r["isError"] and text == f"Error executing tool approve: {said}", r
            answered = await door.tool(
                "await",
                {"handles": [y], "timeout": 2},
                FORM,
                requestState=first["requestState"],
                inputResponses={asked: allow},
            )
            text = answered["content"][0]["text"]
            assert answered["isError"] and text == f"Error executing tool await: {said}", answered
            answer = await door.request(
                "tasks/update", {"taskId": y, "inputResponses": {asked: allow}}, TASKS_CAPS
            )
            assert answer["error"] == {"code": -32603, "message": said}, answer
        monkeypatch.undo()
        st = await s.runs.status(y)
        assert st.state == "AwaitingApproval" and sum(s.mcp.counts.values()) == 0, st
        await s.runs.request_cancel(y)


async def test_status_lists_runs_by_state_tree_parent_class_and_model(
    temporal_address: str,
) -> None:
    async with stack(temporal_address) as s, Client(s.mcp_door, mode="2026-07-28") as c:
        waiting = await spawn(c, task=task_with(1, "flt"), tools=["delete_record"])
        await until(lambda: _state(c, waiting, "AwaitingApproval"), "it waits")
        kid = await spawn(c, task=task_with(0, "fltkid"), parent=waiting)
        done = await spawn(c, task=task_with(0, "fltdone"), serviceClass="batch")
        await c.call_tool("await", {"handles": [kid, done]})

        async def listed(**filters: Any) -> set[str] | None:
            runs = result(await c.call_tool("status", filters))["runs"]
            return {r["handle"] for r in runs}

        # Temporal's list follows the runs' search attributes a moment behind.
        await until(lambda: _equals(listed(state="AwaitingApproval"), {waiting}), "listed by state")
        await until(lambda: _equals(listed(root=waiting), {waiting, kid}), "listed by tree")
        await until(lambda: _covers(listed(state="Completed"), {kid, done}), "listed as ended")
        await until(lambda: _equals(listed(parent=waiting), {kid}), "listed by parent")
        await until(lambda: _equals(listed(serviceClass="batch"), {done}), "listed by class")
        everyone = {waiting, kid, done}
        await until(lambda: _equals(listed(model=MODEL), everyone), "listed by model")
        assert await listed(model="other-model") == set()
        for bad in ({"state": "Completed"}, {"parent": waiting}, {"model": MODEL}):
            r = await c.call_tool("status", {"handles": [done], **bad})
            assert "filter the default list: give them without handles" in error_text(r)
        assert "state" in error_text(await c.call_tool("status", {"state": "Sleeping"}))
        await c.call_tool("approve", {"handle": waiting, "allow": False})


async def _equals(got: Any, want: set[str]) -> bool:
    return bool(await got == want)


async def _covers(got: Any, want: set[str]) -> bool:
    return bool(await got >= want)


async def test_a_part_that_is_down_is_named_not_hidden_as_a_crash(temporal_address: str) -> None:
    # The SDK hides an unexpected error's message ("Error executing tool spawn"); that a
    # needed part is down is no crash, and the caller is told which.
    no_tools = f"http://127.0.0.1:{free_port()}/mcp"  # nothing listens there
    async with contextlib.AsyncExitStack() as es:
        fakes = await start_fakes(es)
        # Temporal up, the tool server down: a spawn that names its tools says so.
        port = free_port()
        app = gateway_app(fakes.engines, temporal=temporal_address, mcp_url=no_tools)
        await es.enter_async_context(serve(app, port=port))
        async with Client(f"http://127.0.0.1:{port}/mcp", mode="legacy") as c:
            r = await c.call_tool("spawn", {"task": "t", "model": MODEL, "tools": ["lookup"]})
            assert r.is_error
            text = r.content[0].text
            assert text.startswith("Error executing tool spawn: a tool server is unreachable:")
            assert "mcp server 'fake'" in text
        # Temporal never reached: the address it was looked for at is named.
        nowhere = f"127.0.0.1:{free_port()}"
        port = free_port()
        app = gateway_app(fakes.engines, temporal=nowhere)
        await es.enter_async_context(serve(app, port=port))
        async with Client(f"http://127.0.0.1:{port}/mcp", mode="legacy") as c:
            r = await c.call_tool("spawn", {"task": "t", "model": MODEL})
            assert r.is_error
            assert r.content[0].text.startswith(
                f"Error executing tool spawn: the run store (Temporal) at {nowhere} "
                "([temporal] address, or LUFTPAUSE_TEMPORAL_ADDRESS) is unreachable: "
            ), r.content[0].text
        # Temporal there, the namespace not (helper-135: a bare "Error executing tool").
        port = free_port()
        app = gateway_app(fakes.engines, temporal=temporal_address, namespace="typo-ns")
        await es.enter_async_context(serve(app, port=port))
        async with Client(f"http://127.0.0.1:{port}/mcp", mode="legacy") as c:
            r = await c.call_tool("status", {})
            assert r.is_error
            assert r.content[0].text == (
                "Error executing tool status: the run store (Temporal) refused it: Namespace "
                "typo-ns is not found.: the namespace ([temporal] namespace) must exist and "
                "have luftpause's search attributes (deploy/k8s/README.md, step 2)"
            )
        # Temporal reached once, then gone (the dev server stopped).
        with tempfile.TemporaryDirectory() as tmp:
            server = DevServer(log_file=Path(tmp) / "temporal.log")
            server.start()
            try:
                port = free_port()
                app = gateway_app(fakes.engines, temporal=server.address)
                await es.enter_async_context(serve(app, port=port))
                async with (
                    Client(f"http://127.0.0.1:{port}/mcp", mode="legacy") as c,
                    Client(
                        f"http://127.0.0.1:{port}/mcp", mode="2026-07-28", extensions=[CreateOnly()]
                    ) as tc,
                ):
                    assert not (await c.call_tool("status", {})).is_error  # connected
                    server.stop()
                    r = await c.call_tool("spawn", {"task": "t", "model": MODEL})
                    # A Tasks client is told the same: polling or answering a task as
                    # JSON-RPC errors, starting one as the tool's error (as without tasks).
                    down = "the run store (Temporal) is unavailable: "
                    get = TasksGet(params=TaskIdParams(taskId="run-0"))
                    with pytest.raises(MCPError, match=f"^{re.escape(down)}"):
                        await tc.session.send_request(get, GetTaskResult)
                    key = f"approve:run-0:{uuid.uuid4().hex}"
                    answer = {key: {"action": "accept", "content": {"allow": True}}}
                    update = TasksUpdate(params=UpdateParams(taskId="run-0", inputResponses=answer))
                    with pytest.raises(MCPError, match=f"^{re.escape(down)}"):
                        await tc.session.send_request(update, EmptyResult)
                    started = await tc.call_tool("run", {"task": "t", "model": MODEL})
                    assert started.is_error and down in started.content[0].text
            finally:
                server.stop()
        assert r.is_error
        text = r.content[0].text
        assert text.startswith(f"Error executing tool spawn: {down}"), text


def test_a_namespace_without_the_search_attributes_is_said_so() -> None:
    # What Temporal answers a list by a search attribute the namespace never registered
    # (made with `temporal operator namespace create` and no more).
    from temporalio.service import RPCError, RPCStatusCode

    from gateway.mcp_door import _unavailable

    e = RPCError(
        "Namespace bare has no mapping defined for search attribute LuftpauseState",
        RPCStatusCode.INVALID_ARGUMENT,
        b"",
    )
    assert _unavailable(RuntimeError("wrapped")) is None
    cause = RuntimeError("the tool failed")
    cause.__cause__ = e
    said = _unavailable(cause)
    assert said is not None and said.startswith(
        "the run store (Temporal) refused it: Namespace bare has no mapping defined for "
        "search attribute LuftpauseState: the namespace ([temporal] namespace) must exist"
    )
    other = RPCError("bad page token", RPCStatusCode.INVALID_ARGUMENT, b"")
    assert _unavailable(other) is None  # another refusal stays a crash


def test_temporal_that_answers_unavailable_or_late_is_not_called_unreachable() -> None:
    # helper-249: every UNAVAILABLE and DEADLINE_EXCEEDED was "is unreachable", though
    # Temporal sends UNAVAILABLE itself (a workflow too busy to lock; service/history/
    # consts ErrWorkflowBusy) and a call's time can run out with Temporal there.
    from temporalio.service import RPCError, RPCStatusCode

    from gateway.mcp_door import _unavailable

    busy = RPCError("timeout locking workflow execution", RPCStatusCode.UNAVAILABLE, b"")
    late = RPCError("context deadline exceeded", RPCStatusCode.DEADLINE_EXCEEDED, b"")
    assert _unavailable(busy) == (
        "the run store (Temporal) is unavailable: timeout locking workflow execution"
    )
    assert _unavailable(late) == (
        "the run store (Temporal) did not answer in time: context deadline exceeded"
    )


async def test_a_caller_cannot_take_every_mcp_session(
    temporal_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Sessions opened and never closed: the caller is refused its own next one, while
    # another caller, and the operator, still open theirs.
    import gateway.app

    monkeypatch.setattr(gateway.app, "MCP_SESSIONS_PER_CALLER", 3)
    monkeypatch.setenv("TEAM_A_TOKEN", "tok-a")
    monkeypatch.setenv("TEAM_B_TOKEN", "tok-b")
    callers = [
        {"name": "team-a", "token_env": "TEAM_A_TOKEN"},
        {"name": "team-b", "token_env": "TEAM_B_TOKEN"},
    ]
    initialize = {
        "jsonrpc": "2.0",
        "id": 0,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "clientInfo": {"name": "raw", "version": "1"},
        },
    }

    async with (
        stack(temporal_address, token="op", callers=callers) as s,
        httpx.AsyncClient(timeout=30) as http,
    ):

        def headers(token: str, session: str | None = None) -> dict[str, str]:
            h = {
                "authorization": f"Bearer {token}",
                "accept": "application/json, text/event-stream",
            }
            if session is not None:
                h |= {"mcp-session-id": session, "mcp-protocol-version": "2025-11-25"}
            return h

        async def opened(token: str) -> httpx.Response:
            return await http.post(s.mcp_door, json=initialize, headers=headers(token))

        first = [await opened("tok-a") for _ in range(4)]
        assert [r.status_code for r in first] == [200, 200, 200, 503]
        assert (await opened("tok-b")).status_code == 200
        assert [(await opened("op")).status_code for _ in range(4)] == [200] * 4
        # A session that ends frees its place.
        session = first[0].headers["mcp-session-id"]
        r = await http.delete(s.mcp_door, headers=headers("tok-a", session))
        assert r.status_code == 200, r.text
        assert (await opened("tok-a")).status_code == 200


@pytest.mark.parametrize("mode", MODES)
async def test_progress_rises_while_no_run_ends(
    temporal_address: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # MCP: "The progress value MUST increase with each notification".  The heartbeats
    # of a wait in which no run ends climb towards the next run, never reaching it.
    import gateway.mcp_door

    monkeypatch.setattr(gateway.mcp_door, "PROGRESS_EVERY_S", 0.3)
    progress: list[tuple[float, float | None, str | None]] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append((done, total, message))

    async with stack(temporal_address) as s, Client(s.mcp_door, mode=mode) as c:
        # A run that does not end: it waits for its child, which waits on an approval.
        # (A run waiting on one itself is answered at once to a client asked nothing.)
        handle = await spawn(c, task=task_with(1, "beats"), tools=["delete_record"])
        await until(lambda: _state(c, handle, "AwaitingApproval"), "it waits")
        kid = await spawn(c, task=task_with(1, "kid"), tools=["delete_record"], parent=handle)
        await until(lambda: _state(c, kid, "AwaitingApproval"), "its child waits")
        result(await c.call_tool("approve", {"handle": handle, "allow": True}))
        await until(lambda: _state(c, handle, "AwaitingChildren"), "it waits for its child")
        r = await c.call_tool(
            "await", {"handles": [handle], "timeout": 1.5}, progress_callback=on_progress
        )
        assert result(r)["done"] is False
        await c.call_tool("cancel", {"handle": handle})
    values = [done for done, _, _ in progress]
    assert len(values) >= 3, progress
    assert all(a < b for a, b in itertools.pairwise(values)) and values[-1] < 1, values
    assert {(total, message) for _, total, message in progress} == {(1, "0 of 1 runs ended")}


async def test_only_the_question_a_task_asks_is_remembered_as_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A dismissal is remembered for the key asked; any other key of the task's handle
    (a call id never issued, up to the body's size) was kept too (helper-145)."""
    from types import SimpleNamespace

    import gateway.mcp_tasks as mcp_tasks
    from gateway.mcp_tasks import TasksExtension, UpdateParams
    from workflows.contract import PendingApproval, RunStatus, Totals
    from workflows.runs import STATUS_UNAVAILABLE

    monkeypatch.setattr(mcp_tasks, "require_client_extension", lambda ctx, ext: None)
    handle = "run-0123456789abcdef0123"
    waiting = RunStatus(
        handle=handle, state="AwaitingApproval", task="t", model="m",
        service_class="interactive", caller="c", parent=None, root=handle, children=[],
        usage=Totals(), subtree=Totals(),
        pending_approval=PendingApproval("call_1", "delete", {}),
    )  # fmt: skip

    class OneRun:
        async def status(self, h: str, **kw: Any) -> RunStatus:
            return waiting

    async def runs(ctx: Any) -> Any:
        return OneRun()

    async def never(*args: Any) -> Any:
        raise AssertionError("not called")

    ext = TasksExtension(runs, start_run=never, result=never, unavailable=lambda e: None)
    dismissed = {"action": "cancel"}
    for key in (f"approve:{handle}:{'x' * 100_000}", f"approve:{handle}:call_0"):
        await ext.update(
            SimpleNamespace(), UpdateParams(taskId=handle, inputResponses={key: dismissed})
        )
    assert not ext._answered
    asked = f"approve:{handle}:call_1"
    await ext.update(
        SimpleNamespace(), UpdateParams(taskId=handle, inputResponses={asked: dismissed})
    )
    assert list(ext._answered) == [asked]
    # With no worker to say which call the run asks about, a key of a call id's size is
    # remembered (helper-147: it was forgotten, and asked again once a worker was back).
    waiting = dataclasses.replace(
        waiting, state="Running", pending_approval=None, error=f"{STATUS_UNAVAILABLE}none"
    )
    for key in (f"approve:{handle}:call_2", f"approve:{handle}:{'x' * 100_000}"):
        await ext.update(
            SimpleNamespace(), UpdateParams(taskId=handle, inputResponses={key: dismissed})
        )
    assert list(ext._answered) == [asked, f"approve:{handle}:call_2"]


async def test_a_stop_lets_background_work_end_within_its_bound(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A cut call's run is cancelled in the background once it has started; the loop's
    end cancelled that work at a stop, and the run went on (helper-147).  A stop waits
    for it, within a bound; what is left is logged."""
    from gateway.mcp_tasks import Background

    started, done = asyncio.Event(), []

    async def cancel_once_started() -> None:
        await started.wait()
        done.append("cancelled the run")

    async def never_ends() -> None:
        await asyncio.Event().wait()

    background = Background()
    background.run(cancel_once_started(), "the cancel of run run-a")
    stuck = background.run(never_ends(), "the cancel of run run-b")
    asyncio.get_running_loop().call_later(0.05, started.set)
    with caplog.at_level(logging.WARNING, logger="gateway.mcp_tasks"):
        await background.settle(0.5)
    assert done == ["cancelled the run"]
    assert "stopped with unfinished: the cancel of run run-b" in caplog.text
    assert "run-a" not in caplog.text
    with contextlib.suppress(asyncio.CancelledError):
        await stuck
    assert stuck.cancelled()
