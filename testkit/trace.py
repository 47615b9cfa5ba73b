"""A seeded random event trace through the scheduler core, and its digest.

Every kind of event, including contract violations, pool and policy changes, clock
jumps past the turn timeout, the KV retention and the idle-run expiry, and a drain
nine tenths of the way (the events after it run on a draining core).  Two
processes that run the same trace must print the same digest: the compiled core and
the interpreted one (luftpause/native.py), and any two hash seeds (the core's actions
must not depend on a map's order).  `python -m testkit.trace [seed [events [runs [callers]]]]`."""

from __future__ import annotations

import hashlib
import random
import sys

from scheduler import (
    Drained,
    Policy,
    PolicyChanged,
    PoolChanged,
    ReplicaProbed,
    ReplicaSpec,
    RunEnded,
    SchedulerError,
    ServiceClass,
    State,
    Tick,
    TurnAbandoned,
    TurnAlive,
    TurnArrived,
    TurnFailed,
    TurnFinished,
    TurnStarted,
    decide,
)
from scheduler._types import Event

_MODELS = ("m0", "m1")


def _pool(rng: random.Random) -> tuple[ReplicaSpec, ...]:
    specs = []
    for i in range(rng.randint(1, 4)):
        models = frozenset(m for m in _MODELS if rng.random() < 0.7) or frozenset({"m0"})
        kv = rng.choice([None, 6_000, 20_000])
        device = rng.choice([None, "g0", "g0", "g1"])  # replicas sharing a GPU (rule 13)
        slots = rng.choice([None, None, 3])  # the engine's running-request limit
        specs.append(
            ReplicaSpec(name=f"r{i}", models=models, kv_tokens=kv, device=device, slots=slots)
        )
    return tuple(specs)


def _policy(rng: random.Random) -> Policy:
    return Policy(
        strict_affinity=rng.random() < 0.8,
        kv_admission=rng.random() < 0.8,
        reserve_for_paused_interactive=rng.random() < 0.8,
        lane_batch_kv_fill=rng.choice([None, 0.3]),
        max_held_per_caller=rng.choice([None, None, 2]),
        eject_after_failures=rng.choice([None, 2]),
        pack_shared_devices=rng.random() < 0.7,
    )


def _event(
    rng: random.Random, now: float, k: int, turns: list[str], runs: int, callers: int
) -> Event:
    roll = rng.random()
    known = rng.choice(turns) if turns and rng.random() < 0.95 else f"t{rng.randrange(k + 1)}"
    if roll < 0.30:
        return TurnArrived(
            now=now,
            turn_id=f"t{k}" if rng.random() < 0.98 else known,  # now and then a duplicate
            run_id=f"run{rng.randrange(runs)}",
            service_class=rng.choice([ServiceClass.INTERACTIVE, ServiceClass.BATCH]),
            caller=f"c{rng.randrange(callers)}",
            model=rng.choice(_MODELS + ("m9",)) if rng.random() < 0.05 else rng.choice(_MODELS),
            prompt_tokens=rng.choice([0, 500, 3_000, 9_000]),
            max_tokens=rng.choice([0, 200, 50_000]),
        )
    if roll < 0.40:
        return TurnStarted(now=now, turn_id=known)
    if roll < 0.45:
        return TurnAlive(now=now, turn_id=known)
    if roll < 0.65:
        return TurnFinished(
            now=now,
            turn_id=known,
            finish_reason=rng.choice(["stop", "tool_calls", "tool_calls", "length"]),
            prompt_tokens=rng.choice([0, 1_000, 6_000]),
            completion_tokens=rng.randrange(400),
            cached_tokens=rng.choice([None, None, 0, 800]),  # None: not said, or a miss
        )
    if roll < 0.72:
        return TurnFailed(now=now, turn_id=known, engine_fault=rng.random() < 0.6)
    if roll < 0.76:
        return TurnAbandoned(now=now, turn_id=known)
    if roll < 0.79:
        return RunEnded(now=now, run_id=f"run{rng.randrange(runs)}")
    if roll < 0.93:
        queued = rng.choice([None, 0, 0, 1, 3])
        return ReplicaProbed(
            now=now,
            replica=f"r{rng.randrange(5)}",  # r4 is never in the pool: a violation
            healthy=rng.random() < 0.9,
            queued=queued,
            running=None if queued is None else rng.randrange(1, 5),
            kv_tokens=rng.choice([None, None, 12_000]),
            slots=rng.choice([None, None, None, 2, 5]),
            repeated=rng.random() < 0.1,
        )
    if roll < 0.97:
        return Tick(now=now)
    if roll < 0.985:
        return PoolChanged(now=now, replicas=_pool(rng))
    return PolicyChanged(now=now, policy=_policy(rng))


def digest(seed: int = 0, events: int = 3_000, runs: int = 25, callers: int = 5) -> str:
    """The sha256 of every step's actions (or contract error) and the state after it.
    Many `runs` and `callers` make large held-turn orders and timers (their persistent
    sets split into many chunks)."""
    rng = random.Random(seed)
    state = State.initial(_pool(rng), _policy(rng))
    h = hashlib.sha256()
    now = 0.0
    turns: list[str] = []
    for k in range(events):
        # Mostly small steps; now and then a jump past the timeouts and the expiry.
        now += rng.choice([0.1, 0.5, 2.0, 30.0, 700.0, 2_000.0]) if rng.random() < 0.05 else 0.2
        event = _event(rng, now, k, turns, runs, callers)
        if k == events * 9 // 10:
            event = Drained(now=now, message="stopping")
        try:
            state, actions = decide(state, event)
        except SchedulerError as exc:
            h.update(f"{k} error {exc}\n".encode())
            continue
        if isinstance(event, TurnArrived) and event.turn_id == f"t{k}":
            turns.append(event.turn_id)
        h.update(f"{k} {actions!r}\n".encode())
        h.update(repr(_summary(state)).encode())
    return h.hexdigest()


def _summary(state: State) -> tuple[object, ...]:
    """The state in an order of its own (a map's or a set's order is its hashes')."""
    return (
        [
            (n, sorted(r.spec.models), r.spec.kv_tokens, r.spec.device, r.spec.slots)
            + tuple(r._values()[1:])
            for n, r in sorted(state.replicas.items())
        ],
        sorted(state.runs.items()),
        sorted(state.turns.items()),
        state.held_count(),
        sorted(state.retired),
        state.draining,
    )


def main(argv: list[str]) -> None:
    """`python -m testkit.trace [seed [events [runs [callers]]]]`"""
    numbers = [int(a) for a in argv]
    print(digest(*numbers))


if __name__ == "__main__":
    main(sys.argv[1:])
