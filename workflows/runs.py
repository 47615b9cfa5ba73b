"""`Runs`: the one Python facade for run operations over the Temporal client.

spawn, await (all | any, with a timeout), status, cancel, approve and list — used by the
MCP door and the tests, so both see runs the same way.  Errors the caller can fix
(unknown handle, a run with nothing to approve, a parent that has ended) raise
`RunError` with a message that says what was expected.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, Literal

from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowUpdateFailedError,
)
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.converter import value_to_type
from temporalio.exceptions import ApplicationError, FailureError
from temporalio.service import RPCError, RPCStatusCode

from workflows.agent_run import AgentRun, search_attributes
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
    ChildRequest,
    RunSpec,
    RunStatus,
    Totals,
)

__all__ = ["AWAIT_MAX_S", "RunError", "Runs", "new_handle"]


def _quoted(value: str) -> str:
    """A string literal of Temporal's list filter."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


AWAIT_MAX_S = 600.0
CANCEL_WAIT_S = 10.0  # how long `cancel` waits for the run to end before answering
CANCEL_QUERY_TIMEOUT_S = 2.0  # then, how long it asks a worker for the run's state
_QUERY_TIMEOUT_S = 10.0


class RunError(Exception):
    """A run operation the caller asked for cannot be done; the message says why."""


def new_handle() -> str:
    """A fresh run handle (the workflow id)."""
    return f"run-{uuid.uuid4().hex[:20]}"


def _reason(exc: WorkflowUpdateFailedError) -> str:
    """Why the run refused an update, in its own words (without the Python type that
    Temporal puts before an ApplicationError's message)."""
    cause = exc.cause
    return cause.message if isinstance(cause, FailureError) else str(cause or exc)


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


_CLOSED = {
    WorkflowExecutionStatus.COMPLETED: "Completed",
    WorkflowExecutionStatus.FAILED: "Failed",
    WorkflowExecutionStatus.CANCELED: "Cancelled",
    WorkflowExecutionStatus.TERMINATED: "Cancelled",
    WorkflowExecutionStatus.TIMED_OUT: "Failed",
}


