"""What crosses the activity boundary: one dataclass in and out of every activity.

Workflows import these; activities implement them.  Fields only grow, with defaults, so
histories recorded by an older worker still decode.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "IDEMPOTENCY_META_KEY",
    "NOT_SENT",
    "TOOL_TIMED_OUT",
    "CheckedArguments",
    "EndRunInput",
    "ToolCall",
    "ToolInfo",
    "ToolInput",
    "ToolOutput",
    "ToolsWanted",
    "TurnInput",
    "TurnOutput",
]


# Sent in every tools/call's `_meta`: "<run id>/<tool call id>".  A call of a tool its
# server marks read-only or idempotent is sent again when the worker running it dies
# (Temporal runs an activity at least once); a server that remembers this key can
# answer the repeat with the first call's result.  Other tools' calls are sent at most
# once (workflows/agent_run.py).
IDEMPOTENCY_META_KEY = "io.luftpause/idempotency-key"

# The ApplicationError type of a tool call that never left the worker: its server could
# not be reached (connecting, or opening the session).  Sending it later is safe for
# every tool; any other failure may come after the server ran the call.
NOT_SENT = "McpUnreachable"
# The ApplicationError type of a call sent and not answered within its tool's time
# (`ToolInput.timeout_s`): cut, and the server told to cancel it.  It may have run.
TOOL_TIMED_OUT = "ToolTimedOut"


@dataclass(frozen=True)
class ToolCall:
    """One tool call the model asked for; `arguments` is the JSON text it wrote."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class TurnInput:
    """One LLM turn of a run, sent through the gateway as that run's turn."""

    run_id: str
    model: str
    messages: list[dict[str, Any]]
    # OpenAI function tools offered this turn; empty = the model must answer.
    tools: list[dict[str, Any]] = field(default_factory=list)
    max_tokens: int = 256  # 0 = the engine decides
    parallel_tool_calls: bool = False
    service_class: str = "interactive"
    caller: str = "anonymous"


@dataclass(frozen=True)
class TurnOutput:
    """The assistant message to append, its tool calls and what the turn cost."""

    message: dict[str, Any]
    tool_calls: list[ToolCall]
    finish_reason: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    seconds: float = 0.0
    # The calls were written as text and recovered into tool calls.
    recovered: bool = False
    # The `gen_ai.provider.name` of the engine that answered, as the gateway's answer
    # names it (`x-luftpause-provider`), for the run's `invoke_agent` span; "" when it
    # names none (an older gateway, a peer router in a benchmark).
    provider: str = ""


@dataclass(frozen=True)
class ToolInfo:
    """An upstream tool sub-agents may call, as its MCP server lists it."""

    server: str
    name: str
    description: str
    input_schema: dict[str, Any]
    read_only: bool = False
    destructive: bool = False
    idempotent: bool = False  # its server's idempotentHint
    # The function name the model is offered and calls, when engines would refuse the
    # tool's own (activities/tool_names.py); "" = its own name.
    function: str = ""
    # How long one call may take, in seconds (its server's `tool_timeout_s`); 0 = the
    # workflow's TOOL_TIMEOUT (a listing by a worker from before this field).
    timeout_s: float = 0.0

    @property
    def offered(self) -> str:
        """The name the run's model knows the tool by."""
        return self.function or self.name

    @property
    def repeatable(self) -> bool:
        """Whether a call that may have run can be sent again: the server marks the tool
        read-only or idempotent (MCP's hints; both default to false)."""
        return self.read_only or self.idempotent

    def openai_tool(self) -> dict[str, Any]:
        """The tool as an OpenAI chat completions `tools` entry."""
        return {
            "type": "function",
            "function": {
                "name": self.offered,
                "description": self.description,
                "parameters": self.input_schema,
            },
        }


def chosen_tools(listed: Sequence[ToolInfo], names: Collection[str] | None) -> list[ToolInfo]:
    """The tools of a listing that `names` asks for (None: all): each by the name its
    model is offered (`web__search`, a tool whose name an earlier server's has), or by
    its own name, which picks the first server listed that offers it."""
    if names is None:
        return list(listed)
    wanted, seen, chosen = set(names), set(), []
    for t in listed:
        if t.offered in wanted or (t.name in wanted and t.name not in seen):
            chosen.append(t)
        seen.add(t.name)
    return chosen


def unknown_tools(listed: Sequence[ToolInfo], names: Collection[str]) -> list[str]:
    """The names no tool of the listing goes by (`chosen_tools` takes none for them)."""
    known = {t.name for t in listed} | {t.offered for t in listed}
    return [n for n in names if n not in known]


@dataclass(frozen=True)
class ToolsWanted:
    """The tools a run offers its model, by name or by function name (None: every
    server's): a run that names its tools needs only the servers that offer them."""

    names: list[str] | None = None


@dataclass(frozen=True)
class ToolInput:
    """One tool call to execute: arguments are validated against `input_schema` first."""

    run_id: str
    server: str
    tool: str
    arguments: str
    input_schema: dict[str, Any] = field(default_factory=dict)
    call_id: str = ""  # the model's tool call id
    # The tool's time for the call once it is sent (its server's tool_timeout_s): then
    # it is cut, TOOL_TIMED_OUT.  0: none but the activity's own timeout.
    timeout_s: float = 0.0

    @property
    def idempotency_key(self) -> str | None:
        return f"{self.run_id}/{self.call_id}" if self.call_id else None


@dataclass(frozen=True)
class ToolOutput:
    """What the model is told; `executed` is False when the call never reached the server
    (malformed arguments)."""

    content: str
    is_error: bool
    executed: bool
    seconds: float = 0.0


@dataclass(frozen=True)
class CheckedArguments:
    """A call's arguments as its tool would get them (`arguments`, coerced to its input
    schema), or what the model is told instead (`error`: they cannot fit)."""

    arguments: dict[str, Any] | None = None
    error: str = ""


@dataclass(frozen=True)
class EndRunInput:
    """A run has ended: the gateway may forget its affinity at once."""

    run_id: str
