"""`Runs`: the one Python facade for run operations over the Temporal client.

spawn, await (all | any, with a timeout), status, cancel, approve and list — used by the
MCP door and the tests, so both see runs the same way.  Errors the caller can fix
(unknown handle, a run with nothing to approve, a parent that has ended) raise
`RunError` with a message that says what was expected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest, DescribeTaskQueueRequest
from temporalio.client import (
    Client,
    WorkflowExecutionDescription,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowUpdateFailedError,
    WorkflowUpdateRPCTimeoutOrCancelledError,
)
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.converter import value_to_type
from temporalio.exceptions import ApplicationError, FailureError
from temporalio.service import RPCError, RPCStatusCode

from workflows.agent_run import CHILDREN_STARTING, AgentRun, search_attributes
from workflows.contract import (
    ACTIVE_STATES,
    CALL_ID_MAX_CHARS,
    CALLER,
    CHILDREN_STARTING_BYTES,
    CLASS,
    MODEL,
    PARENT,
    ROOT,
    STATE,
    TERMINAL_STATES,
    AgentRunInput,
    Approval,
    ChildRequest,
    ChildSummary,
    ChildWithdrawal,
    RunSpec,
    RunStatus,
    Totals,
    run_priority,
    settled,
)

log = logging.getLogger(__name__)
# What a spawn's last send after a refusal needs at least (Runs._spawn_child).
_LAST_SEND_S = 0.25

__all__ = [
    "AWAIT_MAX_S",
    "CallerRuns",
    "Rounds",
    "RunError",
    "RunUnavailable",
    "Runs",
    "SpawnTurn",
    "new_handle",
    "status_unavailable",
]

# The error of a status Temporal gave because no worker answered its query (the run's
# state as Temporal knows it; nothing of what it waits for).
STATUS_UNAVAILABLE = "status unavailable: "
# The runs' workflow type (@workflow.defn names it after its class).
AGENT_RUN = AgentRun.__name__
# Runs below an ended run whose ends are read at once (`Runs._with_children_ends`).
_READS_AT_ONCE = 16
# Children whose ends were read that way and found final, kept so that they are read
# once, not at every status of the runs above them (their runs are closed: what they
# hold no longer changes).
_FINAL_KEPT = 4096


def _quoted(value: str) -> str:
    """A string literal of Temporal's list filter."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


AWAIT_MAX_S = 600.0
CANCEL_WAIT_S = 10.0  # how long `cancel` waits for the run to end before answering
CANCEL_QUERY_TIMEOUT_S = 2.0  # then, how long it asks a worker for the run's state
_QUERY_TIMEOUT_S = 10.0
_QUERY_FLOOR_S = 2.0  # the least a wait asks a worker for a run's status, however short
_QUERY_AGAIN_S = 0.5  # a query asked again of a run no worker answered for (Rounds)
# How long a request a run's worker must take (an update: `spawn(parent=...)`, which the
# parent workflow starts, and `approve`) waits for it; then it answers that the request
# was not taken yet (it may still be, later).
CHILD_WAIT_S = 30.0


class Rounds:
    """What a caller waiting in rounds (the MCP door's `await`) saw of each run: its
    status, and its history's length then.  Every change of a run (a turn or tool
    call ended, an approval asked for or answered, a child reported, a signal) is an
    event in its history; a run whose history has not grown has not changed, so a
    later round describes it (the Temporal server answers) instead of querying it
    (a worker replays it to answer).  Lives as long as one `await` call."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[str, int, RunStatus]] = {}

    def __contains__(self, handle: str) -> bool:
        return handle in self._seen

    def __getitem__(self, handle: str) -> RunStatus:
        return self._seen[handle][2]

    def unchanged(self, desc: WorkflowExecutionDescription) -> RunStatus | None:
        """The status last seen of the run `desc` describes, if nothing has happened in
        it since: still running, the same run (no continue-as-new), no new event; never
        one no worker answered for (`unavailable`)."""
        seen = self._seen.get(desc.id)
        if seen is None or desc.status != WorkflowExecutionStatus.RUNNING:
            return None
        if status_unavailable(seen[2]):
            return None
        return seen[2] if (desc.run_id, desc.history_length) == seen[:2] else None

    def unavailable(self, handle: str) -> bool:
        """Whether the run was last seen with no worker to answer for it: asked again
        at the next round, as a worker may be back (helper-126: a run waiting for an
        approval adds no event, so the first round's answer stood for the whole call,
        and the approval was never asked about)."""
        seen = self._seen.get(handle)
        return seen is not None and status_unavailable(seen[2])

    def saw(self, desc: WorkflowExecutionDescription, status: RunStatus) -> None:
        self._seen[desc.id] = (desc.run_id, desc.history_length, status)


def status_unavailable(status: RunStatus) -> bool:
    """Whether the status is what Temporal knows because no worker answered for the run
    (its state only; nothing of what it waits for)."""
    return (status.error or "").startswith(STATUS_UNAVAILABLE)


def _seconds_so_far(status: RunStatus) -> RunStatus:
    """A running run's status with its budget's seconds counted to now.  A query reads
    the workflow's clock at its last activation: an idle run's seconds would stand
    still.  Its budget's seconds run from its start."""
    budget = status.budget
    if budget is None or not status.started_at or status.state in TERMINAL_STATES:
        return status
    started = datetime.fromisoformat(status.started_at)
    elapsed = (datetime.now(UTC) - started).total_seconds()
    if elapsed <= (budget.used.seconds or 0.0):
        return status
    used = replace(budget.used, seconds=round(elapsed, 3))
    return replace(status, budget=replace(budget, used=used))


def _no_approval(handle: str, state: str) -> str:
    return f"run '{handle}' has ended ({state}); it has no pending approval"


class RunError(Exception):
    """A run operation the caller asked for cannot be done; the message says why."""


