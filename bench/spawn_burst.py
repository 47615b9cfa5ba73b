"""A burst of N spawns at once under one parent (a root waiting for approval): how many
spawns a second the parent takes, each spawn's latency, and where the parent's workflow
tasks go (from its history: per completed workflow task, the updates it accepted and
completed and the child starts it commanded; what woke each task).

    python -m bench.spawn_burst [N ...] [--gates G ...] [--children quiet|busy] [--reps R]
        [--child-wait S] [--passthrough all|mod,mod]

quiet children wait for an approval (one report up each); busy ones make a tool call
and end (their reports land in the parent's history during the burst).  Also timed, by
wrapping the SDK's internals (temporalio 1.35): the worker's activations of the parent
(its own code), and the creation of each new workflow instance (the sandbox re-imports
the workflow's modules, on the worker's event-loop thread).  --child-wait sets
Runs.child_wait_s; --passthrough builds the worker with those modules passed through.
One process, loaded or not (the harness's stack: worker, gateway and fakes share it):
compare arms run side by side.  Numbers: bench/RESULTS.md, "A burst of spawns".
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import temporalio.worker._workflow as _wf_worker
import temporalio.worker.workflow_sandbox._runner as _sandbox_runner
from temporalio.api.enums.v1 import EventType

import workflows.runs as runs_mod
from luftpause.temporal_dev import DevServer
from tests.workflows.harness import MODEL, Stack, spawn_waiting, stack, task_with
from workflows import RunSpec, RunUnavailable

E = EventType
WFT_COMPLETED = E.EVENT_TYPE_WORKFLOW_TASK_COMPLETED
WFT_SCHEDULED = E.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED
ACCEPTED = E.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED
COMPLETED = E.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_COMPLETED
INITIATED = E.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED
STARTED = E.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_STARTED
SIGNALED = E.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED


PHASES: dict[str, list[float]] = collections.defaultdict(list)


def _timed(name: str, fn: Any) -> Any:
    async def wrapper(*a: Any, **k: Any) -> Any:
        t0 = time.monotonic()
        try:
            return await fn(*a, **k)
        finally:
            PHASES[name].append(time.monotonic() - t0)

    return wrapper


runs_mod.Runs._describe = _timed("describe", runs_mod.Runs._describe)  # type: ignore[method-assign]
runs_mod.Runs.workers = _timed("task_queue", runs_mod.Runs.workers)  # type: ignore[method-assign]
runs_mod.Runs._update = _timed("update_incl_task_queue", runs_mod.Runs._update)  # type: ignore[method-assign]


ACTS: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
_activate = _sandbox_runner._Instance.activate


def _timed_activate(self: Any, act: Any) -> Any:
    w0, c0 = time.monotonic(), time.thread_time()
    try:
        return _activate(self, act)
    finally:
        ACTS[act.run_id].append((time.monotonic() - w0, time.thread_time() - c0))


_sandbox_runner._Instance.activate = _timed_activate  # type: ignore[method-assign]
CREATES: list[float] = []
_create = _wf_worker._WorkflowWorker._create_workflow_instance


def _timed_create(self: Any, *a: Any, **k: Any) -> Any:
    t0 = time.monotonic()
    try:
        return _create(self, *a, **k)
    finally:
        CREATES.append(time.monotonic() - t0)


_wf_worker._WorkflowWorker._create_workflow_instance = _timed_create  # type: ignore[method-assign]


def _passthrough(modules: str) -> None:
    """Build the harness's worker with a sandbox that passes `modules` through ("all":
    every module), instead of re-importing them for each new workflow instance."""
    from temporalio.worker import Worker
    from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

    import worker.main as worker_main

    r = SandboxRestrictions.default
    r = (
        r.with_passthrough_all_modules()
        if modules == "all"
        else r.with_passthrough_modules(*modules.split(","))
    )

    def with_runner(*a: Any, **k: Any) -> Any:
        return Worker(*a, workflow_runner=SandboxedWorkflowRunner(restrictions=r), **k)

    worker_main.Worker = with_runner  # type: ignore[assignment,misc]


async def burst(s: Stack, n: int, children: str) -> dict[str, Any]:
    PHASES.clear()
    ACTS.clear()
    CREATES.clear()
    root = await spawn_waiting(s, "root")
    if children == "quiet":
        spec = {"model": MODEL, "tools": ["delete_record"], "parent": root}
        tasks = [task_with(1, "leafq") for _ in range(n)]
    else:
        spec = {"model": MODEL, "tools": ["lookup"], "parent": root}
        tasks = [task_with(1, "leaf") for _ in range(n)]
    before = len((await s.client.get_workflow_handle(root).fetch_history()).events)
    lat: list[float] = []
    refused = 0
    cpu0 = time.process_time()
    began = time.monotonic()

    async def one(task: str) -> None:
        nonlocal refused
        t0 = time.monotonic()
        try:
            await s.runs.spawn(RunSpec(task=task, **spec))
        except RunUnavailable:
            refused += 1
            return
        lat.append(time.monotonic() - t0)

    await asyncio.gather(*(one(t) for t in tasks))
    took = time.monotonic() - began
    cpu = time.process_time() - cpu0
    history = (await s.client.get_workflow_handle(root).fetch_history()).events[before:]
    root_run = (await s.client.get_workflow_handle(root).describe()).run_id
    mine = ACTS.get(root_run, [])
    others = [a for k, v in ACTS.items() if k != root_run for a in v]
    # Per completed workflow task: what its commands/messages recorded (the events after
    # its WorkflowTaskCompleted, up to the next task's scheduling).
    per_task: list[collections.Counter[int]] = []
    woke: collections.Counter[str] = collections.Counter()
    pending: list[int] = []
    for ev in history:
        t = ev.event_type
        if t == WFT_COMPLETED:
            per_task.append(collections.Counter())
        elif t == WFT_SCHEDULED:
            woke[
                "+".join(sorted({E.Name(p).removeprefix("EVENT_TYPE_") for p in pending}))
                or "update-only"
            ] += 1
            pending = []
        elif t in (ACCEPTED, COMPLETED, INITIATED) and per_task:
            per_task[-1][t] += 1
        elif t in (
            STARTED,
            SIGNALED,
            E.EVENT_TYPE_WORKFLOW_TASK_FAILED,
            E.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT,
        ):
            pending.append(t)
    # Per child, from the parent's event times: accepted -> initiated -> started -> completed.
    at: dict[str, dict[int, float]] = collections.defaultdict(dict)
    for ev in history:
        t = ev.event_type
        ts = ev.event_time.ToNanoseconds() / 1e9
        if t == ACCEPTED:
            accepted = ev.workflow_execution_update_accepted_event_attributes
            uid = accepted.accepted_request.meta.update_id
        elif t == COMPLETED:
            uid = ev.workflow_execution_update_completed_event_attributes.meta.update_id
        elif t == INITIATED:
            uid = ev.start_child_workflow_execution_initiated_event_attributes.workflow_id
        elif t == STARTED:
            uid = (
                ev.child_workflow_execution_started_event_attributes.workflow_execution.workflow_id
            )
        else:
            continue
        h = uid.removeprefix("spawn-").rsplit("-", 1)[0] if uid.startswith("spawn-") else uid
        at[h][t] = ts

    def gap(a: int, b: int) -> float:
        xs = [v[b] - v[a] for v in at.values() if a in v and b in v]
        return round(statistics.median(xs), 3) if xs else -1

    wft: dict[int, list[float]] = collections.defaultdict(list)
    last: dict[int, float] = {}
    for ev in history:
        ts = ev.event_time.ToNanoseconds() / 1e9
        if ev.event_type == WFT_SCHEDULED:
            last[WFT_SCHEDULED] = ts
        elif ev.event_type == E.EVENT_TYPE_WORKFLOW_TASK_STARTED and WFT_SCHEDULED in last:
            wft[0].append(ts - last[WFT_SCHEDULED])
            last[E.EVENT_TYPE_WORKFLOW_TASK_STARTED] = ts
        elif ev.event_type == WFT_COMPLETED and E.EVENT_TYPE_WORKFLOW_TASK_STARTED in last:
            wft[1].append(ts - last[E.EVENT_TYPE_WORKFLOW_TASK_STARTED])
            last[WFT_COMPLETED] = ts
    accepts = [c[ACCEPTED] for c in per_task if c[ACCEPTED]]
    types = collections.Counter(E.Name(e.event_type).removeprefix("EVENT_TYPE_") for e in history)
    return {
        "n": n,
        "gate": runs_mod._SPAWNS_AT_ONCE,
        "children": children,
        "took_s": round(took, 2),
        "spawns_per_s": round((n - refused) / took, 1),
        "refused": refused,
        "lat_p50_s": round(statistics.median(lat), 2) if lat else None,
        "lat_max_s": round(max(lat), 2) if lat else None,
        "cpu_s_per_spawn": round(cpu / n, 3),
        "cpu_share": round(cpu / took, 2),
        "acc_to_init_p50": gap(ACCEPTED, INITIATED),
        "init_to_started_p50": gap(INITIATED, STARTED),
        "started_to_done_p50": gap(STARTED, COMPLETED),
        "phases_p50": {k: round(statistics.median(v), 3) for k, v in PHASES.items()},
        "wft_sched_to_start_p50": round(statistics.median(wft[0]), 3) if wft[0] else -1,
        "wft_start_to_complete_p50": round(statistics.median(wft[1]), 3) if wft[1] else -1,
        "wft_span_s": round(sum(wft[0]) + sum(wft[1]), 2),
        "root_activations": len(mine),
        "root_act_wall_p50": round(statistics.median([w for w, _ in mine]), 4) if mine else -1,
        "root_act_cpu_p50": round(statistics.median([c for _, c in mine]), 4) if mine else -1,
        "root_act_wall_sum": round(sum(w for w, _ in mine), 2),
        "other_activations": len(others),
        "other_act_wall_sum": round(sum(w for w, _ in others), 2),
        "other_act_cpu_sum": round(sum(c for _, c in others), 2),
        "creates": len(CREATES),
        "create_p50_s": round(statistics.median(CREATES), 4) if CREATES else -1,
        "create_sum_s": round(sum(CREATES), 2),
        "events": len(history),
        "wft_completed": len(per_task),
        "wft_per_spawn": round(len(per_task) / max(n - refused, 1), 2),
        "accepted_per_accepting_wft": round(statistics.mean(accepts), 2) if accepts else 0,
        "max_accepted_in_one_wft": max(accepts) if accepts else 0,
        "wft_with_accept": len(accepts),
        "wft_with_complete": sum(1 for c in per_task if c[COMPLETED]),
        "wft_with_initiate": sum(1 for c in per_task if c[INITIATED]),
        "woke": dict(woke.most_common(8)),
        "types": dict(types.most_common()),
    }


async def measure(
    sizes: list[int], children: str, reps: int, gates: list[int], child_wait_s: float
) -> list[dict[str, Any]]:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        server = DevServer(log_file=Path(tmp) / "temporal.log")
        server.start()
        try:
            async with stack(server.address) as s:
                s.runs._child_wait_s = child_wait_s
                for _ in range(reps):
                    for g in gates:
                        runs_mod._SPAWNS_AT_ONCE = g
                        for n in sizes:
                            r = await burst(s, n, children)
                            print(json.dumps(r), flush=True)
                            out.append(r)
        finally:
            server.stop()
    return out


def main() -> None:
    logging.disable(logging.CRITICAL)
    p = argparse.ArgumentParser()
    p.add_argument("sizes", nargs="*", type=int, default=[40])
    p.add_argument("--gates", type=int, nargs="*", default=[8])
    p.add_argument("--children", choices=["quiet", "busy"], default="quiet")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--child-wait", type=float, default=runs_mod.CHILD_WAIT_S)
    p.add_argument("--passthrough", default="", help='modules the sandbox passes through, or "all"')
    a = p.parse_args()
    if a.passthrough:
        _passthrough(a.passthrough)
    asyncio.run(measure(a.sizes, a.children, a.reps, a.gates, a.child_wait))


if __name__ == "__main__":
    main()
