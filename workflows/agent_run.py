"""`AgentRun`: one sub-agent run as a Temporal workflow; the workflow id is its handle.

The loop: an LLM turn (through the gateway, as this run's turn) → the tool calls it
asked for (concurrently when `parallel_tool_calls`) → the next turn, until the model
answers.  After `max_tool_calls` calls the model is offered no tools and must answer, so
a run makes at most `max_tool_calls + 1` turns.  A run that holds a tool-call budget
likewise offers no tools once its subtree has made that many calls.

Rules this module keeps:
1. **Trees.** `spawn_child` (an update) starts a child workflow with REQUEST_CANCEL as
   its parent close policy; a run waits for its running children before it completes.
   A request its caller withdrew (`withdraw_child`, a signal: it gave up waiting) is
   refused if it comes later, and its child cancelled if it had just started.
   Every run reports its subtree's state and totals to its parent by signal, one
   report on its way at a time (the latest rides on the next); in a subtree under no
   budget a change of totals alone goes at most every `contract.REPORT_EVERY_S`, a
   change of state at once.  (Runs without the `REPORTS_PATCH` marker report every
   change as it comes.)
2. **Budgets** limit a run's whole subtree.  The run that holds a budget checks it
   before every turn and tool round and on every report from below; the seconds budget
   is a durable timer, so an idle subtree trips it too.  On excess the run and its
   descendants stop (state `Stopping`): nothing new starts, a run waiting for approval
   or for its children stops at once, and the turns and tool calls already in flight
   finish and are counted, so the overshoot is bounded by that work, except that an LLM
   turn is waited for `RunSpec.stop_turn_wait_s` at most (10 min, the gateway's turn
   timeout: a turn it still holds in its queue has no deadline), then cancelled (runs
   without the `STOP_WAIT_PATCH` marker wait for it).  Then every run of
   the subtree ends `Cancelled` with `budget exceeded: <which> <used>/<limit>`.  (Runs
   started before this rule, without the `DRAIN_PATCH` marker, cancel their in-flight
   work instead, as they did.)  `cancel` stops a subtree at once, in-flight work too.
   A run whose Temporal history reaches `contract.HISTORY_STOP_EVENTS` events while
   children run stops the same way (they keep it from continuing as new, and Temporal
   would terminate it at 51,200, and cancel them; `HISTORY_ROOM_PATCH`); a wind-down
   that takes it to `contract.HISTORY_HALT_EVENTS` closes at once.
   A tool call is work the run can count before it starts: the run that holds a
   tool-call budget starts no call it has no room for.  Calls over it are answered to
   the model as spent, as over `max_tool_calls`, and the run's next turn offers no
   tools, so the holder's own calls never exceed the budget; only calls of descendants
   (which do not know it) can, and trip it.  (Runs without the `SPENT_PATCH` marker
   made a whole round while the budget had no room left, as they did.)
3. **Approvals.** A destructive tool (or one named in `approve_tools`) waits in
   `AwaitingApproval` until the `approve` update answers; answers are kept (and carried
   across continue-as-new), so an answered call is never asked again after a restart.
4. **Determinism.** No clock but `workflow.now()`, no I/O but activities, no randomness.
5. **A tool call that may have run is sent again only if its tool is repeatable**
   (its server marks it `readOnlyHint` or `idempotentHint`).  Temporal runs an
   activity at least once: a worker that dies while its server runs a call would send
   the call again, and a server that ignores the idempotency key in `_meta` would run
   it twice (an approved `delete`, twice).  Other tools' calls get one attempt; one that
   never left the worker (the server unreachable) is sent again later, and any other
   failure answers the model that the outcome is unknown (`UNKNOWN_OUTCOME`), so it can
   check before calling again.  (Runs without the `ONCE_PATCH` marker retry every call,
   as they did.)  A call with no answer within its server's `tool_timeout_s` is cut and
   told to the model, whatever the tool, and the run goes on; a repeatable tool's call
   that broke off is sent TOOL_SENDS times before the model is told (`TIMED_OUT`,
   `BROKE_OFF`).
   (Runs without the `TOLD_PATCH` marker left a repeatable call to Temporal's retries,
   each cut at 5 minutes, and failed after 15.)  A call that fails the run cancels the
   other calls of its round (runs without the `ROUND_PATCH` marker left them running).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
from collections.abc import Awaitable, Coroutine, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributePair, TypedSearchAttributes
from temporalio.exceptions import (
    ActivityError,
    ApplicationError,
    CancelledError,
    ChildWorkflowError,
    TerminatedError,
    TimeoutType,
)
from temporalio.exceptions import TimeoutError as ActivityTimeout

with workflow.unsafe.imports_passed_through():
    # The contract module by its own name: the converter resolves the dataclasses'
    # annotations through sys.modules, which in the sandbox holds only what was imported.
    # The module itself too, for the limits read at each spawn: in this form (not `from
    # workflows import contract`, the sandbox's own package's copy) it is the host's.
    import workflows.contract as contract
    from activities._arguments import MAX_DEPTH, depth
    from activities.contract import (
        NOT_SENT,
        TOOL_TIMED_OUT,
        EndRunInput,
        ToolCall,
        ToolInfo,
        ToolInput,
        ToolOutput,
        ToolsWanted,
        TurnInput,
        TurnOutput,
        chosen_tools,
    )
    from activities.llm import RUN_ERROR_MAX_CHARS, LlmActivities, bounded, payload_bytes
    from activities.tools import ToolActivities, check_arguments
    from workflows.contract import (
        CALLER,
        CLASS,
        MODEL,
        PARENT,
        ROOT,
        STATE,
        TERMINAL_STATES,
        AgentRunInput,
        Approval,
        Budget,
        BudgetStatus,
        Carry,
        ChildReport,
        ChildRequest,
        ChildSummary,
        ChildWithdrawal,
        PendingApproval,
        RunSpec,
        RunStatus,
        StopRequest,
        Totals,
        run_priority,
        settled,
    )

__all__ = ["DECLINED", "AgentRun"]

DECLINED = "Error: the user declined this tool call"
BUDGET_EXCEEDED = (
    "BudgetExceeded"  # the ApplicationError type a run stopped by its budget ends with
)
# The ApplicationError type of a spawn refused while other children start (see
# contract.CHILDREN_STARTING_BYTES): Runs.spawn sends it again.
CHILDREN_STARTING = "ChildrenStarting"
# `workflow.patched` id of the budget stop that lets in-flight work finish (rule 2).
DRAIN_PATCH = "budget-stop-drains-in-flight-work"
# `workflow.patched` id of the tool-call budget that the holder's own calls stay inside.
SPENT_PATCH = "budget-tool-calls-start-no-call-over"
# `workflow.patched` id of the budget stop that waits for an LLM turn a bounded time.
STOP_WAIT_PATCH = "budget-stop-waits-for-a-turn-at-most"
# `workflow.patched` id of tool calls sent at most once unless the tool is repeatable.
ONCE_PATCH = "tool-calls-at-most-once-unless-repeatable"
# `workflow.patched` id of the budget check after the run's last turn, and of a run
# that ends (cancelled, stopped, failed) waiting a bounded time for the ends of the
# children it cancelled, so that its final status shows how they ended.
ENDS_PATCH = "budget-checked-after-the-answer-and-children-ends-awaited"
# `workflow.patched` id of the tool listing that names the tools a run offers.
NAMED_TOOLS_PATCH = "tools-listed-by-the-names-a-run-offers"
# How long a run that ends waits for the children it cancelled to end (ENDS_PATCH).
CHILDREN_END_WAIT = timedelta(seconds=10)
# `workflow.patched` id of a run that ends as it was ending when the report of its end
# to the gateway fails (a local activity's failure comes bare; it failed the run).
END_REPORT_PATCH = "a-failed-end-report-fails-no-run"
# `workflow.patched` id of reports up the tree sent one at a time, the latest state
# riding on the next one, and totals alone at most every `REPORT_EVERY_S` in a subtree
# under no budget (rule 1).
REPORTS_PATCH = "reports-up-one-at-a-time"
# `workflow.patched` id of a run that, once it is closing (`_halt`: cancelled, stopped
# or failed), no longer makes its budget the reason from what its children report: a
# run cancelled while its children worked ended "budget exceeded" when their last
# totals passed the limit.  (A run without the marker reads a budget, as it did: in
# it, a child that finished starting while it closed was sent that reason.)
HALT_REASON_PATCH = "a-closing-run-keeps-its-reason"
# `workflow.patched` id of a child that finishes starting while its parent closes
# (cancelled, failed, stopped: `_halt` has stopped the children it had) being stopped
# and cancelled as they were.  Without it the child worked on, to its end if it was
# quick, until the close's wait for the children ended and Temporal cancelled it.
LATE_CHILD_PATCH = "a-child-started-as-its-parent-closes-is-stopped"
# `workflow.patched` id of a run's tools and approvals chosen by function name too (a
# later server's tool of a name already listed is offered as `<server>__<name>`).
TOOLS_BY_FUNCTION_PATCH = "tools-chosen-by-function-name-too"
# `workflow.patched` id of a close (`_halt`) that stops every child whatever cancel
# comes meanwhile.  Without it a cancel arriving while a failing run stopped its
# children (the first cancel it gets) left the rest to the parent-close policy, with
# no reason given, and skipped the end report: the run's state stayed "Running".
HALT_UNBROKEN_PATCH = "a-close-stops-every-child-whatever-cancel-comes"
# `workflow.patched` id of a child's report that came before its start was seen being
# kept.  A workflow task that sees both (the run's worker late: a sticky timeout
# after a worker died, load) runs the report's handler first: `spawn_child` then set
# the child to Running with nothing used, and the run's view, its subtree and its
# budget counted nothing of the child until its next report, never while it waited
# on an approval (helper-180).
EARLY_REPORT_PATCH = "a-childs-report-before-its-start-is-kept"
# `workflow.patched` id of a call of a tool that is not repeatable, never sent (its
# server unreachable), that is not sent again once the run is stopping (rule 2:
# nothing new starts after a stop).  Without it the call kept being sent, for up to
# TOOL_SCHEDULE_TIMEOUT, and ran after the stop when the server came back.
UNSENT_STOP_PATCH = "a-call-never-sent-is-not-sent-after-a-stop"
# `workflow.patched` id of every tool call sent by the run itself, one attempt a send,
# bounded by its server's `tool_timeout_s` (`ToolInfo.timeout_s`): a call with no answer
# in that time is told to the model, and so is a repeatable tool's call that broke off
# (its worker died, its connection broke) TOOL_SENDS times.  Without it a repeatable
# tool's call was retried by Temporal for TOOL_SCHEDULE_TIMEOUT, each attempt cut at
# TOOL_TIMEOUT, and then failed the run: a read-only tool slower than 5 minutes (a test
# suite, a crawl) failed every run that called it, after 15 minutes.
TOLD_PATCH = "a-call-with-no-answer-in-its-time-is-told-to-the-model"
# `workflow.patched` id of a call's arguments checked against its tool's input schema
# before the user is asked to approve it (the `check_arguments` local activity): one
# that cannot fit, or a call of a tool the run was not offered, goes back to the model
# unasked, and the question shows the arguments the tool would get.  Without it the user
# was asked about a call that could never run, and refused it after a yes (helper-179).
CHECKED_PATCH = "arguments-checked-before-approval"
# `workflow.patched` id of the size of what a turn carries (the conversation and the
# tools offered) checked before the turn, and the run failed, not stuck, past
# TURN_INPUT_MAX_BYTES; and of a continue-as-new whose input would be past it left
# out (the run goes on in this history).  Tool answers are cut to keep the
# conversation under CONVERSATION_MAX_BYTES, but the model's own messages (a tool
# call's arguments) are not: past 2 MB Temporal refused the turn's input, or the
# continue-as-new's, on every retry of the workflow task, and the run read Running,
# "status unavailable", for ever (helper-150).
TURN_SIZE_PATCH = "a-turn-too-large-for-temporal-fails-the-run"
# Temporal's default payload limit is 2 MiB (2,097,152 bytes); what a turn carries
# besides the conversation and the tools (its other fields, the envelope) is some
# hundred bytes, and its JSON is what `_size` measures (helper-153 compared them).
# A run replays only with the value it ran with: a change needs a patch id of its own.
TURN_INPUT_MAX_BYTES = 2_090_000
# `workflow.patched` id of the tool listing at a run's start as an activity (not a
# local one), stopped at once by a stop or a budget.  A local activity's attempts and
# retries run inside one workflow task, held open by heartbeats: with the tool servers
# down (or accepting connections and never answering) the run's timers, signals and
# cancel waited, a 3 s budget tripped at 16 s, and the stop then waited for the
# listing's retries, up to 15 minutes, the run Stopping meanwhile (helper-150,
# helper-154).  It costs a task-queue round trip at each run's start.
LISTING_PATCH = "a-tool-listing-gives-way-to-timers-and-stops"
# `workflow.patched` id of the stop of a run whose history has
# contract.HISTORY_STOP_EVENTS events, checked as its budget is (before every turn and
# tool round, and on every report from below) while it has children running; and of
# the end of a wind-down at contract.HISTORY_HALT_EVENTS.  A run cannot continue as new
# while its children run, and a subtree busy for hours took its parent's history, a
# report per child every few seconds, past Temporal's 51,200 events: Temporal
# terminated the run and cancelled every child, no answer kept and no reason given.
HISTORY_ROOM_PATCH = "a-run-stops-before-temporals-event-limit"
# `workflow.patched` id of the same stop at contract.SIGNAL_STOP signals: Temporal takes
# at most 10,000 signals into one execution by default, and refuses the rest.  Its
# children's reports (signals, several a child) passed that before the event limit, in
# a tree of some 550 children or a busy one for an hour: the reports were refused, the
# budget the run holds saw its subtree no more (checked only as each child ended), its
# status froze, and a stop from above could not reach it (helper-163).
SIGNAL_ROOM_PATCH = "a-run-stops-before-temporals-signal-limit"
# `workflow.patched` id of a concurrent tool round (`parallel_tool_calls`) whose other
# calls are cancelled when one of them fails the run (its server unreachable for
# contract.TOOL_UNREACHED_S).  Without it they ran on as orphaned tasks while the run
# closed: a call in flight was left open in the history (the worker cancelled it when a
# heartbeat found the run ended), and a call waiting to be sent again had its timer fire
# during the close: Temporal refused the close for that new event, the close was done
# again (its end reported twice), and the call's next send was scheduled in the run's
# last workflow task (helper-202).  The cancel of a call in flight reaches Temporal only
# as the workflow task in which its round failed completes (for a run with no children,
# the task that closes it), and the worker hears of it at the call's next heartbeat: a
# call that answers during a slow close (the end report retried) still has the close
# refused and done again, as before (helper-206).
ROUND_PATCH = "a-call-that-fails-the-run-cancels-its-round"
# Why a child whose spawn request was withdrawn stops (withdraw_child), and how many
# withdrawn requests a run remembers (each a handle; the oldest is forgotten first).
WITHDRAWN_REASON = "its spawn request was withdrawn: the caller gave up waiting for it"
WITHDRAWN_KEPT = 1000

# What the model reads when a call of a tool that is not repeatable may have run but no
# answer came (rule 5).
UNKNOWN_OUTCOME = (
    "Error: the outcome of this call is unknown: no answer came back ({why}), and it may "
    "have reached the tool's server. It may or may not have taken effect, and it was not "
    "sent again because the server does not mark tool '{tool}' read-only or idempotent. "
    "Check before calling it again."
)
# What the model reads when a call got no answer in its tool's time (TOLD_PATCH).
TIMED_OUT = (
    "Error: tool '{tool}' gave no answer within {seconds:g} s, the time its server allows "
    "a call; the call was cut (it may have run part of its work) and not sent again. Call "
    "it with a smaller request, or go on without it."
)
# ... and when a repeatable tool's call broke off every time it was sent.
BROKE_OFF = (
    "Error: no answer came back from tool '{tool}': {why} ({sends} sends). It may have "
    "run. Try again later, or go on without it."
)

# Named timeouts and retry policies (DESIGN.md "The runtime on Temporal").
# A turn waits in the gateway's queue as long as it takes (a held turn has no deadline:
# one abandoned at a limit would lose its place and come back last).  The gateway bounds
# the engine's part (`[policy] turn_timeout_s`, 10 min: 504), the heartbeat a dead
# worker; this only ends an attempt that somehow never does.  No schedule-to-close: a
# gateway down for long is retried (every 10 s at most) until it is back, losing no run.
TURN_TIMEOUT = timedelta(hours=24)
TOOL_TIMEOUT = timedelta(minutes=5)
TOOL_SCHEDULE_TIMEOUT = timedelta(minutes=15)
# Sends of a repeatable tool's call that broke off before its answer (TOLD_PATCH): the
# first and two more, as Temporal's retry gave a call cut at TOOL_TIMEOUT in 15 minutes.
TOOL_SENDS = 3
HEARTBEAT_TIMEOUT = timedelta(seconds=10)
SHORT_TIMEOUT = timedelta(seconds=30)
RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=10),
)
ONCE = RetryPolicy(maximum_attempts=1)  # a call of a tool that is not repeatable (rule 5)
END_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=3)


def _send(
    inp: ToolInput, *, once: bool, timeout: timedelta = TOOL_TIMEOUT
) -> Awaitable[ToolOutput]:
    """The tool call activity: retried by Temporal for TOOL_SCHEDULE_TIMEOUT, or (`once`,
    rule 5) one attempt, which the run itself sends again (`AgentRun._sent`)."""
    return workflow.execute_activity_method(
        ToolActivities.call_tool,
        inp,
        start_to_close_timeout=timeout,
        schedule_to_close_timeout=None if once else TOOL_SCHEDULE_TIMEOUT,
        heartbeat_timeout=HEARTBEAT_TIMEOUT,
        retry_policy=ONCE if once else RETRY,
    )


class _Stop(Exception):
    """The run must stop: its budget tripped, or an ancestor's did."""


