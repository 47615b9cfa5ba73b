"""One turn through the proxy: hold until admitted, forward to the replica, stream the
answer back byte for byte, and report the turn's life to the admission shell.

The client's disconnect is watched on the ASGI receive channel for the whole turn:
while held (the turn leaves the queue and no engine request is made), while waiting
for the engine's headers and while streaming (the engine request is closed, so the
engine stops generating).  Every admitted turn ends in exactly one `TurnFinished` or
`TurnFailed`; a held one that never reaches the engine ends in `TurnAbandoned`.

With tracing on (luftpause/telemetry.py), a turn is a `chat {model}` span continuing the
client's `traceparent` (or, without one, under its run's `invoke_agent` span), with an
`admit` child for the hold; the engine gets the chat span's `traceparent`.  With tracing
off, the turn does no span work at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

from opentelemetry.context import Context
from opentelemetry.trace import (
    Span,
    SpanKind,
    StatusCode,
    Tracer,
    get_current_span,
    set_span_in_context,
)
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from activities._recover import recover_tool_calls
from gateway._http import (
    Upstream,
    UpstreamAnswer,
    UpstreamError,
    credentials_refused,
    no_answer,
    wait_disconnect,
)
from gateway._runtrace import RunSpans, TurnOutcome
from gateway._shell import Admission, AdmissionShell, Awaited, Rejected, as_answered
from gateway.prober import PROBE_PERIOD_S, auth_headers
from luftpause import telemetry
from luftpause.config import DP_RANK_HEADER, Api, Endpoint
from luftpause.headers import PROVIDER_HEADER, RUN_HEADER
from scheduler import (
    Event,
    RunState,
    ServiceClass,
    TurnAbandoned,
    TurnAlive,
    TurnArrived,
    TurnFailed,
    TurnFinished,
    TurnStarted,
)

__all__ = [
    "DROP_UPSTREAM",
    "RUN_HEADER",
    "CancelOnLeave",
    "ClientLeft",
    "MessagesWatch",
    "ResponsesWatch",
    "StreamWatch",
    "TurnRequest",
    "TurnResponse",
    "dropped_upstream",
    "error_response",
    "no_answer",
]

log = logging.getLogger(__name__)

# A complete non-streaming answer is parsed for usage only up to this size.
_MAX_JSON_BODY = 64 * 1024 * 1024
# An SSE line longer than this is passed through but not inspected.
_MAX_SSE_LINE = 4 * 1024 * 1024
# Not passed on from the engine: hop-by-hop headers, and those the server sets itself.
DROP_UPSTREAM = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
        b"content-length",
        b"date",
        b"server",
        RUN_HEADER.encode(),
        PROVIDER_HEADER.encode(),
    }
)
_RUN_HEADER_BYTES = RUN_HEADER.encode()
_PROVIDER_HEADER_BYTES = PROVIDER_HEADER.encode()
# An engine that sends nothing for this long (for the head, or between body chunks) has
# hung: the turn fails (504 before the head; the stream closes without [DONE] after).
# The same 10 minutes as the core's turn timeout, which frees the slot by then anyway.
ENGINE_IDLE_TIMEOUT_S = 600.0
_USER_AGENT = "luftpause-gateway"
# Engine kinds that take stream_options.include_usage (a router passes it on to them).
# Hosted APIs and Ollama get the client's body as it is: one that rejected the field
# would fail every stream.
USAGE_ASKED_OF = frozenset({"sglang", "vllm", "llamacpp", "router"})


# Client headers the engine gets as they came (ASGI names are lower case).
_PASSED_ON = frozenset({b"x-request-id", b"x-correlation-id"})
# ... and on Anthropic Messages turns, the API's version and beta features, which the
# engines read (Claude Code sends both; its gateway guide asks for them unchanged).
_PASSED_ON_MESSAGES = _PASSED_ON | {b"anthropic-version", b"anthropic-beta"}
_TRACE_CONTEXT = frozenset({b"traceparent", b"tracestate"})
# The headers routers keep a session on one worker by: SMG's (its manual and
# consistent_hash policies) and vllm-router's (consistent_hash: its first key).  A turn
# to a `kind = "router"` endpoint carries the client's, else its run id in each, so
# that behind a router with such a policy a run's turns stay on the worker holding its
# prefix, as luftpause keeps them on a replica.
ROUTING_KEY_HEADERS = (b"x-smg-routing-key", b"x-session-id")
# How often a streaming turn tells the core of its progress, at most: well inside the
# turn timeout (a tenth of it, where the timeout is configured below 50 s).  Its cost is
# one event per streaming turn per period.
ALIVE_EVERY_S = 5.0
# How long before the core's timeout (which comes at a tick, every 2 s) the proxy gives
# up on a silent turn, at most: its report (the engine's fault or not) must come first.
MARGIN_S = 1.0
# The APIs not every replica takes (the file's `messages`, `responses`), by name.
_NEWER_APIS: Mapping[str, str] = {"messages": "Anthropic Messages", "responses": "OpenAI Responses"}


def api_not_served(model: str, replicas: Sequence[str], api: str) -> str:
    """Why a turn of `api` (messages, responses) for `model` is refused 404: `replicas`
    of the model do not take that API.  As a turn arrives, and as a held one is
    admitted after a reload brought such a replica."""
    return (
        f"model '{model}' is served by replicas that do not take the {_NEWER_APIS[api]} "
        f"API ({', '.join(replicas)}: {api} = false, or a kind that does not serve it); "
        f"use /v1/chat/completions, or set {api} = true where they do"
    )


# luftpause's own 503 (no healthy replica for the model) says when to look again: the
# next probe round.
UNAVAILABLE_RETRY_AFTER_S = str(math.ceil(PROBE_PERIOD_S))


def engine_fault(status: int) -> bool:
    """Whether an engine's error status is the engine failing (toward ejecting it): a
    5xx, but not 503 or 529 (an engine saying it is busy, retry later; 529 is
    Anthropic's "overloaded") and no 4xx (an answer about the request, or 429's rate
    limit)."""
    return status >= 500 and status not in (503, 529)


# What a 401 asks for (RFC 6750 section 3): a bearer token, for luftpause.  Nothing
# more: no `resource_metadata` (RFC 9728), as luftpause's tokens are static and it
# serves no OAuth metadata; an MCP client with OAuth starts its discovery on any 401
# anyway, and finds 404s.  A request that sent a token gets `error="invalid_token"`
# added (section 3.1; the gateway's `unauthorized`).
BEARER_CHALLENGE = 'Bearer realm="luftpause"'


# The "type" of an Anthropic error body, by status (its API's error reference); an
# Anthropic client (Claude Code, the SDKs) reads it, every client reads error.message.
_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def error_response(
    status: int,
    message: str,
    run_id: str,
    *,
    anthropic: bool = False,
    retry_after: str = UNAVAILABLE_RETRY_AFTER_S,
) -> Response:
    """The error body every failure uses, with the run id header (none when the
    request names no run, e.g. it was refused before it was read).  `anthropic`: in the
    Anthropic API's shape, `{"type": "error", "error": {"type": ..., "message": ...}}`,
    which is the same body with two fields more.  `retry_after`: a 503's (the gateway's
    probe period)."""
    if anthropic:
        kind = _ANTHROPIC_ERROR_TYPES.get(status, "api_error")
        body = json.dumps({"type": "error", "error": {"type": kind, "message": message}})
    else:
        body = json.dumps({"error": {"message": message}})
    headers = {RUN_HEADER: run_id} if run_id else {}
    if status == 503:
        headers["retry-after"] = retry_after
    elif status == 429:  # luftpause's own: a caller over max_held_per_caller
        headers["retry-after"] = "1"
    elif status == 401:
        headers["www-authenticate"] = BEARER_CHALLENGE
    return Response(body, status, headers=headers, media_type="application/json")


# --------------------------------------------------------------------------- watching


class StreamWatch:
    """Reads what the core needs from an answer without altering it: finish reason,
    usage and tool call ids, from SSE `data:` lines as they pass or a JSON body.

    When tools were offered (`tools`: their names) and the answer ends in `stop` with
    calls written as text instead (engines without a tool-call parser), the finish is
    reported as `tool_calls`: the run is paused on a tool, as the client will treat it."""

    _KEYS: tuple[bytes, ...] = (b'"usage"', b'"tool_calls"', b'"finish_reason"', b'"error"')

    def __init__(self, *, sse: bool, tools: frozenset[str] = frozenset()) -> None:
        self._sse = sse
        self._tools = tools
        # Whether whole lines without a watched key may be passed over unparsed.
        self._fast = sse and not tools
        self._buffer = bytearray()
        self._too_big = False
        self.overflowed = False  # a line (or body) too long to read was passed over
        # The answer's text, only while tools were offered: a JSON body's message, or the
        # raw SSE events that carry content from where a call may begin (parsed only if
        # the answer ends in "stop"): a call written as text either starts the text
        # ({, [, ```, <|python_tag|>) or is tagged (<tool_call>).  A prose answer keeps
        # nothing after its first words.
        self._content: list[str] = []
        self._events: list[bytes] = []
        self._kept = 0
        self._lead: bool | None = None  # whether the text starts like a call (None: no text yet)
        self._capture = False
        self.finish_reason: str | None = None
        # A JSON answer (not a stream) whose body is not a JSON object: no API's answer.
        self.shapeless = False
        self.prompt_tokens = 0
        self.completion_tokens = 0
        # None until the engine says what it found cached (SGLang says so only with
        # --enable-cache-report, vLLM with --enable-prompt-tokens-details, and both
        # only when they found some: the core tells a miss from silence by replica).
        self.cached_tokens: int | None = None
        self.tool_call_ids: list[str] = []
        # An error event inside a 200 stream (vLLM and SGLang send `data: {"error": ...}`
        # when generation fails after the head): the turn failed.  With the status its
        # `code` names and its `type`, if any (see `stream_error_is_engines`).
        self.error: str | None = None
        self.error_status: int | None = None
        self.error_type: str | None = None
        # Whether the error came first, before any other event of the stream (what a
        # request gets wrong; see `stream_error_is_engines`).
        self.error_first = False
        self._data = False  # a data line came (other than an error's)
        # The answer's last two pieces, whatever their framing: where its end marker is.
        self._prev = self._last = b""

    # What ends a whole stream of the API, after its finish reason (see `cut_short`).
    _END_MARKER = b"[DONE]"
    # The types of the events that open a stream before anything is generated: an
    # error after them still comes first (`error_first`).
    _PREAMBLE: frozenset[bytes] = frozenset()

    def _preamble(self, payloads: Iterable[bytes]) -> bool:
        """Whether these data lines' payloads are all events that open the stream, by
        each one's own (top-level) `type`: helper-183, a substring matched a tool named
        `ping` and an `id:` line counted as data; helper-184, vLLM writes `type` after
        `response`, whose tools' schemas carry types of their own.  None: no data.
        (Parsed only when a preamble type is in it: once or twice a stream.)"""
        for payload in payloads:
            if not any(kind in payload for kind in self._PREAMBLE):
                return False
            event = _loads(payload)
            kind = event.get("type") if isinstance(event, dict) else None
            if not isinstance(kind, str) or kind.encode() not in self._PREAMBLE:
                return False
        return True

    def cut_short(self) -> bool:
        """A stream that ended with neither its finish reason nor its end marker (chat's
        `data: [DONE]`, Messages' `message_stop`): cut short (a router that ends its own
        response when its worker died).  Either one is enough: an engine whose finish
        reason the watch cannot read (another key, lines framed by CR alone) still
        sends its end marker."""
        if self.finish_reason is not None:
            return False
        return not self._marker_seen()

    def _marker_seen(self) -> bool:
        """The end marker is in the answer's last two pieces."""
        return self._END_MARKER in self._prev[-64:] + self._last

    def passed_end(self) -> bool:
        """The stream has come to its end marker after its finish reason, no error in
        it: its client has the whole answer, whatever else the engine's response still
        sends (the OpenAI SDK stops reading at `[DONE]` and closes the connection)."""
        return self.error is None and self.finish_reason is not None and self._marker_seen()

    def feed(self, chunk: bytes) -> None:
        self._prev, self._last = self._last, chunk
        if (
            self._fast
            and not self._buffer
            and chunk.endswith(b"\n")
            and not self._too_big
            and not _may_matter(chunk, self._KEYS)
        ):
            self._data = self._data or not self._preamble(
                line[5:] for line in chunk.split(b"\n") if line.startswith(b"data:")
            )
            return  # whole lines that carry nothing the watch reads: most streamed tokens
        if self._too_big:
            if not (self._sse and b"\n" in chunk):
                return
            # Skip to the end of the oversized line and read on from there: the lines
            # after it in this chunk (often the finish and the usage) count.
            self._too_big = False
            chunk = chunk[chunk.index(b"\n") + 1 :]
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
            self._too_big = self.overflowed = True
            self._buffer = bytearray()

    def close(self) -> None:
        """The answer is complete: inspect what is left."""
        if not self._too_big:
            if self._sse:
                self._line(bytes(self._buffer))
            else:
                body = _loads(bytes(self._buffer))
                self.shapeless = not isinstance(body, dict)
                self._inspect(body)
            self._buffer = bytearray()
        if self.finish_reason == "stop" and self.tool_call_ids:
            # Calls made, and "stop" said (vLLM and OpenAI for a named tool_choice; vLLM's
            # /v1/messages says "end_turn" beside tool_use blocks): the client runs them
            # and comes back, so the run is paused on them (helper-156: it read idle).
            self.finish_reason = "tool_calls"
        elif (
            self._tools and not self._too_big and self.finish_reason == "stop"
            and not self.tool_call_ids
        ):  # fmt: skip
            for event in self._events:
                self._content += _texts(_loads(event))
            text = "".join(self._content)
            if text and recover_tool_calls(text, self._tools, salt=""):
                self.finish_reason = "tool_calls"

    def _failed(self, error: object, fallback: object = None, *more: object) -> None:
        """The stream carried `error` (an error object, or what stands for one): its
        text, and the status the first of it and `more` that names one names."""
        self.error = _error_text(error, fallback)
        self.error_first = not self._data
        self.error_status = next(
            (s for s in map(_error_status, (error, *more)) if s is not None), None
        )
        self.error_type = next(
            (
                e["type"]
                for e in (error, *more)
                if isinstance(e, dict) and isinstance(e.get("type"), str) and e["type"] != "error"
            ),
            None,
        ) or next(filter(None, map(_code_type, (error, *more))), None)

    def _line(self, line: bytes) -> None:
        line = line.rstrip(b"\r")
        if not line.startswith(b"data:"):
            return
        data = line[5:].strip()
        if not data or data == b"[DONE]":
            return
        if self._tools and b'"content"' in data:
            self._watch_text(data)
        if _may_matter(data, self._KEYS):
            self._inspect(_loads(data))
        self._data = self._data or not self._preamble((data,))

    def _inspect(self, obj: object) -> None:
        if not isinstance(obj, dict):
            return
        error = obj.get("error")
        if error is None and obj.get("object") == "error":
            error = obj  # older vLLM: the error object itself is the event
        if self._sse and error is not None and self.error is None:
            self._failed(error)
        if self._tools and not self._sse:
            self._content += _texts(obj)  # a JSON body: its message's text
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
            # With n > 1, one choice ending in tool calls pauses the run.
            if isinstance(reason, str) and self.finish_reason != "tool_calls":
                self.finish_reason = reason
            for part in (choice.get("delta"), choice.get("message")):
                calls = part.get("tool_calls") if isinstance(part, dict) else None
                if not isinstance(calls, list):
                    continue
                for call in calls:
                    call_id = call.get("id") if isinstance(call, dict) else None
                    if isinstance(call_id, str) and call_id not in self.tool_call_ids:
                        self.tool_call_ids.append(call_id)

    def _watch_text(self, data: bytes) -> None:
        if not self._capture:
            if b"tool_call" in data:
                self._capture = True
            elif self._lead is None:
                text = "".join(_texts(_loads(data))).lstrip()
                if text:
                    self._lead = text.startswith(_CALL_LEADS)
                    self._capture = self._lead
        if self._capture and self._kept + len(data) <= _MAX_JSON_BODY:
            self._events.append(data)
            self._kept += len(data)


