"""The admission shell's memory of tool call ids (DESIGN: remembered 30 min, swept
every 60 s): what identifies a run that sends no run id."""

from __future__ import annotations

from dataclasses import replace

from gateway._shell import TOOL_CALL_MEMORY_S, AdmissionShell
from scheduler import (
    Admit,
    ReplicaSpec,
    RunEnded,
    ServiceClass,
    State,
    TurnArrived,
    TurnFinished,
)


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


def turn(
    n: int, caller: str = "c", prompt: int = 0, model: str = "m", now: float | None = None
) -> TurnArrived:
    """Turn `tn` of run `rn`, interactive, arriving at `now` (default: n seconds)."""
    return TurnArrived(
        now=float(n) if now is None else now, turn_id=f"t{n}", run_id=f"r{n}",
        service_class=ServiceClass.INTERACTIVE, caller=caller, model=model,
        prompt_tokens=prompt,
    )  # fmt: skip


def test_an_echoed_id_names_its_run_until_it_expires() -> None:
    s = shell()
    s.remember_tool_calls("run-1", "c", ["call_a", "call_b"], now=100.0)
    assert s.run_for_tool_calls("c", ["nope", "call_b"], now=101.0) == "run-1"
    assert s.run_for_tool_calls("c", ["nope"], now=101.0) is None
    expires = 100.0 + TOOL_CALL_MEMORY_S
    assert s.run_for_tool_calls("c", ["call_a"], now=expires - 0.001) == "run-1"
    assert s.run_for_tool_calls("c", ["call_a"], now=expires) is None  # expired, even unswept
    s.sweep_tool_calls(now=expires - 1)
    assert s.remembered_tool_calls() == 2
    s.sweep_tool_calls(now=expires)
    assert s.remembered_tool_calls() == 0


def test_a_forgotten_run_forgets_its_ids_and_only_its_own() -> None:
    s = shell()
    s.remember_tool_calls("run-1", "c", ["call_a", "call_0"], now=0.0)
    s.remember_tool_calls("run-2", "c", ["call_b"], now=0.0)
    s.remember_tool_calls("run-1", "c", ["call_0"], now=1.0)  # its own again: still its own
    assert s.run_for_tool_calls("c", ["call_0"], now=2.0) == "run-1"
    end(s, "run-1", now=3.0)
    assert s.run_for_tool_calls("c", ["call_a"], now=4.0) is None
    assert s.run_for_tool_calls("c", ["call_0"], now=4.0) is None
    assert s.run_for_tool_calls("c", ["call_b"], now=4.0) == "run-2"
    assert s.remembered_tool_calls() == 1


def test_an_id_is_its_callers_and_an_id_two_runs_were_given_names_neither() -> None:
    # Parsers that number calls (Kimi-K2: functions.<name>:<n>) give every run the same
    # ids: an echo of one must never put a turn into somebody else's run.
    s = shell()
    same = "functions.lookup:0"
    s.remember_tool_calls("run-a", "alice", [same], now=0.0)
    s.remember_tool_calls("run-b", "bob", [same], now=0.0)
    assert s.run_for_tool_calls("alice", [same], now=1.0) == "run-a"
    assert s.run_for_tool_calls("bob", [same], now=1.0) == "run-b"
    assert s.run_for_tool_calls("carol", [same], now=1.0) is None

    s.remember_tool_calls("run-a2", "alice", [same, "call_x"], now=2.0)
    assert s.run_for_tool_calls("alice", [same], now=3.0) is None  # run-a's or run-a2's
    assert s.run_for_tool_calls("alice", [same, "call_x"], now=3.0) == "run-a2"
    end(s, "run-a", now=4.0)  # the ambiguity is nobody's to forget
    assert s.run_for_tool_calls("alice", [same], now=5.0) is None
    later = 2.0 + TOOL_CALL_MEMORY_S  # once it expires, the next run to get it owns it
    s.remember_tool_calls("run-a3", "alice", [same], now=later)
    assert s.run_for_tool_calls("alice", [same], now=later + 1) == "run-a3"
    s.sweep_tool_calls(now=later + TOOL_CALL_MEMORY_S)
    assert s.remembered_tool_calls() == 0


