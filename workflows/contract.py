"""The run contract: what a sub-agent run takes, what it reports, how it is steered.

One dataclass in and out of the workflow, each signal, update and query (Temporal's
default converter handles nested dataclasses).  Fields only grow, with defaults, so a
history recorded by an older worker still decodes.  The MCP door, the facade and the
tests all speak these types.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from temporalio.common import Priority, SearchAttributeKey

__all__ = [
    "ACTIVE_STATES",
    "CALL_ID_MAX_CHARS",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_MAX_TOOL_CALLS",
    "DEFAULT_TASK_QUEUE",
    "PRIORITY_OF_CLASS",
    "SEARCH_ATTRIBUTES",
    "TERMINAL_STATES",
    "AgentRunInput",
    "Approval",
    "Budget",
    "BudgetStatus",
    "Carry",
    "ChildReport",
    "ChildRequest",
    "ChildSummary",
    "PendingApproval",
    "RunSpec",
    "RunState",
    "RunStatus",
    "StopRequest",
    "Totals",
    "fairness_key",
    "run_priority",
    "settled",
]

DEFAULT_TASK_QUEUE = "luftpause"
DEFAULT_MAX_TOOL_CALLS = 8
DEFAULT_MAX_TOKENS = 256
# An approval's answer names the call it answers by its id.  Engines keep theirs short
# ("call_…", "toolu_…"), but a proxy may pack more in (helper-129: LiteLLM's Gemini
# thought signatures), so only what no id is: one of megabytes, repeated in the run's
# refusal, put the workflow task past Temporal's 2 MB limit and held the right answer
# back with it (helper-126).
CALL_ID_MAX_CHARS = 65_536
# A run's tree is bounded by its Temporal history: every child adds its start and end,
# and every change in the child's subtree arrives as a report (a signal), ~30 events
# per child of three tool calls.  Temporal terminates a workflow whose history passes
# 51,200 events, and with it (its parent close policy) every running child, so a run
# takes no new child once it has had MAX_RUN_CHILDREN or its history has
# SPAWN_HISTORY_LIMIT events; the rest of the history is left for the reports of the
# children it has.  Read at each spawn (not bound at import), so tests can lower them.
MAX_RUN_CHILDREN = 1000
SPAWN_HISTORY_LIMIT = 20_480
# The children a run starts at once share its workflow task: its completion carries
# each one's spec twice (the accepted spawn request, and the child's input), and
# Temporal terminates a run whose completion passes gRPC's 4 MiB (helper-163: six
# spawns of 450 kB at once ended their parent, "GrpcMessageTooLarge").  Specs of this
# many bytes in all may be starting at once (one larger alone is taken); a spawn past
# them is refused by the run's validator (leaving no trace in its history) and sent
# again by `Runs.spawn`, within its child_wait_s.  With a turn's input (2 MiB at most)
# in the same completion it stays under 4 MiB.  Only the validator reads it: no
# command depends on it.
CHILDREN_STARTING_BYTES = 800_000
# What stays unbounded is the reports: a subtree busy for hours adds a report per
# running child every REPORT_EVERY_S (more under a budget) to its parent, whose history
# cannot shed them (a run continues as new only once its children have ended).  A run
# whose history has HISTORY_STOP_EVENTS events while children run stops, as on a
# budget (its tree winds down and ends Cancelled, saying why); a wind-down (of any
# stop) that takes it past HISTORY_HALT_EVENTS closes at once, stopping and cancelling
# what still runs, all children together, without waiting for their ends.  Measured
# (helper-161, 30 to 250 waiting children): such a close costs 8 to 10 events a child
# (the stop, the cancel, the child's Stopping and end reports and its end, and their
# workflow tasks), so 1,000 children fit in the 13,200 events past HISTORY_HALT_EVENTS
# (agent_run.HISTORY_ROOM_PATCH).  Read at each check, so tests can lower them; a change
# to them needs a patch id of its own.
HISTORY_STOP_EVENTS = 30_000
HISTORY_HALT_EVENTS = 38_000
# The same stop at this many signals taken by one execution (agent_run.SIGNAL_ROOM_PATCH):
# Temporal refuses signals past history.maximumSignalsPerExecution, 10,000 by default,
# and the reports pass it before the event limit (each is one event, and several share
# a workflow task).  The 2,000 left take the wind-down's reports (a child's Stopping and
# its end: a child's end also reaches its parent as the child's result).  Read at each
# check, so tests can lower it; a change to it needs a patch id of its own.
SIGNAL_STOP = 8_000
# ... and, as SPAWN_HISTORY_LIMIT for events, a run that took this many signals takes
# no more children: one taken past SIGNAL_STOP stopped its parent, and itself, at its
# first report (helper-172).  Only the spawn validator reads it: no command depends
# on it.
SPAWN_SIGNAL_LIMIT = 5_000
# Temporal terminates a workflow whose history passes 50 MB (its default size limit),
# its answer lost.  A run whose history could not shed its turns (one that cannot
# continue as new: children running, or an input too large to carry) fails before a
# turn or tool round would take it past this, saying why (agent_run.TURN_SIZE_PATCH).
# Read at each check, so tests can lower it; a run's history replays only with the
# value it ran with, so a change to it needs a patch id of its own.
HISTORY_MAX_BYTES = 45_000_000
# A run under no budget reports a change of its subtree's totals alone (not of its
# state, not its end) at most once in this many seconds; the latest totals ride on the
# next report.  Every report is an event in each ancestor's history up to the root's,
# so a busy subtree sends its root at most one per child per this many seconds, not
# one per change of every run below.  A run under an ancestor's budget of tokens or
# tool calls reports every change at once: the holder checks the budget on each.  Read
# at each report, so tests can change it.  Part of a run's replay (whether a report
# waits is a timer or none): change it only behind a new `workflow.patched` id.
REPORT_EVERY_S = 5.0
# A tool call's activity has its tool's time (`ToolInfo.timeout_s`, the worker's pool
# cuts the call at it) and this much more: the worker may first open the server's
# connection (activities/mcp_pool.py: 20 s to open, 5 s to settle a failed one), which
# must not count as the tool's time (a call cut while still opening would be told as
# one that may have run, and never sent again).  Read at each call, so tests can lower
# it; only the activity's timeout, not a command, depends on it.
TOOL_OPENING_S = 30.0
# How long a tool call whose server cannot be reached (never sent: NOT_SENT) is sent
# again before the run fails, from the first such send since the call last broke off.
# Read at each call, so tests can lower it.  Part of a run's replay (whether the run
# fails or sends again): change it only behind a new `workflow.patched` id.
TOOL_UNREACHED_S = 900.0

RunState = Literal[
    "Running",
    "AwaitingApproval",
    "AwaitingChildren",
    # Its budget (or an ancestor's) tripped: in-flight work finishes; or it ended and
    # is still recording its end (read from outside until its workflow closes).
    "Stopping",
    "Completed",
    "Failed",
    "Cancelled",
]
TERMINAL_STATES: frozenset[str] = frozenset({"Completed", "Failed", "Cancelled"})
ACTIVE_STATES: frozenset[str] = frozenset(
    {"Running", "AwaitingApproval", "AwaitingChildren", "Stopping"}
)

# Registered on the Temporal server (`temporal server start-dev --search-attribute
# LuftpauseCaller=Keyword ...`), set at start and upserted as the run moves, so runs
# can be listed and filtered in the Temporal UI and by `status`.
CALLER = SearchAttributeKey.for_keyword("LuftpauseCaller")
PARENT = SearchAttributeKey.for_keyword("LuftpauseParent")
ROOT = SearchAttributeKey.for_keyword("LuftpauseRoot")
CLASS = SearchAttributeKey.for_keyword("LuftpauseClass")
MODEL = SearchAttributeKey.for_keyword("LuftpauseModel")
STATE = SearchAttributeKey.for_keyword("LuftpauseState")
SEARCH_ATTRIBUTES = (CALLER, PARENT, ROOT, CLASS, MODEL, STATE)


@dataclass(frozen=True)
class Budget:
    """Limits over a run's whole subtree, including runs spawned later; None = no limit."""

    tokens: int | None = None
    tool_calls: int | None = None
    seconds: float | None = None

    def any(self) -> bool:
        return self.tokens is not None or self.tool_calls is not None or self.seconds is not None

    def counts_usage(self) -> bool:
        """Whether the budget's holder counts what its subtree reports (tokens or tool
        calls; the seconds budget is a timer)."""
        return self.tokens is not None or self.tool_calls is not None


