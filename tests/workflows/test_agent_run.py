"""A sub-agent run end to end: the real dev server, gateway, fake engines, fake MCP."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from temporalio.client import WorkflowExecutionStatus, WorkflowHandle

from luftpause.config import McpServer
from tests.workflows.harness import (
    MODEL,
    Stack,
    run_worker,
    spawn_waiting,
    stack,
    state_is,
    task_with,
    until,
)
from workflows import (
    DECLINED,
    AgentRun,
    PendingApproval,
    Rounds,
    RunError,
    Runs,
    RunSpec,
    RunUnavailable,
)
from workflows.contract import Approval, RunStatus, Totals
from workflows.runs import STATUS_UNAVAILABLE


def track_concurrency(s: Stack) -> dict[str, int]:
    """Count the fake MCP's calls in flight; return a dict whose "max" is the peak."""
    seen = {"now": 0, "max": 0}
    begin, finish = s.mcp.begin, s.mcp.finish

    def tracked_begin(tool: str, arguments: Any) -> tuple[str, str]:
        seen["now"] += 1
        seen["max"] = max(seen["max"], seen["now"])
        return begin(tool, arguments)

    def tracked_finish(key: tuple[str, str]) -> None:
        seen["now"] -= 1
        finish(key)

    s.mcp.begin = tracked_begin  # type: ignore[method-assign]
    s.mcp.finish = tracked_finish  # type: ignore[method-assign]
    return seen


async def test_a_run_loops_through_tool_calls_and_answers(temporal_address: str) -> None:
    async with stack(temporal_address) as s:
        task = task_with(3)
        spec = RunSpec(task=task, model=MODEL, caller="alice", tools=["lookup", "deep_search"])
        handle = await s.runs.spawn(spec)
        (status,) = await s.runs.wait([handle], timeout=60)
        assert status.state == "Completed", status
        assert status.answer
        assert status.usage.turns == 4 and status.usage.tool_calls == 3
        assert status.usage.failed_tool_calls == 0
        assert status.usage.completion_tokens > 0 and status.usage.prompt_tokens > 0
        # Turns 2..4 continue the run on the replica that cached its prefix.
        assert status.usage.cached_tokens > 0
        assert status.caller == "alice" and status.root == handle and status.parent is None
        # Every call reached the fake MCP once, and its answer is in the transcript.
        assert sum(s.mcp.counts.values()) == 3 and not s.mcp.repeated()
        messages = await s.runs.transcript(handle)
        assert [m["role"] for m in messages] == ["user", *["assistant", "tool"] * 3, "assistant"]
        assert messages[-1]["content"] == status.answer
        # The gateway was told the run ended.
        assert handle not in s.shell.state.runs
        # A turn may wait in the gateway's queue as long as it takes: no attempt limit
        # short of a day (one would abandon the turn there and queue it again, last),
        # none on its retries (a gateway down for long loses no run); a heartbeat
        # notices a dead worker.
        history = await s.client.get_workflow_handle(handle).fetch_history()
        turns = [
            e.activity_task_scheduled_event_attributes
            for e in history.events
            if e.HasField("activity_task_scheduled_event_attributes")
            and e.activity_task_scheduled_event_attributes.activity_type.name == "llm_turn"
        ]
        assert len(turns) == 4
        for t in turns:
            assert t.start_to_close_timeout.ToSeconds() == 24 * 3600
            assert t.schedule_to_close_timeout.ToSeconds() == 0, t.schedule_to_close_timeout
            assert t.heartbeat_timeout.ToSeconds() == 10
            assert t.retry_policy.maximum_attempts == 0  # unlimited


async def test_the_tool_budget_and_max_tokens_are_respected(temporal_address: str) -> None:
    async with stack(temporal_address) as s:
        spec = RunSpec(task=task_with(3), model=MODEL, tools=["lookup"], max_tool_calls=1)
        handle = await s.runs.spawn(spec)
        (status,) = await s.runs.wait([handle])
        # One call, then the model was offered no tools and had to answer.
        assert status.state == "Completed"
        assert (status.usage.turns, status.usage.tool_calls) == (2, 1)
        assert sum(s.mcp.counts.values()) == 1

        short = await s.runs.spawn(RunSpec(task=task_with(0), model=MODEL, max_tokens=7))
        (status,) = await s.runs.wait([short])
        assert status.usage.completion_tokens == 7 and status.usage.turns == 1