def test_a_client_that_leaves_as_its_turn_is_admitted_left_it_and_did_not_abandon_it() -> None:
    # hold() gives None when the client left, even if the admission came in the same
    # step of the loop; reported as abandoned, such a turn counted on its replica as one
    # the gateway stopped (shutdown) (helper-103).
    from gateway._proxy import left_while_held
    from scheduler import ReplicaProbed, TurnAbandoned, TurnFailed

    s = AdmissionShell(State.initial([ReplicaSpec(name="a", models=frozenset({"m"}), slots=1)]))
    s.apply(ReplicaProbed(now=0.0, replica="a", healthy=True))
    for turn in ("t1", "t2"):
        s.apply(
            TurnArrived(
                now=1.0, turn_id=turn, run_id=f"r-{turn}",
                service_class=ServiceClass.INTERACTIVE, caller="c", model="m",
            )
        )  # fmt: skip
    assert s.state.turns["t1"].replica == "a" and s.state.turns["t2"].replica is None
    admitted = left_while_held(s, "t1", 2.0)
    assert isinstance(admitted, TurnFailed) and admitted.client_left
    assert not admitted.engine_fault
    assert isinstance(left_while_held(s, "t2", 2.0), TurnAbandoned)
    s.apply(admitted)  # its slot is freed: the held turn goes in
    assert s.state.turns["t2"].replica == "a"


async def test_a_draining_gateway_refuses_held_turns_and_every_turn_after() -> None:
    # A slot free after the drain began still started a new turn on a stopping gateway,
    # to be cut at the end of the shutdown's grace (helper-116): it is refused 503 at
    # once, as the held ones are (the core's rule 14), and counted as refused.
    from gateway._shell import Rejected
    from gateway.metrics import GatewayMetrics

    spec = ReplicaSpec(name="a", models=frozenset({"m"}), slots=1)
    s: AdmissionShell | None = None
    m = GatewayMetrics(lambda: (s.state, {}) if s is not None else None)
    s = AdmissionShell(State.initial([spec]), observer=m.observe)

    first, second = s.arrive(turn(1)), s.arrive(turn(2))
    assert first.result() == "a" and not second.done()  # one slot: the second is held
    assert s.drain(3.0, "stopping") == 1
    assert second.result() == Rejected(503, "stopping")
    assert "t2" not in s.state.turns
    s.apply(TurnFinished(now=4.0, turn_id="t1", prompt_tokens=1, completion_tokens=1,
                         finish_reason="stop"))  # fmt: skip
    late = s.arrive(turn(5))  # the slot is free again
    assert late.result() == Rejected(503, "stopping")
    assert "t5" not in s.state.turns and "r5" not in s.state.runs
    assert s.drain(6.0, "later") == 0 and s.state.draining == "stopping"
    assert s.arrive(turn(7, model="nope")).result() == Rejected(503, "stopping")  # no 404

    def sample(name: str, **labels: str) -> float:
        return m.registry.get_sample_value(name, labels) or 0.0

    assert sample("luftpause_rejected_turns_total", status="503") == 3.0
    assert sample("luftpause_turns_total", outcome="rejected") == 3.0
    assert sample("luftpause_turns_total", outcome="abandoned") == 0.0
    assert sample("luftpause_admissions_total", replica="a", **{"class": "interactive"}) == 1.0


async def test_a_drain_admits_none_of_the_turns_it_refuses() -> None:
    # Each held turn was told to the core as abandoned one at a time, and a refusal
    # that freed room let the core admit a later held turn before its own refusal:
    # here the turn waiting for KV goes, and the one held behind it fits (helper-164).
    # The core now refuses every held turn in one decision, with no refill between.
    # It started on a stopping gateway, to be cut at the end of the grace.
    from gateway._shell import Rejected

    spec = ReplicaSpec(name="a", models=frozenset({"m"}), kv_tokens=1000)
    s = AdmissionShell(State.initial([spec]))

    assert s.arrive(turn(0, "c0", 44)).result() == "a"  # claims 300 of a's 800 (kv_fill 0.8)
    big = s.arrive(turn(1, "c1", 500))  # needs 756: waits for KV
    small = s.arrive(turn(2, "c2", 10))  # fits, but does not pass the turn waiting for KV
    assert not big.done() and not small.done()
    assert s.drain(3.0, "stopping") == 2
    assert big.result() == small.result() == Rejected(503, "stopping")
    assert set(s.state.turns) == {"t0"}  # the core holds and runs nothing else
    assert s.state.replicas["a"].in_flight == 1


