"""Run trees and budgets over whole subtrees, on the real stack."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from temporalio import workflow
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowUpdateFailedError
from temporalio.worker import (
    HandleUpdateInput,
    Interceptor,
    Worker,
    WorkflowInboundInterceptor,
    WorkflowInterceptorClassInput,
)

from activities import LlmActivities, ToolActivities
from activities.mcp_pool import McpPool
from activities.tools import check_arguments
from luftpause.config import McpServer
from tests.workflows.harness import (
    MODEL,
    Stack,
    connect,
    dev_server_with,
    run_worker,
    spawn_waiting,
    spawned_as_it_closes,
    stack,
    state_is,
    task_with,
    until,
)
from worker.main import gateway_client
from workflows import (
    TERMINAL_STATES,
    AgentRun,
    Budget,
    CallerRuns,
    RunError,
    Runs,
    RunSpec,
    contract,
)
from workflows.contract import (
    AgentRunInput,
    ChildReport,
    ChildRequest,
    ChildSummary,
    ChildWithdrawal,
    RunStatus,
    Totals,
)
from workflows.runs import new_handle


async def test_a_tree_reports_children_and_subtree_totals(temporal_address: str) -> None:
    async with stack(temporal_address) as s:
        # The parent waits on an approval, so it is running when children are added.
        parent = await spawn_waiting(s, "p", caller="bob")
        kids = [
            await s.runs.spawn(
                RunSpec(task=task_with(2, "kid"), model=MODEL, tools=["lookup"], parent=parent)
            )
            for _ in range(2)
        ]
        done = await s.runs.wait(kids)
        assert [k.state for k in done] == ["Completed", "Completed"]
        assert all(k.parent == parent and k.root == parent for k in done)
        assert all(k.caller == "bob" for k in done)  # a child inherits its parent's caller
        status = await until(
            lambda: _when(s, parent, lambda st: all(c.state == "Completed" for c in st.children)),
            "the parent saw its children end",
        )
        assert {c.handle for c in status.children} == set(kids)
        kid_total = sum(k.usage.turns for k in done)
        assert status.subtree.turns == status.usage.turns + kid_total
        assert status.subtree.tool_calls == status.usage.tool_calls + 4
        await s.runs.approve(parent, True)
        (status,) = await s.runs.wait([parent])
        assert status.state == "Completed"
        assert status.subtree.tool_calls == 5
        assert status.subtree.prompt_tokens == status.usage.prompt_tokens + sum(
            k.usage.prompt_tokens for k in done
        )

        # A run that has ended takes no children, and says so.
        with pytest.raises(RunError, match="has ended"):
            await s.runs.spawn(RunSpec(task="late", model=MODEL, parent=parent))
        with pytest.raises(RunError, match="no run with handle 'run-nope'"):
            await s.runs.spawn(RunSpec(task="orphan", model=MODEL, parent="run-nope"))


async def test_a_run_takes_children_only_while_its_history_has_room(
    temporal_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Temporal ends a workflow whose history passes 51,200 events, and with it every
    # running child; a parent whose reports would take it there says no beforehand.
    # (The limits are read at each spawn from the module the sandbox passes through.)
    monkeypatch.setattr(contract, "MAX_RUN_CHILDREN", 2)
    async with stack(temporal_address) as s:
        parent = await spawn_waiting(s, "p")
        kids = [
            await s.runs.spawn(RunSpec(task=task_with(0, "kid"), model=MODEL, parent=parent))
            for _ in range(2)
        ]
        with pytest.raises(RunError, match=r"has had 2 children, the most one run may have \(2\)"):
            await s.runs.spawn(RunSpec(task="third", model=MODEL, parent=parent))
        monkeypatch.setattr(contract, "MAX_RUN_CHILDREN", 1000)
        monkeypatch.setattr(contract, "SPAWN_HISTORY_LIMIT", 1)
        with pytest.raises(RunError, match=r"its Temporal history has \d+ events"):
            await s.runs.spawn(RunSpec(task="fourth", model=MODEL, parent=parent))
        # The same at SPAWN_SIGNAL_LIMIT signals (its children's reports): one taken
        # past SIGNAL_STOP stopped the run, and itself, at its first report (helper-172).
        # (0 here: whether the children's reports have reached the parent yet is a race;
        # its count of them is tested by the signal-limit test below.)
        monkeypatch.setattr(contract, "SPAWN_HISTORY_LIMIT", 20_480)
        monkeypatch.setattr(contract, "SPAWN_SIGNAL_LIMIT", 0)
        with pytest.raises(RunError, match=r"it has taken \d+ signals, its children's reports"):
            await s.runs.spawn(RunSpec(task="fifth", model=MODEL, parent=parent))
        # The refusals changed nothing: the parent goes on with the children it has.
        await s.runs.approve(parent, True)
        (status,) = await s.runs.wait([parent], timeout=30)
        assert status.state == "Completed", status
        assert sorted(c.handle for c in status.children) == sorted(kids)


async def test_spawns_that_arrive_together_count_against_the_limit(
    temporal_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Spawns taken in one workflow task (queued while no worker was up) are validated
    # one after another; each passed the limit, as the children before it were still
    # starting, and the run took three children where one was allowed.
    monkeypatch.setattr(contract, "MAX_RUN_CHILDREN", 1)
    async with stack(temporal_address, worker=False) as s:
        mcp = f"{s.mcp_url}/mcp"
        async with run_worker(s.client, s.task_queue, s.gateway_url, mcp):
            parent = await spawn_waiting(s, "p")
        handle = s.client.get_workflow_handle(parent)
        spec = RunSpec(task=task_with(0, "kid"), model=MODEL)
        kids = [new_handle() for _ in range(3)]
        spawns = [
            asyncio.create_task(handle.execute_update(AgentRun.spawn_child, ChildRequest(k, spec)))
            for k in kids
        ]

        async def with_the_server() -> bool:  # an update waits for a workflow task
            return (await handle.describe()).raw_description.HasField("pending_workflow_task")

        await until(with_the_server, "the spawns reaching the server")
        # No event says when the other two have reached the server: a bounded wait.  (Did
        # one come later, a worker would see the first child: the test would pass
        # without telling the fix apart, never fail with it.)
        await asyncio.sleep(1.0)
        async with run_worker(s.client, s.task_queue, s.gateway_url, mcp):
            results = await asyncio.gather(*spawns, return_exceptions=True)
            taken = [r for r in results if isinstance(r, str)]
            refused = [r for r in results if isinstance(r, WorkflowUpdateFailedError)]
            assert len(taken) == 1 and len(refused) == 2, results
            for err in refused:
                assert "has had 1 children, the most one run may have (1)" in str(err.cause)
            status = await s.runs.status(parent)
            assert [c.handle for c in status.children] == taken
            await s.runs.cancel(parent)


async def test_many_spawns_at_once_under_one_parent_each_start_their_child(
    temporal_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each spawn under a parent is an update of it, and Temporal takes 10 in flight per
    # workflow (limit.workflowExecution.maxInFlightUpdates): of 80 spawns at once, 18 to
    # 43 were refused ("limit on number of concurrent in-flight updates has been
    # reached"), or aborted, and some of those refused had started their children all
    # the same (helper-207).  Each is taken, and starts its child, once.  Two gateways
    # send them, each 8 at a time (16 in flight: what Temporal turns away is sent
    # again).  (80 at once with no gate, as many gateways would send them, passed
    # alone but failed once beside a whole suite on this 2-core machine: not pinned.)
    async with stack(temporal_address) as s:
        parent = await spawn_waiting(s, "fan")
        try:
            kids = [new_handle() for _ in range(80)]
            spec = RunSpec(task=task_with(0, "fan-kid"), model=MODEL, parent=parent)
            # Room for a loaded 2-core CI: 80 through gates 8 wide take 17-22 s here,
            # of the default 30 s a spawn waits (helper-212).
            monkeypatch.setattr(s.runs, "_child_wait_s", 90.0)
            gateways = [s.runs, Runs(s.client, task_queue=s.task_queue, child_wait_s=90.0)]
            results = await asyncio.gather(
                *(gateways[i % 2].spawn(spec, handle=k) for i, k in enumerate(kids)),
                return_exceptions=True,
            )
            failed = [r for r in results if not isinstance(r, str)]
            assert not failed, f"{len(failed)} of 80 failed: {failed[:3]}"
            assert results == kids
            status = await s.runs.status(parent)
            assert sorted(c.handle for c in status.children) == sorted(kids)
        finally:
            await s.runs.cancel(parent)


async def test_reports_that_arrive_together_go_up_as_one(temporal_address: str) -> None:
    # Every report is a signal event in every ancestor's history, up to the root's, and
    # Temporal ends a root past 51,200 events with its whole tree.  A run sends one
    # report up at a time: reports from below that arrive together (here five, queued
    # while no worker was up) go up as one, with the latest totals.
    async with stack(temporal_address, worker=False) as s:
        mcp = f"{s.mcp_url}/mcp"
        async with run_worker(s.client, s.task_queue, s.gateway_url, mcp):
            root = await spawn_waiting(s, "root")
            mid = await spawn_waiting(s, "mid", parent=root)
            kid = await spawn_waiting(s, "kid", parent=mid)
            settled = await until(
                lambda: _when(s, root, lambda st: _child(st, mid).subtree.tool_calls == 0
                              and _child(st, mid).subtree.turns == 2),
                "the root saw its subtree wait",
            )  # fmt: skip
        before = await _signals(s, root)
        for turns in range(10, 15):
            await s.client.get_workflow_handle(mid).signal(
                AgentRun.report, ChildReport(kid, "AwaitingApproval", Totals(turns=turns))
            )
        async with run_worker(s.client, s.task_queue, s.gateway_url, mcp):
            status = await until(
                lambda: _when(s, root, lambda st: _child(st, mid).subtree.turns == 1 + 14),
                "the root saw the last report",
            )
            assert _child(status, mid).state == "AwaitingApproval"
            assert settled.subtree.turns == 3
            # Before: five, one by one, sent in one workflow task, so they could arrive
            # in any order, and the root kept the fourth's totals.
            assert await _signals(s, root) - before == 1
            await s.runs.cancel(root)


async def test_totals_alone_go_up_at_most_every_few_seconds_unless_under_a_budget(
    temporal_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A subtree under no budget reports a change of totals alone at most every
    # REPORT_EVERY_S; a change of state goes at once, with the latest totals.  Under a
    # budget of tokens or tool calls every change goes at once: its holder checks the
    # budget on each.  A run's own budget is its own to check: its reports wait.
    monkeypatch.setattr(contract, "REPORT_EVERY_S", 3600.0)
    async with stack(temporal_address) as s:
        await _a_tree_reports(s, Budget(), Budget())
        await _a_tree_reports(s, Budget(tokens=10**9), Budget())
        await _a_tree_reports(s, Budget(seconds=3600), Budget())
        await _a_tree_reports(s, Budget(), Budget(tool_calls=100))


async def _a_tree_reports(s: Stack, budget: Budget, mids: Budget) -> None:
    root = await s.runs.spawn(
        RunSpec(task=task_with(1, "root"), model=MODEL, tools=["delete_record"], budget=budget)
    )
    await until(lambda: state_is(s, root, "AwaitingApproval"), "the root waits")
    mid = await spawn_waiting(s, "mid", parent=root, budget=mids)
    await until(  # its first report, and its change of state, go at once
        lambda: _when(s, root, lambda st: _child(st, mid).state == "AwaitingApproval"),
        "the root saw the mid wait",
    )
    kid = await s.runs.spawn(
        RunSpec(task=task_with(2, "kid"), model=MODEL, tools=["lookup"], parent=mid)
    )
    (done,) = await s.runs.wait([kid], timeout=60)
    below = await until(
        lambda: _when(s, mid, lambda st: _child(st, kid).state == "Completed"),
        "the mid saw its child end",
    )
    assert below.subtree.turns == 1 + done.usage.turns
    if budget.counts_usage():
        await until(
            lambda: _when(s, root, lambda st: _child(st, mid).subtree == below.subtree),
            "the mid's totals reached the budget's holder at once",
        )
    else:
        assert _child(await s.runs.status(root), mid).subtree.turns < below.subtree.turns
        await s.runs.approve(mid, True)  # a change of state: all of it goes
        await until(
            lambda: _when(s, root, lambda st: _child(st, mid).subtree.turns >= below.subtree.turns),
            "the mid's change of state took its totals up",
        )
    await s.runs.cancel(root)


async def _signals(s: Stack, handle: str) -> int:
    """The signals in the run's history."""
    history = await s.client.get_workflow_handle(handle).fetch_history()
    return sum(e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
               for e in history.events)  # fmt: skip


