"""The LLM turn activity: one turn of a run, through the gateway's admission.

The turn goes to `/v1/chat/completions` as the run's turn (`x-luftpause-run-id` = the
workflow id, with its class and caller), so the gateway keeps the run on the replica
that holds its prefix.  There are no client-side retries: a failed attempt raises and
Temporal's retry policy decides, with the gateway's `Retry-After` as a floor under its delay:
without end while the gateway is unreachable or answers 429/503 (not now), until the
turn has failed ENGINE_FAULT_ATTEMPTS times otherwise, never for a refused request.
While the turn is held in the gateway's queue (for as long as it takes) or generating,
the activity heartbeats, so a dead worker is noticed within the heartbeat timeout.
With tracing on, the turn carries the activity span's `traceparent`, so the gateway's
`chat` span joins the run's trace; the gateway's answer names the kind of engine that
gave it (`x-luftpause-provider`), which the turn's output keeps for the run's span.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import httpx
from temporalio import activity
from temporalio.converter import DataConverter, PayloadConverter
from temporalio.exceptions import ApplicationError

from activities._arguments import MAX_DEPTH, depth
from activities._recover import recover_tool_calls
from activities.contract import EndRunInput, ToolCall, TurnInput, TurnOutput
from luftpause import telemetry
from luftpause.headers import CALLER_HEADER, CLASS_HEADER, PROVIDER_HEADER, RUN_HEADER

__all__ = [
    "HEARTBEAT_EVERY_S",
    "RUN_ERROR_MAX_CHARS",
    "LlmActivities",
    "bounded",
    "heartbeating",
    "payload_bytes",
]

HEARTBEAT_EVERY_S = 2.0
# Statuses a retry cannot fix: the request itself is wrong (or the model unknown).
_PERMANENT = frozenset({400, 401, 403, 404, 405, 413, 422})
# Answers that say "not now" (a caller over its held bound, no healthy replica for the
# model): retried for as long as it takes, as an unreachable gateway is.
_WAIT = frozenset({429, 503})
# An engine's error message as a turn's failure keeps it, at most (a validation error
# may quote the request; helper-168), and a run's failure message: more, so that an
# engine's cut message, with what the activity and Temporal put around it, is not cut
# again (helper-170: cut twice, it said "of 8,078 characters", and lost "given up").
# A run's failure carries its message twice (its own, and its status's error).
ERROR_MAX_CHARS = 8_000
RUN_ERROR_MAX_CHARS = 10_000


def bounded(text: str, limit: int = ERROR_MAX_CHARS) -> str:
    """`text`, or its first `limit` characters with a note."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]} [luftpause: cut here, of {len(text):,} characters]"


# A turn's output as Temporal carries it, at most: Temporal takes no activity result
# past 2 MB.  (It carries a turn's tool calls twice, in the message and as calls; the
# run's conversation, which counts them once, has its own limit, which the workflow
# checks before the next turn.)
TURN_OUTPUT_MAX_BYTES = 1_900_000
# Any other failure (an engine's 500, 502 or 504 for this turn) is retried until the turn
# has failed so many times: a request that makes the engine fail every time must not be
# sent again for ever (each failure also counts toward ejecting a replica).  Counted
# across attempts in the heartbeat details, so the waits above do not count.
ENGINE_FAULT_ATTEMPTS = 20
# The longest retry delay this activity asks for (a retry policy without a maximum
# interval would otherwise grow it past any use).
_MAX_DELAY_S = 3600.0


class _BadCompletion(Exception):
    """A 200 whose body holds no usable chat completion (what it lacks)."""


def _count_fault(faults: int, message: str) -> tuple[bool, str]:
    """One more engine fault for this turn: recorded in the heartbeat (the next attempt
    counts on from there); whether the turn is given up now, and the message."""
    faults += 1
    activity.heartbeat(faults)
    if faults < ENGINE_FAULT_ATTEMPTS:
        return False, message
    return True, f"{message} (this turn failed {faults} times: given up)"


