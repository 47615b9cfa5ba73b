"""The proxy's request headers: one spelling for the gateway that reads them and the
sub-agent activities (and harnesses) that send them.  DESIGN.md "Inputs it sees"."""

RUN_HEADER = "x-luftpause-run-id"  # the run a turn belongs to (1-128 printable ASCII)
CLASS_HEADER = "x-luftpause-class"  # interactive (default) | batch
CALLER_HEADER = "x-luftpause-caller"  # who is asking, for fairness; cut to 128 bytes

CALLER_MAX_BYTES = 128


def caller_name(header_text: str) -> str:
    """A caller header as a name: the header's bytes (a server hands them over decoded
    as latin-1) read as UTF-8, else as latin-1; cut to 128 bytes of UTF-8 without
    splitting a character; no surrounding blanks (HTTP forbids them in a value we send
    on).  "" when nothing is left."""
    raw = header_text.encode("latin-1", errors="replace")
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        name = raw.decode("latin-1")
    return name.encode()[:CALLER_MAX_BYTES].decode("utf-8", errors="ignore").strip()


__all__ = ["CALLER_HEADER", "CALLER_MAX_BYTES", "CLASS_HEADER", "RUN_HEADER", "caller_name"]
