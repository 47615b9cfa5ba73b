"""A tool call with no answer in its server's time (`tool_timeout_s`), or one that breaks
off, on a real dev server: the model is told, and the run goes on (TOLD_PATCH).  The
activities are stand-ins registered under the real names, as in test_closing: the
tests must hang a call past its timeout, or break it, on cue."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import ApplicationError

import workflows.contract as contract
from activities.contract import (
    NOT_SENT,
    TOOL_TIMED_OUT,
    EndRunInput,
    ToolCall,
    ToolInfo,
    ToolInput,
    ToolOutput,
    ToolsWanted,
    TurnInput,
    TurnOutput,
)
from tests.workflows.harness import (
    MODEL,
    connect,
    replays_with,
    stack,
    stand_in_worker,
    task_with,
    until,
)
from workflows import Runs, RunSpec, RunStatus
from workflows.agent_run import TOLD_PATCH, TOOL_SENDS

TIMEOUT_S = 0.5
SCHEMA = {"type": "object"}


class StandIns:
    """Tools of one server, each allowed TIMEOUT_S a call.  `hang` (read-only) and
    `write` (not repeatable) never answer: cut at their time, as the worker's pool cuts
    a call (TOOL_TIMED_OUT); `stall` (read-only) never answers and is not cut (a worker
    stuck past its pool's bound): the activity's own timeout ends it.  `breaks`
    (read-only) breaks off every time, `flaky` the first time only; `late` (read-only)
    breaks off after 4 s, then finds its server unreachable, then answers.  A
    "call <tool>" task's first turn calls that tool; the next answers "done"."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.timeouts: list[float] = []  # the tool's time each call was given
        self.cancelled: list[str] = []

    @activity.defn(name="list_tools")
    async def list_tools(self, wanted: ToolsWanted | None = None) -> list[ToolInfo]:
        def tool(name: str, *, read_only: bool = True) -> ToolInfo:
            return ToolInfo("fake", name, name, SCHEMA, read_only=read_only, timeout_s=TIMEOUT_S)

        names = ("hang", "stall", "breaks", "flaky", "late")
        return [*(tool(n) for n in names), tool("write", read_only=False)]

    @activity.defn(name="end_run")
    async def end_run(self, end: EndRunInput) -> None:
        pass

    @activity.defn(name="call_tool")
    async def call_tool(self, call: ToolInput) -> ToolOutput:
        self.sent.append(call.tool)
        self.timeouts.append(call.timeout_s)
        sends = self.sent.count(call.tool)
        if call.tool == "breaks" or (call.tool == "flaky" and sends == 1):
            raise ApplicationError("the connection broke mid-call", type="McpUnavailable")
        if call.tool == "late" and sends == 1:
            await asyncio.sleep(4.0)
            raise ApplicationError("the connection broke mid-call", type="McpUnavailable")
        if call.tool == "late" and sends == 2:
            raise ApplicationError("connection refused", type=NOT_SENT)
        if call.tool in ("flaky", "late"):
            return ToolOutput(f"{call.tool}'s answer", False, True, seconds=0.25)
        try:
            if call.tool == "stall":
                await asyncio.Event().wait()  # until the activity's timeout cancels it
            await asyncio.sleep(call.timeout_s)
        except asyncio.CancelledError:
            self.cancelled.append(call.tool)
            raise
        raise ApplicationError(f"no answer within {call.timeout_s:g} s", type=TOOL_TIMED_OUT)

    @activity.defn(name="llm_turn")
    async def llm_turn(self, turn: TurnInput) -> TurnOutput:
        if not any(m["role"] == "tool" for m in turn.messages):
            task = next(m["content"] for m in turn.messages if m["role"] == "user")
            name = task.removeprefix("call ")
            fn = {"name": name, "arguments": "{}"}
            message = {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": fn}],
            }
            return TurnOutput(message, [ToolCall("c1", name, "{}")], "tool_calls", 10, 10)
        return TurnOutput({"role": "assistant", "content": "done"}, [], "stop", 10, 10)


async def run_calling(
    client: Client, tool: str
) -> tuple[str, StandIns, RunStatus, list[dict[str, Any]]]:
    """A run whose one call is of `tool`: its handle once it has ended, the stand-ins,
    its status and its transcript."""
    queue = f"told-{uuid.uuid4().hex[:8]}"
    fakes = StandIns()
    runs = Runs(client, task_queue=queue)
    async with stand_in_worker(client, queue, fakes):
        await until(runs._worker_polls, "the worker polls")
        handle = await runs.spawn(RunSpec(task=f"call {tool}", model="m", tools=[tool]))
        await asyncio.wait_for(client.get_workflow_handle(handle).result(), 60)
        if tool == "stall":
            await until(lambda: tool in fakes.cancelled, "the call cut at its timeout")
        return handle, fakes, await runs.status(handle), await runs.transcript(handle)


def _reply(transcript: list[dict[str, Any]]) -> str:
    (reply,) = [m for m in transcript if m["role"] == "tool"]
    return str(reply["content"])


async def test_a_repeatable_call_with_no_answer_in_its_time_is_told_and_not_sent_again(
    temporal_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, Temporal retried it for 15 minutes, each attempt cut at a fixed 5, and
    # then failed the run.  Now it is cut at its server's tool_timeout_s and the model
    # reads why; a call slower than its time would be as slow again, so it goes once.
    client = await connect(temporal_address)
    handle, fakes, status, transcript = await run_calling(client, "hang")
    assert status.state == "Completed" and status.answer == "done", status
    assert fakes.sent == ["hang"] and fakes.timeouts == [TIMEOUT_S]
    assert _reply(transcript) == (
        "Error: tool 'hang' gave no answer within 0.5 s, the time its server allows a "
        "call; the call was cut (it may have run part of its work) and not sent again. "
        "Call it with a smaller request, or go on without it."
    )
    assert status.usage.failed_tool_calls == 1
    assert TIMEOUT_S <= status.usage.tool_seconds < TIMEOUT_S + 5
    await replays_with(client, handle, TOLD_PATCH)
    # A worker that does not cut it (stuck): the activity's timeout, which leaves room
    # to open the server's connection first, does, and the model reads the same.
    monkeypatch.setattr(contract, "TOOL_OPENING_S", 0.5)
    _, fakes, status, transcript = await run_calling(client, "stall")
    assert fakes.sent == ["stall"] and fakes.cancelled == ["stall"]
    assert _reply(transcript).startswith("Error: tool 'stall' gave no answer within 0.5 s")


async def test_a_repeatable_call_that_breaks_off_is_sent_again_then_told(
    temporal_address: str,
) -> None:
    client = await connect(temporal_address)
    _, fakes, status, transcript = await run_calling(client, "breaks")
    assert status.state == "Completed", status
    assert fakes.sent == ["breaks"] * TOOL_SENDS
    assert _reply(transcript) == (
        "Error: no answer came back from tool 'breaks': McpUnavailable: the connection "
        "broke mid-call (3 sends). It may have run. Try again later, or go on without it."
    )
    # One break is mended by the next send: the model reads the answer.
    _, fakes, status, transcript = await run_calling(client, "flaky")
    assert fakes.sent == ["flaky", "flaky"]
    assert _reply(transcript) == "flaky's answer" and status.usage.failed_tool_calls == 0


async def test_a_call_that_broke_off_late_gets_the_whole_window_to_reach_its_server_again(
    temporal_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The unreachable window counted from the first send: a call that ran past it and
    # broke as its server restarted failed the run at the first refusal (helper-119).
    # Less than the first send: counted from it, the window was over at the refusal.
    monkeypatch.setattr(contract, "TOOL_UNREACHED_S", 3.0)
    client = await connect(temporal_address)
    _, fakes, status, transcript = await run_calling(client, "late")
    assert status.state == "Completed", status
    assert fakes.sent == ["late"] * 3 and _reply(transcript) == "late's answer"
    # The run's tool time is its sends' (4 s, then the answer's 0.25), not the waits.
    assert 4.25 <= status.usage.tool_seconds < 6, status.usage


async def test_a_call_of_a_tool_not_repeatable_cut_at_its_time_has_an_unknown_outcome(
    temporal_address: str,
) -> None:
    client = await connect(temporal_address)
    _, fakes, status, transcript = await run_calling(client, "write")
    assert status.state == "Completed", status
    assert fakes.sent == ["write"]
    reply = _reply(transcript)
    assert reply.startswith(
        "Error: the outcome of this call is unknown: no answer came back "
        "(none within 0.5 s, the time its server allows a call)"
    ), reply


async def test_a_servers_tool_timeout_reaches_the_runs_of_the_real_stack(
    temporal_address: str,
) -> None:
    # `[[mcp_servers]] tool_timeout_s` → the worker's listing → the run's call, cut at it
    # on a real MCP server that holds the call: the run goes on and its model reads why.
    async with stack(temporal_address, tool_timeout_s=1.0) as s:
        s.mcp.gate.clear()  # every call waits at the gate: none answers in time
        h = await s.runs.spawn(RunSpec(task=task_with(1), model=MODEL, tools=["lookup"]))
        (status,) = await s.runs.wait([h], timeout=60)
        assert status.state == "Completed", status
        reply = _reply(await s.runs.transcript(h))
        assert reply.startswith("Error: tool 'lookup' gave no answer within 1 s"), reply
        assert [(t, n) for (t, _), n in s.mcp.received.items()] == [("lookup", 1)]
        assert not s.mcp.counts  # it never finished
        # The cut reached the server: the call is not still running there.
        await until(lambda: not s.mcp.inflight, "the cut call gone from the server")
        s.mcp.gate.set()
