"""Runs.spawn with a parent that refuses a spawn while others of its children start
(contract.CHILDREN_STARTING_BYTES): it sends the spawn again, all within child_wait_s,
and once that is up it says that no child started (helper-167).  The parent here is a
stand-in: the handle's update refuses, as the run's validator does."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from temporalio.client import WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError

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

    async def execute_update(self, update: Any, arg: Any) -> Any:
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

    async def execute_update(self, update: Any, arg: Any) -> Any:
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
