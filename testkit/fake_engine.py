"""An OpenAI-compatible fake inference server backed by the simulated engine, in real time.

`create_app(settings)` builds the FastAPI app; `serve(settings, host=..., port=...)` runs it
under uvicorn (`luftpause fake-engine`).  Behind the HTTP API runs ONE `SimEngine`
(testkit.engine) driven by an asyncio task: virtual time = wall seconds since the app
started x `time_scale`.  A request becomes an `EngineRequest` (4 characters per token;
prompt blocks are chained hashes of 16-token blocks of the rendered conversation, so
identical prefixes share blocks and a growing conversation hits the cache); its reply is
streamed as the engine generates it, and a client that leaves cancels it in the engine.

With `instant=True` there is no simulation: replies are answered at once, from response
bytes cached per request body (the "engine that answers instantly" of the proxy-overhead
benchmark).

What a reply says is decided in `testkit._fake_text` (filler, tool calls, label logprobs).
Sampling fields (`temperature`, `stop`, `seed`, ...) are accepted and do not change it:
a reply is a function of the conversation alone.
`/metrics` speaks the flavor's Prometheus names (SGLang, vLLM or llama.cpp) and the
endpoints the peer routers probe (`/server_info`, `/get_load`, `/loads`, ...) answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import itertools
import json
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeGuard

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from testkit._fake_text import (
    CHARS_PER_TOKEN,
    DEFAULT_MAX_TOOL_CALLS,
    FillerPool,
    Reply,
    content_text,
    key,
    plan_reply,
    render_message,
)
from testkit.engine import EngineParams, EngineRequest, Finished, FirstToken, SimEngine

__all__ = ["CACHE_REPORTS", "FLAVORS", "FakeEngineSettings", "create_app", "serve"]

log = logging.getLogger(__name__)

Flavor = Literal["sglang", "vllm", "llamacpp"]
FLAVORS: tuple[Flavor, ...] = ("sglang", "vllm", "llamacpp")
CacheReport = Literal["always", "hits", "never"]
CACHE_REPORTS: tuple[CacheReport, ...] = ("always", "hits", "never")

DEFAULT_MAX_TOKENS = 256
# How often a waiting handler checks that its client is still there, and how often a
# stream looks for newly generated tokens (wall seconds).
_DISCONNECT_POLL_S = 0.05
_STREAM_POLL_S = 0.01
# A content chunk carries at most this many tokens.
_TOKENS_PER_CHUNK = 5
_INSTANT_CACHE_ENTRIES = 4096
_JSON = "application/json"
_SSE = "text/event-stream"
_PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"
# Instant responses are cached with this id and get a fresh one (same length) per request.
_ID_PLACEHOLDER = "chatcmpl-" + "0" * 24


_OPENAI_FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def _check_tool_names(tools: list[dict[str, Any]]) -> None:
    """OpenAI's check of function names, and its answer (`strict_tool_names`)."""
    for i, tool in enumerate(tools):
        name = tool["function"]["name"]
        if not _OPENAI_FUNCTION_NAME.fullmatch(name):
            raise _HTTPError(
                400,
                f"Invalid 'tools[{i}].function.name': string does not match pattern. "
                "Expected a string that matches the pattern '^[a-zA-Z0-9_-]{1,64}$'.",
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class FakeEngineSettings:
    """Configuration of one fake engine."""

    flavor: Flavor = "sglang"
    models: tuple[str, ...] = ("llama-3.2-1b",)
    # virtual seconds per wall second: 20 makes a 5 s generation take 0.25 s
    time_scale: float = 1.0
    # answer at once, no simulation
    instant: bool = False
    seed: int = 0
    # label set of /classify
    labels: tuple[str, ...] = ("negative", "positive")
    # a run makes 0..max_tool_calls tool calls when a request does not say
    # (`fake_max_tool_calls`), decided by its first user message
    max_tool_calls: int = DEFAULT_MAX_TOOL_CALLS
    engine: EngineParams = field(default_factory=EngineParams.reference)
    # Data-parallel ranks (SGLang --dp-size, vLLM --data-parallel-size): as many
    # simulated engines, each with its own KV cache.  A request goes to the rank its
    # X-Data-Parallel-Rank header names, else to the next in turn (SGLang's default
    # round robin); /metrics labels each rank's load (SGLang `dp_rank`, vLLM `engine`).
    dp_size: int = 1
    # Refuse a function name OpenAI refuses (^[a-zA-Z0-9_-]{1,64}$) with its 400, as a
    # hosted endpoint does; the open engines take any name.
    strict_tool_names: bool = False
    # When an answer says what the engine found cached of its prompt (Chat Completions'
    # usage.prompt_tokens_details.cached_tokens, and the flavor's Anthropic cache fields):
    # "always", 0 included, as llama.cpp's server does; "hits", only when it found some,
    # as SGLang with --enable-cache-report and vLLM with --enable-prompt-tokens-details
    # do; "never", as those two do without their flag (their default) and Ollama.
    # "always" by default, the fake's answer before the setting (and llama.cpp's), not
    # SGLang's or vLLM's default ("never"): the tests of the fake and of luftpause's
    # cache accounting read the figure, a miss's 0 among them.
    cache_report: CacheReport = "always"

    def __post_init__(self) -> None:
        if self.flavor not in FLAVORS:
            raise ValueError(f"flavor must be one of {FLAVORS}, got {self.flavor!r}")
        if not self.models:
            raise ValueError("at least one model name is needed")
        if not self.time_scale > 0 or math.isinf(self.time_scale):
            raise ValueError("time_scale must be a positive finite number")
        if not self.labels:
            raise ValueError("at least one label is needed")
        if not 1 <= self.dp_size <= 64:
            raise ValueError(f"dp_size must be 1 to 64, got {self.dp_size}")
        if self.max_tool_calls < 0:
            raise ValueError(f"max_tool_calls must be at least 0, got {self.max_tool_calls}")
        if self.cache_report not in CACHE_REPORTS:
            raise ValueError(
                f"cache_report must be one of {CACHE_REPORTS}, got {self.cache_report!r}"
            )


# --------------------------------------------------------------------------- engine driver


@dataclass(eq=False, slots=True)
class _Pending:
    first: asyncio.Future[int]  # the prompt's cached tokens, at the first token
    done: asyncio.Future[Finished]


class EngineStopped(Exception):
    """The engine's loop died (a bug): a request waiting on it is answered 503."""


class _Driver:
    """Runs the SimEngine in real time and wakes the handlers waiting on its outputs."""

    def __init__(self, params: EngineParams, time_scale: float) -> None:
        self.engine = SimEngine(params)
        self._scale = time_scale
        self._t0 = time.monotonic()
        self._wake = asyncio.Event()
        self._pending: dict[str, _Pending] = {}
        self._stopped_at: float | None = None  # the virtual time the clock stands at
        self.running = False

    def now(self) -> float:
        if self._stopped_at is not None:
            return self._stopped_at
        return (time.monotonic() - self._t0) * self._scale

    def stop(self) -> None:
        if self._stopped_at is None:
            self._stopped_at = self.now()

    def go(self) -> None:
        if self._stopped_at is not None:
            self._t0 = time.monotonic() - self._stopped_at / self._scale
            self._stopped_at = None
            self._wake.set()

    def submit(self, request: EngineRequest) -> _Pending:
        loop = asyncio.get_running_loop()
        pending = _Pending(loop.create_future(), loop.create_future())
        self.engine.submit(request, self.now())
        self._pending[request.request_id] = pending
        self._wake.set()
        return pending

    def cancel(self, request_id: str) -> None:
        """Stop a request whose client left (no-op once it finished)."""
        if self._pending.pop(request_id, None) is not None:
            self.engine.cancel(request_id, self.now())
            self._wake.set()

    def poll(self) -> None:
        """Bring the engine up to now and resolve the outputs."""
        for out in self.engine.advance(self.now()):
            pending = self._pending.get(out.request_id)
            if pending is None:
                continue
            if not pending.first.done():
                pending.first.set_result(out.cached_tokens)
            if isinstance(out, Finished):
                del self._pending[out.request_id]
                # A client that left cancels the future its handler waited on; the
                # handler's own cancel of the request may come after this.
                if not pending.done.done():
                    pending.done.set_result(out)
            else:
                assert isinstance(out, FirstToken)

    def start(self) -> asyncio.Task[None]:
        """Start the clock (virtual time 0) and the task that drives the engine."""
        self._t0 = time.monotonic()
        self.running = True
        return asyncio.create_task(self._run(), name="fake-engine")

    async def _run(self) -> None:
        try:
            while True:
                self._wake.clear()
                self.poll()
                t = self.engine.next_event_time()
                if t is None or self._stopped_at is not None:
                    await self._wake.wait()
                    continue
                delay = (t - self.now()) / self._scale
                if delay <= 0:
                    await asyncio.sleep(0)
                    continue
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._wake.wait()
        except Exception:
            log.exception("the engine's loop died; the engine answers 503 from now on")
        finally:
            self.running = False
            for pending in self._pending.values():  # none is ever answered otherwise
                for future in (pending.first, pending.done):
                    if not future.done():
                        future.set_exception(EngineStopped())
                        future.exception()  # seen: no "never retrieved" warning
            self._pending.clear()


class EngineClock:
    """The virtual clock of a served fake engine (`app.state.clock`), for tests that must
    look at a state which, in wall time, lasts only as long as one decode.

    `stop()` stands the clock still: requests are still accepted, queued and admitted to
    the running batch, and the metrics report them, but no prefill or decode progresses
    until `go()`, from where the clock resumes without a jump."""

    def __init__(self, drivers: list[_Driver]) -> None:
        self._drivers = drivers

    def stop(self) -> None:
        for d in self._drivers:
            d.stop()

    def go(self) -> None:
        for d in self._drivers:
            d.go()


# --------------------------------------------------------------------------- requests


class _HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _error(status: int, message: str) -> Response:
    return Response(json.dumps({"error": {"message": message}}), status, media_type=_JSON)


def _json(payload: object) -> Response:
    return Response(json.dumps(payload), media_type=_JSON)


@dataclass(frozen=True, slots=True)
class _Chat:
    model: str
    messages: list[dict[str, Any]]
    stream: bool
    include_usage: bool
    max_tokens: int
    logprobs: bool
    top_logprobs: int
    tools: list[dict[str, Any]]
    max_tool_calls: int
    parallel_tool_calls: bool
    priority: int
    # "auto", "none", "required", or the one function's name a named choice forces
    tool_choice: str = "auto"
    forced: str | None = None


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _HTTPError(400, f"invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise _HTTPError(400, "the request body must be a JSON object")
    return body


def _check_json(request: Request) -> None:
    """Refuse a body not sent as JSON, as vLLM does on these routes and SGLang on chat
    completions (their `validate_json_request`: the media type before any `;`,
    lowercased, must be application/json; a charset passes).  Both answer 400 (a
    validation error, whose message FastAPI wraps in a line of its own).  Checked on
    all three routes whatever the flavor, stricter than some engines: this fake would
    otherwise hide a client that sends its JSON under another media type, or none."""
    media = request.headers.get("content-type", "").lower().split(";", 1)[0]
    if media != "application/json":
        raise _HTTPError(400, "Unsupported Media Type: Only 'application/json' is allowed")


def _parse_model(body: dict[str, Any], models: tuple[str, ...]) -> str:
    model = body.get("model", models[0])
    if model is None:
        return models[0]
    if not isinstance(model, str) or model not in models:
        raise _HTTPError(404, f"model {model!r} not found")
    return model


def _parse_chat(
    body: dict[str, Any],
    models: tuple[str, ...],
    max_tool_calls: int = DEFAULT_MAX_TOOL_CALLS,
    flavor: str = "sglang",
) -> _Chat:
    """Validate a chat completion request; unknown fields are ignored (routers add some).
    `stream_options` without `include_usage` asks for usage of vLLM (its default)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _HTTPError(400, "'messages' must be a non-empty list of message objects")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise _HTTPError(400, f"messages[{i}] must be an object with a string 'role'")
    model = _parse_model(body, models)
    # As vLLM and SGLang: max_completion_tokens, else max_tokens (a null is not given).
    field = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    max_tokens = body.get(field)
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    elif not _is_int(max_tokens) or max_tokens < 1:
        raise _HTTPError(400, f"{field!r} must be a positive integer")
    if body.get("n") not in (None, 1):  # not silently one choice where n were asked
        raise _HTTPError(400, "'n': the fake engine makes one choice (n = 1)")
    top = body.get("top_logprobs")
    if top is None:
        top = 0
    elif not _is_int(top) or not 0 <= top <= 20:
        raise _HTTPError(400, "'top_logprobs' must be an integer from 0 to 20")
    tools = body.get("tools")
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise _HTTPError(400, "'tools' must be a list")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _HTTPError(400, f"tools[{i}] must have a 'function' with a string 'name'")
    choice, forced = _parse_tool_choice(body.get("tool_choice"), tools)
    n_calls = body.get("fake_max_tool_calls")
    if not _is_int(n_calls) or n_calls < 0:
        n_calls = max_tool_calls
    options = body.get("stream_options")
    priority = body.get("priority")
    return _Chat(
        model=model,
        messages=messages,
        stream=body.get("stream") is True,
        include_usage=isinstance(options, dict)
        and options.get("include_usage", flavor == "vllm") is True,
        max_tokens=max_tokens,
        logprobs=body.get("logprobs") is True,
        top_logprobs=top,
        tools=tools,
        max_tool_calls=n_calls,
        parallel_tool_calls=body.get("parallel_tool_calls") is True,
        priority=priority if _is_int(priority) else 0,
        tool_choice=choice,
        forced=forced,
    )


def _parse_tool_choice(value: object, tools: list[dict[str, Any]]) -> tuple[str, str | None]:
    """OpenAI's `tool_choice`: "auto" (the default), "none", "required", or
    {"type": "function", "function": {"name": ...}}, which must name an offered tool (as
    vLLM checks)."""
    if value is None or value in ("auto", "none", "required"):
        choice = "auto" if value is None else str(value)
        if choice == "required" and not tools:
            raise _HTTPError(400, "tool_choice 'required' needs 'tools'")
        return choice, None
    fn = value.get("function") if isinstance(value, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(name, str):
        raise _HTTPError(
            400,
            "'tool_choice' must be 'auto', 'none', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
        )
    if all(t["function"]["name"] != name for t in tools):
        raise _HTTPError(400, f"tool_choice names {name!r}, which is not in 'tools'")
    return "required", name


def _from_anthropic(body: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic Messages request as the chat request the engine runs, the way vLLM,
    SGLang and llama.cpp convert it: `system` first, tool_use blocks as an assistant's
    tool_calls, tool_result blocks as `tool` messages."""
    messages: list[dict[str, Any]] = []
    system = content_text(body.get("system"))
    if system:
        messages.append({"role": "system", "content": system})
    given = body.get("messages")
    if not isinstance(given, list) or not given:
        raise _HTTPError(400, "messages: Field required (a non-empty list)")
    for i, m in enumerate(given):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise _HTTPError(400, f"messages.{i}.role: Input should be 'user' or 'assistant'")
        content = m.get("content")
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise _HTTPError(400, f"messages.{i}.content: Input should be a string or a list")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for block in content:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(str(block.get("text", "")))
            elif kind == "tool_use":
                args = json.dumps(block.get("input", {}))
                fn = {"name": block.get("name"), "arguments": args}
                calls.append({"id": block.get("id"), "type": "function", "function": fn})
            elif kind == "tool_result":
                result = content_text(block.get("content", ""))
                messages.append(
                    {"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": result}
                )
        if texts or calls:
            message: dict[str, Any] = {"role": role, "content": "".join(texts)}
            if calls:
                message["tool_calls"] = calls
            messages.append(message)
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise _HTTPError(400, "tools: Input should be a list")
    choice = body.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else None
    name = choice.get("name") if isinstance(choice, dict) else None
    chat_choice: object = {"auto": "auto", "any": "required", "none": "none"}.get(str(kind))
    if kind == "tool":
        chat_choice = {"type": "function", "function": {"name": name}}
    elif choice is not None and chat_choice is None:
        raise _HTTPError(400, "tool_choice: expected an object with type auto, any, tool or none")
    return {
        **{k: body[k] for k in ("model", "max_tokens", "fake_max_tool_calls") if k in body},
        **({"tool_choice": chat_choice} if choice is not None else {}),
        "stream": body.get("stream") is True,
        "messages": messages,
        "tools": [
            {
                "type": "function",
                "function": {"name": t.get("name"), "parameters": t.get("input_schema", {})},
            }
            for t in tools or ()
            if isinstance(t, dict)
        ],
    }


def _from_responses(body: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI Responses request as the chat request the engine runs, as vLLM and
    llama.cpp convert it: `instructions` first, `function_call` items as an assistant's
    tool_calls, `function_call_output` items as `tool` messages (stateless: no
    previous_response_id)."""
    if body.get("previous_response_id") is not None:
        raise _HTTPError(400, "previous_response_id is not supported (the engine keeps no state)")
    messages: list[dict[str, Any]] = []
    if isinstance(body.get("instructions"), str) and body["instructions"]:
        messages.append({"role": "system", "content": body["instructions"]})
    given = body.get("input")
    if isinstance(given, str):
        given = [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise _HTTPError(400, "input: a non-empty string or list of items is required")
    for i, item in enumerate(given):
        if not isinstance(item, dict):
            raise _HTTPError(400, f"input[{i}]: expected an object")
        kind = item.get("type", "message")
        if kind == "message":
            texts = content_text(item.get("content"))  # a string, or parts with "text"
            messages.append({"role": item.get("role", "user"), "content": texts})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant message
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    "content": output if isinstance(output, str) else json.dumps(output),
                }
            )
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise _HTTPError(400, "tools: Input should be a list")
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":  # its flat form
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    chat: dict[str, Any] = {
        **{k: body[k] for k in ("model", "fake_max_tool_calls") if k in body},
        **({"tool_choice": choice} if choice is not None else {}),
        "stream": body.get("stream") is True,
        "messages": messages,
        "parallel_tool_calls": body.get("parallel_tool_calls") is True,
        "tools": [
            {
                "type": "function",
                "function": {"name": t.get("name"), "parameters": t.get("parameters", {})},
            }
            for t in tools or ()
            if isinstance(t, dict) and t.get("type") == "function"
        ],
    }
    if "max_output_tokens" in body:
        chat["max_tokens"] = body["max_output_tokens"]
    return chat


# --------------------------------------------------------------------------- responses


def _said(report: str, cached: int, flavor: str = "", api: str = "chat") -> int | None:
    """The cached tokens an answer of `api` states under `report`
    (FakeEngineSettings.cache_report); None: it leaves them out.  The Responses API is
    another matter (helper-193): vLLM's states them always, its flag not asked, and
    SGLang's says 0 of what it does not state."""
    if api == "responses" and flavor == "vllm":
        return cached
    if report == "never" or (report == "hits" and cached == 0):
        return 0 if api == "responses" and flavor == "sglang" else None
    return cached


def _usage(prompt: int, completion: int, cached: int | None) -> dict[str, Any]:
    """Chat Completions usage; `cached` None: no prompt_tokens_details (null, as SGLang's
    and vLLM's UsageInfo serialize an unset one)."""
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": None if cached is None else {"cached_tokens": cached},
    }


def _cached(usage: dict[str, Any]) -> int | None:
    """What `usage` (from `_usage`) says was cached; None: it says nothing."""
    details = usage["prompt_tokens_details"]
    return None if details is None else int(details["cached_tokens"])


def _completion_body(
    rid: str, created: int, chat: _Chat, reply: Reply, conv: int, usage: dict[str, Any]
) -> bytes:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = list(reply.tool_calls)
    logprobs = None
    if chat.logprobs:
        logprobs = {"content": reply.logprobs(0, len(reply.tokens), chat.top_logprobs, conv)}
    payload = {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": chat.model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": reply.finish_reason,
            }
        ],
        "usage": usage,
    }
    return json.dumps(payload).encode()


