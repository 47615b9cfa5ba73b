"""Runs.approve when Temporal cuts the update call short (DEADLINE_EXCEEDED or
CANCELLED: the SDK's WorkflowUpdateRPCTimeoutOrCancelledError, no RPCError): the
caller gets RunUnavailable, which the MCP door and the Tasks extension report as an
answer not taken, never acknowledged (helper-219: the SDK's error went up as it was).
The run here is a stand-in: its handle's update raises as the SDK does."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from temporalio.client import WorkflowExecutionStatus, WorkflowUpdateRPCTimeoutOrCancelledError

from tests.workflows.test_spawn_retry import _CANCELLED, _DEADLINE
from workflows import Runs, RunUnavailable


class _Cut:
    """A run's handle whose updates Temporal cuts short with `error`."""

    def __init__(self, error: WorkflowUpdateRPCTimeoutOrCancelledError) -> None:
        self.error = error
        self.sends = 0

    async def execute_update(self, update: Any, arg: Any, id: str | None = None) -> Any:
        self.sends += 1
        raise self.error


@pytest.mark.parametrize("error", [_DEADLINE, _CANCELLED], ids=["deadline", "cancelled"])
async def test_an_answer_temporal_cuts_short_is_not_taken(
    monkeypatch: pytest.MonkeyPatch, error: WorkflowUpdateRPCTimeoutOrCancelledError
) -> None:
    run = _Cut(error)
    runs = Runs(None, task_queue="q", child_wait_s=1.0)  # type: ignore[arg-type]

    async def running(handle: str) -> Any:
        return SimpleNamespace(status=WorkflowExecutionStatus.RUNNING)

    async def yes() -> bool:
        return True

    monkeypatch.setattr(runs, "_describe", running)
    monkeypatch.setattr(runs, "_worker_polls", yes)
    monkeypatch.setattr(runs, "_handle", lambda handle: run)
    with pytest.raises(RunUnavailable) as err:
        await runs.approve("run-x", True, "call_1")
    # Sent once: the run may have taken it (the client, told so, reads the status).
    assert run.sends == 1
    assert str(err.value) == (
        "run 'run-x' did not say it took the answer: Temporal cut the call short "
        "(context deadline exceeded); it may have taken it, or take it later (status tells)"
    )