@dataclass(frozen=True)
class RunSpec:
    """What `spawn` asks for."""

    task: str
    model: str
    service_class: str = "interactive"
    system: str | None = None
    max_tool_calls: int = DEFAULT_MAX_TOOL_CALLS
    # Names of the upstream tools the run may use; None = all of them.
    tools: list[str] | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS  # per turn; 0 = the engine decides
    parallel_tool_calls: bool = False
    caller: str = ""  # "" = the parent's caller, or "anonymous" for a root run
    parent: str | None = None
    root: str | None = None  # set by the parent
    budget: Budget = field(default_factory=Budget)
    # Tools that wait for the user's approval, besides those marked destructive.
    approve_tools: list[str] = field(default_factory=list)
    # A budget stop waits this long at most for the run's LLM turn in flight, then
    # cancels it: a turn the gateway still holds has no deadline.  The gateway's turn
    # timeout by default (an admitted turn ends within it); not an MCP argument.
    stop_turn_wait_s: float = 600.0
    # Set by the parent: a run above holds a budget of tokens or tool calls, which counts
    # every change of this run's subtree at once (see REPORT_EVERY_S).  Not an MCP
    # argument.
    under_budget: bool = False


# A run's place in its Temporal task queue (Task Queue Priority): its workflow tasks,
# and the turns and tool calls it schedules (activities inherit it), are dispatched
# lower key first when the queue has a backlog, FIFO within a key.  Without it an
# interactive run's next step waits behind every batch run's, whatever the gateway
# does for its turns.  Keys run from 1 to 5 on a default server, and a task that names
# none is 3: interactive and batch sit either side of that default, so a run started
# by a gateway from before this (or a workflow an operator starts on the queue) goes
# after interactive runs and before batch ones, and 1 and 5 stay free for work that
# must go before or after all runs.  Read at each start: a run keeps the priority it
# started with (continue-as-new carries it over on the server).
PRIORITY_OF_CLASS: dict[str, int] = {"interactive": 2, "batch": 4}
# Temporal refuses a start whose fairness key is over 64 bytes ("fairness key length
# exceeds limit"): a longer caller is shortened (`fairness_key`).
FAIRNESS_KEY_MAX_BYTES = 64
_FAIRNESS_DIGEST_CHARS = 16