async def test_a_drain_admits_none_across_buckets() -> None:
    # When the shell refused held turns one at a time, in an order of its own, a
    # caller's oldest held turn for another model's replica (or of the other class)
    # did not move its turns in this bucket: the core orders each bucket by the
    # caller's oldest turn in it.  x's T (model n, for z) is older than y's B, but in
    # m's bucket B comes first, waiting for a's KV, x's t4 behind it (helper-171).
    from gateway._shell import Rejected

    specs = [
        ReplicaSpec(name="a", models=frozenset({"m"}), kv_tokens=1000, slots=2),
        ReplicaSpec(name="z", models=frozenset({"n"}), slots=1),
    ]
    s = AdmissionShell(State.initial(specs))
    assert s.arrive(turn(0, "w", 10, model="n")).result() == "z"  # z full
    old = s.arrive(turn(1, "x", 10, model="n"))  # T: x's oldest, held for z
    assert s.arrive(turn(2, "v", 44)).result() == "a"
    s.apply(
        TurnFinished(
            now=2.5, turn_id="t2", prompt_tokens=44, completion_tokens=1, finish_reason="tool_calls"
        )
    )  # fmt: skip  (v's claim stays on a)
    b = s.arrive(turn(3, "y", 500))  # waits for a's KV
    t4 = s.arrive(turn(4, "x", 10))  # would fit; behind B in m's bucket
    assert not (old.done() or b.done() or t4.done())
    admitted: list[str] = []
    s._observer = lambda before, event, actions: admitted.extend(
        a.turn_id for a in actions if isinstance(a, Admit)
    )
    assert s.drain(5.0, "stopping") == 3
    for held in (old, b, t4):
        assert held.result() == Rejected(503, "stopping")
    assert admitted == []  # the core admitted none of them
    assert set(s.state.turns) == {"t0"} and s.state.replicas["a"].in_flight == 0


async def test_a_drain_counts_no_admission_for_a_turn_it_refuses() -> None:
    # The same drain: the small turn, admitted by the core when the big one's refusal
    # freed its KV, and then refused, was counted an admission and an engine turn
    # `abandoned` ("the gateway stopped it"), though nothing reached the engine
    # (helper-166).  Refused in one decision with the others, it never is.
    from gateway._shell import Rejected
    from gateway.metrics import GatewayMetrics

    spec = ReplicaSpec(name="a", models=frozenset({"m"}), kv_tokens=1000)
    shell: AdmissionShell | None = None
    m = GatewayMetrics(lambda: (shell.state, {}) if shell is not None else None)
    shell = AdmissionShell(State.initial([spec]), observer=m.observe)

    assert shell.arrive(turn(0, "c0", 44)).result() == "a"
    big, small = shell.arrive(turn(1, "c1", 500)), shell.arrive(turn(2, "c2", 10))
    assert shell.drain(3.0, "stopping") == 2
    assert big.result() == small.result() == Rejected(503, "stopping")

    def sample(name: str, **labels: str) -> float:
        return m.registry.get_sample_value(name, labels) or 0.0

    admitted = sample("luftpause_admissions_total", replica="a", **{"class": "interactive"})
    stopped = sample("luftpause_engine_turns_total", replica="a", outcome="abandoned")
    assert (admitted, stopped) == (1.0, 0.0)  # t0 only; nothing went to the engine


async def test_a_reload_keeps_the_turn_timeout_of_turns_already_admitted() -> None:
    # The proxy waits for a turn's engine as long as the shell says at its admission.
    # A reload that shortened turn_timeout_s made the core free, at its next tick, the
    # slot of a turn the proxy still waited on, and a second turn went to the one-slot
    # engine beside it (helper-164).
    from dataclasses import replace

    from scheduler import Policy, PolicyChanged, Tick

    spec = ReplicaSpec(name="a", models=frozenset({"m"}), slots=1)
    s = AdmissionShell(State.initial([spec]))

    assert s.arrive(turn(1, now=0.0)).result() == "a"
    second = s.arrive(turn(2, now=1.0))
    s.apply(PolicyChanged(now=100.0, policy=replace(Policy(), turn_timeout_s=60.0)))
    assert s.turn_timeout("t1") == Policy().turn_timeout_s  # the proxy's wait for t1
    assert s.turn_timeout("t2") == 60.0  # held: it gets the value at its admission
    s.apply(Tick(now=120.0))
    assert not second.done()  # t1 still runs there
    s.apply(Tick(now=Policy().turn_timeout_s))
    assert second.result() == "a"
    assert s.turn_timeout("t2") == 60.0


