"""`[worker]` and `luftpause worker`'s flags reach temporalio's Worker: activity and
workflow-task slots, the workflow cache and the pollers."""

from __future__ import annotations

import argparse
import asyncio
import gc
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from temporalio.client import Client
from temporalio.worker import PollerBehaviorSimpleMaximum, Worker

import worker.main as worker_main
from activities import LlmActivities, ToolActivities
from activities.mcp_pool import McpPool
from luftpause.config import WorkerOptions, load_config
from testkit.loopback import serve
from worker.main import WORKER_FLAGS, add_arguments, build_worker, with_flags

CONFIG = '[[endpoints]]\nname = "e"\nurl = "http://127.0.0.1:9"\nkind = "sglang"\nmodels = ["m"]\n'


async def _built(address: str, options: WorkerOptions | None = None) -> dict[str, object]:
    """The configuration of a worker `build_worker` makes (as the SDK reports it)."""
    client = await Client.connect(address)
    async with httpx.AsyncClient() as http:
        llm = LlmActivities(http, base_url="http://127.0.0.1:9")
        tools = ToolActivities(McpPool([]))
        queue = f"sizing-{uuid.uuid4().hex[:8]}"
        if options is None:
            worker = build_worker(client, task_queue=queue, llm=llm, tools=tools)
        else:
            worker = build_worker(client, task_queue=queue, llm=llm, tools=tools, options=options)
        return dict(worker.config(active_config=True))


async def _connections_opened(http: httpx.AsyncClient, bound: int) -> int:
    """How many connections `http` opens to a loopback server for `bound` + 1 requests
    at once, when the server holds the first `bound` of them until all those came:
    `bound` when its pool is bounded there (the last request waits for one of them to
    be free, and goes out on it), more when the pool's bound is higher."""
    clients: list[tuple[str, int]] = []  # each request's connection (its client address)
    held, answer = asyncio.Event(), asyncio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        clients.append(scope["client"])
        if len(clients) == bound:
            held.set()
        await answer.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async with serve(app) as url:
        sent = asyncio.gather(*(http.get(f"{url}/{i}") for i in range(bound + 1)))
        try:
            await asyncio.wait_for(held.wait(), 30)  # a pool bounded below `bound`: never
        finally:
            answer.set()  # (on a timeout too: the server stops only once it answered)
            replies = await asyncio.wait_for(sent, 30)
        assert [r.status_code for r in replies] == [200] * (bound + 1)
    return len(set(clients))


async def test_the_worker_is_built_with_the_configured_slots_cache_and_pollers(
    temporal_address: str,
) -> None:
    options = WorkerOptions(
        max_concurrent_activities=16,
        max_concurrent_workflow_tasks=8,
        max_cached_workflows=4000,
        max_concurrent_workflow_task_polls=3,
        max_concurrent_activity_task_polls=12,
    )
    config = await _built(temporal_address, options)
    assert config["max_concurrent_activities"] == 16
    assert config["max_concurrent_workflow_tasks"] == 8
    assert config["max_cached_workflows"] == 4000
    assert config["workflow_task_poller_behavior"] == PollerBehaviorSimpleMaximum(maximum=3)
    assert config["activity_task_poller_behavior"] == PollerBehaviorSimpleMaximum(maximum=12)
    assert config.get("tuner") is None  # fixed counts (a tuner would exclude them)


async def test_without_a_worker_section_the_sdks_defaults_stand_but_1000_activities(
    temporal_address: str,
) -> None:
    config = await _built(temporal_address)
    assert config["max_concurrent_activities"] == 1000
    assert config.get("max_concurrent_workflow_tasks") is None  # the SDK's 100
    assert config["max_cached_workflows"] == 1000  # the SDK's default, passed on as it is
    assert config["workflow_task_poller_behavior"] == PollerBehaviorSimpleMaximum(maximum=5)
    assert config["activity_task_poller_behavior"] == PollerBehaviorSimpleMaximum(maximum=5)