async def test_parallel_tool_calls_run_concurrently(temporal_address: str) -> None:
    # Calls of 0.5-1.5 s: three started together overlap however late a poll is.
    async with stack(temporal_address, mcp_time_scale=1) as s:
        seen = track_concurrency(s)
        spec = RunSpec(task=task_with(3), model=MODEL, tools=["lookup"], parallel_tool_calls=True)
        (status,) = await s.runs.wait([await s.runs.spawn(spec)])
        assert status.state == "Completed"
        # All three calls came in one turn and were in flight together.
        assert (status.usage.turns, status.usage.tool_calls) == (2, 3)
        assert seen["max"] == 3

        seen["max"] = 0
        spec = RunSpec(task=task_with(3), model=MODEL, tools=["lookup"])
        (status,) = await s.runs.wait([await s.runs.spawn(spec)])
        assert (status.usage.turns, seen["max"]) == (4, 1)


async def test_a_malformed_call_is_an_error_the_model_sees(temporal_address: str) -> None:
    async with stack(temporal_address) as s:
        task = task_with(2) + " [fake: malformed-args]"
        handle = await s.runs.spawn(RunSpec(task=task, model=MODEL, tools=["lookup"]))
        (status,) = await s.runs.wait([handle])
        assert status.state == "Completed"
        assert (status.usage.tool_calls, status.usage.failed_tool_calls) == (2, 2)
        assert not s.mcp.started  # never executed
        tool_messages = [m for m in await s.runs.transcript(handle) if m["role"] == "tool"]
        assert len(tool_messages) == 2
        for m in tool_messages:
            assert m["content"].startswith("Error: the arguments for tool 'lookup'")
            assert "'query' is a required property" in m["content"]
            assert 'expected {"query": string}' in m["content"]


async def test_a_call_that_cannot_run_is_not_put_to_the_user(temporal_address: str) -> None:
    # Arguments that do not fit the tool's schema go back to the model unasked: the
    # user was asked to approve a destructive call that could never run, and after a
    # yes the model was told its arguments did not fit (helper-179).
    async with stack(temporal_address) as s:
        task = task_with(1, "unfit") + " [fake: malformed-args]"
        handle = await s.runs.spawn(RunSpec(task=task, model=MODEL, tools=["delete_record"]))
        # (Bounded: a run that asks waits for an answer for ever.)
        (status,) = await asyncio.wait_for(s.runs.wait([handle]), 60)
        assert status.state == "Completed", status
        assert (status.usage.tool_calls, status.usage.failed_tool_calls) == (1, 1)
        assert not s.mcp.started
        (reply,) = [m for m in await s.runs.transcript(handle) if m["role"] == "tool"]
        assert reply["content"].startswith("Error: the arguments for tool 'delete_record'")
        assert "'record_id' is a required property" in reply["content"]


async def test_calls_written_as_text_are_recovered(temporal_address: str) -> None:
    async with stack(temporal_address) as s:
        task = task_with(2) + " [fake: text-tools]"
        handle = await s.runs.spawn(RunSpec(task=task, model=MODEL, tools=["lookup"]))
        (status,) = await s.runs.wait([handle])
        assert status.state == "Completed"
        assert (status.usage.tool_calls, status.usage.failed_tool_calls) == (2, 0)
        assert sum(s.mcp.counts.values()) == 2
        assistant = [m for m in await s.runs.transcript(handle) if m["role"] == "assistant"]
        assert all(m.get("tool_calls") for m in assistant[:2])
        assert assistant[0]["tool_calls"][0]["id"].startswith("call_recovered_")


