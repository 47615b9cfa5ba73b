"""What a run's sandbox costs to start: the time temporalio (1.35) takes to create one
`AgentRun` workflow instance in its sandbox, which the worker does on its event-loop
thread for every run it starts and every replay after a cache eviction, and the modules
the sandbox executes afresh for it (the rest it passes through from outside).

    python -m bench.sandbox_start [--reps R] [--passthrough all|mod,mod]

--passthrough builds the sandbox with those modules passed through ("all": every module)
instead of the Worker's default.  Numbers: bench/RESULTS.md, "What the sandbox costs a
run".  Without bytecode caches (PYTHONDONTWRITEBYTECODE=1 over a source checkout) the
sandbox compiles the modules it executes afresh from source at every run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from importlib.machinery import SourceFileLoader
from importlib.util import cache_from_source
from pathlib import Path
from types import ModuleType

import temporalio.converter
import temporalio.workflow
from temporalio.api.common.v1.message_pb2 import Payloads
from temporalio.api.failure.v1.message_pb2 import Failure
from temporalio.worker._workflow_instance import WorkflowInstanceDetails
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions
from temporalio.worker.workflow_sandbox._runner import _fake_info

import workflows.agent_run as agent_run
from workflows import AgentRun


def _details() -> WorkflowInstanceDetails:
    """What the worker passes to create a run's instance (the SDK's own validation
    uses the same, with this fake info)."""
    converter = temporalio.converter.DataConverter.default
    return WorkflowInstanceDetails(
        payload_converter_factory=converter._new_payload_converter,
        failure_converter_class=converter.failure_converter_class,
        interceptor_classes=[],
        defn=temporalio.workflow._Definition.must_from_class(AgentRun),
        info=_fake_info,
        randomness_seed=-1,
        extern_functions={},
        disable_eager_activity_execution=False,
        worker_level_failure_exception_types=[],
        patch_activation_callback=None,
        last_completion_result=Payloads(),
        last_failure=Failure(),
    )


def _runner(passthrough: str) -> SandboxedWorkflowRunner:
    r = SandboxRestrictions.default
    if passthrough == "all":
        r = r.with_passthrough_all_modules()
    elif passthrough:
        r = r.with_passthrough_modules(*passthrough.split(","))
    return SandboxedWorkflowRunner(restrictions=r)


async def measure(reps: int, passthrough: str) -> dict[str, object]:
    runner = _runner(passthrough)
    runner.create_instance(_details())  # the host's own first imports (temporalio's)
    executed: list[str] = []
    exec_module = SourceFileLoader.exec_module

    def recorded(loader: SourceFileLoader, module: ModuleType) -> None:
        executed.append(module.__name__)
        exec_module(loader, module)

    SourceFileLoader.exec_module = recorded  # type: ignore[method-assign,assignment]
    try:
        runner.create_instance(_details())
    finally:
        SourceFileLoader.exec_module = exec_module  # type: ignore[method-assign]
    took = []
    for _ in range(reps):
        t0 = time.perf_counter()
        runner.create_instance(_details())
        took.append(time.perf_counter() - t0)
    return {
        "passthrough": passthrough or "default",
        "reps": reps,
        "create_ms_p50": round(statistics.median(took) * 1000, 2),
        "create_ms_min": round(min(took) * 1000, 2),
        "create_ms_max": round(max(took) * 1000, 2),
        "executed_afresh": executed,
        # Whether the workflow's module has a bytecode cache to load instead of its source.
        "bytecode_cached": Path(cache_from_source(agent_run.__file__)).exists(),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--passthrough", default="", help='modules passed through, or "all"')
    a = p.parse_args()
    print(json.dumps(asyncio.run(measure(a.reps, a.passthrough))))


if __name__ == "__main__":
    main()
