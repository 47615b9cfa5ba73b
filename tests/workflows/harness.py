"""The real stack for runtime tests: a Temporal dev server, the gateway with two fake
engines, the fake MCP tool server and a worker — all on loopback, in this process
except the dev server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from temporalio.client import Client
from temporalio.service import RPCError
from temporalio.worker import Replayer, Worker

from activities import LlmActivities, ToolActivities
from activities.mcp_pool import McpPool
from activities.tools import check_arguments
from gateway._server import BoundedHead
from gateway._shell import AdmissionShell
from gateway.app import GatewaySettings, create_app
from luftpause.config import McpServer, parse_config
from luftpause.temporal_dev import DevServer, free_port
from luftpause.up import Child, wait_http
from testkit._fake_text import DEFAULT_MAX_TOOL_CALLS, directives, key
from testkit.fake_engine import FakeEngineSettings
from testkit.fake_engine import create_app as create_engine
from testkit.fake_mcp import FakeMcpSettings, FakeMcpState
from testkit.fake_mcp import create_app as create_mcp
from testkit.loopback import serve
from worker.main import build_worker, gateway_client
from workflows import AgentRun, Runs, RunSpec
from workflows.contract import ChildRequest, RunStatus
from workflows.runs import new_handle

MODEL = "llama-3.2-1b"
# Fake engines and tools run 50x faster than real time: a 256-token turn takes ~0.1 s.
TIME_SCALE = 50.0


def calls_of(task: str, max_tool_calls: int = DEFAULT_MAX_TOOL_CALLS, seed: int = 0) -> int:
    """How many tool calls the fake engine makes for a run with this task."""
    return key(seed, "tool-calls", directives(task)[0]) % (max_tool_calls + 1)


def task_with(
    calls: int, prefix: str = "task", max_tool_calls: int = DEFAULT_MAX_TOOL_CALLS
) -> str:
    """A task whose run makes exactly `calls` tool calls on the fake engine."""
    for i in range(10_000):
        task = f"{prefix} {uuid.uuid4().hex[:6]} {i}"
        if calls_of(task, max_tool_calls) == calls:
            return task
    raise AssertionError(f"no task with {calls} calls")


async def connect(address: str) -> Client:
    """A Temporal client; the dev server may need a moment after its port opens."""
    last: Exception | None = None
    for _ in range(100):
        try:
            return await Client.connect(address)
        except (RPCError, RuntimeError) as exc:
            last = exc
            await asyncio.sleep(0.1)
    raise AssertionError(f"temporal at {address} never answered: {last}")


@dataclass
class Stack:
    runs: Runs
    client: Client
    task_queue: str
    mcp: FakeMcpState
    shell: AdmissionShell
    gateway_url: str
    mcp_url: str
    drain: Callable[[], None]  # what the gateway does as it begins to stop (SIGTERM)

    @property
    def mcp_door(self) -> str:
        """The gateway's MCP endpoint."""
        return f"{self.gateway_url}/mcp"


@dataclass
class Fakes:
    engines: list[str]  # two fake engines' base URLs
    mcp_url: str  # the fake MCP server's base URL (its endpoint is {mcp_url}/mcp)
    mcp: FakeMcpState


async def start_fakes(
    es: contextlib.AsyncExitStack,
    *,
    engine: dict[str, Any] | None = None,
    mcp_time_scale: float = TIME_SCALE,
) -> Fakes:
    """Two fake engines and the fake MCP server on loopback, stopped with `es`."""
    engine_kw = {"time_scale": TIME_SCALE, **(engine or {})}
    mcp_state = FakeMcpState()
    urls = [
        await es.enter_async_context(serve(create_engine(FakeEngineSettings(**engine_kw))))
        for _ in range(2)
    ]
    mcp_url = await es.enter_async_context(
        serve(create_mcp(FakeMcpSettings(time_scale=mcp_time_scale), mcp_state))
    )
    return Fakes(urls, mcp_url, mcp_state)


