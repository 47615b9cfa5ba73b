"""The virtual-time simulator behind `luftpause sim`."""

from testkit.sim._arms import ARMS, Arm, Turn
from testkit.sim._run import (
    SCENARIOS,
    ArmResult,
    Scenario,
    Simulation,
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
    "simulate",
    "simulate_fanout",
]
