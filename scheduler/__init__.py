"""The admission policy as a pure core: no I/O, no clock, no randomness.

`decide(state, event) -> (state, actions)` over an immutable `State`; the gateway and
the simulator are the shells that report events and carry out actions.
"""

# The core compiled with mypyc, where `make` builds it (luftpause/native.py), is looked
# for first: build/native/scheduler/ beside this package.  Without a build, the modules
# here are imported as they are.
__path__.insert(0, __path__[0].rpartition("/")[0] + "/build/native/scheduler")

from scheduler._core import ReplicaState, RunState, State, TurnState, decide  # noqa: E402
from scheduler._types import (  # noqa: E402 (after the path above)
    Action,
    Admit,
    Drained,
    Ejected,
    Event,
    Forget,
    Policy,
    PolicyChanged,
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
    "Drained",
    "Ejected",
    "Event",
    "Forget",
    "Policy",
    "PolicyChanged",
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
