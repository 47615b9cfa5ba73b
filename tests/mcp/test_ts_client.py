"""The MCP door driven by an independent client: the official TypeScript SDK
(`@modelcontextprotocol/sdk`, pinned in tests/mcp/ts/package-lock.json) run by Node as
`tests/mcp/ts/client.mjs` against the real stack — list tools, spawn, await.

Node is required in CI (`.ci/run` installs it); on a developer machine without Node the
test skips and says why.  `node_modules` is installed once per session with `npm ci`."""

from __future__ import annotations

import asyncio
import fcntl
import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.children import communicate
from tests.system import missing_tool
from tests.workflows.harness import MODEL, stack, task_with

TS_DIR = Path(__file__).parent / "ts"
SDK = "@modelcontextprotocol/sdk"
NODE_MIN_MAJOR = 18  # the SDK's transport needs the global fetch
NPM_CI_TIMEOUT_S = 300.0
CLIENT_TIMEOUT_S = 120.0
AWAIT_TIMEOUT_S = 60.0
DOOR_TOOLS = {"spawn", "await", "run", "status", "answer", "cancel", "approve", "tools", "decide"}


@dataclass(frozen=True)
class Node:
    node: str
    version: str
    npm_ci_seconds: float | None  # None: node_modules was already in place


def _missing(what: str) -> None:
    """Skip on a developer machine; fail in CI, where nothing may be skipped."""
    message = f"{what}: the TypeScript SDK client test needs Node >= {NODE_MIN_MAJOR} and npm"
    missing_tool(message)


def _locked_sdk_version() -> str:
    lock = json.loads((TS_DIR / "package-lock.json").read_text(encoding="utf-8"))
    return str(lock["packages"][f"node_modules/{SDK}"]["version"])


def _installed_sdk_version() -> str | None:
    manifest = TS_DIR / "node_modules" / SDK / "package.json"
    try:
        return str(json.loads(manifest.read_text(encoding="utf-8"))["version"])
    except (OSError, ValueError, KeyError):
        return None