async def test_approval_allowed_and_declined(temporal_address: str) -> None:
    async with stack(temporal_address) as s:
        specs = [
            RunSpec(task=task_with(1, "approve"), model=MODEL, tools=["delete_record"])
            for _ in range(2)
        ]
        allowed, declined = [await s.runs.spawn(spec) for spec in specs]
        for handle in (allowed, declined):
            status = await _pending(s, handle)
            assert status.pending_approval is not None
            assert status.pending_approval.tool == "delete_record"
            assert set(status.pending_approval.arguments) == {"record_id"}
        assert not s.mcp.started  # nothing ran before the answer
        await s.runs.approve(allowed, True)
        await s.runs.approve(declined, False)
        a, d = await s.runs.wait([allowed, declined])
        assert a.state == d.state == "Completed"
        assert (a.usage.tool_calls, a.usage.failed_tool_calls) == (1, 0)
        assert (d.usage.tool_calls, d.usage.failed_tool_calls) == (1, 1)
        assert sum(s.mcp.counts.values()) == 1
        tool_reply = [m for m in await s.runs.transcript(declined) if m["role"] == "tool"]
        assert tool_reply[0]["content"] == DECLINED == "Error: the user declined this tool call"


def test_a_second_answer_to_one_call_does_not_overwrite_the_first() -> None:
    # Two answers in one workflow task (the approve tool and an elicitation, two
    # clients) each pass the validator before the run moves on: a decline taken and
    # acknowledged must not be overwritten by an allow, or the destructive call runs.
    # (Validator and handler of one update run without a yield between them, so the
    # second validator sees the first answer; that ordering is the SDK's.)
    run = object.__new__(AgentRun)
    run._id, run._state, run._answers = "r", "AwaitingApproval", {}
    run._pending = PendingApproval(call_id="c1", tool="delete_record", arguments={})
    run._validate_approve(Approval(False, "c1"))
    assert run.approve(Approval(False, "c1")) == "delete_record"
    with pytest.raises(ValueError, match="answer to call 'c1' already: declined"):
        run._validate_approve(Approval(True, "c1"))
    with pytest.raises(ValueError, match="already: declined"):
        run._validate_approve(Approval(True))  # an answer naming no call: the pending one
    run._validate_approve(Approval(False, "c1"))  # the same answer again: a resend
    assert run._answers == {"c1": False}


async def test_approve_tools_names_a_tool_that_is_not_destructive(temporal_address: str) -> None:
    async with stack(temporal_address) as s:
        spec = RunSpec(
            task=task_with(1, "approve"), model=MODEL, tools=["lookup"], approve_tools=["lookup"]
        )
        handle = await s.runs.spawn(spec)
        status = await _pending(s, handle)
        assert status.pending_approval is not None and status.pending_approval.tool == "lookup"
        # A wrong call id is refused and changes nothing.
        try:
            await s.runs.approve(handle, True, call_id="call_other")
        except Exception as exc:
            assert str(exc).startswith(f"run '{handle}' is waiting on call"), exc
        else:
            raise AssertionError("an approval for another call was accepted")
        assert (await s.runs.status(handle)).state == "AwaitingApproval"
        await s.runs.approve(handle, True, call_id=status.pending_approval.call_id)
        (status,) = await s.runs.wait([handle])
        assert status.state == "Completed" and sum(s.mcp.counts.values()) == 1


async def test_a_tool_named_as_engines_refuse_is_offered_by_a_name_they_take(
    temporal_address: str,
) -> None:
    # An engine that checks function names as OpenAI does answered 400 to every turn that
    # offered `files.read`: the run failed on its first turn.  Its model now calls it by
    # a name it takes; approvals and `approve_tools` still speak of the tool's own name.
    script = Path(__file__).parents[1] / "activities" / "named_server.py"
    named = McpServer(name="named", command=[sys.executable, str(script)])
    engine = {"strict_tool_names": True}
    async with stack(temporal_address, engine=engine, mcp_servers=[named]) as s:
        read = await s.runs.spawn(
            RunSpec(task=task_with(1, "read"), model=MODEL, tools=["files.read"])
        )
        delete = await s.runs.spawn(
            RunSpec(task=task_with(1, "delete"), model=MODEL, tools=["files/delete"])
        )
        check = await s.runs.spawn(
            RunSpec(task=task_with(1, "2fa"), model=MODEL, tools=["2fa-check"],
                    approve_tools=["2fa-check"])
        )  # fmt: skip
        for handle, tool in ((delete, "files/delete"), (check, "2fa-check")):
            pending = (await _pending(s, handle)).pending_approval
            assert pending is not None and pending.tool == tool
            await s.runs.approve(handle, True)
        done = await s.runs.wait([read, delete, check], timeout=60)
        assert [d.state for d in done] == ["Completed"] * 3, done
        assert [(d.usage.tool_calls, d.usage.failed_tool_calls) for d in done] == [(1, 0)] * 3
        for handle, function, answer in (
            (read, "files_read_", "contents of "),
            (delete, "files_delete", "deleted "),
            (check, "t_2fa_check", "checked "),
        ):
            messages = await s.runs.transcript(handle)
            (call,) = [c for m in messages for c in m.get("tool_calls") or ()]
            assert call["function"]["name"].startswith(function)
            (reply,) = [m for m in messages if m["role"] == "tool"]
            assert reply["content"].startswith(answer), reply


