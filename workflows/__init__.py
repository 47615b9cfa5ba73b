"""Temporal workflows: the sub-agent run (`AgentRun`), its contract, and `Runs`, the
facade the MCP door and tests use to operate runs."""

from temporalio import workflow

# AgentRun's module is imported afresh into a new sandbox for every run a worker starts
# and every replay: temporalio's isolation of that module's state, and its checks on what
# workflow code calls (clock, randomness, I/O) through the modules it imports.  Python
# imports this package first, in the sandbox too, so what the package imports would be
# executed afresh as well.  Passed through from outside the sandbox instead (here, so
# that every runner does it: the worker's, the tests' own workers, the Replayer):
# `workflows.contract`, frozen dataclasses and constants that runs read and never write
# (agent_run.py passes it through already), and `workflows.runs`, the client-side facade
# that no workflow code calls (its module-level state: constants, lookup tables, a
# logger).  Executing `workflows.runs` afresh was a third of each run's sandbox start
# (helper-247; bench/RESULTS.md, "What the sandbox costs a run").  AgentRun's module
# stays outside the block: passed through, its state would be shared between runs and
# its calls unchecked.
from workflows.agent_run import DECLINED, AgentRun

with workflow.unsafe.imports_passed_through():
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