class RunUnavailable(RunError):
    """The run could not take the request: no worker is up to run it, or none took the
    request in time.  Unlike other RunErrors, not an answer about the request: a caller
    that would ignore a refused answer (one answered already) must report this one."""


# The state a run closed without setting its own (terminated from outside) is read in.
_CLOSED = {
    WorkflowExecutionStatus.COMPLETED: "Completed",
    WorkflowExecutionStatus.FAILED: "Failed",
    WorkflowExecutionStatus.CANCELED: "Cancelled",
    WorkflowExecutionStatus.TERMINATED: "Cancelled",
    WorkflowExecutionStatus.TIMED_OUT: "Failed",
}


def _visibility_name(status: WorkflowExecutionStatus) -> str:
    """A close status as visibility queries spell it (TIMED_OUT is 'TimedOut')."""
    return "".join(part.title() for part in status.name.split("_"))


# The same mapping the other way, by visibility's names, for `list(state=...)`.
_CLOSED_AS = {
    state: tuple(_visibility_name(s) for s, read in _CLOSED.items() if read == state)
    for state in dict.fromkeys(_CLOSED.values())
}


def _in_state(state: str) -> str:
    """A visibility query for the runs `status` reads in `state`: a run whose own state
    is an end is Stopping until its workflow closes (it is still reporting its end),
    and a run closed without setting its state (terminated from outside) is in the
    state its close gives it."""
    own = f"{STATE.name} = {_quoted(state)}"
    ended = [f"{STATE.name} = {_quoted(s)}" for s in sorted(TERMINAL_STATES)]
    if state in TERMINAL_STATES:
        not_ended = " AND ".join(f"{STATE.name} != {_quoted(s)}" for s in sorted(TERMINAL_STATES))
        closed = " OR ".join(f"ExecutionStatus = {_quoted(e)}" for e in _CLOSED_AS[state])
        return f"ExecutionStatus != 'Running' AND ({own} OR (({not_ended}) AND ({closed})))"
    if state == "Stopping":
        own = f"({' OR '.join([own, *ended])})"
    return f"ExecutionStatus = 'Running' AND {own}"


# The spawns of one parent's children a gateway sends at once: Temporal takes 10
# updates in flight per workflow by default (limit.workflowExecution.maxInFlightUpdates),
# and refuses more; some room is left for `approve` and other gateways.
_SPAWNS_AT_ONCE = 8


class _Gate(asyncio.Semaphore):
    """The sends of spawns to one parent run (`Runs._spawn_child`), and how many spawns
    use it (it is dropped when none does).  `tripped`: why the parent is taken for
    stuck (a send to it was not taken within its clock, or a spawn was refused for all
    of its clock, while it took no other; or no worker polls), which every spawn then
    waiting its turn fails with, unsent, until a send is taken.  `taken`: how many
    sends the parent has taken."""

    def __init__(self) -> None:
        super().__init__(_SPAWNS_AT_ONCE)
        self.users = 0
        self.tripped: str | None = None
        self.taken = 0
        # The spawns waiting their turn, first in line first (the semaphore wakes its
        # waiters in order): what `SpawnTurn.ahead` counts.
        self.line: dict[SpawnTurn, None] = {}


class SpawnTurn:
    """How a child's spawn stands at its parent's gate (`Runs.spawn`'s `turn`), for its
    caller to follow and to give up on (the MCP door's `spawn`: progress while the
    spawn waits, and a cut call's spawn taken out of the line).  `ahead`: the spawns
    waiting their turn before this one, while it waits; `sending`: its turn has come,
    its parent not taken for stuck (or, for a run without a parent, its start has
    begun), and its request may reach Temporal.  `changed` is set as either changes
    (its reader clears it); `ahead`, which each turn given moves, is read when wanted.
    Until `sending`, cancelling the spawn's task sends nothing, and a spawn in line
    leaves it, its turn passed on; once `sending`, the request must be withdrawn
    (`Runs.withdraw_child`).

    A status object rather than a callback: the caller reads it at its own pace (each
    turn given moves every spawn behind it, 499 of a burst of 500), its reads cannot
    fail or hold a spawn at the gate, and what it decides on a cut (`sending`) is read
    at the moment of the cut, with no await between the read and the cancel."""

    def __init__(self) -> None:
        self.parent: str | None = None  # the run it waits at, once in line
        self.sending = False
        self.changed = asyncio.Event()
        self._gate: _Gate | None = None

    @property
    def ahead(self) -> int | None:
        """The spawns waiting their turn before this one; None out of the line."""
        gate = self._gate
        if gate is None or self not in gate.line:
            return None
        for n, other in enumerate(gate.line):
            if other is self:
                return n
        return None  # (unreachable: it is in the line)

    def _started(self) -> None:
        self.sending = True
        self.changed.set()


# How long reading the namespace's retention may take (a Tasks poll waits on it).
_RETENTION_READ_S = 2.0


class _NotTaken(RunUnavailable):
    """A request was sent to the run's worker, which did not take it in time."""


def _stuck(gate: _Gate) -> None:
    """Raise, for a spawn about to be sent, if `gate` has tripped: its parent is taken
    for stuck, so the spawn is not sent (one that waited its turn has nothing to
    withdraw; one sent before and turned away is withdrawn by `_send_spawn`)."""
    if gate.tripped is not None:
        raise RunUnavailable(
            f"{gate.tripped}; another spawn to it found so, and this one was not sent "
            "(again): no child was started"
        )


@dataclass(frozen=True)
class _Again:
    """A spawn's send to make again (`Runs._send_spawn`): `why` this one was not taken
    (or not made, its turn at the gate not come), the error's words once time is up;
    `turned_away`: Temporal refused, aborted or cut it short, and may have taken it all
    the same."""

    why: str
    turned_away: bool = False


def new_handle() -> str:
    """A fresh run handle (the workflow id)."""
    return f"run-{uuid.uuid4().hex[:20]}"


