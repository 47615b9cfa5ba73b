"""`luftpause bench temporal` — what Temporal adds per sub-agent turn.

Two arms do the same work against the same gateway, instant fake engine and fake MCP
tools (about 1 ms each), each its own process as `luftpause up` runs them: `workflow`
runs each sub-agent as an `AgentRun` on a tuned Temporal dev server (the flags of
NOTES.md) with a worker in the bench's process; `direct` runs the identical loop (LLM
turn through the gateway, then the tool calls through the same MCP connection) as plain
asyncio.  Runs go one at a time and the arms alternate, so
the machine's noise falls on both; the added cost per turn is
(workflow run time - direct run time) / turns, per run pair, reported as p50 and p90.
Everything runs on loopback; every process started is stopped by its PID at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["GOAL_MS_PER_TURN", "add_arguments", "run"]

GOAL_MS_PER_TURN = 15.0
MODEL = "llama-3.2-1b"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", type=int, default=20, help="runs per arm (default 20)")
    parser.add_argument(
        "--tool-calls", type=int, default=3, help="tool calls per run (default 3, max 8)"
    )
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured runs per arm first")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


@dataclass
class _Bed:
    runs: Any
    gateway_url: str
    pool: Any
    http: Any
    tools: list[Any]


def _task(calls: int, i: int, max_calls: int) -> str:
    from testkit._fake_text import key

    for j in range(100_000):
        task = f"bench task {i} {j}"
        if key(0, "tool-calls", task) % (max_calls + 1) == calls:
            return task
    raise RuntimeError("no task found")


@contextlib.asynccontextmanager
async def _bed(max_calls: int, log: Path) -> AsyncIterator[_Bed]:
    """The dev server, an instant fake engine, the gateway and the fake MCP server as
    their own processes (as `luftpause up` runs them); the worker and both arms in this
    one, so the worker has this event loop to itself while it runs."""
    import httpx

    from activities import LlmActivities, ToolActivities
    from activities.mcp_pool import McpPool
    from luftpause.config import McpServer
    from luftpause.temporal_dev import DevServer, free_port
    from luftpause.up import Child, wait_http
    from worker.main import build_worker
    from workflows import Runs

    exe = str(Path(sys.executable).parent / "luftpause")
    server = DevServer(log_file=log)
    children: list[Child] = []

    def child(name: str, argv: list[str]) -> Child:
        c = Child(name, [exe, *argv], log.with_name(f"{name}.log"))
        c.start()
        children.append(c)
        return c

    server.start()
    try:
        ports = {name: free_port() for name in ("engine", "gateway", "mcp")}
        engine_url = f"http://127.0.0.1:{ports['engine']}"
        c = child(
            "engine",
            [
                "fake-engine",
                "--instant",
                "--port",
                str(ports["engine"]),
                "--max-tool-calls",
                str(max_calls),
            ],
        )
        wait_http(f"{engine_url}/health", "the fake engine", c)
        config = log.with_name("luftpause.toml")
        config.write_text(
            f'[[endpoints]]\nname = "e"\nurl = "{engine_url}"\nkind = "sglang"\n'
            f'models = ["{MODEL}"]\n',
            encoding="utf-8",
        )
        gateway_url = f"http://127.0.0.1:{ports['gateway']}"
        c = child("gateway", ["gateway", "--config", str(config), "--port", str(ports["gateway"])])
        wait_http(f"{gateway_url}/health", "the gateway", c)
        mcp_base = f"http://127.0.0.1:{ports['mcp']}"
        c = child("mcp", ["fake-mcp", "--port", str(ports["mcp"]), "--time-scale", "1000000"])
        wait_http(f"{mcp_base}/counts", "the fake MCP server", c)
        async with contextlib.AsyncExitStack() as stack:
            from temporalio.client import Client

            client = None
            for _ in range(100):
                try:
                    client = await Client.connect(server.address)
                    break
                except RuntimeError:
                    await asyncio.sleep(0.1)
            if client is None:
                raise RuntimeError(f"temporal at {server.address} never answered")
            pool = McpPool([McpServer(name="fake", url=f"{mcp_base}/mcp")])
            stack.push_async_callback(pool.aclose)
            http = await stack.enter_async_context(
                httpx.AsyncClient(timeout=httpx.Timeout(60, connect=2))
            )
            queue = f"bench-{uuid.uuid4().hex[:8]}"
            worker = build_worker(
                client,
                task_queue=queue,
                llm=LlmActivities(http, base_url=gateway_url),
                tools=ToolActivities(pool),
            )
            await stack.enter_async_context(worker)
            tools = [t for t in await pool.list_tools() if t.name == "lookup"]
            yield _Bed(Runs(client, task_queue=queue), gateway_url, pool, http, tools)
    finally:
        for c in reversed(children):
            c.stop()
        server.stop()


async def _direct(bed: _Bed, task: str, run_id: str) -> int:
    """The run's loop without Temporal; returns its number of turns."""
    from activities._arguments import prepare_arguments

    messages: list[dict[str, Any]] = [{"role": "user", "content": task}]
    tools = [t.openai_tool() for t in bed.tools]
    headers = {"x-luftpause-run-id": run_id}
    turns = 0
    while True:
        body = {"model": MODEL, "messages": messages, "tools": tools, "max_tokens": 256}
        r = await bed.http.post(
            f"{bed.gateway_url}/v1/chat/completions", json=body, headers=headers
        )
        r.raise_for_status()
        turns += 1
        message = r.json()["choices"][0]["message"]
        messages.append(message)
        calls = message.get("tool_calls") or []
        if not calls:
            await bed.http.delete(f"{bed.gateway_url}/v1/runs/{run_id}")
            return turns
        for call in calls:
            tool = bed.tools[0]
            args = prepare_arguments(tool.name, call["function"]["arguments"], tool.input_schema)
            text, _ = await bed.pool.call(tool.server, tool.name, args)
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": text})