_TOOL_FIELDS = frozenset(f.name for f in dataclasses.fields(ToolInfo))


def _tool_info(carried: dict[str, Any]) -> ToolInfo:
    """A tool a run carried across continue-as-new: the fields this version knows (a
    later version's, after a rollback, would fail every workflow task; helper-119)."""
    return ToolInfo(**{k: v for k, v in carried.items() if k in _TOOL_FIELDS})


def _no_answer_why(cause: BaseException | None) -> str:
    """Why a tool call that may have run broke off, in the model's words."""
    if isinstance(cause, ActivityTimeout) and cause.type == TimeoutType.HEARTBEAT:
        return "the worker running it stopped"
    return str(cause)


def _tool_message(call_id: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


# Every LLM turn carries the whole conversation as its activity's input, and Temporal
# refuses a payload over 2 MB (the workflow task would fail on every retry: a run stuck
# Running).  Tool answers are cut to keep the conversation below this (JSON bytes).
CONVERSATION_MAX_BYTES = 1_500_000


def _size(message: Any) -> int:
    return len(json.dumps(message))  # ASCII-escaped: never less than the UTF-8 size


# A run's final status as Temporal carries it (its result, or its failure's details), at
# most: Temporal takes none past 2 MB (see AgentRun._final).
RESULT_MAX_BYTES = 1_900_000


def _with(status: RunStatus, field: str, text: str) -> RunStatus:
    """`status` with its task or its answer (`field`) as `text`."""
    return replace(status, task=text) if field == "task" else replace(status, answer=text)


def fit_answer(content: str, room: int) -> str:
    """A tool answer cut to `room` bytes of JSON (its part of the conversation still
    free), with a note the model reads; the note alone when no room is left."""
    if _size(content) <= room:
        return content
    note = (
        "\n[luftpause: the answer was cut: this run's conversation is at its limit of "
        f"{CONVERSATION_MAX_BYTES:,} bytes]"
    )
    keep = content[: max(0, room - _size(note))]
    while keep and _size(keep + note) > room:  # escaped characters take several bytes
        keep = keep[: len(keep) * 3 // 4]
    return keep + note


async def _unbroken(work: Coroutine[Any, Any, None]) -> None:
    """Run `work` to its end, whatever cancellation reaches the caller meanwhile (the
    workflow's cancel is taken: what runs this closes the run anyway)."""
    task = asyncio.create_task(work)
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            continue


def fit_round(
    messages: Sequence[Any], tools: Sequence[ToolInfo], answers: Sequence[tuple[str, str]]
) -> list[dict[str, Any]]:
    """A tool round's messages, (call id, answer) each, with the answers cut to the room
    the conversation has left.  Every turn carries the offered tools beside the
    messages, so their definitions count against the limit too."""
    used = _size(list(messages)) + _size([t.openai_tool() for t in tools])
    out = []
    for call_id, content in answers:
        message = _tool_message(call_id, content)
        if used + _size(message) > CONVERSATION_MAX_BYTES:
            room = CONVERSATION_MAX_BYTES - used - _size(_tool_message(call_id, ""))
            message = _tool_message(call_id, fit_answer(content, room))
        used += _size(message) + 2
        out.append(message)
    return out


@workflow.defn
class AgentRun:
    """One sub-agent: see the module docstring for its rules."""

    @workflow.init
    def __init__(self, inp: AgentRunInput) -> None:
        info = workflow.info()
        self._id = info.workflow_id
        self._spec = inp.spec if inp.spec.caller else replace(inp.spec, caller="anonymous")
        self._root = inp.spec.root or self._id
        carry = inp.carry
        self._messages: list[dict[str, Any]] = list(carry.messages) if carry else []
        self._usage = carry.usage if carry else Totals()
        self._answers: dict[str, bool] = dict(carry.answers) if carry else {}
        self._started_at = carry.started_at if carry else workflow.now().isoformat()
        self._tools: list[ToolInfo] | None = (
            [t if isinstance(t, ToolInfo) else _tool_info(t) for t in carry.tools]
            if carry
            else None
        )
        self._children: dict[str, ChildSummary] = (
            {c.handle: c for c in carry.children} if carry else {}
        )
        self._state = "Running"
        self._answer: str | None = None
        self._answer_cut = False  # its turn stopped at max_tokens (RunStatus.answer_cut)
        self._error: str | None = None
        self._pending: PendingApproval | None = None
        self._exceeded: str | None = None
        self._stop_reason: str | None = None
        self._drain = False  # set by run(): see DRAIN_PATCH
        self._spent_rule = False  # set by run(): see SPENT_PATCH
        self._stop_wait = False  # set by run(): see STOP_WAIT_PATCH
        self._in_turn = False  # an LLM turn of the run is in flight
        # The gen_ai.provider.name its span names: the first a turn's answer gave (in
        # this execution: not carried across continue-as-new, whose next turn names
        # one).  Read from activity results, which a replay reads back; no command
        # depends on it, so it needs no patch marker.
        self._provider = ""
        self._spawning: set[str] = set()  # the handles spawn_child is still starting
        # Their requests' sizes, by handle (contract.CHILDREN_STARTING_BYTES): set by
        # the validator (the next spawn's validator counts it, however the SDK orders
        # validators and handlers) and by the handler (a replay runs no validator);
        # only validators read it.
        self._starting: dict[str, int] = {}
        self._ending = False  # in _halt: cancelled, stopped or failed, closing
        self._halt_reason = ""  # why, as _halt tells the children
        self._late_stopped: set[str] = set()  # children stopped as they started late
        self._no_continue = False  # its continue-as-new input is too large (TURN_SIZE_PATCH)
        self._listing = False  # it waits for its tool listing (LISTING_PATCH)
        # The spawn requests their callers withdrew (withdraw_child), oldest first.
        self._withdrawn: dict[str, None] = {}
        self._ended_at: str | None = None
        self._updated_at = workflow.now().isoformat()  # its state last changed
        self._last_report: tuple[str, Totals] | None = None
        self._coalesce = False  # set by run(): see REPORTS_PATCH
        self._keep_reason = False  # set by run(): see HALT_REASON_PATCH
        self._room_rule = False  # set by run(): see HISTORY_ROOM_PATCH
        self._signal_rule = False  # set by run(): see SIGNAL_ROOM_PATCH
        self._signals = 0  # the signals this execution took (in its history: replays alike)
        self._reporting = False  # the reporter is on its way (REPORTS_PATCH)
        self._report_again = False  # the run or its subtree changed since it left
        self._flushing = False  # a report held back goes now (continue-as-new)
        self._reported_at: datetime | None = None  # the last report up left then
        self._watchers: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ run

    @workflow.run
    async def run(self, inp: AgentRunInput) -> RunStatus:
        # Decided once, at the run's first workflow task: a run whose history has no
        # marker (started by an older worker) keeps the stop it started with.
        self._drain = workflow.patched(DRAIN_PATCH)
        self._spent_rule = workflow.patched(SPENT_PATCH)
        self._stop_wait = workflow.patched(STOP_WAIT_PATCH)
        self._once = workflow.patched(ONCE_PATCH)
        self._ends = workflow.patched(ENDS_PATCH)
        self._coalesce = workflow.patched(REPORTS_PATCH)
        self._keep_reason = workflow.patched(HALT_REASON_PATCH)
        self._room_rule = workflow.patched(HISTORY_ROOM_PATCH)
        self._signal_rule = workflow.patched(SIGNAL_ROOM_PATCH)
        work = asyncio.create_task(self._work())
        try:
            await self._until_done(work)
            if self._exceeded is not None:
                raise _Stop(self._exceeded)
            if self._stopping():
                raise _Stop(self._stop_reason or "")
            work.result()  # raises what the loop raised
            if self._ends and self._exceeded is None:
                # Its own last turn may have taken its subtree over the budget it holds
                # (nothing else looks after the answer): then the subtree stops, as on
                # any excess, instead of its children working on past it.
                self._exceeded = self._over()
                if self._exceeded is not None:
                    raise _Stop(self._exceeded)
            await self._wait_children()
            self._set_state("Completed")
        except _Stop as stop:
            reason = str(stop)
            if self._drain:
                try:
                    await self._wind_down(work, reason)
                except asyncio.CancelledError:  # `cancel` while stopping: at once
                    await self._halt(work, "Cancelled", reason)
                    raise
            await self._halt(work, "Cancelled", reason)
            # The final status rides on the failure (as on a result): a store reads it
            # from history, with no worker to replay the run for a query.
            raise ApplicationError(
                reason, self._final(), type=BUDGET_EXCEEDED, non_retryable=True
            ) from None
        except asyncio.CancelledError:
            await self._halt(work, "Cancelled", self._stop_reason or "cancelled")
            raise
        except (ActivityError, ApplicationError) as exc:
            message = str(exc.cause) if isinstance(exc, ActivityError) and exc.cause else str(exc)
            # Bounded: the failure carries it twice (its message, and the status's
            # error), past Temporal's 2 MB for a long one (helper-168).
            message = bounded(message, RUN_ERROR_MAX_CHARS)
            await self._halt(work, "Failed", message)
            raise ApplicationError(
                message, self._final(), type="RunFailed", non_retryable=True
            ) from None
        await self._finish()
        return self._final()

    async def _until_done(self, work: asyncio.Task[None]) -> None:
        """Wait for the loop, or for the budget to trip (the seconds budget by timer)."""
        limit = self._spec.budget.seconds

        def done() -> bool:
            return work.done() or self._exceeded is not None or self._stopping()

        if limit is None:
            await workflow.wait_condition(done)
            return
        left = limit - self._elapsed()
        try:
            await workflow.wait_condition(done, timeout=max(left, 0.001))
        except TimeoutError:
            self._exceeded = self._seconds_over(limit)
        if self._exceeded is None and not done():  # pragma: no cover - defensive
            await workflow.wait_condition(done)

    async def _wait_children(self) -> None:
        if not self._children_done():
            self._set_state("AwaitingChildren")
            limit = self._spec.budget.seconds
            done = lambda: (  # noqa: E731
                self._children_done() or self._exceeded is not None or self._stopping()
            )
            if limit is None:
                await workflow.wait_condition(done)
            else:
                try:
                    await workflow.wait_condition(done, timeout=max(limit - self._elapsed(), 0.001))
                except TimeoutError:
                    self._exceeded = self._seconds_over(limit)
            if self._exceeded is not None:
                raise _Stop(self._exceeded)
            if self._stopping():
                raise _Stop(self._stop_reason or "")

    async def _wind_down(self, work: asyncio.Task[None], reason: str) -> None:
        """The budget stop (rule 2): tell the running children to stop, let the loop
        reach its next check (the turn or tool round in flight finishes and is counted;
        a wait for approval ends at once), and wait until the children have ended."""
        self._error = reason
        self._pending = None
        self._set_state("Stopping")
        await self._report_up()
        if self._room_rule:
            # All at once: their commands share workflow tasks (HISTORY_ROOM_PATCH).
            going = [h for h, c in self._children.items() if c.state not in TERMINAL_STATES]
            await asyncio.gather(*(self._tell_stop(h, reason) for h in going))
        else:
            for handle, child in list(self._children.items()):
                if child.state not in TERMINAL_STATES:
                    await self._tell_stop(handle, reason)
        if self._listing:
            work.cancel()  # nothing has run yet: no turn, no tool call (LISTING_PATCH)
        elif self._stop_wait and self._in_turn:
            try:
                await workflow.wait_condition(
                    lambda: work.done() or self._history_full(),
                    timeout=self._spec.stop_turn_wait_s,
                )
            except TimeoutError:
                work.cancel()  # the gateway drops the turn, held or generating
        await workflow.wait_condition(
            lambda: (work.done() and self._children_done()) or self._history_full()
        )
        if work.done() and not work.cancelled():
            work.exception()  # the loop's own stop (or failure): this stop answers it

    async def _halt(self, work: asyncio.Task[None], state: str, reason: str) -> None:
        """Stop the loop and the subtree, record why, report the end."""
        self._ending = True  # takes no children from now on (see _validate_spawn)
        self._halt_reason = reason
        if not work.done():
            work.cancel()
            with contextlib.suppress(BaseException):
                await work
        self._error = reason
        self._pending = None
        if workflow.patched(HALT_UNBROKEN_PATCH):
            await _unbroken(self._stop_children(reason))
        else:
            await self._stop_children(reason)
        if self._ends and not self._children_done() and not self._history_full():
            # Their watchers record how they end; without this wait the run's final
            # status would show them as they last reported ("Stopping", "Running").
            # (Not with its history past HISTORY_HALT_EVENTS: their ends, reports and
            # the workflow tasks they take could take it past Temporal's limit.)
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await workflow.wait_condition(
                    self._children_done, timeout=CHILDREN_END_WAIT.total_seconds()
                )
        self._set_state(state)
        await self._finish()

    async def _stop_children(self, reason: str) -> None:
        if self._room_rule:
            # All at once, their commands sharing workflow tasks: one child after another
            # took some 16 events each, past Temporal's limit for a close with hundreds
            # of children running (helper-159).  (HISTORY_ROOM_PATCH)
            going = [
                h
                for h, c in self._children.items()
                if c.state not in TERMINAL_STATES and h not in self._late_stopped
            ]
            await asyncio.gather(*(self._cancel_child(h, reason) for h in going))
            return
        for handle, child in list(self._children.items()):
            # (One whose start ended while this waited for the loop was stopped then.)
            if child.state not in TERMINAL_STATES and handle not in self._late_stopped:
                await self._cancel_child(handle, reason)

    async def _tell_stop(self, handle: str, reason: str) -> None:
        """Tell a child to stop (a wind-down).  It may have ended meanwhile: its watcher
        records how."""
        with contextlib.suppress(Exception):
            await workflow.get_external_workflow_handle(handle).signal(
                AgentRun.stop, StopRequest(reason)
            )

    async def _cancel_child(self, handle: str, reason: str) -> None:
        """Tell a child why it stops, and cancel it (it may have ended meanwhile)."""
        ext = workflow.get_external_workflow_handle(handle)
        with contextlib.suppress(Exception):
            await ext.signal(AgentRun.stop, StopRequest(reason))
            await ext.cancel()

    async def _finish(self) -> None:
        """Report the end up the tree and to the gateway.  Runs to its end even when a
        cancellation request arrives meanwhile (a failing run's first)."""
        await _unbroken(self._report_end())

    async def _report_end(self) -> None:
        self._ended_at = workflow.now().isoformat()
        await self._report_up()
        try:
            # Local activities: short and idempotent, so they skip the task queue round
            # trip (about 12 ms each on the dev server) that a regular activity pays.
            await workflow.execute_local_activity_method(
                LlmActivities.end_run,
                EndRunInput(self._id),
                start_to_close_timeout=SHORT_TIMEOUT,
                retry_policy=END_RETRY,
            )
        except (ActivityError, ApplicationError) as exc:
            # A local activity whose retries are spent fails bare (an ApplicationError,
            # not an ActivityError): with the gateway down for a few seconds as a run
            # ended, the run ended Failed, and its cause (cancel, budget) was lost
            # from its history (helper-75).  Histories from before kept that ending.
            if isinstance(exc, ApplicationError) and not workflow.patched(END_REPORT_PATCH):
                raise
            workflow.logger.warning(
                "could not report the end of run %s to the gateway: %s",
                self._id,
                exc.cause if isinstance(exc, ActivityError) else exc,
            )
        await workflow.wait_condition(workflow.all_handlers_finished)

    # ------------------------------------------------------------------ the loop

    async def _work(self) -> None:
        spec = self._spec
        if not self._messages:
            if spec.system:
                self._messages.append({"role": "system", "content": spec.system})
            self._messages.append({"role": "user", "content": spec.task})
        if self._tools is None:
            # Tool servers down for this long fail the run (it says which) rather than
            # leave it Running with nothing to show; a run that names its tools waits
            # only for the servers that offer them (NAMED_TOOLS_PATCH).
            timeouts: dict[str, Any] = {
                "start_to_close_timeout": SHORT_TIMEOUT,
                "schedule_to_close_timeout": TOOL_SCHEDULE_TIMEOUT,
                "retry_policy": RETRY,
            }
            if workflow.patched(LISTING_PATCH):
                self._listing = True
                try:
                    listed = await workflow.execute_activity_method(
                        ToolActivities.list_tools, ToolsWanted(spec.tools), **timeouts
                    )
                finally:
                    self._listing = False
            elif workflow.patched(NAMED_TOOLS_PATCH):
                listed = await workflow.execute_local_activity_method(
                    ToolActivities.list_tools, ToolsWanted(spec.tools), **timeouts
                )
            else:
                listed = await workflow.execute_local_activity_method(
                    ToolActivities.list_tools, **timeouts
                )
            if workflow.patched(TOOLS_BY_FUNCTION_PATCH):
                self._tools = chosen_tools(listed, spec.tools)
            else:
                allowed = None if spec.tools is None else set(spec.tools)
                self._tools = [t for t in listed if allowed is None or t.name in allowed]
        while True:
            self._check_budget()
            await self._maybe_continue_as_new()
            offer = self._calls_left() > 0 and bool(self._tools)
            turn = await self._turn(offer)
            if not turn.tool_calls or not offer:
                self._answer = turn.message.get("content") or ""
                self._answer_cut = turn.finish_reason == "length"
                return
            self._check_budget()
            await self._tool_round(turn.tool_calls)

    async def _turn(self, offer: bool) -> TurnOutput:
        spec = self._spec
        assert self._tools is not None
        tools = [t.openai_tool() for t in self._tools] if offer else []
        if workflow.patched(TURN_SIZE_PATCH):
            size = _size(self._messages) + _size(tools)
            # (Each turn's input stays in the history: one that cannot continue as new
            # grows by its conversation a turn.)
            self._check_history("turn", size)
            if size > TURN_INPUT_MAX_BYTES:
                raise ApplicationError(
                    f"the run's conversation is {size:,} bytes as Temporal encodes it "
                    f"(with the tools offered), past the {TURN_INPUT_MAX_BYTES:,} a turn "
                    "may carry (Temporal refuses a payload over 2 MiB): the model's own "
                    "messages grew it (tool answers are cut to keep it under "
                    f"{CONVERSATION_MAX_BYTES:,}); split the work into runs of less "
                    "context, or ask for shorter tool-call arguments",
                    type="ConversationTooLarge",
                    non_retryable=True,
                )
        self._in_turn = True  # a budget stop waits for it a bounded time (STOP_WAIT_PATCH)
        try:
            turn = await workflow.execute_activity_method(
                LlmActivities.llm_turn,
                TurnInput(
                    run_id=self._id,
                    model=spec.model,
                    messages=self._messages,
                    tools=tools,
                    max_tokens=spec.max_tokens,
                    parallel_tool_calls=spec.parallel_tool_calls,
                    service_class=spec.service_class,
                    caller=spec.caller,
                ),
                start_to_close_timeout=TURN_TIMEOUT,
                heartbeat_timeout=HEARTBEAT_TIMEOUT,
                retry_policy=RETRY,
            )
        finally:
            self._in_turn = False
        if not self._provider:
            self._provider = turn.provider
        self._messages.append(turn.message)
        self._usage = self._usage.plus(
            Totals(
                turns=1,
                prompt_tokens=turn.prompt_tokens,
                completion_tokens=turn.completion_tokens,
                cached_tokens=turn.cached_tokens,
                turn_seconds=turn.seconds,
            )
        )
        await self._report_up()
        return turn

    def _check_history(self, what: str, adding: int) -> None:
        """Fail the run (TURN_SIZE_PATCH) when its Temporal history, with `adding`
        bytes more, would pass contract.HISTORY_MAX_BYTES: Temporal terminates a run
        at 50 MB, its answer lost.  (The history's size as its workflow task started:
        the value is recorded in the history, so a replay reads the same.)"""
        history = workflow.info().get_current_history_size()
        if history + adding > contract.HISTORY_MAX_BYTES:
            raise ApplicationError(
                f"the run's Temporal history is {history:,} bytes, and its next {what} "
                f"would add {adding:,}: past {contract.HISTORY_MAX_BYTES:,} (Temporal "
                "terminates a run at 50 MB, its answer lost); it could not continue as "
                "new (children running, or too large a conversation to carry)",
                type="ConversationTooLarge",
                non_retryable=True,
            )

    async def _tool_round(self, calls: list[ToolCall]) -> None:
        spec = self._spec
        if workflow.patched(TURN_SIZE_PATCH):
            # Its answers land in the history whole (the conversation keeps them cut).
            self._check_history("tool round", 0)
        left = self._calls_left()
        spent = (
            f"this run's tool-call budget ({spec.max_tool_calls}) is spent"
            if left == spec.max_tool_calls - self._usage.tool_calls
            else f"the tool-call budget of this run's tree ({spec.budget.tool_calls}) is spent"
        )
        run, over = calls[:left], calls[left:]
        outputs: dict[str, ToolOutput] = {}
        # Approvals first, one at a time, in the model's order; then execution.
        approved: list[ToolCall] = []
        for call in run:
            if not self._needs_approval(call):
                approved.append(call)
                continue
            shown: Any = None  # the arguments the question shows (None: the call's own)
            if workflow.patched(CHECKED_PATCH):
                checked = await self._checked(call)
                if isinstance(checked, ToolOutput):  # it could not run: nobody is asked
                    outputs[call.id] = checked
                    continue
                shown = checked
            if await self._approval(call, shown):
                approved.append(call)
            else:
                outputs[call.id] = ToolOutput(content=DECLINED, is_error=True, executed=False)
        if self._drain:
            self._check_budget()  # a stop may have come while approvals were awaited
        if spec.parallel_tool_calls:
            results = await self._concurrently(approved)
        else:
            results = [await self._call(c) for c in approved]
        outputs.update({c.id: r for c, r in zip(approved, results, strict=True)})
        for call in over:
            outputs[call.id] = ToolOutput(
                content=f"Error: {spent}; answer with what you have",
                is_error=True,
                executed=False,
            )
        self._messages.extend(
            fit_round(
                self._messages, self._tools or [], [(c.id, outputs[c.id].content) for c in calls]
            )
        )
        self._usage = self._usage.plus(
            Totals(
                tool_calls=len(run),
                failed_tool_calls=sum(1 for c in run if outputs[c.id].is_error),
                tool_seconds=sum(outputs[c.id].seconds for c in run),
            )
        )
        await self._report_up()

    async def _concurrently(self, calls: list[ToolCall]) -> list[ToolOutput]:
        """The round's calls at once; one that fails the run cancels the others
        (ROUND_PATCH), as a round made one call after another starts no more."""
        tasks = [asyncio.create_task(self._call(c)) for c in calls]
        try:
            return await asyncio.gather(*tasks)
        except Exception:
            going = [t for t in tasks if not t.done()]
            if going and workflow.patched(ROUND_PATCH):
                for task in going:
                    task.cancel()
                # Each ends at once: an activity's cancel is requested, not waited for.
                await asyncio.gather(*going, return_exceptions=True)
            raise

    async def _call(self, call: ToolCall) -> ToolOutput:
        assert self._tools is not None
        tool = self._tool(call)
        if tool is None:
            names = ", ".join(t.offered for t in self._tools) or "none"
            return ToolOutput(
                content=f"Error: there is no tool named '{call.name}'; the tools are: {names}",
                is_error=True,
                executed=False,
            )
        inp = self._input(call, tool)
        if workflow.patched(TOLD_PATCH):
            return await self._sent(inp, tool)
        if not self._once or tool.repeatable:
            return await _send(inp, once=False)
        return await self._sent(inp, None)

    def _input(self, call: ToolCall, tool: ToolInfo) -> ToolInput:
        """The call as its tool's activities take it (checked, then sent)."""
        return ToolInput(
            run_id=self._id,
            server=tool.server,
            tool=tool.name,
            arguments=call.arguments,
            input_schema=tool.input_schema,
            call_id=call.id,
        )

    async def _sent(self, inp: ToolInput, tool: ToolInfo | None) -> ToolOutput:
        """A call the run sends itself, one attempt per send (rule 5).  It is sent again
        while it never left the worker (its server unreachable: NOT_SENT), with RETRY's
        backoff, for `contract.TOOL_UNREACHED_S` from the first such send since the
        call last broke off (runs without TOLD_PATCH: TOOL_SCHEDULE_TIMEOUT from its
        first send), and then fails the run.  Any other failure may come after the
        server ran it: a call with no answer within its timeout is told to the model,
        and so is one that broke off (the worker died, the connection broke), after
        TOOL_SENDS sends of a repeatable tool's, at once of another's (the outcome is
        unknown).

        `tool` None: a tool that is not repeatable, as runs without TOLD_PATCH send it
        (TOOL_TIMEOUT, and the cause's own words)."""
        told = tool is not None
        timeout = TOOL_TIMEOUT
        if tool is not None and tool.timeout_s > 0:
            # The pool cuts the call at the tool's time; the activity's own timeout also
            # leaves room to open the connection first (contract.TOOL_OPENING_S).
            inp = replace(inp, timeout_s=tool.timeout_s)
            timeout = timedelta(seconds=tool.timeout_s + contract.TOOL_OPENING_S)
        sends = TOOL_SENDS if tool is not None and tool.repeatable else 1
        delay = RETRY.initial_interval
        assert delay is not None and RETRY.maximum_interval is not None
        # Runs without TOLD_PATCH: from the first send, attempts included (an attempt may
        # spend CONNECT_TIMEOUT_S on a server that does not answer), as schedule-to-close
        # bounds a repeatable call.  With it: from the first of the sends not sent since
        # the last that broke off (a call that ran 20 minutes and broke as its server
        # restarted gets its 15 minutes to reach the server again; helper-119).
        window = timedelta(seconds=contract.TOOL_UNREACHED_S) if told else TOOL_SCHEDULE_TIMEOUT
        give_up: datetime | None = workflow.now() + window
        spent = 0.0  # the seconds the sends took (TOLD_PATCH: the run's tool time)
        broke, broke_why = 0, ""
        while True:
            sent_at = workflow.now()
            try:
                out = await _send(inp, once=True, timeout=timeout)
                return replace(out, seconds=out.seconds + spent) if told else out
            except ActivityError as exc:
                cause = exc.cause
                if isinstance(cause, CancelledError):
                    raise
                if isinstance(cause, ApplicationError) and cause.non_retryable:
                    raise  # a failure no attempt mends: the run fails, as with any tool
                spent += (workflow.now() - sent_at).total_seconds()
                unsent = isinstance(cause, ApplicationError) and cause.type == NOT_SENT
                if unsent and give_up is None:
                    give_up = workflow.now() + window
                if unsent and give_up is not None and workflow.now() + delay > give_up:
                    raise  # down for as long as a repeatable call is retried
                timed_out = (
                    isinstance(cause, ActivityTimeout) and cause.type == TimeoutType.START_TO_CLOSE
                ) or (isinstance(cause, ApplicationError) and cause.type == TOOL_TIMED_OUT)
                if not unsent:
                    broke += 1
                    broke_why = _no_answer_why(cause) if told else str(cause or exc)
                    if told:
                        give_up = None  # a later unreachable spell gets its own window
                if not unsent and (timed_out or broke >= sends):
                    if not told:
                        content = UNKNOWN_OUTCOME.format(why=broke_why, tool=inp.tool)
                        return ToolOutput(content, is_error=True, executed=True)
                    assert tool is not None
                    if timed_out:
                        seconds = tool.timeout_s or TOOL_TIMEOUT.total_seconds()
                        why = f"none within {seconds:g} s, the time its server allows a call"
                    else:
                        why = broke_why
                    if not tool.repeatable:
                        content = UNKNOWN_OUTCOME.format(why=why, tool=inp.tool)
                    elif timed_out:
                        content = TIMED_OUT.format(tool=inp.tool, seconds=seconds)
                    else:
                        content = BROKE_OFF.format(tool=inp.tool, why=why, sends=broke)
                    return ToolOutput(content, is_error=True, executed=True, seconds=spent)
                if told or workflow.patched(UNSENT_STOP_PATCH):
                    with contextlib.suppress(TimeoutError):
                        await workflow.wait_condition(self._halting, timeout=delay)
                    if self._halting():
                        stop = self._stop_reason or self._exceeded
                        if not broke:
                            content = f"Error: not sent: this run is stopping ({stop})"
                        else:  # an earlier send may have run
                            content = (
                                f"Error: no answer came back ({broke_why}), and the call was "
                                f"not sent again: this run is stopping ({stop})"
                            )
                        return ToolOutput(
                            content, is_error=True, executed=broke > 0, seconds=spent if told else 0
                        )
                else:
                    await workflow.sleep(delay)
                delay = min(delay * RETRY.backoff_coefficient, RETRY.maximum_interval)

    def _tool(self, call: ToolCall) -> ToolInfo | None:
        """The tool a call asks for: by the name the model was offered, or by the tool's
        own (a model may write that, read in a description or an earlier answer)."""
        tools = self._tools or []
        found = next((t for t in tools if t.offered == call.name), None)
        return found or next((t for t in tools if t.name == call.name), None)

    def _needs_approval(self, call: ToolCall) -> bool:
        tool = self._tool(call)
        if tool is None:
            named = {call.name}
        elif workflow.patched(TOOLS_BY_FUNCTION_PATCH):
            named = {tool.name, tool.offered}
        else:
            named = {tool.name}
        if not named.isdisjoint(self._spec.approve_tools):
            return True
        return tool is not None and tool.destructive and not tool.read_only

    async def _checked(self, call: ToolCall) -> ToolOutput | dict[str, Any] | None:
        """What the tool would get of a call the user is to approve (its arguments,
        coerced to its input schema), or what the model is told instead of asking: no
        such tool, or arguments that cannot fit.  None: not known (the check failed),
        the user is asked about the arguments as written, as before."""
        tool = self._tool(call)
        if tool is None:
            return await self._call(call)  # no tool of that name: nothing to ask about
        try:
            checked = await workflow.execute_local_activity(
                check_arguments,
                self._input(call, tool),
                start_to_close_timeout=SHORT_TIMEOUT,
                retry_policy=END_RETRY,
            )
        except (ActivityError, ApplicationError) as exc:
            if isinstance(exc, ActivityError) and isinstance(exc.cause, CancelledError):
                raise  # the run stops
            # (A local activity whose retries are spent fails bare: see _report_end.)
            workflow.logger.warning("could not check the arguments of %s: %s", tool.name, exc)
            return None
        if checked.arguments is None:
            return ToolOutput(content=checked.error, is_error=True, executed=False)
        return checked.arguments

    async def _approval(self, call: ToolCall, shown: dict[str, Any] | None = None) -> bool:
        """The user's answer to the call (`shown`: its arguments as the tool gets them)."""
        if self._drain:
            self._check_budget()  # a run that is to stop asks nobody
        if call.id not in self._answers:
            arguments: Any = shown
            if arguments is None:
                try:
                    arguments = json.loads(call.arguments) if call.arguments.strip() else {}
                except (ValueError, RecursionError):
                    # Nested too deeply (a model looping on brackets): a RecursionError
                    # failed every workflow task of the run, a cancel too (helper-180).
                    arguments = call.arguments
            if depth(arguments) > MAX_DEPTH:
                # Read, but too deep for a query's answer to carry: every status failed,
                # and the question never reached the user (helper-182).  (Checked ones
                # too: a check from before MAX_DEPTH passed them; helper-183.)
                arguments = call.arguments
            tool = self._tool(call)
            self._pending = PendingApproval(
                call.id,
                tool.name if tool is not None else call.name,
                arguments,
                tool.server if tool is not None else "",
            )
            self._set_state("AwaitingApproval")
            await self._report_up()
            await workflow.wait_condition(lambda: call.id in self._answers or self._halting())
            if self._drain:
                self._check_budget()  # a stop ends the wait (an answer with it is moot)
            self._pending = None
            self._set_state("Running")
            await self._report_up()
        return self._answers[call.id]

    # ------------------------------------------------------------------ budgets

    def _seconds_over(self, limit: float) -> str:
        """The message of a seconds budget passed: used seconds up to the next tenth, so
        they never read as less than the limit (2.47 of 2.4 is "2.5", not "2")."""
        used = math.ceil(self._elapsed() * 10) / 10
        return f"budget exceeded: seconds {used:g}/{limit:g}"

    def _elapsed(self) -> float:
        return (workflow.now() - datetime.fromisoformat(self._started_at)).total_seconds()

    def subtree(self) -> Totals:
        return self._usage.with_children(self._children.values())

    def _calls_left(self) -> int:
        """Tool calls this run may still start: its own `max_tool_calls`, and (with
        SPENT_PATCH) the room left in the tool-call budget it holds (rule 2)."""
        left = self._spec.max_tool_calls - self._usage.tool_calls
        limit = self._spec.budget.tool_calls
        if self._spent_rule and limit is not None:
            left = min(left, limit - self.subtree().tool_calls)
        return max(left, 0)

    def _budget_status(self) -> BudgetStatus | None:
        limits = self._spec.budget
        if not limits.any():
            return None
        used = self.subtree()
        return BudgetStatus(
            limits=limits,
            used=Budget(
                tokens=used.tokens, tool_calls=used.tool_calls, seconds=round(self._elapsed(), 3)
            ),
            exceeded=self._exceeded,
        )

    def _over(self) -> str | None:
        limits = self._spec.budget
        # The subtree only for a limit that reads it: it adds up every child's, and this
        # runs on every report and child's end, so a run with N children and no such
        # limit made some N² additions over its life, again on every replay
        # (helper-257).  The same answer either way: no command changes, no patch.
        if limits.counts_usage():
            used = self.subtree()
            if limits.tokens is not None and used.tokens > limits.tokens:
                return f"budget exceeded: tokens {used.tokens}/{limits.tokens}"
            if limits.tool_calls is not None and used.tool_calls > limits.tool_calls:
                return f"budget exceeded: tool_calls {used.tool_calls}/{limits.tool_calls}"
        if limits.seconds is not None and self._elapsed() >= limits.seconds:
            return self._seconds_over(limits.seconds)
        return None

    def _check_reported(self) -> None:
        """The budget this run holds, on a change below.  Not once the run is closing
        (`_halt`, HALT_REASON_PATCH): what stopped it is said (a cancel, a stop, a
        failure), and the totals its children report as they end do not make its budget
        the reason; a closed run's status says a limit was passed in `BudgetStatus.over`
        instead.  (While it winds down from a stop, before it closes, its own budget is
        still checked, as before every turn.)"""
        if self._exceeded is None and not (self._keep_reason and self._ending):
            self._exceeded = self._over()
        self._check_room()

    def _check_room(self) -> None:
        """Stop the run, as on a budget, once its history has contract.HISTORY_STOP_EVENTS
        events (HISTORY_ROOM_PATCH), or it took contract.SIGNAL_STOP signals
        (SIGNAL_ROOM_PATCH): the stop's reason goes down to its children.  (The length
        as the workflow task started, and the signals it delivered: both in the history,
        so a replay reads the same.)"""
        if not self._room_rule or self._stop_reason is not None or self._ending:
            return
        if self._children_done():
            # None running: it answers, or continues as new, in a few events (helper-158:
            # a parent whose last child's end crossed the limit lost its answer).
            return
        events = workflow.info().get_current_history_length()
        if events >= contract.HISTORY_STOP_EVENTS:
            self._stop_reason = (
                f"run {self._id}'s Temporal history reached {events:,} events, its limit "
                f"{contract.HISTORY_STOP_EVENTS:,} (Temporal terminates a run past 51,200, "
                "and cancels every child it has running; a run continues as new only once "
                "its children have ended): its tree stops, as on a budget"
            )
        elif self._signal_rule and self._signals >= contract.SIGNAL_STOP:
            self._stop_reason = (
                f"run {self._id} took {self._signals:,} signals (its children's reports), "
                f"its limit {contract.SIGNAL_STOP:,} (Temporal takes at most 10,000 into a "
                "run by default, and refuses its children's reports and stops past them; "
                "a run continues as new only once its children have ended): its tree "
                "stops, as on a budget"
            )
        if self._stop_reason is not None:
            workflow.logger.warning("run %s stops: %s", self._id, self._stop_reason)

    def _history_full(self) -> bool:
        """HISTORY_ROOM_PATCH: a wind-down that took the history to
        contract.HISTORY_HALT_EVENTS ends now (the close cancels what still runs) rather
        than wait for children that keep reporting until Temporal terminates the run."""
        return (
            self._room_rule
            and workflow.info().get_current_history_length() >= contract.HISTORY_HALT_EVENTS
        )

    def _children_done(self) -> bool:
        """Every child has ended, and none is still being started (counted with
        DRAIN_PATCH: a child started while this run completes, stops or continues as
        new would otherwise be cancelled by its parent's close)."""
        if self._drain and self._spawning:
            return False
        return all(c.state in TERMINAL_STATES for c in self._children.values())

    def _stopping(self) -> bool:
        """An ancestor's budget stop reached this run (and stops wind down, rule 2)."""
        return self._drain and self._stop_reason is not None

    def _halting(self) -> bool:
        """This run is to stop at its next check, and stops wind down (rule 2)."""
        return self._drain and (self._stop_reason is not None or self._exceeded is not None)

    def _check_budget(self) -> None:
        if self._exceeded is None:
            self._exceeded = self._over()
        self._check_room()
        if self._stop_reason is not None:
            raise _Stop(self._stop_reason)
        if self._exceeded is not None:
            raise _Stop(self._exceeded)

    # ------------------------------------------------------------------ tree

    async def _report_up(self) -> None:
        """Report the run's state and subtree totals to its parent (rule 1).

        Every report is a signal, and an event in each ancestor's history up to the
        root's; Temporal ends a workflow past 51,200 events, and a root with it its
        whole tree.  So (REPORTS_PATCH) one report is on its way at a time, sent by a
        reporter task: changes made meanwhile (a burst of reports from below, handled
        in one workflow task) go up as one, in the next report.  A change of totals
        alone in a subtree under no budget waits until `REPORT_EVERY_S` has passed since
        the last report (a change of state ends the wait).  Returns at once, except
        that a run that has ended returns once its end has gone up."""
        if not self._spec.parent:  # "" was let through before Runs.spawn read it as none
            return
        if not self._coalesce:
            await self._send_report()
            return
        last = self._last_report
        if last is not None and last[0] in TERMINAL_STATES:
            # Its end has gone up, and a parent takes no report of a child after its end:
            # a late one from below (a child that ended past CHILDREN_END_WAIT) would only
            # hold this run's close for REPORT_EVERY_S (helper-82).
            return
        self._report_again = True
        if not self._reporting:
            self._reporting = True
            reporter = asyncio.create_task(self._reporter())
            self._watchers.add(reporter)
            reporter.add_done_callback(self._watchers.discard)
        if self._state in TERMINAL_STATES:
            await workflow.wait_condition(lambda: not self._reporting)

    async def _reporter(self) -> None:
        try:
            while self._report_again:
                hold = self._report_hold()
                if hold > 0:
                    # Held back: a change of state, or a flush, sends it at once.
                    with contextlib.suppress(TimeoutError):
                        await workflow.wait_condition(self._report_due, timeout=hold)
                self._report_again = False
                await self._send_report()
        except BaseException:
            # Cancelled on its way: whoever reports next sends it.
            self._report_again, self._last_report = True, None
            raise
        finally:
            self._reporting = False

    def _report_hold(self) -> float:
        """Seconds the next report waits: totals alone, under no budget, sooner than
        `REPORT_EVERY_S` after the last report."""
        last, at = self._last_report, self._reported_at
        if self._report_due() or last is None or at is None:
            return 0.0
        if self._spec.under_budget:
            return 0.0
        return contract.REPORT_EVERY_S - (workflow.now() - at).total_seconds()

    def _report_due(self) -> bool:
        last = self._last_report
        return self._flushing or last is None or last[0] != self._state

    async def _flush_reports(self) -> None:
        """Send a report held back, and wait until it has gone."""
        self._flushing = True
        try:
            await workflow.wait_condition(lambda: not self._reporting)
        finally:
            self._flushing = False

    async def _send_report(self) -> None:
        parent = self._spec.parent
        report = (self._state, self.subtree())
        if not parent or report == self._last_report:
            return
        self._last_report = report
        self._reported_at = workflow.now()
        # Settled only on its end (the last report), so not part of what a report
        # repeats: a change of it alone sends nothing.
        final = report[0] in TERMINAL_STATES and settled(self._children.values())
        try:
            await workflow.get_external_workflow_handle(parent).signal(
                AgentRun.report, ChildReport(self._id, report[0], report[1], final)
            )
        except Exception:
            workflow.logger.info("run %s: parent %s no longer takes reports", self._id, parent)

    async def _watch(self, handle: str, child: workflow.ChildWorkflowHandle[Any, Any]) -> None:
        try:
            status: RunStatus = await child
            state = "Completed"
            subtree, final = status.subtree, settled(status.children)
        except ChildWorkflowError as exc:
            # A child stopped by a budget ends as Failed in Temporal (it cannot cancel
            # itself) but is Cancelled as a run, like every run its budget stopped.
            cause = exc.cause
            # Terminated (by an operator) reads as Cancelled, as `Runs.status` shows it.
            stopped = isinstance(cause, (CancelledError, TerminatedError)) or (
                isinstance(cause, ApplicationError) and cause.type == BUDGET_EXCEEDED
            )
            state = "Cancelled" if stopped else "Failed"
            # As its end report left it; with none (terminated), not settled.
            known = self._children[handle]
            subtree, final = known.subtree, known.settled and known.state in TERMINAL_STATES
        self._children[handle] = ChildSummary(handle, state, subtree, final)
        self._check_reported()
        await self._report_up()

    async def _maybe_continue_as_new(self) -> None:
        if not workflow.info().is_continue_as_new_suggested() or self._no_continue:
            return
        if not self._children_done():
            return  # closing this run would cancel its running children
        if self._coalesce:
            # The next run reports afresh.  First: the flush may take workflow tasks, in
            # which a child may be spawned; the checks below see it (helper-82).
            await self._flush_reports()
        await workflow.wait_condition(workflow.all_handlers_finished)
        if self._drain and not self._children_done():
            return  # a child was spawned meanwhile
        if self._coalesce and self._reporting:
            return  # a report went on its way meanwhile: at the next check
        carried = AgentRunInput(
            spec=self._spec,
            carry=Carry(
                messages=self._messages,
                usage=self._usage,
                answers=self._answers,
                started_at=self._started_at,
                tools=list(self._tools or []),
                children=list(self._children.values()),
            ),
        )
        if workflow.patched(TURN_SIZE_PATCH):
            # The task and system prompt travel twice (the spec, the first messages):
            # an input Temporal would refuse is not sent; the run goes on here.
            size = len(json.dumps(dataclasses.asdict(carried), default=str))
            if size > TURN_INPUT_MAX_BYTES:
                # The conversation only grows: not asked again (nor logged).  The history
                # bound ends the run, saying why, if it goes on that long.
                self._no_continue = True
                workflow.logger.warning(
                    "run %s cannot continue as new: its input would be %s bytes",
                    self._id,
                    f"{size:,}",
                )
                return
        workflow.continue_as_new(carried)

    def _set_state(self, state: str) -> None:
        if state != self._state:
            self._state = state
            self._updated_at = workflow.now().isoformat()
            workflow.upsert_search_attributes([STATE.value_set(state)])

    # ------------------------------------------------------------------ messages

    @workflow.query
    def status(self) -> RunStatus:
        """The run as `status` shows it."""
        state = self._state
        if self._ending and state not in TERMINAL_STATES:
            # Closing (cancelled, stopped or failed): its children are being stopped
            # and their ends awaited, which with hundreds of them takes tens of
            # seconds.  It read as before meanwhile: `cancel` answered AwaitingApproval
            # (an MCP task input_required) with no approval left to give (helper-254).
            # Its recorded state (the search attribute) changes only as it ends.
            state = "Stopping"
        return RunStatus(
            handle=self._id,
            state=state,
            task=self._spec.task,
            model=self._spec.model,
            service_class=self._spec.service_class,
            caller=self._spec.caller,
            parent=self._spec.parent,
            root=self._root,
            children=list(self._children.values()),
            usage=self._usage,
            subtree=self.subtree(),
            answer=self._answer if self._state == "Completed" else None,
            answer_cut=self._answer_cut and self._state == "Completed",
            error=self._error,
            budget=self._budget_status(),
            pending_approval=self._pending,
            started_at=self._started_at,
            ended_at=self._ended_at,
            updated_at=self._updated_at,
        )

    def _final(self) -> RunStatus:
        """The status the run ends with (its result, or its failure's details), within
        Temporal's 2 MB for either: the task (its caller gave it) is cut first, then
        the answer, each with a note.  (Each was within its own bound, their sum was
        not, and the run's close failed for ever, its answer lost; helper-163.)"""
        status = self.status()
        converter = workflow.payload_converter()
        for field in ("task", "answer"):
            text = getattr(status, field)
            if payload_bytes(status, converter) <= RESULT_MAX_BYTES:
                break
            if not text:
                continue
            note = (
                f"\n[luftpause: the {field}, {len(text):,} characters, is cut here: the "
                "run's final status is limited to what Temporal carries]"
            )
            room = (
                RESULT_MAX_BYTES - payload_bytes(_with(status, field, ""), converter) - _size(note)
            )
            # The longest beginning that fits, by its bytes as JSON (a character takes 1
            # to 12; helper-167: a cut by their average left CJK before English whole).
            lo, hi = 0, len(text)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if _size(text[:mid]) <= room:
                    lo = mid
                else:
                    hi = mid - 1
            status = _with(status, field, text[:lo] + note)
        return status

    def span_end(self) -> tuple[dict[str, str | int], str | None]:
        """How the run ended, for its `invoke_agent` span (luftpause/telemetry.py)."""
        usage = self._usage
        attributes: dict[str, str | int] = {
            "luftpause.state": self._state,
            "luftpause.turns": usage.turns,
            "luftpause.tool_calls": usage.tool_calls,
            "gen_ai.usage.input_tokens": usage.prompt_tokens,
            "gen_ai.usage.output_tokens": usage.completion_tokens,
            "luftpause.subtree_tokens": self.subtree().tokens,
        }
        if usage.cached_tokens:
            attributes["gen_ai.usage.cache_read.input_tokens"] = usage.cached_tokens
        return attributes, (self._error or "failed") if self._state == "Failed" else None

    def span_provider(self) -> str | None:
        """The provider its span names (luftpause/telemetry.py), or None: no turn of it
        was answered by a gateway that names one."""
        return self._provider or None

    @workflow.query
    def transcript(self) -> list[dict[str, Any]]:
        """The run's messages so far, in the OpenAI chat shape."""
        return self._messages

    @workflow.signal
    async def report(self, report: ChildReport) -> None:
        """A child's subtree changed."""
        self._signals += 1
        known = self._children.get(report.handle)
        if known is not None and known.state in TERMINAL_STATES:
            return  # the watcher saw it end; a late report changes nothing
        self._children[report.handle] = ChildSummary(
            report.handle, report.state, report.subtree, report.settled
        )
        self._check_reported()
        await self._report_up()

    @workflow.signal
    def stop(self, request: StopRequest) -> None:
        """An ancestor's budget tripped: stop at the next check (see rule 2)."""
        self._signals += 1
        self._stop_reason = self._stop_reason or request.reason

    @workflow.signal
    async def withdraw_child(self, request: ChildWithdrawal) -> None:
        """The caller of `spawn_child` for this handle gave up waiting for the run to
        take it (`Runs.spawn`, after CHILD_WAIT_S): the server still holds the request,
        and a worker that comes later delivers it.  It is refused then; a child that
        started meanwhile (the request was taken as its caller gave up) is cancelled.
        (A signal, which old histories never carry: no patch is needed.)"""
        self._signals += 1
        self._withdrawn[request.handle] = None
        while len(self._withdrawn) > WITHDRAWN_KEPT:
            del self._withdrawn[next(iter(self._withdrawn))]
        child = self._children.get(request.handle)
        if child is not None and child.state not in TERMINAL_STATES:
            await self._cancel_child(request.handle, WITHDRAWN_REASON)
        # (One still starting is cancelled by spawn_child once it has started.)

    @workflow.update
    async def spawn_child(self, request: ChildRequest) -> str:
        """Start a child run of this run; returns its handle once it exists."""
        spec = replace(
            request.spec,
            parent=self._id,
            root=self._root,
            caller=request.spec.caller or self._spec.caller,
            under_budget=self._spec.under_budget or self._spec.budget.counts_usage(),
        )
        self._spawning.add(request.handle)  # before any await: the validator counts it
        if request.handle not in self._starting:
            self._starting[request.handle] = payload_bytes(request, workflow.payload_converter())
        try:
            child = await workflow.start_child_workflow(
                AgentRun.run,
                AgentRunInput(spec),
                id=request.handle,
                parent_close_policy=workflow.ParentClosePolicy.REQUEST_CANCEL,
                search_attributes=search_attributes(spec, request.handle),
                # Its own class's, not its parent's (which a child inherits unless told).
                # No patch: core compares only a child start's id and type on replay.
                priority=run_priority(spec),
            )
        finally:
            self._spawning.discard(request.handle)
            self._starting.pop(request.handle, None)
        if request.handle not in self._children or not workflow.patched(EARLY_REPORT_PATCH):
            self._children[request.handle] = ChildSummary(request.handle, "Running", settled=False)
        watcher = asyncio.create_task(self._watch(request.handle, child))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)
        reason = self._stop_reason or self._exceeded
        if self._ending and workflow.patched(LATE_CHILD_PATCH):
            # The run began closing while the child was starting, after `_halt` had
            # stopped the children it knew: this one ends as they did.
            self._late_stopped.add(request.handle)
            await self._cancel_child(request.handle, self._halt_reason)
        elif request.handle in self._withdrawn:
            # Its caller withdrew the request while the child was starting.
            await self._cancel_child(request.handle, WITHDRAWN_REASON)
        elif self._drain and reason is not None:
            # The stop came while the child was starting: it stops too (rule 2).
            with contextlib.suppress(Exception):
                await workflow.get_external_workflow_handle(request.handle).signal(
                    AgentRun.stop, StopRequest(reason)
                )
        await self._report_up()
        return request.handle

    @spawn_child.validator
    def _validate_spawn(self, request: ChildRequest) -> None:
        if self._state in TERMINAL_STATES:
            raise ValueError(f"run '{self._id}' has ended ({self._state}); it takes no children")
        if self._ending:
            # Closing (waiting for the ends of the children it cancelled): a child
            # started now would run on unasked until the close cancels it.
            raise ValueError(f"run '{self._id}' is ending ({self._error}); it takes no children")
        reason = self._exceeded or self._stop_reason
        if reason:
            raise ValueError(f"run '{self._id}' is stopping ({reason}); it takes no children")
        # (Children still starting count: several spawns may arrive in one workflow
        # task, each validated before any is started.)
        if request.handle in self._children or request.handle in self._spawning:
            raise ValueError(f"run '{self._id}' already has a child '{request.handle}'")
        if request.handle in self._withdrawn:
            raise ValueError(
                f"the request for child '{request.handle}' was withdrawn (its caller gave "
                "up waiting for the run to take it); no child was started"
            )
        most = contract.MAX_RUN_CHILDREN
        had = len(self._children) + len(self._spawning)
        if had >= most:
            raise ValueError(
                f"run '{self._id}' has had {had} children, the most one run "
                f"may have ({most}); start further runs without a parent"
            )
        events = workflow.info().get_current_history_length()
        if events >= contract.SPAWN_HISTORY_LIMIT:
            raise ValueError(
                f"run '{self._id}' takes no more children: its Temporal history has {events} "
                f"events (at {contract.SPAWN_HISTORY_LIMIT} it stops taking children, so "
                "that the reports of those it has stay under Temporal's limit of 51,200, "
                "past which Temporal ends the run and its tree); start further runs "
                "without a parent"
            )
        if self._signal_rule and self._signals >= contract.SPAWN_SIGNAL_LIMIT:
            raise ValueError(
                f"run '{self._id}' takes no more children: it has taken {self._signals:,} "
                f"signals, its children's reports (at {contract.SPAWN_SIGNAL_LIMIT:,} it "
                "stops taking children, so that the reports of those it has stay under "
                "Temporal's limit of 10,000, past which they are refused); start further "
                "runs without a parent"
            )
        size = payload_bytes(request, workflow.payload_converter())
        starting = sum(self._starting.values())
        if self._starting and starting + size > contract.CHILDREN_STARTING_BYTES:
            raise ApplicationError(
                f"run '{self._id}' is starting {len(self._starting)} children of "
                f"{starting:,} bytes; one of {size:,} more is refused until they have "
                f"started (at most {contract.CHILDREN_STARTING_BYTES:,} at once: they "
                "share a workflow task, which Temporal limits)",
                type=CHILDREN_STARTING,
                non_retryable=True,
            )
        self._starting[request.handle] = size  # taken: the next spawn's validator counts it

    @workflow.update
    def approve(self, answer: Approval) -> str:
        """Answer the pending approval; returns the tool that was allowed or declined."""
        assert self._pending is not None  # the validator ran
        self._answers[self._pending.call_id] = answer.allow
        return self._pending.tool

    @approve.validator
    def _validate_approve(self, answer: Approval) -> None:
        if self._pending is None:
            raise ValueError(f"run '{self._id}' has no pending approval (state {self._state})")
        call_id = self._pending.call_id
        if answer.call_id is not None and answer.call_id != call_id:
            raise ValueError(
                f"run '{self._id}' is waiting on call '{call_id}', not '{answer.call_id}'"
            )
        # Two answers can reach the run in one workflow task (the approve tool and an
        # elicitation, two clients): the first stands, and one that says otherwise is
        # refused, never acknowledged and then overwritten.  The same answer again (a
        # resend) is taken.  (Validators do not run on replay: no patch needed.)
        given = self._answers.get(call_id)
        if given is not None and given != answer.allow:
            said = "allowed" if given else "declined"
            raise ValueError(f"run '{self._id}' has its answer to call '{call_id}' already: {said}")


def search_attributes(spec: RunSpec, handle: str) -> TypedSearchAttributes:
    """The search attributes a run starts with."""
    pairs: list[SearchAttributePair[Any]] = [
        SearchAttributePair(CALLER, spec.caller or "anonymous"),
        SearchAttributePair(ROOT, spec.root or handle),
        SearchAttributePair(CLASS, spec.service_class),
        SearchAttributePair(MODEL, spec.model),
        SearchAttributePair(STATE, "Running"),
    ]
    if spec.parent:
        pairs.append(SearchAttributePair(PARENT, spec.parent))
    return TypedSearchAttributes(pairs)
