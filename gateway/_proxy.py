"""One turn through the proxy: hold until admitted, forward to the replica, stream the
answer back byte for byte, and report the turn's life to the admission shell.

The client's disconnect is watched on the ASGI receive channel for the whole turn:
while held (the turn leaves the queue and no engine request is made), while waiting
for the engine's headers and while streaming (the engine request is closed, so the
engine stops generating).  Every admitted turn ends in exactly one `TurnFinished` or
`TurnFailed`; a held one that never reaches the engine ends in `TurnAbandoned`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway._http import describe_http_error, wait_disconnect
from gateway._shell import Admission, AdmissionShell, Rejected
from gateway.prober import auth_headers
from luftpause.config import Endpoint
from scheduler import (
    Event,
    ServiceClass,
    TurnAbandoned,
    TurnArrived,
    TurnFailed,
    TurnFinished,
    TurnStarted,
)

__all__ = ["RUN_HEADER", "StreamWatch", "TurnRequest", "TurnResponse", "error_response"]

log = logging.getLogger(__name__)

RUN_HEADER = "x-luftpause-run-id"
# A complete non-streaming answer is parsed for usage only up to this size.
_MAX_JSON_BODY = 64 * 1024 * 1024
# An SSE line longer than this is passed through but not inspected.
_MAX_SSE_LINE = 4 * 1024 * 1024
# Not passed on from the engine: hop-by-hop headers, and those the server sets itself.
_DROP_UPSTREAM = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "date",
        "server",
        RUN_HEADER,
    }
)


def error_response(status: int, message: str, run_id: str) -> Response:
    """The error body every failure uses, with the run id header."""
    body = json.dumps({"error": {"message": message}})
    return Response(body, status, headers={RUN_HEADER: run_id}, media_type="application/json")


# --------------------------------------------------------------------------- watching


class StreamWatch:
    """Reads what the core needs from an answer without altering it: finish reason,
    usage and tool call ids, from SSE `data:` lines as they pass or a JSON body."""

    def __init__(self, *, sse: bool) -> None:
        self._sse = sse
        self._buffer = bytearray()
        self._too_big = False
        self.finish_reason: str | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.tool_call_ids: list[str] = []

    def feed(self, chunk: bytes) -> None:
        if self._too_big:
            if self._sse and b"\n" in chunk:  # skip to the next line and resume
                self._too_big = False
                self._buffer = bytearray(chunk[chunk.rindex(b"\n") + 1 :])
            return
        self._buffer += chunk
        if self._sse:
            *lines, rest = self._buffer.split(b"\n")
            self._buffer = bytearray(rest)
            for line in lines:
                self._line(bytes(line))
            limit = _MAX_SSE_LINE
        else:
            limit = _MAX_JSON_BODY
        if len(self._buffer) > limit:
            self._too_big = True
            self._buffer = bytearray()

    def close(self) -> None:
        """The answer is complete: inspect what is left."""
        if self._too_big:
            return
        if self._sse:
            self._line(bytes(self._buffer))
        else:
            self._inspect(_loads(bytes(self._buffer)))
        self._buffer = bytearray()

    def _line(self, line: bytes) -> None:
        line = line.rstrip(b"\r")
        if not line.startswith(b"data:"):
            return
        data = line[5:].strip()
        if data and data != b"[DONE]":
            self._inspect(_loads(data))

    def _inspect(self, obj: object) -> None:
        if not isinstance(obj, dict):
            return
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.prompt_tokens = _int(usage.get("prompt_tokens"), self.prompt_tokens)
            self.completion_tokens = _int(usage.get("completion_tokens"), self.completion_tokens)
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict):
                self.cached_tokens = _int(details.get("cached_tokens"), self.cached_tokens)
        choices = obj.get("choices")
        if not isinstance(choices, list):
            return
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            reason = choice.get("finish_reason")
            if isinstance(reason, str):
                self.finish_reason = reason
            for part in (choice.get("delta"), choice.get("message")):
                calls = part.get("tool_calls") if isinstance(part, dict) else None
                if not isinstance(calls, list):
                    continue
                for call in calls:
                    call_id = call.get("id") if isinstance(call, dict) else None
                    if isinstance(call_id, str) and call_id not in self.tool_call_ids:
                        self.tool_call_ids.append(call_id)


def _loads(data: bytes) -> object:
    try:
        return json.loads(data)
    except ValueError:
        return None


def _int(value: object, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


# --------------------------------------------------------------------------- a turn


@dataclass(frozen=True, kw_only=True, slots=True)
class TurnRequest:
    """A validated chat completion request, as the proxy forwards it."""

    turn_id: str
    run_id: str
    service_class: ServiceClass
    caller: str
    model: str
    body: bytes
    content_type: str
    accept: str | None
    prompt_tokens: int
    max_tokens: int

    def arrival(self, now: float) -> TurnArrived:
        return TurnArrived(
            now=now,
            turn_id=self.turn_id,
            run_id=self.run_id,
            service_class=self.service_class,
            caller=self.caller,
            model=self.model,
            prompt_tokens=self.prompt_tokens,
            max_tokens=self.max_tokens,
        )


async def hold(
    shell: AdmissionShell,
    turn: TurnRequest,
    clock: Callable[[], float],
    disconnected: asyncio.Future[None],
) -> Admission | None:
    """Report the turn's arrival and wait, with no deadline, for the core to admit or
    reject it.  None: the client left while the turn was held; the caller reports it
    abandoned, and no engine request is made."""
    admission = shell.arrive(turn.arrival(clock()))
    if not admission.done():
        await asyncio.wait((admission, disconnected), return_when=asyncio.FIRST_COMPLETED)
    if not admission.done() or disconnected.done():
        return None
    return admission.result()


class _ClientLeft(Exception):
    pass


class TurnResponse(Response):
    """The ASGI response that runs one turn end to end (see the module docstring)."""

    def __init__(
        self,
        turn: TurnRequest,
        *,
        shell: AdmissionShell,
        client: httpx.AsyncClient,
        endpoints: Mapping[str, Endpoint],
        clock: Callable[[], float],
    ) -> None:
        super().__init__(status_code=200)
        self._turn = turn
        self._shell = shell
        self._client = client
        self._endpoints = endpoints
        self._clock = clock
        self._ended = False
        self._complete = False  # the last body message is on its way to the client

    def _end(self, event: Event) -> None:
        """Report the turn's one terminal event."""
        if not self._ended:
            self._ended = True
            self._shell.forget_turn(self._turn.turn_id)
            self._shell.apply(event)

    def _fail(self, reason: str) -> None:
        self._end(TurnFailed(now=self._clock(), turn_id=self._turn.turn_id, reason=reason))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        t = self._turn
        disconnected = asyncio.ensure_future(wait_disconnect(receive))
        arrived = False
        try:
            arrived = True  # an abandon of a turn the core never saw is ignored by it
            outcome = await hold(self._shell, t, self._clock, disconnected)
            if outcome is None:
                self._end(TurnAbandoned(now=self._clock(), turn_id=t.turn_id))
                return
            if isinstance(outcome, Rejected):
                self._ended = True  # never queued: nothing to report
                await error_response(outcome.status, outcome.message, t.run_id)(
                    scope, receive, send
                )
                return
            await self._forward(outcome, scope, receive, send, disconnected)
        finally:
            disconnected.cancel()
            if arrived and not self._ended:
                # Cancelled from outside (server shutdown) or a bug: free the slot.
                self._end(TurnAbandoned(now=self._clock(), turn_id=t.turn_id))

    async def _until(self, work: Awaitable[Any], disconnected: asyncio.Future[None]) -> Any:
        """Await `work` unless the client leaves first (then cancel it, raise _ClientLeft).

        Once the whole body is handed to the server, the server reports a disconnect
        for the finished response: then the work is let finish."""
        task = asyncio.ensure_future(work)
        try:
            await asyncio.wait((task, disconnected), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()  # cancelled from outside (shutdown): close the engine request
            raise
        if not task.done():
            if not self._complete:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                raise _ClientLeft
            return await task  # the body is all sent: let the turn end as finished
        return task.result()

    async def _forward(
        self,
        replica: str,
        scope: Scope,
        receive: Receive,
        send: Send,
        disconnected: asyncio.Future[None],
    ) -> None:
        t = self._turn
        endpoint = self._endpoints[replica]
        headers = {"content-type": t.content_type, "accept-encoding": "identity"}
        if t.accept is not None:
            headers["accept"] = t.accept
        headers.update(auth_headers(endpoint))
        request = self._client.build_request(
            "POST", endpoint.url + "/v1/chat/completions", content=t.body, headers=headers
        )
        try:
            upstream: httpx.Response = await self._until(
                self._client.send(request, stream=True), disconnected
            )
        except _ClientLeft:
            self._fail("client disconnected before the engine answered")
            return
        except httpx.HTTPError as exc:
            message = f"engine {replica}: {describe_http_error(exc)}"
            self._fail(message)
            await error_response(502, message, t.run_id)(scope, receive, send)
            return
        try:
            ok: bool = await self._until(self._pump(upstream, send), disconnected)
        except _ClientLeft:
            self._fail("client disconnected mid-stream")
            return
        finally:
            await upstream.aclose()  # mid-stream: closes the connection, the engine stops
        if not ok:
            # The client got the chunks so far; returning without completing the
            # response makes the server close the connection (no [DONE] appended).
            return

    async def _pump(self, upstream: httpx.Response, send: Send) -> bool:
        """Stream the engine's answer to the client; report its end.  False: the
        engine failed mid-stream."""
        t = self._turn
        media = upstream.headers.get("content-type", "")
        encoded = upstream.headers.get("content-encoding", "identity").lower() != "identity"
        watch = StreamWatch(sse=media.startswith("text/event-stream"))
        headers = [
            (k.encode("latin-1"), v.encode("latin-1"))
            for k, v in upstream.headers.items()
            if k.lower() not in _DROP_UPSTREAM
        ]
        headers.append((RUN_HEADER.encode("latin-1"), t.run_id.encode("latin-1")))
        await send(
            {"type": "http.response.start", "status": upstream.status_code, "headers": headers}
        )
        started = False
        try:
            async for chunk in upstream.aiter_raw():
                if not started:
                    started = True
                    self._shell.apply(TurnStarted(now=self._clock(), turn_id=t.turn_id))
                if not encoded:
                    watch.feed(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.HTTPError as exc:
            self._fail(f"engine failed mid-stream: {describe_http_error(exc)}")
            self._remember(watch)
            return False
        self._complete = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        if not encoded:
            watch.close()
        self._remember(watch)
        if upstream.status_code >= 400:
            self._fail(f"engine answered {upstream.status_code}")
            return True
        self._end(
            TurnFinished(
                now=self._clock(),
                turn_id=t.turn_id,
                finish_reason=watch.finish_reason or "",
                prompt_tokens=watch.prompt_tokens,
                completion_tokens=watch.completion_tokens,
                cached_tokens=watch.cached_tokens,
            )
        )
        return True

    def _remember(self, watch: StreamWatch) -> None:
        if watch.tool_call_ids:
            self._shell.remember_tool_calls(self._turn.run_id, watch.tool_call_ids, self._clock())