async def _workflow(bed: _Bed, task: str) -> int:
    from workflows import RunSpec

    # Start to result only: the facade's status queries are not Temporal's cost per turn.
    handle = await bed.runs.spawn(RunSpec(task=task, model=MODEL, tools=["lookup"]))
    status = await asyncio.wait_for(bed.runs.client.get_workflow_handle(handle).result(), 120)
    return int(status["usage"]["turns"] if isinstance(status, dict) else status.usage.turns)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def _measure(runs: int, calls: int, warmup: int, log: Path) -> dict[str, Any]:
    max_calls = max(calls, 1)
    async with _bed(max_calls, log) as bed:
        pairs: list[tuple[float, float, int]] = []
        for i in range(warmup + runs):
            task = _task(calls, i, max_calls)
            order = ("direct", "workflow") if i % 2 == 0 else ("workflow", "direct")
            took: dict[str, float] = {}
            turns = 0
            for arm in order:
                # Same task, different run ids: both arms do the same turns and calls.
                t0 = time.perf_counter()
                if arm == "direct":
                    turns = await _direct(bed, task, f"direct-{uuid.uuid4().hex[:12]}")
                else:
                    n = await _workflow(bed, task)
                    if n != calls + 1:
                        raise RuntimeError(f"workflow made {n} turns, expected {calls + 1}")
                took[arm] = time.perf_counter() - t0
            if i >= warmup:
                pairs.append((took["direct"], took["workflow"], turns))
    per_turn = [(w - d) / t * 1000 for d, w, t in pairs]
    direct = [d * 1000 for d, _, _ in pairs]
    workflow = [w * 1000 for _, w, _ in pairs]
    return {
        "scenario": "temporal",
        "runs": runs,
        "turns_per_run": calls + 1,
        "tool_calls_per_run": calls,
        "direct_run_ms": {"p50": round(_pct(direct, 0.5), 2), "p90": round(_pct(direct, 0.9), 2)},
        "workflow_run_ms": {
            "p50": round(_pct(workflow, 0.5), 2),
            "p90": round(_pct(workflow, 0.9), 2),
        },
        "added_ms_per_turn": {
            "p50": round(_pct(per_turn, 0.5), 2),
            "p90": round(_pct(per_turn, 0.9), 2),
            "mean": round(statistics.fmean(per_turn), 2),
        },
        "goal_ms_per_turn": GOAL_MS_PER_TURN,
        "goal_met": _pct(per_turn, 0.5) <= GOAL_MS_PER_TURN,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }


def _table(r: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"Temporal's added cost per sub-agent turn ({r['runs']} runs of "
            f"{r['turns_per_run']} turns and {r['tool_calls_per_run']} tool calls, one at a time)",
            f"{'arm':<10} {'run p50 ms':>11} {'run p90 ms':>11}",
            f"{'direct':<10} {r['direct_run_ms']['p50']:>11} {r['direct_run_ms']['p90']:>11}",
            f"{'workflow':<10} {r['workflow_run_ms']['p50']:>11} {r['workflow_run_ms']['p90']:>11}",
            f"added per turn: p50 {r['added_ms_per_turn']['p50']} ms, "
            f"p90 {r['added_ms_per_turn']['p90']} ms "
            f"(goal <= {r['goal_ms_per_turn']:g} ms: {'met' if r['goal_met'] else 'NOT met'})",
        ]
    )


def run(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING)
    if not 1 <= args.runs <= 10_000 or not 0 <= args.tool_calls <= 8 or args.warmup < 0:
        print("luftpause bench temporal: --runs 1..10000, --tool-calls 0..8", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="luftpause-bench-") as tmp:
        result = asyncio.run(
            _measure(args.runs, args.tool_calls, args.warmup, Path(tmp) / "temporal.log")
        )
    print(json.dumps(result, indent=2) if args.json else _table(result))
    return 0