# How a text that is a tool call begins (activities/_recover.py's forms).
_CALL_LEADS = ("{", "[", "```", "<|python_tag|>", "<tool_call>")


def _texts(obj: object) -> list[str]:
    """The content strings of a chunk's choices (delta or message)."""
    out: list[str] = []
    choices = obj.get("choices") if isinstance(obj, dict) else None
    for choice in choices if isinstance(choices, list) else ():
        if isinstance(choice, dict):
            for part in (choice.get("delta"), choice.get("message")):
                text = part.get("content") if isinstance(part, dict) else None
                if isinstance(text, str):
                    out.append(text)
    return out


def _may_matter(event: bytes, keys: tuple[bytes, ...]) -> bool:
    """Whether an SSE event may carry what the watch reads: a watched key with a value
    other than null (inside a JSON string its quotes would be escaped).  Most events are
    content deltas; parsing each as JSON was the proxy's largest cost per streamed
    token.  (A false yes only costs a parse.)"""
    for key in keys:
        n = event.count(key)
        if n and n > event.count(key + b": null") + event.count(key + b":null"):
            return True
    return False


# An Anthropic stop_reason as the core's finish reason: "tool_use" pauses the run.
_STOP_REASONS = {
    "tool_use": "tool_calls",
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
}


# The error of a Messages stream's `event: error` until its data line says more.
_ERROR_EVENT = "an error event without data"


