"""The MCP Tasks extension (`io.modelcontextprotocol/tasks`, 2026-07-28) for `run`.

A client that opts in gets a task instead of waiting on the call: the task id is the
run's handle (its workflow id), returned only once the workflow exists, so the task is
durable before the client knows it.  `tasks/get` reads the run's status, `tasks/update`
delivers the answer to an open approval (shown as `input_required` with an elicitation
request), `tasks/cancel` cancels the run.  The workflow is the store: tasks survive a
gateway restart, and any gateway on the same Temporal namespace can answer for them.
With Temporal unreachable, unavailable or out of time, or no worker up to take an
answer, they answer a JSON-RPC error that says which (an answer not taken is never
acknowledged: the client may send it again).

The SDK ships the wire types of the older in-core tasks only, so the SEP-2663 shapes
are written here as plain JSON (`taskId`, `status`, `createdAt`, `lastUpdatedAt`,
`ttlMs`, `pollIntervalMs`, `inputRequests`, `result`, `statusMessage`).  An ended
run's task is `completed` with the result the `run` call itself returns (a run that
failed, or that its budget stopped, included: that result is a tool error, `isError`,
which SEP-2663 counts as completed; `failed` is for JSON-RPC errors); a run cancelled
on request is a `cancelled` task saying why.  `ttlMs` is how long Temporal keeps the
run: null while it runs (its workflow has no timeout, and an approval may wait days),
and once it ended its time to its end plus the namespace's retention (to its end alone
while the retention cannot be read: it may be gone).  Only a
client that declared the extension may use tasks/* (-32021 otherwise), and only one
that declared form elicitation is sent the approval question (`inputRequests`); for
any other a run waiting for approval is a `working` task whose `statusMessage` says so
(`input_required` must list the requests, and there is none it could answer; the
`approve` tool answers, or where `[mcp] approve_tool = false` withholds it, the user
through `await` in a client that shows forms), as it is for a client that dismissed
the question (its key is not asked again).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from mcp.server.extension import Extension, MethodBinding
from mcp.server.mcpserver import require_client_extension
from mcp.server.mcpserver.exceptions import ToolError
from mcp.shared.exceptions import MCPError
from mcp_types import (
    CallToolRequestParams,
    CallToolResult,
    EmptyResult,
    RequestParams,
    TextContent,
)
from pydantic import ConfigDict, Field

from gateway import _approval as approval
from workflows import TERMINAL_STATES, RunError, Runs, RunStatus, RunUnavailable
from workflows.runs import status_unavailable

__all__ = ["TASKS", "Background", "TasksExtension", "cancel_quietly"]

log = logging.getLogger(__name__)

TASKS = "io.modelcontextprotocol/tasks"
MODERN = frozenset({approval.MODERN})
POLL_MS = 500
# How long an unknown namespace retention (its describe refused or failed) is left
# before it is read again.
RETENTION_RETRY_S = 60.0
# How long tasks/get (and a task's creation) asks a worker for the run's state before
# answering with what Temporal knows: a poll every POLL_MS must not take 10 s.
QUERY_TIMEOUT_S = 2.0
# Question keys answered that are remembered (a key is ~70 bytes).
ANSWERED_KEPT = 10_000
# The longest call id remembered from an answer given while no worker could say which
# the run asks (engines' ids are ~30-40 characters).
REMEMBERED_CALL_ID_CHARS = 256
_INVALID_PARAMS = -32602
_INTERNAL_ERROR = -32603
# What tasks/update tells a client that cannot show forms where [mcp] approve_tool is
# false (it was asked nothing, so it has no answer of the user's to give).
NOT_ASKED = (
    "tasks/update: approvals here are the user's alone ([mcp] approve_tool = false), "
    "answered in a client that declares form elicitation (tasks/get puts the question "
    "to it); this client declared none"
)

_STATUS = {
    "Running": "working",
    "AwaitingChildren": "working",
    "Stopping": "working",
    "AwaitingApproval": "input_required",
    "Completed": "completed",
    "Failed": "completed",  # its result is what run returns: state Failed, its error
    "Cancelled": "cancelled",
}


class TaskIdParams(RequestParams):
    model_config = ConfigDict(populate_by_name=True)

    task_id: str = Field(alias="taskId", min_length=1, max_length=200)


class UpdateParams(TaskIdParams):
    input_responses: dict[str, Any] = Field(alias="inputResponses")


class Background:
    """Work begun for a request that must outlive it (the cancel of a run whose call
    was cut), held until done (the loop holds tasks weakly) and waited for at a stop
    (helper-147: the loop's end cancelled it, and the run went on).  One per door."""

    def __init__(self) -> None:
        self._tasks: dict[asyncio.Future[Any], str] = {}  # each, and what it does

    def run(self, work: Awaitable[Any], what: str) -> asyncio.Future[Any]:
        """`work` on its own; `what` it does, named in the log if a stop cuts it."""
        task = asyncio.ensure_future(work)
        self._tasks[task] = what
        task.add_done_callback(lambda done: self._tasks.pop(done, None))
        return task

    async def settle(self, timeout: float) -> None:
        """Let it end, `timeout` at most; what is left is logged and cancelled (an
        operator may cancel by hand a run whose cancel this cut: helper-149)."""
        pending = set(self._tasks)
        if not pending:
            return
        _, left = await asyncio.wait(pending, timeout=timeout)
        for task in left:
            log.warning("stopped with unfinished: %s", self._tasks.get(task, task))
            task.cancel()


async def cancel_quietly(runs: Callable[[], Awaitable[Runs]], handle: str) -> None:
    """Ask for a run's cancel (one whose call was cut); a failure (Temporal away, the
    run ended) is logged, so the cancellation that asked for it is what the call ends
    with.  The door's and the tasks' both."""
    try:
        await (await runs()).request_cancel(handle)
    except Exception as exc:
        log.warning("could not cancel run %s whose call was cut: %s", handle, exc)


def _iso(value: str | None) -> str:
    return value or datetime.now(UTC).isoformat()


def _ttl_ms(status: RunStatus, created: str, ended: str, retention: timedelta | None) -> int | None:
    """A task lives as its run's workflow: for ever while it runs (null), and after it
    ends for the namespace's retention from its end, counted here from its `createdAt`
    to the `lastUpdatedAt` shown.  With the retention unknown, to its end: it may be
    gone now."""
    if status.state not in TERMINAL_STATES:
        return None
    lived = datetime.fromisoformat(ended) - datetime.fromisoformat(created)
    return max(0, (lived + (retention or timedelta(0))) // timedelta(milliseconds=1))


class TasksExtension(Extension):
    """Tasks for `run`; see the module docstring."""

    identifier = TASKS

    def __init__(
        self,
        runs: Callable[[Any], Awaitable[Runs]],  # the runs a request (its ctx) may see
        start_run: Callable[[dict[str, Any], Any], Awaitable[tuple[str | None, str]]],
        result: Callable[[RunStatus], dict[str, Any]],  # what `run` returns for an ended run
        unavailable: Callable[[BaseException], str | None],  # why, if Temporal is down
        background: Background | None = None,  # the door's (a test's own otherwise)
        approve_tool: bool = True,  # whether the door offers `approve` ([mcp] approve_tool)
    ) -> None:
        self._runs = runs
        self._approve_tool = approve_tool
        self._background = background or Background()
        # Question keys a response was delivered for (this process's; bounded): MCP
        # forbids asking a key again, and a client skips one it answered, so a task
        # asking again after a dismissal stayed input_required for ever (helper-144).
        # Such an approval is shown as one the client cannot answer: working, and how
        # the approve tool answers it.  (A restart forgets them: asked once more.)
        self._answered = approval.RecentKeys(ANSWERED_KEPT)
        self._start = start_run
        self._result = result
        self._unavailable = unavailable
        # The namespace's retention (one per door: CallerRuns is built per request),
        # read at the first ended task; unknown, read again after RETENTION_RETRY_S.
        self._retention: timedelta | None = None
        self._retention_read = -math.inf  # when it was last read (monotonic)
        self._reading = asyncio.Lock()  # one read at a time: the others wait for it

    @contextlib.contextmanager
    def _store(self) -> Iterator[None]:
        """The run store (Temporal) unreachable, unavailable or out of time (`_unavailable`
        says which), or a run no worker takes an answer for: a JSON-RPC error saying so,
        not a bare "Internal server error"."""
        try:
            yield
        except (ToolError, RunUnavailable) as exc:  # the door's runs(): the store is down
            raise MCPError(code=_INTERNAL_ERROR, message=str(exc)) from None
        except Exception as exc:
            down = self._unavailable(exc)
            if down is None:
                raise
            raise MCPError(code=_INTERNAL_ERROR, message=down) from None

    def methods(self) -> Sequence[MethodBinding]:
        return [
            MethodBinding("tasks/get", TaskIdParams, self.get, MODERN),
            MethodBinding("tasks/update", UpdateParams, self.update, MODERN),
            MethodBinding("tasks/cancel", TaskIdParams, self.cancel, MODERN),
        ]

    async def intercept_tool_call(
        self, params: CallToolRequestParams, ctx: Any, call_next: Any
    ) -> Any:
        caps = ctx.session.client_capabilities
        opted = (
            ctx.protocol_version in MODERN
            and caps is not None
            and caps.extensions is not None
            and TASKS in caps.extensions
        )
        if params.name != "run" or not opted:
            return await call_next(ctx)
        # Validation errors come back as the tool's own errors, as without tasks.
        handle, error = await self._start(dict(params.arguments or {}), ctx)
        if handle is None:
            return CallToolResult(content=[TextContent(type="text", text=error)], is_error=True)
        try:
            with self._store():
                runs = await self._runs(ctx)
                status = await runs.status(handle, query_timeout=QUERY_TIMEOUT_S)
        except asyncio.CancelledError:
            # Cut before its id reached the client: the run goes too (helper-145).
            cancel = cancel_quietly(lambda: self._runs(ctx), handle)
            self._background.run(cancel, f"the cancel of run {handle}")
            raise
        except MCPError:
            # The run exists (its workflow does) but its status could not be read just
            # now: its task all the same, working, rather than an error that makes the
            # client start the run again (helper-144).
            now = datetime.now(UTC).isoformat()
            return {
                "resultType": "task",
                "taskId": handle,
                "status": "working",
                "createdAt": now,
                "lastUpdatedAt": now,
                "ttlMs": None,
                "pollIntervalMs": POLL_MS,
            }
        retention = await self._kept(runs) if status.state in TERMINAL_STATES else None
        return {"resultType": "task", **self._task(status, ctx, retention)}

    async def _kept(self, runs: Runs) -> timedelta | None:
        """The namespace's retention: read once, and again later while unknown."""
        if self._retention is not None:
            return self._retention
        # (A poll that came during another's read took None: an ended task shown as
        # already past its ttlMs, helper-227.)
        async with self._reading:
            if self._retention is None and (
                time.monotonic() - self._retention_read >= RETENTION_RETRY_S
            ):
                self._retention_read = time.monotonic()
                self._retention = await runs.retention()
        return self._retention

    def _task(
        self, status: RunStatus, ctx: Any, retention: timedelta | None = None
    ) -> dict[str, Any]:
        """The task of the run `status` reads; `retention`: the namespace's, if known."""
        # Stopped by its budget, and ended (it is `Stopping` while its work winds down).
        stopped = (
            status.state in TERMINAL_STATES
            and status.budget is not None
            and status.budget.exceeded is not None
        )
        state = "completed" if stopped else _STATUS.get(status.state, "working")
        created = _iso(status.started_at)
        updated = _iso(status.ended_at or status.updated_at or status.started_at)
        task: dict[str, Any] = {
            "taskId": status.handle,
            "status": state,
            "createdAt": created,
            "lastUpdatedAt": updated,
            "ttlMs": _ttl_ms(status, created, updated, retention),
            "pollIntervalMs": POLL_MS,
        }
        if status.state == "AwaitingApproval" and status.pending_approval is not None:
            key = approval.question_key(status)
            if key not in self._answered and approval.can_ask(ctx.session.client_capabilities):
                task["statusMessage"] = approval.message(status)
                task["inputRequests"] = {
                    key: {
                        "method": "elicitation/create",
                        "params": approval.elicit_params(status),
                    }
                }
            else:
                # input_required must list the requests, and this client could answer
                # none: working, and what it waits for (and who may answer it: without
                # the approve tool, only the user, asked by a client that shows forms).
                task["status"] = "working"
                how = (
                    f"through the approve tool: approve(handle='{status.handle}', allow=true|false)"
                    if self._approve_tool
                    else "from the user: `await` of this run asks them in a client that "
                    "shows forms (elicitation); or cancel the task"
                )
                task["statusMessage"] = f"{approval.message(status)} (waiting for an answer {how})"
        elif state == "input_required":
            # Waiting for approval, but what it waits on was not read (no worker
            # answered the status query): nothing to ask yet.
            task["status"] = "working"
            task["statusMessage"] = status.error or "waiting for approval"
        elif state == "completed":
            # Exactly what the `run` call itself would have returned.
            task["result"] = self._result(status)
        elif status.state == "Cancelled":
            task["statusMessage"] = status.error or "cancelled"
        elif status_unavailable(status):
            task["statusMessage"] = status.error  # working, as far as Temporal knows
        return task

    async def _status(self, ctx: Any, task_id: str) -> RunStatus:
        require_client_extension(ctx, TASKS)  # -32021 for a client that did not opt in
        with self._store():
            try:
                return await (await self._runs(ctx)).status(task_id, query_timeout=QUERY_TIMEOUT_S)
            except RunError as exc:
                raise MCPError(code=_INVALID_PARAMS, message=f"unknown task: {exc}") from None

    async def get(self, ctx: Any, params: TaskIdParams) -> dict[str, Any]:
        status = await self._status(ctx, params.task_id)
        retention = None
        if status.state in TERMINAL_STATES:
            with self._store():
                runs = await self._runs(ctx)
            retention = await self._kept(runs)
        return {"resultType": "complete", **self._task(status, ctx, retention)}

    async def update(self, ctx: Any, params: UpdateParams) -> EmptyResult:
        status = await self._status(ctx, params.task_id)  # the task exists, and is the caller's
        if not self._approve_tool and not approval.can_ask(ctx.session.client_capabilities):
            # Approvals are the user's alone, and this client was shown no question (it
            # cannot show forms): an answer from it is made up, the key being the handle
            # and the call id `status` shows (helper-241: one approved a delete no person
            # was asked about).  Refused, not ignored: the client would take it as given.
            keys = (approval.parse_key(k) for k in params.input_responses)
            if any(key is not None and key[0] == status.handle for key in keys):
                raise MCPError(code=_INVALID_PARAMS, message=NOT_ASKED)
        with self._store():
            runs = await self._runs(ctx)
        # The key this task asks now: the only one remembered as answered (helper-145:
        # any key of its handle was, up to the body's size each).  With no worker to
        # read the run's approval from, one of a call id's usual size (helper-147: the
        # dismissal was forgotten, and the question asked again once a worker was back).
        asked = approval.question_key(status) if status.pending_approval is not None else None
        unread = status_unavailable(status)
        # All read first, then applied: a malformed response refuses the update whole
        # (helper-155: the answers before it in the dict were applied, the call ran, and
        # the client was told the update failed).
        answers: list[tuple[str, str, bool | None]] = []
        for key, response in params.input_responses.items():
            # The key names the call it answers, and the run takes an answer only while
            # it waits on that call: one for a call answered or superseded is refused
            # by the run and ignored here, as MCP asks of keys not outstanding.  (Not
            # judged by the status read above: with no worker to answer its query it
            # shows no approval, and an answer the client will not send again would
            # be dropped with an acknowledgement.)
            parsed = approval.parse_key(key)
            if parsed is None or parsed[0] != status.handle:
                continue  # never issued for this task: ignored
            action = response.get("action") if isinstance(response, dict) else None
            content = response.get("content") if isinstance(response, dict) else None
            allow = approval.answer(action, content)
            if allow is None and action == "accept":
                if not (key == asked or unread):
                    continue  # not outstanding: ignored, malformed or not
                raise MCPError(
                    code=_INVALID_PARAMS,
                    message=f'input response {key!r}: expected content {{"allow": true|false}}',
                )
            answers.append((key, parsed[1], allow))
        for key, call_id, allow in answers:
            remember = key == asked or (unread and len(call_id) <= REMEMBERED_CALL_ID_CHARS)
            if allow is None:
                if remember:
                    self._note_answered(key)  # dismissed: the approval stays open
                continue
            with self._store():  # RunUnavailable: not taken, say so (the client may resend)
                try:
                    await runs.approve(status.handle, allow, call_id)
                except RunUnavailable:
                    raise
                except RunError:
                    pass  # answered already, or superseded (the run moved on or ended)
            if remember:
                self._note_answered(key)
        return EmptyResult()

    def _note_answered(self, key: str) -> None:
        self._answered.add(key)

    async def cancel(self, ctx: Any, params: TaskIdParams) -> EmptyResult:
        """Acknowledged once the cancellation is requested (the run ends after; no worker
        needs to be up)."""
        require_client_extension(ctx, TASKS)
        with self._store():
            try:
                await (await self._runs(ctx)).request_cancel(params.task_id)
            except RunError as exc:
                raise MCPError(code=_INVALID_PARAMS, message=f"unknown task: {exc}") from None
        return EmptyResult()