def run_priority(spec: RunSpec) -> Priority:
    """The Temporal priority a run starts with: its service class's key (as the gateway
    reads the class: a blank one is interactive; one it would refuse gets Temporal's
    default, or, for a child, its parent's), and its caller as the fairness key, so a
    server with fairness on shares each class's dispatch among callers.  A server with
    fairness off (the default) keeps FIFO order within a class whatever the caller."""
    service_class = spec.service_class.strip().lower() or "interactive"
    return Priority(
        priority_key=PRIORITY_OF_CLASS.get(service_class),
        fairness_key=fairness_key(spec.caller or "anonymous"),
    )


def fairness_key(caller: str) -> str:
    """`caller` as a fairness key: itself when it fits Temporal's 64 bytes, else its
    first bytes and a digest of the whole (the same caller always gets the same key,
    and two long names that share their start get two)."""
    raw = caller.encode()
    if len(raw) <= FAIRNESS_KEY_MAX_BYTES:
        return caller
    digest = hashlib.sha256(raw).hexdigest()[:_FAIRNESS_DIGEST_CHARS]
    room = FAIRNESS_KEY_MAX_BYTES - _FAIRNESS_DIGEST_CHARS - 1
    head = raw[:room].decode(errors="ignore")  # not a character cut in two
    return f"{head}~{digest}"


@dataclass(frozen=True)
class Totals:
    """What a run (or a subtree) has cost so far."""

    turns: int = 0
    tool_calls: int = 0
    failed_tool_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    turn_seconds: float = 0.0
    tool_seconds: float = 0.0

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def with_children(self, children: Iterable[ChildSummary]) -> Totals:
        """These totals (a run's own) and its children's subtrees: the run's subtree."""
        total = self
        for child in children:
            total = total.plus(child.subtree)
        return total

    def plus(self, other: Totals) -> Totals:
        return Totals(
            turns=self.turns + other.turns,
            tool_calls=self.tool_calls + other.tool_calls,
            failed_tool_calls=self.failed_tool_calls + other.failed_tool_calls,
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            completion_tokens=self.completion_tokens + other.completion_tokens,
            cached_tokens=self.cached_tokens + other.cached_tokens,
            turn_seconds=self.turn_seconds + other.turn_seconds,
            tool_seconds=self.tool_seconds + other.tool_seconds,
        )