class MessagesWatch(StreamWatch):
    """The watch of an Anthropic Messages answer (`/v1/messages`): the stop reason from
    `message_delta` (or the message), tool use ids from `content_block_start` (or the
    content), usage merged over `message_start` and `message_delta`, and `error` events.

    Engines split usage differently: llama.cpp puts `input_tokens` (net of the cache, as
    Anthropic's API does) and `cache_read_input_tokens` in `message_start`; vLLM repeats
    `input_tokens` in the last `message_delta` (net of the cache where it reports
    `cache_read_input_tokens`, since vLLM PR #40912, while its `message_start`, written
    before the cache hit is known, still counts the whole prompt; before that PR it
    reported no cache and its `input_tokens` were the whole prompt in both).  SGLang
    since 0.5.19 (its PRs #25876, #29703) as llama.cpp: `message_start` carries
    `input_tokens` net of the cache and `cache_read_input_tokens` (only when above 0),
    its `message_delta` only `output_tokens`; its JSON answer the same two fields.
    Before, it reported them in the last `message_delta` only, its `input_tokens`
    counting the cached tokens too: an SGLang stream whose `message_delta` carries
    `input_tokens` is read so (`input_counts_cached`; helper-198: read so always, a
    0.5.19 turn of 7,237 prompt tokens, 6,336 cached, counted 6,336).  The last
    reading of a field wins."""

    _KEYS = (b'"usage"', b'"stop_reason"', b'"tool_use"', b'"error"', b"event: error")
    _PREAMBLE = frozenset({b"message_start", b"ping"})  # (as Responses' response.created)
    _END_MARKER = b"message_stop"

    def __init__(self, *, sse: bool, input_counts_cached: bool = False) -> None:
        super().__init__(sse=sse)
        self._input_counts_cached = input_counts_cached
        self._input_in_delta = False  # an older SGLang's stream (its input counts the cached)
        self._input = 0
        self._cache_read = 0
        self._cache_write = 0

    def _line(self, line: bytes) -> None:
        # An error is known by its `event:` line: llama.cpp's data is its own error body
        # ({"code", "message", "type": "server_error"}), not Anthropic's.
        if line.startswith(b"event:"):
            if line[6:].strip() == b"error":
                self._fast = False  # its data line may carry no watched key
                if self.error is None:
                    self.error = _ERROR_EVENT  # an error, even if no data line follows
            return
        if not self._fast and line.startswith(b"data:"):
            self._fast = True
            if self.error is None or self.error is _ERROR_EVENT:
                data = line[5:].strip()
                obj = _loads(data)
                inner = obj.get("error", obj) if isinstance(obj, dict) else None
                self._failed(inner, data.decode("utf-8", "replace"))
            return
        super()._line(line)

    def _inspect(self, obj: object) -> None:
        if not isinstance(obj, dict):
            return
        kind = obj.get("type")
        if kind == "error":
            if self._sse and self.error is None:
                self._failed(obj.get("error"))
            return
        message = obj.get("message") if kind == "message_start" else obj
        if not isinstance(message, dict):
            return
        self._usage(message.get("usage"), kind == "message_delta")
        delta = obj.get("delta") if kind == "message_delta" else message
        reason = delta.get("stop_reason") if isinstance(delta, dict) else None
        if isinstance(reason, str):
            self.finish_reason = _STOP_REASONS.get(reason, reason)
        blocks = [obj.get("content_block")] if kind == "content_block_start" else None
        if not self._sse:  # a JSON body: the message
            blocks = message.get("content")
        for block in blocks if isinstance(blocks, list) else ():
            if isinstance(block, dict) and block.get("type") == "tool_use":
                call_id = block.get("id")
                if isinstance(call_id, str) and call_id not in self.tool_call_ids:
                    self.tool_call_ids.append(call_id)

    def _usage(self, usage: object, in_delta: bool = False) -> None:
        if not isinstance(usage, dict):
            return
        # Each field is the total so far wherever it appears (Anthropic's message_delta
        # usage is cumulative): a later reading replaces an earlier one, but a 0 (or a
        # field left out) says nothing (an older SGLang's message_start has zeros, llama.cpp's
        # message_delta only output_tokens).  Not the largest reading: vLLM's
        # message_start counts the whole prompt in input_tokens before it knows its
        # cache hit, and its message_delta the part net of the cache beside the cached
        # part, so the largest input_tokens plus the cached part counted the cached
        # tokens twice (helper-83).
        given = _int(usage.get("input_tokens"), 0)
        self._input = given or self._input
        if given and in_delta:
            self._input_in_delta = True
        read = _int(usage.get("cache_read_input_tokens"), None)
        if read is not None:
            self._cache_read = read or self._cache_read
            self.cached_tokens = self._cache_read
        self._cache_write = _int(usage.get("cache_creation_input_tokens"), 0) or self._cache_write
        self.completion_tokens = max(self.completion_tokens, _int(usage.get("output_tokens"), 0))
        if self._input_counts_cached and self._input_in_delta:
            self.prompt_tokens = max(self._input, self._cache_read)
        else:
            self.prompt_tokens = self._input + self._cache_read + self._cache_write


# A response id kept for its run at most this long (vLLM's are resp_ and 32 hex digits).
RESPONSE_ID_MAX_CHARS = 256
# The events of an OpenAI Responses stream that end it, with the whole response.
_RESPONSE_ENDS = frozenset({"response.completed", "response.incomplete", "response.failed"})


class ResponsesWatch(StreamWatch):
    """The watch of an OpenAI Responses answer (`/v1/responses`, Codex's API): reads the
    final response (`response.completed`, `.incomplete` or `.failed`, or a JSON body):
    its usage (`input_tokens` count the cached ones, as in Chat Completions), the
    `call_id`s of the calls it made (`function_call`, and Codex's `custom_tool_call`,
    `local_shell_call`, ...: any finished output item with a `call_id`; the run is
    paused on them), also from `response.output_item.done` as they finish, and errors:
    `error` events, and the bare `{"error": ...}` llama.cpp sends mid-stream."""

    _KEYS = (
        b"response.completed",
        b"response.incomplete",
        b"response.failed",
        b"response.output_item.done",
        b'"error"',
    )
    # (vLLM sends response.created before it checks what it checks of a request lazily,
    # a schema it cannot compile: helper-182.)
    _PREAMBLE = frozenset({b"response.created", b"response.in_progress", b"response.queued"})
    # Whether the answer ended as the API ends one (a final event, an error, a JSON
    # body): a stream closed before is no finished turn (helper-140).
    ended = False

    def passed_end(self) -> bool:
        return self.error is None and self.ended

    # The response's id, which a client that chains with previous_response_id names
    # in its next turn (the run's, remembered as its call ids are).
    response_id: str | None = None

    def _inspect(self, obj: object) -> None:
        if not isinstance(obj, dict):
            return
        kind = obj.get("type")
        if kind in _RESPONSE_ENDS or not self._sse:
            self.ended = True
        if kind == "error" or (
            kind is None and obj.get("error") is not None and obj.get("object") != "response"
        ):
            self.ended = True
            if self._sse and self.error is None:
                fallback = obj.get("message") or obj.get("code") or "error"
                self._failed(obj.get("error"), fallback, obj)
            return
        if kind == "response.output_item.done":
            self._call(obj.get("item"))
            return
        response = obj.get("response") if kind in _RESPONSE_ENDS else None
        if not self._sse and obj.get("object") == "response":
            response = obj  # a JSON body
        if not isinstance(response, dict):
            return
        if isinstance(response.get("id"), str):
            self.response_id = response["id"][:RESPONSE_ID_MAX_CHARS]
        status = response.get("status")
        if status == "failed" and self.error is None:
            # (A JSON body too: a 200 whose response failed is no finished turn.)
            self._failed(response.get("error"), "the response failed")
        usage = response.get("usage")
        if isinstance(usage, dict):
            # (Older SGLang builds named them as Chat Completions does.)
            prompt = usage.get("input_tokens", usage.get("prompt_tokens"))
            completion = usage.get("output_tokens", usage.get("completion_tokens"))
            self.prompt_tokens = _int(prompt, self.prompt_tokens)
            self.completion_tokens = _int(completion, self.completion_tokens)
            details = usage.get("input_tokens_details", usage.get("prompt_tokens_details"))
            if isinstance(details, dict):
                self.cached_tokens = _int(details.get("cached_tokens"), self.cached_tokens)
        output = response.get("output")
        for item in output if isinstance(output, list) else ():
            self._call(item)
        if status == "incomplete":
            # Cut short (max_output_tokens): a call it was writing is not one the client
            # will answer.
            self.finish_reason = "length"
        elif self.tool_call_ids:
            self.finish_reason = "tool_calls"
        elif status == "completed":
            self.finish_reason = "stop"

    def _call(self, item: object) -> None:
        """Note a finished output item that is a call the client answers."""
        if not isinstance(item, dict) or item.get("status") == "incomplete":
            return
        call_id = item.get("call_id")
        kind = item.get("type")
        if (
            isinstance(call_id, str)
            and isinstance(kind, str)
            and not kind.endswith("_output")
            and call_id not in self.tool_call_ids
        ):
            self.tool_call_ids.append(call_id)


