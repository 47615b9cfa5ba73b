"""Runs.spawn with a parent that refuses a spawn while others of its children start
(contract.CHILDREN_STARTING_BYTES), or that Temporal turns away (its updates in flight
at the limit, an update aborted): it sends the spawn again, all within child_wait_s
from its first turn at the gate, and once that is up it says that no child started
(helper-167, helper-210); a line of spawns at a stuck parent fails at once, unsent.
The parent here is a stand-in: the handle's update refuses, as the run's validator
or Temporal does."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest
from temporalio.client import WorkflowUpdateFailedError, WorkflowUpdateRPCTimeoutOrCancelledError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from workflows import Runs, RunSpec, RunUnavailable
from workflows.agent_run import CHILDREN_STARTING

WAIT = 1.0


class _Refusing:
    """A parent's handle whose spawn_child update is refused, the run busy starting
    other children; a send after `slow_after` seconds is answered just within a whole
    child_wait_s (its workflow task slow to come)."""

    def __init__(self, slow_after: float | None) -> None:
        self.sends = 0
        self.started = time.monotonic()
        self.slow_after = slow_after

    async def execute_update(self, update: Any, arg: Any, id: str | None = None) -> Any:
        self.sends += 1
        if self.slow_after is not None and time.monotonic() - self.started > self.slow_after:
            await asyncio.sleep(WAIT * 0.95)
        raise WorkflowUpdateFailedError(
            ApplicationError("run 'p' is starting 1 children", type=CHILDREN_STARTING)
        )


def _runs(
    monkeypatch: pytest.MonkeyPatch,
    parent: _Refusing,
    wait_s: float = WAIT,
    withdrawn: list[str] | None = None,
) -> Runs:
    """Runs whose parent run is `parent`, a worker polling; the handles withdrawn go
    to `withdrawn`."""
    runs = Runs(None, task_queue="q", child_wait_s=wait_s)  # type: ignore[arg-type]

    async def yes(*args: Any) -> bool:
        return True

    async def withdraw(parent_handle: str, handle: str) -> bool:
        if withdrawn is not None:
            withdrawn.append(handle)
        return True

    async def nothing(*args: Any) -> None:
        return None

    monkeypatch.setattr(runs, "_describe", nothing)
    monkeypatch.setattr(runs, "_worker_polls", yes)
    monkeypatch.setattr(runs, "withdraw_child", withdraw)
    monkeypatch.setattr(runs, "_handle", lambda handle: parent)
    return runs


@pytest.mark.parametrize("slow_after", [None, WAIT * 0.6], ids=["quick", "slow-late"])
async def test_a_spawn_refused_while_others_start_gives_up_within_child_wait_s(
    monkeypatch: pytest.MonkeyPatch, slow_after: float | None
) -> None:
    # Each send had its own child_wait_s: a late one took the spawn to ~1.6 of it.
    parent = _Refusing(slow_after)
    runs = _runs(monkeypatch, parent)
    began = time.monotonic()
    with pytest.raises(RunUnavailable) as err:
        await runs.spawn(RunSpec(task="t", model="m", parent="p"), handle="run-x")
    took = time.monotonic() - began
    assert took <= WAIT * 1.2, f"took {took:.2f} s, child_wait_s {WAIT}"
    assert parent.sends >= 3  # sent again while it was refused
    if slow_after is None:
        # Not the run's words for one refusal: the caller learns nothing will start.
        assert str(err.value) == (
            "parent run 'p' was starting other children for all of 1 s (those starting "
            "at once may carry 800,000 bytes of task and system prompt: they share a "
            "workflow task, which Temporal limits); no child was started: spawn it again"
        )
    else:
        assert "the request is withdrawn: no child runs" in str(err.value), err.value


class _Busy(_Refusing):
    """A parent that answers each send after a round trip of 0.2 s, refusing it."""

    def __init__(self) -> None:
        super().__init__(None)
        self.left_with_server = 0  # sends whose caller gave up before the answer

    async def execute_update(self, update: Any, arg: Any, id: str | None = None) -> Any:
        self.sends += 1
        try:
            await asyncio.sleep(0.2)
        except asyncio.CancelledError:
            self.left_with_server += 1
            raise
        raise WorkflowUpdateFailedError(
            ApplicationError("run 'p' is starting 1 children", type=CHILDREN_STARTING)
        )


async def test_a_spawn_sends_no_last_time_too_short_for_an_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Sends at 0, .22, .46 and .74 s of child_wait_s 1.15; one at 1.10 s got the 50 ms
    # left, was cut as not taken and withdrawn, an update left with the server, and the
    # caller was told to look for a worker (helper-168).
    parent = _Busy()
    withdrawn: list[str] = []
    runs = _runs(monkeypatch, parent, wait_s=1.15, withdrawn=withdrawn)
    with pytest.raises(RunUnavailable) as err:
        await runs.spawn(RunSpec(task="t", model="m", parent="p"), handle="run-x")
    assert (parent.left_with_server, withdrawn) == (0, []), (parent.sends, str(err.value))
    assert "was starting other children for all of 1.15 s" in str(err.value)


class _Pressed:
    """A parent whose spawn_child sends Temporal turns away (`error`) `times` times,
    then takes; `started`: whether the child exists (describe, for the child's handle)."""

    def __init__(self, error: Exception, times: int, started: bool = False) -> None:
        self.error = error
        self.times = times
        self.started = started
        self.ids: list[str | None] = []

    async def execute_update(self, update: Any, arg: Any, id: str | None = None) -> Any:
        self.ids.append(id)
        if len(self.ids) <= self.times:
            raise self.error
        return arg.handle

    async def describe(self) -> Any:
        if not self.started:
            raise RPCError("workflow not found", RPCStatusCode.NOT_FOUND, b"")
        return SimpleNamespace(parent_id="p")


_LIMIT = RPCError(
    "limit on number of concurrent in-flight updates has been reached (10)",
    RPCStatusCode.RESOURCE_EXHAUSTED,
    b"",
)
_ABORTED = RPCError("workflow update was aborted", RPCStatusCode.UNAVAILABLE, b"")


def _cut(status: RPCStatusCode) -> WorkflowUpdateRPCTimeoutOrCancelledError:
    """What the SDK raises when Temporal answers the update call (or a poll for its
    outcome) with DEADLINE_EXCEEDED or CANCELLED: no RPCError, but its own error, the
    RPCError its cause (temporalio/client/_impl.py, start_workflow_update)."""
    cut = WorkflowUpdateRPCTimeoutOrCancelledError()
    cut.__cause__ = RPCError("context deadline exceeded", status, b"")
    return cut


_DEADLINE = _cut(RPCStatusCode.DEADLINE_EXCEEDED)
_CANCELLED = _cut(RPCStatusCode.CANCELLED)


@pytest.mark.parametrize(
    "error",
    [_LIMIT, _ABORTED, _DEADLINE, _CANCELLED],
    ids=["limit", "aborted", "deadline", "cancelled"],
)
async def test_a_spawn_temporal_turns_away_is_sent_again_as_the_same_update(
    monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    # The parent's updates in flight at Temporal's limit (10), or an update Temporal
    # aborted: the spawn failed at once (helper-207).  Sent again under the same update
    # id, one Temporal had taken is answered with its outcome, never taken twice.  So
    # too when Temporal cut the call short (the SDK's own error, no RPCError: it went
    # up to the caller as it was, the child perhaps started; helper-218).
    parent = _Pressed(error, times=3)
    runs = _runs(monkeypatch, parent)
    assert await runs.spawn(RunSpec(task="t", model="m", parent="p"), handle="run-x") == "run-x"
    assert len(parent.ids) == 4 and len(set(parent.ids)) == 1 and parent.ids[0], parent.ids


@pytest.mark.parametrize("started", [True, False], ids=["started", "not-started"])
async def test_a_spawn_aborted_until_its_time_is_up_says_whether_its_child_runs(
    monkeypatch: pytest.MonkeyPatch, started: bool
) -> None:
    # An aborted update may have been taken (the worker's answer revives it): its
    # child found started, the spawn answers its handle; not found, the request is
    # withdrawn (the parent refuses it, or cancels the child), and the error says so.
    parent = _Pressed(_ABORTED, times=10**6, started=started)
    withdrawn: list[str] = []
    runs = _runs(monkeypatch, parent, withdrawn=withdrawn)
    spec = RunSpec(task="t", model="m", parent="p")
    if started:
        assert await runs.spawn(spec, handle="run-x") == "run-x"
        assert withdrawn == []
        return
    with pytest.raises(RunUnavailable) as err:
        await runs.spawn(spec, handle="run-x")
    assert withdrawn == ["run-x"]
    assert str(err.value).startswith(
        "Temporal did not take the request to parent run 'p' for all of 1 s: workflow "
        "update was aborted; the request is withdrawn: no child runs"
    ), err.value


async def test_a_spawn_temporal_cuts_short_until_its_time_is_up_is_withdrawn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every send cut short by Temporal (DEADLINE_EXCEEDED), each of which it may have
    # taken: once time is up, the child not found, the request is withdrawn, and the
    # error says so (helper-218: the first cut went up as it was, nothing withdrawn).
    parent = _Pressed(_DEADLINE, times=10**6)
    withdrawn: list[str] = []
    runs = _runs(monkeypatch, parent, withdrawn=withdrawn)
    with pytest.raises(RunUnavailable) as err:
        await runs.spawn(RunSpec(task="t", model="m", parent="p"), handle="run-x")
    assert withdrawn == ["run-x"]
    assert len(parent.ids) >= 3 and len(set(parent.ids)) == 1, parent.ids
    assert str(err.value).startswith(
        "Temporal did not take the request to parent run 'p' for all of 1 s: context "
        "deadline exceeded; the request is withdrawn: no child runs"
    ), err.value


async def _burst(runs: Runs, n: int = 40) -> tuple[list[str], list[Any]]:
    """`n` spawns at once under parent `p`: their handles, and what each spawn gave
    (a handle or its error), in order."""
    kids = [f"run-{i}" for i in range(n)]
    spec = RunSpec(task="t", model="m", parent="p")
    got = await asyncio.gather(*(runs.spawn(spec, handle=k) for k in kids), return_exceptions=True)
    return kids, got


class _Counting:
    """A parent that takes every spawn after 20 ms, counting the sends in flight."""

    def __init__(self) -> None:
        self.now = 0
        self.most = 0

    async def execute_update(self, update: Any, arg: Any, id: str | None = None) -> Any:
        self.now += 1
        self.most = max(self.most, self.now)
        try:
            await asyncio.sleep(0.02)
        finally:
            self.now -= 1
        return arg.handle


async def test_a_gateway_sends_a_few_spawns_to_one_parent_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 150 spawns at once, each sent again as Temporal refused it for the parent's
    # updates in flight, kept the parent's workflow tasks failing: most were never
    # taken.  The others wait their turn here, under Temporal's limit of 10.
    parent = _Counting()
    runs = _runs(monkeypatch, parent)
    kids, got = await _burst(runs)
    assert got == kids
    assert parent.most == 8
    assert runs._gates == {}  # none kept for a parent no spawn waits for


class _OneAtATime:
    """A parent that takes one spawn at a time, each after 50 ms (its workflow tasks one
    after another), recording the handles it took."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.took: list[str] = []

    async def execute_update(self, update: Any, arg: Any, id: str | None = None) -> Any:
        async with self.lock:
            await asyncio.sleep(0.05)
            self.took.append(arg.handle)
        return arg.handle


async def test_spawns_in_line_behind_a_slow_parent_are_all_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A spawn's clock ran from when it joined the line: of 250 spawns at a parent
    # taking ~4 a second, 116-131 were refused, though the parent took them steadily
    # (helper-242).  It runs from the spawn's first turn: 40 here take ~2 s, twice
    # child_wait_s, and every one is taken.
    parent = _OneAtATime()
    runs = _runs(monkeypatch, parent)
    kids, got = await _burst(runs)
    assert got == kids, [str(g) for g in got if isinstance(g, Exception)][:3]
    assert sorted(parent.took) == sorted(kids)
    assert runs._gates == {}


class _Gone:
    """A parent whose worker is listed but gone: no send is ever answered."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    async def execute_update(self, update: Any, arg: Any, id: str | None = None) -> Any:
        self.sent.append(arg.handle)
        await asyncio.Event().wait()


async def test_a_line_of_spawns_at_a_stuck_parent_fails_within_one_child_wait_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With no clock in the line, the line is bounded by the parent's progress: the
    # first send not taken within its clock trips the gate, and the spawns waiting
    # their turn fail at once, unsent (not 5 clocks in turn for 40 spawns, 8 at once).
    # Only those sent are withdrawn; the others left nothing to withdraw.
    parent = _Gone()
    withdrawn: list[str] = []
    runs = _runs(monkeypatch, parent, withdrawn=withdrawn)
    kids = [f"run-{i}" for i in range(40)]
    spec = RunSpec(task="t", model="m", parent="p")
    began = time.monotonic()
    got = await asyncio.gather(*(runs.spawn(spec, handle=k) for k in kids), return_exceptions=True)
    took = time.monotonic() - began
    assert took <= WAIT * 1.5, f"took {took:.2f} s, child_wait_s {WAIT}"
    assert all(isinstance(g, RunUnavailable) for g in got), got
    assert len(parent.sent) == 8 and sorted(withdrawn) == sorted(parent.sent)
    for kid, err in zip(kids, got, strict=True):
        if kid in parent.sent:
            assert "the request is withdrawn: no child runs" in str(err), err
        else:
            assert str(err) == (
                "parent run 'p' did not take the child within 1 s (is a worker up on task "
                "queue 'q', and the parent's workflow task not failing?); another spawn to "
                "it found so, and this one was not sent (again): no child was started"
            ), err
    assert runs._gates == {}
    # A spawn after the line has gone is sent again (the gate was dropped with it).
    runs._handle = lambda handle: _OneAtATime()  # type: ignore[method-assign]
    assert await runs.spawn(spec, handle="run-later") == "run-later"


class _TakingOthers(_OneAtATime):
    """A `_OneAtATime` parent that refuses run-0's first send, its children starting,
    and does not take its next within child_wait_s (run-0's clock left too short, as
    for a send again behind others in the parent's queue); `again` is set as that
    send comes."""

    def __init__(self) -> None:
        super().__init__()
        self.refused = False
        self.again = asyncio.Event()

    async def execute_update(self, update: Any, arg: Any, id: str | None = None) -> Any:
        if arg.handle == "run-0":
            if not self.refused:
                self.refused = True
                raise WorkflowUpdateFailedError(
                    ApplicationError("run 'p' is starting 1 children", type=CHILDREN_STARTING)
                )
            self.again.set()
            await asyncio.sleep(WAIT * 2)
        return await super().execute_update(update, arg, id)


async def test_a_send_not_taken_while_the_parent_takes_others_trips_no_gate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A send not taken within what was left of its clock tripped the gate though the
    # parent was taking the others, and the spawns waiting their turn failed, unsent
    # (helper-245: 7 of 40 whose every other spawn was refused once).  Only a parent
    # that took nothing while the send waited is taken for stuck.
    parent = _TakingOthers()
    withdrawn: list[str] = []
    runs = _runs(monkeypatch, parent, withdrawn=withdrawn)  # type: ignore[arg-type]
    spec = RunSpec(task="t", model="m", parent="p")
    first = asyncio.ensure_future(runs.spawn(spec, handle="run-0"))
    await parent.again.wait()
    kids = [f"run-{i}" for i in range(1, 41)]
    got = await asyncio.gather(*(runs.spawn(spec, handle=k) for k in kids), return_exceptions=True)
    assert got == kids, [str(g) for g in got if isinstance(g, Exception)][:3]
    with pytest.raises(RunUnavailable, match="did not take the child within 1 s"):
        await first
    assert withdrawn == ["run-0"]
    assert runs._gates == {}


class _RefusesEachOnce(_OneAtATime):
    """A `_OneAtATime` parent that refuses each spawn's first send, its children
    starting (as many are, of a burst at one parent)."""

    def __init__(self) -> None:
        super().__init__()
        self.refused: set[str] = set()

    async def execute_update(self, update: Any, arg: Any, id: str | None = None) -> Any:
        if arg.handle not in self.refused:
            self.refused.add(arg.handle)
            raise WorkflowUpdateFailedError(
                ApplicationError("run 'p' is starting 1 children", type=CHILDREN_STARTING)
            )
        return await super().execute_update(update, arg, id)


async def test_a_spawn_sent_again_keeps_its_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    # A spawn refused once gave its turn up until its send again, which waited at the
    # back of the line with its clock running: of 40 here 21 failed, "was taking 8 other
    # spawns of this gateway for all of 1 s" or not taken (helper-245), as all did
    # before the clock started at the turn.  It keeps its turn for all its sends.
    parent = _RefusesEachOnce()
    runs = _runs(monkeypatch, parent)  # type: ignore[arg-type]
    kids, got = await _burst(runs)
    assert got == kids, [str(g) for g in got if isinstance(g, Exception)][:3]
    assert sorted(parent.took) == sorted(kids)
    assert runs._gates == {}


async def test_a_line_at_a_parent_refusing_every_spawn_fails_within_one_child_wait_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each spawn keeps its turn while it is refused, so a parent that takes none would
    # hold the line for a clock per 8 spawns (3 s here); one refused a whole clock while
    # the parent took no spawn trips the gate, as one not taken does.
    parent = _Refusing(None)
    runs = _runs(monkeypatch, parent)
    spec = RunSpec(task="t", model="m", parent="p")
    began = time.monotonic()
    got = await asyncio.gather(
        *(runs.spawn(spec, handle=f"run-{i}") for i in range(24)), return_exceptions=True
    )
    took = time.monotonic() - began
    assert took <= WAIT * 1.5, f"took {took:.2f} s, child_wait_s {WAIT}"
    assert all(isinstance(g, RunUnavailable) for g in got), got
    why = "parent run 'p' was starting other children for all of 1 s"
    assert all(str(g).startswith(why) for g in got), got
    # The one that ran out its clock says so; the 7 others in their turn, refused as
    # well, and the 16 waiting theirs fail with the trip at their next send.
    waited = [g for g in got if "was not sent (again): no child was started" in str(g)]
    assert len(waited) == 23, got
    assert runs._gates == {}
