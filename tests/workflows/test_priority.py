"""Interactive runs ahead of batch runs in Temporal's task queue (Task Queue Priority,
contract.run_priority), on a real dev server started as `luftpause up` starts it: its
task queues are written to one partition (priority holds within a partition: with
Temporal's default four, a small backlog comes out in any order).  Runs are started by
`Runs.spawn` and `spawn_child`, as luftpause starts them; the run's activities are
stand-ins registered under the real names, and a worker with one slot shows the order
the server dispatches a backlog in."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.common import Priority
from temporalio.worker import Worker

from activities.contract import (
    EndRunInput,
    ToolInfo,
    ToolInput,
    ToolOutput,
    ToolsWanted,
    TurnInput,
    TurnOutput,
)
from luftpause.temporal_dev import ORDER_FLAGS, DevServer
from tests.workflows.harness import connect, stand_in_worker, until
from workflows import AgentRun, Runs, RunSpec
from workflows.contract import FAIRNESS_KEY_MAX_BYTES, fairness_key, run_priority

FAIRNESS = ("--dynamic-config-value", "matching.enableFairness=true")
# One read partition as well as the one written: the batch runs' order exact, so that
# fairness off would have the last caller's run last.
ONE_READ_PARTITION = ("--dynamic-config-value", "matching.numTaskqueueReadPartitions=1")


@contextlib.contextmanager
def _server(tmp: Path, extra: tuple[str, ...]) -> Iterator[str]:
    server = DevServer(log_file=tmp / "temporal.log", extra_args=extra)
    server.start()
    try:
        yield server.address
    finally:
        server.stop()


class StandIns:
    """list_tools notes which run called it, and the priority it was dispatched with;
    a turn runs until cancelled (a parent that stays running)."""

    def __init__(self, expected: int = 0) -> None:
        self.listed: list[tuple[str, Priority]] = []
        self.all_listed = asyncio.Event()
        self.expected = expected

    @activity.defn(name="list_tools")
    async def list_tools(self, wanted: ToolsWanted | None = None) -> list[ToolInfo]:
        info = activity.info()
        self.listed.append((info.workflow_id or "", info.priority))
        if len(self.listed) == self.expected:
            self.all_listed.set()
        return []

    @activity.defn(name="end_run")
    async def end_run(self, end: EndRunInput) -> None:
        pass

    @activity.defn(name="call_tool")
    async def call_tool(self, call: ToolInput) -> ToolOutput:
        return ToolOutput("ok", False, True)

    @activity.defn(name="llm_turn")
    async def llm_turn(self, turn: TurnInput) -> TurnOutput:
        while True:  # until cancelled
            activity.heartbeat()
            await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def workflow_worker(client: Client, queue: str, **slots: Any) -> AsyncIterator[None]:
    """A worker of AgentRun that runs no activities: they stay in the queue."""
    async with Worker(client, task_queue=queue, workflows=[AgentRun], **slots):
        yield


async def _listing(client: Client, handles: list[str]) -> bool:
    """Whether every run's list_tools is scheduled (its first workflow task is done)."""
    for handle in handles:
        described = await client.get_workflow_handle(handle).describe()
        if not described.raw_description.pending_activities:
            return False
    return True


async def _first_task_started(client: Client, handle: str) -> float:
    """When the run's first workflow task was dispatched (the server's clock)."""
    async for event in client.get_workflow_handle(handle).fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED:
            return event.event_time.ToDatetime().timestamp()
    raise AssertionError(f"run {handle} has no workflow task started")


def _spec(service_class: str, caller: str) -> RunSpec:
    return RunSpec(task=f"{caller} run", model="m", service_class=service_class, caller=caller)


async def _dispatch_order(address: str, specs: list[RunSpec]) -> list[int]:
    """Start these runs, in order, with no worker polling, then one worker that takes
    one workflow task at a time: the runs (their indexes in `specs`), in the order their
    first workflow tasks were dispatched."""
    client = await connect(address)
    queue = f"priority-{uuid.uuid4().hex[:8]}"
    runs = Runs(client, task_queue=queue)
    handles = [await runs.spawn(spec) for spec in specs]
    async with workflow_worker(client, queue, max_concurrent_workflow_tasks=1):
        await until(lambda: _listing(client, handles), "every run's first workflow task")
    # One slot: each task was dispatched after the one before had completed.
    started = [await _first_task_started(client, h) for h in handles]
    return sorted(range(len(specs)), key=started.__getitem__)


def test_a_run_s_priority_is_its_class_s_and_its_fairness_key_its_caller() -> None:
    assert run_priority(_spec("interactive", "ada")) == Priority(2, "ada")
    assert run_priority(_spec("batch", "ada")) == Priority(4, "ada")
    # As the gateway reads the class: blank is interactive, case and spaces do not count.
    assert run_priority(_spec("", "ada")).priority_key == 2
    assert run_priority(_spec(" Batch ", "ada")).priority_key == 4
    # A class the gateway refuses: Temporal's default (a child: its parent's).
    assert run_priority(_spec("bulk", "ada")).priority_key is None
    assert run_priority(RunSpec(task="t", model="m")).fairness_key == "anonymous"