# A blank line: two line ends, each CRLF, LF or a CR alone (the SSE grammar's three).
_EVENT_END = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r(?!\n)|\n)")
# An empty `choices` list, however the engine spaces its JSON (`"choices":[]`,
# `"choices": []`, `"choices" : [ ]`): as cheap a search as a test for `[]`.
_EMPTY_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')


class _AddedUsage:
    """Removes the usage-only event (`"choices": []` with `usage`) from a stream whose
    request the gateway asked for usage; every other byte passes unchanged.  Forwards
    whole events: a partial one waits for its end (a client cannot use half an event).
    SGLang puts `"usage": null` in every chunk, so the test is the empty choices."""

    __slots__ = ("_cr", "_tail")

    def __init__(self) -> None:
        self._tail = b""
        # The last piece ended an event with a CR, which may be half of a CRLF whose LF
        # comes first in the next piece: None, or whether that event was dropped (its
        # LF then goes with it; else the LF is passed on, not held for the next event).
        self._cr: bool | None = None

    def filter(self, chunk: bytes, *, last: bool = False) -> bytes:
        lead = b""
        if self._cr is not None and chunk:
            dropped, self._cr = self._cr, None
            if chunk.startswith(b"\n"):
                chunk = chunk[1:]
                lead = b"" if dropped else b"\n"
        if (
            not self._tail
            and (last or chunk.endswith(b"\n\n"))
            and _EMPTY_CHOICES.search(chunk) is None
        ):
            return lead + chunk  # whole events, none with empty choices: most chunks
        data = self._tail + chunk if self._tail else chunk
        kept = [lead]
        start = 0
        dropped = False
        for m in _EVENT_END.finditer(data):
            dropped = _is_added_usage(data[start : m.end()])
            if not dropped:
                kept.append(data[start : m.end()])
            start = m.end()
        rest = data[start:]
        self._tail = b"" if last else rest
        if not last and start and not rest and data.endswith(b"\r"):
            self._cr = dropped
        if last and rest and not _is_added_usage(rest):
            kept.append(rest)
        return b"".join(kept)


def _is_added_usage(event: bytes) -> bool:
    """The usage-only event: empty choices and a usage (bytes tests, no parse: inside a
    JSON string these quotes would be escaped)."""
    return b'"usage"' in event and _EMPTY_CHOICES.search(event) is not None


