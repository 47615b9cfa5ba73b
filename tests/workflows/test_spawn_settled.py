"""A spawn that Temporal turned away once (aborted: its update may have been taken all
the same) answers an error only with its request withdrawn, whatever ends it after
(helper-212); and the gate of a parent's spawns gives its permits back when holders and
waiters are cancelled."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from temporalio.client import WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from tests.workflows.test_spawn_retry import _ABORTED, _DEADLINE, _runs
from workflows import RunSpec


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
