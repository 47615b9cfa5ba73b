"""The admission policy as a pure core: no I/O, no clock, no randomness.

`decide(state, event) -> (state, actions)` over an immutable `State`; the gateway and
the simulator are the shells that report events and carry out actions.
"""

from scheduler._core import ReplicaState, RunState, State, TurnState, decide
from scheduler._types import (
    Action,
    Admit,
    Ejected,
    Event,
    Forget,
    Policy,
    PoolChanged,
    Reject,
    ReplicaProbed,
    ReplicaSpec,
    RunEnded,
    RunPhase,
    SchedulerError,
    ServiceClass,
    Tick,
    TimedOut,
    TurnAbandoned,
    TurnAlive,
    TurnArrived,
    TurnFailed,
    TurnFinished,
    TurnStarted,
    unknown_model,
)

__all__ = [
    "Action",
    "Admit",
    "Ejected",
    "Event",
    "Forget",
    "Policy",
    "PoolChanged",
    "Reject",
    "ReplicaProbed",
    "ReplicaSpec",
    "ReplicaState",
    "RunEnded",
    "RunPhase",
    "RunState",
    "SchedulerError",
    "ServiceClass",
    "State",
    "Tick",
    "TimedOut",
    "TurnAbandoned",
    "TurnAlive",
    "TurnArrived",
    "TurnFailed",
    "TurnFinished",
    "TurnStarted",
    "TurnState",
    "decide",
    "unknown_model",
]