def dropped_upstream(headers: Sequence[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """The engine's headers (names lower case) not passed on: DROP_UPSTREAM, and those
    its `Connection` header names, hop-by-hop too (RFC 9110 7.6.1)."""
    named = {
        token.strip().lower() for k, v in headers if k == b"connection" for token in v.split(b",")
    }
    return DROP_UPSTREAM | named if named else DROP_UPSTREAM


# In-stream errors that say the engine is busy (retry later), as 429 and 503 do, and
# Anthropic's 529 "overloaded": no failure of the engine.
_BUSY_STATUSES = frozenset({429, 503, 529})
_BUSY_TYPES = frozenset({"rate_limit_error", "overloaded_error"})
# Anthropic's error types about the request itself (its API's error reference): an API
# that names these means them.  Not vLLM's and SGLang's "BadRequestError" as such:
# older vLLM stream generators report every exception so, a dead engine's included
# (helper-116); see `stream_error_is_engines` for the 4xx that comes first.
_REQUEST_TYPES = frozenset(
    {
        "invalid_request_error",
        "authentication_error",
        "permission_error",
        "not_found_error",
        "request_too_large",
    }
)


# OpenAI's error codes of a failed response (`response.failed`, or a stream's `error`
# event; the Responses API reference, openai-python's ResponseError): strings, which
# name a status only by what they say.  A rate limit or quota says busy; the rest but
# server_error are about the request (helper-140: a context too long ejected the
# replica for every caller).  Unknown codes stay the engine's.
_BUSY_CODES = frozenset({"rate_limit_exceeded", "insufficient_quota", "vector_store_timeout"})
_REQUEST_CODES = frozenset(
    {
        "context_length_exceeded",
        "invalid_prompt",
        "data_residency_mismatch",
        "bio_policy",
        "misalignment_policy_violation",
        "invalid_image",
        "invalid_image_format",
        "invalid_base64_image",
        "invalid_image_url",
        "image_too_large",
        "image_too_small",
        "image_parse_error",
        "image_content_policy_violation",
        "invalid_image_mode",
        "image_file_too_large",
        "unsupported_image_media_type",
        "empty_image_file",
        "failed_to_download_image",
        "image_file_not_found",
    }
)


def _code_type(error: object) -> str | None:
    """The error type an OpenAI error `code` stands for, as `stream_error_is_engines`
    reads types (None: no such code)."""
    code = error.get("code") if isinstance(error, dict) else None
    if not isinstance(code, str):
        return None  # (a number is `_error_status`'s; an object or list, nobody's)
    if code in _BUSY_CODES:
        return "rate_limit_error"
    if code in _REQUEST_CODES:
        return "invalid_request_error"
    return None


def stream_error_is_engines(status: int | None, kind: str | None, first: bool = False) -> bool:
    """Whether an error event inside a 200 stream counts as the engine failing (toward
    ejecting it): unless it says the engine is busy, or is an Anthropic-style error
    about the request, or names a 4xx and came `first`, before any other event.

    vLLM checks much of a request only as its stream generator starts (the processor
    runs lazily inside it: a structured-output schema it cannot compile, top_logprobs
    past --max-logprobs), and SGLang streams a scheduler's abort with its status (a
    prompt past the context length, sgl-project/sglang#12081): a 200, then one error
    event, code 400.  Counted as the engine's, five in a row ejected a healthy replica
    for every caller (helper-181).  A dead engine is refused before the head (vLLM's
    `engine_client.errored` check) and fails its health probe; a 400 after tokens, an
    older vLLM's way of saying its engine died mid-generation, stays the engine's."""
    if first and status is not None and 400 <= status < 500:
        return False
    return not (status in _BUSY_STATUSES or kind in _BUSY_TYPES or kind in _REQUEST_TYPES)


def _error_status(error: object) -> int | None:
    """The HTTP status an in-stream error object's `code` names (vLLM's and SGLang's),
    if it is one."""
    if not isinstance(error, dict):
        return None
    code = error.get("code")
    if isinstance(code, str) and code.isascii() and code.isdigit():
        code = int(code)
    if isinstance(code, int) and not isinstance(code, bool) and 400 <= code <= 599:
        return code
    return None


def _error_text(error: object, fallback: object = None) -> str:
    """What an engine's error says: an error object's `message`, else the error itself,
    else `fallback`; cut to 200 characters (it goes into a log line and a span)."""
    message = error.get("message") if isinstance(error, dict) else error
    return str(message or fallback or error)[:200]


# Anthropic's keep-alive is an event of its own (`event: ping`, its streaming
# reference): sent while a request waits, it is no more progress than a comment.


# The Responses API's first events, which vLLM sends before the request is scheduled
# (serving_responses.py): no sign that the engine generates (helper-140).
_RESPONSE_LIFECYCLE = (
    b"event: response.created",
    b"event: response.in_progress",
    b"event: response.queued",
)


_LINE_END = re.compile(rb"\r\n|\r|\n")


class _Progress:
    """Which pieces of an answer carry progress, piece by piece as they are read (a
    piece may end anywhere): not SSE comments (`: ping`), Anthropic's `ping` events, a
    Responses stream's lifecycle events or blank lines, nor a JSON body's whitespace.
    A piece that goes on a line begun before is data unless that line is a keep-alive's
    (helper-139: a piece may begin at a JSON colon; helper-141: a keep-alive split
    across pieces)."""

    __slots__ = ("_cr", "_line_start", "_skip", "_sse")

    def __init__(self, sse: bool, line_start: bool = True) -> None:
        self._sse = sse
        self._line_start = line_start  # the next piece begins a line
        self._cr = False  # the last piece ended in CR (its LF may begin the next)
        self._skip: str | None = None  # "line" or "event": a keep-alive's rest comes first

    def carries(self, chunk: bytes) -> bool:
        if not self._sse:
            return bool(chunk.strip())
        if (
            self._line_start
            and not self._cr
            and self._skip is None
            and chunk.startswith(b"data:")
            and chunk.endswith(b"\n\n")
        ):
            # Whole events from a data line on (an engine's every token): data, and the
            # next piece begins an event, as `_read` finds, in a tenth of its time (its
            # 3 us a piece were some 50 a stream).
            return True
        return self._read(chunk)

    def _read(self, chunk: bytes) -> bool:
        """`carries`, for any piece of an SSE stream."""
        line_start, cr = self._line_start, self._cr
        self._line_start, self._cr = chunk.endswith((b"\n", b"\r")), chunk.endswith(b"\r")
        rest = chunk[1:] if cr and chunk.startswith(b"\n") else chunk
        skip, self._skip = self._skip, None
        if skip == "event":  # the rest of a keep-alive event, to its blank line
            blank = _LINE_END.match(rest) if line_start else None
            ended = blank or _EVENT_END.search(rest)
            if ended is None:
                self._skip = "event"
                return False
            rest = rest[ended.end() :]
        elif skip == "line" or not line_start:  # the rest of a line begun before
            ended = _LINE_END.search(rest)
            if skip is None and rest[: ended.start() if ended else len(rest)].strip():
                self._lines(rest, data=True)  # data goes on (read on, for what ends it)
                return True
            if ended is None:
                self._skip = skip
                return False
            rest = rest[ended.end() :]
        return self._lines(rest.lstrip())

    def _lines(self, rest: bytes, data: bool = False) -> bool:
        """Whether `rest` (from a line's start; or inside a data event, `data`) holds
        data.  Read to its end, so that a keep-alive it ends in is skipped in the next
        piece (helper-142: one begun after data was taken for data)."""
        found = data
        while rest:
            if data:  # a data event: on to its end
                ended = _EVENT_END.search(rest)
                if ended is None:
                    return True  # it goes on in the next piece
                rest, data = rest[ended.end() :].lstrip(), False
            elif rest.startswith(b":"):  # a comment line; what follows it may be an event
                ended = _LINE_END.search(rest)
                if ended is None:
                    self._skip = "line"
                    return found
                rest = rest[ended.end() :].lstrip()
            elif rest.startswith((b"event: ping", *_RESPONSE_LIFECYCLE)) and _keep_alive(rest):
                ended = _EVENT_END.search(rest)
                if ended is None:
                    self._skip = "event"
                    return found
                rest = rest[ended.end() :].lstrip()
            else:
                found = data = True
        return found


def _keep_alive(event: bytes) -> bool:
    """Whether an event that begins so is a keep-alive: a Responses lifecycle event, or
    one named exactly `ping` (whose data is `{"type": "ping"}`)."""
    if not event.startswith(b"event: ping"):
        return True
    line = _LINE_END.search(event)
    return line is None or event[: line.start()].rstrip() == b"event: ping"


def _carries(chunk: bytes, sse: bool = True, line_start: bool = True) -> bool:
    """`_Progress(sse, line_start).carries(chunk)`: one piece, on its own."""
    return _Progress(sse, line_start).carries(chunk)


async def _head_of_body(answer: UpstreamAnswer, limit: int = 2048) -> str:
    """The start of an (error) answer's body, read for at most a second, for a log."""
    got = b""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(1.0):
            while len(got) < limit and (piece := await answer.read()):
                got += piece
    return got[:limit].decode("utf-8", "replace") or "(no body)"


def _loads(data: bytes) -> object:
    try:
        return json.loads(data)
    except (ValueError, RecursionError):  # RecursionError: nested past the parser's depth
        return None


# No engine's context comes near this; a count beyond it (or below 0) is no count, and
# would size the run's KV claim in the core.
_MAX_TOKEN_COUNT = 1 << 31


_D = TypeVar("_D")


def _int(value: object, default: _D) -> int | _D:
    """A token count from an engine's usage, or `default` if it is not one."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _MAX_TOKEN_COUNT:
        return value
    return default


# --------------------------------------------------------------------------- a turn


@dataclass(frozen=True, kw_only=True, slots=True)
class TurnRequest:
    """A validated turn of one of the APIs (`api`), as the proxy forwards it."""

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
    tools: frozenset[str] = frozenset()  # names of the function tools offered
    # The estimate measures the whole prompt (TurnArrived.learnable)
    learnable: bool = True
    # The body with stream_options.include_usage turned on, for a stream that does not
    # ask for usage; sent to the engine kinds known to take it (USAGE_ASKED_OF), whose
    # usage-only event is then read and not forwarded.  None: `body` is sent.
    usage_body: bytes | None = None
    # The client's stream_options has no include_usage: vLLM then sends usage (its
    # default), so a vLLM replica gets `body` and the client its usage event, as direct.
    usage_by_default: bool = False
    api: Api = "chat"
    stream: bool = False  # the client asked for a stream (`"stream": true`)

    def error(
        self, status: int, message: str, retry_after: str = UNAVAILABLE_RETRY_AFTER_S
    ) -> Response:
        """An error answer in the shape of the turn's API."""
        anthropic = self.api == "messages"
        return error_response(
            status, message, self.run_id, anthropic=anthropic, retry_after=retry_after
        )

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
            learnable=self.learnable,
        )


async def hold(
    shell: AdmissionShell,
    turn: TurnRequest,
    clock: Callable[[], float],
    disconnected: asyncio.Future[None],
    awaited: Callable[[str], Awaited | None] = lambda model: None,
) -> Admission | None:
    """Report the turn's arrival and wait, with no deadline, for the core to admit or
    reject it.  None: the client left while the turn was held; the caller reports it
    abandoned, and no engine request is made.  `awaited`: why a model has no engine
    for now (discovered endpoints with none up, `Pool.awaited`): the core's 404 for a
    turn whose model no replica serves any more is then a 503, to be retried."""
    admission = shell.arrive(turn.arrival(clock()))
    if not admission.done():
        await asyncio.wait((admission, disconnected), return_when=asyncio.FIRST_COMPLETED)
    if not admission.done() or disconnected.done():
        return None
    outcome = admission.result()
    return as_answered(outcome, turn.model, awaited) if isinstance(outcome, Rejected) else outcome


def left_while_held(shell: AdmissionShell, turn_id: str, now: float) -> Event:
    """What to report of a turn whose client left while it was held (`hold` gave None):
    abandoned, or, admitted in the same step of the loop as the client left, a turn
    the client left (to the core alike: its slot is freed; the metrics tell them apart,
    and `abandoned` on a replica means the gateway stopped it)."""
    t = shell.state.turns.get(turn_id)
    if t is not None and t.replica is not None:
        reason = "client disconnected as the turn was admitted"
        return TurnFailed(now=now, turn_id=turn_id, reason=reason, client_left=True)
    return TurnAbandoned(now=now, turn_id=turn_id)


class ClientLeft(Exception):
    """The client left while a `CancelOnLeave` block ran: the block's step stopped."""


class CancelOnLeave:
    """While a `with` block of it runs, the client leaving cancels the task running it:
    the step it awaits (the engine's head, or streaming the answer) stops and the block
    raises ClientLeft.  No task per step is raced against the disconnect (that cost
    ~30 µs a step here).  Once the last body message is on its way (`finishing`), the
    server reports a disconnect for the finished response: then nothing is cancelled."""

    def __init__(self, disconnected: asyncio.Future[None], finishing: Callable[[], bool]) -> None:
        self._disconnected = disconnected
        self._finishing = finishing
        self._task: asyncio.Task[Any] | None = None
        self._left = False
        self._armed: functools.partial[None] | None = None

    def __enter__(self) -> None:
        self._task = asyncio.current_task()
        # A callback of this block's own: one the loop had already scheduled when an
        # earlier block ended (the disconnect and the step's end in one iteration)
        # cannot be taken back, and must not cancel this block too.
        self._armed = functools.partial(self._leave, object())
        self._disconnected.add_done_callback(self._armed)

    def _leave(self, block: object, disconnected: asyncio.Future[None]) -> None:
        # Runs from the loop while the task waits inside the block (or not at all: the
        # block's exit disarms it), so the cancellation lands at an await in the block.
        armed, task = self._armed, self._task
        if armed is None or armed.args[0] is not block or task is None or self._left:
            return
        if disconnected.cancelled() or self._finishing():
            return
        self._left = True
        task.cancel()

    def __exit__(self, kind: type[BaseException] | None, exc: object, tb: object) -> None:
        task, self._task = self._task, None
        left, self._left = self._left, False
        if self._armed is not None:
            self._disconnected.remove_done_callback(self._armed)
            self._armed = None
        # uncancel() > 0: cancelled from outside as well (shutdown): let that through.
        if left and kind is asyncio.CancelledError and task is not None and not task.uncancel():
            raise ClientLeft from None


class TurnResponse(Response):
    """The ASGI response that runs one turn end to end (see the module docstring)."""

    def __init__(
        self,
        turn: TurnRequest,
        *,
        shell: AdmissionShell,
        upstream: Upstream,
        endpoints: Mapping[str, Endpoint],
        clock: Callable[[], float],
        answered_by: Mapping[str, str] | None = None,
        runs: RunSpans,
        retry_after: str = UNAVAILABLE_RETRY_AFTER_S,
        awaited: Callable[[str], Awaited | None] = lambda model: None,
    ) -> None:
        """`answered_by`: the kind of engine that answers each replica's turns (a
        router's engines', `Pool.answered_by`; missing: the replica's own).
        `retry_after`: when a turn refused for want of a healthy replica may look again
        (the next probe round).  `runs`: the runs' `invoke_agent` spans, for turns that
        come without a trace.  `awaited`: as `hold`'s."""
        super().__init__(status_code=200)
        self._idle = ENGINE_IDLE_TIMEOUT_S  # the core's turn_timeout_s, at admission
        self._alive_every = self._margin = 0.0  # (see _timed)
        self._admitted = 0.0  # the loop's time when the core admitted the turn
        self._answered_by = answered_by or {}
        self._retry_after = retry_after
        self._turn = turn
        self._shell = shell
        self._upstream = upstream
        self._endpoints = endpoints
        self._clock = clock
        self._ended = False
        self._complete = False  # the last body message is on its way to the client
        self._watch: StreamWatch | None = None  # the stream's watch, once it streams
        self._sent_end = False  # its end marker went to the client (see ClientLeft)
        self.started = False  # the engine's head went to the client
        self._trace: _TurnTrace | None = None
        self._runs = runs
        self._awaited = awaited

    def _end(self, event: Event) -> None:
        """Report the turn's one terminal event."""
        if not self._ended:
            self._ended = True
            self._shell.forget_turn(self._turn.turn_id)
            self._shell.apply(event)
            if self._trace is not None:
                self._trace.ended(event)

    def _fail(
        self, reason: str, *, engine: bool = False, client_left: bool = False, silent: bool = False
    ) -> None:
        """`engine`: the engine's fault (counts toward ejecting its replica); `silent`:
        nothing came within the turn timeout."""
        self._end(
            TurnFailed(
                now=self._clock(),
                turn_id=self._turn.turn_id,
                reason=reason,
                engine_fault=engine,
                client_left=client_left,
                timed_out=silent,
            )
        )

    def _kind(self, replica: str) -> str:
        """The kind of engine that answers the replica's turns."""
        return self._answered_by.get(replica) or self._endpoints[replica].kind

    def _sent_into_room(self, replica: str) -> bool:
        """Whether the turn is a stream sent into room the engine had, as it is sent:
        within the cap (what the engine was seen running once it showed a queue), or
        its known slots; or, the engine reporting its load and no queue at its last
        probe, at most one more than it ran then.  Only then is no head within the turn
        timeout the engine's fault (toward ejecting it): an engine sends a stream's head
        as it starts generating, but a non-streamed answer's head comes with its end (a
        long generation is no fault), and an engine may hold a turn sent past its room
        in its queue, as one that reports no load (Ollama, hosted APIs) may any (a queue
        of ten minutes ejected a healthy replica: helper-125).  Decided as the turn is
        sent, not at the timeout (helper-128), and a hung engine whose probes still
        show a queue is within its cap, so it is ejected still (helper-130)."""
        r = self._shell.state.replicas.get(replica)
        if not self._turn.stream or r is None:
            return False
        if r.limit is not None and r.in_flight <= r.limit:
            return True
        return r.running is not None and r.queued == 0 and r.in_flight <= r.running + 1

    def _timed(self, turn_timeout: float) -> None:
        """The turn's engine wait is bounded by the core's `turn_timeout_s` as the core
        admits it: a reload's value holds for turns held across the reload too (read
        at arrival, the proxy waited on after the core had freed the slot, or gave up
        before the new limit: helper-151).  Also how often a streaming turn tells the
        core of its progress, and how long before the core would time it out the proxy
        gives up on it (see `_pump`)."""
        self._idle = turn_timeout
        self._alive_every = min(ALIVE_EVERY_S, turn_timeout / 10)
        self._margin = min(MARGIN_S, turn_timeout / 10)

    @property
    def turn(self) -> TurnRequest:
        return self._turn

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        t = self._turn
        disconnected = asyncio.ensure_future(wait_disconnect(receive))
        arrived = False
        tracer = telemetry.tracer()
        if tracer is not None:
            self._trace = _TurnTrace(tracer, t, scope["headers"], self._clock(), self._runs)
        try:
            arrived = True  # an abandon of a turn the core never saw is ignored by it
            outcome = await hold(self._shell, t, self._clock, disconnected, self._awaited)
            self._admitted = asyncio.get_running_loop().time()
            self._timed(self._shell.turn_timeout(t.turn_id))
            if self._trace is not None:
                self._trace.admitted(outcome, self._clock())
            if outcome is None:
                self._end(left_while_held(self._shell, t.turn_id, self._clock()))
                return
            if isinstance(outcome, Rejected):
                self._ended = True  # never queued: nothing to report
                answer = t.error(
                    outcome.status, outcome.message, outcome.retry_after or self._retry_after
                )
                await answer(scope, receive, send)
                return
            if t.api in _NEWER_APIS and not self._endpoints[outcome].serves(t.api):
                # Held before a reload added a replica of its model that does not take
                # its API (the core places turns by model): refused as a turn arriving
                # now is, in its API's shape (helper-143: the engine's own 404 went out).
                message = api_not_served(t.model, [outcome], t.api)
                self._fail(message)
                await t.error(404, message)(scope, receive, send)
                return
            await self._forward(outcome, scope, receive, send, disconnected)
        finally:
            disconnected.cancel()
            if arrived and not self._ended:
                # Cancelled from outside (server shutdown) or a bug: free the slot.
                self._end(TurnAbandoned(now=self._clock(), turn_id=t.turn_id))
            if self._trace is not None:
                self._trace.close(self._shell.state.runs.get(t.run_id))

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
        headers = [
            ("content-type", t.content_type),
            ("accept", t.accept or "*/*"),
            ("accept-encoding", "identity"),
            ("user-agent", _USER_AGENT),
            *auth_headers(endpoint, anthropic=t.api == "messages").items(),
        ]
        if endpoint.dp_rank is not None:  # a rank of a data-parallel server: pin it there
            headers.append((DP_RANK_HEADER, str(endpoint.dp_rank)))
        passed = _PASSED_ON_MESSAGES if t.api == "messages" else _PASSED_ON
        for name, value in scope["headers"]:
            # The client's request id goes on, so engine logs can be matched with it
            # (vLLM takes X-Request-Id as its own with --enable-request-id-headers); so
            # does its trace context when luftpause makes no span of its own.
            if name in passed or (self._trace is None and name in _TRACE_CONTEXT):
                headers.append((name.decode("latin-1"), value.decode("latin-1")))
        if endpoint.kind == "router":
            given = dict(scope["headers"])
            for name in ROUTING_KEY_HEADERS:
                value = given.get(name, t.run_id.encode("latin-1"))
                headers.append((name.decode("latin-1"), value.decode("latin-1")))
        if self._trace is not None:
            headers += self._trace.forwarding(replica, endpoint, self._kind(replica))
        leave = CancelOnLeave(disconnected, lambda: self._complete)
        into_room = self._sent_into_room(replica)
        url = endpoint.api_url(t.api)
        body = t.body
        if (
            t.usage_body is not None
            and endpoint.kind in USAGE_ASKED_OF
            and not (t.usage_by_default and self._kind(replica) == "vllm")
        ):
            body = t.usage_body
        try:
            # asyncio.timeout, not wait_for: no extra task per turn on the hot path.
            with leave:
                async with asyncio.timeout_at(self._admitted + self._idle - self._margin):
                    answer = await self._upstream.post(
                        url, body, headers, query=scope["query_string"]
                    )
        except ClientLeft:
            self._fail("client disconnected before the engine answered", client_left=True)
            return
        except TimeoutError:
            # A hung engine would otherwise hold the client (and the request) forever.
            message = f"engine {replica}: no answer within {self._idle:g} s"
            self._fail(message, engine=into_room, silent=True)
            await t.error(504, message)(scope, receive, send)
            return
        except UpstreamError as exc:
            message = f"engine {replica}: {exc}"
            self._fail(message, engine=True)
            await t.error(502, message)(scope, receive, send)
            return
        if (why := no_answer(answer.status, answer.header(b"location"))) is not None:
            answer.close()
            message = f"engine {replica}: {why}"
            self._fail(message, engine=True)
            await t.error(502, message)(scope, receive, send)
            return
        if answer.status == 401:
            # The engine refused luftpause's own credentials (the client's never go
            # upstream): passed on, the client would take its own key for wrong
            # (helper-133).  Every turn there fails so: the engine's fault, toward
            # ejecting it.  Its body is the operator's to read (it may quote the key).
            said = await _head_of_body(answer)
            answer.close()
            message = credentials_refused(replica, said)
            self._fail(message, engine=True)
            await t.error(502, message)(scope, receive, send)
            return
        try:
            with leave:
                ok = await self._pump(
                    answer,
                    send,
                    hide_usage=body is t.usage_body,
                    replica=replica,
                    into_room=into_room,
                    disconnected=disconnected,
                )
        except ClientLeft:
            watch = self._watch
            if watch is not None and self._sent_end:
                # The client had the whole answer and closed before the engine's end of
                # response came (the OpenAI SDK stops reading at [DONE]): finished, its
                # usage and its tool calls read (helper-156: counted client_left).
                self._settle(watch, answer.status, sse=True, encoded=False)
                return
            self._fail("client disconnected mid-stream", client_left=True)
            return
        finally:
            answer.close()  # mid-stream: closes the connection, the engine stops
        if not ok:
            # The client got the chunks so far; returning without completing the
            # response makes the server close the connection (no [DONE] appended).
            return

    async def _pump(
        self,
        answer: UpstreamAnswer,
        send: Send,
        *,
        hide_usage: bool,
        replica: str,
        into_room: bool,
        disconnected: asyncio.Future[None] | None = None,
    ) -> bool:
        """Stream the engine's answer to the client; report its end.  False: the
        engine failed mid-stream.  `into_room`: as `_sent_into_room` said;
        `disconnected`: done once the client has left."""
        t = self._turn
        media = answer.header(b"content-type") or b""
        encoded = (answer.header(b"content-encoding") or b"identity").lower() != b"identity"
        sse = media.lower().startswith(b"text/event-stream")  # a media type has no case
        watch: StreamWatch
        if t.api == "chat":
            watch = StreamWatch(sse=sse, tools=t.tools)
        elif t.api == "messages":
            watch = MessagesWatch(sse=sse, input_counts_cached=self._kind(replica) == "sglang")
        else:
            watch = ResponsesWatch(sse=sse)
        if sse and not encoded and answer.status < 400:
            self._watch = watch  # what a client that leaves had read (see ClientLeft)
        hide = _AddedUsage() if hide_usage and sse and not encoded else None
        drop = dropped_upstream(answer.headers)
        # The body goes as it came unless usage is hidden: so does its length, where the
        # engine gave one (a JSON answer): an HTTP/1.0 client, which cannot read chunked
        # framing, gets the body and not its chunks (RFC 9112 6.1).
        if hide is None and answer.header(b"transfer-encoding") is None:
            drop = drop - {b"content-length"}
        headers = [(k, v) for k, v in answer.headers if k not in drop]
        headers.append((_RUN_HEADER_BYTES, t.run_id.encode("latin-1")))
        # Whose engine answered, for a sub-agent run's span (the worker sees only this).
        headers.append((_PROVIDER_HEADER_BYTES, _provider(self._kind(replica)).encode("latin-1")))
        self.started = True
        await send({"type": "http.response.start", "status": answer.status, "headers": headers})
        loop = asyncio.get_running_loop()
        idle, margin = self._idle, self._margin
        # The core times the turn out `idle` after it last heard it alive (its admission,
        # at first), at its next tick; the proxy, which knows why a turn is silent,
        # gives up `margin` before that, so that its report counts (the core ignores a
        # turn's end once it has timed the turn out, and would not eject a hung engine).
        # A watch every `alive_every` tells the core of progress since it last did:
        # data from the engine (keep-alive comments and blanks are none: an engine
        # that only pings is as stalled as a silent one), or a client taking its time
        # to read it (a slow client is not an idle engine), one write at most `idle`.
        alive_at = self._admitted
        last_data = alive_at  # a head is no data: engines send it before they start
        data = False  # any came
        sending_since: float | None = None  # blocked writing to the client since then
        watch_handle: asyncio.TimerHandle | None = None

        def report_alive() -> None:
            nonlocal alive_at
            alive_at = loop.time()
            self._shell.apply(TurnAlive(now=self._clock(), turn_id=t.turn_id))
            deadline = alive_at + idle - margin
            if sending_since is not None:  # a write the client takes as long to read
                deadline = min(deadline, sending_since + idle - margin)
            timer.reschedule(deadline)

        def watch_alive() -> None:
            nonlocal watch_handle
            if (last_data > alive_at or sending_since is not None) and not timer.expired():
                report_alive()
            watch_handle = loop.call_later(self._alive_every, watch_alive)

        chunk = b""
        progress = _Progress(sse and not encoded)  # (compressed bytes: all data)
        try:
            async with asyncio.timeout_at(alive_at + idle - margin) as timer:
                watch_handle = loop.call_later(self._alive_every, watch_alive)
                try:
                    while chunk := await answer.read():
                        now = loop.time()
                        if progress.carries(chunk):
                            last_data = now
                            if not data:
                                data = True
                                if answer.status < 400:  # an error's body is no first token
                                    started = TurnStarted(now=self._clock(), turn_id=t.turn_id)
                                    self._shell.apply(started)
                            if now - alive_at >= self._alive_every and not timer.expired():
                                # Data after a silence: told at once, not at the next
                                # watch, which may come after the deadline (helper-137).
                                report_alive()
                        if not encoded:
                            watch.feed(chunk)
                        if answer.complete:
                            break  # the rest has arrived too: this chunk ends the response
                        if hide is not None:
                            chunk = hide.filter(chunk)
                        if chunk:
                            sending_since = now
                            await send(
                                {"type": "http.response.body", "body": chunk, "more_body": True}
                            )
                            sending_since = None
                            if (
                                not self._sent_end
                                and watch.passed_end()
                                and (hide is None or watch._END_MARKER in chunk)
                            ):
                                # Its end is written to the client, not only read: one
                                # that leaves now had the whole answer (helper-158).
                                # A write to a client that left returns too, without
                                # writing (uvicorn): its disconnect is let in first
                                # (helper-159).
                                await asyncio.sleep(0)
                                self._sent_end = disconnected is None or not disconnected.done()
                            if alive_at > now:  # told during the write, whose limit
                                timer.reschedule(alive_at + idle - margin)  # lapses now
                    if hide is not None:
                        chunk = hide.filter(chunk, last=True)
                    # One write less per turn when the last chunk carries the end (often
                    # all of it).
                    self._complete = True  # the engine is done: a client leaving now is no matter
                    sending_since = loop.time()
                    await send({"type": "http.response.body", "body": chunk, "more_body": False})
                    sending_since = None
                finally:
                    watch_handle.cancel()
        except UpstreamError as exc:
            self._fail(f"engine failed mid-stream: {exc}", engine=True)
            self._remember(watch)
            return False
        except TimeoutError:
            if sending_since is not None and loop.time() - sending_since >= (idle - margin) / 2:
                # (A deadline is the client's only once a write has waited that long:
                # the watch keeps the engine's deadline past it while data flows.)
                self._fail(f"client read nothing for {idle:g} s", client_left=True)
            else:
                # Before any data, a stream the engine may hold in its queue (sent past
                # its room) is no fault of it, as no head is (`_sent_into_room`).
                self._fail(
                    f"engine stalled mid-stream: nothing for {idle:g} s",
                    engine=data or into_room,
                    silent=True,
                )
            self._remember(watch)
            return False
        self._settle(watch, answer.status, sse=sse, encoded=encoded)
        return True

    def _settle(self, watch: StreamWatch, status: int, *, sse: bool, encoded: bool) -> None:
        """Report the end of an answer that came whole, to its client at least."""
        t = self._turn
        if not encoded:
            watch.close()
        self._remember(watch)
        if status >= 400:
            self._fail(f"engine answered {status}", engine=engine_fault(status))
            return
        if watch.error is not None:
            engine = stream_error_is_engines(
                watch.error_status, watch.error_type, watch.error_first
            )
            self._fail(f"engine error in the stream: {watch.error}", engine=engine)
            return
        if watch.shapeless:
            self._fail(f"engine answered {status} without a JSON object", engine=True)
            return
        if (
            isinstance(watch, ResponsesWatch)
            and sse
            and not encoded
            and not (watch.ended or watch.overflowed)  # (one too long to read may end it)
        ):
            # Every Responses client takes it for a failure, and retries (Codex).
            self._fail("engine ended the stream before response.completed", engine=True)
            return
        if (
            sse
            and not encoded
            and not watch.overflowed
            and not isinstance(watch, ResponsesWatch)  # (its own end is read above)
            and watch.cut_short()
        ):
            # A chat or Messages stream ended cleanly with neither its finish reason nor
            # its end marker, both of which every engine sends: cut short, not finished
            # (helper-151).  Its run retries the turn where it was.
            self._fail("engine ended the stream before its end", engine=True)
            return
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

    def _remember(self, watch: StreamWatch) -> None:
        run = self._shell.state.runs.get(self._turn.run_id)
        if run is None or run.ended:
            return  # ended meanwhile (DELETE /v1/runs): its ids name nothing (helper-141)
        ids = watch.tool_call_ids
        if isinstance(watch, ResponsesWatch) and watch.response_id:
            ids = [*ids, response_key(watch.response_id)]
        if ids:
            self._shell.remember_tool_calls(
                self._turn.run_id, self._turn.caller, ids, self._clock()
            )


def response_key(response_id: str) -> str:
    """A Responses answer's id as the run memory keeps it beside call ids (a prefix no
    call id the engines make has)."""
    return f"response\x00{response_id}"


# --------------------------------------------------------------------------- tracing


# gen_ai.provider.name by endpoint kind where the name differs from the kind.
_PROVIDERS = {"llamacpp": "llama.cpp"}


def _provider(kind: str) -> str:
    """The `gen_ai.provider.name` of an engine of `kind`: its kind, or a well-known value
    where there is one (helper-169: a router's was "router", which is no provider).  On
    a turn's `chat` span, and on its answer (PROVIDER_HEADER) for a sub-agent's run."""
    return _PROVIDERS.get(kind, kind)


class _TurnTrace:
    """A turn's spans (GenAI semantic conventions): `chat {model}` (`chat` until it is
    admitted) from arrival to the end of the answer, and its child `admit` for the
    hold.  The chat span continues the client's `traceparent`; without a valid one, it
    is a child of its run's `invoke_agent` span (gateway/_runtrace.py).  Made only with
    tracing on; attributes are set in batches (the SDK locks and validates per call)."""

    __slots__ = (
        "_admit",
        "_arrived",
        "_chat",
        "_model",
        "_outcome",
        "_run_id",
        "_runs",
        "_under_run",
    )

    def __init__(
        self,
        tracer: Tracer,
        turn: TurnRequest,
        headers: list[tuple[bytes, bytes]],
        now: float,
        runs: RunSpans,
    ) -> None:
        parent = _client_context(headers)
        self._runs = runs
        self._under_run = False  # the chat span is a child of the run's invoke_agent span
        if parent is None or not get_current_span(parent).get_span_context().is_valid:
            parent = runs.turn_began(
                tracer, turn.run_id, turn.model, turn.caller, turn.service_class.value
            )
            self._under_run = True
        self._run_id = turn.run_id
        self._outcome: TurnOutcome = None
        attributes = {
            "luftpause.run_id": turn.run_id,
            "luftpause.class": turn.service_class.value,
            "luftpause.caller": turn.caller,
        }
        # Named for its model once admitted: a model the client names may be none
        # served, and span names stay few (helper-146; helper-147: a drain's 503s).
        self._model = turn.model
        self._chat: Span = tracer.start_span(
            "chat",
            parent,
            kind=SpanKind.CLIENT,
            attributes={
                "gen_ai.operation.name": "chat",
                "gen_ai.request.model": turn.model,
                # The class and caller are on `admit` only: each attribute costs ~8 µs
                # to export (OTLP encoding in Python), twice a turn.
                "luftpause.run_id": turn.run_id,
            },
        )
        self._admit: Span | None = tracer.start_span(
            "admit", set_span_in_context(self._chat), attributes=attributes
        )
        self._arrived = now

    def admitted(self, outcome: Admission | None, now: float) -> None:
        """The hold is over: admitted to a replica, rejected, or the client left."""
        admit, self._admit = self._admit, None
        if admit is None:
            return
        held = max(0.0, now - self._arrived)
        if isinstance(outcome, str):
            admit.set_attributes({"luftpause.held_seconds": held, "luftpause.replica": outcome})
            self._chat.update_name(f"chat {self._model}")
        elif isinstance(outcome, Rejected):
            self._outcome = outcome
            error = {"error.type": str(outcome.status)}
            admit.set_attributes({"luftpause.held_seconds": held, **error})
            admit.set_status(StatusCode.ERROR, outcome.message)
            self._chat.set_attributes(error)
            self._chat.set_status(StatusCode.ERROR, outcome.message)
        else:
            admit.set_attributes({"luftpause.held_seconds": held, "error.type": "client_left"})
        admit.end()

    def forwarding(self, replica: str, endpoint: Endpoint, kind: str) -> list[tuple[str, str]]:
        """Where the turn goes, and the `traceparent` header the engine continues;
        `kind`: the kind of engine that answers there (behind a router, its engines')."""
        # GenAI semconv's required attribute: the engine that answers.  The run's span
        # takes its first turn's (helper-191).
        provider = _provider(kind)
        self._chat.set_attributes(
            {
                "luftpause.replica": replica,
                "gen_ai.provider.name": provider,
                **_server(endpoint.url),
            }
        )
        if self._under_run:
            self._runs.forwarded(self._run_id, provider)
        carrier: dict[str, str] = {}
        telemetry.inject(carrier, set_span_in_context(self._chat))
        return list(carrier.items())

    def ended(self, event: Event) -> None:
        """The turn's terminal event: usage and finish reason, or what went wrong."""
        self._outcome = event
        chat = self._chat
        if isinstance(event, TurnFinished):
            usage: dict[str, int | tuple[str, ...]] = {}
            if event.prompt_tokens or event.completion_tokens:  # else none was sent
                usage["gen_ai.usage.input_tokens"] = event.prompt_tokens
                usage["gen_ai.usage.output_tokens"] = event.completion_tokens
            if event.cached_tokens:
                usage["gen_ai.usage.cache_read.input_tokens"] = event.cached_tokens
            if event.finish_reason:
                usage["gen_ai.response.finish_reasons"] = (event.finish_reason,)
            chat.set_attributes(usage)
        elif isinstance(event, TurnFailed):
            # (A client that left is named as on `admit`, not as the turn's failure.)
            chat.set_attribute("error.type", "client_left" if event.client_left else "turn_failed")
            chat.set_status(StatusCode.ERROR, event.reason)
        elif isinstance(event, TurnAbandoned):
            chat.set_attribute("error.type", "abandoned")
            chat.set_status(StatusCode.ERROR, "abandoned: the client left, or the gateway stopped")

    def close(self, run: RunState | None) -> None:
        """End the spans (the turn's response is over, however it ended); `run`: the
        core's view of the turn's run now, which says whether its invocation is over."""
        if self._admit is not None:  # cancelled while held
            self._admit.end()
            self._admit = None
        self._chat.end()
        if self._under_run:
            self._runs.turn_ended(self._run_id, self._outcome, run)
        else:  # in the caller's trace; it may still answer a run whose span is open
            self._runs.settle(self._run_id, self._outcome, run)


def _client_context(headers: list[tuple[bytes, bytes]]) -> Context | None:
    """The trace context a client's `traceparent` (and `tracestate`) carry, if any."""
    carrier = {
        k.decode("latin-1"): v.decode("latin-1")
        for k, v in headers
        if k == b"traceparent" or k == b"tracestate"
    }
    return telemetry.extract(carrier) if carrier else None


@functools.lru_cache(maxsize=256)
def _server(url: str) -> dict[str, str | int]:
    """`server.address` and `server.port` of an engine URL.  Bounded: with DNS
    discovery every pod address ever seen is a URL."""
    parts = urlsplit(url)
    server: dict[str, str | int] = {}
    if parts.hostname:
        server["server.address"] = parts.hostname
    # (The scheme's own when the URL names none: semconv asks for it beside the
    # address; helper-169: every hosted https endpoint had none.)
    port = parts.port or {"https": 443, "http": 80}.get(parts.scheme)
    if port:
        server["server.port"] = port
    return server