class _Chunks:
    """`data: {chat.completion.chunk}` events of one stream."""

    def __init__(self, rid: str, created: int, chat: _Chat, reply: Reply, conv: int) -> None:
        head = {"id": rid, "object": "chat.completion.chunk", "created": created}
        self._head = json.dumps({**head, "model": chat.model})[:-1]
        self._chat, self._reply, self._conv = chat, reply, conv

    def _event(
        self, delta: dict[str, Any], logprobs: object = None, finish: str | None = None
    ) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return f'data: {self._head}, "choices": [{json.dumps(choice)}]}}\n\n'

    def role(self, cached: int | None = 0) -> str:
        return self._event({"role": "assistant", "content": ""})

    def content(self, start: int, stop: int) -> str:
        """Events for text tokens [start, stop), at most _TOKENS_PER_CHUNK tokens each."""
        reply, chat, parts = self._reply, self._chat, []
        for a in range(start, stop, _TOKENS_PER_CHUNK):
            b = min(a + _TOKENS_PER_CHUNK, stop)
            lp = None
            if chat.logprobs:
                lp = {"content": reply.logprobs(a, b, chat.top_logprobs, self._conv)}
            parts.append(self._event({"content": "".join(reply.tokens[a:b])}, lp))
        return "".join(parts)

    def tool_calls(self, part: int) -> str:
        """Part 0: each call's id and name; part 1: each call's arguments (as engines do)."""
        events = []
        for i, call in enumerate(self._reply.tool_calls):
            fn = call["function"]
            if part == 0:
                head = {"name": fn["name"], "arguments": ""}
                delta = {"index": i, "id": call["id"], "type": "function", "function": head}
            else:
                delta = {"index": i, "function": {"arguments": fn["arguments"]}}
            events.append(self._event({"tool_calls": [delta]}))
        return "".join(events)

    def end(self, usage: dict[str, Any]) -> str:
        tail = self._event({}, None, self._reply.finish_reason)
        if self._chat.include_usage:
            tail += f'data: {self._head}, "choices": [], "usage": {json.dumps(usage)}}}\n\n'
        return tail + "data: [DONE]\n\n"


