"""Tracing (luftpause/telemetry.py): the gateway's `chat` and `admit` spans and the
`traceparent` it sends engines; a sub-agent run's spans in one trace; OTLP export.

Spans are recorded by an in-memory exporter on a provider of the test's own, handed to
the code with `telemetry.use()` and taken back afterwards: the process-wide provider
(settable once per process) is never touched."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased
from opentelemetry.trace import SpanContext, StatusCode, TraceFlags
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send
from temporalio import activity
from temporalio.client import Client

import gateway.app as gateway_app
from activities.contract import (
    EndRunInput,
    ToolCall,
    ToolInfo,
    ToolInput,
    ToolOutput,
    ToolsWanted,
    TurnInput,
    TurnOutput,
)
from luftpause import telemetry
from luftpause.temporal_dev import free_port
from luftpause.up import Child, wait_http
from scheduler import Policy
from testkit.loopback import serve
from tests.gateway.harness import (
    MODEL,
    RUN,
    answered_health,
    chat,
    closed_port_url,
    endpoint,
    engine,
    gateway,
    raw_engine,
    tool_loop,
    tool_task,
    turn,
    until,
    upstream,
)
from tests.workflows import harness as runs_harness
from workflows import Runs, RunSpec

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry.use(provider)
    try:
        yield exporter
    finally:
        telemetry.use(None)
        provider.shutdown()


def named(exporter: InMemorySpanExporter, prefix: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name.startswith(prefix)]


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def descends_from(
    exporter: InMemorySpanExporter, span: ReadableSpan, ancestor: ReadableSpan
) -> bool:
    """Whether `ancestor` is on `span`'s chain of recorded parents."""
    assert ancestor.context is not None
    by_id = {s.context.span_id: s for s in exporter.get_finished_spans() if s.context}
    parent = span.parent
    while parent is not None:
        if parent.span_id == ancestor.context.span_id:
            return True
        up = by_id.get(parent.span_id)
        parent = up.parent if up is not None else None
    return False


def traceparent_ids(value: str) -> tuple[str, str]:
    """(trace id, parent span id) of a W3C traceparent header."""
    version, trace_id, span_id, _flags = value.split("-")
    assert version == "00"
    return trace_id, span_id


# --------------------------------------------------------------------------- gateway


async def test_a_turn_is_a_chat_span_continuing_the_callers_trace(
    spans: InMemorySpanExporter,
) -> None:
    async with engine() as (url, recorder), gateway(endpoint("e0", url)) as (client, _):
        headers = {
            "traceparent": TRACEPARENT,
            RUN: "run-1",
            "x-luftpause-class": "batch",
            "x-luftpause-caller": "alice",
        }
        r = await client.post("/v1/chat/completions", json=chat(max_tokens=8), headers=headers)
        assert r.status_code == 200
        await until(lambda: bool(named(spans, "chat ")), "the chat span ended")

    (chat_span,) = named(spans, "chat ")
    (admit,) = named(spans, "admit")
    assert not named(spans, "invoke_agent")  # the caller's trace has its own
    assert chat_span.name == "chat llama-3.2-1b"
    # The chat span continues the caller's trace; admit is its child.
    assert chat_span.context is not None and admit.context is not None
    assert format(chat_span.context.trace_id, "032x") == TRACE_ID
    assert chat_span.parent is not None and format(chat_span.parent.span_id, "016x") == (
        PARENT_SPAN_ID
    )
    assert admit.parent is not None and admit.parent.span_id == chat_span.context.span_id
    assert admit.context.trace_id == chat_span.context.trace_id

    a = attrs(admit)
    assert a["luftpause.run_id"] == "run-1"
    assert a["luftpause.class"] == "batch"
    assert a["luftpause.caller"] == "alice"
    assert a["luftpause.replica"] == "e0"
    assert 0.0 <= a["luftpause.held_seconds"] < 5.0

    c = attrs(chat_span)
    assert c["gen_ai.operation.name"] == "chat"
    assert c["gen_ai.request.model"] == "llama-3.2-1b"
    assert c["gen_ai.usage.input_tokens"] > 0
    assert c["gen_ai.usage.output_tokens"] == 8
    assert c["gen_ai.response.finish_reasons"] == ("length",)
    assert c["server.address"] == "127.0.0.1"
    assert c["luftpause.replica"] == "e0"
    assert c["gen_ai.provider.name"] == "sglang"  # the semconv's required attribute
    assert chat_span.status.status_code is not StatusCode.ERROR

    # The engine continues the gateway's chat span.
    (sent,) = recorder.headers
    trace_id, parent_id = traceparent_ids(sent["traceparent"])
    assert trace_id == TRACE_ID
    assert parent_id == format(chat_span.context.span_id, "016x")


async def test_a_streamed_turn_without_a_traceparent_is_a_run_of_its_own(
    spans: InMemorySpanExporter,
) -> None:
    async with engine() as (url, recorder), gateway(endpoint("e0", url)) as (client, _):
        body = chat(max_tokens=4, stream=True, stream_options={"include_usage": True})
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            await r.aread()
            run_id = r.headers[RUN]
        await until(lambda: bool(named(spans, "invoke_agent")), "the run's span ended")

    # The answer ended the run's invocation: its span is the trace's root, the turn's
    # chat span its child.
    (agent,) = named(spans, "invoke_agent")
    (chat_span,) = named(spans, "chat ")
    assert agent.parent is None and agent.context is not None and chat_span.context is not None
    assert chat_span.parent is not None and chat_span.parent.span_id == agent.context.span_id
    assert chat_span.context.trace_id == agent.context.trace_id
    a = attrs(agent)
    assert a["gen_ai.operation.name"] == "invoke_agent"
    assert a["gen_ai.conversation.id"] == a["luftpause.run_id"] == run_id
    assert a["luftpause.end"] == "answered" and a["luftpause.turns"] == 1
    assert a["gen_ai.provider.name"] == attrs(chat_span)["gen_ai.provider.name"] == "sglang"
    assert a["gen_ai.usage.output_tokens"] == attrs(chat_span)["gen_ai.usage.output_tokens"] == 4
    assert a["gen_ai.usage.input_tokens"] == attrs(chat_span)["gen_ai.usage.input_tokens"] > 0
    assert agent.status.status_code is not StatusCode.ERROR
    (sent,) = recorder.headers
    assert traceparent_ids(sent["traceparent"])[0] == format(chat_span.context.trace_id, "032x")


