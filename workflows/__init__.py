"""Temporal workflows: the sub-agent run (`AgentRun`), its contract, and `Runs`, the
facade the MCP door and tests use to operate runs."""

from workflows.agent_run import DECLINED, AgentRun
from workflows.contract import (
    DEFAULT_TASK_QUEUE,
    SEARCH_ATTRIBUTES,
    TERMINAL_STATES,
    Budget,
    ChildSummary,
    PendingApproval,
    RunSpec,
    RunStatus,
    Totals,
)
from workflows.runs import (
    AWAIT_MAX_S,
    CallerRuns,
    Rounds,
    RunError,
    Runs,
    RunUnavailable,
    SpawnTurn,
    new_handle,
)

__all__ = [
    "AWAIT_MAX_S",
    "DECLINED",
    "DEFAULT_TASK_QUEUE",
    "SEARCH_ATTRIBUTES",
    "TERMINAL_STATES",
    "AgentRun",
    "Budget",
    "CallerRuns",
    "ChildSummary",
    "PendingApproval",
    "Rounds",
    "RunError",
    "RunSpec",
    "RunStatus",
    "RunUnavailable",
    "Runs",
    "SpawnTurn",
    "Totals",
    "new_handle",
]
