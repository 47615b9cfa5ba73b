"""Comparisons across arms: the figures `luftpause sim` prints (P, W, ratios)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

from luftpause.native import core_build
from scheduler import (
    Admit,
    Policy,
    ReplicaProbed,
    ReplicaSpec,
    ServiceClass,
    State,
    TurnArrived,
    TurnFinished,
    TurnStarted,
    decide,
)
from testkit.sim._arms import ARMS
from testkit.sim._run import Scenario, simulate, simulate_fanout

APPROXIMATION_NOTE = (
    "direct, round_robin, cache_aware and priority are approximations of the SGLang "
    "router and SMG policies, program of vllm-router's program-level scheduling, for "
    "fast iteration only; the SGLang router and SMG are measured in real time by "
    "`luftpause bench flood|light|routing` (vllm-router is not)."
)
# The reference arms run under each of these and keep the better result, so that P
# and W are measured against the best the engines do alone, not a weak baseline.
REFERENCE_ARMS = ("cache_aware", "luftpause")


def compare(sc: Scenario, arms: Sequence[str] = ARMS) -> dict[str, Any]:
    """Every arm on the mixed workload, plus the two reference arms, with P and W."""
    results = {a: simulate(sc, a) for a in arms}
    alone_i = max(
        (simulate(sc, a, batch=False) for a in REFERENCE_ARMS),
        key=lambda r: r.interactive_per_min,
    )
    alone_b = max(
        (simulate(sc, a, interactive=False) for a in REFERENCE_ARMS),
        key=lambda r: r.batch_per_min,
    )
    out: dict[str, Any] = {
        "scenario": _scenario_json(sc),
        "note": APPROXIMATION_NOTE,
        "reference": {
            "interactive-alone": {**alone_i.as_json(), "arm": alone_i.arm},
            "batch-alone": {**alone_b.as_json(), "arm": alone_b.arm},
        },
        "arms": {},
    }
    ia, ba = alone_i.interactive_per_min, alone_b.batch_per_min
    for name, r in results.items():
        row = r.as_json()
        row["interactive_vs_alone"] = ratio(r.interactive_per_min, ia)
        row["batch_vs_alone"] = ratio(r.batch_per_min, ba)
        row["P"] = row["interactive_vs_alone"]
        row["W"] = ratio(r.interactive_per_min + r.batch_per_min, ba)
        row["ratios"] = {
            other: {
                "interactive": ratio(r.interactive_per_min, o.interactive_per_min),
                "batch": ratio(r.batch_per_min, o.batch_per_min),
            }
            for other, o in results.items()
            if other != name
        }
        out["arms"][name] = row
    out["wall_s"] = round(
        sum(r.wall_s for r in results.values()) + alone_i.wall_s + alone_b.wall_s, 2
    )
    return out


def compare_fanout(
    sc: Scenario, arms: Sequence[str] = ("luftpause", "cache_aware")
) -> dict[str, Any]:
    """`sc.runs` runs fanned out together vs one at a time, per arm."""
    out: dict[str, Any] = {"scenario": _scenario_json(sc), "note": APPROXIMATION_NOTE}
    rows = {}
    for a in arms:
        together = simulate_fanout(sc, a, together=True)
        alone = simulate_fanout(sc, a, together=False)
        slowest_alone = max(alone.interactive_durations)
        rows[a] = {
            "fanned_out_s": round(together.makespan_s, 2),
            "one_at_a_time_s": round(alone.makespan_s, 2),
            "slowest_run_alone_s": round(slowest_alone, 2),
            "speedup": ratio(alone.makespan_s, together.makespan_s),
            "fanned_out_vs_slowest_alone": ratio(together.makespan_s, slowest_alone),
            "cached_prompt_token_share": round(together.cached_share, 3),
        }
    out["arms"] = rows
    return out


def ratio(a: float, b: float) -> float | None:
    """a / b to three places; None when b is 0."""
    return round(a / b, 3) if b else None


def _scenario_json(sc: Scenario) -> dict[str, Any]:
    return asdict(sc)


# --------------------------------------------------------------------------- tables


def table(report: dict[str, Any]) -> str:
    """A fixed-width table of a `compare` report."""
    head = (
        f"{'arm':<20}{'int/min':>9}{'int p50':>9}{'int p90':>9}{'batch/min':>11}"
        f"{'cached':>8}{'moved':>7}{'P':>7}{'W':>7}{'B':>7}"
    )
    lines = [head, "-" * len(head)]

    def fmt(x: Any, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    for name, r in [
        ("interactive-alone", report["reference"]["interactive-alone"]),
        ("batch-alone", report["reference"]["batch-alone"]),
        *report["arms"].items(),
    ]:
        lines.append(
            f"{name:<20}{r['interactive_runs_per_min']:>9.2f}"
            f"{fmt(r['interactive_p50_s'], '.1f'):>9}{fmt(r['interactive_p90_s'], '.1f'):>9}"
            f"{r['batch_runs_per_min']:>11.2f}{r['cached_prompt_token_share']:>8.1%}"
            f"{r['runs_that_moved']:>7}{fmt(r.get('P'), '.2f'):>7}{fmt(r.get('W'), '.2f'):>7}"
            f"{fmt(r.get('batch_vs_alone'), '.2f'):>7}"
        )
    ref = report["reference"]
    lines.append(
        "(P: interactive runs/min / interactive-alone's; W: all runs/min / batch-alone's, "
        "an interactive run counted as a batch run's work; B: batch runs/min / "
        "batch-alone's)"
    )
    for name, r in report["arms"].items():
        w, b = r.get("W"), r.get("batch_vs_alone")
        if w is not None and b is not None and (w > 1 or b < 0.5):
            lines.append(
                f"note: {name}: W {w:.2f} with B {b:.2f}: batch work is not kept whole, "
                "whatever W says (W > 1 when interactive runs, lighter, stand in for it; "
                "a short --minutes undercounts long batch runs)"
            )
    lines.append(
        f"(interactive-alone under {ref['interactive-alone']['arm']}, batch-alone under "
        f"{ref['batch-alone']['arm']}: the better of {', '.join(REFERENCE_ARMS)})"
    )
    lines.append(report["note"])
    return "\n".join(lines)


def fanout_table(report: dict[str, Any]) -> str:
    head = f"{'arm':<14}{'fanned out s':>14}{'one at a time s':>17}{'slowest alone s':>17}"
    lines = [head, "-" * len(head)]
    for name, r in report["arms"].items():
        lines.append(
            f"{name:<14}{r['fanned_out_s']:>14.1f}{r['one_at_a_time_s']:>17.1f}"
            f"{r['slowest_run_alone_s']:>17.1f}"
        )
    lines.append(report["note"])
    return "\n".join(lines)


# --------------------------------------------------------------------------- bench-core


def bench_core(held: int = 10_000, decisions: int = 50_000, replicas: int = 4) -> dict[str, Any]:
    """Decisions per second of the core while `held` turns are held.

    Replicas are full (capped); `held` turns wait, from one caller per 10 held turns, half
    of them batch.  Each cycle is the events one turn brings the gateway: a turn
    finishes (the core picks the best held turn and admits it), the admitted turn
    starts (first byte), and a new turn arrives and is held, so the held count stays
    at `held`.  Only `decide` is timed, not building the events."""
    specs = [ReplicaSpec(name=f"r{i}", models=frozenset({"m"})) for i in range(replicas)]
    state = State.initial(specs, Policy())
    cap = 8
    for i in range(replicas):
        for _ in range(state.policy.cap_after_queued_probes):  # a queue that persists
            probe = ReplicaProbed(now=0.0, replica=f"r{i}", healthy=True, queued=1, running=cap)
            state, _ = decide(state, probe)
    callers = max(1, held // 10)
    admitted: deque[str] = deque()

    def arrival(k: int, now: float) -> TurnArrived:
        return TurnArrived(
            now=now,
            turn_id=f"t{k}",
            run_id=f"run{k}",
            service_class=ServiceClass.BATCH if k % 2 else ServiceClass.INTERACTIVE,
            caller=f"c{k % callers}",
            model="m",
            prompt_tokens=2000,
            max_tokens=256,
        )

    n = held + cap * replicas
    for k in range(n):
        state, actions = decide(state, arrival(k, 1.0))
        admitted.extend(a.turn_id for a in actions if isinstance(a, Admit))
    assert state.held_count() == held, state.held_count()
    clock = time.perf_counter
    elapsed = 0.0
    done = 0
    now = 2.0
    while done < decisions:
        now += 0.001
        finished = TurnFinished(
            now=now,
            turn_id=admitted.popleft(),
            finish_reason="stop",
            prompt_tokens=2000,
            completion_tokens=256,
        )
        t0 = clock()
        state, actions = decide(state, finished)
        elapsed += clock() - t0
        new = [a.turn_id for a in actions if isinstance(a, Admit)]
        admitted.extend(new)
        for tid in new:
            started = TurnStarted(now=now, turn_id=tid)
            t0 = clock()
            state, _ = decide(state, started)
            elapsed += clock() - t0
        arrived = arrival(n, now)
        t0 = clock()
        state, _ = decide(state, arrived)
        elapsed += clock() - t0
        n += 1
        done += 2 + len(new)
    return {
        "held_turns": state.held_count(),
        "decisions": done,
        "seconds": round(elapsed, 3),
        "decisions_per_s": round(done / elapsed),
        "replicas": replicas,
        "callers": callers,
        "core": core_build(),  # compiled (mypyc) or interpreted: luftpause/native.py
    }


def scenario_with(sc: Scenario, **changes: Any) -> Scenario:
    return replace(sc, **{k: v for k, v in changes.items() if v is not None})


def variant(sc: Scenario, changes: dict[str, object]) -> Scenario:
    """The scenario with a measured variant's changes: scheduler Policy fields by name,
    the simulated engines' EngineParams fields as `engine.<field>`."""
    engine = {k.removeprefix("engine."): v for k, v in changes.items() if k.startswith("engine.")}
    policy = {k: v for k, v in changes.items() if not k.startswith("engine.")}
    return replace(
        sc,
        policy=replace(sc.policy, **policy),  # type: ignore[arg-type]
        engine=replace(sc.engine, **engine),  # type: ignore[arg-type]
    )
