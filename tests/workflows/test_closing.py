"""A run's close (`_halt`) against a cancel that arrives in the middle of it, and a stop
against a call that was never sent, on a real dev server.  The run's activities are
stand-ins here (registered under the real names): these are about what the workflow
does, and the tests must fail a turn, keep children in theirs, or keep a tool's server
out of reach, on cue."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import uuid
from typing import Any, cast

import httpx
import pytest
from fastapi.responses import Response
from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
)
from temporalio.exceptions import ApplicationError

from activities import LlmActivities
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
from testkit.loopback import serve
from tests.gateway.harness import upstream
from tests.workflows.harness import connect, replays_with, stand_in_worker, until
from workflows import Budget, Runs, RunSpec, RunStatus, contract
from workflows.agent_run import HALT_UNBROKEN_PATCH, TOLD_PATCH

CHILDREN = 12  # the close signals and cancels each: a wide window for the cancel
ATTEMPTS = 3  # scenarios tried until the cancel lands mid-close (bounded)
STOP = "signal_external_workflow_execution_initiated_event_attributes"
CANCEL = "request_cancel_external_workflow_execution_initiated_event_attributes"


class StandIns:
    """The activities: a turn of a "fail" task fails (non-retryable, as a gateway's 400)
    once `fail` is set; a "block" task's turn runs until cancelled."""

    def __init__(self) -> None:
        self.fail = asyncio.Event()
        self.ended: list[str] = []
        self.in_turn: set[str] = set()
        self.turn_bytes: list[int] = []  # what each "big" turn carried

    @activity.defn(name="list_tools")
    async def list_tools(self, wanted: ToolsWanted | None = None) -> list[ToolInfo]:
        return [ToolInfo("fake", "lookup", "look up", {"type": "object"}, read_only=True)]

    @activity.defn(name="end_run")
    async def end_run(self, end: EndRunInput) -> None:
        self.ended.append(end.run_id)

    @activity.defn(name="call_tool")
    async def call_tool(self, call: ToolInput) -> ToolOutput:
        return ToolOutput("ok", False, True)

    @activity.defn(name="llm_turn")
    async def llm_turn(self, turn: TurnInput) -> TurnOutput:
        task = next(m["content"] for m in turn.messages if m["role"] == "user")
        if task.startswith(("big", "grow")):  # a call with 700 kB (5 kB) of arguments
            size = 700_000 if task.startswith("big") else 5_000
            call = ToolCall(f"call-{len(turn.messages)}", "lookup", "x" * size)
            function = {"name": call.name, "arguments": call.arguments}
            message = {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": call.id, "type": "function", "function": function}],
            }
            self.turn_bytes.append(len(json.dumps(turn.messages)))
            return TurnOutput(message, [call], "tool_calls")
        self.in_turn.add(turn.run_id)
        try:
            if task.startswith("fail"):
                await self.fail.wait()
                raise ApplicationError("engine refused", type="Http400", non_retryable=True)
            while True:  # "block": until the close cancels it
                activity.heartbeat()
                await asyncio.sleep(0.2)
        finally:
            self.in_turn.discard(turn.run_id)


async def _events(handle: WorkflowHandle[Any, Any]) -> list[Any]:
    return list((await handle.fetch_history()).events)


async def _closed(handle: WorkflowHandle[Any, Any]) -> bool:
    return (await handle.describe()).status != WorkflowExecutionStatus.RUNNING


async def failing_run_cancelled_while_closing(client: Client) -> tuple[str, StandIns, int]:
    """A run with CHILDREN children fails; it is cancelled as soon as its close has
    stopped its first child.  Its handle, the stand-ins, and how many children the
    close had stopped when the cancel reached the server."""
    queue = f"closing-{uuid.uuid4().hex[:8]}"
    fakes = StandIns()
    runs = Runs(client, task_queue=queue)
    async with stand_in_worker(client, queue, fakes):
        await until(runs._worker_polls, "the worker polls")
        parent = await runs.spawn(RunSpec(task="fail parent", model="m"))
        kids = [
            await runs.spawn(RunSpec(task=f"block kid {i}", model="m", parent=parent))
            for i in range(CHILDREN)
        ]
        await until(lambda: set(kids) <= fakes.in_turn, "the children in their turns")
        handle = client.get_workflow_handle(parent)

        async def cancel_at_the_first_stop() -> None:
            while True:  # bounded by the wait_for below
                if any(e.HasField(STOP) for e in await _events(handle)):
                    await handle.cancel()
                    return
                await asyncio.sleep(0.002)

        canceller = asyncio.create_task(cancel_at_the_first_stop())
        fakes.fail.set()
        await asyncio.wait_for(canceller, 30)
        await until(lambda: _closed(handle), "the parent closed", polls=600)
        events = await _events(handle)
        requested = next(
            i
            for i, e in enumerate(events)
            if e.HasField("workflow_execution_cancel_requested_event_attributes")
        )
        before = sum(1 for e in events[:requested] if e.HasField(CANCEL))
        return parent, fakes, before


async def test_a_cancel_during_a_failing_runs_close_stops_every_child(
    temporal_address: str,
) -> None:
    # A failing run's close signals and cancels each child, one after another; its first
    # cancel can land in the middle.  It stopped the rest of the close: the children
    # left were cancelled by the parent-close policy with no reason, and no end was
    # reported (the run's state stayed "Running" in the search attributes).
    client = await connect(temporal_address)
    for _ in range(ATTEMPTS):
        parent, fakes, before = await failing_run_cancelled_while_closing(client)
        if before < CHILDREN:
            break  # the cancel came mid-close: the case
    assert before < CHILDREN, "the cancel never landed while the close was stopping children"
    handle = client.get_workflow_handle(parent)
    events = await _events(handle)
    assert sum(1 for e in events if e.HasField(STOP)) == CHILDREN
    assert sum(1 for e in events if e.HasField(CANCEL)) == CHILDREN
    assert (await handle.describe()).status == WorkflowExecutionStatus.FAILED
    assert parent in fakes.ended
    # (Read through the runs of the run's own queue: another queue's see no such run.)
    queue = (await handle.describe()).task_queue
    status = await Runs(client, task_queue=queue).status(parent)
    assert status.state == "Failed" and status.error == "Http400: engine refused", status
    # The new close replays, marker and all.
    await replays_with(client, parent, HALT_UNBROKEN_PATCH)


class Unreachable(StandIns):
    """A tool that is not repeatable ("write") whose server cannot be reached: every
    call of it fails NOT_SENT.  A "calls" task's first turn calls it."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[str] = []

    @activity.defn(name="list_tools")
    async def list_tools(self, wanted: ToolsWanted | None = None) -> list[ToolInfo]:
        return [ToolInfo("fake", "write", "write a record", {"type": "object"})]

    @activity.defn(name="call_tool")
    async def call_tool(self, call: ToolInput) -> ToolOutput:
        self.sent.append(call.call_id)
        raise ApplicationError("the server is not reachable", type=NOT_SENT)

    @activity.defn(name="llm_turn")
    async def llm_turn(self, turn: TurnInput) -> TurnOutput:
        if not any(m["role"] == "tool" for m in turn.messages):
            fn = {"name": "write", "arguments": "{}"}
            message = {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": fn}],
            }
            return TurnOutput(message, [ToolCall("c1", "write", "{}")], "tool_calls", 10, 10)
        return TurnOutput({"role": "assistant", "content": "done"}, [], "stop", 10, 10)


async def unsent_call_stopped(
    client: Client,
) -> tuple[str, Unreachable, RunStatus, list[dict[str, Any]]]:
    """A run whose only call cannot be sent, stopped by its seconds budget: its handle
    once it has ended, the stand-ins, its status and its transcript."""
    queue = f"unsent-{uuid.uuid4().hex[:8]}"
    fakes = Unreachable()
    runs = Runs(client, task_queue=queue)
    async with stand_in_worker(client, queue, fakes):
        await until(runs._worker_polls, "the worker polls")
        handle = await runs.spawn(
            RunSpec(task="calls write", model="m", tools=["write"], budget=Budget(seconds=1.5))
        )
        # Sent again while unreachable (rule 5) until the stop: then not again.  (It
        # went on being sent, up to 15 minutes, and ran if the server came back.)
        with contextlib.suppress(WorkflowFailureError):
            await asyncio.wait_for(client.get_workflow_handle(handle).result(), 30)
        return handle, fakes, await runs.status(handle), await runs.transcript(handle)


async def test_a_call_never_sent_is_not_sent_after_a_stop(temporal_address: str) -> None:
    client = await connect(temporal_address)
    handle, fakes, status, transcript = await unsent_call_stopped(client)
    assert status.state == "Cancelled" and status.error is not None
    assert status.error.startswith("budget exceeded: seconds"), status
    assert fakes.sent and len(fakes.sent) <= 2  # the sends before the stop (1 s apart)
    (reply,) = [m for m in transcript if m["role"] == "tool"]
    assert reply["content"].startswith("Error: not sent: this run is stopping (budget exceeded")
    # Runs since TOLD_PATCH send their calls themselves with the stop rule built in; the
    # `unsent_stopped` history (test_replay) keeps UNSENT_STOP_PATCH's path replayed.
    await replays_with(client, handle, TOLD_PATCH)


class SlowEnd(StandIns):
    """A run that answers at once, and whose end report (the end_run local activity:
    the gateway slow to answer, or restarting) waits for `release`."""

    def __init__(self) -> None:
        super().__init__()
        self.ending = asyncio.Event()
        self.release = asyncio.Event()

    @activity.defn(name="end_run")
    async def end_run(self, end: EndRunInput) -> None:
        self.ending.set()
        await self.release.wait()
        self.ended.append(end.run_id)

    @activity.defn(name="llm_turn")
    async def llm_turn(self, turn: TurnInput) -> TurnOutput:
        return TurnOutput({"role": "assistant", "content": "done"}, [], "stop", 10, 10)


async def test_a_run_reads_as_ended_only_once_its_workflow_closed(temporal_address: str) -> None:
    """A run is Completed in its own state before it reports its end; a query answered
    meanwhile (at the workflow task's heartbeat) said Completed while the workflow
    ran on, and the next, answered by no worker in time, Running: an MCP task went
    completed -> working -> completed (helper-144).  Until it closes it is Stopping."""
    client = await connect(temporal_address)
    queue = f"slow-end-{uuid.uuid4().hex[:8]}"
    fakes = SlowEnd()
    runs = Runs(client, task_queue=queue)
    async with stand_in_worker(client, queue, fakes):
        await until(runs._worker_polls, "the worker polls")
        handle = await runs.spawn(RunSpec(task="answer", model="m"))
        await asyncio.wait_for(fakes.ending.wait(), 30)
        # Long enough for the query to be answered at the heartbeat of the workflow
        # task the local activity holds open (every 8 s).
        status = await runs.status(handle, query_timeout=15)
        described = await client.get_workflow_handle(handle).describe()
        assert described.status == WorkflowExecutionStatus.RUNNING
        assert status.state == "Stopping" and not status.error, status
        assert status.answer == "done"

        # Listed as status reads it (its own state, the search attribute, is
        # Completed already), and counted so.
        async def listed(state: str) -> bool:
            return handle in await runs.list(state=state)

        await until(lambda: listed("Stopping"), "listed as Stopping while it ends")
        assert not await listed("Completed") and not await listed("Running")
        assert (await runs.count_open())["Stopping"] == 1
        fakes.release.set()
        await asyncio.wait_for(client.get_workflow_handle(handle).result(), 30)
        assert (await runs.status(handle)).state == "Completed"
        await until(lambda: listed("Completed"), "listed as Completed once closed")
        assert not await listed("Stopping")
        assert (await runs.count_open())["Stopping"] == 0
        assert fakes.ended == [handle]


class Wedged(StandIns):
    """A "wedge" task's turn answers what its run cannot take (its tokens as text): the
    run's workflow task fails, again and again, and it takes nothing more, a cancel
    neither (as under a worker that fails to run it)."""

    @activity.defn(name="llm_turn")
    async def llm_turn(self, turn: TurnInput) -> TurnOutput:
        task = next(m["content"] for m in turn.messages if m["role"] == "user")
        if task.startswith("wedge"):
            message = {"role": "assistant", "content": "done"}
            return TurnOutput(message, [], "stop", cast(int, "many"))
        return await super().llm_turn(turn)


async def test_a_cancelled_run_reads_stopping_while_its_close_waits_for_its_children(
    temporal_address: str,
) -> None:
    """A close stops the children and waits for their ends (up to 10 s); with hundreds
    of them that takes tens of seconds, and the run read as before meanwhile: the MCP
    `cancel` tool answered a root with 250 waiting children as AwaitingApproval, with
    no approval left to give (helper-254, bench.wide_tree --cancel).  Here one child
    that takes nothing holds the close for its 10 s."""
    client = await connect(temporal_address)
    queue = f"wedged-{uuid.uuid4().hex[:8]}"
    fakes = Wedged()
    runs = Runs(client, task_queue=queue)
    async with stand_in_worker(client, queue, fakes):
        await until(runs._worker_polls, "the worker polls")
        parent = await runs.spawn(RunSpec(task="block parent", model="m"))
        kid = await runs.spawn(RunSpec(task="wedge kid", model="m", parent=parent))
        await until(lambda: parent in fakes.in_turn, "the parent in its turn")
        failed = EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED
        kid_handle = client.get_workflow_handle(kid)
        await until(lambda: _has(kid_handle, lambda e: e.event_type == failed), "the child wedged")
        handle = client.get_workflow_handle(parent)
        await runs.request_cancel(parent)
        await until(lambda: _has(handle, lambda e: e.HasField(CANCEL)), "the child cancelled")
        status = await runs.status(parent)
        assert not await _closed(handle)  # its close waits for the child's end
        assert status.state == "Stopping", status
        assert status.pending_approval is None
        (ended,) = await runs.wait([parent], timeout=30)
        assert ended.state == "Cancelled", ended
        await kid_handle.terminate("the test is over")


async def _has(handle: WorkflowHandle[Any, Any], pred: Any) -> bool:
    return any(pred(e) for e in await _events(handle))


async def _run_to_its_end(address: str, fakes: StandIns, spec: RunSpec) -> RunStatus:
    """The run `spec` asks for, on a worker of `fakes`, once it has ended."""
    client = await connect(address)
    queue = f"stand-in-{uuid.uuid4().hex[:8]}"
    runs = Runs(client, task_queue=queue)
    async with stand_in_worker(client, queue, fakes):
        await until(runs._worker_polls, "the worker polls")
        (status,) = await runs.wait([await runs.spawn(spec)], timeout=60)
    return status


async def test_children_with_large_tasks_spawned_at_once_leave_their_parent_running(
    temporal_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spawns that reach a parent together are taken in one workflow task, whose
    completion carries each child's spec twice: six of 450 kB passed gRPC's 4 MiB, and
    Temporal terminated the parent and cancelled its tree (helper-163).  The parent
    takes at most contract.CHILDREN_STARTING_BYTES starting at once; Runs.spawn sends
    the others again once those have started.  (Its worker is down while the six
    reach the server: they come to it in one task.)"""
    client = await connect(temporal_address)
    queue = f"stand-in-{uuid.uuid4().hex[:8]}"
    runs = Runs(client, task_queue=queue)
    fakes = StandIns()
    async with stand_in_worker(client, queue, fakes):
        await until(runs._worker_polls, "the worker polls")
        parent = await runs.spawn(RunSpec(task="block parent", model="m"))
        await until(lambda: parent in fakes.in_turn, "the parent in its turn")
    service = client.workflow_service
    asked = service.update_workflow_execution
    sent: list[object] = []

    async def counted(*args: Any, **kwargs: Any) -> Any:
        sent.append(args[0])
        return await asked(*args, **kwargs)

    monkeypatch.setattr(service, "update_workflow_execution", counted)
    pad = "d" * 450_000
    spawns = asyncio.gather(
        *(runs.spawn(RunSpec(task=f"block kid {i} {pad}", model="m", parent=parent))
          for i in range(6))
    )  # fmt: skip
    await until(lambda: len(sent) >= 6, "the six spawns sent")
    async with stand_in_worker(client, queue, fakes):
        kids = await spawns
        status = await runs.status(parent)
        assert status.state == "Running", status.error
        assert sorted(c.handle for c in status.children) == sorted(kids)
        assert len(sent) > 6  # some were refused while others started, and sent again
        kinds = [e.event_type for e in await _events(client.get_workflow_handle(parent))]
        assert EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED not in kinds
        ended = await runs.cancel(parent)
    assert ended.state == "Cancelled", ended


class LongAnswer(StandIns):
    @activity.defn(name="llm_turn")
    async def llm_turn(self, turn: TurnInput) -> TurnOutput:
        return TurnOutput({"role": "assistant", "content": "a" * 1_850_000}, [], "stop")


async def test_a_final_status_past_temporals_limit_keeps_the_answer(
    temporal_address: str,
) -> None:
    """A 300 kB task and a 1.85 MB answer, each within its own bound, made a result past
    Temporal's 2 MB: the run's close failed for ever, Running, its answer lost
    (helper-163).  The task is cut from the final status, the answer kept whole."""
    spec = RunSpec(task="t" * 300_000, model="m")
    status = await asyncio.wait_for(_run_to_its_end(temporal_address, LongAnswer(), spec), 60)
    assert (status.state, status.error) == ("Completed", None), status.error
    assert status.answer == "a" * 1_850_000
    assert status.task.startswith("t" * 1000) and len(status.task) < 300_000
    assert status.task.endswith(
        "[luftpause: the task, 300,000 characters, is cut here: the run's final status is "
        "limited to what Temporal carries]"
    )


class LongRefusal(StandIns):
    @activity.defn(name="llm_turn")
    async def llm_turn(self, turn: TurnInput) -> TurnOutput:
        message = "gateway answered 400: validation error: input=" + "q" * 1_100_000
        raise ApplicationError(message, type="Http400", non_retryable=True)


async def test_a_run_failed_with_a_long_message_closes_with_it_cut(
    temporal_address: str,
) -> None:
    """The failure carries its message twice (its own, and its status's error): an
    engine's 400 quoting the request took it past Temporal's 2 MB, and the run's close
    failed for ever, Running (helper-168).  The run's error is cut, saying so."""
    spec = RunSpec(task="a task", model="m")
    status = await asyncio.wait_for(_run_to_its_end(temporal_address, LongRefusal(), spec), 60)
    assert status.state == "Failed", status
    error = status.error or ""
    assert error.startswith("Http400: gateway answered 400: validation error: input=qqq")
    assert error.endswith(" [luftpause: cut here, of 1,100,055 characters]"), error[-80:]
    assert len(error) < 10_100


class EngineTurn(StandIns):
    """The real llm_turn activity, against an engine at `base`."""

    def __init__(self, base: str, http: httpx.AsyncClient) -> None:
        super().__init__()
        self.real = LlmActivities(http, base_url=base, heartbeat_every_s=0.05)

    @activity.defn(name="llm_turn")
    async def llm_turn(self, turn: TurnInput) -> TurnOutput:
        return await self.real.llm_turn(turn)


async def test_a_runs_error_says_how_long_the_engines_message_was(
    temporal_address: str,
) -> None:
    """An engine's 400 quoting 1 MB: cut once, by the activity, and the run says of how
    much (cut again by the run, after "Http400: " made it longer, it said "of 8,078
    characters"; helper-170)."""
    body = {"error": {"message": "input=" + "q" * 1_000_000}}
    app = upstream(lambda r: Response(json.dumps(body), 400))
    spec = RunSpec(task="a task", model="m")
    async with serve(app) as url, httpx.AsyncClient() as http:
        status = await _run_to_its_end(temporal_address, EngineTurn(url, http), spec)
    assert status.state == "Failed", status
    error = status.error or ""
    assert error.startswith("Http400: gateway answered 400: input=qqq"), error[:80]
    assert error.endswith(" [luftpause: cut here, of 1,000,006 characters]"), error[-120:]


async def test_a_conversation_too_large_for_temporal_fails_the_run(temporal_address: str) -> None:
    """Tool answers are cut to keep a run's conversation under 1.5 MB, but the model's
    own messages are not: turn after turn of large tool-call arguments took the next
    turn's input past Temporal's 2 MiB limit, its workflow task failed on every retry,
    and the run read Running, "status unavailable", for ever (helper-150).  It fails,
    saying why."""
    fakes = StandIns()
    status = await _run_to_its_end(temporal_address, fakes, RunSpec(task="big talk", model="m"))
    assert status.state == "Failed", status
    assert "past the 2,090,000 a turn may carry" in (status.error or ""), status.error
    # Three turns ran, the third carrying some 1.4 MB; the fourth, 2.1 MB, was not sent.
    assert len(fakes.turn_bytes) == 3 and fakes.turn_bytes[-1] < 2_090_000


async def test_a_run_fails_before_its_history_passes_temporals_limit(
    temporal_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that cannot continue as new (children running, or too large an input to
    carry) keeps every turn's input in its history, and Temporal terminates it at 50 MB,
    its answer lost.  It fails before, saying why (the bound lowered here)."""
    monkeypatch.setattr(contract, "HISTORY_MAX_BYTES", 40_000)
    fakes = StandIns()
    spec = RunSpec(task="grow a history", model="m", max_tool_calls=30)
    status = await _run_to_its_end(temporal_address, fakes, spec)
    assert status.state == "Failed", status
    assert "the run's Temporal history is" in (status.error or ""), status.error
    assert "past 40,000" in (status.error or "")
    assert 2 <= len(fakes.turn_bytes) < 30  # some turns ran, not all


async def test_a_run_without_children_is_not_stopped_by_its_history_length(
    temporal_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """contract.HISTORY_STOP_EVENTS (lowered here) stops a run whose running children
    keep it from continuing as new; one with none continues as new when Temporal
    suggests it, and goes on (helper-158: the stop took such runs' answers)."""
    monkeypatch.setattr(contract, "HISTORY_STOP_EVENTS", 60)
    fakes = StandIns()
    spec = RunSpec(task="grow a history", model="m", max_tool_calls=30)
    status = await _run_to_its_end(temporal_address, fakes, spec)
    assert (status.state, status.error) == ("Completed", None), status
    assert len(fakes.turn_bytes) == 31  # every tool call, and the answer


async def test_a_wind_down_past_the_halt_limit_closes_at_once(
    temporal_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop waits for the turn in flight (up to stop_turn_wait_s) and for the children
    to end, while their reports grow the history; past contract.HISTORY_HALT_EVENTS
    (lowered here: the wind-down starts past it) the run closes at once, cancelling
    what still runs, rather than be terminated by Temporal at 51,200 (helper-158)."""
    monkeypatch.setattr(contract, "HISTORY_HALT_EVENTS", 10)
    fakes = StandIns()
    spec = RunSpec(task="block", model="m", budget=Budget(seconds=1), stop_turn_wait_s=300)
    status = await asyncio.wait_for(_run_to_its_end(temporal_address, fakes, spec), 60)
    assert status.state == "Cancelled", status
    assert (status.error or "").startswith("budget exceeded: seconds"), status.error
    assert fakes.in_turn == set()  # its turn was cancelled, not waited for


class ServersDown(StandIns):
    """The tool servers are unreachable: every listing fails at once, as retryable; or
    (`hang`) a server accepts the connection and never answers."""

    def __init__(self, hang: bool) -> None:
        super().__init__()
        self.hang = hang
        self.listings = 0

    @activity.defn(name="list_tools")
    async def list_tools(self, wanted: ToolsWanted | None = None) -> list[ToolInfo]:
        self.listings += 1
        if self.hang:
            await asyncio.sleep(25)  # cancelled by the worker's shutdown at the latest
        raise ApplicationError("listing tools: connection refused", type="McpUnavailable")


@pytest.mark.parametrize("hang", [False, True], ids=["refused", "hangs"])
async def test_a_budget_trips_on_time_and_ends_a_run_still_listing_its_tools(
    temporal_address: str, hang: bool
) -> None:
    """With its tool servers down a run retries its listing for up to 15 minutes.  The
    listing, a local activity, held its workflow task open, so its budget timer was read
    16 s late (of 3), and the stop then waited for the retries to end, the run Stopping
    meanwhile (helper-150); an attempt that hangs held it as long (helper-154).  The
    budget trips on time, and the run ends at once, its end reported."""
    fakes = ServersDown(hang)
    spec = RunSpec(task="answer", model="m", budget=Budget(seconds=3))
    status = await _run_to_its_end(temporal_address, fakes, spec)
    assert status.state == "Cancelled", status
    # (Seconds up to the next tenth: the timer's 3 s and the workflow task's time.)
    assert re.fullmatch(r"budget exceeded: seconds 3\.[0-3]/3", status.error or ""), status
    assert fakes.listings >= 1 and fakes.turn_bytes == []  # no turn ever ran
    assert fakes.ended == [status.handle]