async def _pending(s: Stack, handle: str) -> Any:
    for _ in range(300):
        status = await s.runs.status(handle)
        if status.state == "AwaitingApproval":
            return status
        await asyncio.sleep(0.05)
    raise AssertionError(f"{handle} never asked for approval")


def counting_queries(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """From now on, the ids of the workflows queried, in order."""
    queried: list[str] = []
    query = WorkflowHandle.query

    async def counted(self: WorkflowHandle[Any, Any], *args: Any, **kwargs: Any) -> Any:
        queried.append(self.id)
        return await query(self, *args, **kwargs)

    monkeypatch.setattr(WorkflowHandle, "query", counted)
    return queried


async def test_an_ended_run_seen_with_no_worker_is_read_again_briefly() -> None:
    # helper-130: a status "Cancelled, status unavailable" was kept as final for the
    # rest of the call, its usage and answer never read; helper-131: read again, it
    # was asked for the whole query time (a cancelled run is queried, with a worker).
    ended = RunStatus(
        handle="h", state="Cancelled", task="", model="", service_class="", caller="",
        parent=None, root="h", children=[], usage=Totals(), subtree=Totals(),
        error=f"{STATUS_UNAVAILABLE}no worker answered within 10 s", started_at="",
    )  # fmt: skip
    desc = SimpleNamespace(
        id="h", run_id="r", history_length=5, status=WorkflowExecutionStatus.CANCELED
    )
    rounds = Rounds()
    rounds.saw(desc, ended)  # type: ignore[arg-type]
    asked: list[float] = []

    async def describe(handle: str) -> Any:
        return desc

    async def status(d: Any, query_timeout: float) -> RunStatus:
        asked.append(query_timeout)
        return ended

    runs = Runs.__new__(Runs)
    runs._describe = describe  # type: ignore[method-assign]
    runs._status = status  # type: ignore[method-assign]
    assert await runs._look("h", rounds, 10.0) is ended
    assert asked == [0.5]


async def test_waiting_in_rounds_asks_a_worker_only_about_runs_whose_history_grew(
    temporal_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with stack(temporal_address) as s:
        done = await s.runs.spawn(RunSpec(task=task_with(0, "known"), model=MODEL))
        (ended,) = await s.runs.wait([done])
        assert ended.state == "Completed"
        waiting = await spawn_waiting(s, "rounds")
        queried = counting_queries(monkeypatch)
        rounds = Rounds()
        first = await s.runs.wait([done, waiting], timeout=0.2, rounds=rounds)
        assert [x.state for x in first] == ["Completed", "AwaitingApproval"]
        # The ended run's status is read from its result (no worker), the waiting one's
        # from a worker once ...
        assert queried == [waiting]
        # ... and while nothing happens in it, later rounds only describe it.
        for _ in range(3):
            again = await s.runs.wait([done, waiting], timeout=0.2, rounds=rounds)
            assert again[1].state == "AwaitingApproval"
            assert again[1].pending_approval == first[1].pending_approval
        assert queried == [waiting]
        # Something happens (the approval): the next round sees it.
        await s.runs.approve(waiting, True)
        queried.clear()
        got = await s.runs.wait([done, waiting], timeout=30, rounds=rounds)
        assert got[0] is first[0]  # seen ended: not asked again
        assert got[1].state == "Completed" and got[1].usage.tool_calls == 1


async def test_a_short_wait_reads_a_live_run_from_its_worker(temporal_address: str) -> None:
    # helper-155: the query was cut at the wait's own timeout, so a short wait (or the
    # last round of a long `await`, with milliseconds left) read a run waiting on an
    # approval as "Running, status unavailable", its approval not shown.
    async with stack(temporal_address) as s:
        waiting = await spawn_waiting(s, "short")
        for _ in range(5):
            (seen,) = await s.runs.wait([waiting], timeout=0.001)
            assert (seen.state, seen.error) == ("AwaitingApproval", None), seen
            assert seen.pending_approval is not None
        await s.runs.request_cancel(waiting)


async def test_a_round_that_found_no_worker_asks_again_briefly(
    temporal_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # helper-126: the first round's "status unavailable" was kept while the run's
    # history did not grow (it waits for an approval), so an `await` begun while the
    # worker restarted never saw the approval, though a worker was back.
    async with stack(temporal_address, worker=False) as s:
        mcp = f"{s.mcp_url}/mcp"
        async with run_worker(s.client, s.task_queue, s.gateway_url, mcp):
            waiting = await spawn_waiting(s, "stale")
        rounds = Rounds()
        (first,) = await s.runs.wait([waiting], timeout=0.3, rounds=rounds)
        assert first.error is not None and first.error.startswith(STATUS_UNAVAILABLE)
        # Still no worker: the next round asks once more, for half a second, not for
        # its whole query time (helper-129: asked at both ends of every round, a 20 s
        # call took 30).
        queried = counting_queries(monkeypatch)
        started = time.monotonic()
        (again,) = await s.runs.wait([waiting], timeout=3.0, rounds=rounds)
        assert again.error == "status unavailable: no worker answered within 0.5 s"
        assert queried == [waiting] and time.monotonic() - started < 6.0
        async with run_worker(s.client, s.task_queue, s.gateway_url, mcp):

            async def seen() -> RunStatus | None:
                (st,) = await s.runs.wait([waiting], timeout=1.0, rounds=rounds)
                return st if st.pending_approval is not None else None

            again = await until(seen, "a later round asks the worker that is back")
            assert again.state == "AwaitingApproval" and again.error is None


async def test_cancel_answers_in_bounded_time_with_no_worker_up(temporal_address: str) -> None:
    async with stack(temporal_address, worker=False) as s:
        handle = await s.runs.spawn(RunSpec(task=task_with(0, "nowork"), model=MODEL))
        # A wait asks no worker longer than its own timeout (it asked for 10 s), 2 s at
        # least, and after a round none answered only briefly; it says why it knows
        # only what Temporal knows (it said "status unavailable: ").
        (seen,) = await s.runs.wait([handle], timeout=0.5)
        assert seen.state == "Running"
        assert seen.error == "status unavailable: no worker answered within 0.5 s"
        # The request needs Temporal only; the answer says what is known after the wait.
        await asyncio.wait_for(s.runs.request_cancel(handle), 5)
        status = await asyncio.wait_for(s.runs.cancel(handle, wait_s=0.5), 8)
        assert status.handle == handle and status.state == "Running"
        assert status.error is not None and status.error.startswith("status unavailable")
        with pytest.raises(RunError, match="no run with handle 'run-nope'"):
            await s.runs.request_cancel("run-nope")
        # An answer naming a call no engine names (the Tasks path's key, too): refused
        # before it reaches the run (helper-126: a megabyte of one failed its task).
        with pytest.raises(RunError, match=r"callId: expected .* got 1,000,000 characters"):
            await s.runs.approve(handle, True, "c" * 1_000_000)
        history = await s.client.get_workflow_handle(handle).fetch_history()
        kinds = {e.WhichOneof("attributes") for e in history.events}
        assert "workflow_execution_cancel_requested_event_attributes" in kinds
        # A handle names this gateway's runs only (helper-126: cancel reached any
        # workflow of the namespace): not another task queue's run, nor a workflow that
        # is no run.
        other = Runs(s.client, task_queue=f"{s.task_queue}-other")
        foreign = await s.client.start_workflow(
            "BillingMonthEnd", id=f"billing-{s.task_queue}", task_queue=f"{s.task_queue}-b"
        )
        try:
            for runs, h in ((other, handle), (s.runs, foreign.id)):
                for look in (runs.status, runs.request_cancel, runs.cancel):
                    with pytest.raises(RunError, match=f"no run with handle '{h}'"):
                        await look(h)
                # Nor a parent (helper-129: the spawn reached it).
                with pytest.raises(RunError, match=f"no run with handle '{h}'"):
                    await runs.spawn(RunSpec(task="x", model=MODEL, parent=h))
            foreign_kinds = {
                e.WhichOneof("attributes") async for e in foreign.fetch_history_events()
            }
            assert "workflow_execution_cancel_requested_event_attributes" not in foreign_kinds
        finally:
            await foreign.terminate()


async def test_an_answer_no_worker_takes_is_said_not_taken_in_bounded_time(
    temporal_address: str,
) -> None:
    # `approve` used to wait for ever with no worker up: the update stays with the
    # server and the SDK asks again at each 20 s long poll.  Its callers (the approve
    # tool, elicitation answers, tasks/update) now hear that the answer was not taken.
    async with stack(temporal_address, worker=False) as s:
        runs = Runs(s.client, task_queue=s.task_queue, child_wait_s=3.0)
        spec = RunSpec(task=task_with(1, "noworkapprove"), model=MODEL, tools=["delete_record"])
        handle = await runs.spawn(spec)
        # No worker has ever polled the queue: said at once, and nothing is sent.
        with pytest.raises(RunUnavailable, match="no worker polls task queue"):
            await asyncio.wait_for(runs.approve(handle, True), 5)
        # ... but a run that has ended needs no worker to say so: a stale answer, which
        # its callers ignore, not one left untaken.
        gone = await runs.spawn(replace(spec, task=task_with(1, "noworkgone")))
        await s.client.get_workflow_handle(gone).terminate("test")
        with pytest.raises(RunError, match="has ended") as ended:
            await asyncio.wait_for(runs.approve(gone, True), 20)
        assert not isinstance(ended.value, RunUnavailable)
        async with run_worker(s.client, s.task_queue, s.gateway_url, f"{s.mcp_url}/mcp"):
            await until(lambda: state_is(s, handle, "AwaitingApproval"), "the run waits")
        # A worker that has just gone away is still listed: the answer is sent, and the
        # wait for it is bounded.
        with pytest.raises(RunUnavailable, match="did not take the answer within 3 s"):
            await asyncio.wait_for(runs.approve(handle, False), 15)
        # As the message says, it may still be taken: a worker that comes takes it.
        async with run_worker(s.client, s.task_queue, s.gateway_url, f"{s.mcp_url}/mcp"):
            (done,) = await s.runs.wait([handle], timeout=60)
        assert done.state == "Completed" and done.usage.failed_tool_calls == 1
        assert s.mcp.counts.get("delete_record", 0) == 0  # declined: never run


async def test_a_run_terminated_while_it_awaits_approval_shows_no_call_to_answer(
    temporal_address: str,
) -> None:
    # Terminated from outside (the Temporal UI), its status still showed the call it
    # had waited on: a client was offered an approval nobody could give, and the
    # call's arguments took a share of the door's maxChars (helper-240).
    async with stack(temporal_address) as s:
        spec = RunSpec(task=task_with(1, "termapprove"), model=MODEL, tools=["delete_record"])
        handle = await s.runs.spawn(spec)
        await until(lambda: state_is(s, handle, "AwaitingApproval"), "the run waits")
        assert (await s.runs.status(handle)).pending_approval is not None
        await s.client.get_workflow_handle(handle).terminate("by an operator")
        ended = await s.runs.status(handle)
        assert (ended.state, ended.error) == ("Cancelled", "terminated")
        assert ended.pending_approval is None
        assert s.mcp.counts.get("delete_record", 0) == 0


async def test_spawning_a_child_with_no_worker_up_answers_in_bounded_time(
    temporal_address: str,
) -> None:
    async with stack(temporal_address, worker=False) as s:
        # Longer than the server's 20 s long poll of an update, after which the SDK
        # would ask again and again.
        runs = Runs(s.client, task_queue=s.task_queue, child_wait_s=21.0)
        spec = RunSpec(task=task_with(1, "noworkerp"), model=MODEL, tools=["delete_record"])
        parent = await runs.spawn(spec)
        child = RunSpec(task=task_with(0, "noworkerc"), model=MODEL, parent=parent)
        # No worker has ever polled the queue: said at once, and nothing is asked.
        with pytest.raises(RunError, match="no worker polls task queue"):
            await asyncio.wait_for(runs.spawn(child, handle="run-never"), 5)

        # A worker that has just gone away is still listed: the request is made, and
        # the wait for it is bounded.
        async with run_worker(s.client, s.task_queue, s.gateway_url, f"{s.mcp_url}/mcp"):
            await until(lambda: state_is(s, parent, "AwaitingApproval"), "the parent waits")
        with pytest.raises(RunUnavailable, match="did not take the child within 21 s") as err:
            await asyncio.wait_for(runs.spawn(child, handle="run-later-child"), 40)
        assert s.task_queue in str(err.value)
        # ... and withdrawn: the server keeps an update its caller left, and a worker
        # that came would start a child its caller was told had not started (and that
        # a retry would start twice).
        assert "the request is withdrawn: no child runs" in str(err.value)
        assert "run 'run-later-child', is cancelled" in str(err.value)
        # A caller that gives up first (an MCP client's own timeout) is cancelled, not
        # answered as if the wait had run out; its request stays (the door shields a
        # spawn its call no longer waits for, and cancels the run once it starts).
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(runs.spawn(replace(child, task="cancelled")), 1)

        # A worker comes back: the request withdrawn is refused (or, taken in the same
        # workflow task before the withdrawal, its child cancelled); the one its caller
        # left was taken; the one never asked made no child.
        async with run_worker(s.client, s.task_queue, s.gateway_url, f"{s.mcp_url}/mcp"):
            await s.runs.approve(parent, False)
            (done,) = await s.runs.wait([parent], timeout=60)
            assert done.state == "Completed", done
            kids = {c.handle: c.state for c in done.children}
            assert kids.pop("run-later-child", "Cancelled") == "Cancelled", kids
            assert "run-never" not in kids
            assert len(kids) == 1 and set(kids.values()) == {"Completed"}, kids
            with contextlib.suppress(RunError):  # no run with the handle: never started
                later = await s.runs.status("run-later-child")
                assert later.state == "Cancelled" and "withdrawn" in (later.error or ""), later


def test_a_tool_answer_is_cut_to_the_room_left_in_the_conversation() -> None:
    # Every turn carries the conversation; past Temporal's 2 MB payload limit the run
    # would be stuck.  What does not fit is cut, with a note the model reads.
    from workflows.agent_run import CONVERSATION_MAX_BYTES, fit_answer

    assert fit_answer("short answer", 100) == "short answer"
    wide = "é" * 300_000  # 1.8 MB once JSON escapes it (\u00e9)
    cut = fit_answer(wide, 10_000)
    assert cut.startswith("é") and cut.endswith(f"limit of {CONVERSATION_MAX_BYTES:,} bytes]")
    assert len(json.dumps(cut)) <= 10_000
    assert fit_answer(wide, 0).startswith("\n[luftpause: the answer was cut")


def test_the_offered_tools_count_against_the_conversation_limit() -> None:
    # Each turn's input is the conversation and the tools offered: a wide tool listing
    # leaves that much less room for answers.
    from activities.contract import ToolInfo
    from workflows.agent_run import CONVERSATION_MAX_BYTES, fit_round

    schema = {"type": "object", "description": "x" * 100_000}
    tools = [ToolInfo("s", f"t{i}", "a tool", schema) for i in range(10)]  # ~1 MB
    messages = [{"role": "user", "content": "go"}]
    answers = [("call-1", "a" * 200_000), ("call-2", "b" * 400_000), ("call-3", "c")]
    fitted = fit_round(messages, tools, answers)
    offered = [t.openai_tool() for t in tools]
    # (A call with no room left still gets its note, a message of its own: the limit
    # leaves 500 kB below Temporal's for such.)
    over = len(json.dumps(messages + fitted)) + len(json.dumps(offered)) - CONVERSATION_MAX_BYTES
    assert over <= len(json.dumps(fitted[2])) + 2
    # The first answer fits whole; the second is cut with its note; the third, with no
    # room left, is the note alone.  Each call has its message, in order.
    assert [m["tool_call_id"] for m in fitted] == ["call-1", "call-2", "call-3"]
    assert fitted[0]["content"] == answers[0][1]
    assert fitted[1]["content"].startswith("bbb") and "answer was cut" in fitted[1]["content"]
    assert fitted[2]["content"].startswith("\n[luftpause: the answer was cut")
    # Without tools the same answers fit whole.
    assert [m["content"] for m in fit_round(messages, [], answers)] == [a for _, a in answers]
