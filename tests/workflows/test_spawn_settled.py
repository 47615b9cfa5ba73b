"""A spawn that Temporal turned away once (aborted: its update may have been taken all
the same) answers an error only with its request withdrawn, whatever ends it after
(helper-212); a spawn its caller cancels stops at once; and the gate of a parent's
spawns gives its permits back when holders and waiters are cancelled, and says so to
a spawn whose turn never came."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace
from typing import Any

import pytest
from temporalio.client import WorkflowUpdateFailedError, WorkflowUpdateRPCTimeoutOrCancelledError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

import workflows.runs as runs_module
from tests.workflows.test_spawn_retry import _ABORTED, _DEADLINE, _runs
from workflows import RunSpec, RunUnavailable, SpawnTurn
from workflows.agent_run import CHILDREN_STARTING


class _Then:
    """First send aborted by Temporal (but taken: the child starts); the second send
    fails with `then`; describe of the child raises `describe_error` or finds it."""

    def __init__(self, then: BaseException, describe_error: RPCError | None = None) -> None:
        self.then = then
        self.describe_error = describe_error
        self.sends = 0

    async def execute_update(self, update: Any, arg: Any, id: str | None = None) -> Any:
        self.sends += 1
        if self.sends == 1:
            raise _ABORTED
        raise self.then

    async def describe(self) -> Any:
        if self.describe_error is not None:
            raise self.describe_error
        return SimpleNamespace(parent_id="p")


async def test_unsure_then_other_rpc_error_child_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    # The aborted first send was taken (the child runs, describe finds it); the second
    # send meets a connection error: the spawn answers the child, nothing withdrawn.
    parent = _Then(RPCError("connection reset", RPCStatusCode.UNAVAILABLE, b""))
    withdrawn: list[str] = []
    runs = _runs(monkeypatch, parent, withdrawn=withdrawn)
    result = await runs.spawn(RunSpec(task="t", model="m", parent="p"), handle="run-x")
    assert (result, withdrawn) == ("run-x", [])


async def test_unsure_then_cut_short_child_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    # The aborted first send was taken (the child runs); Temporal cuts the sends after
    # it short (DEADLINE_EXCEEDED, the SDK's own error, no RPCError): the spawn answers
    # the child, nothing withdrawn (helper-218: the error went up as it was).
    parent = _Then(_DEADLINE)
    withdrawn: list[str] = []
    runs = _runs(monkeypatch, parent, withdrawn=withdrawn)
    result = await runs.spawn(RunSpec(task="t", model="m", parent="p"), handle="run-x")
    assert (result, withdrawn) == ("run-x", [])


async def test_unsure_then_refused_while_others_start_child_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The aborted first send was taken (the child runs); every send after it is refused
    # while other children start, until time is up: the spawn is still unsure, so it
    # answers the child it finds (helper-222: a send that turned no one away must not
    # make the spawn forget the first).
    starting = WorkflowUpdateFailedError(
        ApplicationError("run 'p' is starting 1 children", type=CHILDREN_STARTING)
    )
    parent = _Then(starting)
    withdrawn: list[str] = []
    runs = _runs(monkeypatch, parent, withdrawn=withdrawn)
    result = await runs.spawn(RunSpec(task="t", model="m", parent="p"), handle="run-x")
    assert (result, withdrawn) == ("run-x", []) and parent.sends >= 3, parent.sends


class _ThenSilent(_Then):
    """First send aborted by Temporal (but taken: the child starts); the second is
    never answered, so the spawn's time runs out on it."""

    async def execute_update(self, update: Any, arg: Any, id: str | None = None) -> Any:
        self.sends += 1
        if self.sends == 1:
            raise _ABORTED
        await asyncio.sleep(10)