def test_a_long_caller_is_shortened_to_a_fairness_key_the_same_each_time() -> None:
    fits = "c" * FAIRNESS_KEY_MAX_BYTES
    assert fairness_key(fits) == fits
    long_a, long_b = "team-" + "x" * 80 + "a", "team-" + "x" * 80 + "b"
    key_a = fairness_key(long_a)
    assert len(key_a.encode()) <= FAIRNESS_KEY_MAX_BYTES
    assert key_a.startswith("team-xxx")
    assert key_a == fairness_key(long_a)  # a digest, not Python's salted hash
    assert key_a != fairness_key(long_b)  # the same start, two callers, two keys
    wide = "ü" * 40  # 80 bytes: not cut inside a character
    key = fairness_key(wide)
    assert len(key.encode()) <= FAIRNESS_KEY_MAX_BYTES
    assert key.split("~")[0] == "ü" * 23


def test_every_dev_server_writes_each_task_queue_to_one_partition(tmp_path: Path) -> None:
    # luftpause up's (a db file, a namespace) and the tests' alike.  (The order test
    # below fails without it only most of the time: in 2 of 2 runs.)
    up = DevServer(db_file=tmp_path / "t.db", extra_args=("--namespace", "x"))
    for server in (DevServer(), up):
        cmd = server.command()
        at = cmd.index(ORDER_FLAGS[1])
        assert tuple(cmd[at - 1 : at + 1]) == ORDER_FLAGS


async def test_an_interactive_run_s_workflow_task_goes_before_a_batch_backlog(
    temporal_address: str,
) -> None:
    # The interactive run came last and goes first.  (The batch runs go in about the
    # order they came: exactly with one read partition too, but the dev server keeps
    # its four, and a poll forwarded from another partition can take the second
    # before the first; fairness is off, its default.)
    specs = [_spec("batch", c) for c in ("a1", "a1", "b2", "a1")]
    order = await _dispatch_order(temporal_address, [*specs, _spec("interactive", "c3")])
    assert order[0] == 4, order


async def test_a_run_s_activities_go_with_its_priority(temporal_address: str) -> None:
    client = await connect(temporal_address)
    queue = f"priority-{uuid.uuid4().hex[:8]}"
    runs = Runs(client, task_queue=queue)
    # The batch runs' activities reach the queue first, the interactive run's last.
    async with workflow_worker(client, queue):
        batch = [await runs.spawn(_spec("batch", "a1")) for _ in range(4)]
        await until(lambda: _listing(client, batch), "the batch runs' list_tools")
        interactive = await runs.spawn(_spec("interactive", "c3"))
        await until(lambda: _listing(client, [interactive]), "the interactive run's list_tools")
    fakes = StandIns(expected=5)
    activities: list[Any] = [fakes.list_tools, fakes.end_run, fakes.llm_turn, fakes.call_tool]
    async with Worker(client, task_queue=queue, activities=activities, max_concurrent_activities=1):
        await asyncio.wait_for(fakes.all_listed.wait(), 30)
    first, priority = fakes.listed[0]
    assert (first, priority.priority_key) == (interactive, 2)  # inherited from its run
    assert [p.priority_key for _, p in fakes.listed[1:]] == [4] * 4
    # (The batch runs' in the order their runs scheduled them, which a worker of many
    # slots chose.)
    assert sorted(h for h, _ in fakes.listed[1:]) == sorted(batch)


async def test_fairness_on_shares_a_priority_among_callers(tmp_path: Path) -> None:
    # Where an operator turns fairness on, one caller's backlog does not hold another
    # caller's run of the same class behind it.
    with _server(tmp_path, FAIRNESS + ONE_READ_PARTITION) as address:
        specs = [_spec("batch", c) for c in ("a1", "a1", "a1", "b2")]
        order = await _dispatch_order(address, specs)
    assert order.index(3) < 3, order  # FIFO (fairness off) has it last


async def test_a_child_takes_its_own_class_s_priority_and_its_parent_s_caller(
    temporal_address: str,
) -> None:
    client = await connect(temporal_address)
    queue = f"priority-{uuid.uuid4().hex[:8]}"
    runs = Runs(client, task_queue=queue)
    fakes = StandIns()
    async with stand_in_worker(client, queue, fakes):
        await until(runs._worker_polls, "the worker polls")
        parent = await runs.spawn(_spec("batch", "ops"))
        child = await runs.spawn(RunSpec(task="look", model="m", parent=parent))
        batch_child = await runs.spawn(
            RunSpec(task="sweep", model="m", parent=parent, service_class="batch")
        )
        await runs.request_cancel(parent)
        await runs.wait([parent, child, batch_child], timeout=30)

    async def priority(handle: str) -> Any:
        described = await client.get_workflow_handle(handle).describe()
        return described.raw_description.workflow_execution_info.priority

    assert (await priority(parent)).priority_key == 4
    # Not its parent's 4, which a child is given unless its start names another.
    assert (await priority(child)).priority_key == 2
    assert (await priority(child)).fairness_key == "ops"
    assert (await priority(batch_child)).priority_key == 4


async def test_a_run_of_a_caller_past_64_bytes_starts(temporal_address: str) -> None:
    # Temporal refuses a start whose fairness key is longer ("fairness key length
    # exceeds limit").
    client = await connect(temporal_address)
    runs = Runs(client, task_queue=f"priority-{uuid.uuid4().hex[:8]}")
    caller = "team-" + "x" * 200
    handle = await runs.spawn(_spec("batch", caller))
    described = await client.get_workflow_handle(handle).describe()
    priority = described.raw_description.workflow_execution_info.priority
    assert (priority.priority_key, priority.fairness_key) == (4, fairness_key(caller))
    assert described.search_attributes["LuftpauseCaller"] == [caller]  # whole here
    await client.get_workflow_handle(handle).terminate("the test is done")