async def test_the_worker_that_serve_runs_is_sized_by_the_files_worker_section(
    temporal_address: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What `luftpause worker` runs (serve), not build_worker alone: the file's
    # [worker] reaches the Worker, and its pool of connections to the gateway is sized
    # from the activity slots (a held turn keeps its slot and its connection).
    path = tmp_path / "luftpause.toml"
    path.write_text(
        CONFIG
        + f'[temporal]\naddress = "{temporal_address}"\n'
        + f'task_queue = "sizing-{uuid.uuid4().hex[:8]}"\n'
        + "[worker]\nmax_concurrent_activities = 7\nmax_cached_workflows = 3\n"
    )
    built: dict[str, Any] = {}
    ready = asyncio.Event()
    gateway_client = worker_main.gateway_client

    def spy(*args: Any, **kwargs: Any) -> Worker:
        built["worker"] = build_worker(*args, **kwargs)
        ready.set()
        return built["worker"]

    def client_spy(activities: int) -> httpx.AsyncClient:
        built["http"] = gateway_client(activities)
        return built["http"]

    monkeypatch.setattr(worker_main, "build_worker", spy)
    monkeypatch.setattr(worker_main, "gateway_client", client_spy)
    # serve freezes the heap for a process that serves until it ends; here it would keep
    # every object of this test process out of the collector's reach for the tests after.
    monkeypatch.setattr(worker_main, "freeze_heap", lambda: "heap not frozen (a test)")
    frozen = gc.get_freeze_count()
    stop = asyncio.Event()
    serving = asyncio.create_task(worker_main.serve(load_config(path, env={}), None, stop))
    try:
        await asyncio.wait_for(ready.wait(), 30)
        config = built["worker"].config(active_config=True)
        assert (config["max_concurrent_activities"], config["max_cached_workflows"]) == (7, 3)
        # serve's client for the gateway opens at most 7 + 24 connections: a request
        # beyond them waits for one (seen over loopback, not read from httpcore's pool).
        assert await _connections_opened(built["http"], 7 + 24) == 7 + 24
    finally:
        stop.set()
        await asyncio.wait_for(serving, 30)
    assert gc.get_freeze_count() == frozen


def test_the_flags_override_the_files_worker_section(tmp_path: Path) -> None:
    path = tmp_path / "luftpause.toml"
    path.write_text(
        CONFIG + "[worker]\nmax_concurrent_activities = 64\nmax_cached_workflows = 10\n"
    )
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(
        ["--max-concurrent-activities", "4", "--max-concurrent-workflow-task-polls", "2"]
    )
    worker = with_flags(load_config(path), args).worker
    assert worker.max_concurrent_activities == 4
    assert worker.max_concurrent_workflow_task_polls == 2
    assert worker.max_cached_workflows == 10  # no flag: the file's
    unchanged = with_flags(load_config(path), p.parse_args([])).worker
    assert unchanged.max_concurrent_activities == 64


def test_the_help_says_a_flag_overrides_the_files_worker_section(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # helper-239: "--max-concurrent-activities ... (default 1000)" read as the flag's
    # default, as if a worker run without it took 1000 over the file's value.
    p = argparse.ArgumentParser(prog="luftpause worker")
    add_arguments(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps its lines
    for key in WORKER_FLAGS:
        assert f"--{key.replace('_', '-')} N overrides the file's [worker] {key}: " in text
    assert "(default 1000)" not in text and "(if neither sets it: 1000)" in text


def test_a_bad_flag_value_is_refused_before_the_worker_connects(tmp_path: Path) -> None:
    path = tmp_path / "luftpause.toml"
    # Temporal at a port nothing listens on: a worker that got past the check would
    # retry for a minute, not exit at once.
    path.write_text(CONFIG + '[temporal]\naddress = "127.0.0.1:9"\n')
    out = subprocess.run(
        [sys.executable, "-m", "luftpause", "worker", "--config", str(path)]
        + ["--max-concurrent-activities", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip() == (
        "luftpause worker: worker.max_concurrent_activities (from "
        "--max-concurrent-activities): Input should be greater than or equal to 1"
    )