def _child(status: RunStatus, handle: str) -> ChildSummary:
    (child,) = [c for c in status.children if c.handle == handle]
    return child


async def test_a_child_temporal_refuses_to_start_is_said_so(tmp_path: Path) -> None:
    # A server whose limit on pending children is lower than luftpause's: the parent's
    # workflow task fails as it starts the child, and the caller read only "unexpected
    # workflow task failure".
    with dev_server_with(tmp_path, "limit.numPendingChildExecutions.error=1") as server:
        async with stack(server.address) as s:
            parent = await spawn_waiting(s, "p")
            kid = await spawn_waiting(s, "kid", parent=parent)
            with pytest.raises(RunError, match="could not start the child: its workflow task"):
                await s.runs.spawn(RunSpec(task="second", model=MODEL, parent=parent))
            status = await s.runs.status(parent)
            assert status.state == "AwaitingApproval"
            assert [c.handle for c in status.children] == [kid]


async def test_an_ended_runs_status_shows_how_its_children_ended_after_it_closed(
    temporal_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A run waits 10 s at most for the ends of the children it cancels; with Temporal or
    # the workers down meanwhile they end after it closed, and its record showed them
    # "Stopping" with their old totals for ever (helper-75, in a chaos run).  Here the
    # record is made so: when it happens is a race of the runs' workflow tasks.
    async with stack(temporal_address) as s:
        parent = await spawn_waiting(s, "p")
        kid = await spawn_waiting(s, "kid", parent=parent)
        await s.runs.cancel(parent)
        record = await s.runs.status(parent)
        (ended,) = await s.runs.wait([kid], timeout=30)
        assert ended.state == "Cancelled" and ended.usage.turns > 0
        stale = ChildSummary(kid, "Stopping", Totals())
        recorded = Runs._recorded_status

        async def as_recorded(self: Runs, desc: Any, query_timeout: float) -> RunStatus:
            status = await recorded(self, desc, query_timeout)
            if desc.id != parent:
                return status
            return replace(status, children=[stale], subtree=status.usage)

        monkeypatch.setattr(Runs, "_recorded_status", as_recorded)
        status = await s.runs.status(parent)
        assert status.state == "Cancelled" == record.state
        assert [(c.handle, c.state) for c in status.children] == [(kid, "Cancelled")]
        assert status.subtree == status.usage.plus(ended.subtree) == record.subtree


async def test_an_ended_runs_status_reads_below_a_child_that_ended_before_its_own(
    temporal_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The same one level down (helper-84, in a chaos run): a child that closed while
    # its own child was still ending reported totals without that child's end, and
    # its parent's record kept them, in the subtree and in the budget's use.  Its end
    # report says it was not settled, and the parent's status reads below it.
    async with stack(temporal_address) as s:
        parent = await spawn_waiting(s, "p", budget=Budget(tokens=10**9))
        kid = await spawn_waiting(s, "kid", parent=parent)
        grandkid = await spawn_waiting(s, "gk", parent=kid)
        running = await s.runs.status(parent)
        assert [(c.handle, c.settled) for c in running.children] == [(kid, False)]
        await s.runs.cancel(parent)
        ended, below = await s.runs.wait([kid, grandkid], timeout=30)
        assert below.state == "Cancelled" and below.usage.turns > 0
        record = await until(
            lambda: _when(s, parent, lambda st: st.state in TERMINAL_STATES),
            "the parent ended",
        )
        # As it happens almost always: the kid's end came after the grandkid's.
        assert record.children == [ChildSummary(kid, "Cancelled", ended.subtree, True)]
        assert record.subtree == record.usage.plus(ended.usage).plus(below.subtree)
        assert record.budget is not None and record.budget.used.tokens == record.subtree.tokens

        before = record.usage.plus(ended.usage)  # the kid's end as if the grandkid's was late
        stale = {
            parent: (ChildSummary(kid, "Cancelled", ended.usage, settled=False), before),
            kid: (ChildSummary(grandkid, "Stopping", Totals(), settled=False), ended.usage),
        }
        recorded = Runs._recorded_status

        async def as_recorded(self: Runs, desc: Any, query_timeout: float) -> RunStatus:
            status = await recorded(self, desc, query_timeout)
            if desc.id not in stale:
                return status
            child, subtree = stale[desc.id]
            budget = status.budget
            if budget is not None:
                used = replace(budget.used, tokens=subtree.tokens)
                budget = replace(budget, used=used)
            return replace(status, children=[child], subtree=subtree, budget=budget)

        read: list[str] = []

        async def counted(self: Runs, desc: Any, query_timeout: float) -> RunStatus:
            read.append(desc.id)
            return await as_recorded(self, desc, query_timeout)

        monkeypatch.setattr(Runs, "_recorded_status", counted)
        status = await s.runs.status(parent)
        assert status.children == record.children
        assert status.subtree == record.subtree
        assert status.budget == record.budget
        assert read == [parent, kid, grandkid]
        # Found final, the kid's end is not read again at the next status.
        read.clear()
        assert await s.runs.status(parent) == status
        assert read == [parent]
        assert status.budget is not None and status.budget.over is None  # within 10**9

        # Had the parent held a budget its recorded use just met, the grandkid's late
        # end takes the use past it, though nothing was stopped by it: `over` says so.
        limit = before.tokens

        async def at_limit(self: Runs, desc: Any, query_timeout: float) -> RunStatus:
            status = await as_recorded(self, desc, query_timeout)
            if desc.id != parent or status.budget is None:
                return status
            limits = replace(status.budget.limits, tokens=limit)
            return replace(status, budget=replace(status.budget, limits=limits))

        monkeypatch.setattr(Runs, "_recorded_status", at_limit)
        s.runs._final.clear()  # read the kid's end again, as a new gateway would
        late = await s.runs.status(parent)
        assert late.budget is not None and late.budget.exceeded is None
        assert late.budget.used.tokens == record.subtree.tokens > limit
        assert late.budget.over == f"tokens {record.subtree.tokens}/{limit}"


async def test_an_empty_parent_is_no_parent(temporal_address: str) -> None:
    # A harness that fills optional fields with "" once started a run that signalled
    # the workflow "" with its usage: a failing command, so it never moved and could
    # not even be cancelled.
    async with stack(temporal_address) as s:
        handle = await s.runs.spawn(
            RunSpec(task=task_with(1, "orphan"), model=MODEL, tools=["lookup"], parent="")
        )
        (status,) = await s.runs.wait([handle], timeout=30)
        assert status.state == "Completed" and status.parent is None, status
        assert status.root == handle and status.usage.tool_calls == 1
        # A run started that way before the fix (its spec still says parent "") moves
        # on under a worker that has it: it reports to no one.
        spec = RunSpec(task=task_with(1, "stuck"), model=MODEL, tools=["lookup"], parent="")
        stuck = new_handle()
        await s.client.start_workflow(
            AgentRun.run, AgentRunInput(spec), id=stuck, task_queue=s.task_queue
        )
        (status,) = await s.runs.wait([stuck], timeout=30)
        assert status.state == "Completed" and status.usage.tool_calls == 1, status


async def test_cancelling_a_parent_cancels_running_descendants(temporal_address: str) -> None:
    async with stack(temporal_address) as s:
        parent = await spawn_waiting(s, "p")
        child = await spawn_waiting(s, "c", parent=parent)
        grandchild = await spawn_waiting(s, "g", parent=child)
        status = await s.runs.cancel(parent)
        assert status.state == "Cancelled"
        statuses = await s.runs.wait([child, grandchild], timeout=30)
        assert [st.state for st in statuses] == ["Cancelled", "Cancelled"]
        assert statuses[1].root == parent and statuses[1].parent == child
        assert not s.mcp.started  # no destructive call ran
        # Each run's final status shows how the child it cancelled ended (helper-66:
        # the parent closed before the end came and showed it "Stopping" for ever).
        ended = await s.runs.status(parent), await s.runs.status(child)
        assert [[c.state for c in st.children] for st in ended] == [["Cancelled"], ["Cancelled"]]


async def test_a_withdrawn_spawn_request_is_refused_or_its_child_cancelled(
    temporal_address: str,
) -> None:
    # `Runs.spawn` withdraws a request its parent did not take within CHILD_WAIT_S (the
    # server keeps it, and a worker that comes later would deliver it).  Taken just as
    # its caller gave up, the child started: it is cancelled, with the reason.
    async with stack(temporal_address) as s:
        parent = await spawn_waiting(s, "wp")
        child = await spawn_waiting(s, "wc", parent=parent)
        other = await spawn_waiting(s, "wo", parent=parent)
        handle = s.client.get_workflow_handle(parent)
        # Only a run of this gateway's (and caller's) is told (helper-152).
        assert not await CallerRuns(s.runs, "someone else").withdraw_child(parent, child)
        assert not await Runs(s.client, task_queue="another").withdraw_child(parent, child)
        await handle.signal(AgentRun.withdraw_child, ChildWithdrawal(child))
        (ended,) = await s.runs.wait([child], timeout=30)
        assert ended.state == "Cancelled" and "withdrawn" in (ended.error or ""), ended
        # Withdrawn before it came, it is refused, and nothing starts.
        late = new_handle()
        await handle.signal(AgentRun.withdraw_child, ChildWithdrawal(late))
        spec = RunSpec(task=task_with(0, "wl"), model=MODEL, parent=parent)
        with pytest.raises(RunError, match=f"the request for child '{late}' was withdrawn"):
            await s.runs.spawn(spec, handle=late)
        with pytest.raises(RunError, match="no run with handle"):
            await s.runs.status(late)
        # The parent and its other child go on.
        assert await state_is(s, other, "AwaitingApproval")
        status = await s.runs.status(parent)
        assert status.state == "AwaitingApproval"
        assert {c.handle: c.state for c in status.children} == {
            child: "Cancelled",
            other: "AwaitingApproval",
        }
        signals = [
            e.workflow_execution_signaled_event_attributes.signal_name
            async for e in handle.fetch_history_events()
            if e.HasField("workflow_execution_signaled_event_attributes")
        ]
        assert signals.count("withdraw_child") == 2  # the two above, none of the others


async def test_a_cancelled_runs_budget_is_not_made_its_reason_by_what_ends_after(
    temporal_address: str,
) -> None:
    # A run cancelled while its children still work waits for their ends; the last
    # totals they report may take its subtree past the budget it holds.  The run was
    # stopped by the cancel, not by its budget: `exceeded` (the reason its subtree
    # stopped) stays None, and the limit passed is said as `over`.  The child here is
    # a report sent by hand: when a real child's last report lands is a race.
    async with stack(temporal_address) as s:
        parent = await spawn_waiting(s, "p", budget=Budget(tokens=10**6))
        kid = "run-reported-by-hand"
        handle = s.client.get_workflow_handle(parent)
        await handle.signal(AgentRun.report, ChildReport(kid, "Running", Totals(turns=1)))
        await until(lambda: _when(s, parent, lambda st: bool(st.children)), "the child known")
        await s.runs.request_cancel(parent)
        await until(  # it waits for its running child's end (CHILDREN_END_WAIT)
            lambda: _when(s, parent, lambda st: st.error is not None), "the parent ending"
        )
        spent = Totals(turns=3, prompt_tokens=2 * 10**6)
        await handle.signal(AgentRun.report, ChildReport(kid, "Cancelled", spent))
        (status,) = await s.runs.wait([parent], timeout=30)
        assert (status.state, status.error) == ("Cancelled", "cancelled")
        assert status.budget is not None and status.budget.exceeded is None
        assert status.budget.over is not None and status.budget.over.startswith("tokens ")
        assert status.subtree.tokens > 2 * 10**6


async def test_a_run_whose_history_nears_temporals_limit_stops_its_tree(
    temporal_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A run cannot continue as new while its children run, and their reports grow its
    # history; a subtree busy for hours took it past Temporal's 51,200 events, and
    # Temporal terminated the run and every child, no reason given.  At
    # HISTORY_STOP_EVENTS (lowered here: the parent's history, a spawn more) the run
    # stops as on a budget, on the child's first report, and the child with it.
    async with stack(temporal_address) as s:
        parent = await spawn_waiting(s, "p")
        history = await s.client.get_workflow_handle(parent).fetch_history()
        monkeypatch.setattr(contract, "HISTORY_STOP_EVENTS", len(history.events) + 8)
        kid = await s.runs.spawn(
            RunSpec(task=task_with(1, "kid"), model=MODEL, tools=["delete_record"], parent=parent)
        )
        top, below = await s.runs.wait([parent, kid], timeout=60)
    assert top.state == "Cancelled", top
    assert (top.error or "").startswith(f"run {parent}'s Temporal history reached "), top.error
    assert (top.error or "").endswith(": its tree stops, as on a budget")
    assert (below.state, below.error) == ("Cancelled", top.error)
    assert [(c.handle, c.state) for c in top.children] == [(kid, "Cancelled")]


async def test_a_run_whose_children_report_near_temporals_signal_limit_stops_its_tree(
    temporal_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Temporal takes at most 10,000 signals into one execution and refuses the rest:
    # past them the children's reports were refused, the budget the run held saw its
    # subtree no more, and a stop from above could not reach it (helper-163).  At
    # SIGNAL_STOP signals (lowered here: the signals it has taken, and the next one)
    # the run stops as on a budget.  (Not below what it has taken: a replay of the run,
    # which a loaded worker may make, would stop it at an earlier report.)
    async with stack(temporal_address) as s:
        parent = await spawn_waiting(s, "p")
        kid = await spawn_waiting(s, "k", parent=parent)
        handle = s.client.get_workflow_handle(parent)
        signalled = EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
        taken = [e.event_type for e in (await handle.fetch_history()).events].count(signalled)
        monkeypatch.setattr(contract, "SIGNAL_STOP", taken + 1)
        await handle.signal(AgentRun.report, ChildReport(kid, "AwaitingApproval", Totals()))
        top, below = await s.runs.wait([parent, kid], timeout=60)
    assert top.state == "Cancelled", top
    assert (top.error or "").startswith(f"run {parent} took "), top.error
    assert f"signals (its children's reports), its limit {taken + 1} " in (top.error or "")
    assert (below.state, below.error) == ("Cancelled", top.error)


async def test_a_wind_down_tells_its_running_children_to_stop_all_at_once(
    temporal_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stop's wind-down told its running children one after another, each signal in
    # a workflow task of its own (helper-159): a stop at HISTORY_STOP_EVENTS with
    # hundreds of children running took hundreds of tasks.  Under HISTORY_ROOM_PATCH
    # it signals them together.  (The limit is lowered to the parent's history once
    # its children wait; a report sent by hand makes it look.)
    async with stack(temporal_address) as s:
        parent, kids = await _three_waiting(s)
        handle = s.client.get_workflow_handle(parent)
        history = await _quiet_history(s, parent, kids)
        monkeypatch.setattr(contract, "HISTORY_STOP_EVENTS", len(history.events))
        await handle.signal(AgentRun.report, ChildReport(kids[0], "Running", Totals(turns=1)))
        done = await s.runs.wait([parent, *kids], timeout=60)
        assert [d.state for d in done] == ["Cancelled"] * 4, done
        assert all(d.error == done[0].error for d in done), done
        history = await handle.fetch_history()
    told, tasks = _tasks_telling(history, until=_SIGNAL)
    assert told == 3, history  # the wind-down's stops; the close finds them ended
    assert tasks == 0, tasks  # one after another: a task each


_SIGNAL = EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED
_CANCEL = EventType.EVENT_TYPE_REQUEST_CANCEL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED


async def _three_waiting(s: Stack) -> tuple[str, list[str]]:
    """A parent and its three children, each waiting for approval."""
    parent = await spawn_waiting(s, "p")
    return parent, [await spawn_waiting(s, f"k{i}", parent=parent) for i in range(3)]


async def _quiet_history(s: Stack, parent: str, kids: list[str]) -> Any:
    """The parent's history once it has taken its children's reports that they wait,
    and no workflow task of its is in flight.  A limit lowered to the length of a
    history whose last task was still running did not stop that task, but did stop
    its replay (a task that ends the run while new events arrive fails, and the run
    is replayed), with a reason of another length than its children were told."""
    waiting = {k: "AwaitingApproval" for k in kids}
    await until(
        lambda: _when(s, parent, lambda st: {c.handle: c.state for c in st.children} == waiting),
        "the parent saw its children wait",
    )
    handle = s.client.get_workflow_handle(parent)
    task = (
        EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED,
        EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED,
        EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED,
    )

    async def quiet() -> Any:
        history = await handle.fetch_history()
        tasks = [e.event_type for e in history.events if e.event_type in task]
        return history if tasks[-1] == task[-1] else None

    return await until(quiet, "the parent's last workflow task completed")


def _tasks_telling(history: Any, until: int) -> tuple[int, int]:
    """Of a parent's history: how many `until` commands it issued, and how many
    workflow tasks completed from its first stop signal to its last `until`."""
    kinds = [e.event_type for e in history.events]
    marks = [i for i, k in enumerate(kinds) if k == until]
    first = kinds.index(_SIGNAL)
    return len(marks), kinds[first : marks[-1]].count(EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED)


async def test_a_run_whose_children_have_ended_is_not_stopped_by_its_history(
    temporal_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With no child running the run can answer or continue as new in a few events: a
    # parent whose last child's end crossed HISTORY_STOP_EVENTS lost its answer
    # (helper-158).  Here the limit is the parent's history once its child has ended.
    async with stack(temporal_address) as s:
        parent = await spawn_waiting(s, "p")
        kid = await s.runs.spawn(RunSpec(task=task_with(0, "kid"), model=MODEL, parent=parent))
        await s.runs.wait([kid], timeout=60)
        await until(
            lambda: _when(s, parent, lambda st: _child(st, kid).state == "Completed"),
            "the parent saw its child end",
        )
        history = await s.client.get_workflow_handle(parent).fetch_history()
        monkeypatch.setattr(contract, "HISTORY_STOP_EVENTS", len(history.events))
        await s.runs.approve(parent, True)
        (status,) = await s.runs.wait([parent], timeout=60)
    assert (status.state, status.error) == ("Completed", None), status
    assert status.answer


async def test_a_close_past_the_halt_limit_stops_its_children_all_at_once(
    temporal_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A close stopped its running children one after another, a signal and a cancel
    # each in a workflow task of its own (some 16 events a child): past
    # HISTORY_HALT_EVENTS (lowered here, so that the close starts past it) a run with
    # hundreds running would still pass Temporal's 51,200 (helper-159).  They are
    # told at once, their signals sharing one workflow task, and each is cancelled as
    # its signal is delivered.  (How many tasks the cancels take is a race: the
    # deliveries, and the children's reports, come in tasks of one or several.)
    async with stack(temporal_address) as s:
        parent, kids = await _three_waiting(s)
        monkeypatch.setattr(contract, "HISTORY_HALT_EVENTS", 1)
        await s.runs.request_cancel(parent)
        done = await s.runs.wait([parent, *kids], timeout=60)
        assert [d.state for d in done] == ["Cancelled"] * 4, done
        history = await s.client.get_workflow_handle(parent).fetch_history()
    told, tasks = _tasks_telling(history, until=_SIGNAL)
    assert told == 3, history
    assert tasks == 0, tasks  # one after another: a signal and a cancel a task each
    cancelled, _ = _tasks_telling(history, until=_CANCEL)
    assert cancelled == 3, history


async def test_the_token_budget_trips_and_cancels_the_subtree(temporal_address: str) -> None:
    # Tool calls of 0.5-1.5 s keep the child working when its first turns trip the budget.
    async with stack(temporal_address, mcp_time_scale=1) as s:
        parent = await spawn_waiting(s, "p", budget=Budget(tokens=600))
        # A child that keeps working: many tool calls, long context.
        child = await s.runs.spawn(
            RunSpec(
                task=task_with(3, "context " * 200),
                model=MODEL,
                tools=["lookup"],
                parent=parent,
            )
        )
        status, kid = await s.runs.wait([parent, child], timeout=30)
        assert status.state == "Cancelled", status
        assert status.error is not None and status.error.startswith("budget exceeded: tokens ")
        used, limit = status.error.removeprefix("budget exceeded: tokens ").split("/")
        assert int(used) > int(limit) == 600
        assert status.budget is not None and status.budget.exceeded == status.error
        assert status.budget.used.tokens == int(used)
        assert kid.state == "Cancelled" and kid.error == status.error


async def test_a_budget_its_holders_last_turn_crosses_stops_the_subtree(
    temporal_address: str,
) -> None:
    # helper-66: the parent's answer took its subtree past the budget and nothing
    # looked: its child's approval stayed open and, approved, deleted; a new child was
    # taken.  The answer is the last work in flight; then the subtree stops.
    async with stack(temporal_address) as s:
        parent = await spawn_waiting(s, "op", budget=Budget(tokens=300))
        child = await spawn_waiting(s, "ok", parent=parent)
        before = await s.runs.status(parent)
        assert before.budget is not None and before.budget.used.tokens < 300
        await s.runs.approve(parent, True)  # its delete runs, then its answer crosses 300
        status, kid = await s.runs.wait([parent, child], timeout=30)
        assert status.state == kid.state == "Cancelled", status
        assert status.error is not None and status.error.startswith("budget exceeded: tokens ")
        assert status.budget is not None and status.budget.exceeded == status.error
        assert kid.error == status.error and kid.usage.tool_calls == 0
        assert sum(s.mcp.counts.values()) == 1  # the parent's approved call; not the child's
        assert [c.state for c in status.children] == ["Cancelled"]


async def test_a_single_runs_answer_that_crosses_its_budget_trips_it(temporal_address: str) -> None:
    async with stack(temporal_address) as s:
        (status,) = await s.runs.wait(
            [await s.runs.spawn(RunSpec(task=task_with(0), model=MODEL, budget=Budget(tokens=50)))]
        )
        assert status.state == "Cancelled" and status.budget is not None
        assert status.error is not None and status.error.startswith("budget exceeded: tokens ")
        assert status.budget.exceeded == status.error and status.budget.used.tokens > 50


async def test_a_run_holding_a_tool_call_budget_makes_no_call_over_it(
    temporal_address: str,
) -> None:
    async with stack(temporal_address) as s:
        # One call at a time: after the one call the budget allows, the model is offered
        # no tools and answers (as after maxToolCalls); nothing was exceeded.
        handle = await s.runs.spawn(
            RunSpec(task=task_with(3), model=MODEL, tools=["lookup"], budget=Budget(tool_calls=1))
        )
        (status,) = await s.runs.wait([handle])
        assert status.state == "Completed" and status.answer, status
        assert (status.usage.turns, status.usage.tool_calls) == (2, 1)
        assert status.budget is not None and status.budget.exceeded is None
        assert status.budget.used.tool_calls == 1
        assert sum(s.mcp.counts.values()) == 1

        # Three calls asked in one round with room for two: two run, the third is
        # answered to the model as spent, never executed.
        handle = await s.runs.spawn(
            RunSpec(
                task=task_with(3, "par"),
                model=MODEL,
                tools=["lookup"],
                parallel_tool_calls=True,
                budget=Budget(tool_calls=2),
            )
        )
        (status,) = await s.runs.wait([handle])
        assert status.state == "Completed", status
        assert (status.usage.turns, status.usage.tool_calls) == (2, 2)
        assert status.usage.failed_tool_calls == 0
        assert sum(s.mcp.counts.values()) == 3
        replies = [m["content"] for m in await s.runs.transcript(handle) if m["role"] == "tool"]
        assert len(replies) == 3
        assert replies[2] == (
            "Error: the tool-call budget of this run's tree (2) is spent; answer with what you have"
        )
        assert not any(r.startswith("Error") for r in replies[:2])


async def test_a_run_a_budget_stopped_shows_its_status_with_no_worker_up(
    temporal_address: str,
) -> None:
    # Temporal records a budget stop as a failure; the status page and `status` read
    # ended runs from history, since no worker may be up to replay them for a query.
    async with stack(temporal_address) as s:
        handle = await s.runs.spawn(
            RunSpec(
                task=task_with(3, "nw"), model=MODEL, tools=["lookup"], budget=Budget(tokens=50)
            )
        )
        (live,) = await s.runs.wait([handle])
        # What the run itself answers (a worker replays it to its end).
        queried = await s.client.get_workflow_handle_for(AgentRun.run, handle).query(
            AgentRun.status
        )
        queue = s.task_queue
    assert live.state == "Cancelled" and live.usage.turns >= 1, live
    assert live.error is not None and live.error.startswith("budget exceeded: tokens ")
    # The stack, its worker with it, is gone.
    runs = Runs(await connect(temporal_address), task_queue=queue)
    ended = await runs.status(handle, query_timeout=5)
    assert ended == live == queried


async def test_the_seconds_budget_trips_on_an_idle_subtree(temporal_address: str) -> None:
    async with stack(temporal_address) as s:
        parent = await spawn_waiting(s, "p", budget=Budget(seconds=2.4))
        child = await s.runs.spawn(
            RunSpec(task=task_with(1, "c"), model=MODEL, tools=["delete_record"], parent=parent)
        )
        # Nobody answers: the whole subtree is idle, and the durable timer trips it.
        status, kid = await s.runs.wait([parent, child], timeout=30)
        assert status.state == kid.state == "Cancelled"
        assert status.error is not None and status.error.startswith("budget exceeded: seconds ")
        assert status.error.endswith("/2.4") and kid.error == status.error
        used = float(status.error.removeprefix("budget exceeded: seconds ").split("/")[0])
        assert used >= 2.4  # to the next tenth ("2.5/2.4"); it read "2/2.4" (helper-66)
        assert not s.mcp.started


async def test_a_budget_stop_waits_for_a_turn_in_flight_a_bounded_time(
    temporal_address: str,
) -> None:
    # Engines 50x slower than real: the run's first turn (256 tokens) takes minutes, and
    # is generating when the seconds budget trips.  (A turn the gateway holds in its
    # queue is the case this is for: it has no deadline at all.)
    async with stack(temporal_address, engine={"time_scale": 0.02}) as s:
        handle = await s.runs.spawn(
            RunSpec(
                task=task_with(0, "slowturn"),
                model=MODEL,
                budget=Budget(seconds=1),
                stop_turn_wait_s=1.0,
            )
        )
        (status,) = await s.runs.wait([handle], timeout=30)
        assert status.state == "Cancelled", status
        assert status.error is not None and status.error.startswith("budget exceeded: seconds ")
        assert status.usage.turns == 0  # cancelled after its wait, not waited for
        # The gateway dropped the turn and was told the run ended.
        await until(lambda: handle not in s.shell.state.runs, "the gateway forgot the run")
        assert not list(s.shell.state.admitted())


async def test_work_in_flight_when_a_budget_trips_finishes_and_is_counted(
    temporal_address: str,
) -> None:
    async with stack(temporal_address) as s:
        s.mcp.gate.clear()  # lookups begin, then hold until the gate opens
        parent = await spawn_waiting(s, "dp", budget=Budget(tool_calls=1))
        held = await s.runs.spawn(
            RunSpec(task=task_with(1, "dpheld"), model=MODEL, tools=["lookup"], parent=parent)
        )
        await until(lambda: _begun(s, "lookup") == 1, "the child's lookup is in flight")
        # A second child's two (instant) calls take the subtree over its one call.  Each
        # waits for the test's approval, and so does its third, which nobody answers: the
        # stop finds this child still running, however late it arrives (without the third
        # the child could answer and complete before the stop reached it).
        quick = await s.runs.spawn(
            RunSpec(
                task=task_with(3, "dpquick"),
                model=MODEL,
                tools=["fail"],
                approve_tools=["fail"],
                parent=parent,
            )
        )
        answered: set[str] = set()
        for _ in range(2):
            waiting = await until(
                lambda: _when(
                    s,
                    quick,
                    lambda st: st.pending_approval and st.pending_approval.call_id not in answered,
                ),
                "the quick child's next call waits for approval",
            )
            answered.add(waiting.pending_approval.call_id)  # type: ignore[attr-defined]
            await s.runs.approve(quick, True, waiting.pending_approval.call_id)  # type: ignore[attr-defined]
        await until(
            lambda: _when(s, held, lambda st: st.state == "Stopping"),
            "the stop reached the child whose call is in flight",
        )
        stopping = await s.runs.status(parent)
        assert stopping.state == "Stopping"
        assert stopping.error == "budget exceeded: tool_calls 2/1"
        assert stopping.pending_approval is None  # a wait for approval ends at once
        with pytest.raises(RunError, match="is stopping"):
            await s.runs.spawn(RunSpec(task="more", model=MODEL, parent=parent))
        assert _done(s, "lookup") == 0  # the subtree waits for it, not the other way round

        s.mcp.gate.set()
        status, kid, other = await s.runs.wait([parent, held, quick], timeout=30)
        assert [st.state for st in (status, kid, other)] == ["Cancelled"] * 3
        assert status.error == kid.error == other.error == "budget exceeded: tool_calls 2/1"
        # The held call finished, reached its run's transcript and counts; no turn followed.
        assert _done(s, "lookup") == 1
        assert (kid.usage.tool_calls, kid.usage.turns) == (1, 1)
        transcript = await s.client.get_workflow_handle(held).query("transcript")
        assert transcript[-1]["role"] == "tool" and "Lookup of" in transcript[-1]["content"]
        assert other.usage.tool_calls == 2
        # The overshoot is what was in flight, and the holder knows all of it.
        assert status.usage.tool_calls == 0  # its own call waited for approval: never ran
        assert status.budget is not None and status.budget.used.tool_calls == 3
        assert _begun(s, "delete_record") == 0


def _begun(s: Stack, tool: str) -> int:
    return sum(n for (t, _), n in s.mcp.started.items() if t == tool)


def _done(s: Stack, tool: str) -> int:
    return sum(n for (t, _), n in s.mcp.counts.items() if t == tool)


async def _child_end_seen(s: Stack, parent: str) -> Any:
    """The parent's status once it has seen its one child end."""
    return await until(
        lambda: _when(
            s, parent, lambda st: st.children and st.children[0].state in TERMINAL_STATES
        ),
        "the parent saw its child end",
    )


async def _decline_and_end(s: Stack, handle: str) -> None:
    """Decline the run's pending approval and wait for it to end."""
    await s.runs.approve(handle, False)
    await s.runs.wait([handle])


async def _when(s: object, handle: str, pred: object) -> object:
    status = await s.runs.status(handle)  # type: ignore[attr-defined]
    return status if pred(status) else None  # type: ignore[operator]


async def test_status_shows_recent_runs_as_trees_with_subtree_costs(
    temporal_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import httpx

    import gateway.app

    monkeypatch.setattr(gateway.app, "SUBAGENT_COUNT_EVERY_S", 0.0)  # count at each scrape
    async with stack(temporal_address) as s:
        parent = await spawn_waiting(s, "page")
        child = await s.runs.spawn(
            RunSpec(task=task_with(1, "pagekid"), model=MODEL, tools=["lookup"], parent=parent)
        )
        await s.runs.wait([child])
        async with httpx.AsyncClient(base_url=s.gateway_url) as http:

            async def tree() -> object:
                body = (await http.get("/status")).json()
                nodes = [n for n in body["sub_agents"] if n["handle"] == parent]
                if nodes and nodes[0]["children"]:
                    return nodes[0]
                return None

            node = await until(tree, "the parent and its child on /status")
            assert node["state"] == "AwaitingApproval"
            assert node["note"] == "waits for approval of delete_record (of fake)"
            (kid,) = node["children"]
            assert (kid["handle"], kid["depth"], kid["state"]) == (child, 1, "Completed")
            assert node["tool_calls"] == kid["tool_calls"] == 1  # the subtree's costs
            page = (await http.get("/")).text
        assert "Sub-agent runs" in page and parent in page and child in page

        async def open_runs(http: httpx.AsyncClient, want: dict[str, float]) -> object:
            """/metrics' count of open runs by state, once it is `want` (Temporal's
            visibility may lag a change by a moment)."""
            text = (await http.get("/metrics")).text
            up = [s.value for f in text_string_to_metric_families(text) for s in f.samples
                  if s.name == "luftpause_run_store_up"]  # fmt: skip
            seen = {
                s.labels["state"]: s.value
                for f in text_string_to_metric_families(text)
                for s in f.samples
                if s.name == "luftpause_subagent_runs"
            }
            workers = [s.value for f in text_string_to_metric_families(text) for s in f.samples
                       if s.name == "luftpause_subagent_workers"]  # fmt: skip
            assert workers == [1.0]  # the stack's one worker polls the runs' queue
            return seen if up == [1.0] and seen == want else None

        quiet = {"AwaitingApproval": 0.0, "AwaitingChildren": 0.0, "Running": 0.0, "Stopping": 0.0}
        async with httpx.AsyncClient(base_url=s.gateway_url) as http:
            # The parent waits for approval; its child has completed (not open).
            await until(
                lambda: open_runs(http, {**quiet, "AwaitingApproval": 1.0}), "parent counted"
            )
            # A caller's view counts only its own runs.
            mine = await CallerRuns(s.runs, (await s.runs.status(parent)).caller).count_open()
            assert mine == {**dict.fromkeys(quiet, 0), "AwaitingApproval": 1}
            assert await CallerRuns(s.runs, "someone else").count_open() == dict.fromkeys(quiet, 0)
            await _decline_and_end(s, parent)
            await until(lambda: open_runs(http, quiet), "no run open")


async def test_a_child_stopped_by_its_own_budget_is_cancelled_in_its_parents_view(
    temporal_address: str,
) -> None:
    async with stack(temporal_address) as s:
        parent = await spawn_waiting(s, "pv")
        child = await s.runs.spawn(
            RunSpec(
                task=task_with(3, "pvkid"),
                model=MODEL,
                tools=["lookup"],
                parent=parent,
                budget=Budget(tokens=50),  # its first turn takes it over
            )
        )
        (kid,) = await s.runs.wait([child])
        assert kid.state == "Cancelled", kid
        assert kid.error is not None and kid.error.startswith("budget exceeded: tokens ")
        assert kid.usage.tool_calls == 0
        status = await _child_end_seen(s, parent)
        assert [(c.handle, c.state) for c in status.children] == [(child, "Cancelled")]
        assert status.state == "AwaitingApproval"  # a child's own budget stops only the child
        await _decline_and_end(s, parent)


async def test_a_terminated_child_reads_cancelled_in_its_parent_as_in_status(
    temporal_address: str,
) -> None:
    async with stack(temporal_address) as s:
        parent = await spawn_waiting(s, "tp")
        child = await spawn_waiting(s, "tc", parent=parent)
        await s.client.get_workflow_handle(child).terminate("by an operator")
        status = await _child_end_seen(s, parent)
        assert [(c.handle, c.state) for c in status.children] == [(child, "Cancelled")]
        # It sent no end report: what it last reported may not be all (helper-84) ...
        assert not status.children[0].settled
        assert (await s.runs.status(child)).state == "Cancelled"

        # Listed so too, not by the state it last set (AwaitingApproval).
        async def listed(state: str) -> bool:
            return child in await s.runs.list(state=state)

        await until(lambda: listed("Cancelled"), "the terminated child listed as Cancelled")
        assert not await listed("AwaitingApproval")
        await _decline_and_end(s, parent)
        # ... so the parent's ended status reads it.
        (ended,) = (await s.runs.status(parent)).children
        assert (ended.state, ended.settled) == ("Cancelled", True)


async def test_an_idle_runs_budget_seconds_keep_counting_in_its_status(
    temporal_address: str,
) -> None:
    async with stack(temporal_address) as s:
        handle = await spawn_waiting(s, "idle", budget=Budget(seconds=120))

        async def counted() -> bool:
            budget = (await s.runs.status(handle)).budget
            return budget is not None and (budget.used.seconds or 0) >= 1.0

        # Nothing happens in the run meanwhile: its workflow clock stands still.
        await until(counted, "the seconds used grow while the run waits")
        await s.runs.approve(handle, False)
        await s.runs.wait([handle])


async def test_a_child_that_finishes_starting_as_its_parent_closes_is_stopped_with_it(
    temporal_address: str,
) -> None:
    # The child is stopped and cancelled as the children the closing run had were,
    # instead of working on (here: to its end) until the close's wait for its children
    # (CHILDREN_END_WAIT) ends and Temporal cancels it at the parent's close.
    async with stack(temporal_address, worker=False) as s:
        statuses = await spawned_as_it_closes(s)
        parent, child = (st.handle for st in statuses)
        assert [st.state for st in statuses] == ["Cancelled", "Cancelled"]
        assert [c.state for c in statuses[0].children] == ["Cancelled"]
        handle = s.client.get_workflow_handle(parent)
        events = [e async for e in handle.fetch_history_events()]
        # The parent cancelled it itself (without the fix, nothing did: it was quick
        # and ran to its end, its tool calls with it).
        cancels = [
            e.request_cancel_external_workflow_execution_initiated_event_attributes
            for e in events
            if e.event_type
            == EventType.EVENT_TYPE_REQUEST_CANCEL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED
        ]
        assert [c.workflow_execution.workflow_id for c in cancels] == [child]


class _FailAfterSpawn(WorkflowInboundInterceptor):
    """While `armed`, fails every workflow task in which a run's `spawn_child` has seen
    its child start: the task that takes it once disarmed sees the child's start and
    whatever came meanwhile together (its worker was late)."""

    armed = threading.Event()

    async def handle_update_handler(self, input: HandleUpdateInput) -> Any:
        result = await self.next.handle_update_handler(input)
        first = not workflow.unsafe.is_replaying()
        if input.update == "spawn_child" and self.armed.is_set() and first:
            raise RuntimeError("fail this workflow task")
        return result


class _Intercept(Interceptor):
    def workflow_interceptor_class(
        self, input: WorkflowInterceptorClassInput
    ) -> type[WorkflowInboundInterceptor]:
        return _FailAfterSpawn


async def test_a_childs_report_before_its_start_was_seen_is_kept(temporal_address: str) -> None:
    # The parent's workflow task that sees the child's start also carries the child's
    # first report (the parent's worker was late): the report's handler runs first, and
    # spawn_child set the child back to Running with nothing used.  The parent's view
    # and its subtree then counted nothing of the child while it waited on an approval
    # (helper-180).
    async with stack(temporal_address, worker=False) as s:
        pool = McpPool([McpServer(name="fake", url=f"{s.mcp_url}/mcp")])
        async with gateway_client() as http:
            llm = LlmActivities(http, base_url=s.gateway_url, heartbeat_every_s=0.5)
            tools = ToolActivities(pool, heartbeat_every_s=0.5)
            activities = [llm.llm_turn, llm.end_run, tools.list_tools, tools.call_tool]
            async with Worker(
                s.client,
                task_queue=s.task_queue,
                workflows=[AgentRun],
                activities=[*activities, check_arguments],
                interceptors=[_Intercept()],
            ):
                parent = await spawn_waiting(s, "early", budget=Budget(tokens=10**6))
                _FailAfterSpawn.armed.set()
                spec = RunSpec(
                    task=task_with(1, "kid"), model=MODEL, tools=["delete_record"], parent=parent
                )
                spawning = asyncio.ensure_future(s.runs.spawn(spec))

                async def reported() -> bool:
                    """The child's report that it waits (its last before the approval)
                    is in the parent's history."""
                    async for e in s.client.get_workflow_handle(parent).fetch_history_events():
                        attrs = e.workflow_execution_signaled_event_attributes
                        if (
                            e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
                            and attrs.signal_name == "report"
                            and b"AwaitingApproval" in attrs.SerializeToString()
                        ):
                            return True
                    return False

                try:
                    await until(reported, "the child's report reaches the parent")
                finally:
                    _FailAfterSpawn.armed.clear()
                child = await asyncio.wait_for(spawning, 60)
                await until(lambda: state_is(s, child, "AwaitingApproval"), "the child waits")
                used = (await s.runs.status(child)).subtree.tokens
                assert used > 0

                async def counted() -> bool:
                    st = await s.runs.status(parent)
                    return [(c.state, c.subtree.tokens) for c in st.children] == [
                        ("AwaitingApproval", used)
                    ]

                await until(counted, "the parent counts the child's report")
                await s.runs.cancel(parent)
        await pool.aclose()