def _reason(exc: WorkflowUpdateFailedError) -> str:
    """Why the run refused an update, in its own words (without the Python type that
    Temporal puts before an ApplicationError's message)."""
    cause = exc.cause
    return cause.message if isinstance(cause, FailureError) else str(cause or exc)


def _busy(exc: RPCError) -> bool:
    """Whether Temporal turned an update away without an answer from the run: refused
    for its load (the workflow's updates in flight at the limit, 10 by default; a rate
    limit), or aborted, the workflow's updates in memory lost (Temporal retries that
    itself, then gives up; the update may have been taken all the same, by a worker
    that answered it).  Sent again, it may be taken."""
    if exc.status == RPCStatusCode.RESOURCE_EXHAUSTED:
        return True
    # (Either case: a Temporal server's registry says "Workflow Update was aborted.".)
    return exc.status == RPCStatusCode.UNAVAILABLE and "update was aborted" in exc.message.lower()


def _refused(exc: RPCError, parent: str | None) -> None:
    """Raise a RunError if Temporal refused the run's input as too large (its blob
    limit, 2 MB by default); return otherwise."""
    if exc.status == RPCStatusCode.INVALID_ARGUMENT and "size" in exc.message.lower():
        to = f"parent run '{parent}'" if parent is not None else "Temporal"
        raise RunError(
            f"the run's input is too large for {to}: {exc.message} (task and system "
            "prompt, together under the server's payload limit, 2 MB by default)"
        ) from None


async def _final(h: WorkflowHandle[AgentRun, RunStatus]) -> RunStatus:
    """An ended run's last status from its history: the result, or the details of the
    failure it ended with (budget stops and failed runs carry it)."""
    try:
        return await h.result()
    except WorkflowFailureError as exc:
        cause = exc.cause
        if isinstance(cause, ApplicationError) and cause.details:
            final: RunStatus = value_to_type(RunStatus, cause.details[0])
            return final
        raise


