"""A call to be approved is checked against its tool's input schema first (CHECKED_PATCH),
on a real dev server with stand-in activities registered under the real names (as in
test_tool_timeouts): the model's arguments are chosen per test."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator

import pytest
from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import ApplicationError

from activities.contract import (
    CheckedArguments,
    EndRunInput,
    ToolCall,
    ToolInfo,
    ToolInput,
    ToolOutput,
    ToolsWanted,
    TurnInput,
    TurnOutput,
)
from tests.workflows.harness import connect, replays_with, stand_in_worker, until
from workflows import Runs, RunSpec, RunStatus
from workflows.agent_run import CHECKED_PATCH

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}
DEEP = "[" * 1200 + "]" * 1200  # past Python's recursion limit as JSON is decoded
# Read, but past what Temporal's converter carries (about 450 levels: helper-182).
DEEPISH = '{"id": 1, "note": ' + "[" * 500 + "]" * 500 + "}"


class StandIns:
    """One destructive tool, `erase`.  A run's first turn calls it with the task as its
    arguments; the next answers "done"."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    @activity.defn(name="list_tools")
    async def list_tools(self, wanted: ToolsWanted | None = None) -> list[ToolInfo]:
        return [ToolInfo("fake", "erase", "erase a record", SCHEMA, destructive=True)]

    @activity.defn(name="end_run")
    async def end_run(self, end: EndRunInput) -> None:
        pass

    @activity.defn(name="call_tool")
    async def call_tool(self, call: ToolInput) -> ToolOutput:
        self.sent.append(call.arguments)
        return ToolOutput("erased", False, True)

    @activity.defn(name="llm_turn")
    async def llm_turn(self, turn: TurnInput) -> TurnOutput:
        if not any(m["role"] == "tool" for m in turn.messages):
            arguments = next(m["content"] for m in turn.messages if m["role"] == "user")
            fn = {"name": "erase", "arguments": arguments}
            message = {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": fn}],
            }
            return TurnOutput(message, [ToolCall("c1", "erase", arguments)], "tool_calls", 10, 10)
        return TurnOutput({"role": "assistant", "content": "done"}, [], "stop", 10, 10)


class CheckDown(StandIns):
    """As StandIns, with a check that never answers (its worker's fault)."""

    @activity.defn(name="check_arguments")
    async def check_arguments(self, call: ToolInput) -> CheckedArguments:
        raise ApplicationError("the check broke", non_retryable=True)


async def _pending(runs: Runs, handle: str) -> RunStatus:
    async def asks() -> bool:
        return (await runs.status(handle)).state == "AwaitingApproval"

    await until(asks, "the run asks for approval")
    return await runs.status(handle)


@contextlib.asynccontextmanager
async def _erasing(
    temporal_address: str, fakes: StandIns, arguments: str
) -> AsyncIterator[tuple[Client, Runs, str]]:
    """A worker of `fakes`, and a run whose first turn calls `erase` with `arguments`:
    the client, the runs and the run's handle."""
    client = await connect(temporal_address)
    queue = f"erase-{uuid.uuid4().hex[:8]}"
    runs = Runs(client, task_queue=queue)
    async with stand_in_worker(client, queue, fakes):
        await until(runs._worker_polls, "the worker polls")
        yield client, runs, await runs.spawn(RunSpec(task=arguments, model="m", tools=["erase"]))


async def test_the_question_shows_the_arguments_the_tool_would_get(temporal_address: str) -> None:
    fakes = StandIns()
    async with _erasing(temporal_address, fakes, '{"id": "7"}') as (client, runs, handle):
        status = await _pending(runs, handle)
        assert status.pending_approval is not None
        assert status.pending_approval.arguments == {"id": 7}, "coerced, as the tool gets it"
        await runs.approve(handle, True)
        await asyncio.wait_for(client.get_workflow_handle(handle).result(), 60)
    assert fakes.sent == ['{"id": "7"}']
    await replays_with(client, handle, CHECKED_PATCH)


@pytest.mark.parametrize("arguments", ["{}", '{"id": "seven"}', DEEP, DEEPISH])
async def test_a_call_that_cannot_fit_goes_back_to_the_model_unasked(
    temporal_address: str, arguments: str
) -> None:
    fakes = StandIns()
    async with _erasing(temporal_address, fakes, arguments) as (client, runs, handle):
        # (Bounded: a run that asks waits for an answer for ever.)
        await asyncio.wait_for(client.get_workflow_handle(handle).result(), 60)
        status = await runs.status(handle)
        transcript = await runs.transcript(handle)
    assert status.state == "Completed" and not fakes.sent
    assert (status.usage.tool_calls, status.usage.failed_tool_calls) == (1, 1)
    (reply,) = [m for m in transcript if m["role"] == "tool"]
    assert reply["content"].startswith("Error: the arguments for tool 'erase'"), reply
    await replays_with(client, handle, CHECKED_PATCH)


@pytest.mark.parametrize("arguments", [DEEP, DEEPISH], ids=["unreadable", "uncarriable"])
async def test_a_call_nested_too_deep_is_asked_about_as_written_when_the_check_fails(
    temporal_address: str, arguments: str
) -> None:
    # With no check to go by, the question shows the arguments as the model wrote them.
    # Decoding them for it raised a RecursionError, which failed every workflow task of
    # the run: it read Running, "status unavailable", and a cancel could not end it
    # (helper-180).  Decoded, 500 levels deep, they failed every status query instead
    # (Temporal's converter recurses about twice a level; helper-182).
    fakes = CheckDown()
    async with _erasing(temporal_address, fakes, arguments) as (client, runs, handle):
        status = await _pending(runs, handle)
        assert status.pending_approval is not None
        assert status.pending_approval.arguments == arguments
        await runs.approve(handle, False)
        await asyncio.wait_for(client.get_workflow_handle(handle).result(), 60)
        status = await runs.status(handle)
    assert status.state == "Completed" and not fakes.sent
    assert (status.usage.tool_calls, status.usage.failed_tool_calls) == (1, 1)


class CheckLoose(StandIns):
    """As StandIns, with a check from before MAX_DEPTH: it passes any JSON object."""

    @activity.defn(name="check_arguments")
    async def check_arguments(self, call: ToolInput) -> CheckedArguments:
        return CheckedArguments(json.loads(call.arguments))


async def test_checked_arguments_too_deep_to_show_are_shown_as_their_text(
    temporal_address: str,
) -> None:
    # A run that was checked before MAX_DEPTH existed replays with the old check's
    # answer: the question shows arguments that deep as their text (helper-183).
    deep = '{"id": 1, "note": ' + "[" * 100 + "]" * 100 + "}"
    async with _erasing(temporal_address, CheckLoose(), deep) as (_, runs, handle):
        status = await _pending(runs, handle)
        assert status.pending_approval is not None
        assert status.pending_approval.arguments == deep
        await runs.cancel(handle)
