"""How long a worker takes to replay a run's whole history: what a run evicted from the
worker's cache (or queried after its close) costs before its next workflow task can
complete, against Temporal's 10 s workflow-task timeout.  Replays each history (JSON, as
`bench.wide_tree --history` or `temporal workflow show -o json` writes it) with
`temporalio.worker.Replayer` and today's `AgentRun`, in the sandbox as a worker runs it.

    PYTHONPATH=. .venv/bin/python -m bench.replay_root HISTORY.json ... [--reps R]
        [--profile FILE]

Prints one JSON line per history: its events, and each replay's seconds (the first
replay in the process also imports the sandbox's modules: one warm-up replay, not
counted, precedes them).  With --profile, one more replay of the first history runs
under cProfile (in the SDK's debug mode, which runs activations on the profiled thread:
the SDK's own work on the event loop is counted too) and its top functions by
cumulative time are printed, the stats written to FILE.  Compare two versions of the
workflow code by running this with PYTHONPATH at each checkout, alternately.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import time
from pathlib import Path

from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from workflows import AgentRun


def _load(path: Path) -> WorkflowHistory:
    return WorkflowHistory.from_json(path.stem, path.read_text(encoding="utf-8"))


async def _replay(history: WorkflowHistory, profiler: cProfile.Profile | None = None) -> float:
    began = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    try:
        result = await Replayer(
            workflows=[AgentRun],
            # Profiled: the SDK's debug mode runs each activation on this thread (which
            # cProfile sees), without its 2 s deadlock check (which profiling may pass).
            debug_mode=profiler is not None,
        ).replay_workflow(history, raise_on_replay_failure=False)
    finally:
        if profiler is not None:
            profiler.disable()
    took = time.perf_counter() - began
    if result.replay_failure is not None:
        raise SystemExit(f"{history.workflow_id}: replay failed: {result.replay_failure}")
    return took


async def _profiled(history: WorkflowHistory, out: Path) -> None:
    profiler = cProfile.Profile()
    took = await _replay(history, profiler)
    profiler.dump_stats(out)
    print(f"profiled replay of {history.workflow_id}: {took:.2f} s (under cProfile)")
    pstats.Stats(str(out)).sort_stats("cumulative").print_stats(30)


async def main_async(paths: list[Path], reps: int, profile: Path | None) -> None:
    histories = [_load(p) for p in paths]
    await _replay(histories[0])  # warm-up: the sandbox's imports
    for h in histories:
        times = [await _replay(h) for _ in range(reps)]
        print(
            json.dumps(
                {
                    "history": h.workflow_id,
                    "events": len(h.events),
                    "replay_s": [round(t, 3) for t in times],
                    "min_s": round(min(times), 3),
                }
            ),
            flush=True,
        )
    if profile is not None:
        await _profiled(histories[0], profile)


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"at least 1, not {n}")
    return n


def main() -> None:
    p = argparse.ArgumentParser(prog="bench.replay_root", description=__doc__.split("\n\n")[0])
    p.add_argument("histories", nargs="+", type=Path)
    p.add_argument("--reps", type=_positive, default=3, help="replays of each history")
    p.add_argument("--profile", type=Path, metavar="FILE", help="one more replay, profiled")
    a = p.parse_args()
    asyncio.run(main_async(a.histories, a.reps, a.profile))


if __name__ == "__main__":
    main()
