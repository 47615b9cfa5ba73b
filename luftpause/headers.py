"""The proxy's request headers: one spelling for the gateway that reads them and the
sub-agent activities (and harnesses) that send them.  DESIGN.md "Inputs it sees"."""

RUN_HEADER = "x-luftpause-run-id"  # the run a turn belongs to (1-128 printable ASCII)
CLASS_HEADER = "x-luftpause-class"  # interactive (default) | batch
CALLER_HEADER = "x-luftpause-caller"  # who is asking, for fairness; cut to 128 bytes

__all__ = ["CALLER_HEADER", "CLASS_HEADER", "RUN_HEADER"]