class Runs:
    """Run operations for one Temporal namespace and task queue."""

    def __init__(
        self, client: Client, *, task_queue: str, child_wait_s: float = CHILD_WAIT_S
    ) -> None:
        self._client = client
        self._queue = task_queue
        self._child_wait_s = child_wait_s
        # handle -> (Temporal run id, state, subtree) of an unsettled child read to its
        # final end (a reset starts another run under the handle: read again then).
        self._final: OrderedDict[str, tuple[str, str, Totals]] = OrderedDict()
        # parent -> the spawns of its children this gateway is sending (`_spawn_child`).
        self._gates: dict[str, _Gate] = {}

    @property
    def client(self) -> Client:
        return self._client

    def _handle(self, handle: str) -> WorkflowHandle[AgentRun, RunStatus]:
        return self._client.get_workflow_handle_for(AgentRun.run, handle)

    async def spawn(
        self, spec: RunSpec, *, handle: str | None = None, turn: SpawnTurn | None = None
    ) -> str:
        """Start a run (a child of `spec.parent` when given); returns its handle once the
        workflow exists, so the handle is durable when the caller sees it.  `turn`: how
        the spawn stands, for a caller that follows it (`SpawnTurn`)."""
        handle = handle or new_handle()
        turn = turn or SpawnTurn()
        if spec.parent is not None and not spec.parent.strip():
            spec = replace(spec, parent=None)  # "" (a form's empty field): no parent
        if spec.parent:
            # A child only of this gateway's runs (helper-129: the update reached another
            # task queue's run, and a workflow that is no run).
            await self._describe(spec.parent)
            try:
                return await self._spawn_child(spec.parent, handle, spec, turn)
            except _NotTaken as exc:
                # The server keeps an update its caller left, and a worker that comes
                # takes it: a child would start that its caller was told had not, and
                # that a retry would start twice.  The parent is told to refuse the
                # request, or to cancel the child if it started meanwhile.
                if await self.withdraw_child(spec.parent, handle):
                    raise RunUnavailable(
                        f"{exc}; the request is withdrawn: no child runs (one its parent "
                        f"started meanwhile, run '{handle}', is cancelled)"
                    ) from None
                raise RunUnavailable(
                    f"{exc}; the request may still be taken later, and the child is then "
                    f"run '{handle}' (status tells)"
                ) from None
            except WorkflowUpdateFailedError as exc:
                raise RunError(_reason(exc)) from None
            except RPCError as exc:
                _refused(exc, spec.parent)
                if "workflow task failure" in exc.message:
                    # The parent's task failed as it started the child (a limit of
                    # Temporal's, such as pending children); the update was not taken.
                    raise RunError(
                        f"parent run '{spec.parent}' could not start the child: its "
                        f"workflow task failed ({exc.message}); the worker's log says "
                        "why (a per-workflow limit of Temporal's, such as "
                        "limit.numPendingChildExecutions.error, can be the cause); no "
                        "child was started"
                    ) from None
                if exc.status != RPCStatusCode.NOT_FOUND:
                    raise
                # Updates reach only running workflows: say which case this is.
                state = (await self.status(spec.parent)).state  # RunError if unknown
                raise RunError(
                    f"parent run '{spec.parent}' has ended ({state}); it takes no children"
                ) from None
        turn._started()
        try:
            await self._client.start_workflow(
                AgentRun.run,
                AgentRunInput(spec),
                id=handle,
                task_queue=self._queue,
                search_attributes=search_attributes(spec, handle),
                priority=run_priority(spec),
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
            )
        except RPCError as exc:
            _refused(exc, None)
            raise
        return handle

    async def _spawn_child(self, parent: str, handle: str, spec: RunSpec, turn: SpawnTurn) -> str:
        """Ask run `parent` to start child `handle`.  A send refused while other children
        of it start (contract.CHILDREN_STARTING_BYTES; it left no trace), or by Temporal
        (`_busy`, or cut short), is sent again, after 20 ms, doubling to 1 s, all within
        `child_wait_s` (helper-167: each send had its own, twice that in all).  Every
        send carries the same update id: Temporal answers a send of an update it has
        taken with that update's outcome, so a send again never starts a second child.
        At most _SPAWNS_AT_ONCE sends to one parent are in flight from this gateway, the
        others wait their turn (helper-210: 150 spawns at once, sent again as Temporal
        refused them, kept the parent's workflow tasks failing, and most were never
        taken).  The clock starts at a spawn's turn, not as it joins the line
        (helper-242: of 250 spawns at one parent taking ~4 a second, 116-131 ran out
        of time in the line), and the spawn keeps its turn for all its sends (sent
        again, it waited at the back of the line with its clock running, and failed
        there); the line is bounded by the parent's progress instead: a send not taken
        within its clock, no worker, or a clock run out while the parent took no
        spawn, trips the gate, and the spawns waiting their turn fail at once, unsent.
        `turn` shows where the spawn stands; one cancelled before its turn leaves the
        line unsent (helper-248: the door let a cut call's spawn wait on, to be sent
        and refused, a turn and a round trip at the parent that is the bottleneck)."""
        loop = asyncio.get_running_loop()
        update_id = f"spawn-{handle}-{uuid.uuid4().hex[:8]}"
        pause = 0.02
        # Whether Temporal refused, aborted or cut short a send.  An aborted update may
        # have been taken all the same (the worker's answer revives it after Temporal lost
        # it), as may one cut short, and a refusal may answer a send Temporal retried
        # itself after aborting it (helper-207: 4 of 80 spawns sent at once were refused
        # for the limit, and their children ran).  Such a spawn is answered with an error
        # only once its child is found not to have started, and its request withdrawn.
        unsure = False
        gate = self._gates.setdefault(parent, _Gate())
        gate.users += 1
        try:
            _stuck(gate)
            turn.parent, turn._gate = parent, gate
            gate.line[turn] = None
            turn.changed.set()
            try:
                # Its turn: no clock while it waits (the gate trips).  Cancelled here, the
                # semaphore passes a turn it was just given on to the next.
                await gate.acquire()
            finally:
                del gate.line[turn]
            try:
                # Tripped while it waited: it fails unsent, and is not said to be sending
                # (helper-252: its progress said it was sent, and a cut withdrew it).
                _stuck(gate)
                turn._started()  # (no await since its turn came: `sending` is exact)
                deadline = loop.time() + self._child_wait_s
                taken = gate.taken
                while True:
                    sent = await self._send_spawn(
                        parent,
                        handle,
                        spec,
                        gate,
                        deadline=deadline,
                        update_id=update_id,
                        unsure=unsure,
                    )
                    if not isinstance(sent, _Again):
                        return sent
                    unsure = unsure or sent.turned_away
                    # A send needs a round trip's time: one with only milliseconds left
                    # was cut as not taken, and withdrawn, the caller told to look for a
                    # worker (helper-168).
                    if loop.time() + pause + _LAST_SEND_S > deadline:
                        if gate.taken == taken and gate.tripped is None:
                            # Refused a whole clock, none taken: so would the line be.
                            gate.tripped = sent.why
                        if unsure:
                            if await self._has_child(parent, handle):
                                return handle
                            raise _NotTaken(sent.why)  # Runs.spawn withdraws the request
                        # (Not the run's words: they say why it refused one send.)
                        raise RunUnavailable(f"{sent.why}; no child was started: spawn it again")
                    await asyncio.sleep(pause)
                    pause = min(pause * 2, 1.0)
            finally:
                gate.release()
        finally:
            gate.users -= 1
            if gate.users == 0:
                del self._gates[parent]

    async def _send_spawn(
        self,
        parent: str,
        handle: str,
        spec: RunSpec,
        gate: _Gate,
        *,
        deadline: float,
        update_id: str,
        unsure: bool,
    ) -> str | _Again:
        """One send of `_spawn_child`'s update, in its turn at `gate`: the child's handle
        as the parent answered it, _Again when a send again may be taken, or the error.
        `unsure`: Temporal turned an earlier send away, so an error goes up only once the
        child is found not to have started (and its request withdrawn, here or, for
        _NotTaken, by `spawn`); a child found started answers the spawn."""
        taken = gate.taken
        try:
            _stuck(gate)  # (unsure, it is withdrawn below)
            child: str = await self._update(
                parent,
                AgentRun.spawn_child,
                ChildRequest(handle, replace(spec, parent=None)),
                no_worker=f"the parent run '{parent}' cannot start a child until "
                "one runs (`luftpause worker`); nothing was asked of it",
                not_taken=f"parent run '{parent}' did not take the child within "
                f"{self._child_wait_s:g} s (is a worker up on task queue "
                f"'{self._queue}', and the parent's workflow task not failing?)",
                wait_s=max(deadline - asyncio.get_running_loop().time(), 0.001),
                update_id=update_id,
            )
            gate.tripped = None  # the parent takes children again
            gate.taken += 1
            return child
        except WorkflowUpdateFailedError as exc:
            cause = exc.cause
            starting = isinstance(cause, ApplicationError) and cause.type == CHILDREN_STARTING
            if not starting:
                if unsure and await self._settled(parent, handle):
                    return handle
                raise
            return _Again(
                f"parent run '{parent}' was starting other children for all of "
                f"{self._child_wait_s:g} s (those starting at once may carry "
                f"{CHILDREN_STARTING_BYTES:,} bytes of task and system prompt: "
                "they share a workflow task, which Temporal limits)"
            )
        except _NotTaken as exc:
            if unsure and await self._has_child(parent, handle):
                return handle
            # The parent, or its worker, is stuck, unless it took others meanwhile: then
            # this send had too little of its clock left (sent again after a refusal,
            # behind others the parent was taking), which says nothing of the spawns
            # waiting their turn.
            if gate.taken == taken:
                gate.tripped = str(exc)
            raise
        except RunUnavailable as exc:  # no worker polls (or the gate tripped): not sent
            if gate.tripped is None:
                gate.tripped = str(exc)
            if unsure and await self._settled(parent, handle):
                return handle
            raise
        except RPCError as exc:
            if not _busy(exc):
                if unsure and await self._settled(parent, handle):
                    return handle
                raise
            return _Again(
                f"Temporal did not take the request to parent run '{parent}' "
                f"for all of {self._child_wait_s:g} s: {exc.message}",
                turned_away=True,
            )
        except WorkflowUpdateRPCTimeoutOrCancelledError as exc:
            # Temporal answered the call, or a poll for its outcome, with DEADLINE_EXCEEDED
            # or CANCELLED (our own time-out is _NotTaken): the SDK's error, no RPCError,
            # which went up as it was (helper-218).  The update may have been taken; sent
            # again under its id, it is answered with its outcome.
            rpc = exc.__cause__
            return _Again(
                f"Temporal did not take the request to parent run '{parent}' for all of "
                f"{self._child_wait_s:g} s: {rpc.message if isinstance(rpc, RPCError) else exc}",
                turned_away=True,
            )

    async def _settled(self, parent: str, handle: str) -> bool:
        """After an unsure send, a spawn about to answer an error other than _NotTaken
        (which `spawn` withdraws): True if the child runs; else its request is withdrawn
        (the parent refuses it, or cancels a child that starts), and False."""
        if await self._has_child(parent, handle):
            return True
        await self.withdraw_child(parent, handle)
        return False

    async def _has_child(self, parent: str, handle: str) -> bool:
        """Whether run `parent` has started child `handle`; False when Temporal cannot
        say (the caller then withdraws the request, which cancels a child that starts)."""
        try:
            desc = await self._handle(handle).describe()
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                log.warning("whether run %s has child %s is unknown: %r", parent, handle, exc)
            return False
        return desc.parent_id == parent

    async def withdraw_child(self, parent: str, handle: str) -> bool:
        """Withdraw the request that run `parent` start child `handle` (its caller gave
        up on it): the parent refuses it if it comes later, and cancels the child if it
        has started.  False when the parent could not be told (the request stays), or
        is no run of this gateway's (of this caller's, for CallerRuns) to tell."""
        try:
            # Only a run `spawn` would ask (helper-152: the door withdraws a cut call's
            # request before the spawn has checked its parent, and the signal reached
            # another caller's run, or any workflow of the namespace).
            await self._describe(parent)
            await self._handle(parent).signal(AgentRun.withdraw_child, ChildWithdrawal(handle))
        except Exception as exc:  # Temporal away, the parent ended
            log.warning("the request for child %s of run %s stays: %r", handle, parent, exc)
            return False
        return True

    async def _update(
        self,
        handle: str,
        update: Any,
        arg: Any,
        *,
        no_worker: str,
        not_taken: str,
        wait_s: float | None = None,
        update_id: str | None = None,
    ) -> Any:
        """`execute_update` on the run, bounded: an update left with the server is taken
        whenever a worker comes, even after its caller gave up (and a caller that tries
        again asks twice), so with no worker at all it is not sent (RunUnavailable:
        "no worker polls ...: " + `no_worker`), and one not taken within `wait_s`
        (default `child_wait_s`) is given up on (RunUnavailable(`not_taken`))."""
        if not await self._worker_polls():
            raise RunUnavailable(f"no worker polls task queue '{self._queue}': {no_worker}")
        try:
            # (Not the update's rpc_timeout: the server answers a long poll at 20 s, and
            # the SDK asks again, for ever.)
            async with asyncio.timeout(wait_s or self._child_wait_s) as waited:
                return await self._handle(handle).execute_update(update, arg, id=update_id)
        except (TimeoutError, WorkflowUpdateRPCTimeoutOrCancelledError):
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise asyncio.CancelledError from None  # the caller's: not a timeout
            if not waited.expired():
                raise
            raise _NotTaken(not_taken) from None

    async def _worker_polls(self) -> bool:
        """Whether a worker has polled the run's task queue for workflow tasks lately."""
        return await self.workers() > 0

    async def workers(self) -> int:
        """How many workers have polled the runs' task queue for workflow tasks lately
        (the server lists the pollers of the last few minutes): 0 when none runs, or
        when they poll another queue (`luftpause worker --task-queue`)."""
        request = DescribeTaskQueueRequest(
            namespace=self._client.namespace,
            task_queue=TaskQueue(name=self._queue),
            task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW,
        )
        answer = await self._client.workflow_service.describe_task_queue(request)
        return len(answer.pollers)

    async def retention(self) -> timedelta | None:
        """How long the namespace keeps a run's workflow after it closes (its retention:
        the dev server's is a day); None when it sets none or cannot be read just now.
        A run that has not closed is kept for as long as it runs."""
        request = DescribeNamespaceRequest(namespace=self._client.namespace)
        try:
            # (Bounded: a task's poll waits on it.)
            answer = await self._client.workflow_service.describe_namespace(
                request, timeout=timedelta(seconds=_RETENTION_READ_S)
            )
        except Exception as exc:  # a hint only: never the poll's failure
            log.warning("could not read the retention of namespace %r: %s", request.namespace, exc)
            return None
        if not answer.config.HasField("workflow_execution_retention_ttl"):
            return None
        kept = answer.config.workflow_execution_retention_ttl.ToTimedelta()
        return kept if kept > timedelta(0) else None

    @property
    def task_queue(self) -> str:
        return self._queue

    async def status(self, handle: str, *, query_timeout: float = _QUERY_TIMEOUT_S) -> RunStatus:
        """The run's status; `RunError` when no run has this handle."""
        return await self._status(await self._describe(handle), query_timeout)

    async def _describe(self, handle: str) -> WorkflowExecutionDescription:
        try:
            desc = await self._handle(handle).describe()
        except RPCError as exc:
            if exc.status in (RPCStatusCode.NOT_FOUND, RPCStatusCode.INVALID_ARGUMENT):
                raise RunError(f"no run with handle '{handle}'") from None
            raise
        if desc.workflow_type != AGENT_RUN or desc.task_queue != self._queue:
            # Another gateway's run (another task queue), or a workflow that is no run
            # at all: `list` shows neither, and none is this gateway's to read, cancel
            # or approve (helper-126: cancel reached any workflow in the namespace).
            raise RunError(f"no run with handle '{handle}'")
        return desc

    async def _status(
        self, desc: WorkflowExecutionDescription, query_timeout: float = _QUERY_TIMEOUT_S
    ) -> RunStatus:
        """The status of the run `desc` describes (it follows continue-as-new)."""
        status = await self._recorded_status(desc, query_timeout)
        return await self._settle(status, query_timeout, asyncio.Semaphore(_READS_AT_ONCE))

    async def _settle(
        self, status: RunStatus, query_timeout: float, gate: asyncio.Semaphore
    ) -> RunStatus:
        if status.state not in TERMINAL_STATES:
            return status
        if not settled(status.children):
            status = await self._with_children_ends(status, query_timeout, gate)
        budget = status.budget
        if budget is not None and budget.exceeded is None:
            # Nothing stopped it, yet its use is past a limit: say so, as `exceeded`
            # cannot (it is the reason the subtree stopped).
            over = budget.past_a_limit()
            if over is not None:
                status = replace(status, budget=replace(budget, over=over))
        return status

    async def _with_children_ends(
        self, status: RunStatus, query_timeout: float, gate: asyncio.Semaphore
    ) -> RunStatus:
        """An ended run whose children were still ending when it closed: how they ended,
        from their own runs.  A run waits for the ends of the children it cancels
        (10 s, `agent_run.CHILDREN_END_WAIT`), but with Temporal or the workers down meanwhile
        they end later, and its own record keeps them "Stopping" for ever (helper-75).
        So with a child that ended so (unsettled): its record has what it reported
        before the runs below it ended (helper-84).  Each such child's own status reads
        its own children the same way, down the tree (`gate`, shared by the whole tree,
        bounds the reads at once); the budget's use follows."""

        async def now(child: ChildSummary) -> ChildSummary:
            if child.state in TERMINAL_STATES and child.settled:
                return child

            def ended(state: str, subtree: Totals, whole: bool) -> ChildSummary:
                # An ended child keeps the state its parent saw (a budget's stop is
                # Cancelled there, as here).
                if child.state in TERMINAL_STATES:
                    state = child.state
                return ChildSummary(child.handle, state, subtree, whole)

            try:
                async with gate:  # not held while the runs below are read
                    desc = await self._describe(child.handle)
                    final = self._final.get(child.handle)
                    if final is not None and final[0] == desc.run_id:
                        self._final.move_to_end(child.handle)
                        return ended(final[1], final[2], True)
                    seen = await self._recorded_status(desc, query_timeout)
                seen = await self._settle(seen, query_timeout, gate)
            except Exception:
                return child  # gone (retention), Temporal down, a failed query: as recorded
            if seen.state not in TERMINAL_STATES or status_unavailable(seen):
                return child  # no worker to replay it: its totals are unknown
            whole = settled(seen.children)
            if whole:
                self._final[child.handle] = (desc.run_id, seen.state, seen.subtree)
                if len(self._final) > _FINAL_KEPT:
                    self._final.popitem(last=False)
            return ended(seen.state, seen.subtree, whole)

        children = list(await asyncio.gather(*(now(c) for c in status.children)))
        subtree = status.usage.with_children(children)
        budget = status.budget
        if budget is not None:
            used = replace(budget.used, tokens=subtree.tokens, tool_calls=subtree.tool_calls)
            budget = replace(budget, used=used)
        return replace(status, children=children, subtree=subtree, budget=budget)

    async def _recorded_status(
        self, desc: WorkflowExecutionDescription, query_timeout: float
    ) -> RunStatus:
        """The status as the run itself has it (or, with no worker, what Temporal knows)."""
        handle = desc.id
        h = self._handle(handle)
        if desc.status in (WorkflowExecutionStatus.COMPLETED, WorkflowExecutionStatus.FAILED):
            # The result (or the failure's details) is the final status, read from
            # history: no worker replays the run.  Runs from before the details were
            # added fail without them, and are queried.
            with contextlib.suppress(Exception):
                return await asyncio.wait_for(_final(h), query_timeout)
        # When Temporal closed it: the end of a run whose own record has none (cancelled
        # or terminated unseen; a Tasks task counts its ttlMs to it).
        closed_at = desc.close_time.isoformat() if desc.close_time else None
        try:
            status = await asyncio.wait_for(h.query(AgentRun.status), query_timeout)
        except (TimeoutError, RPCError) as exc:
            # No worker can answer (all down): say what Temporal knows.
            why = str(exc) or f"no worker answered within {query_timeout:g} s"
            state = _CLOSED.get(desc.status, "Running") if desc.status else "Running"
            return RunStatus(
                handle=handle,
                state=state,
                task="",
                model="",
                service_class="",
                caller="",
                parent=None,
                root=handle,
                children=[],
                usage=Totals(),
                subtree=Totals(),
                error=f"{STATUS_UNAVAILABLE}{why}",
                started_at=desc.start_time.isoformat() if desc.start_time else "",
                ended_at=closed_at,
            )
        closed = _CLOSED.get(desc.status) if desc.status else None
        if closed is not None and status.state not in TERMINAL_STATES:
            # Terminated from outside (e.g. the Temporal UI): the workflow never saw it.
            # Nor does the approval it waited on wait any longer (helper-240: shown, it
            # took a share of maxChars, and a client was shown a call to answer).
            status = replace(
                status,
                state=closed,
                error=status.error or "terminated",
                ended_at=status.ended_at or closed_at,
                pending_approval=None,
            )
        if closed is None and status.state in TERMINAL_STATES:
            # Ended, and still reporting it (its end to the gateway, its children's
            # ends): not closed, so a query between its workflow tasks said Completed
            # and the next, answered by no worker, Running (helper-144: a task went
            # completed -> working -> completed).  Ending until the workflow closes.
            # (Its seconds as it ended them, not counted on to now: helper-145.)
            return replace(status, state="Stopping")
        return status if closed is not None else _seconds_so_far(status)

    async def transcript(self, handle: str) -> list[dict[str, Any]]:
        """The run's messages so far."""
        await self._describe(handle)  # RunError if unknown
        return await self._handle(handle).query(AgentRun.transcript)

    async def statuses(
        self, handles: Sequence[str], *, query_timeout: float = _QUERY_TIMEOUT_S
    ) -> list[RunStatus]:
        """Several runs' statuses; a run no worker answers for within `query_timeout`
        shows what Temporal knows of it."""
        return list(
            await asyncio.gather(*(self.status(h, query_timeout=query_timeout) for h in handles))
        )

    async def wait(
        self,
        handles: Sequence[str],
        *,
        mode: Literal["all", "any"] = "all",
        timeout: float = 60.0,
        rounds: Rounds | None = None,
        until_one_ends: bool = False,
    ) -> list[RunStatus]:
        """Wait until all (or any) of the runs ended, or the timeout; return every
        run's status either way.  `rounds`: what a caller waiting in rounds saw in its
        earlier ones (see `Rounds`); updated.  `until_one_ends`: return as soon as any
        run still going ends (a caller reporting progress)."""
        if not handles:
            raise RunError("expected at least one handle")
        if not 0 < timeout <= AWAIT_MAX_S:
            raise RunError(f"timeout must be more than 0 and at most {AWAIT_MAX_S:g} seconds")
        rounds = rounds if rounds is not None else Rounds()
        # A worker not answering must not hold the wait much past its timeout; but a
        # query cut at a short wait's few milliseconds read a live run, waiting on an
        # approval, as "Running, status unavailable" (helper-155: 1 in 10 at 0.01 s).
        asking = min(max(timeout, _QUERY_FLOOR_S), _QUERY_TIMEOUT_S)
        if all(h in rounds for h in handles):
            first = [rounds[h] for h in handles]  # a run's end wakes its result wait
        else:
            first = await self._refresh(handles, rounds, asking)  # also checks every handle
        pending = [
            asyncio.create_task(self._ended(h))
            for h, s in zip(handles, first, strict=True)
            if s.state not in TERMINAL_STATES
        ]
        done_enough = not pending or (mode == "any" and len(pending) < len(handles))
        if pending and not done_enough:
            whole = mode == "all" and not until_one_ends
            try:
                await asyncio.wait(
                    pending,
                    timeout=timeout,
                    return_when=asyncio.ALL_COMPLETED if whole else asyncio.FIRST_COMPLETED,
                )
            finally:
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
        return await self._refresh(handles, rounds, asking)

    async def _refresh(
        self, handles: Sequence[str], rounds: Rounds, query_timeout: float = _QUERY_TIMEOUT_S
    ) -> list[RunStatus]:
        """The runs' statuses.  A run seen ended is not asked again; a run whose history
        has not grown since it was seen is only described (no worker): on a long
        `await` most runs are waiting (for a tool, a turn, an approval, children)."""
        return list(await asyncio.gather(*(self._look(h, rounds, query_timeout) for h in handles)))

    async def _look(self, handle: str, rounds: Rounds, query_timeout: float) -> RunStatus:
        again = rounds.unavailable(handle)  # (an ended run seen so is read again too)
        if handle in rounds and rounds[handle].state in TERMINAL_STATES and not again:
            return rounds[handle]
        desc = await self._describe(handle)
        if again:
            # Asked again briefly: a worker that is back answers at once, and with none
            # up each round would wait the whole query time (helper-129: a call overran
            # its timeout by two such waits, and sent its progress every 15 s; helper-131:
            # a cancelled or terminated run is queried too).
            query_timeout = min(query_timeout, _QUERY_AGAIN_S)
        same = rounds.unchanged(desc)
        if same is not None:
            return _seconds_so_far(same)  # nothing happened in the run since
        status = await self._status(desc, query_timeout)
        rounds.saw(desc, status)
        return status

    async def _ended(self, handle: str) -> None:
        with contextlib.suppress(Exception):
            await self._handle(handle).result()

    async def request_cancel(self, handle: str) -> None:
        """Ask Temporal to cancel the run (and so its running descendants) unless it has
        ended; `RunError` when no run has this handle.  Needs no worker."""
        desc = await self._describe(handle)
        if desc.status == WorkflowExecutionStatus.RUNNING:
            await self._handle(handle).cancel()

    async def cancel(self, handle: str, *, wait_s: float = CANCEL_WAIT_S) -> RunStatus:
        """Cancel the run and its running descendants; returns its status once it has
        ended, or after about `wait_s` (no worker may be up to end it) as it is then."""
        await self.request_cancel(handle)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ended(handle), wait_s)
        return await self.status(handle, query_timeout=CANCEL_QUERY_TIMEOUT_S)

    async def approve(self, handle: str, allow: bool, call_id: str | None = None) -> RunStatus:
        """Answer the run's pending approval."""
        if call_id is not None and len(call_id) > CALL_ID_MAX_CHARS:
            raise RunError(
                f"callId: expected the pendingApproval.callId the run showed (at most "
                f"{CALL_ID_MAX_CHARS} characters), got {len(call_id):,} characters"
            )
        desc = await self._describe(handle)  # RunError if unknown
        if desc.status != WorkflowExecutionStatus.RUNNING:
            # Said without a worker (an update to a closed run needs none to be refused).
            raise RunError(_no_approval(handle, (await self._status(desc)).state))
        try:
            await self._update(
                handle,
                AgentRun.approve,
                Approval(allow, call_id),
                no_worker=f"run '{handle}' cannot take the answer until one runs "
                "(`luftpause worker`); it was not sent",
                not_taken=f"run '{handle}' did not take the answer within "
                f"{self._child_wait_s:g} s (is a worker up on task queue '{self._queue}'?); "
                "it may still be taken later (status tells)",
            )
        except WorkflowUpdateFailedError as exc:
            raise RunError(_reason(exc)) from None
        except WorkflowUpdateRPCTimeoutOrCancelledError as exc:
            # Temporal answered the call, or a poll for its outcome, with DEADLINE_EXCEEDED
            # or CANCELLED (our own time-out is _NotTaken): the SDK's error, no RPCError,
            # which went up as it was, where callers read RunUnavailable as "not taken,
            # say so" (helper-219).  Not sent again here, as a spawn is: the run may have
            # taken it and moved on, and an answer sent again under a new update id with
            # no call id would answer its next approval, one the user was not shown.
            rpc = exc.__cause__
            raise RunUnavailable(  # not taken, as far as anyone knows: not acknowledged
                f"run '{handle}' did not say it took the answer: Temporal cut the call "
                f"short ({rpc.message if isinstance(rpc, RPCError) else exc}); it may "
                "have taken it, or take it later (status tells)"
            ) from None
        except RPCError as exc:
            if exc.status == RPCStatusCode.FAILED_PRECONDITION:
                raise RunUnavailable(  # not taken: its callers must not acknowledge it
                    f"run '{handle}' cannot take the answer now: {exc.message} (its worker "
                    "fails to run it; the worker's log says why)"
                ) from None
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
            raise RunError(_no_approval(handle, (await self.status(handle)).state)) from None
        return await self.status(handle)

    async def list(
        self,
        *,
        caller: str | None = None,
        state: str | None = None,
        root: str | None = None,
        parent: str | None = None,
        service_class: str | None = None,
        model: str | None = None,
        limit: int = 20,
    ) -> list[str]:
        """The most recent runs' handles on this task queue, newest first: of one
        caller, in one state, of one tree (root's handle), children of one run, of one
        class or model, when given (by the search attributes runs keep up to date;
        Temporal's list may lag a change by a moment)."""
        # Not the executions a run continued from (continue-as-new): each would list
        # the run again, with the state it had then.
        query = f"{self._ours()} AND ExecutionStatus != 'ContinuedAsNew'"
        filters = (
            (CALLER, caller),
            (STATE, state),
            (ROOT, root),
            (PARENT, parent),
            (CLASS, service_class),
            (MODEL, model),
        )
        for key, value in filters:
            if value is None:
                continue
            if key is STATE:
                query += f" AND {_in_state(value)}"
            else:
                query += f" AND {key.name} = {_quoted(value)}"
        handles: list[str] = []
        async for wf in self._client.list_workflows(query, limit=limit):
            handles.append(wf.id)
        return handles

    def _ours(self) -> str:
        """The visibility query for the runs on this task queue."""
        return f"WorkflowType = {_quoted(AGENT_RUN)} AND TaskQueue = {_quoted(self._queue)}"

    async def count_open(self) -> dict[str, int]:
        """How many runs on this task queue are open, by state (`Running`,
        `AwaitingApproval`, ...): Temporal's visibility counts them by the state search
        attribute runs keep up to date, one query per state (its count groups by
        `ExecutionStatus` only).  It may lag a change by a moment, as `list` does."""
        states = sorted(ACTIVE_STATES)
        counts = await asyncio.gather(
            *(self._client.count_workflows(f"{self._ours()} AND {_in_state(s)}") for s in states)
        )
        return {s: c.count for s, c in zip(states, counts, strict=True)}


