"""The proxy's request headers: one spelling for the gateway that reads them and the
sub-agent activities (and harnesses) that send them.  DESIGN.md "Inputs it sees".

Besides its own, the gateway reads the session headers coding harnesses send on every
request of a conversation, so that a session's turns are one run before (or without)
any tool call they could echo: `session_run`."""

import hashlib
import re
from collections.abc import Callable

RUN_HEADER = "x-luftpause-run-id"  # the run a turn belongs to (1-128 printable ASCII)
CLASS_HEADER = "x-luftpause-class"  # interactive (default) | batch
CALLER_HEADER = "x-luftpause-caller"  # who is asking, for fairness; cut to 128 bytes

CALLER_MAX_BYTES = 128

# Set by the gateway on a proxied turn's answer: the kind of engine that answered it, as
# the turn's `chat` span names it in `gen_ai.provider.name` (OpenTelemetry's GenAI
# conventions).  A sub-agent's turn activity reads it, so that the run's `invoke_agent`
# span, which the worker makes, can name the provider too: the worker only sees the
# gateway.  An engine's own header of this name is not passed on.
PROVIDER_HEADER = "x-luftpause-provider"

# Set by the gateway on a request to its MCP door when a caller's own token
# (`[[callers]]`) sent it: that caller's name.  The gateway drops a client's own.
TENANT_HEADER = "x-luftpause-tenant"

# What a harness sends on every request of one conversation, and the prefix of the run
# id it names; the first present wins.
SESSION_HEADERS: tuple[tuple[str, str], ...] = (
    ("x-claude-code-session-id", "claude-code"),  # Claude Code 2.1.86 and later
    ("session-id", "codex"),  # Codex CLI
    ("session_id", "codex"),  # Codex CLI, earlier versions
    ("x-session-affinity", "session"),  # OpenCode
    ("x-session-id", "session"),  # OpenCode 1.17 and later, OpenRouter's clients
)
# Claude Code (2.1.139 and later) names the sub-agent (Task tool) a request is of: each
# sub-agent of a session is a run of its own, as its turns share no prefix with the
# main conversation's.  The main agent sends none.
AGENT_HEADER = "x-claude-code-agent-id"
# Claude Code's routing hint (2.1.273 and later, to a gateway only with
# CLAUDE_CODE_GATEWAY_HINT_HEADERS=1): `auxiliary` requests (titles, safety checks on a
# small model) are no step of the conversation; they stay out of its run, whose phase
# (paused on a tool) they would otherwise end.  Compaction joins: it carries the
# conversation, which the run's replica holds in its cache.
REQUEST_CLASS_HEADER = "x-claude-code-request-class"
OUTSIDE_THE_RUN = frozenset({"auxiliary"})
# A run id as x-luftpause-run-id takes it; a session id that does not fit is hashed.
RUN_ID = re.compile(r"[\x21-\x2e\x30-\x7e]{1,128}")
RUN_ID_SHAPE = "expected 1 to 128 printable ASCII characters, no spaces and no /"


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
    return caller_text(name)


def caller_text(text: str) -> str:
    """A caller named in text already decoded (a query parameter, `?caller=`), as
    `caller_name` makes it of a header."""
    return text.encode(errors="replace")[:CALLER_MAX_BYTES].decode("utf-8", errors="ignore").strip()


def _named_session(header: Callable[[str], str | None]) -> tuple[str, str] | None:
    """The first session header present: (its run id prefix, its value), or None."""
    for name, prefix in SESSION_HEADERS:
        if session := (header(name) or "").strip():
            return prefix, session
    return None


def outside_the_run(header: Callable[[str], str | None]) -> bool:
    """Whether a harness says this request is not part of its session's run: a Claude
    Code request of class `auxiliary` (a title, a summary, a quick check).  It is a run
    of its own, even when it echoes the session's tool calls."""
    named = _named_session(header)
    kind = (header(REQUEST_CLASS_HEADER) or "").strip().lower()
    return named is not None and named[0] == "claude-code" and kind in OUTSIDE_THE_RUN


def session_run(header: Callable[[str], str | None]) -> str | None:
    """The run a harness's session headers name (`header(name)` reads one), or None.

    `claude-code:<session>`, with `:<agent>` for a sub-agent's requests, `codex:<session>`
    or `session:<id>`; None for a request outside its session's run (`outside_the_run`).
    A value the run id cannot carry as it is (over 128 characters in all, a `/`,
    anything but printable ASCII) is named by its SHA-256 instead."""
    named = _named_session(header)
    if named is None or outside_the_run(header):
        return None
    prefix, session = named
    if prefix == "claude-code" and (agent := (header(AGENT_HEADER) or "").strip()):
        session = f"{session}:{agent}"
    run_id = f"{prefix}:{session}"
    if RUN_ID.fullmatch(run_id):
        return run_id
    digest = hashlib.sha256(session.encode("utf-8", "replace")).hexdigest()
    return f"{prefix}:{digest[:32]}"


__all__ = [
    "AGENT_HEADER",
    "CALLER_HEADER",
    "CALLER_MAX_BYTES",
    "CLASS_HEADER",
    "PROVIDER_HEADER",
    "REQUEST_CLASS_HEADER",
    "RUN_HEADER",
    "RUN_ID",
    "RUN_ID_SHAPE",
    "SESSION_HEADERS",
    "TENANT_HEADER",
    "caller_name",
    "outside_the_run",
    "session_run",
]