async def test_unsure_then_not_taken_in_time_child_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    # The aborted first send was taken; the second is not answered within the spawn's
    # time: the child found, the spawn answers it, nothing withdrawn (a withdrawal
    # would cancel a child that runs).
    parent = _ThenSilent(RuntimeError("unused"))
    withdrawn: list[str] = []
    runs = _runs(monkeypatch, parent, withdrawn=withdrawn)
    result = await runs.spawn(RunSpec(task="t", model="m", parent="p"), handle="run-x")
    assert (result, withdrawn, parent.sends) == ("run-x", [], 2)


async def test_unsure_then_refused_describe_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    # The second send's update is refused ("already has a child", e.g. after the
    # parent continued as new), and describe fails for a moment: the child is not
    # known to run, so the error comes with the request withdrawn.
    refusal = WorkflowUpdateFailedError(ApplicationError("run 'p' already has a child 'run-x'"))
    blip = RPCError("deadline", RPCStatusCode.UNAVAILABLE, b"")
    parent = _Then(refusal, describe_error=blip)
    withdrawn: list[str] = []
    runs = _runs(monkeypatch, parent, withdrawn=withdrawn)
    with pytest.raises(Exception) as err:
        await runs.spawn(RunSpec(task="t", model="m", parent="p"), handle="run-x")
    assert withdrawn == ["run-x"], f"error {err.value!r} and nothing withdrawn"


async def _until(pred: Any) -> None:
    """Let the loop run until `pred()` (bounded: the stand-ins need a few passes)."""
    for _ in range(1000):
        if pred():
            return
        await asyncio.sleep(0)
    raise AssertionError("never happened")


class _Slow:
    async def execute_update(self, update: Any, arg: Any, id: str | None = None) -> Any:
        await asyncio.sleep(10)


async def test_gate_released_on_cancel(monkeypatch: pytest.MonkeyPatch) -> None:
    runs = _runs(monkeypatch, _Slow(), wait_s=5)  # type: ignore[arg-type]
    spec = RunSpec(task="t", model="m", parent="p")
    tasks = [asyncio.create_task(runs.spawn(spec, handle=f"run-{i}")) for i in range(12)]
    await _until(lambda: "p" in runs._gates and runs._gates["p"]._value == 0)
    gate = runs._gates["p"]
    assert gate._value == 0 and gate.users == 12
    for t in tasks[:3] + tasks[9:]:  # holders and waiters
        t.cancel()
    await _until(lambda: gate.users == 6)
    assert gate.users == 6 and gate._value == 2, (gate.users, gate._value)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert runs._gates == {}