@dataclass(frozen=True)
class PendingApproval:
    """A tool call waiting for the user."""

    call_id: str
    tool: str
    arguments: Any
    # The tool's MCP server ("" for a call of a tool the run was not offered): two
    # servers may offer one name.
    server: str = ""

    @property
    def described(self) -> str:
        """The tool, with its server when known: `delete_record (of fake)`."""
        return f"{self.tool} (of {self.server})" if self.server else self.tool


@dataclass(frozen=True)
class Approval:
    """The user's answer; `call_id` (optional) guards against answering a later call."""

    allow: bool
    call_id: str | None = None


@dataclass(frozen=True)
class ChildSummary:
    handle: str
    state: str
    subtree: Totals = field(default_factory=Totals)
    # The child has ended, and every run below it had ended when it did: its subtree is
    # final.  A run that closes while a child it cancelled is still ending (past
    # CHILDREN_END_WAIT) reports its end unsettled, and `Runs.status` reads the rest
    # from the runs below.  True in records from before the field (as they were read).
    settled: bool = True


def settled(children: Iterable[ChildSummary]) -> bool:
    """Whether every one of a run's children has ended, each with its subtree final."""
    return all(c.state in TERMINAL_STATES and c.settled for c in children)


@dataclass(frozen=True)
class ChildReport:
    """Sent by a run to its parent whenever its subtree's state or totals change."""

    handle: str
    state: str
    subtree: Totals
    settled: bool = True  # as ChildSummary.settled; False on every report before the end


@dataclass(frozen=True)
class ChildRequest:
    """Asks a run to start a child run with this handle (the facade picks it)."""

    handle: str
    spec: RunSpec


@dataclass(frozen=True)
class ChildWithdrawal:
    """The caller of `ChildRequest` gave up before the run took it: the run refuses
    the request if it comes later, and cancels the child if it started meanwhile."""

    handle: str


@dataclass(frozen=True)
class StopRequest:
    """Why a run is about to be cancelled (e.g. an ancestor's budget)."""

    reason: str


@dataclass(frozen=True)
class BudgetStatus:
    limits: Budget
    used: Budget
    exceeded: str | None = None  # what stopped the subtree: `budget exceeded: ...`
    # An ended run's use past a limit that stopped nothing, "<which> <used>/<limit>":
    # work below it that ended after it closed (Temporal or the workers down), or its
    # own end past `seconds`.  Set by the client that reads the run (`Runs`).
    over: str | None = None

    def past_a_limit(self) -> str | None:
        """The first limit `used` is past, as "<which> <used>/<limit>", or None (seconds
        up to the next tenth, as `budget exceeded` gives them).  Past, not reached: the
        workflow's own check (`AgentRun._over`) trips the seconds budget when its timer
        fires, at the limit; this reads a closed run's final figures."""
        limits, used = self.limits, self.used
        if limits.tokens is not None and used.tokens is not None and used.tokens > limits.tokens:
            return f"tokens {used.tokens}/{limits.tokens}"
        calls, limit = used.tool_calls, limits.tool_calls
        if limit is not None and calls is not None and calls > limit:
            return f"tool_calls {calls}/{limit}"
        seconds = used.seconds
        if limits.seconds is not None and seconds is not None and seconds > limits.seconds:
            return f"seconds {math.ceil(seconds * 10) / 10:g}/{limits.seconds:g}"
        return None


@dataclass(frozen=True)
class RunStatus:
    """A run as `status` and `await` show it."""

    handle: str
    state: str
    task: str
    model: str
    service_class: str
    caller: str
    parent: str | None
    root: str
    children: list[ChildSummary]
    usage: Totals  # this run alone
    subtree: Totals  # this run and every descendant
    answer: str | None = None
    # The answer's turn ended at the run's max_tokens (finish_reason "length"): cut,
    # an empty answer included (a reasoning model cut while thinking).
    answer_cut: bool = False
    error: str | None = None
    budget: BudgetStatus | None = None
    pending_approval: PendingApproval | None = None
    started_at: str = ""
    ended_at: str | None = None
    updated_at: str = ""  # when its state last changed ("" : not known)


@dataclass(frozen=True)
class Carry:
    """What a run carries across continue-as-new."""

    messages: list[dict[str, Any]]
    usage: Totals
    answers: dict[str, bool]
    started_at: str
    tools: list[Any]  # list[ToolInfo]
    children: list[ChildSummary]


@dataclass(frozen=True)
class AgentRunInput:
    spec: RunSpec
    carry: Carry | None = None
