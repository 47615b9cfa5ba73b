"""The admission shell's memory of tool call ids (DESIGN: remembered 30 min, swept
every 60 s): what identifies a run that sends no run id."""

from __future__ import annotations

from gateway._shell import TOOL_CALL_MEMORY_S, AdmissionShell
from scheduler import ReplicaSpec, RunEnded, ServiceClass, State, TurnArrived


def shell() -> AdmissionShell:
    return AdmissionShell(State.initial([ReplicaSpec(name="a", models=frozenset({"m"}))]))


def end(s: AdmissionShell, run_id: str, now: float) -> None:
    """A run the core knows (one turn admitted), then ended: the core says Forget."""
    s.apply(
        TurnArrived(
            now=now, turn_id=f"{run_id}-t", run_id=run_id,
            service_class=ServiceClass.INTERACTIVE, caller="c", model="m",
        )
    )  # fmt: skip
    assert run_id in s.state.runs
    s.apply(RunEnded(now=now, run_id=run_id))


def test_an_echoed_id_names_its_run_until_it_expires() -> None:
    s = shell()
    s.remember_tool_calls("run-1", ["call_a", "call_b"], now=100.0)
    assert s.run_for_tool_calls(["nope", "call_b"], now=101.0) == "run-1"
    assert s.run_for_tool_calls(["nope"], now=101.0) is None
    expires = 100.0 + TOOL_CALL_MEMORY_S
    assert s.run_for_tool_calls(["call_a"], now=expires - 0.001) == "run-1"
    assert s.run_for_tool_calls(["call_a"], now=expires) is None  # expired, even unswept
    s.sweep_tool_calls(now=expires - 1)
    assert s.remembered_tool_calls() == 2
    s.sweep_tool_calls(now=expires)
    assert s.remembered_tool_calls() == 0


def test_a_forgotten_run_forgets_its_ids_and_only_its_own() -> None:
    s = shell()
    s.remember_tool_calls("run-1", ["call_a", "call_0"], now=0.0)
    s.remember_tool_calls("run-2", ["call_b"], now=0.0)
    s.remember_tool_calls("run-3", ["call_0"], now=1.0)  # returned again: now run-3's
    assert s.run_for_tool_calls(["call_0"], now=2.0) == "run-3"
    end(s, "run-1", now=3.0)
    assert s.run_for_tool_calls(["call_a"], now=4.0) is None
    assert s.run_for_tool_calls(["call_0"], now=4.0) == "run-3"
    assert s.run_for_tool_calls(["call_b"], now=4.0) == "run-2"
    assert s.remembered_tool_calls() == 2
