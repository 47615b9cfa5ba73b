"""Durability: the worker killed, the Temporal dev server and the gateway restarted
mid-run — every run completes; no completed call of a tool that is not repeatable is
sent again, and a repeatable one is answered from the first call by a server that
remembers the idempotency key."""

from __future__ import annotations

import contextlib
import uuid
from pathlib import Path

from temporalio.client import Client, WorkflowExecutionDescription, WorkflowExecutionStatus

from activities.contract import NOT_SENT
from luftpause.temporal_dev import DevServer
from luftpause.up import Child
from testkit.loopback import serve
from tests.workflows.harness import (
    MODEL,
    FakeMcpProcess,
    Stack,
    connect,
    gateway_app,
    run_worker,
    stack,
    start_fakes,
    task_with,
    until,
    worker_config,
    worker_process,
)
from workflows import Runs, RunSpec

RUNS = 10


def specs(prefix: str) -> list[RunSpec]:
    return [
        RunSpec(task=task_with(3, f"{prefix}{i}"), model=MODEL, tools=["lookup"])
        for i in range(RUNS)
    ]


async def test_worker_killed_mid_run(temporal_address: str, tmp_path: Path) -> None:
    # Tool calls of 0.5-1.5 s: runs are mid-call when the worker dies.
    async with stack(temporal_address, mcp_time_scale=1, worker=False) as s:
        worker = _worker_process(s, temporal_address, tmp_path)
        try:
            handles = [await s.runs.spawn(spec) for spec in specs("kill")]
            await until(lambda: sum(s.mcp.counts.values()) >= 8, "calls completed", polls=600)
            worker.kill()
            before = sum(s.mcp.counts.values())
            assert before < RUNS * 3  # the kill really was mid-run
            worker.start()
            statuses = await s.runs.wait(handles, timeout=120)
        finally:
            code = worker.stop(30)
        assert code == 0, (tmp_path / "worker.log").read_text()[-3000:]
        assert [st.state for st in statuses] == ["Completed"] * RUNS
        # lookup is read-only: a call the dead worker left is sent again, and answered.
        assert all((st.usage.tool_calls, st.usage.failed_tool_calls) == (3, 0) for st in statuses)
        assert sum(s.mcp.counts.values()) == RUNS * 3
        assert s.mcp.repeated() == []


async def test_a_call_that_may_have_run_is_not_sent_again_unless_repeatable(
    temporal_address: str, tmp_path: Path
) -> None:
    # helper-65: an approved delete_record was running at the server when the worker
    # died; the retry sent it again, and only this fake's memory of the idempotency key
    # kept a real server from deleting twice.  delete_record is destructive and not
    # idempotent: it is sent once, and the model is told its outcome is unknown.
    async with stack(temporal_address, worker=False) as s:
        worker = _worker_process(s, temporal_address, tmp_path)
        try:
            spec = RunSpec(task=task_with(1, "once"), model=MODEL, tools=["delete_record"])
            handle = await s.runs.spawn(spec)
            s.mcp.gate.clear()  # the delete, once begun, waits at the server
            await until(lambda: _pending(s, handle), "the delete asks for approval", polls=600)
            await s.runs.approve(handle, True)
            await until(lambda: s.mcp.started, "the delete reached the server", polls=600)
            worker.kill()
            s.mcp.gate.set()  # it completes at the server; nobody hears the answer
            worker.start()
            (status,) = await s.runs.wait([handle], timeout=120)
            transcript = await s.runs.transcript(handle)  # a query: with a worker up
        finally:
            s.mcp.gate.set()
            code = worker.stop(30)
        assert code == 0, (tmp_path / "worker.log").read_text()[-3000:]
        assert status.state == "Completed"
        assert (status.usage.tool_calls, status.usage.failed_tool_calls) == (1, 1)
        assert s.mcp.resent() == [] and sum(s.mcp.received.values()) == 1, s.mcp.received
        assert sum(s.mcp.counts.values()) == 1
        (told,) = [m for m in transcript if m["role"] == "tool"]
        assert told["content"].startswith("Error: the outcome of this call is unknown"), told
        assert "tool 'delete_record' read-only or idempotent" in told["content"]


def _worker_process(s: Stack, temporal_address: str, tmp_path: Path) -> Child:
    """`luftpause worker` for the stack, as a process started (kill it by its PID)."""
    config = worker_config(
        tmp_path / "luftpause.toml",
        temporal=temporal_address,
        queue=s.task_queue,
        gateway_url=s.gateway_url,
        mcp_url=f"{s.mcp_url}/mcp",
    )
    worker = worker_process(config, tmp_path / "worker.log")
    worker.start()
    return worker


async def _pending(s: Stack, handle: str) -> bool:
    return (await s.runs.status(handle)).pending_approval is not None