class _Counting:
    """A parent whose sends are held until `release`, then taken; `sent`: the children
    each send asked for."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.release = asyncio.Event()

    async def execute_update(self, update: Any, arg: Any, id: str | None = None) -> Any:
        self.sent.append(arg.handle)
        await self.release.wait()
        return arg.handle


async def test_a_spawns_turn_says_where_it_stands_and_a_spawn_cut_in_line_is_unsent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The contract the MCP door follows (helper-248): `ahead` while a spawn waits its
    # turn, `sending` once it came; cancelled before that, the spawn leaves the line,
    # is never sent, and the gate's count is whole.
    parent = _Counting()
    runs = _runs(monkeypatch, parent, wait_s=5)  # type: ignore[arg-type]
    spec = RunSpec(task="t", model="m", parent="p")
    turns = [SpawnTurn() for _ in range(12)]
    tasks = [
        asyncio.create_task(runs.spawn(spec, handle=f"run-{i}", turn=turn))
        for i, turn in enumerate(turns)
    ]
    await _until(lambda: len(parent.sent) == 8 and runs._gates["p"].users == 12)
    gate = runs._gates["p"]
    assert [t.sending for t in turns] == [True] * 8 + [False] * 4
    assert [t.ahead for t in turns] == [None] * 8 + [0, 1, 2, 3]
    assert {t.parent for t in turns} == {"p"} and all(t.changed.is_set() for t in turns)
    tasks[9].cancel()  # waiting, one ahead of it: as the door cuts a spawn in line
    await _until(lambda: gate.users == 11)
    assert [t.ahead for t in turns[8:]] == [0, None, 1, 2] and len(gate.line) == 3
    parent.release.set()
    ends = await asyncio.gather(*tasks, return_exceptions=True)
    assert tasks[9].cancelled() and "run-9" not in parent.sent, parent.sent
    assert [e for i, e in enumerate(ends) if i != 9] == [f"run-{i}" for i in range(12) if i != 9]
    assert (len(parent.sent), runs._gates, gate._value, gate.line) == (11, {}, 8, {})
    assert [t.sending for t in turns] == [True] * 9 + [False] + [True] * 2


class _Random:
    """A parent that answers each send as `rng` says: takes it, refuses it while other
    children start, is busy, aborts it (taken or not), refuses it outright, or leaves
    it unanswered (the spawn's clock cuts it, and the gate trips).  `sent`: the
    children asked for; `most`: the sends in flight at once, at most."""

    def __init__(self, rng: random.Random, turns: dict[str, SpawnTurn]) -> None:
        self.rng, self.turns = rng, turns
        self.sent: list[str] = []
        self.early: list[str] = []  # sent while its spawn did not say `sending`
        self.in_flight = self.most = 0

    async def execute_update(self, update: Any, arg: Any, id: str | None = None) -> Any:
        self.sent.append(arg.handle)
        if not self.turns[arg.handle].sending:
            self.early.append(arg.handle)
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            for _ in range(self.rng.randrange(4)):
                await asyncio.sleep(0)
            r = self.rng.random()
            if r < 0.03:
                await asyncio.Event().wait()
            if r < 0.55:
                return arg.handle
            if r < 0.75:
                raise WorkflowUpdateFailedError(ApplicationError("s", type=CHILDREN_STARTING))
            if r < 0.85:
                raise RPCError("busy", RPCStatusCode.RESOURCE_EXHAUSTED, b"")
            if r < 0.92:
                raise _ABORTED
            raise WorkflowUpdateFailedError(ApplicationError("refused"))
        finally:
            self.in_flight -= 1

    async def describe(self) -> Any:
        raise RPCError("workflow not found", RPCStatusCode.NOT_FOUND, b"")

    async def signal(self, *args: Any) -> None:
        return None


@pytest.mark.parametrize("seed", range(40))
async def test_a_line_of_spawns_cut_at_random_keeps_the_gate_whole(
    monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    # Spawns at one parent, answered at random, their callers cut at random as the door
    # cuts them (helper-252): never more than 8 sends in flight, a request sent only
    # while `sending`, a spawn cut before it never sent, its turns given in the order
    # its line was joined, and at the end the gate's permits whole and the gate dropped.
    rng = random.Random(seed)
    monkeypatch.setattr(runs_module, "_LAST_SEND_S", 0.002)  # (a clock of 50 ms)
    gates: list[Any] = []
    gate_class = runs_module._Gate

    class _Seen(gate_class):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            gates.append(self)

    monkeypatch.setattr(runs_module, "_Gate", _Seen)
    turns = {f"run-{i}": SpawnTurn() for i in range(rng.randrange(5, 60))}
    parent = _Random(rng, turns)
    runs = _runs(monkeypatch, parent, wait_s=0.05)  # type: ignore[arg-type]
    given: list[SpawnTurn] = []
    started = SpawnTurn._started
    monkeypatch.setattr(SpawnTurn, "_started", lambda t: (given.append(t), started(t)))
    spec = RunSpec(task="t", model="m", parent="p")
    tasks = {h: asyncio.create_task(runs.spawn(spec, handle=h, turn=t)) for h, t in turns.items()}
    joined: dict[SpawnTurn, None] = {}
    unsent: list[str] = []  # cut before `sending`
    for _ in range(rng.randrange(200)):
        await asyncio.sleep(0)
        joined.update((t, None) for g in gates for t in g.line)
        h = rng.choice(list(turns))
        if rng.random() < 0.1 and not tasks[h].done():
            if not turns[h].sending:
                unsent.append(h)
            tasks[h].cancel()
    await asyncio.wait_for(asyncio.gather(*tasks.values(), return_exceptions=True), 30)
    assert (parent.most <= 8, parent.early, runs._gates) == (True, [], {}), parent.most
    assert all((g._value, g.users, g.line) == (8, 0, {}) for g in gates)
    assert all(tasks[h].cancelled() and h not in parent.sent for h in unsent), unsent
    seen = set(given)
    assert [t for t in joined if t in seen] == [t for t in given if t in joined]


class _SdkSlow:
    """A parent whose update is in flight until its caller gives up, the caller's
    cancellation raised as the SDK raises it (temporalio/client/_impl.py,
    start_workflow_update: WorkflowUpdateRPCTimeoutOrCancelledError from the
    CancelledError); its child never started."""

    def __init__(self) -> None:
        self.sends = 0
        self.in_flight = asyncio.Event()

    async def execute_update(self, update: Any, arg: Any, id: str | None = None) -> Any:
        self.sends += 1
        self.in_flight.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError as err:
            raise WorkflowUpdateRPCTimeoutOrCancelledError() from err

    async def describe(self) -> Any:
        raise RPCError("workflow not found", RPCStatusCode.NOT_FOUND, b"")


async def test_a_spawn_its_caller_cancels_is_not_sent_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The SDK raises the caller's cancellation as the error Temporal's own cut gives,
    # which is sent again (helper-218): the caller's is told apart, and the spawn stops
    # at once, not sending for the rest of its time (helper-222).
    parent = _SdkSlow()
    runs = _runs(monkeypatch, parent, wait_s=5)  # type: ignore[arg-type]
    spec = RunSpec(task="t", model="m", parent="p")
    task = asyncio.create_task(runs.spawn(spec, handle="run-x"))
    await asyncio.wait_for(parent.in_flight.wait(), 5)
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=2)
    assert done and task.cancelled(), (parent.sends, task)
    assert (parent.sends, runs._gates) == (1, {})


async def test_a_spawn_whose_turn_at_the_gate_never_comes_asked_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Nine spawns at once to a parent that answers none: eight hold the gate all the
    # while, the ninth never sends (the first not taken trips the gate), so it
    # withdraws nothing and says no child was started.
    parent = _SdkSlow()
    withdrawn: list[str] = []
    runs = _runs(monkeypatch, parent, withdrawn=withdrawn)  # type: ignore[arg-type]
    spec = RunSpec(task="t", model="m", parent="p")
    ends = await asyncio.gather(
        *(runs.spawn(spec, handle=f"run-{i}") for i in range(9)), return_exceptions=True
    )
    assert all(isinstance(e, RunUnavailable) for e in ends), ends
    assert parent.sends == 8 and "run-8" not in withdrawn, (parent.sends, withdrawn)
    assert str(ends[8]) == (
        "parent run 'p' did not take the child within 1 s (is a worker up on task queue "
        "'q', and the parent's workflow task not failing?); another spawn to it found "
        "so, and this one was not sent (again): no child was started"
    )


async def test_unsure_then_worker_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    # The aborted first send may be taken later; the second finds no worker polling
    # ("nothing was asked of it", of this send): the error comes with the request
    # withdrawn.
    parent = _Then(
        RuntimeError("not sent"), describe_error=RPCError("nf", RPCStatusCode.NOT_FOUND, b"")
    )
    withdrawn: list[str] = []
    runs = _runs(monkeypatch, parent, withdrawn=withdrawn)
    polls = iter([True, False])

    async def worker_polls() -> bool:
        return next(polls)

    monkeypatch.setattr(runs, "_worker_polls", worker_polls)
    with pytest.raises(Exception) as err:
        await runs.spawn(RunSpec(task="t", model="m", parent="p"), handle="run-x")
    assert withdrawn == ["run-x"], f"error {err.value!r} and nothing withdrawn"