async def test_a_runs_span_names_the_provider_its_first_turn_went_to(
    spans: InMemorySpanExporter,
) -> None:
    # semconv: gen_ai.provider.name is required on invoke_agent spans too; the run's
    # had none (helper-191).  Its span opens before a replica is chosen: the provider is
    # the first admitted turn's, as its chat span names it.  A later turn of the run
    # that goes to another kind of engine (here: another model's) names its own on its
    # chat span; the run's keeps the first (one value, a discriminator of the spans'
    # flavour, set as early as it is known).
    async with (
        engine(flavor="llamacpp", time_scale=50) as (llama, _),
        engine(flavor="vllm", time_scale=50, models=("other",)) as (vllm, _),
        gateway(
            endpoint("e0", llama, kind="llamacpp"),
            endpoint("e1", vllm, kind="vllm", models=("other",)),
        ) as (gw, _),
    ):
        run_id = await paused_run(gw)
        r = await gw.post("/v1/chat/completions", json=chat(model="other"), headers={RUN: run_id})
        assert r.status_code == 200, r.text
        assert (await gw.delete(f"/v1/runs/{run_id}")).status_code < 300
        await until(lambda: bool(named(spans, "invoke_agent")), "the run's span ended")
    (agent,) = named(spans, "invoke_agent")
    assert attrs(agent)["luftpause.turns"] == 2
    chats = sorted(named(spans, "chat "), key=lambda s: s.start_time or 0)
    assert [attrs(c)["gen_ai.provider.name"] for c in chats] == ["llama.cpp", "vllm"]
    assert agent.context is not None
    assert all(c.parent is not None and c.parent.span_id == agent.context.span_id for c in chats)
    assert attrs(agent)["gen_ai.provider.name"] == "llama.cpp"


async def test_a_tool_loop_without_a_traceparent_is_one_trace(
    spans: InMemorySpanExporter,
) -> None:
    async with engine(time_scale=50) as (url, _), gateway(endpoint("e0", url)) as (client, _):
        ids, turns = await tool_loop(client, tool_task(2))
        await until(lambda: bool(named(spans, "invoke_agent")), "the run's span ended")
    assert turns >= 3 and len(set(ids)) == 1

    # One span for the run, open from its first turn to its answer, over every turn.
    (agent,) = named(spans, "invoke_agent")
    chats = named(spans, "chat ")
    assert len(chats) == turns and agent.context is not None
    for c in chats:
        assert c.parent is not None and c.parent.span_id == agent.context.span_id
        assert c.context is not None and c.context.trace_id == agent.context.trace_id
    assert agent.start_time is not None and agent.end_time is not None
    assert agent.start_time <= min(c.start_time or 0 for c in chats)
    assert agent.end_time >= max(c.end_time or 0 for c in chats)
    a = attrs(agent)
    assert a["luftpause.end"] == "answered" and a["luftpause.turns"] == turns
    for usage in ("gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens"):
        assert a[usage] == sum(attrs(c)[usage] for c in chats)
    # Later turns read the run's prefix from the cache, and the run's span says so.
    cached = sum(attrs(c).get("gen_ai.usage.cache_read.input_tokens", 0) for c in chats)
    assert a["gen_ai.usage.cache_read.input_tokens"] == cached > 0


async def test_a_run_answered_in_the_callers_own_trace_ends_its_span(
    spans: InMemorySpanExporter,
) -> None:
    async with engine(time_scale=50) as (url, _), gateway(endpoint("e0", url)) as (client, _):
        messages: list[dict[str, Any]] = [{"role": "user", "content": tool_task(1)}]
        run_id, message, finish = await turn(client, messages, False)
        assert finish == "tool_calls" and not named(spans, "invoke_agent")
        messages.append(message)
        for call in message["tool_calls"]:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "found"})
        while finish == "tool_calls":  # the rest in a trace the caller started
            again, message, finish = await turn(
                client, messages, False, traceparent=TRACEPARENT, **{RUN: run_id}
            )
            assert again == run_id
            messages.append(message)
            for call in message.get("tool_calls") or []:
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": "x"})
        (agent,) = named(spans, "invoke_agent")
    assert attrs(agent)["luftpause.end"] == "answered" and attrs(agent)["luftpause.turns"] == 1


async def paused_run(client: httpx.AsyncClient) -> str:
    """A run whose first turn ended in a tool call: its id."""
    run_id, _, finish = await turn(client, [{"role": "user", "content": tool_task(1)}], False)
    assert finish == "tool_calls"
    return run_id


async def test_a_paused_run_not_resumed_ends_its_span_at_its_last_turn(
    spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gateway_app, "TICK_PERIOD_S", 0.05)
    policy = Policy(idle_run_expiry_s=0.5)
    async with (
        engine(time_scale=50) as (url, _),
        gateway(endpoint("e0", url), policy=policy) as (client, _),
    ):
        run_id = await paused_run(client)
        assert not named(spans, "invoke_agent")  # paused: the client will come back
        await until(lambda: bool(named(spans, "invoke_agent")), "the run expired")
        seen = time.time_ns()

    (agent,) = named(spans, "invoke_agent")
    (chat_span,) = named(spans, "chat ")
    a = attrs(agent)
    assert a["luftpause.run_id"] == run_id and a["luftpause.end"] == "expired"
    assert agent.status.status_code is not StatusCode.ERROR
    # It ends when the run was last active, not when the core forgot it.
    assert agent.end_time is not None and chat_span.end_time is not None
    assert 0 <= agent.end_time - chat_span.end_time < 100_000_000
    assert seen - agent.end_time >= 400_000_000


