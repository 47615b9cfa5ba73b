"""A concurrent tool round (`parallel_tool_calls`) one of whose calls fails the run (its
server unreachable for `contract.TOOL_UNREACHED_S`), on a real dev server: the round's
other calls are cancelled as the run fails (ROUND_PATCH).  Before, they ran on as
orphaned tasks of the workflow while it closed: a call in flight was left open in the
history, and one waiting to be sent again had its timer fire during the close, which
Temporal then refused, so that the close was done twice.

The first test sends the calls through the worker's real pool: the fake MCP server holds
one call, and nothing listens where the other's server should be.  The second stands in
for the activities, to break a call and keep the gateway down at the run's end on cue."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowFailureError
from temporalio.exceptions import ApplicationError

from activities import ToolActivities
from activities.contract import (
    NOT_SENT,
    EndRunInput,
    ToolCall,
    ToolInfo,
    ToolInput,
    ToolOutput,
    ToolsWanted,
    TurnInput,
    TurnOutput,
)
from activities.mcp_pool import McpPool
from luftpause.config import McpServer
from luftpause.temporal_dev import free_port
from testkit.fake_mcp import FakeMcpSettings, FakeMcpState
from testkit.fake_mcp import create_app as create_mcp
from testkit.loopback import serve
from tests.workflows.harness import TIME_SCALE, connect, replays_with, stand_in_worker, until
from workflows import Runs, RunSpec, RunStatus, contract
from workflows.agent_run import END_RETRY, ROUND_PATCH

# The unreachable window the runs here are given (the recorded `failed_round` histories
# too: test_replay replays them with it).
UNREACHED_S = 2.0
SCHEDULED = "activity_task_scheduled_event_attributes"


def _turn(calls: list[ToolCall]) -> TurnOutput:
    """A turn that asks for `calls`, all at once."""
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ],
    }
    return TurnOutput(message, calls, "tool_calls", 10, 10)


class RealCalls:
    """The worker's real `call_tool` and listing over a pool of two servers: `fake` (the
    fake MCP server) and `down` (a loopback port nothing listens on; its `write` tool as
    it was listed before it went down).  The model asks for a lookup and a write at once."""

    def __init__(self, pool: McpPool) -> None:
        self._tools = ToolActivities(pool, heartbeat_every_s=0.5)
        self.call_tool = self._tools.call_tool

    @activity.defn(name="list_tools")
    async def list_tools(self, wanted: ToolsWanted | None = None) -> list[ToolInfo]:
        listed = await self._tools.list_tools(ToolsWanted(["lookup"]))
        return [*listed, ToolInfo("down", "write", "Write a record.", {"type": "object"})]

    @activity.defn(name="end_run")
    async def end_run(self, end: EndRunInput) -> None:
        pass

    @activity.defn(name="llm_turn")
    async def llm_turn(self, turn: TurnInput) -> TurnOutput:
        return _turn(
            [ToolCall("c1", "lookup", '{"query": "tides"}'), ToolCall("c2", "write", "{}")]
        )


async def round_failing_with_a_call_in_flight(
    client: Client, mcp_url: str, mcp: FakeMcpState
) -> tuple[str, RunStatus]:
    """A run whose round of two calls fails on one (its server unreachable) while the
    fake MCP server at `mcp_url` holds the other: the run's handle and status, once the
    held call has left the server.  `contract.TOOL_UNREACHED_S` must be UNREACHED_S."""
    assert contract.TOOL_UNREACHED_S == UNREACHED_S
    pool = McpPool(
        [
            McpServer(name="fake", url=mcp_url),
            McpServer(name="down", url=f"http://127.0.0.1:{free_port()}/mcp"),
        ]
    )
    queue = f"round-{uuid.uuid4().hex[:8]}"
    runs = Runs(client, task_queue=queue)
    mcp.gate.clear()  # the lookup is held in flight at the server
    try:
        async with stand_in_worker(client, queue, RealCalls(pool)):
            await until(runs._worker_polls, "the worker polls")
            spec = RunSpec(task="t", model="m", tools=["lookup", "write"], parallel_tool_calls=True)
            handle = await runs.spawn(spec)
            with pytest.raises(WorkflowFailureError):
                await asyncio.wait_for(client.get_workflow_handle(handle).result(), 60)
            # The worker hears of the cancel (or of the run's end) at the call's next
            # heartbeat to the server, 0.8 x HEARTBEAT_TIMEOUT at most after the last;
            # the pool's cancel then reaches the MCP server.
            await until(lambda: not mcp.inflight, "the held call cut at the server")
            status = await runs.status(handle)
    finally:
        mcp.gate.set()
        await pool.aclose()
    return handle, status


async def test_a_call_that_fails_the_run_cancels_the_others_of_its_round(
    temporal_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(contract, "TOOL_UNREACHED_S", UNREACHED_S)
    client = await connect(temporal_address)
    mcp = FakeMcpState()
    async with serve(create_mcp(FakeMcpSettings(time_scale=TIME_SCALE), mcp)) as url:
        handle, status = await round_failing_with_a_call_in_flight(client, f"{url}/mcp", mcp)
    assert status.state == "Failed", status
    assert status.error is not None and "'down', tool 'write': not reached" in status.error
    events = list((await client.get_workflow_handle(handle).fetch_history()).events)
    (lookup,) = [e.event_id for e in events if b'"lookup"' in _input(e)]
    cancels = [
        e
        for e in events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_CANCEL_REQUESTED
        and e.activity_task_cancel_requested_event_attributes.scheduled_event_id == lookup
    ]
    # The run gave the lookup up as it failed: before, it left it open (the worker heard
    # of the run's end at the call's next heartbeat, and cancelled it then).
    assert len(cancels) == 1, [EventType.Name(e.event_type) for e in events[-12:]]
    assert events[-1].event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_FAILED
    # The cut reached the tool's server (the MCP SDK aborts the call's request): the
    # lookup was cut there, never completed.
    assert mcp.received == {mcp.key("lookup", {"query": "tides"}): 1} and not mcp.counts
    await replays_with(client, handle, ROUND_PATCH)


def _input(event: Any) -> bytes:
    """A call_tool activity's input, as its scheduled event carries it (b"" otherwise)."""
    if not event.HasField(SCHEDULED):
        return b""
    scheduled = getattr(event, SCHEDULED)
    if scheduled.activity_type.name != "call_tool":
        return b""
    return b"".join(p.data for p in scheduled.input.payloads)


