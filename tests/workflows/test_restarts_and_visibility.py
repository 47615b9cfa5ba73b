"""Approvals across a worker restart, stdio tool servers, search attributes, and
continue-as-new on a server that suggests it early."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

from activities import LlmActivities, ToolActivities
from activities.mcp_pool import McpPool
from luftpause.config import McpServer
from tests.workflows.harness import (
    MODEL,
    Stack,
    dev_server_with,
    run_worker,
    stack,
    task_with,
    until,
)
from worker.main import build_worker
from workflows import Runs, RunSpec


async def _pending_call(s: Stack, handle: str, not_call: str | None = None) -> str:
    async def probe() -> str | None:
        st = await s.runs.status(handle)
        p = st.pending_approval
        return p.call_id if p is not None and p.call_id != not_call else None

    return str(await until(probe, f"{handle} asks for approval"))


async def test_approvals_survive_a_worker_restart(temporal_address: str) -> None:
    async with stack(temporal_address, worker=False) as s:
        spec = RunSpec(task=task_with(2, "two-deletes"), model=MODEL, tools=["delete_record"])
        async with run_worker(s.client, s.task_queue, s.gateway_url, f"{s.mcp_url}/mcp"):
            handle = await s.runs.spawn(spec)
            first = await _pending_call(s, handle)
            await s.runs.approve(handle, True)
            second = await _pending_call(s, handle, not_call=first)
        # No worker: the open approval is still open, and Temporal says what it knows.
        async with run_worker(s.client, s.task_queue, s.gateway_url, f"{s.mcp_url}/mcp"):
            status = await s.runs.status(handle)
            assert status.state == "AwaitingApproval"
            assert status.pending_approval is not None
            assert status.pending_approval.call_id == second  # the answered one is not asked again
            await s.runs.approve(handle, False)
            (status,) = await s.runs.wait([handle])
        assert status.state == "Completed"
        assert (status.usage.tool_calls, status.usage.failed_tool_calls) == (2, 1)
        assert sum(s.mcp.counts.values()) == 1  # the allowed call ran once, the declined never


async def test_a_stdio_tool_server(temporal_address: str, tmp_path: Path) -> None:
    counts = tmp_path / "counts.json"
    exe = str(Path(sys.executable).parent / "luftpause")
    server = McpServer(
        name="stdio",
        command=[
            exe,
            "fake-mcp",
            "--transport",
            "stdio",
            "--time-scale",
            "50",
            "--counts-file",
            str(counts),
        ],
    )
    async with stack(temporal_address, worker=False) as s:
        pool = McpPool([server])
        import httpx

        async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=2.0)) as http:
            worker = build_worker(
                s.client,
                task_queue=s.task_queue,
                llm=LlmActivities(http, base_url=s.gateway_url, heartbeat_every_s=0.5),
                tools=ToolActivities(pool, heartbeat_every_s=0.5),
            )
            async with worker:
                spec = RunSpec(task=task_with(2, "stdio"), model=MODEL, tools=["lookup"])
                (status,) = await s.runs.wait([await s.runs.spawn(spec)])
        await pool.aclose()
    assert status.state == "Completed" and status.usage.tool_calls == 2
    completed = json.loads(counts.read_text())["completed"]
    assert sum(row["count"] for row in completed) == 2
    assert all(row["tool"] == "lookup" for row in completed)


async def test_runs_are_listed_by_search_attributes(temporal_address: str) -> None:
    async with stack(temporal_address) as s:
        caller = f"carol-{uuid.uuid4().hex[:6]}"
        handles = [
            await s.runs.spawn(RunSpec(task=task_with(0, "vis"), model=MODEL, caller=caller))
            for _ in range(3)
        ]
        await s.runs.wait(handles)
        # Visibility is eventually consistent: poll until all three are listed.
        listed = await until(
            lambda: _listed(s.runs, caller, 3), "the caller's runs are listed", polls=200
        )
        assert set(listed) == set(handles)
        query = f"LuftpauseCaller = '{caller}' AND LuftpauseState = 'Completed'"

        async def completed() -> set[str] | None:
            found = {wf.id async for wf in s.client.list_workflows(query)}
            return found if len(found) == 3 else None

        assert await until(completed, "listed as Completed", polls=200) == set(handles)


async def _listed(runs: Runs, caller: str, n: int) -> list[str] | None:
    handles = await runs.list(caller=caller)
    return handles if len(handles) == n else None


async def _listed_once(runs: Runs, handle: str, state: str) -> bool | None:
    found = await runs.list(state=state)
    return True if found.count(handle) == 1 else None


async def test_a_long_run_continues_as_new_and_keeps_its_state(tmp_path: Path) -> None:
    # A server that suggests continue-as-new after 20 history events.
    with dev_server_with(tmp_path, "limit.historyCount.suggestContinueAsNew=20") as server:
        async with stack(server.address) as s:
            task = task_with(3, "long")
            handle = await s.runs.spawn(RunSpec(task=task, model=MODEL, tools=["lookup"]))
            (status,) = await s.runs.wait([handle])
            assert status.state == "Completed"
            assert (status.usage.turns, status.usage.tool_calls) == (4, 3)
            assert sum(s.mcp.counts.values()) == 3 and not s.mcp.repeated()
            runs_of_handle = [
                wf async for wf in s.client.list_workflows(f"WorkflowId = '{handle}'")
            ]
            assert len(runs_of_handle) >= 2  # it continued as new at least once
            # Its last execution has the priority the run started with: the server
            # carries it over (continue-as-new names none).
            latest = (await s.client.get_workflow_handle(handle).describe()).raw_description
            priority = latest.workflow_execution_info.priority
            assert (priority.priority_key, priority.fairness_key) == (2, "anonymous")
            # Listed once, as it is now: not again for each execution it continued from
            # (those keep the state they had then, Running).
            assert await until(
                lambda: _listed_once(s.runs, handle, "Completed"), "listed once", polls=200
            )
            assert handle not in await s.runs.list(state="Running")
            assert (await s.runs.list()).count(handle) == 1
            messages = await s.runs.transcript(handle)
            assert [m["role"] for m in messages].count("tool") == 3