class Runs:
    """Run operations for one Temporal namespace and task queue."""

    def __init__(self, client: Client, *, task_queue: str) -> None:
        self._client = client
        self._queue = task_queue

    @property
    def client(self) -> Client:
        return self._client

    def _handle(self, handle: str) -> WorkflowHandle[AgentRun, RunStatus]:
        return self._client.get_workflow_handle_for(AgentRun.run, handle)

    async def spawn(self, spec: RunSpec, *, handle: str | None = None) -> str:
        """Start a run (a child of `spec.parent` when given); returns its handle once the
        workflow exists, so the handle is durable when the caller sees it."""
        handle = handle or new_handle()
        if spec.parent is not None and not spec.parent.strip():
            spec = replace(spec, parent=None)  # "" (a form's empty field): no parent
        if spec.parent:
            parent = self._handle(spec.parent)
            try:
                return await parent.execute_update(
                    AgentRun.spawn_child, ChildRequest(handle, replace(spec, parent=None))
                )
            except WorkflowUpdateFailedError as exc:
                raise RunError(_reason(exc)) from None
            except RPCError as exc:
                if exc.status != RPCStatusCode.NOT_FOUND:
                    raise
                # Updates reach only running workflows: say which case this is.
                state = (await self.status(spec.parent)).state  # RunError if unknown
                raise RunError(
                    f"parent run '{spec.parent}' has ended ({state}); it takes no children"
                ) from None
        await self._client.start_workflow(
            AgentRun.run,
            AgentRunInput(spec),
            id=handle,
            task_queue=self._queue,
            search_attributes=search_attributes(spec, handle),
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
            id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
        )
        return handle

    async def status(self, handle: str, *, query_timeout: float = _QUERY_TIMEOUT_S) -> RunStatus:
        """The run's status; `RunError` when no run has this handle."""
        h = self._handle(handle)
        try:
            desc = await h.describe()
        except RPCError as exc:
            if exc.status in (RPCStatusCode.NOT_FOUND, RPCStatusCode.INVALID_ARGUMENT):
                raise RunError(f"no run with handle '{handle}'") from None
            raise
        if desc.status in (WorkflowExecutionStatus.COMPLETED, WorkflowExecutionStatus.FAILED):
            # The result (or the failure's details) is the final status, read from
            # history: no worker replays the run.  Runs from before the details were
            # added fail without them, and are queried.
            with contextlib.suppress(Exception):
                return await asyncio.wait_for(_final(h), query_timeout)
        try:
            status = await asyncio.wait_for(h.query(AgentRun.status), query_timeout)
        except (TimeoutError, RPCError) as exc:
            # No worker can answer (all down): say what Temporal knows.
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
                error=f"status unavailable: {exc}",
            )
        closed = _CLOSED.get(desc.status) if desc.status else None
        if closed is not None and status.state not in TERMINAL_STATES:
            # Terminated from outside (e.g. the Temporal UI): the workflow never saw it.
            status = replace(status, state=closed, error=status.error or "terminated")
        budget = status.budget
        if budget is not None and closed is None and status.started_at:
            # A query reads the workflow's clock at its last activation: an idle run's
            # seconds would stand still.  Its budget's seconds run from its start.
            started = datetime.fromisoformat(status.started_at)
            elapsed = (datetime.now(UTC) - started).total_seconds()
            if elapsed > (budget.used.seconds or 0.0):
                used = replace(budget.used, seconds=round(elapsed, 3))
                status = replace(status, budget=replace(budget, used=used))
        return status

    async def transcript(self, handle: str) -> list[dict[str, Any]]:
        """The run's messages so far."""
        await self.status(handle)
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
        known: Sequence[RunStatus] = (),
        until_one_ends: bool = False,
    ) -> list[RunStatus]:
        """Wait until all (or any) of the runs ended, or the timeout; return every
        run's status either way.  `known`: these runs' statuses at the end of the
        caller's last round (a caller waiting in rounds): they are not asked again
        before this round's wait, and the ended ones not at all.  `until_one_ends`:
        return as soon as any run still going ends (a caller reporting progress)."""
        if not handles:
            raise RunError("expected at least one handle")
        if not 0 < timeout <= AWAIT_MAX_S:
            raise RunError(f"timeout must be more than 0 and at most {AWAIT_MAX_S:g} seconds")
        by_handle = {s.handle: s for s in known}
        if all(h in by_handle for h in handles):
            first = [by_handle[h] for h in handles]  # a run's end wakes its result wait
        else:
            first = await self._refresh(handles, known)  # also checks every handle exists
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
        return await self._refresh(handles, first)

    async def _refresh(self, handles: Sequence[str], known: Sequence[RunStatus]) -> list[RunStatus]:
        """The runs' statuses, asking Temporal (and a worker) only for those not known to
        have ended: on a long `await` most polls are of runs that did."""
        ended = {s.handle: s for s in known if s.state in TERMINAL_STATES}
        asked = [h for h in handles if h not in ended]
        fresh = dict(zip(asked, await self.statuses(asked), strict=True))
        return [ended[h] if h in ended else fresh[h] for h in handles]

    async def _ended(self, handle: str) -> None:
        with contextlib.suppress(Exception):
            await self._handle(handle).result()

    async def request_cancel(self, handle: str) -> None:
        """Ask Temporal to cancel the run (and so its running descendants) unless it has
        ended; `RunError` when no run has this handle.  Needs no worker."""
        try:
            desc = await self._handle(handle).describe()
        except RPCError as exc:
            if exc.status in (RPCStatusCode.NOT_FOUND, RPCStatusCode.INVALID_ARGUMENT):
                raise RunError(f"no run with handle '{handle}'") from None
            raise
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
        await self.status(handle)
        try:
            await self._handle(handle).execute_update(AgentRun.approve, Approval(allow, call_id))
        except WorkflowUpdateFailedError as exc:
            raise RunError(_reason(exc)) from None
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
            state = (await self.status(handle)).state
            raise RunError(
                f"run '{handle}' has ended ({state}); it has no pending approval"
            ) from None
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
        query = f"WorkflowType = 'AgentRun' AND TaskQueue = {_quoted(self._queue)}"
        filters = (
            (CALLER, caller),
            (STATE, state),
            (ROOT, root),
            (PARENT, parent),
            (CLASS, service_class),
            (MODEL, model),
        )
        for key, value in filters:
            if value is not None:
                query += f" AND {key.name} = {_quoted(value)}"
        handles: list[str] = []
        async for wf in self._client.list_workflows(query, limit=limit):
            handles.append(wf.id)
        return handles