@contextlib.contextmanager
def dev_server_with(tmp_path: Path, setting: str) -> Iterator[DevServer]:
    """A dev server of its own with one dynamic config `setting` ("key=value")."""
    server = DevServer(
        log_file=tmp_path / "temporal.log", extra_args=("--dynamic-config-value", setting)
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


@contextlib.asynccontextmanager
async def stack(
    temporal_address: str,
    *,
    engine: dict[str, Any] | None = None,
    mcp_time_scale: float = TIME_SCALE,
    worker: bool = True,
    token: str | None = None,
    callers: list[dict[str, str]] | None = None,
    mcp_servers: Sequence[McpServer] = (),
    tool_timeout_s: float = 300.0,
    mcp: dict[str, Any] | None = None,
) -> AsyncIterator[Stack]:
    """Gateway + two fake engines + fake MCP + (optionally) a worker on a fresh task queue;
    `tool_timeout_s` is the worker's for the fake MCP server's tools; `mcp` the gateway's
    `[mcp]` table."""
    async with contextlib.AsyncExitStack() as stack_:
        fakes = await start_fakes(stack_, engine=engine, mcp_time_scale=mcp_time_scale)
        urls, mcp_url, mcp_state = fakes.engines, fakes.mcp_url, fakes.mcp
        queue = f"test-{uuid.uuid4().hex[:12]}"
        app = gateway_app(
            urls,
            temporal=temporal_address,
            queue=queue,
            mcp_url=f"{mcp_url}/mcp",
            token=token,
            callers=callers,
            mcp_servers=mcp_servers,
            mcp=mcp,
        )
        gateway_url = await stack_.enter_async_context(serve(app, http=BoundedHead))
        client = await connect(temporal_address)
        if worker:
            await stack_.enter_async_context(
                run_worker(
                    client,
                    queue,
                    gateway_url,
                    f"{mcp_url}/mcp",
                    token=token,
                    more=mcp_servers,
                    tool_timeout_s=tool_timeout_s,
                )
            )
        yield Stack(
            runs=Runs(client, task_queue=queue),
            client=client,
            task_queue=queue,
            mcp=mcp_state,
            shell=app.state.shell,
            gateway_url=gateway_url,
            mcp_url=mcp_url,
            drain=app.state.drain,
        )


@contextlib.asynccontextmanager
async def run_worker(
    client: Client,
    queue: str,
    gateway_url: str,
    mcp_url: str,
    *,
    token: str | None = None,
    more: Sequence[McpServer] = (),
    tool_timeout_s: float = 300.0,
) -> AsyncIterator[None]:
    """A worker whose tools are the fake MCP server's (`fake`), and `more` servers'."""
    pool = McpPool([McpServer(name="fake", url=mcp_url, tool_timeout_s=tool_timeout_s), *more])
    async with gateway_client() as http:  # the worker's own
        llm = LlmActivities(http, base_url=gateway_url, token=token, heartbeat_every_s=0.5)
        worker = build_worker(
            client, task_queue=queue, llm=llm, tools=ToolActivities(pool, heartbeat_every_s=0.5)
        )
        async with worker:
            yield
        await pool.aclose()


async def replays_with(client: Client, handle: str, patch: str) -> None:
    """The run's history has `patch`'s marker, and replays on this code."""
    history = await client.get_workflow_handle(handle).fetch_history()
    markers = [e for e in history.events if e.HasField("marker_recorded_event_attributes")]
    assert any(patch.encode() in e.SerializeToString() for e in markers)
    result = await Replayer(workflows=[AgentRun]).replay_workflow(
        history, raise_on_replay_failure=False
    )
    assert result.replay_failure is None, result.replay_failure


async def until(
    pred: Callable[[], Any], what: str, *, polls: int = 300, every: float = 0.05
) -> Any:
    """Poll an async or sync predicate, bounded (default 15 s)."""
    for _ in range(polls):
        value = pred()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        await asyncio.sleep(every)
    raise AssertionError(f"never happened: {what}")


async def state_is(s: Stack, handle: str, state: str) -> bool:
    return (await s.runs.status(handle)).state == state


async def spawn_waiting(s: Stack, prefix: str, **spec: Any) -> str:
    """A run whose one tool call (delete_record) waits for approval; its handle, once it
    waits, so that it is running when children are added."""
    handle = await s.runs.spawn(
        RunSpec(task=task_with(1, prefix), model=MODEL, tools=["delete_record"], **spec)
    )
    await until(lambda: state_is(s, handle, "AwaitingApproval"), f"run {prefix!r} waits")
    return handle


async def spawned_as_it_closes(s: Stack) -> list[RunStatus]:
    """A parent that takes a spawn and a cancel in one workflow task (its worker is down
    while both reach the server; `s` runs none of its own): the spawn begins, the
    cancel closes the run, and the child's start completes only after the close has
    stopped the children the run had.  Returns the parent's and the child's statuses
    once both have ended."""
    mcp = f"{s.mcp_url}/mcp"
    async with run_worker(s.client, s.task_queue, s.gateway_url, mcp):
        parent = await spawn_waiting(s, "closing")
    handle = s.client.get_workflow_handle(parent)
    child = new_handle()
    spec = RunSpec(task=task_with(3, "late"), model=MODEL, tools=["lookup"])
    spawn = asyncio.create_task(
        handle.execute_update(AgentRun.spawn_child, ChildRequest(child, spec))
    )

    async def with_the_server() -> bool:  # the update waits for a workflow task
        return (await handle.describe()).raw_description.HasField("pending_workflow_task")

    await until(with_the_server, "the spawn reaching the server")
    await s.runs.request_cancel(parent)
    async with run_worker(s.client, s.task_queue, s.gateway_url, mcp):
        # Taken before the cancel, which it is in the same task with: not refused.
        assert await spawn == child
        return await s.runs.wait([parent, child], timeout=60)


def gateway_app(
    engine_urls: list[str],
    *,
    temporal: str | None = None,
    queue: str | None = None,
    mcp_url: str | None = None,
    token: str | None = None,
    callers: list[dict[str, str]] | None = None,  # [[callers]]: name, token_env
    mcp_servers: Sequence[McpServer] = (),
    namespace: str | None = None,
    mcp: dict[str, Any] | None = None,  # the [mcp] table: the door's settings
) -> Any:
    """A gateway over these engines (the first also serves /classify), with its MCP
    door on `temporal`/`queue` (and `namespace`, if not the default) and the fake MCP's
    tools when given."""
    endpoints: list[dict[str, Any]] = [
        {"name": f"engine-{i}", "url": u, "kind": "sglang", "models": [MODEL]}
        for i, u in enumerate(engine_urls)
    ]
    endpoints.append(
        {"name": "classifier", "url": engine_urls[0], "kind": "classifier", "models": [MODEL]}
    )
    data: dict[str, Any] = {"endpoints": endpoints}
    if temporal is not None:
        data["temporal"] = {"address": temporal, "task_queue": queue or "luftpause"}
        if namespace is not None:
            data["temporal"]["namespace"] = namespace
    if mcp_url is not None:
        more = [m.model_dump(exclude_defaults=True) for m in mcp_servers]
        data["mcp_servers"] = [{"name": "fake", "url": mcp_url}, *more]
    if callers:
        data |= {"callers": callers, "token": token}
    if mcp is not None:
        data["mcp"] = mcp
    return create_app(GatewaySettings(config=parse_config(data), probe_period=0.05, token=token))


def worker_config(path: Path, *, temporal: str, queue: str, gateway_url: str, mcp_url: str) -> Path:
    """A luftpause.toml for a worker process."""
    path.write_text(
        f'gateway_url = "{gateway_url}"\n'
        "[[endpoints]]\n"
        f'name = "gateway"\nurl = "{gateway_url}"\nkind = "openai"\nmodels = ["{MODEL}"]\n'
        "[[mcp_servers]]\n"
        f'name = "fake"\nurl = "{mcp_url}"\n'
        "[temporal]\n"
        f'address = "{temporal}"\ntask_queue = "{queue}"\n',
        encoding="utf-8",
    )
    return path


def worker_process(config: Path, log: Path) -> Child:
    """`luftpause worker` as a subprocess (start, stop or kill it by its PID)."""
    exe = str(Path(sys.executable).parent / "luftpause")
    return Child("worker", [exe, "worker", "--config", str(config)], log)


class FakeMcpProcess:
    """`luftpause fake-mcp` as a process on one port: killed (SIGKILL, by PID) and
    started again there, as a tool server that crashes and comes back."""

    def __init__(self, tmp: Path, time_scale: float) -> None:
        self.port = free_port()
        exe = str(Path(sys.executable).parent / "luftpause")
        argv = [exe, "fake-mcp", "--port", str(self.port), "--time-scale", str(time_scale)]
        self.child = Child("fake-mcp", argv, tmp / "fake-mcp.log")

    def start(self) -> None:
        self.child.start()
        wait_http(f"http://127.0.0.1:{self.port}/counts", "the fake MCP server", self.child)

    def counts(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/counts", timeout=10) as r:
            return dict(json.load(r))


@contextlib.asynccontextmanager
async def stand_in_worker(client: Client, queue: str, fakes: Any) -> AsyncIterator[None]:
    """A worker of AgentRun whose activities are stand-ins registered under the real
    names: `fakes` has list_tools, end_run, llm_turn and call_tool (tests that must make
    a turn fail, a call hang or a server unreachable on cue), and check_arguments if it
    is not the real one."""
    check = getattr(fakes, "check_arguments", check_arguments)
    activities = [fakes.list_tools, fakes.end_run, fakes.llm_turn, fakes.call_tool, check]
    async with Worker(client, task_queue=queue, workflows=[AgentRun], activities=activities):
        yield