_STOP_REASONS = {"tool_calls": "tool_use", "stop": "end_turn", "length": "max_tokens"}


class _AnthropicEvents:
    """The events of one Anthropic Messages stream, with the same steps as `_Chunks`.
    Usage goes where each flavor puts it: llama.cpp and SGLang (since 0.5.19, the
    version deploy/ runs: its PRs #25876, #29703) in `message_start`, net of the cache,
    with `cache_read_input_tokens` (SGLang's only when above 0); vLLM in both: in
    `message_start` the whole prompt (its cache hit not known yet, no cache fields), in
    the last `message_delta` net of the cache with `cache_read_input_tokens`, as since
    its PR #40912 (with --enable-prompt-tokens-details; before, no cache figure at
    all).  An answer that states no cached tokens (FakeEngineSettings.cache_report)
    leaves the cache fields out and counts the whole prompt."""

    def __init__(self, rid: str, chat: _Chat, reply: Reply, flavor: str, prompt: int) -> None:
        self._rid, self._chat, self._reply = rid, chat, reply
        self._flavor, self._prompt = flavor, prompt

    @staticmethod
    def _event(kind: str, payload: dict[str, Any]) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload})}\n\n"

    def role(self, cached: int | None = 0) -> str:
        usage: dict[str, Any] = {"input_tokens": self._prompt - (cached or 0), "output_tokens": 0}
        if self._flavor == "vllm" or cached is None or (self._flavor == "sglang" and not cached):
            usage = {"input_tokens": self._prompt, "output_tokens": 0}
        else:
            usage["cache_read_input_tokens"] = cached
        message: dict[str, Any] = {
            "id": self._rid,
            "type": "message",
            "role": "assistant",
            "model": self._chat.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }
        head = self._event("message_start", {"message": message})
        if self._reply.tool_calls:
            return head
        block = {"index": 0, "content_block": {"type": "text", "text": ""}}
        return head + self._event("content_block_start", block)

    def content(self, start: int, stop: int) -> str:
        parts = []
        for a in range(start, stop, _TOKENS_PER_CHUNK):
            text = "".join(self._reply.tokens[a : min(a + _TOKENS_PER_CHUNK, stop)])
            delta = {"index": 0, "delta": {"type": "text_delta", "text": text}}
            parts.append(self._event("content_block_delta", delta))
        return "".join(parts)

    def tool_calls(self, part: int) -> str:
        """Part 0: the first call's block start; part 1: the rest of every call."""
        events = []
        for i, call in enumerate(self._reply.tool_calls):
            fn = call["function"]
            if part == 0 or i > 0:
                use = {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": {}}
                events.append(
                    self._event("content_block_start", {"index": i, "content_block": use})
                )
            if part == 1:
                delta = {"type": "input_json_delta", "partial_json": fn["arguments"]}
                events.append(self._event("content_block_delta", {"index": i, "delta": delta}))
                events.append(self._event("content_block_stop", {"index": i}))
            if part == 0:
                break
        return "".join(events)

    def end(self, usage: dict[str, Any]) -> str:
        cached = _cached(usage)
        tail = {"output_tokens": usage["completion_tokens"]}
        if self._flavor == "vllm" and cached is None:
            tail |= {"input_tokens": usage["prompt_tokens"]}
        elif self._flavor == "vllm":
            tail |= {
                "input_tokens": usage["prompt_tokens"] - cached,
                "cache_read_input_tokens": cached,
                "cache_creation_input_tokens": 0,
            }
        reason = _STOP_REASONS.get(self._reply.finish_reason, "end_turn")
        delta = {"delta": {"stop_reason": reason, "stop_sequence": None}, "usage": tail}
        stop = "" if self._reply.tool_calls else self._event("content_block_stop", {"index": 0})
        return stop + self._event("message_delta", delta) + self._event("message_stop", {})

    def body(self, usage: dict[str, Any]) -> bytes:
        """The whole answer as one JSON message (a request without `stream`)."""
        content: list[dict[str, Any]] = [
            {
                "type": "tool_use",
                "id": c["id"],
                "name": c["function"]["name"],
                "input": json.loads(c["function"]["arguments"]),
            }
            for c in self._reply.tool_calls
        ]
        if not content:
            content = [{"type": "text", "text": self._reply.content}]
        cached = _cached(usage)
        prompt = usage["prompt_tokens"]
        counts: dict[str, Any] = {
            "input_tokens": prompt,
            "output_tokens": usage["completion_tokens"],
        }
        if cached is not None and (cached or self._flavor != "sglang"):
            counts |= {"input_tokens": prompt - cached, "cache_read_input_tokens": cached}
        message = {
            "id": self._rid,
            "type": "message",
            "role": "assistant",
            "model": self._chat.model,
            "content": content,
            "stop_reason": _STOP_REASONS.get(self._reply.finish_reason, "end_turn"),
            "stop_sequence": None,
            "usage": counts,
        }
        return json.dumps(message).encode()


class _ResponseEvents:
    """The events of one OpenAI Responses stream, with the same steps as `_Chunks`:
    `response.created`, the output items as they are generated, then
    `response.completed` (or `.incomplete` when max_output_tokens cut it) carrying the
    whole response with its usage."""

    def __init__(self, rid: str, chat: _Chat, reply: Reply, flavor: str) -> None:
        self._rid, self._chat, self._reply, self._flavor = rid, chat, reply, flavor
        self._seq = itertools.count()
        self._msg = "msg_" + rid[5:]

    def _event(self, kind: str, payload: dict[str, Any]) -> str:
        data = {"type": kind, "sequence_number": next(self._seq), **payload}
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def _calls(self) -> list[dict[str, Any]]:
        return [
            {
                "id": "fc_" + c["id"],
                "type": "function_call",
                "status": "completed",
                "call_id": c["id"],
                "name": c["function"]["name"],
                "arguments": c["function"]["arguments"],
            }
            for c in self._reply.tool_calls
        ]

    def response(self, usage: dict[str, Any] | None) -> dict[str, Any]:
        """The response object; with `usage` the finished one."""
        cut = self._reply.finish_reason == "length"
        body: dict[str, Any] = {
            "id": self._rid,
            "object": "response",
            "created_at": int(time.time()),
            "model": self._chat.model,
            "status": "in_progress",
            "output": [],
            "error": None,
            "incomplete_details": None,
            "usage": None,
        }
        if usage is None:
            return body
        output = self._calls() or [self._message(self._reply.content or "")]
        details = usage["prompt_tokens_details"]
        if details is not None and self._flavor == "sglang":
            details = {**details, "cache_write_tokens": 0}  # as SGLang's usage says it
        body |= {
            "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "output": output,
            "usage": {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": details,
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"],
            },
        }
        return body

    def body(self, usage: dict[str, Any]) -> bytes:
        """The whole answer as one JSON response (a request without `stream`)."""
        return json.dumps(self.response(usage)).encode()

    def _message(self, text: str) -> dict[str, Any]:
        part = {"type": "output_text", "text": text, "annotations": []}
        return {
            "id": self._msg,
            "type": "message",
            "status": "completed",
            "role": "assistant",
            "content": [part],
        }

    def role(self, cached: int | None = 0) -> str:
        head = self._event("response.created", {"response": self.response(None)})
        if self._reply.tool_calls:
            return head
        item = self._message("") | {"status": "in_progress", "content": []}
        head += self._event("response.output_item.added", {"output_index": 0, "item": item})
        part = {"type": "output_text", "text": "", "annotations": []}
        where = {"item_id": self._msg, "output_index": 0, "content_index": 0}
        return head + self._event("response.content_part.added", where | {"part": part})

    def content(self, start: int, stop: int) -> str:
        where = {"item_id": self._msg, "output_index": 0, "content_index": 0}
        return "".join(
            self._event(
                "response.output_text.delta",
                where
                | {"delta": "".join(self._reply.tokens[a : min(a + _TOKENS_PER_CHUNK, stop)])},
            )
            for a in range(start, stop, _TOKENS_PER_CHUNK)
        )

    def tool_calls(self, part: int) -> str:
        """Part 0: each call's item; part 1: its arguments, and the item done."""
        events = []
        for i, call in enumerate(self._calls()):
            if part == 0:
                item = call | {"status": "in_progress", "arguments": ""}
                events.append(
                    self._event("response.output_item.added", {"output_index": i, "item": item})
                )
                continue
            where = {"item_id": call["id"], "output_index": i}
            args = call["arguments"]
            events.append(
                self._event("response.function_call_arguments.delta", where | {"delta": args})
            )
            events.append(
                self._event("response.function_call_arguments.done", where | {"arguments": args})
            )
            events.append(
                self._event("response.output_item.done", {"output_index": i, "item": call})
            )
        return "".join(events)

    def end(self, usage: dict[str, Any]) -> str:
        final = self.response(usage)
        tail = ""
        if not self._reply.tool_calls:
            where = {"item_id": self._msg, "output_index": 0, "content_index": 0}
            text = self._reply.content or ""
            tail += self._event("response.output_text.done", where | {"text": text})
            part = final["output"][0]["content"][0]
            tail += self._event("response.content_part.done", where | {"part": part})
            item = final["output"][0]
            tail += self._event("response.output_item.done", {"output_index": 0, "item": item})
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return tail + self._event(kind, {"response": final})


def _anthropic_error(status: int, message: str) -> Response:
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return Response(json.dumps(body), status, media_type=_JSON)


# --------------------------------------------------------------------------- metrics

# (metric suffix, EngineMetrics field, help) per flavor
_METRICS: dict[str, tuple[tuple[str, str, str], ...]] = {
    "sglang": (
        ("num_running_reqs", "running", "The number of running requests."),
        ("num_queue_reqs", "queued", "The number of requests in the waiting queue."),
        ("token_usage", "token_usage", "The token usage of the KV pool."),
        ("cache_hit_rate", "cache_hit_rate", "The prefix cache hit rate."),
    ),
    "vllm": (
        ("num_requests_running", "running", "Number of requests in model execution batches."),
        ("num_requests_waiting", "queued", "Number of requests waiting to be processed."),
        # (vLLM's name since 0.10; gpu_cache_usage_perc before, removed since)
        ("kv_cache_usage_perc", "token_usage", "KV-cache usage. 1 means 100 percent usage."),
    ),
    "llamacpp": (
        ("requests_processing", "running", "Number of requests processing."),
        ("requests_deferred", "queued", "Number of requests deferred."),
        ("kv_cache_usage_ratio", "token_usage", "KV-cache usage. 1 means 100 percent usage."),
    ),
}


# The label a data-parallel server's metrics tell its ranks apart by.
_RANK_LABEL = {"sglang": "dp_rank", "vllm": "engine", "llamacpp": "rank"}


def _metrics_text(flavor: str, model: str, ranks: list[dict[str, float]]) -> str:
    """The gauges; one sample per rank, labelled by rank when there are several."""
    label = json.dumps(model)
    lines = []
    for suffix, field_name, help_text in _METRICS[flavor]:
        name = f"{flavor}:{suffix}"
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        for rank, values in enumerate(ranks):
            # vLLM labels its engine even when it has one
            by_rank = (
                f',{_RANK_LABEL[flavor]}="{rank}"' if len(ranks) > 1 or flavor == "vllm" else ""
            )
            lines.append(f"{name}{{model_name={label}{by_rank}}} {float(values[field_name])}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the app


def _prompt_blocks(text: str, block_chars: int) -> tuple[list[int], int]:
    """Chained block ids of `text`, and the chain value before its last block."""
    ids: list[int] = []
    prev = 0
    for i in range(0, len(text), block_chars):
        prev = hash((prev, text[i : i + block_chars]))
        ids.append(prev)
    return ids, (ids[-2] if len(ids) > 1 else 0)


def create_app(settings: FakeEngineSettings) -> FastAPI:
    """Build the fake engine's app; its simulated engine starts with the app's lifespan."""
    s = settings
    params = s.engine
    block_chars = params.block_tokens * CHARS_PER_TOKEN
    drivers = [] if s.instant else [_Driver(params, s.time_scale) for _ in range(s.dp_size)]
    turn_order = itertools.count()  # round robin over the ranks, for requests naming none
    pool = FillerPool(s.seed)
    ids = itertools.count(1)
    instant_cache: dict[bytes, tuple[bytes, str]] = {}
    # Owned by the engine, as each names itself there (SMG tells SGLang from vLLM by it:
    # "fake" made it take an SGLang for vLLM, helper-189).
    served = [{"id": m, "object": "model", "created": 0, "owned_by": s.flavor} for m in s.models]

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tasks = [d.start() for d in drivers]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    app = FastAPI(title=f"fake {s.flavor} engine", lifespan=lifespan)
    app.state.clock = EngineClock(drivers)

    @app.exception_handler(EngineStopped)
    async def stopped(request: Request, exc: EngineStopped) -> Response:
        return _error(503, "the engine is not running")

    def rank_values() -> list[dict[str, float]]:
        """Each rank's gauges, and the prompt tokens of its waiting requests."""
        if not drivers:  # instant: every rank idle, as many as there are
            idle = {"running": 0, "queued": 0, "token_usage": 0.0, "cache_hit_rate": 0.0}
            return [idle | {"queued_tokens": 0} for _ in range(s.dp_size)]
        out = []
        for d in drivers:
            if d.running:
                d.poll()
            m = d.engine.metrics()
            out.append(
                {
                    "running": m.running,
                    "queued": m.queued,
                    "token_usage": m.token_usage,
                    "cache_hit_rate": m.cache_hit_rate,
                    "queued_tokens": d.engine.queued_tokens(),
                }
            )
        return out

    def rank_loads() -> list[dict[str, Any]]:
        """Each rank's load as SGLang's /v1/loads reports it (its `core` section; a
        throughput the simulation does not know is left out, not said to be 0): the KV
        tokens its running requests hold, and in all the waiting prompts' tokens too."""
        ranks = []
        for rank, v in enumerate(rank_values()):
            used = round(v["token_usage"] * params.kv_pool_tokens)
            ranks.append(
                {
                    "dp_rank": rank,
                    "num_running_reqs": int(v["running"]),
                    "num_waiting_reqs": int(v["queued"]),
                    "num_used_tokens": used,
                    "num_total_tokens": used + int(v["queued_tokens"]),
                    "max_total_num_tokens": params.kv_pool_tokens,
                    "token_usage": round(v["token_usage"], 4),
                    "cache_hit_rate": round(v["cache_hit_rate"], 4),
                    "max_running_requests": params.max_running_requests,
                }
            )
        return ranks

    def rank_of(request: Request) -> _Driver:
        """The rank a request goes to: its X-Data-Parallel-Rank, else the next in turn.
        A value that is no rank of this server is a 400, as SGLang answers it."""
        assert drivers
        given = request.headers.get("x-data-parallel-rank")
        if given is None:
            return drivers[next(turn_order) % len(drivers)]
        if not re.fullmatch(r" *[0-9]+ *", given) or int(given) >= len(drivers):
            raise _HTTPError(
                400, f"X-Data-Parallel-Rank must be a rank 0 to {len(drivers) - 1}: {given!r}"
            )
        return drivers[int(given)]

    def plan(chat: _Chat) -> tuple[str, int, Reply]:
        text = "".join(render_message(m) for m in chat.messages)
        if chat.tools:
            text = json.dumps(chat.tools, sort_keys=True) + text
        conv = key(s.seed, text)
        reply = plan_reply(
            seed=s.seed,
            pool=pool,
            conv=conv,
            messages=chat.messages,
            tools=chat.tools,
            max_tool_calls=chat.max_tool_calls,
            max_tokens=chat.max_tokens,
            parallel=chat.parallel_tool_calls,
            tool_choice=chat.tool_choice,
            forced=chat.forced,
        )
        return text, conv, reply

    def new_id() -> str:
        return f"chatcmpl-{next(ids):024x}"

    def instant_reply(raw: bytes, chat: _Chat) -> Response:
        hit = instant_cache.get(raw)
        if hit is None:
            text, conv, reply = plan(chat)
            prompt = max(1, -(-len(text) // CHARS_PER_TOKEN))
            usage = _usage(prompt, reply.n_tokens, said(0))
            created = int(time.time())
            if chat.stream:
                chunks = _Chunks(_ID_PLACEHOLDER, created, chat, reply, conv)
                events = chunks.role()
                if reply.tool_calls:
                    events += chunks.tool_calls(0) + chunks.tool_calls(1)
                else:
                    events += chunks.content(0, len(reply.tokens))
                hit = ((events + chunks.end(usage)).encode(), _SSE)
            else:
                hit = (_completion_body(_ID_PLACEHOLDER, created, chat, reply, conv, usage), _JSON)
            if len(instant_cache) >= _INSTANT_CACHE_ENTRIES:
                instant_cache.clear()
            instant_cache[raw] = hit
        body, media = hit
        return Response(body.replace(_ID_PLACEHOLDER.encode(), new_id().encode()), media_type=media)

    def engine_request(chat: _Chat, text: str, reply: Reply, rid: str) -> EngineRequest:
        blocks, before_last = _prompt_blocks(text, block_chars)
        prompt = max(1, -(-len(text) // CHARS_PER_TOKEN))
        room = params.kv_pool_tokens - len(blocks) * params.block_tokens
        if room < 1:
            raise _HTTPError(
                400,
                f"the prompt ({prompt} tokens) does not fit the KV pool "
                f"({params.kv_pool_tokens} tokens)",
            )
        max_new = min(chat.max_tokens, room)
        # The reply's blocks continue the chain over the conversation as the client will
        # send it back, so the next turn also finds this turn's reply in the cache.
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if reply.tool_calls:
            message["tool_calls"] = list(reply.tool_calls)
        grown = text + render_message(message)
        start = len(blocks) - (len(text) % block_chars != 0)
        prev = blocks[start - 1] if start == len(blocks) else before_last
        out_blocks: list[int] = []
        for i in range(start * block_chars, len(grown), block_chars):
            prev = hash((prev, grown[i : i + block_chars]))
            out_blocks.append(prev)
        return EngineRequest(
            request_id=rid,
            prompt_blocks=tuple(blocks),
            prompt_tokens=prompt,
            output_tokens=max(1, min(reply.n_tokens, max_new)),
            max_new_tokens=max_new,
            output_blocks=tuple(out_blocks),
            # The engine serves the highest first, as SGLang; vLLM the lowest.
            priority=-chat.priority if s.flavor == "vllm" else chat.priority,
        )

    def said(cached: int, api: str = "chat") -> int | None:
        return _said(s.cache_report, cached, s.flavor, api)

    def usage_of(done: Finished, api: str = "chat") -> dict[str, Any]:
        return _usage(done.prompt_tokens, done.completion_tokens, said(done.cached_tokens, api))

    async def client_stayed(request: Request, fut: asyncio.Future[Any]) -> bool:
        """Wait for `fut`; False if the client disconnected first."""
        while not fut.done():
            await asyncio.wait((fut,), timeout=_DISCONNECT_POLL_S)
            if not fut.done() and await request.is_disconnected():
                return False
        return True

    async def finished(
        request: Request, d: _Driver, rid: str, pending: _Pending
    ) -> Finished | None:
        """The request's end, for a reply sent whole; None if the client left first (the
        engine stops the request either way)."""
        try:
            if not await client_stayed(request, pending.done):
                return None
            return pending.done.result()
        finally:
            d.cancel(rid)

    async def stream(
        d: _Driver,
        pending: _Pending,
        rid: str,
        chunks: _Chunks | _AnthropicEvents | _ResponseEvents,
        reply: Reply,
        api: str = "chat",
    ) -> AsyncIterator[str]:
        # Starlette cancels this generator when the client leaves: `finally` cancels the
        # request in the engine.
        try:
            cached = said(await pending.first, api)
            yield chunks.role(cached)
            if reply.tool_calls:
                yield chunks.tool_calls(0)
                done = await asyncio.shield(pending.done)
                yield chunks.tool_calls(1)
            else:
                sent, total = 0, len(reply.tokens)
                while True:
                    if pending.done.done():
                        n = total
                    else:
                        n = min(d.engine.generated_tokens(rid, d.now()), total)
                    if n > sent:
                        yield chunks.content(sent, n)
                        sent = n
                    if sent >= total and pending.done.done():
                        break
                    await asyncio.wait((pending.done,), timeout=_STREAM_POLL_S)
                done = pending.done.result()
            yield chunks.end(usage_of(done, api))
        finally:
            d.cancel(rid)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        raw = await request.body()
        try:
            _check_json(request)
            chat = _parse_chat(_parse_json(raw), s.models, s.max_tool_calls, s.flavor)
            if s.strict_tool_names:
                _check_tool_names(chat.tools)
            if not drivers:
                return instant_reply(raw, chat)
            driver = rank_of(request)
            if not driver.running:
                return _error(503, "the engine is not running")
            text, conv, reply = plan(chat)
            rid = new_id()
            ereq = engine_request(chat, text, reply, rid)
        except _HTTPError as exc:
            return _error(exc.status, exc.message)
        # The engine generates output_tokens; a reply cut short by a small KV pool ends early.
        if ereq.output_tokens < reply.n_tokens:
            reply = reply.cut(ereq.output_tokens)
        pending = driver.submit(ereq)
        created = int(time.time())
        if chat.stream:
            chunks = _Chunks(rid, created, chat, reply, conv)
            gen = stream(driver, pending, rid, chunks, reply)
            return StreamingResponse(gen, media_type=_SSE)
        done = await finished(request, driver, rid, pending)
        if done is None:
            return Response(status_code=499)
        usage = usage_of(done)
        return Response(_completion_body(rid, created, chat, reply, conv, usage), media_type=_JSON)

    async def other_api(
        request: Request,
        convert: Callable[[dict[str, Any]], dict[str, Any]],
        prefix: str,
        events_for: Callable[[str, _Chat, Reply, int], _AnthropicEvents | _ResponseEvents],
        error: Callable[[int, str], Response],
        api: str,
    ) -> Response:
        """A turn of an API the engine serves beside Chat Completions (Anthropic
        Messages, OpenAI Responses): the request converted to a chat as vLLM, SGLang and
        llama.cpp convert it, the same engine, the reply in the API's own events."""
        try:
            _check_json(request)
            body = _parse_json(await request.body())
            chat = _parse_chat(convert(body), s.models, s.max_tool_calls)
            text, _, reply = plan(chat)
            rid = f"{prefix}{next(ids):024x}"
            if not drivers:  # instant: no engine, nothing cached
                prompt = max(1, -(-len(text) // CHARS_PER_TOKEN))
                events = events_for(rid, chat, reply, prompt)
                usage = _usage(prompt, reply.n_tokens, said(0, api))
                if not chat.stream:
                    return Response(events.body(usage), media_type=_JSON)
                steps = events.role(said(0, api)) + (
                    events.tool_calls(0) + events.tool_calls(1)
                    if reply.tool_calls
                    else events.content(0, len(reply.tokens))
                )
                return Response(steps + events.end(usage), media_type=_SSE)
            driver = rank_of(request)
            if not driver.running:
                return error(503, "the engine is not running")
            ereq = engine_request(chat, text, reply, rid)
        except _HTTPError as exc:
            return error(exc.status, exc.message)
        if ereq.output_tokens < reply.n_tokens:
            # A reply cut short by a small KV pool ends early, as on the chat route.
            reply = reply.cut(ereq.output_tokens)
        pending = driver.submit(ereq)
        events = events_for(rid, chat, reply, ereq.prompt_tokens)
        if chat.stream:
            gen = stream(driver, pending, rid, events, reply, api)
            return StreamingResponse(gen, media_type=_SSE)
        done = await finished(request, driver, rid, pending)
        if done is None:
            return Response(status_code=499)
        usage = usage_of(done, api)
        return Response(events.body(usage), media_type=_JSON)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        """The Anthropic Messages API, as vLLM, SGLang and llama.cpp serve it."""

        def events(rid: str, chat: _Chat, reply: Reply, prompt: int) -> _AnthropicEvents:
            return _AnthropicEvents(rid, chat, reply, s.flavor, prompt)

        return await other_api(
            request, _from_anthropic, "msg_", events, _anthropic_error, "messages"
        )

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        """The OpenAI Responses API, stateless (`store` is ignored), as vLLM, SGLang,
        llama.cpp and Ollama serve it."""

        def events(rid: str, chat: _Chat, reply: Reply, prompt: int) -> _ResponseEvents:
            return _ResponseEvents(rid, chat, reply, s.flavor)

        return await other_api(request, _from_responses, "resp_", events, _error, "responses")

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        try:
            chat = _parse_chat(_from_anthropic(_parse_json(await request.body())), s.models)
        except _HTTPError as exc:
            return _anthropic_error(exc.status, exc.message)
        text = "".join(render_message(m) for m in chat.messages)
        return _json({"input_tokens": max(1, -(-len(text) // CHARS_PER_TOKEN))})

    @app.post("/classify")
    async def classify(request: Request) -> Response:
        try:
            body = _parse_json(await request.body())
            model = _parse_model(body, s.models)
        except _HTTPError as exc:
            return _error(exc.status, exc.message)
        inputs = body.get("input")
        if isinstance(inputs, str):
            inputs = [inputs]
        if not (isinstance(inputs, list) and inputs and all(isinstance(t, str) for t in inputs)):
            return _error(400, "'input' must be a string or a non-empty list of strings")
        labels, data, tokens = s.labels, [], 0
        for i, text in enumerate(inputs):
            h = key(s.seed, "classify", text)
            best = h % len(labels)
            weights = [1.0] * len(labels)
            weights[best] = 2.0 + (h >> 16) % 8
            total = sum(weights)
            probs = [w / total for w in weights]
            data.append(
                {"index": i, "label": labels[best], "probs": probs, "num_classes": len(labels)}
            )
            tokens += max(1, -(-len(text) // CHARS_PER_TOKEN))
        return _json(
            {
                "id": f"classify-{next(ids):024x}",
                "object": "list",
                "created": int(time.time()),
                "model": model,
                "data": data,
                "usage": {
                    "prompt_tokens": tokens,
                    "total_tokens": tokens,
                    "completion_tokens": 0,
                    "prompt_tokens_details": None,
                },
            }
        )

    @app.get("/health")
    async def health() -> Response:
        # As a real engine whose scheduler died: not healthy, so routers stop sending.
        if any(not d.running for d in drivers):
            return _error(503, "the engine is not running")
        return _json({})

    @app.get("/v1/models")
    async def models() -> Response:
        return _json({"object": "list", "data": served})

    @app.get("/metrics")
    async def metrics() -> Response:
        text = _metrics_text(s.flavor, s.models[0], rank_values())
        if s.flavor == "vllm":
            # vLLM exports its CacheConfig as labels of an info gauge, one per engine
            # (rank), each with the API server's sum of its engines' blocks; the pool
            # in tokens is num_gpu_blocks x block_size.
            blocks = params.kv_pool_tokens // params.block_tokens * s.dp_size
            text += (
                "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
                "# TYPE vllm:cache_config_info gauge\n"
            )
            for rank in range(s.dp_size):
                text += (
                    f'vllm:cache_config_info{{block_size="{params.block_tokens}",'
                    f'cache_dtype="auto",engine="{rank}",num_gpu_blocks="{blocks}"}} 1.0\n'
                )
        return Response(text, media_type=_PROMETHEUS)

    async def server_info() -> Response:
        return _json(
            {
                "model_path": s.models[0],
                "served_model_name": s.models[0],
                "max_total_num_tokens": params.kv_pool_tokens,  # one rank's
                "dp_size": s.dp_size,
                "max_running_requests": params.max_running_requests,
                "chunked_prefill_size": params.chunked_prefill_tokens,
                "page_size": params.block_tokens,
                "enable_priority_scheduling": params.priority_scheduling,
                "version": f"fake-{s.flavor}",
                # One per rank, as SGLang's schedulers report theirs.
                "internal_states": [
                    {
                        "load": r["num_running_reqs"] + r["num_waiting_reqs"],
                        "effective_max_running_requests_per_dp": params.max_running_requests,
                    }
                    for r in rank_loads()
                ],
            }
        )

    async def model_info() -> Response:
        return _json({"model_path": s.models[0], "is_generation": True, "tokenizer_path": None})

    async def loads(model: str | None = None) -> Response:
        """SGLang's /v1/loads; also /loads?model=, which SMG 1.13 polls and reads the
        same way.  Beside it the fake's older totals: `load` (running and waiting),
        `num_reqs` (running), `num_waiting_reqs`."""
        ranks = rank_loads()
        running = sum(r["num_running_reqs"] for r in ranks)
        waiting = sum(r["num_waiting_reqs"] for r in ranks)
        return _json(
            {
                "timestamp": datetime.datetime.now(datetime.UTC).isoformat(),
                "version": f"fake-{s.flavor}",
                "loads": ranks,
                "model": model or s.models[0],
                "load": running + waiting,
                "num_reqs": running,
                "num_waiting_reqs": waiting,
            }
        )

    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, server_info, methods=["GET"])

    if s.flavor == "llamacpp":

        @app.get("/props")
        async def props() -> Response:
            # llama-server's: its slots are --parallel, and each slot gets its share of
            # the context (-c), which default_generation_settings.n_ctx says.
            per_slot = params.kv_pool_tokens // params.max_running_requests
            return _json(
                {
                    "total_slots": params.max_running_requests,
                    "model_path": s.models[0],
                    "default_generation_settings": {"n_ctx": per_slot},
                }
            )

    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, model_info, methods=["GET"])
    for path in ("/loads", "/v1/loads"):
        app.add_api_route(path, loads, methods=["GET"])

    @app.get("/get_load")
    async def get_load() -> Response:
        # SGLang's, a list with one entry per rank (its shim over /v1/loads keeps the
        # names its routers parse): the SGLang router's power_of_two sums num_tokens,
        # and takes an answer that is no list for no load at all (-1).
        tic = time.perf_counter()
        return _json(
            [
                {
                    "dp_rank": r["dp_rank"],
                    "num_reqs": r["num_running_reqs"] + r["num_waiting_reqs"],
                    "num_waiting_reqs": r["num_waiting_reqs"],
                    "num_tokens": r["num_total_tokens"],
                    "num_pending_tokens": r["num_total_tokens"] - r["num_used_tokens"],
                    "ts_tic": tic,
                }
                for r in rank_loads()
            ]
        )

    @app.get("/version")
    async def version() -> Response:
        return _json({"version": f"fake-{s.flavor}"})

    return app


# --------------------------------------------------------------------------- serving


def serve(settings: FakeEngineSettings, *, host: str = "127.0.0.1", port: int) -> None:
    """Serve the fake engine with uvicorn until SIGINT or SIGTERM (then return normally)."""
    from testkit.loopback import serve_until_signalled

    def started() -> None:
        log.info("fake %s engine on http://%s:%d", settings.flavor, host, port)

    serve_until_signalled(create_app(settings), host=host, port=port, started=started)
