"""Tool activities: list the upstream tools, and call one after checking its arguments.

A call whose arguments do not fit the tool's schema (after coercing scalars) is never
sent: it completes with an error the model reads, naming the expected shape.  A tool
that reports an error (`isError`) completes too — the model sees it as the tool's
answer.  Only a failure to reach the server raises: `McpUnreachable` (NOT_SENT) when the
call never left the worker, `ToolTimedOut` when it was sent and got no answer within
its tool's time (`ToolInput.timeout_s`), `McpUnavailable` when it may have reached the
server otherwise; the workflow decides which to send again (workflows/agent_run.py,
`_sent`).

An answer longer than `TOOL_OUTPUT_MAX_CHARS` is cut, with a note the model reads.
Uncut, one large answer (a fetched page, an image as base64) would overflow the model's
context in every later turn and, past Temporal's 2 MB payload limit, fail the activity
*after* the call ran, so each retry would run the tool again.  The message of a failure
is cut too (`activities.llm.bounded`): it may quote a server's words, and a run's
failure carries it twice.

With tracing on, each call is an `execute_tool {name}` span (GenAI semantic
conventions); the MCP SDK sends its `traceparent` to the server in the request's `_meta`.
"""

from __future__ import annotations

import asyncio
import time

from opentelemetry.trace import StatusCode
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities._arguments import ArgumentsError, prepare_arguments
from activities.contract import (
    NOT_SENT,
    TOOL_TIMED_OUT,
    CheckedArguments,
    ToolInfo,
    ToolInput,
    ToolOutput,
    ToolsWanted,
)
from activities.llm import HEARTBEAT_EVERY_S, bounded, heartbeating
from activities.mcp_pool import CallTimedOut, McpPool, UnknownTool, Unreachable
from luftpause import telemetry

__all__ = ["TOOL_OUTPUT_MAX_CHARS", "ToolActivities", "capped", "check_arguments"]

# As Claude Code's default limit for an MCP tool's answer (25,000 tokens), at ~4
# characters a token; at most 400 kB of UTF-8, well inside a Temporal payload.
TOOL_OUTPUT_MAX_CHARS = 100_000


def capped(text: str, limit: int = TOOL_OUTPUT_MAX_CHARS) -> str:
    """The tool's answer, cut to `limit` characters with a note saying so."""
    if len(text) <= limit:
        return text
    return text[:limit] + (
        f"\n[luftpause: the tool's answer was cut to its first {limit:,} of "
        f"{len(text):,} characters]"
    )


def _checked(call: ToolInput) -> CheckedArguments:
    """The call's arguments made fit for its tool, or what the model is told instead."""
    try:
        return CheckedArguments(prepare_arguments(call.tool, call.arguments, call.input_schema))
    except ArgumentsError as exc:
        return CheckedArguments(error=f"Error: {exc}")
    except Exception as exc:  # a schema the checks did not foresee: never retried
        activity.logger.exception("checking the arguments of tool %r", call.tool)
        return CheckedArguments(
            error=f"Error: the arguments for tool '{call.tool}' could not be checked "
            f"against its input schema ({type(exc).__name__})"
        )


@activity.defn(name="check_arguments")
async def check_arguments(call: ToolInput) -> CheckedArguments:
    """The check `call_tool` makes first, alone: a run asks the user to approve only a
    call that could run, showing the arguments the tool would get (a local activity:
    its answer is in the run's history, so a replay reads the same whatever the
    worker's jsonschema)."""
    return _checked(call)


class ToolActivities:
    """The worker's upstream MCP servers, as activities."""

    def __init__(self, pool: McpPool, *, heartbeat_every_s: float = HEARTBEAT_EVERY_S) -> None:
        self._pool = pool
        self._every = heartbeat_every_s

    @activity.defn(name="list_tools")
    async def list_tools(self, wanted: ToolsWanted | None = None) -> list[ToolInfo]:
        """The tools of every configured server (`wanted`: enough servers to find the
        tools named there)."""
        try:
            return await self._pool.list_tools(wanted.names if wanted is not None else None)
        except Exception as exc:
            message = bounded(f"listing tools: {exc}")  # a server's words: any length
            raise ApplicationError(message, type="McpUnavailable") from None

    @activity.defn(name="call_tool")
    async def call_tool(self, call: ToolInput) -> ToolOutput:
        """Validate, then execute one tool call."""
        tracer = telemetry.tracer()
        if tracer is None:
            return await self._call(call)
        attributes = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": call.tool,
            "gen_ai.tool.type": "extension",  # runs on an MCP server, not in the worker
            "luftpause.run_id": call.run_id,
            "luftpause.mcp_server": call.server,
        }
        if call.call_id:
            attributes["gen_ai.tool.call.id"] = call.call_id
        # Current while the call runs: the MCP SDK injects this span's traceparent.
        with tracer.start_as_current_span(
            f"execute_tool {call.tool}", attributes=attributes
        ) as span:
            try:
                output = await self._call(call)
            except ApplicationError as exc:
                # Not reached, cut at its timeout, the connection broken: semconv's
                # error.type names it, as for an answer that is an error (helper-169).
                span.set_attribute("error.type", exc.type or type(exc).__name__)
                raise
            except asyncio.CancelledError:
                # The run stopped, or the worker: the call has no outcome here (it is
                # sent again, or told to the model, by the workflow's rules).
                span.set_attribute("error.type", "cancelled")
                span.set_status(StatusCode.ERROR, "cancelled")
                raise
            if output.is_error:
                span.set_attribute(
                    "error.type", "tool_error" if output.executed else "invalid_arguments"
                )
                span.set_status(StatusCode.ERROR, output.content[:200])
            return output

    async def _call(self, call: ToolInput) -> ToolOutput:
        checked = _checked(call)
        if checked.arguments is None:
            return ToolOutput(content=checked.error, is_error=True, executed=False)
        arguments = checked.arguments
        started = time.monotonic()
        try:
            async with heartbeating(self._every):
                text, is_error = await self._pool.call(
                    call.server,
                    call.tool,
                    arguments,
                    key=call.idempotency_key,
                    timeout=call.timeout_s or None,
                )
        except CallTimedOut as exc:
            raise ApplicationError(
                bounded(f"mcp server '{call.server}', tool '{call.tool}': {exc}"),
                type=TOOL_TIMED_OUT,
            ) from None
        except UnknownTool as exc:
            # Never sent.  In a rolling deploy that adds or removes a server, the run
            # listed its tools on a worker that has it and this call came to one that
            # has not: another worker of the queue may take it (helper-114: the run
            # failed at once).  Where none has it, it fails as an unreachable server does.
            raise ApplicationError(
                bounded(f"mcp server '{call.server}', tool '{call.tool}': not sent: {exc}"),
                type=NOT_SENT,
            ) from None
        except Unreachable as exc:  # never sent: safe to send later, whatever the tool
            raise ApplicationError(
                bounded(f"mcp server '{call.server}', tool '{call.tool}': not reached: {exc}"),
                type=NOT_SENT,
            ) from None
        except Exception as exc:
            raise ApplicationError(
                bounded(
                    f"mcp server '{call.server}', tool '{call.tool}': {type(exc).__name__}: {exc}"
                ),
                type="McpUnavailable",
            ) from None
        return ToolOutput(
            content=capped(text),
            is_error=is_error,
            executed=True,
            seconds=time.monotonic() - started,
        )