async def test_a_drain_by_callers_in_flight_counts_no_admission() -> None:
    # One replica, one model: y's later turn, waiting for KV, comes before x's earlier
    # one in the core's order (x has a turn in flight); refused by arrival alone, y's
    # went first and the core admitted x's (helper-170).
    from gateway._shell import Rejected
    from gateway.metrics import GatewayMetrics

    spec = ReplicaSpec(name="a", models=frozenset({"m"}), kv_tokens=2000, slots=2)
    shell: AdmissionShell | None = None
    m = GatewayMetrics(lambda: (shell.state, {}) if shell is not None else None)
    shell = AdmissionShell(State.initial([spec]), observer=m.observe)

    assert shell.arrive(turn(0, "x", 10)).result() == "a"  # x: a turn in flight
    assert shell.arrive(turn(1, "w", 400)).result() == "a"  # both slots taken
    small = shell.arrive(turn(2, "x", 10))
    big = shell.arrive(turn(3, "y", 800))
    shell.apply(TurnFinished(now=4.0, turn_id="t1", prompt_tokens=400, completion_tokens=1,
                             finish_reason="tool_calls"))  # fmt: skip
    assert not small.done() and not big.done()  # y's first, waiting for KV; x's behind

    def sample(name: str, **labels: str) -> float:
        return m.registry.get_sample_value(name, labels) or 0.0

    admitted = sample("luftpause_admissions_total", replica="a", **{"class": "interactive"})
    assert shell.drain(5.0, "stopping") == 2
    assert small.result() == big.result() == Rejected(503, "stopping")
    after = sample("luftpause_admissions_total", replica="a", **{"class": "interactive"})
    stopped = sample("luftpause_engine_turns_total", replica="a", outcome="abandoned")
    assert (after - admitted, stopped) == (0.0, 0.0)


async def test_a_drain_admits_none_across_classes() -> None:
    # x's oldest held turn is batch, waiting for a slot: in the shell's old order by a
    # caller's oldest anywhere it moved x's interactive turn ahead of y's, which waits
    # for KV ahead of it in the core's; y's refusal let the core admit x's (helper-171).
    from gateway._shell import Rejected
    from gateway.metrics import GatewayMetrics

    spec = ReplicaSpec(name="a", models=frozenset({"m"}), kv_tokens=2000, slots=2)
    shell: AdmissionShell | None = None
    m = GatewayMetrics(lambda: (shell.state, {}) if shell is not None else None)
    shell = AdmissionShell(State.initial([spec]), observer=m.observe)
    assert shell.arrive(turn(0, "v", 10)).result() == "a"
    assert shell.arrive(turn(1, "w", 400)).result() == "a"  # both slots taken
    batch = shell.arrive(replace(turn(2, "x", 10), service_class=ServiceClass.BATCH))
    big = shell.arrive(turn(3, "y", 800))
    small = shell.arrive(turn(4, "x", 10))
    shell.apply(
        TurnFinished(
            now=5.0,
            turn_id="t1",
            prompt_tokens=400,
            completion_tokens=1,
            finish_reason="tool_calls",
        )
    )  # fmt: skip  (w's claim stays)
    assert not (batch.done() or big.done() or small.done())
    admitted = m.registry.get_sample_value(
        "luftpause_admissions_total", {"replica": "a", "class": "interactive"}
    )
    assert shell.drain(6.0, "stopping") == 3
    for held in (batch, big, small):
        assert held.result() == Rejected(503, "stopping")
    after = m.registry.get_sample_value(
        "luftpause_admissions_total", {"replica": "a", "class": "interactive"}
    )
    assert after == admitted
