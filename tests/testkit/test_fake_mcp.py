"""Tests for testkit.fake_mcp: the official MCP client over real loopback HTTP in both
protocol generations, in-process calls for timing and cancellation, and the CLI as a
stdio and an HTTP subprocess."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from mcp import Client, StdioServerParameters
from mcp.types import CallToolResult, TextContent

import testkit.fake_mcp as fake_mcp_module
from luftpause.cli import main as cli_main
from testkit.fake_mcp import (
    FakeMcpSettings,
    FakeMcpState,
    add_arguments,
    create_app,
    create_server,
    run,
)
from testkit.loopback import serve

ROOT = Path(__file__).resolve().parents[2]
MODES = ["legacy", "2026-07-28"]
FAST = FakeMcpSettings(time_scale=50)


@contextlib.asynccontextmanager
async def fake_mcp(
    settings: FakeMcpSettings = FAST, state: FakeMcpState | None = None
) -> AsyncIterator[tuple[str, FakeMcpState]]:
    """Serve the fake MCP app on a free loopback port; yield its base URL and state."""
    state = FakeMcpState() if state is None else state
    async with serve(create_app(settings, state)) as url:
        yield url, state


def text(result: CallToolResult) -> str:
    assert len(result.content) == 1 and isinstance(result.content[0], TextContent)
    return result.content[0].text


# --------------------------------------------------------------------------- over HTTP


@pytest.mark.parametrize("mode", MODES)
async def test_tools_are_listed_with_annotations_and_schemas(mode: str) -> None:
    async with fake_mcp() as (url, _), Client(f"{url}/mcp", mode=mode) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
    assert sorted(tools) == ["deep_search", "delete_record", "fail", "lookup"]
    for tool in tools.values():
        assert tool.description and tool.annotations is not None
        for prop in tool.input_schema["properties"].values():
            assert prop["description"]
    delete = tools["delete_record"].annotations
    assert delete is not None and delete.destructive_hint is True and not delete.read_only_hint
    for name in ("lookup", "deep_search", "fail"):
        ann = tools[name].annotations
        assert ann is not None and ann.read_only_hint is True
    lookup = tools["lookup"].input_schema
    assert lookup["required"] == ["query"]
    assert lookup["properties"]["query"]["type"] == "string"
    deep = tools["deep_search"].input_schema
    assert deep["required"] == ["query"]
    assert deep["properties"]["depth"] | {"description": ""} == {
        "type": "integer",
        "default": 2,
        "minimum": 1,
        "maximum": 5,
        "title": "Depth",
        "description": "",
    }
    assert tools["delete_record"].input_schema["required"] == ["record_id"]


@pytest.mark.parametrize("mode", MODES)
async def test_lookup_answers_and_counts_completed_calls(mode: str) -> None:
    async with fake_mcp() as (url, state), Client(f"{url}/mcp", mode=mode) as client:
        t0 = time.perf_counter()
        first = await client.call_tool("lookup", {"query": "tallest tree"})
        elapsed = time.perf_counter() - t0
        again = await client.call_tool("lookup", {"query": "tallest tree"})
        other = await client.call_tool("lookup", {"query": "oldest river"})
    assert not first.is_error and "tallest tree" in text(first)
    assert text(again) == text(first)  # deterministic: the seed and the query decide
    assert "oldest river" in text(other)
    assert elapsed >= 0.5 / FAST.time_scale  # it did wait, scaled
    assert state.completed("lookup", query="tallest tree") == 2
    assert state.completed("lookup", query="oldest river") == 1
    assert state.repeated() == [("lookup", '{"query":"tallest tree"}', 2)]
    assert state.started == state.counts


@pytest.mark.parametrize("mode", MODES)
async def test_fail_is_a_tool_error_and_not_completed(mode: str) -> None:
    async with fake_mcp() as (url, state), Client(f"{url}/mcp", mode=mode) as client:
        result = await client.call_tool("fail", {"reason": "disk on fire"})
        deleted = await client.call_tool("delete_record", {"record_id": "r-17"})
    assert result.is_error
    # The SDK prefixes a ToolError's message with "Error executing tool fail: ".
    assert text(result).endswith("fail: disk on fire")
    assert state.completed("fail", reason="disk on fire") == 0
    assert state.started[FakeMcpState.key("fail", {"reason": "disk on fire"})] == 1
    assert not deleted.is_error and text(deleted) == "deleted r-17"
    assert state.completed("delete_record", record_id="r-17") == 1


async def test_get_counts_reports_completed_and_started_calls() -> None:
    async with fake_mcp() as (url, _), Client(f"{url}/mcp", mode="2026-07-28") as client:
        await client.call_tool("deep_search", {"query": "q", "depth": 1})
        await client.call_tool("deep_search", {"query": "q", "depth": 1})
        await client.call_tool("deep_search", {"query": "r"})  # depth defaults to 2
        await client.call_tool("fail", {"reason": "x"})
        bad = await client.call_tool("deep_search", {"query": "q", "depth": 9})
        async with httpx.AsyncClient(base_url=url) as http:
            response = await http.get("/counts")
    assert bad.is_error  # rejected by the input schema: never started
    assert response.status_code == 200
    assert response.json() == {
        "completed": [
            {"tool": "deep_search", "arguments": {"depth": 1, "query": "q"}, "count": 2},
            {"tool": "deep_search", "arguments": {"depth": 2, "query": "r"}, "count": 1},
        ],
        "started": [
            {"tool": "deep_search", "arguments": {"depth": 1, "query": "q"}, "count": 2},
            {"tool": "deep_search", "arguments": {"depth": 2, "query": "r"}, "count": 1},
            {"tool": "fail", "arguments": {"reason": "x"}, "count": 1},
        ],
        # Every call that reached a tool (past its input schema), answered from the
        # memory of its idempotency key or not.
        "received": [
            {"tool": "deep_search", "arguments": {"depth": 1, "query": "q"}, "count": 2},
            {"tool": "deep_search", "arguments": {"depth": 2, "query": "r"}, "count": 1},
            {"tool": "fail", "arguments": {"reason": "x"}, "count": 1},
        ],
    }


# --------------------------------------------------------------------------- in process


async def test_durations_scale_and_answers_follow_the_seed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The durations the server asks to sleep, read where it asks (a stopwatch would
    # also time a loaded machine).
    asked: dict[str, float] = {}
    sleep = fake_mcp_module.anyio.sleep

    async def recorded(seconds: float) -> None:
        asked[asyncio.current_task().get_name()] = seconds  # type: ignore[union-attr]
        await sleep(0)

    monkeypatch.setattr(fake_mcp_module.anyio, "sleep", recorded)

    async def answer(settings: FakeMcpSettings, query: str) -> tuple[str, float]:
        server = create_server(settings, FakeMcpState())
        result = await server.call_tool("lookup", {"query": query})
        assert isinstance(result, CallToolResult)
        return text(result), asked[asyncio.current_task().get_name()]  # type: ignore[union-attr]

    async def answers(settings: FakeMcpSettings) -> list[tuple[str, float]]:
        return await asyncio.gather(*(answer(settings, f"q{i}") for i in range(6)))

    seed0, again, seed1 = await asyncio.gather(
        answers(FakeMcpSettings(time_scale=20)),
        answers(FakeMcpSettings(time_scale=20)),
        answers(FakeMcpSettings(time_scale=20, seed=1)),
    )
    assert seed0 == again  # the same answers after the same durations
    assert [a for a, _ in seed0] != [a for a, _ in seed1]
    assert [s for _, s in seed0] != [s for _, s in seed1]
    # Uniform 0.5–1.5 virtual seconds at 20x: 0.025–0.075 s, never the unscaled 0.5 s.
    assert all(0.025 <= s <= 0.075 for _, s in seed0 + again + seed1)


async def test_a_cancelled_call_is_started_but_not_completed() -> None:
    state = FakeMcpState()
    began = asyncio.Event()
    original = state.begin

    def begin(tool: str, arguments: Any) -> tuple[str, str]:
        key = original(tool, arguments)
        began.set()
        return key

    state.begin = begin  # type: ignore[method-assign]
    server = create_server(FakeMcpSettings(), state)  # real time: 2–4 s
    call = asyncio.create_task(server.call_tool("deep_search", {"query": "slow"}))
    await began.wait()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert state.started == {("deep_search", '{"depth":2,"query":"slow"}'): 1}
    assert state.counts == {}
    assert state.completed("deep_search", query="slow", depth=2) == 0


def test_settings_reject_a_non_positive_time_scale() -> None:
    with pytest.raises(ValueError, match="time_scale"):
        FakeMcpSettings(time_scale=0)


def test_http_without_a_port_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args([])) == 2
    assert "--port is required" in capsys.readouterr().err


# --------------------------------------------------------------------------- the CLI


async def test_the_help_names_every_tool_the_server_serves(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # helper-250: `fake-mcp --help` named lookup, deep_search and "a destructive tool",
    # not `fail`, which tests of failed calls use.
    with pytest.raises(SystemExit) as done:
        cli_main(["fake-mcp", "--help"])
    assert done.value.code == 0
    # (Without the spaces argparse wraps lines at, within "read-only" too.)
    said = "".join(capsys.readouterr().out.split())
    async with fake_mcp() as (url, _), Client(f"{url}/mcp") as client:
        tools = (await client.list_tools()).tools
    assert len(tools) == 4
    for tool in tools:
        annotations = tool.annotations
        assert annotations is not None
        kind = "destructive" if annotations.destructive_hint else "read-only"
        assert f"{tool.name}({kind})" in said, (tool.name, said)


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "luftpause", "fake-mcp", *args]


@pytest.mark.parametrize("mode", MODES)
async def test_stdio_subprocess_serves_tools_and_writes_the_counts_file(
    mode: str, tmp_path: Path
) -> None:
    counts_file = tmp_path / "counts.json"
    command, *args = cli("--transport", "stdio", "--time-scale", "50")
    args += ["--counts-file", str(counts_file)]
    params = StdioServerParameters(
        command=command, args=args, env={"PYTHONPATH": str(ROOT)}, cwd=ROOT
    )
    async with Client(params, mode=mode) as client:
        names = {t.name for t in (await client.list_tools()).tools}
        result = await client.call_tool("lookup", {"query": "stdio"})
        await client.call_tool("lookup", {"query": "stdio"})
        # Written before the reply was sent: readable as soon as the call returns.
        counts = json.loads(counts_file.read_text(encoding="utf-8"))
    assert "delete_record" in names
    assert not result.is_error and "stdio" in text(result)
    row = {"tool": "lookup", "arguments": {"query": "stdio"}, "count": 2}
    assert counts == {"completed": [row], "started": [row], "received": [row]}
    assert [p.name for p in tmp_path.iterdir()] == ["counts.json"]  # no tmp file left


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_http_subprocess_serves_and_exits_cleanly_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    log = tmp_path / "stderr.log"
    with log.open("wb") as stderr:
        proc = subprocess.Popen(
            cli("--port", str(port), "--time-scale", "50", "--seed", "3"),
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            for _ in range(1000):  # bounded: ~10 s for the interpreter to start
                assert proc.poll() is None, log.read_text()
                try:
                    if (await http.get("/counts")).status_code == 200:
                        break
                except httpx.TransportError:
                    await asyncio.sleep(0.01)
            else:
                raise AssertionError(f"fake MCP subprocess did not come up:\n{log.read_text()}")
            async with Client(f"{url}/mcp", mode="legacy") as client:
                result = await client.call_tool("lookup", {"query": "sub"})
            counts = (await http.get("/counts")).json()
        assert "sub" in text(result)
        assert counts["completed"] == [
            {"tool": "lookup", "arguments": {"query": "sub"}, "count": 1}
        ]
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0, log.read_text()


async def test_an_idempotency_key_runs_a_call_once() -> None:
    from activities.contract import IDEMPOTENCY_META_KEY

    state = FakeMcpState()
    app = create_app(FakeMcpSettings(time_scale=20), state)
    async with serve(app) as url, Client(f"{url}/mcp", mode="2026-07-28") as c:
        meta: Any = {IDEMPOTENCY_META_KEY: "run-1/call_a"}
        first, again = await asyncio.gather(
            c.call_tool("lookup", {"query": "x"}, meta=meta),
            c.call_tool("lookup", {"query": "x"}, meta=meta),
        )
        third = await c.call_tool("lookup", {"query": "x"}, meta=meta)
        other = await c.call_tool(
            "lookup", {"query": "x"}, meta={IDEMPOTENCY_META_KEY: "run-1/call_b"}
        )
    assert text(first) == text(again) == text(third) == text(other)
    # Three calls with one key ran once (one waited for it, one was answered after);
    # another key is another call.
    assert state.completed("lookup", query="x") == 2
    assert state.replayed >= 1