class BrokenRound:
    """Stand-ins: `write`'s server is never reached (NOT_SENT); `lookup` (read-only)
    breaks off twice (the second time at once, the first once `write` has been sent
    twice), so that it waits to be sent again when `write` fails the run; and the
    gateway is down as the run ends (each end report fails)."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.ends = 0
        self.write_again = asyncio.Event()

    @activity.defn(name="list_tools")
    async def list_tools(self, wanted: ToolsWanted | None = None) -> list[ToolInfo]:
        return [
            ToolInfo("a", "lookup", "Look up.", {"type": "object"}, read_only=True),
            ToolInfo("b", "write", "Write.", {"type": "object"}),
        ]

    @activity.defn(name="end_run")
    async def end_run(self, end: EndRunInput) -> None:
        self.ends += 1
        raise ApplicationError("connection refused", type="ConnectError")

    @activity.defn(name="call_tool")
    async def call_tool(self, call: ToolInput) -> ToolOutput:
        self.sent.append(call.tool)
        if call.tool == "write":
            if self.sent.count("write") == 2:
                self.write_again.set()
            raise ApplicationError("connection refused", type=NOT_SENT)
        if self.sent.count("lookup") == 1:
            await self.write_again.wait()
        raise ApplicationError("the connection broke mid-call", type="McpUnavailable")

    @activity.defn(name="llm_turn")
    async def llm_turn(self, turn: TurnInput) -> TurnOutput:
        return _turn([ToolCall("c1", "lookup", "{}"), ToolCall("c2", "write", "{}")])


async def test_a_call_waiting_to_be_sent_again_is_not_sent_as_the_run_fails(
    temporal_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `write` is sent at 0, 1 and 3 s and fails the run at the third (the next wait would
    # pass its 4 s); `lookup` broke at 1 and 2 s and waits 2 s to be sent again, so it
    # is due while the run closes (some 3 s: its end report's three attempts).  Before,
    # its timer fired then: Temporal refused the close (an event came meanwhile), the
    # close was done again (the end reported twice, six attempts), and the lookup's
    # next send was scheduled in the run's last workflow task.
    monkeypatch.setattr(contract, "TOOL_UNREACHED_S", 4.0)
    client = await connect(temporal_address)
    queue = f"round-{uuid.uuid4().hex[:8]}"
    fakes = BrokenRound()
    runs = Runs(client, task_queue=queue)
    async with stand_in_worker(client, queue, fakes):
        await until(runs._worker_polls, "the worker polls")
        spec = RunSpec(task="t", model="m", tools=["lookup", "write"], parallel_tool_calls=True)
        handle = await runs.spawn(spec)
        with pytest.raises(WorkflowFailureError):
            await asyncio.wait_for(client.get_workflow_handle(handle).result(), 60)
        status = await runs.status(handle)
    assert status.state == "Failed" and status.error is not None, status
    assert status.error.endswith("connection refused"), status.error
    events = list((await client.get_workflow_handle(handle).fetch_history()).events)
    kinds = [e.event_type for e in events]
    assert EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED not in kinds, (fakes.ends, fakes.sent)
    assert fakes.ends == END_RETRY.maximum_attempts  # one end report, its attempts
    # Sent: `write` three times, `lookup` twice; its third send never scheduled.
    assert sum(1 for e in events if _input(e)) == 5, fakes.sent
    assert kinds.count(EventType.EVENT_TYPE_TIMER_CANCELED) == 1  # the lookup's wait