async def test_dev_server_and_gateway_restarted_mid_run(tmp_path: Path) -> None:
    server = DevServer(db_file=tmp_path / "temporal.db", log_file=tmp_path / "temporal.log")
    server.start()
    try:
        async with contextlib.AsyncExitStack() as stack_:
            fakes = await start_fakes(stack_, mcp_time_scale=2)
            urls, mcp_url, mcp_state = fakes.engines, fakes.mcp_url, fakes.mcp
            gateway = contextlib.AsyncExitStack()
            gateway_url = await gateway.enter_async_context(serve(gateway_app(urls)))
            port = int(gateway_url.rsplit(":", 1)[1])
            client = await connect(server.address)
            queue = f"test-{uuid.uuid4().hex[:12]}"
            await stack_.enter_async_context(
                run_worker(client, queue, gateway_url, f"{mcp_url}/mcp")
            )
            runs = Runs(client, task_queue=queue)
            handles = [await runs.spawn(spec) for spec in specs("restart")]

            # The dev server dies and comes back on the same port and db file.
            await until(lambda: sum(mcp_state.counts.values()) >= 5, "calls completed")
            server.kill()
            server.start()

            # The gateway goes away; turns fail and are retried until it is back.
            await until(lambda: sum(mcp_state.counts.values()) >= 12, "more calls", polls=900)
            await gateway.aclose()
            assert sum(mcp_state.counts.values()) < RUNS * 3
            async with serve(gateway_app(urls), port=port):
                statuses = await Runs(await connect(server.address), task_queue=queue).wait(
                    handles, timeout=180
                )
            assert [st.state for st in statuses] == ["Completed"] * RUNS
            assert all(st.usage.tool_calls == 3 for st in statuses)
            assert mcp_state.repeated() == []
    finally:
        server.stop()


async def test_a_worker_started_before_temporal_waits_for_it(tmp_path: Path) -> None:
    # compose, k8s and a restarted dev server can bring Temporal up after the worker.
    from luftpause.temporal_dev import free_port

    port = free_port()
    config = worker_config(
        tmp_path / "luftpause.toml",
        temporal=f"127.0.0.1:{port}",
        queue="early-worker",
        gateway_url="http://127.0.0.1:9",
        mcp_url="http://127.0.0.1:9/mcp",
    )
    log = tmp_path / "worker.log"
    worker = worker_process(config, log)
    server = DevServer(port=port, log_file=tmp_path / "temporal.log")
    worker.start()
    try:
        await until(lambda: "is not answering yet" in log.read_text(), "the worker waits")
        assert worker.alive()
        server.start()
        await until(lambda: "worker on task queue" in log.read_text(), "the worker connected")
        assert worker.stop() == 0
    finally:
        worker.kill()
        server.stop()


async def test_a_call_its_server_never_got_is_sent_once_the_server_is_back(
    temporal_address: str, tmp_path: Path
) -> None:
    # The tool server dies between calls.  An approved delete_record (not repeatable)
    # cannot have reached it (the connection is refused): it is sent again, with
    # backoff, once the server is back, and runs once; the model sees its answer.
    server = FakeMcpProcess(tmp_path, time_scale=100)
    server.start()
    try:
        async with stack(temporal_address, worker=False) as s:
            mcp_url = f"http://127.0.0.1:{server.port}/mcp"
            async with run_worker(s.client, s.task_queue, s.gateway_url, mcp_url):
                spec = RunSpec(task=task_with(1, "back"), model=MODEL, tools=["delete_record"])
                handle = await s.runs.spawn(spec)
                await until(lambda: _pending(s, handle), "the delete asks for approval")
                server.child.kill()
                await s.runs.approve(handle, True)
                await until(lambda: _failed_attempts(s, handle), "an attempt that found no server")
                server.start()
                (status,) = await s.runs.wait([handle], timeout=60)
                transcript = await s.runs.transcript(handle)
        assert status.state == "Completed"
        assert (status.usage.tool_calls, status.usage.failed_tool_calls) == (1, 0)
        assert [r["count"] for r in server.counts()["completed"]] == [1]
        (told,) = [m for m in transcript if m["role"] == "tool"]
        assert told["content"].startswith("deleted "), told
    finally:
        server.child.kill()


async def _failed_attempts(s: Stack, handle: str) -> int:
    """Tool-call attempts of the run that failed as never sent (its history)."""
    n = 0
    async for event in s.client.get_workflow_handle(handle).fetch_history_events():
        failure = event.activity_task_failed_event_attributes.failure
        if failure.application_failure_info.type == NOT_SENT:
            n += 1
    return n


async def test_a_run_that_ends_while_the_gateway_is_down_ends_as_it_was_ending(
    temporal_address: str,
) -> None:
    # The report of a run's end to the gateway (a local activity, three attempts) failed
    # bare, and the run ended Failed with "All connection attempts failed": its cancel
    # was lost from its history, and with no worker up `status` said Failed (helper-75).
    async with contextlib.AsyncExitStack() as stack_:
        fakes = await start_fakes(stack_)
        gateway = contextlib.AsyncExitStack()
        gateway_url = await gateway.enter_async_context(serve(gateway_app(fakes.engines)))
        client = await connect(temporal_address)
        queue = f"test-{uuid.uuid4().hex[:12]}"
        await stack_.enter_async_context(
            run_worker(client, queue, gateway_url, f"{fakes.mcp_url}/mcp")
        )
        runs = Runs(client, task_queue=queue)
        spec = RunSpec(task=task_with(1, "end"), model=MODEL, tools=["delete_record"])
        handle = await runs.spawn(spec)
        await until(lambda: _state(runs, handle, "AwaitingApproval"), "the run waits", polls=600)
        await gateway.aclose()
        await runs.cancel(handle)
        described = await until(lambda: _closed(client, handle), "the run closed", polls=600)
        assert described.status == WorkflowExecutionStatus.CANCELED
        status = await runs.status(handle)
        assert status.state == "Cancelled" and status.error == "cancelled", status


async def _state(runs: Runs, handle: str, state: str) -> bool:
    return (await runs.status(handle)).state == state


async def _closed(client: Client, handle: str) -> WorkflowExecutionDescription | None:
    described = await client.get_workflow_handle(handle).describe()
    return described if described.close_time is not None else None