@pytest.fixture(scope="session")
def node() -> Iterator[Node]:
    """Node, with tests/mcp/ts/node_modules installed from the lockfile (`npm ci`, once,
    when missing or not the locked SDK version)."""
    exe = shutil.which("node")
    if exe is None:
        _missing("`node` is not on PATH")
    assert exe is not None
    version = subprocess.run(
        [exe, "--version"], capture_output=True, text=True, timeout=30, check=True
    ).stdout.strip()
    if int(version.lstrip("v").split(".")[0]) < NODE_MIN_MAJOR:
        _missing(f"node {version} is too old")
    npm_seconds: float | None = None
    # Other pytest processes may share this checkout: one `npm ci` at a time.
    with open(TS_DIR / "package-lock.json", "rb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if _installed_sdk_version() != _locked_sdk_version():
                npm = shutil.which("npm")
                if npm is None:
                    _missing("`npm` is not on PATH (needed once, to install node_modules)")
                assert npm is not None
                started = time.monotonic()
                # subprocess.run kills the child (by its PID) when the timeout expires.
                done = subprocess.run(
                    [npm, "ci", "--no-audit", "--no-fund"],
                    cwd=TS_DIR,
                    capture_output=True,
                    text=True,
                    timeout=NPM_CI_TIMEOUT_S,
                    check=False,
                )
                npm_seconds = time.monotonic() - started
                assert done.returncode == 0, f"npm ci failed:\n{done.stdout}\n{done.stderr}"
                assert _installed_sdk_version() == _locked_sdk_version(), done.stdout
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    yield Node(node=exe, version=version, npm_ci_seconds=npm_seconds)


async def run_client(node: Node, url: str, spawn_args: dict[str, Any]) -> dict[str, Any]:
    """`node client.mjs <url> <spawn args> <await timeout>`; its JSON report.  Bounded: the
    process is killed (by its PID) when it outlives CLIENT_TIMEOUT_S."""
    proc = await asyncio.create_subprocess_exec(
        node.node,
        "client.mjs",
        url,
        json.dumps(spawn_args),
        str(AWAIT_TIMEOUT_S),
        cwd=TS_DIR,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await communicate(proc, CLIENT_TIMEOUT_S)
    stderr = err.decode(errors="replace")
    assert proc.returncode == 0, f"client.mjs exited {proc.returncode}:\n{stderr}"
    lines = out.decode().strip().splitlines()
    assert len(lines) == 1, f"expected one JSON line on stdout, got:\n{out.decode()}\n{stderr}"
    report: dict[str, Any] = json.loads(lines[0])
    return report


async def test_typescript_sdk_client_lists_spawns_and_awaits(
    node: Node,  # first: without Node, skip (or fail) before starting Temporal
    temporal_address: str,
) -> None:
    task = task_with(2, "ts")
    async with stack(temporal_address) as s:
        started = time.monotonic()
        report = await run_client(
            node, s.mcp_door, {"task": task, "model": MODEL, "tools": ["lookup"]}
        )
        wall = time.monotonic() - started
        (status,) = await s.runs.statuses([report["spawn"]["handle"]])
        lookups = sum(n for (tool, _), n in s.mcp.counts.items() if tool == "lookup")
        other_calls = sum(n for (tool, _), n in s.mcp.counts.items() if tool != "lookup")
    print(
        f"\nTypeScript SDK client ({node.version}, npm ci "
        f"{'skipped' if node.npm_ci_seconds is None else f'{node.npm_ci_seconds:.1f} s'}): "
        f"{wall:.2f} s wall, protocol {report['protocolVersion']}, steps (ms) "
        f"{report['timingsMs']}"
    )

    # The session-based protocol: negotiated in the handshake, a session id, ended by DELETE.
    assert report["protocolVersion"] == "2025-11-25"
    assert report["sessionId"] and report["sessionTerminated"] is True
    assert report["server"]["name"] == "luftpause"
    # The door saw the session: its runs belong to the caller `mcp-session:<id>`.
    assert status.caller == f"mcp-session:{report['sessionId']}"

    # Tools, each with an output schema from its pydantic result model.
    assert set(report["tools"]) >= DOOR_TOOLS
    schemas = report["outputSchemas"]
    assert all(schemas[name] is not None for name in DOOR_TOOLS), schemas
    assert schemas["spawn"]["title"] == "SpawnResult"
    assert set(schemas["spawn"]["required"]) == {"handle", "state"}
    assert schemas["await"]["title"] == "AwaitResult"
    assert set(schemas["await"]["required"]) == {"runs", "done"}
    assert "RunView" in schemas["await"]["$defs"]  # the SDK resolved the $ref to validate
    assert "answerChars" in schemas["await"]["$defs"]["RunView"]["properties"]
    assert schemas["answer"]["title"] == "AnswerResult"
    assert set(schemas["answer"]["required"]) == {
        "handle",
        "text",
        "offset",
        "totalChars",
        "nextOffset",
    }

    # structuredContent (validated by the SDK against those schemas), mirrored as text.
    spawned = report["spawn"]
    assert spawned["state"] == "Running"
    assert spawned["handle"].startswith("run-")
    assert report["textMatches"] == {"spawn": True, "await": True}

    awaited = report["await"]
    assert awaited["done"] is True
    (run,) = awaited["runs"]
    assert run["handle"] == spawned["handle"]
    assert run["state"] == "Completed" and run["answer"], run
    assert (run["toolCalls"], run["failedToolCalls"]) == (2, 0), run
    # Null fields are left out (helper-230), and the SDK still validated the content.
    assert "error" not in run and "pendingApproval" not in run
    assert status.state == "Completed" and status.answer == run["answer"]
    assert status.task == task and status.model == MODEL
    assert (lookups, other_calls) == (2, 0)  # only the allowed tool, as often as reported