def _faults_so_far() -> int:
    """This turn's engine failures in earlier attempts (their last heartbeat's details)."""
    details = activity.info().heartbeat_details
    first = details[0] if details else 0
    return first if isinstance(first, int) and not isinstance(first, bool) else 0


def _message(response: httpx.Response) -> str:
    """The engine's own words for an error status, at most ERROR_MAX_CHARS of them (a
    validation error may quote the whole request: helper-168)."""
    try:
        body = response.json()
        msg = body["error"]["message"] if isinstance(body.get("error"), dict) else body["error"]
        return bounded(str(msg))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return response.text[:300] or response.reason_phrase


def _retry_after(response: httpx.Response) -> timedelta | None:
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        return timedelta(seconds=max(0.0, float(value)))
    except ValueError:
        return None  # an HTTP date: leave the delay to the retry policy


def _next_delay(response: httpx.Response) -> timedelta | None:
    """The gateway's `Retry-After` as a floor under the retry policy's own backoff, not
    in place of it: a server that keeps answering "1 s" (the gateway's 429 to a caller
    over its held bound) must not turn the backoff into polling once a second."""
    after = _retry_after(response)
    info = activity.info()
    policy = info.retry_policy
    if after is None or policy is None:
        return after
    # In float seconds, bounded before it becomes a timedelta: from about the 48th
    # attempt the growth overflows one (helper-114: an OverflowError then replaced the
    # turn's error, and the engine-fault count's "given up" with it).
    seconds = policy.initial_interval.total_seconds() * min(
        policy.backoff_coefficient ** min(info.attempt - 1, 64), 1e9
    )
    if policy.maximum_interval is not None:
        seconds = min(seconds, policy.maximum_interval.total_seconds())
    return max(after, timedelta(seconds=min(seconds, _MAX_DELAY_S)))


def _count(value: object) -> int:
    """A token count from an engine's usage, as int() read it before (a number, or
    digits as text), and 0 for anything else."""
    if isinstance(value, bool):
        return 0
    if isinstance(value, int):
        return max(value, 0)
    if isinstance(value, float) and math.isfinite(value):
        return max(int(value), 0)
    if isinstance(value, str) and value.strip().isdecimal() and len(value.strip()) <= 18:
        return int(value.strip())
    return 0


@contextlib.asynccontextmanager
async def heartbeating(every_s: float, *details: Any) -> AsyncIterator[None]:
    """Heartbeat every `every_s` while the block runs, with `details` (a later attempt
    of the activity reads the last ones in `activity.info().heartbeat_details`)."""

    async def beat() -> None:
        while True:
            activity.heartbeat(*details)
            await asyncio.sleep(every_s)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _encode(body: dict[str, Any]) -> bytes:
    """The request body as UTF-8 JSON.  A lone surrogate (a task given from Python, or an
    engine's reply that escaped one) cannot be UTF-8: then the whole body is ASCII with
    JSON escapes, which every JSON parser reads.  (httpx's `json=` raised
    UnicodeEncodeError, which the retry policy retried for ever.)"""
    try:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:
        return json.dumps(body, separators=(",", ":")).encode()


