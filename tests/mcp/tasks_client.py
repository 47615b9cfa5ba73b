"""A client side of the MCP Tasks extension (the SDK has none): claims `resultType:
"task"` results, polls `tasks/get`, answers `input_required` through the client's own
elicitation callback and `tasks/update`, and returns the task's result."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Literal

import anyio
from mcp.client.extension import ClaimContext, ClientExtension, ResultClaim
from mcp.client.session import ClientRequestContext
from mcp_types import CallToolResult, EmptyResult, InputRequest, Request, RequestParams, Result
from pydantic import ConfigDict, Field, TypeAdapter

TASKS = "io.modelcontextprotocol/tasks"
_INPUT_REQUEST: TypeAdapter[Any] = TypeAdapter(InputRequest)


class CreateTaskResult(Result):
    result_type: Literal["task"] = Field(default="task", alias="resultType")
    task_id: str = Field(alias="taskId")
    status: str
    created_at: str = Field(alias="createdAt")
    last_updated_at: str = Field(alias="lastUpdatedAt")
    ttl_ms: int | None = Field(alias="ttlMs")  # required, null for unlimited
    poll_interval_ms: int | None = Field(default=None, alias="pollIntervalMs")


class GetTaskResult(Result):
    result_type: Literal["complete"] = Field(alias="resultType")
    task_id: str = Field(alias="taskId")
    status: Literal["working", "input_required", "completed", "cancelled", "failed"]
    created_at: str = Field(alias="createdAt")
    last_updated_at: str = Field(alias="lastUpdatedAt")
    ttl_ms: int | None = Field(alias="ttlMs")
    poll_interval_ms: int | None = Field(default=None, alias="pollIntervalMs")
    status_message: str | None = Field(default=None, alias="statusMessage")
    input_requests: dict[str, Any] | None = Field(default=None, alias="inputRequests")
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None


class TaskIdParams(RequestParams):
    model_config = ConfigDict(populate_by_name=True)
    task_id: str = Field(alias="taskId")


class UpdateParams(TaskIdParams):
    input_responses: dict[str, Any] = Field(alias="inputResponses")


class TasksGet(Request[TaskIdParams, Literal["tasks/get"]]):
    method: Literal["tasks/get"] = "tasks/get"
    params: TaskIdParams
    name_param = "taskId"


class TasksUpdate(Request[UpdateParams, Literal["tasks/update"]]):
    method: Literal["tasks/update"] = "tasks/update"
    params: UpdateParams
    name_param = "taskId"


class TasksCancel(Request[TaskIdParams, Literal["tasks/cancel"]]):
    method: Literal["tasks/cancel"] = "tasks/cancel"
    params: TaskIdParams
    name_param = "taskId"


class TasksClient(ClientExtension):
    """Opt in to tasks; `seen` records every status polled (`created` and `polls` the
    tasks themselves), `on_created` may act on a new task (e.g. cancel it)."""

    identifier = TASKS

    def __init__(self, on_created: Callable[[Any, str], Awaitable[None]] | None = None) -> None:
        self.seen: list[str] = []
        self.task_ids: list[str] = []
        self.created: list[CreateTaskResult] = []
        self.polls: list[GetTaskResult] = []
        self._on_created = on_created

    def claims(self) -> list[ResultClaim[Any]]:
        return [ResultClaim(result_type="task", model=CreateTaskResult, resolve=self._resolve)]

    async def _resolve(self, created: CreateTaskResult, cctx: ClaimContext) -> CallToolResult:
        session = cctx.session
        self.task_ids.append(created.task_id)
        self.created.append(created)
        if self._on_created is not None:
            await self._on_created(session, created.task_id)
        poll_s = (created.poll_interval_ms or 500) / 1000
        return await follow(session, created.task_id, poll_s, self.seen, self.polls)


class TaskCreated(Exception):
    """Raised out of `call_tool` by `CreateOnly` once the task exists."""

    def __init__(self, task_id: str) -> None:
        super().__init__(task_id)
        self.task_id = task_id


class CreateOnly(TasksClient):
    """Opt in to tasks and stop at creation: `call_tool` raises `TaskCreated` with the
    task's id, and the task is followed later (e.g. with `follow` on another session)."""

    async def _resolve(self, created: CreateTaskResult, cctx: ClaimContext) -> CallToolResult:
        self.task_ids.append(created.task_id)
        self.seen.append(created.status)
        raise TaskCreated(created.task_id)


async def follow(
    session: Any,
    task_id: str,
    poll_s: float,
    seen: list[str],
    polls: list[GetTaskResult] | None = None,
) -> CallToolResult:
    """Poll `tasks/get` until the task ends, answering `input_required` through the
    session's elicitation callback and `tasks/update`; return the task's result (each
    task polled is added to `polls`)."""
    answered: set[str] = set()
    with anyio.fail_after(120):
        while True:
            task = await session.send_request(
                TasksGet(params=TaskIdParams(taskId=task_id)), GetTaskResult
            )
            seen.append(task.status)
            if polls is not None:
                polls.append(task)
            if task.status == "input_required":
                responses = {}
                for key, raw in (task.input_requests or {}).items():
                    if key in answered:
                        continue
                    context = ClientRequestContext(session=session, request_id=key)
                    answer = await session.dispatch_input_request(
                        context, _INPUT_REQUEST.validate_python(raw)
                    )
                    responses[key] = answer.model_dump(
                        by_alias=True, exclude_none=True, mode="json"
                    )
                    answered.add(key)
                if responses:
                    update = UpdateParams(taskId=task_id, inputResponses=responses)
                    await session.send_request(TasksUpdate(params=update), EmptyResult)
            elif task.status == "completed":
                return CallToolResult.model_validate(task.result)
            elif task.status in ("failed", "cancelled"):
                message = (task.error or {}).get("message") or task.status_message or task.status
                text = f"task {task.status}: {message}"
                return CallToolResult(content=[{"type": "text", "text": text}], is_error=True)
            await anyio.sleep(poll_s)


async def cancel_task(session: Any, task_id: str) -> None:
    await session.send_request(TasksCancel(params=TaskIdParams(taskId=task_id)), EmptyResult)