async def test_a_client_that_leaves_mid_stream_abandons_its_run_without_an_error(
    spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Esc in a harness while the answer streams.  The turn's chat span says the client
    # left (as its admit span does for a held turn); the run may come back with the
    # turn, so its span ends once the run expires: abandoned, not an error.
    monkeypatch.setattr(gateway_app, "TICK_PERIOD_S", 0.05)
    policy = Policy(idle_run_expiry_s=0.5)
    async with (
        engine(time_scale=0.5) as (url, _),
        gateway(endpoint("e0", url), policy=policy) as (client, _),
    ):
        body = chat(max_tokens=200, stream=True)
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if '"content": "' in line and '"role"' not in line:
                    break  # the first words: leave
        await until(lambda: bool(named(spans, "chat ")), "the turn's span ended")
        (chat_span,) = named(spans, "chat ")
        assert attrs(chat_span)["error.type"] == "client_left"
        assert not named(spans, "invoke_agent")  # the client may send the turn again
        await until(lambda: bool(named(spans, "invoke_agent")), "the run expired")

    (agent,) = named(spans, "invoke_agent")
    assert attrs(agent)["luftpause.end"] == "abandoned" and "error.type" not in attrs(agent)
    assert agent.status.status_code is not StatusCode.ERROR


async def test_a_run_ended_by_the_client_or_left_at_a_stop_ends_its_span(
    spans: InMemorySpanExporter,
) -> None:
    async with engine(time_scale=50) as (url, _), gateway(endpoint("e0", url)) as (client, _):
        ended, left = await paused_run(client), await paused_run(client)
        r = await client.delete(f"/v1/runs/{ended}")
        assert r.status_code == 204
        # The core forgot the run in the request: its span ended there.
        (agent,) = named(spans, "invoke_agent")
        assert attrs(agent)["luftpause.run_id"] == ended
        assert attrs(agent)["luftpause.end"] == "ended"

    # The other was still paused when the gateway stopped.
    (_, agent) = named(spans, "invoke_agent")
    assert attrs(agent)["luftpause.run_id"] == left
    assert attrs(agent)["luftpause.end"] == "gateway_stopped"


async def test_a_decision_is_a_span_the_engines_request_continues(
    spans: InMemorySpanExporter,
) -> None:
    # DESIGN: traceparent is propagated to engines; /v1/decide's turns too, both the
    # scored one on a generative replica and the classifier's /classify.
    async with (
        engine(instant=True) as (url, generative),
        engine(models=("clf",), labels=("no", "yes"), instant=True) as (clf_url, classifier),
        gateway(
            endpoint("e0", url), endpoint("c", clf_url, kind="classifier", models=("clf",))
        ) as (
            client,
            _,
        ),
    ):
        for body in ({"input": "spam?", "labels": ["yes", "no"]}, {"input": "a lovely day"}):
            r = await client.post("/v1/decide", json=body, headers={"traceparent": TRACEPARENT})
            assert r.status_code == 200, r.text
        await until(lambda: len(named(spans, "decide")) == 2, "both decide spans ended")
        unknown = {"input": "x", "labels": ["a", "b"], "model": "no-such-model"}
        assert (await client.post("/v1/decide", json=unknown)).status_code == 404
        await until(lambda: len(named(spans, "decide")) == 3, "the third decide span ended")

    scored, classified, refused = named(spans, "decide")
    assert refused.name == "decide"  # names stay few whatever models clients name
    assert attrs(refused)["gen_ai.request.model"] == "no-such-model"
    assert attrs(refused)["error.type"] == "404"  # semconv's, on an error (helper-169)
    sent = [generative.headers[0], next(h for p, h, _ in classifier.posts if p == "/classify")]
    for span, headers in zip((scored, classified), sent, strict=True):
        assert span.context is not None and span.parent is not None
        assert format(span.context.trace_id, "032x") == TRACE_ID
        assert format(span.parent.span_id, "016x") == PARENT_SPAN_ID
        assert traceparent_ids(headers["traceparent"]) == (
            TRACE_ID,
            format(span.context.span_id, "016x"),
        )
        assert attrs(span)["http.response.status_code"] == 200
    assert attrs(scored)["luftpause.labels"] == 2 and attrs(classified)["luftpause.labels"] == 0


async def test_a_decision_its_engine_never_answered_names_how_it_failed(
    spans: InMemorySpanExporter,
) -> None:
    # semconv's HTTP client span: a request that got no response has no status code, and
    # its error.type names the failure; it read as the engine's 502 or 504, which were
    # the gateway's (helper-200).  An engine's own 502 is still one.
    released = asyncio.Event()

    async def hung(scope: Scope, receive: Receive, send: Send) -> None:
        if await answered_health(scope, send):
            return
        await released.wait()  # accepts the request, never answers

    def bad_gateway(request: Request) -> Response:
        return Response(b'{"error": {"message": "no backend"}}', 502)

    async with (
        raw_engine(None) as broken,
        serve(hung) as slow,
        serve(upstream(bad_gateway)) as failing,
        gateway(
            endpoint("broken", broken, kind="openai", models=("m-broken",)),
            endpoint("slow", slow, kind="openai", models=("m-slow",)),
            endpoint("failing", failing, kind="openai", models=("m-502",)),
            endpoint("c-down", closed_port_url(), kind="classifier", models=("c-down",)),
            endpoint("c-broken", broken, kind="classifier", models=("c-broken",)),
            endpoint("c-slow", slow, kind="classifier", models=("c-slow",)),
            policy=Policy(turn_timeout_s=0.5),
        ) as (client, _),
    ):
        answered = {}
        try:
            for model in ("m-broken", "m-slow", "m-502", "c-down", "c-broken", "c-slow"):
                labels = {"labels": ["a", "b"]} if model.startswith("m-") else {}
                body = {"input": "x", "model": model, **labels}
                answered[model] = (await client.post("/v1/decide", json=body)).status_code
        finally:
            released.set()
        await until(lambda: len(named(spans, "decide")) == 6, "every decide span ended")
    assert answered == {
        "m-broken": 502,
        "m-slow": 504,
        "m-502": 502,
        "c-down": 502,
        "c-broken": 502,
        "c-slow": 504,
    }
    by_model = {attrs(s)["gen_ai.request.model"]: s for s in named(spans, "decide")}
    failed = {
        "m-broken": "RemoteProtocolError",  # the connection closed unanswered
        "m-slow": "timeout",  # the turn's own deadline, which raises nothing
        "c-down": "ConnectError",
        "c-broken": "RemoteProtocolError",
        "c-slow": "ReadTimeout",
    }
    for model, error in failed.items():
        span = by_model[model]
        assert attrs(span)["error.type"] == error, model
        assert "http.response.status_code" not in attrs(span), model
        assert span.status.status_code is StatusCode.ERROR
        assert (span.status.description or "").startswith("engine "), model
    answer = attrs(by_model["m-502"])
    assert (answer["error.type"], answer["http.response.status_code"]) == ("502", 502)


async def test_a_decision_whose_client_left_says_so(spans: InMemorySpanExporter) -> None:
    # As a turn's and a count's: the client left, not an engine answering 499.
    asked, released = asyncio.Event(), asyncio.Event()

    async def hung(scope: Scope, receive: Receive, send: Send) -> None:
        if await answered_health(scope, send):
            return
        asked.set()
        await released.wait()  # accepts the request, never answers

    async with serve(hung) as url, gateway(endpoint("e0", url, kind="openai")) as (client, _):
        body = {"input": "x", "model": MODEL, "labels": ["a", "b"]}
        call = asyncio.create_task(client.post("/v1/decide", json=body))
        try:
            await asyncio.wait_for(asked.wait(), 5)
            call.cancel()  # the client leaves: its connection to the gateway closes
            with contextlib.suppress(asyncio.CancelledError):
                await call
            await until(lambda: len(named(spans, "decide")) == 1, "the decide span ended")
        finally:
            released.set()
    (span,) = named(spans, "decide")
    assert attrs(span)["error.type"] == "client_left"
    assert "http.response.status_code" not in attrs(span)
    assert span.status.status_code is StatusCode.ERROR


async def test_a_classifier_passed_over_leaves_no_failure_but_the_last_is_told(
    spans: InMemorySpanExporter,
) -> None:
    # Only the failure the answer is about is told: a classifier that refused the
    # connection and was passed over for one that answered is no failure of the span,
    # and one passed over for one that never answered leaves that one's failure.
    released = asyncio.Event()

    async def down_yet_answering(scope: Scope, receive: Receive, send: Send) -> None:
        # Found down by every probe (so the refusing one, first in the file, is tried
        # first), yet it classifies; "c-slow" never answers.
        if scope["type"] != "http":
            return
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 503, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        body = await receive()
        if b'"c-slow"' in body.get("body", b""):
            await released.wait()
            return
        answer = b'{"data": [{"label": "yes", "probs": [0.1, 0.9]}]}'
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": answer})

    refusing = closed_port_url()
    async with (
        serve(down_yet_answering) as url,
        gateway(
            endpoint("r-ok", refusing, kind="classifier", models=("c-ok",)),
            endpoint("ok", url, kind="classifier", models=("c-ok",)),
            endpoint("r-slow", refusing, kind="classifier", models=("c-slow",)),
            endpoint("slow", url, kind="classifier", models=("c-slow",)),
            policy=Policy(turn_timeout_s=0.5),
        ) as (client, _),
    ):
        try:
            answered = {}
            for model in ("c-ok", "c-slow"):
                body = {"input": "x", "model": model}
                answered[model] = (await client.post("/v1/decide", json=body)).status_code
        finally:
            released.set()
        await until(lambda: len(named(spans, "decide")) == 2, "both decide spans ended")
    assert answered == {"c-ok": 200, "c-slow": 504}
    by_model = {attrs(s)["gen_ai.request.model"]: s for s in named(spans, "decide")}
    ok = attrs(by_model["c-ok"])
    assert "error.type" not in ok and ok["http.response.status_code"] == 200
    slow = attrs(by_model["c-slow"])
    assert slow["error.type"] == "ReadTimeout" and "http.response.status_code" not in slow


async def test_a_decision_whose_client_left_while_held_says_so(
    spans: InMemorySpanExporter,
) -> None:
    asked, released = asyncio.Event(), asyncio.Event()

    async def hung(scope: Scope, receive: Receive, send: Send) -> None:
        if await answered_health(scope, send):
            return
        asked.set()
        await released.wait()
        await send({"type": "http.response.start", "status": 503, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async with (
        serve(hung) as url,
        gateway(endpoint("e0", url, kind="openai", slots=1)) as (client, shell),
    ):
        body = {"input": "x", "model": MODEL, "labels": ["a", "b"]}
        first = asyncio.create_task(client.post("/v1/decide", json=body))
        try:
            await asyncio.wait_for(asked.wait(), 5)  # the one slot is taken
            second = asyncio.create_task(client.post("/v1/decide", json=body))
            await until(lambda: shell.state.held_count() == 1, "the second decision held")
            second.cancel()
            await asyncio.gather(second, return_exceptions=True)
            await until(lambda: len(named(spans, "decide")) == 1, "the held one's span ended")
        finally:
            released.set()
            await asyncio.gather(first, return_exceptions=True)
    (span, _) = named(spans, "decide")
    assert attrs(span)["error.type"] == "client_left"
    assert "http.response.status_code" not in attrs(span)
    assert span.status.description == "client disconnected while held"


async def test_a_turn_the_engine_sent_no_usage_for_records_none(
    spans: InMemorySpanExporter,
) -> None:
    # Streams to hosted and Ollama endpoints are not asked for usage: no count is
    # known, and 0 would read as a turn that cost nothing.
    async with engine() as (url, _), gateway(endpoint("e0", url, kind="openai")) as (client, _):
        async with client.stream(
            "POST", "/v1/chat/completions", json=chat(max_tokens=4, stream=True)
        ) as r:
            assert r.status_code == 200
            assert b'"usage"' not in await r.aread()
        await until(lambda: bool(named(spans, "chat ")), "the chat span ended")
    (chat_span,) = named(spans, "chat ")
    c = attrs(chat_span)
    assert c["gen_ai.response.finish_reasons"] == ("length",)
    assert not [k for k in c if k.startswith("gen_ai.usage.")], c


async def test_a_rejected_turn_is_an_error_span() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with engine() as (url, _), gateway(endpoint("e0", url)) as (client, _):
        telemetry.use(provider)
        try:
            r = await client.post("/v1/chat/completions", json=chat(model="no-such-model"))
            await until(lambda: bool(named(exporter, "chat")), "the chat span ended")
            # A model's name is bounded: 4 MB of one went into six places in the spans
            # (helper-146).
            long = await client.post("/v1/chat/completions", json=chat(model="m" * 1025))
        finally:
            telemetry.use(None)
    assert long.status_code == 400
    assert "'model' is a model's name: at most 1024 characters" in long.text
    assert r.status_code == 404
    (chat_span,) = named(exporter, "chat")
    # Span names stay few whatever models clients name: the one asked for is an attribute.
    assert chat_span.name == "chat"
    assert attrs(chat_span)["gen_ai.request.model"] == "no-such-model"
    (admit,) = named(exporter, "admit")
    (agent,) = named(exporter, "invoke_agent")  # the run never got further
    for span in (chat_span, admit, agent):
        assert span.status.status_code is StatusCode.ERROR
        assert attrs(span)["error.type"] == "404"
    assert attrs(agent)["luftpause.end"] == "rejected"
    assert "no-such-model" in (agent.status.description or "")
    # No engine was chosen: no provider is named, on the run's span as on the chat span.
    assert "gen_ai.provider.name" not in attrs(agent) and "gen_ai.provider.name" not in (
        attrs(chat_span)
    )


def test_an_engines_address_has_its_port_even_when_its_url_names_none() -> None:
    # semconv: server.port beside server.address; every hosted https endpoint had none
    # (helper-169).
    from gateway._proxy import _server

    assert _server("https://api.openai.com/v1") == {
        "server.address": "api.openai.com",
        "server.port": 443,
    }
    assert _server("http://sglang:30000")["server.port"] == 30000
    assert _server("http://ollama")["server.port"] == 80


async def test_a_turn_behind_a_router_names_the_engine_that_answers(
    spans: InMemorySpanExporter,
) -> None:
    # gen_ai.provider.name was the endpoint's kind, "router", which is no provider: it
    # is the kind of the engines behind it (`load_from`), as the proxy reads answers.
    async with (
        engine() as (url, _),
        gateway(endpoint("eng", url), endpoint("rt", url, kind="router", load_from=["eng"])) as (
            client,
            _,
        ),
    ):
        r = await client.post(
            "/v1/chat/completions", json=chat(max_tokens=2), headers={RUN: "via-router"}
        )
        assert r.status_code == 200
        await until(lambda: bool(named(spans, "chat ")), "the chat span ended")
    (chat_span,) = named(spans, "chat ")
    assert attrs(chat_span)["gen_ai.provider.name"] == "sglang", attrs(chat_span)


async def test_a_turn_for_a_model_with_no_engine_now_is_an_error_span(
    spans: InMemorySpanExporter,
) -> None:
    # The model's engines are found by name, and the name resolves to none: the 503
    # went out before the turn reached the core, with no span, in an outage, when
    # traces matter most (helper-169).  A plain `chat`, in the caller's trace.
    from testkit.fake_dns import fake_dns

    async with fake_dns() as (_, where):  # it knows no name: no engine
        pod = endpoint("pod", f"http://engines.test:{free_port()}", discover="dns")
        found = {"discovery": {"period_s": 1.5, "timeout_s": 0.5, "nameservers": [where]}}
        async with gateway(pod, sections=found) as (gw, _):
            headers = {"traceparent": TRACEPARENT}
            r = await gw.post("/v1/chat/completions", json=chat(), headers=headers)
    assert r.status_code == 503 and "has no engine now" in r.json()["error"]["message"]
    (chat_span,) = named(spans, "chat")
    assert chat_span.name == "chat" and chat_span.status.status_code is StatusCode.ERROR
    assert chat_span.context is not None and format(chat_span.context.trace_id, "032x") == (
        TRACE_ID
    )
    c = attrs(chat_span)
    assert (c["error.type"], c["gen_ai.request.model"]) == ("503", "llama-3.2-1b")


async def test_a_runs_turn_refused_for_no_engine_now_is_in_the_runs_trace(
    spans: InMemorySpanExporter,
) -> None:
    # Without a traceparent (Claude Code, Codex) a turn goes under its run's
    # invoke_agent span; answered before the core saw it, this one began a trace of
    # its own, outside the session's (helper-170).
    from testkit.fake_dns import fake_dns

    async with fake_dns() as (_, where), engine(time_scale=50) as (url, _):
        pod = endpoint(
            "pod", f"http://engines.test:{free_port()}", models=("other",), discover="dns"
        )
        found = {"discovery": {"period_s": 1.5, "timeout_s": 0.5, "nameservers": [where]}}
        async with gateway(endpoint("e0", url), pod, sections=found) as (gw, _):
            run_id = await paused_run(gw)  # its invoke_agent span is open
            r = await gw.post(
                "/v1/chat/completions", json=chat(model="other"), headers={RUN: run_id}
            )
    assert r.status_code == 503 and "has no engine now" in r.json()["error"]["message"]
    (first,) = named(spans, "chat ")
    (refused,) = [s for s in named(spans, "chat") if s.name == "chat"]
    assert first.context is not None and refused.context is not None
    assert first.parent is not None  # under the run's invoke_agent span
    assert refused.parent is not None and refused.parent.span_id == first.parent.span_id
    assert refused.context.trace_id == first.context.trace_id
    assert attrs(refused)["error.type"] == "503"


async def test_a_tool_call_that_fails_says_how_in_its_span(
    spans: InMemorySpanExporter,
) -> None:
    # An execute_tool span that ended in an error raised (the server not reached, the
    # call cut at its timeout) had ERROR status and no error.type (helper-169).
    from temporalio.exceptions import ApplicationError
    from temporalio.testing import ActivityEnvironment

    from activities.contract import NOT_SENT, ToolInput
    from activities.mcp_pool import Unreachable
    from activities.tools import ToolActivities

    class Down:
        async def call(self, *args: Any, **kwargs: Any) -> Any:
            raise Unreachable("connection refused")

    tools = ToolActivities(Down())  # type: ignore[arg-type]
    call = ToolInput(run_id="r1", server="s", tool="lookup", arguments="{}", call_id="c1")
    with pytest.raises(ApplicationError):
        await ActivityEnvironment().run(tools.call_tool, call)
    (span,) = named(spans, "execute_tool")
    assert span.status.status_code is StatusCode.ERROR
    assert attrs(span)["error.type"] == NOT_SENT


async def test_a_tool_call_cancelled_says_so_in_its_span(spans: InMemorySpanExporter) -> None:
    # A call cut by a cancellation (its run stopped, its worker shut down) ended with
    # no status and no error.type: it read as a call that went well.
    from temporalio.testing import ActivityEnvironment

    from activities.contract import ToolInput
    from activities.tools import ToolActivities

    began = asyncio.Event()

    class Slow:
        async def call(self, *args: Any, **kwargs: Any) -> Any:
            began.set()
            await asyncio.Event().wait()  # never answers

    env = ActivityEnvironment()
    tools = ToolActivities(Slow())  # type: ignore[arg-type]
    call = ToolInput(run_id="r1", server="s", tool="lookup", arguments="{}", call_id="c1")
    task = asyncio.ensure_future(env.run(tools.call_tool, call))
    await began.wait()
    env.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    (span,) = named(spans, "execute_tool")
    assert span.status.status_code is StatusCode.ERROR
    assert attrs(span)["error.type"] == "cancelled"


async def test_with_tracing_off_the_engine_gets_no_traceparent() -> None:
    assert telemetry.tracer() is None
    async with engine() as (url, recorder), gateway(endpoint("e0", url)) as (client, _):
        r = await client.post("/v1/chat/completions", json=chat(max_tokens=2))
        assert r.status_code == 200
    (sent,) = recorder.headers
    assert "traceparent" not in sent


async def test_with_tracing_off_decides_turns_pass_the_callers_context_on() -> None:
    # As a proxied turn's (README: "passed on as it came"); helper-146: decide's scored
    # turn and /classify sent none.
    assert telemetry.tracer() is None
    context = {"traceparent": TRACEPARENT, "tracestate": "vendor=1"}
    async with (
        engine(instant=True) as (url, generative),
        engine(models=("clf",), labels=("no", "yes"), instant=True) as (clf_url, classifier),
        gateway(
            endpoint("e0", url), endpoint("c", clf_url, kind="classifier", models=("clf",))
        ) as (client, _),
    ):
        for body in ({"input": "spam?", "labels": ["yes", "no"]}, {"input": "a lovely day"}):
            r = await client.post("/v1/decide", json=body, headers=context)
            assert r.status_code == 200, r.text
        r = await client.post("/v1/decide", json={"input": "no context"})
        assert r.status_code == 200, r.text
    classified = [h for p, h, _ in classifier.posts if p == "/classify"]
    for sent in (generative.headers[0], classified[0]):
        assert (sent["traceparent"], sent["tracestate"]) == (TRACEPARENT, "vendor=1")
    assert "traceparent" not in classified[1]


# --------------------------------------------------------------------------- a run


async def test_a_run_is_one_trace_of_agent_turns_and_tool_calls(
    temporal_address: str, spans: InMemorySpanExporter
) -> None:
    async with runs_harness.stack(temporal_address) as s:
        seen_by_tool: list[int] = []
        begin = s.mcp.begin

        def traced_begin(tool: str, arguments: Any) -> tuple[str, str]:
            # The fake MCP server runs in this process: the MCP SDK's server span (a
            # non-recording one here) continues the `_meta.traceparent` it was sent.
            seen_by_tool.append(trace.get_current_span().get_span_context().trace_id)
            return begin(tool, arguments)

        s.mcp.begin = traced_begin  # type: ignore[method-assign]
        spec = RunSpec(task=runs_harness.task_with(1), model=runs_harness.MODEL, tools=["lookup"])
        handle = await s.runs.spawn(spec)
        (status,) = await s.runs.wait([handle], timeout=60)
        assert status.state == "Completed", status
        await until(lambda: len(named(spans, "chat ")) >= 2, "both chat spans ended")

    (agent,) = named(spans, "invoke_agent ")
    assert agent.name == "invoke_agent AgentRun" and agent.context is not None
    a = attrs(agent)
    assert a["gen_ai.operation.name"] == "invoke_agent"
    assert a["gen_ai.conversation.id"] == handle == a["luftpause.run_id"] == a["gen_ai.agent.id"]
    assert a["gen_ai.request.model"] == runs_harness.MODEL  # (helper-169: it had none)
    run_trace = agent.context.trace_id

    (tool,) = named(spans, "execute_tool ")
    assert tool.name == "execute_tool lookup" and tool.context is not None
    t = attrs(tool)
    assert t["gen_ai.operation.name"] == "execute_tool" and t["gen_ai.tool.name"] == "lookup"
    assert tool.status.status_code is not StatusCode.ERROR
    assert tool.context.trace_id == run_trace

    chats = named(spans, "chat ")
    assert len(chats) == 2  # a turn that calls the tool, then the answer
    assert {c.context.trace_id for c in chats if c.context is not None} == {run_trace}
    assert all(attrs(c)["luftpause.run_id"] == handle for c in chats)
    assert seen_by_tool == [run_trace]
    # Started by a client without tracing: the run is still one trace, Temporal's spans
    # (StartActivity, RunActivity, CompleteWorkflow) included, and its span is the root:
    # every other span descends from it, and it lasts from the run's start to its close.
    assert {s.context.trace_id for s in spans.get_finished_spans() if s.context} == {run_trace}
    assert agent.parent is None
    others = [s for s in spans.get_finished_spans() if s is not agent]
    assert all(descends_from(spans, s, agent) for s in others), [s.name for s in others]
    assert agent.start_time is not None and agent.end_time is not None
    assert all(agent.start_time <= (s.start_time or 0) for s in chats + [tool])
    assert all(agent.end_time >= (s.end_time or 0) for s in chats + [tool])
    assert a["luftpause.state"] == "Completed" and agent.status.status_code is StatusCode.UNSET
    assert (a["luftpause.turns"], a["luftpause.tool_calls"]) == (2, 1)
    assert a["gen_ai.usage.input_tokens"] == sum(
        attrs(c)["gen_ai.usage.input_tokens"] for c in chats
    )
    assert a["gen_ai.usage.output_tokens"] == sum(
        attrs(c)["gen_ai.usage.output_tokens"] for c in chats
    )
    # Required by the conventions; it had none (helper-201).  The engine is the
    # gateway's choice: the turn's answer names its kind, as the turn's chat span does.
    assert a["gen_ai.provider.name"] == "sglang"
    assert {attrs(c)["gen_ai.provider.name"] for c in chats} == {"sglang"}


async def test_each_span_of_a_run_that_continues_as_new_names_its_provider(
    tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    # An execution that continues as new records a span of its own, which says nothing
    # of how the run ended (the next one does) but is an invoke_agent span all the same:
    # it names the provider of its turns.  One that made no turn (here the first, which
    # the server tells to continue as new once it has listed the tools) names none.
    setting = "limit.historyCount.suggestContinueAsNew=20"
    with runs_harness.dev_server_with(tmp_path, setting) as server:
        async with runs_harness.stack(server.address) as s:
            task = runs_harness.task_with(3, "long")
            spec = RunSpec(task=task, model=runs_harness.MODEL, tools=["lookup"])
            handle = await s.runs.spawn(spec)
            (status,) = await s.runs.wait([handle], timeout=60)
            assert status.state == "Completed", status
            agents = named(spans, "invoke_agent ")
            turned: dict[str, bool] = {}  # by execution: whether it made a turn
            for agent in agents:
                execution = str(attrs(agent)["temporalRunID"])
                one = s.client.get_workflow_handle(handle, run_id=execution)
                turned[execution] = any(
                    e.activity_task_scheduled_event_attributes.activity_type.name == "llm_turn"
                    for e in (await one.fetch_history()).events
                )

    named_by = {
        str(attrs(a)["temporalRunID"]): attrs(a).get("gen_ai.provider.name") for a in agents
    }
    assert named_by == {e: "sglang" if made else None for e, made in turned.items()}
    continued = [a for a in agents if attrs(a).get("luftpause.end") == "continued_as_new"]
    assert any(turned[str(attrs(a)["temporalRunID"])] for a in continued), turned


class _NamedTurns:
    """Stand-in activities (under the real names) whose turns name the engines of
    `providers`, one a turn: a `lookup` call each, the last an answer."""

    def __init__(self, *providers: str) -> None:
        self.providers = providers

    @activity.defn(name="list_tools")
    async def list_tools(self, wanted: ToolsWanted | None = None) -> list[ToolInfo]:
        return [ToolInfo("fake", "lookup", "look up", {"type": "object"}, read_only=True)]

    @activity.defn(name="end_run")
    async def end_run(self, end: EndRunInput) -> None:
        pass

    @activity.defn(name="call_tool")
    async def call_tool(self, call: ToolInput) -> ToolOutput:
        return ToolOutput("ok", False, True)

    @activity.defn(name="llm_turn")
    async def llm_turn(self, turn: TurnInput) -> TurnOutput:
        n = sum(m["role"] == "assistant" for m in turn.messages)
        provider = self.providers[n]
        if n == len(self.providers) - 1:
            return TurnOutput(
                {"role": "assistant", "content": "done"}, [], "stop", provider=provider
            )
        call = ToolCall(f"call-{n}", "lookup", "{}")
        function = {"name": call.name, "arguments": call.arguments}
        message = {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": function}
        ]}  # fmt: skip
        return TurnOutput(message, [call], "tool_calls", provider=provider)


async def test_a_runs_span_names_the_first_provider_its_turns_name(
    temporal_address: str, spans: InMemorySpanExporter
) -> None:
    # As the gateway's run span does: the first engine's, for one value however many
    # kinds of engine the run's turns go to.  A turn whose answer names none (a gateway
    # from before the header, a peer router) leaves it to the next.
    client = await Client.connect(temporal_address, interceptors=telemetry.temporal_interceptors())
    queue = f"providers-{uuid.uuid4().hex[:8]}"
    runs = Runs(client, task_queue=queue)
    async with runs_harness.stand_in_worker(client, queue, _NamedTurns("", "vllm", "sglang")):
        await runs_harness.until(runs._worker_polls, "the worker polls")
        handle = await runs.spawn(RunSpec(task="t", model="m", tools=["lookup"]))
        (status,) = await runs.wait([handle], timeout=60)
    assert status.state == "Completed" and status.usage.turns == 3, status
    (agent,) = named(spans, "invoke_agent ")
    assert attrs(agent)["gen_ai.provider.name"] == "vllm"


async def test_a_run_started_in_a_trace_continues_it(
    temporal_address: str, spans: InMemorySpanExporter
) -> None:
    # As the gateway's MCP door starts runs: a client with the tracing interceptor.
    async with runs_harness.stack(temporal_address) as s:
        client = await Client.connect(
            temporal_address, interceptors=telemetry.temporal_interceptors()
        )
        runs = Runs(client, task_queue=s.task_queue)
        tracer = telemetry.tracer()
        assert tracer is not None
        with tracer.start_as_current_span("caller") as caller:
            spec = RunSpec(task=runs_harness.task_with(0), model=runs_harness.MODEL)
            handle = await runs.spawn(spec)
        (status,) = await runs.wait([handle], timeout=60)
        assert status.state == "Completed", status
        await until(lambda: bool(named(spans, "chat ")), "the chat span ended")

    caller_trace = caller.get_span_context().trace_id
    (start,) = named(spans, "StartWorkflow:AgentRun")
    (agent,) = named(spans, "invoke_agent ")
    (chat_span,) = named(spans, "chat ")
    assert start.context is not None and start.context.trace_id == caller_trace
    assert agent.parent is not None and agent.parent.span_id == start.context.span_id
    assert chat_span.context is not None and chat_span.context.trace_id == caller_trace
    assert descends_from(spans, chat_span, agent)


async def test_a_runs_span_is_one_across_a_worker_restart(
    temporal_address: str, spans: InMemorySpanExporter
) -> None:
    # The run's span is recorded when it closes, by whichever worker closes it; the spans
    # the first worker made before the restart are its children all the same.
    async with runs_harness.stack(temporal_address, worker=False) as s:
        mcp = f"{s.mcp_url}/mcp"
        spec = RunSpec(
            task=runs_harness.task_with(1, "restart"),
            model=runs_harness.MODEL,
            tools=["delete_record"],
        )
        async with runs_harness.run_worker(s.client, s.task_queue, s.gateway_url, mcp):
            handle = await s.runs.spawn(spec)
            await runs_harness.until(
                lambda: runs_harness.state_is(s, handle, "AwaitingApproval"), "it asks"
            )
            before = {x.context.span_id for x in spans.get_finished_spans() if x.context}
        assert not named(spans, "invoke_agent ")  # open runs have no span yet
        async with runs_harness.run_worker(s.client, s.task_queue, s.gateway_url, mcp):
            await s.runs.approve(handle, True)
            (status,) = await s.runs.wait([handle], timeout=60)
        assert status.state == "Completed", status

    (agent,) = named(spans, "invoke_agent ")
    first_chat = next(c for c in named(spans, "chat ") if c.context and c.context.span_id in before)
    assert descends_from(spans, first_chat, agent)  # made by the first worker
    (tool,) = named(spans, "execute_tool ")
    assert descends_from(spans, tool, agent)  # by the second
    assert agent.start_time is not None and first_chat.start_time is not None
    assert agent.start_time <= first_chat.start_time


async def test_a_failed_run_is_an_error_span(
    temporal_address: str, spans: InMemorySpanExporter
) -> None:
    async with runs_harness.stack(temporal_address) as s:
        handle = await s.runs.spawn(RunSpec(task="hello", model="no-such-model"))
        (status,) = await s.runs.wait([handle], timeout=60)
    assert status.state == "Failed", status
    (agent,) = named(spans, "invoke_agent ")
    a = attrs(agent)
    assert a["luftpause.state"] == "Failed" and a["error.type"] == "Failed"
    assert agent.status.status_code is StatusCode.ERROR
    assert "no-such-model" in (agent.status.description or "")
    # Refused before an engine was chosen: no provider, as the gateway's run span has none.
    assert "gen_ai.provider.name" not in a


# --------------------------------------------------------------------------- setup


def test_setup_does_nothing_without_an_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    assert telemetry.setup("luftpause-test") is None
    assert telemetry.tracer() is None


@pytest.mark.parametrize(
    ("name", "value"),
    [("OTEL_EXPORTER_OTLP_ENDPOINT", "notaurl"),
     ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "localhost:4318")],
)  # fmt: skip
def test_an_endpoint_that_is_no_url_is_refused_at_setup(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    # helper-127: taken, it failed every export later ("No scheme supplied").
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.setenv(name, value)
    with pytest.raises(telemetry.TracingError, match=f"tracing: {name}='{value}': expected an"):
        telemetry.setup("luftpause-test")
    assert telemetry.tracer() is None


class _Collector(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP trace receiver: keeps each request's spans."""

    received: ClassVar[list[ExportTraceServiceRequest]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        self.received.append(request)
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.mark.parametrize("service_env", [None, "custom-name"])
def test_setup_exports_over_otlp_http(service_env: str | None) -> None:
    # In a subprocess: setup() sets the process-wide provider, which is set once only.
    _Collector.received = []
    server = http.server.HTTPServer(("127.0.0.1", 0), _Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{server.server_port}"
        if service_env is not None:
            env["OTEL_SERVICE_NAME"] = service_env
        script = textwrap.dedent(
            """
            from luftpause import telemetry
            assert telemetry.setup("luftpause-test") is not None
            tracer = telemetry.tracer()
            assert tracer is not None
            with tracer.start_as_current_span("hello"):
                pass
            telemetry.shutdown()
            assert telemetry.tracer() is None
            """
        )
        subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60)
    finally:
        server.shutdown()
        server.server_close()
    (request,) = _Collector.received
    (resource_spans,) = request.resource_spans
    service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}[
        "service.name"
    ]
    assert service == (service_env or "luftpause-test")
    names = [s.name for scope in resource_spans.scope_spans for s in scope.spans]
    assert names == ["hello"]


def test_a_collector_that_never_answers_delays_a_stop_by_the_flush_timeout_at_most() -> None:
    # The exporter's own timeout (10 s, and its retries) was not bounded by the flush's:
    # a gateway under `up` was killed past its stop timeout (helper-101: 7-10 s).
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # connections complete in the backlog; nothing ever answers
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{silent.getsockname()[1]}"
        script = textwrap.dedent(
            """
            import os, time
            from luftpause import telemetry
            telemetry.setup("luftpause-test")
            with telemetry.tracer().start_as_current_span("hello"):
                pass
            began = time.monotonic()
            telemetry.flush(0.5)
            telemetry.shutdown(0.5)
            print(round(time.monotonic() - began, 2), flush=True)
            os._exit(0)  # as the CLI leaves
            """
        )
        out = subprocess.run(
            [sys.executable, "-c", script],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    waited = float(out.stdout.strip())
    assert waited < 3.0, (waited, out.stderr)  # 0.5 s each, not the exporter's 10 s
    assert "were not exported within 0.5 s" in out.stderr


def test_the_gateway_exports_no_http_spans_and_no_token(tmp_path: Path) -> None:
    # helper-68: with a tracer provider set, FastAPI traced every request outside the
    # turn paths as an HTTP span with its `url.query`: opening the status page as
    # documented (`/?token=...`) exported the operator's token to the collector, and
    # each /metrics scrape added spans of its own.
    _Collector.received = []
    collector = http.server.HTTPServer(("127.0.0.1", 0), _Collector)
    thread = threading.Thread(target=collector.serve_forever, daemon=True)
    thread.start()
    token = "s3cret-token-for-the-page"
    port = free_port()
    config = tmp_path / "luftpause.toml"
    config.write_text(
        f'token = "{token}"\n[[endpoints]]\nname = "e"\nurl = "http://127.0.0.1:9"\n'
        f'kind = "openai"\nmodels = ["{MODEL}"]\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{collector.server_port}"
    exe = str(Path(sys.executable).parent / "luftpause")
    gw = Child("gateway", [exe, "gateway", "--config", str(config), "--port", str(port)],
               tmp_path / "gateway.log", env)  # fmt: skip
    try:
        gw.start()
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/health", "the gateway", gw)
        assert httpx.get(f"{base}/?token={token}", timeout=10).status_code == 200
        assert httpx.get(f"{base}/status?token={token}", timeout=10).status_code == 401
        for _ in range(3):
            assert httpx.get(f"{base}/metrics", timeout=10).status_code == 200
        # A turn no healthy replica can take: the gateway's own (error) span is
        # exported, so the export itself works.
        r = httpx.post(
            f"{base}/v1/chat/completions",
            json=chat(),
            headers={"authorization": f"Bearer {token}"},
            timeout=30,
        )
        assert r.status_code == 503
    finally:
        assert gw.stop() in (0, -signal.SIGTERM)  # its exporter flushes on the way out
        collector.shutdown()
        collector.server_close()
    spans = [
        span
        for request in _Collector.received
        for resource in request.resource_spans
        for scope in resource.scope_spans
        for span in scope.spans
    ]
    names = {span.name for span in spans}
    assert "chat" in names, names  # (refused, so not named for its model)
    assert not any(name.startswith(("GET ", "POST ", "HEAD ")) for name in names), names
    assert not any(token.encode() in request.SerializeToString() for request in _Collector.received)


async def test_a_run_started_without_a_trace_is_sampled_as_configured(
    temporal_address: str,
) -> None:
    # Its trace's root is the run's span: the sampler decides, and the run's spans
    # (Temporal's, the tool's, the gateway's) follow that decision.
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(ALWAYS_OFF))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry.use(provider)
    try:
        async with runs_harness.stack(temporal_address) as s:
            spec = RunSpec(
                task=runs_harness.task_with(1), model=runs_harness.MODEL, tools=["lookup"]
            )
            (status,) = await s.runs.wait([await s.runs.spawn(spec)], timeout=60)
            assert status.state == "Completed", status
    finally:
        telemetry.use(None)
        provider.shutdown()
    assert exporter.get_finished_spans() == ()


def test_a_runs_span_is_recorded_once_however_often_its_close_runs() -> None:
    # A closing workflow task that Temporal turns back (a signal came meanwhile) runs,
    # and closes the run, again on the worker.
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = telemetry._RunTracing(provider.get_tracer("test"))
    ids = SpanContext(
        int(TRACE_ID, 16), int(PARENT_SPAN_ID, 16), is_remote=True, trace_flags=TraceFlags(1)
    )
    span = telemetry._RunSpan("invoke_agent AgentRun", ids, None, 1, 2, {}, None)
    for _ in range(3):
        tracing._record_run_span(span)
    assert [s.name for s in exporter.get_finished_spans()] == ["invoke_agent AgentRun"]