class LlmActivities:
    """LLM turns and run-ended reports against one gateway (or, in a benchmark, a peer
    router at the same OpenAI-compatible path)."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        *,
        base_url: str,
        token: str | None = None,
        heartbeat_every_s: float = HEARTBEAT_EVERY_S,
    ) -> None:
        self._http = http
        self._base = base_url.rstrip("/")
        self._auth = {"authorization": f"Bearer {token}"} if token else {}
        self._every = heartbeat_every_s

    def _headers(self, run_id: str, service_class: str, caller: str) -> dict[str, str]:
        return {
            RUN_HEADER: run_id,
            CLASS_HEADER: service_class,
            CALLER_HEADER: caller,
            **self._auth,
        }

    @activity.defn(name="llm_turn")
    async def llm_turn(self, turn: TurnInput) -> TurnOutput:
        """Run one turn; raise for Temporal to retry (or not) when it fails."""
        body: dict[str, Any] = {"model": turn.model, "messages": turn.messages, "stream": False}
        if turn.max_tokens > 0:
            body["max_tokens"] = turn.max_tokens
        if turn.tools:
            body["tools"] = turn.tools
            body["parallel_tool_calls"] = turn.parallel_tool_calls
        headers = self._headers(turn.run_id, turn.service_class, turn.caller)
        headers["content-type"] = "application/json"
        telemetry.inject(headers)
        content = _encode(body)
        started = time.monotonic()
        faults = _faults_so_far()
        try:
            async with heartbeating(self._every, faults):
                # A caller may be any UTF-8 name (httpx would encode str values as ASCII).
                wire = {k.encode(): v.encode() for k, v in headers.items()}
                response = await self._http.post(
                    f"{self._base}/v1/chat/completions", content=content, headers=wire
                )
        except httpx.LocalProtocolError as exc:
            # The request itself cannot be sent (e.g. a header value HTTP forbids): the
            # same request would fail again.
            raise ApplicationError(
                f"the turn cannot be sent: {exc}", type="BadRequest", non_retryable=True
            ) from None
        except httpx.HTTPError as exc:
            # The gateway is down or restarting: retry, as the policy allows.
            raise ApplicationError(
                f"gateway {self._base}: {type(exc).__name__}: {exc}", type="GatewayUnreachable"
            ) from None
        status = response.status_code
        if status != 200:
            message = f"gateway answered {status}: {_message(response)}"
            spent = False
            if status not in _WAIT and status not in _PERMANENT:
                spent, message = _count_fault(faults, message)
            raise ApplicationError(
                message,
                type=f"Http{status}",
                non_retryable=status in _PERMANENT or spent,
                next_retry_delay=_next_delay(response),
            )
        try:
            output = self._output(turn, response, time.monotonic() - started)
            # Read, but nested too deeply to carry on: Temporal's converter recurses
            # about twice a level, past about 450 here and a few less once the run
            # puts the message in its next turn (helper-182, helper-183: retried
            # uncounted for ever, or every workflow task failed).
            if depth(output.message) > MAX_DEPTH:
                raise _BadCompletion(f"with a message nested past {MAX_DEPTH} levels")
            size = payload_bytes(output)
        except _BadCompletion as exc:
            # An engine (or a router before it) that answers this turn with a body no
            # completion can be read from is failing it as a 500 would: counted, not
            # retried for ever.
            spent, message = _count_fault(faults, f"gateway answered 200 {exc}")
            raise ApplicationError(message, type="BadCompletion", non_retryable=spent) from None
        if size > TURN_OUTPUT_MAX_BYTES:
            # Temporal takes no activity result past 2 MB: the attempt failed after
            # the fact, as a retryable one, and the engine wrote the same turn again
            # for ever, the run Running all along (helper-163: 4 calls of 280 kB,
            # carried twice, in the message and as calls; helper-167: measured against
            # the conversation's 1.5 MB, one call of 760 kB was refused).
            raise ApplicationError(
                f"the engine's turn is {size:,} bytes as the run keeps it "
                f"({len(output.tool_calls)} tool calls), past {TURN_OUTPUT_MAX_BYTES:,}: "
                "Temporal carries no activity result past 2 MB; a lower maxTokens keeps "
                "turns smaller",
                type="TurnTooLarge",
                non_retryable=True,
            )
        return output

    def _output(self, turn: TurnInput, response: httpx.Response, seconds: float) -> TurnOutput:
        try:
            data = response.json()
            choice = data["choices"][0]
            message = dict(choice["message"])
            finish = str(choice.get("finish_reason") or "stop")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            raise _BadCompletion(f"without a chat completion ({exc!r})") from None
        except RecursionError:  # nested past the decoder's limit (helper-180)
            raise _BadCompletion("without a chat completion (JSON nested too deeply)") from None
        # Usage as far as it reads (helper-160: "usage": "n/a" or a count as text raised
        # past the fault count, and the turn was sent again for ever).
        usage = data.get("usage")
        usage = usage if isinstance(usage, dict) else {}
        details = usage.get("prompt_tokens_details")
        details = details if isinstance(details, dict) else {}
        # Call ids key approvals and the tool servers' idempotency: they must be unique
        # in the run, whatever the engine sends (none, or "call_0" again every turn).
        used = _call_ids(turn.messages)
        calls = []
        for i, c in enumerate(message.get("tool_calls") or []):
            if not (isinstance(c, dict) and isinstance(c.get("function"), dict)):
                continue
            name = c["function"].get("name")
            if not isinstance(name, str) or not name:
                raise _BadCompletion(f"with a tool call that names no function: {c!r:.200}")
            call_id = str(c.get("id") or "")
            if not call_id or call_id in used:
                base = f"{call_id or 'call'}_{len(turn.messages)}_{i}"
                call_id, n = base, 1
                while call_id in used:  # an engine may have sent that very id before
                    call_id, n = f"{base}_{n}", n + 1
            used.add(call_id)
            arguments = c["function"].get("arguments")
            if not isinstance(arguments, str):
                # An object, as some llama-server and TGI builds send: its JSON, not its
                # Python repr, which no schema check reads (helper-160).
                arguments = "" if arguments is None else json.dumps(arguments, ensure_ascii=False)
            calls.append(ToolCall(id=call_id, name=name, arguments=arguments))
        recovered = False
        content = message.get("content")
        if not calls and turn.tools and isinstance(content, str):
            offered = {t["function"]["name"] for t in turn.tools}
            calls = recover_tool_calls(content, offered, salt=f"{turn.run_id}/{len(turn.messages)}")
            recovered = bool(calls)
        # The transcript keeps only what the next turn needs, in the OpenAI shape.
        kept: dict[str, Any] = {"role": "assistant", "content": None if recovered else content}
        if calls:
            kept["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in calls
            ]
            finish = "tool_calls"
        return TurnOutput(
            message=kept,
            tool_calls=calls,
            finish_reason=finish,
            prompt_tokens=_count(usage.get("prompt_tokens")),
            completion_tokens=_count(usage.get("completion_tokens")),
            cached_tokens=_count(details.get("cached_tokens")),
            seconds=seconds,
            recovered=recovered,
            # The engine's kind, as the gateway names it (the worker sees no engine).
            provider=response.headers.get(PROVIDER_HEADER, ""),
        )

    @activity.defn(name="end_run")
    async def end_run(self, end: EndRunInput) -> None:
        """Tell the gateway the run ended, so it forgets the run's affinity at once."""
        try:
            response = await self._http.delete(
                f"{self._base}/v1/runs/{end.run_id}", headers=self._auth
            )
        except httpx.HTTPError as exc:
            raise ApplicationError(
                f"gateway {self._base}: {exc}", type="GatewayUnreachable"
            ) from None
        # 404: a peer router has no such route, or the gateway restarted and never saw
        # the run; either way there is nothing to forget.
        if response.status_code not in (200, 202, 204, 404):
            raise ApplicationError(
                f"gateway answered {response.status_code}: {_message(response)}",
                non_retryable=response.status_code in _PERMANENT,
            )


def _call_ids(messages: list[dict[str, Any]]) -> set[str]:
    """The tool call ids the run's transcript already has."""
    return {
        str(c.get("id"))
        for m in messages
        if m.get("role") == "assistant"
        for c in m.get("tool_calls") or []
        if isinstance(c, dict)
    }


def payload_bytes(value: Any, converter: PayloadConverter | None = None) -> int:
    """What `value` weighs as Temporal carries it: by `converter` (a workflow passes
    its own, `workflow.payload_converter()`), else by the default one, the worker's."""
    by = converter if converter is not None else DataConverter.default.payload_converter
    return by.to_payloads([value])[0].ByteSize()
