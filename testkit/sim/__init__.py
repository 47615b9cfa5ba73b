"""The virtual-time simulator behind `luftpause sim`."""

from testkit.sim._arms import ARMS, Arm, Turn
from testkit.sim._report import ratio, variant
from testkit.sim._run import (
    SCENARIOS,
    ArmResult,
    Scenario,
    Simulation,
    TurnTimes,
    percentile,
    simulate,
    simulate_fanout,
)

__all__ = [
    "ARMS",
    "SCENARIOS",
    "Arm",
    "ArmResult",
    "Scenario",
    "Simulation",
    "Turn",
    "TurnTimes",
    "percentile",
    "ratio",
    "simulate",
    "simulate_fanout",
    "variant",
]