class CallerRuns(Runs):
    """The runs of one caller, for a request that proved it is that caller (a token
    of its own).  Another caller's run is to it no run at all, with the error an
    unknown handle gets: it can neither read nor touch one, nor learn that it exists.
    Ownership is the run's caller search attribute, which Temporal answers without a
    worker."""

    def __init__(self, runs: Runs, caller: str) -> None:
        super().__init__(runs.client, task_queue=runs._queue, child_wait_s=runs._child_wait_s)
        self.caller = caller
        self._gates = runs._gates  # (one for the gateway: a CallerRuns lives for a call)

    def _ours(self) -> str:
        return f"{super()._ours()} AND {CALLER.name} = {_quoted(self.caller)}"

    async def _describe(self, handle: str) -> WorkflowExecutionDescription:
        desc = await super()._describe(handle)
        if desc.typed_search_attributes.get(CALLER) != self.caller:
            raise RunError(f"no run with handle '{handle}'")
        return desc

    async def spawn(
        self, spec: RunSpec, *, handle: str | None = None, turn: SpawnTurn | None = None
    ) -> str:
        if spec.caller != self.caller:
            raise RunError(f"this caller is '{self.caller}'; it spawns runs as itself")
        # (A child only of its own runs: Runs.spawn asks this class's _describe.)
        return await super().spawn(spec, handle=handle, turn=turn)

    async def list(
        self,
        *,
        caller: str | None = None,
        state: str | None = None,
        root: str | None = None,
        parent: str | None = None,
        service_class: str | None = None,
        model: str | None = None,
        limit: int = 20,
    ) -> list[str]:
        if caller is not None and caller != self.caller:
            return []
        return await super().list(  # (its query names this caller: `_ours`)
            state=state,
            root=root,
            parent=parent,
            service_class=service_class,
            model=model,
            limit=limit,
        )
