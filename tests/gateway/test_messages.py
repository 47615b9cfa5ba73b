"""The Anthropic Messages door (`/v1/messages`, Claude Code's API) end to end over real
loopback HTTP: the official Anthropic SDK in front of the gateway, fake engines of each
flavor (and tiny upstream apps) behind it."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import re
from types import SimpleNamespace
from typing import Any

import anthropic
import httpx
import pytest
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from harness import (
    MODEL,
    RUN,
    Recorder,
    answered_health,
    chat,
    closed_port_url,
    endpoint,
    engine,
    gateway,
    models_only,
    raw_engine,
    tool_task,
    until,
)
from starlette.types import Receive, Scope, Send

import gateway.app as app_module
from gateway._proxy import MessagesWatch
from gateway._shell import AdmissionShell
from gateway.decide import ClassifierLoad, Spread
from scheduler import Policy, RunPhase
from testkit.loopback import serve

TOOLS: list[Any] = [
    {
        "name": "lookup",
        "description": "Look something up.",
        "input_schema": {
            "type": "object",
            "properties": {"query": {"type": "string"}},
            "required": ["query"],
        },
    }
]


def client(gw: httpx.AsyncClient, **kw: Any) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=str(gw.base_url), max_retries=0, **kw)


async def ask(
    claude: anthropic.AsyncAnthropic, messages: list[Any], *, stream: bool
) -> tuple[anthropic.types.Message, str]:
    """One turn as Claude Code makes it; the answer and the run id it was given."""
    extra = {"fake_max_tool_calls": 3}
    if stream:
        async with claude.messages.stream(
            model=MODEL, max_tokens=300, messages=messages, tools=TOOLS, extra_body=extra
        ) as s:
            async for _ in s:
                pass
            return await s.get_final_message(), s.response.headers[RUN]
    raw = await claude.messages.with_raw_response.create(
        model=MODEL, max_tokens=300, messages=messages, tools=TOOLS, extra_body=extra
    )
    return await raw.parse(), raw.headers[RUN]


async def tool_loop(
    claude: anthropic.AsyncAnthropic, shell: AdmissionShell, task: str
) -> tuple[list[str], list[anthropic.types.Usage]]:
    """Drive a run until the model answers, streaming every other turn; check that the
    run is paused on its tool between turns.  Each turn's run id and usage."""
    messages: list[Any] = [{"role": "user", "content": task}]
    ids, usages = [], []
    for n in range(10):
        message, run_id = await ask(claude, messages, stream=n % 2 == 0)
        ids.append(run_id)
        usages.append(message.usage)
        if message.stop_reason != "tool_use":
            assert shell.state.runs[run_id].phase is RunPhase.IDLE
            return ids, usages
        # The stop reason reached the core: the run waits on its tool, not idle.
        assert shell.state.runs[run_id].phase is RunPhase.PAUSED
        messages.append({"role": "assistant", "content": [b.model_dump() for b in message.content]})
        results = [
            {"type": "tool_result", "tool_use_id": b.id, "content": "found it"}
            for b in message.content
            if b.type == "tool_use"
        ]
        messages.append({"role": "user", "content": results})
    raise AssertionError("the run never ended")


def metric(text: str, name: str) -> float:
    """The sum of a counter's samples in a Prometheus exposition."""
    return sum(float(m) for m in re.findall(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M))


@pytest.mark.parametrize("flavor", ["sglang", "vllm", "llamacpp"])
async def test_a_claude_code_tool_loop_is_one_run_with_its_usage_read(flavor: str) -> None:
    async with (
        engine(time_scale=50, flavor=flavor) as (url, recorder),
        gateway(endpoint("a", url, kind=flavor)) as (gw, shell),
    ):
        async with client(gw, api_key="any") as claude:
            ids, usages = await tool_loop(claude, shell, tool_task(2))
        # Joined by the tool use ids its tool results echo, as chat turns by theirs.
        assert len(ids) >= 3 and len(set(ids)) == 1
        assert {path for path, _, _ in recorder.posts} == {"/v1/messages"}
        # Each engine puts usage elsewhere, all net of the cache as Anthropic's (SGLang's
        # since 0.5.19); the core got the engine's figures.
        cached = sum(u.cache_read_input_tokens or 0 for u in usages)
        prompt = sum(u.input_tokens + (u.cache_read_input_tokens or 0) for u in usages)
        text = (await gw.get("/metrics")).text
        assert metric(text, "luftpause_prompt_tokens_total") == prompt
        assert metric(text, "luftpause_cached_tokens_total") == cached > 0  # a growing prefix
        assert metric(text, "luftpause_completion_tokens_total") == sum(
            u.output_tokens for u in usages
        )


async def test_the_api_key_header_carries_the_token_and_neither_reaches_the_engine() -> None:
    async with (
        engine(time_scale=50) as (url, recorder),
        gateway(endpoint("a", url), token="s3cret") as (gw, _),
    ):
        body = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
        # Claude Code sends ANTHROPIC_API_KEY as x-api-key, ANTHROPIC_AUTH_TOKEN as Bearer.
        # (Claude Code asks for /v1/messages?beta=true.)
        for headers, path in (
            ({"x-api-key": "s3cret"}, "/v1/messages?beta=true"),
            ({"authorization": "Bearer s3cret"}, "/v1/messages"),
        ):
            sent = headers | {"anthropic-version": "2023-06-01", "anthropic-beta": "a,b"}
            r = await gw.post(path, json=body, headers=sent)
            assert r.status_code == 200, r.text
            assert r.json()["type"] == "message"
        wrong = await gw.post("/v1/messages", json=body, headers={"x-api-key": "nope"})
        assert wrong.status_code == 401
        assert wrong.json() == {
            "type": "error",
            "error": {
                "type": "authentication_error",
                "message": "missing or wrong token: the gateway's token, in x-api-key or as "
                "a bearer token",
            },
        }
        # Other methods on the Anthropic paths: its key, its error shape.
        r = await gw.get("/v1/messages", headers={"x-api-key": "s3cret"})
        assert (r.status_code, r.headers["allow"]) == (405, "POST")
        assert r.json()["error"]["type"] == "api_error" and "POST /v1/messages" in r.text
        # x-api-key is the Anthropic API's header, not the OpenAI one's.
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        r = await gw.post("/v1/chat/completions", json=chat, headers={"x-api-key": "s3cret"})
        assert r.status_code == 401
        assert len(recorder.posts) == 2
        for _, headers, _ in recorder.posts:
            assert "x-api-key" not in headers and "authorization" not in headers
            assert headers["anthropic-version"] == "2023-06-01"
            assert headers["anthropic-beta"] == "a,b"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{", "request body is not valid JSON"),
        (b'{"messages": [{"role": "user", "content": "x"}]}', "'model' is required"),
        (b'{"model": "m", "messages": []}', "'messages' is required and must be a non-empty"),
        (
            b'{"model": "m", "max_tokens": "lots", "messages": [{"role": "user", "content": "x"}]}',
            "'max_tokens' must be a positive integer, got 'lots'",
        ),
    ],
)
async def test_malformed_requests_are_anthropic_shaped_400s(body: bytes, message: str) -> None:
    async with engine() as (url, recorder), gateway(endpoint("a", url)) as (gw, _):
        r = await gw.post("/v1/messages", content=body)
        assert r.status_code == 400
        error = r.json()["error"]
        assert r.json()["type"] == "error" and error["type"] == "invalid_request_error"
        assert message in error["message"]
        assert re.fullmatch("[0-9a-f]{32}", r.headers[RUN])
        assert recorder.posts == []
        # The official client shows the message.
        with pytest.raises(anthropic.BadRequestError, match="'messages' is required"):
            async with client(gw, api_key="k") as claude:
                await claude.messages.create(model=MODEL, max_tokens=5, messages=[])


async def test_a_model_any_replica_of_which_lacks_the_api_is_refused_before_queueing() -> None:
    async with (
        engine(time_scale=50) as (url, recorder),
        serve(models_only()) as other,
        gateway(endpoint("engine", url), endpoint("hosted", other, kind="openai")) as (gw, shell),
    ):
        body = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
        r = await gw.post("/v1/messages", json=body)
        assert r.status_code == 404
        assert r.json()["error"]["type"] == "not_found_error"
        assert "replicas that do not take the Anthropic Messages API (hosted:" in r.text
        assert recorder.posts == [] and not shell.state.turns
        unknown = await gw.post("/v1/messages", json=body | {"model": "nope"})
        assert unknown.status_code == 404
        assert unknown.json()["error"]["message"] == (
            f"no generative replica serves model 'nope' (served: {MODEL})"
        )
        # A client's base URL with /v1, where the client adds it: said so, in its shape.
        r = await gw.post("/v1/v1/messages", json=body)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        assert "its base URL is the gateway's root" in r.json()["error"]["message"]


async def test_count_tokens_passes_over_a_replica_ejected_for_failing_turns() -> None:
    # helper-116: count_tokens went to the first healthy replica by its probe, an
    # ejected one included (failing turns while its health check passes).
    def app(n: int, chat_status: int) -> Any:
        a = models_only()

        @a.post("/v1/messages/count_tokens")
        async def count(request: Request) -> Response:
            return Response(json.dumps({"input_tokens": n}), media_type="application/json")

        @a.post("/v1/chat/completions")
        async def chat_(request: Request) -> Response:
            return Response(json.dumps({"error": {"message": "CUDA"}}), chat_status)

        return a

    policy = Policy(eject_after_failures=1, eject_for_s=60)
    async with (
        serve(app(1, 500)) as bad,
        serve(app(2, 500)) as good,
        gateway(
            endpoint("a", bad, kind="openai", messages=True),
            endpoint("b", good, kind="openai", messages=True),
            policy=policy,
        ) as (gw, shell),
    ):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        assert (await gw.post("/v1/messages/count_tokens", json=body)).status_code == 200
        r = await gw.post("/v1/chat/completions", json={**body, "max_tokens": 4})
        assert r.status_code == 500
        assert shell.state.replicas["a"].ejected_until is not None  # a failed its turn
        # (Several: counts are spread over the replicas in rotation, ties in turn.)
        for _ in range(4):
            r = await gw.post("/v1/messages/count_tokens", json=body)
            assert r.json()["input_tokens"] == 2


async def test_count_tokens_are_spread_over_the_replicas_and_pass_a_loaded_one() -> None:
    # helper-190: every count went to the replica whose name sorted first, beside its
    # turns (Claude Code counts often).  As a router spreads what is no turn: over the
    # replicas of the model, the least loaded first, ties in turn.
    path = "/v1/messages/count_tokens"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}

    def counts(recorder: Recorder) -> int:
        return sum(p == path for p, _, _ in recorder.posts)

    async with (
        engine(time_scale=50) as (url_a, a),
        engine(time_scale=50) as (url_b, b),
        gateway(endpoint("a", url_a), endpoint("b", url_b)) as (gw, shell),
    ):
        for _ in range(6):
            assert (await gw.post(path, json=body)).status_code == 200
        assert (counts(a), counts(b)) == (3, 3)
        # A turn in flight on a (its engine's clock stands still): counts go to b.
        a.app.state.clock.stop()
        turn = asyncio.create_task(gw.post("/v1/chat/completions", json=chat(max_tokens=4)))
        try:
            await until(lambda: shell.state.replicas["a"].in_flight == 1, "a turn on a")
            for _ in range(4):
                assert (await gw.post(path, json=body)).status_code == 200
            assert (counts(a), counts(b)) == (3, 7)
        finally:
            a.app.state.clock.go()
            assert (await turn).status_code == 200


async def test_a_count_passes_a_replica_at_its_limit_for_one_with_room() -> None:
    # Fewer turns in flight, but as many as its engine runs at once (its slots): the
    # count goes where there is room, beside more turns.
    path = "/v1/messages/count_tokens"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}

    def in_flight(shell: AdmissionShell) -> tuple[int, int]:
        replicas = shell.state.replicas  # (a new state each step: read it each time)
        return replicas["a"].in_flight, replicas["b"].in_flight

    async with (
        engine(time_scale=50) as (url_a, a),
        engine(time_scale=50) as (url_b, b),
        gateway(endpoint("a", url_a, slots=1), endpoint("b", url_b, slots=8)) as (gw, shell),
    ):
        a.app.state.clock.stop()
        b.app.state.clock.stop()
        turns = [
            asyncio.create_task(gw.post("/v1/chat/completions", json=chat(f"t{i}", max_tokens=4)))
            for i in range(3)
        ]
        try:
            await until(lambda: in_flight(shell) == (1, 2), "a full with one turn, b with two")
            assert shell.state.replicas["a"].limit == 1
            assert (await gw.post(path, json=body)).status_code == 200
            assert [p for p, _, _ in b.posts if p == path] == [path]
            assert path not in [p for p, _, _ in a.posts]
        finally:
            a.app.state.clock.go()
            b.app.state.clock.go()
            for t in turns:
                assert (await t).status_code == 200


def _spread(load: Any, pick: Any, sets: list[list[str]], rounds: int) -> dict[str, int]:
    """How often each endpoint is picked, the sets asked in turn `rounds` times."""
    chosen: dict[str, int] = {}
    for _ in range(rounds):
        for names in sets:
            name = pick([SimpleNamespace(name=n) for n in names])
            with load.using(name):
                chosen[name] = chosen.get(name, 0) + 1
    return chosen


def test_requests_tied_on_load_are_taken_in_turn_whatever_the_set() -> None:
    # helper-194: ties went by a counter shared by every set of replicas, modulo the
    # set's size: with two models' counts alternating, one replica of each got them
    # all; with one of three replicas down, the other two got them 2:1.  Counts and
    # /v1/decide's classify requests spread alike (gateway.decide.Spread).
    counts, classify = app_module._CountLoad(), ClassifierLoad()
    picks = [
        (counts, lambda es: counts.target(es, {"a"}, {}).name),
        (classify, lambda es: classify.order(es, {"a"})[0].name),
    ]
    for load, pick in picks:
        two_models = _spread(load, pick, [["x1", "x2"], ["y1", "y2"]], 50)
        assert two_models == dict.fromkeys(("x1", "x2", "y1", "y2"), 25)
        assert _spread(load, pick, [["a", "b", "c"]], 30) == {"b": 15, "c": 15}


async def test_an_engines_own_499_to_a_count_is_its_answer() -> None:
    # A 499 the engine (or a router before it) answers is passed on as its answer, and
    # its span says the engine answered it, not that the client left (helper-196).
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from luftpause import telemetry

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = models_only()

    @app.post("/v1/messages/count_tokens")
    async def count(request: Request) -> Response:
        return Response('{"error": "closed"}', status_code=499, media_type="application/json")

    telemetry.use(provider)
    try:
        async with (
            serve(app) as url,
            gateway(endpoint("a", url, kind="openai", messages=True)) as (gw, _),
        ):
            body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
            r = await gw.post("/v1/messages/count_tokens", json=body)
            assert r.status_code == 499 and r.json() == {"error": "closed"}
    finally:
        telemetry.use(None)
        provider.shutdown()
    (span,) = exporter.get_finished_spans()
    assert span.attributes is not None
    assert span.attributes["http.response.status_code"] == 499
    assert span.attributes["error.type"] == "499"


def test_a_spread_remembers_a_bounded_number_of_endpoints() -> None:
    # helper-195: under DNS discovery every pod address ever seen is a replica's name,
    # and when each was last chosen was kept for good.  The least recent is forgotten.
    load = ClassifierLoad()
    for n in range(3 * Spread.KEPT):
        with load.using(f"pod-{n}"):
            pass
    assert load.last("pod-0") == -1 and load.last(f"pod-{3 * Spread.KEPT - 1}") > 0
    assert len(load._last) == Spread.KEPT


async def test_a_count_whose_client_left_closes_the_engines_request() -> None:
    # helper-190: a count had no watch on its client, as a turn has: one that left
    # kept the engine's request open up to the turn timeout (10 min), for nobody.  Its
    # span says the client left, as a turn's does, not that the engine answered 499
    # (helper-194).
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from luftpause import telemetry

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    asked, closed, released = asyncio.Event(), asyncio.Event(), asyncio.Event()
    app = models_only()

    @app.post("/v1/messages/count_tokens")
    async def count(request: Request) -> Response:
        await request.body()
        asked.set()
        # The body read, what comes next is the disconnect: the gateway closed the
        # request.  (Else `released` answers it: a gateway that keeps it open fails
        # the test at once, not after the turn timeout.)
        left = asyncio.ensure_future(request.receive())
        let_go = asyncio.ensure_future(released.wait())
        await asyncio.wait((left, let_go), return_when=asyncio.FIRST_COMPLETED)
        if left.done():
            closed.set()
        left.cancel()
        let_go.cancel()
        return Response(json.dumps({"input_tokens": 1}), media_type="application/json")

    telemetry.use(provider)
    try:
        async with (
            serve(app) as url,
            gateway(endpoint("a", url, kind="openai", messages=True)) as (gw, shell),
        ):
            assert shell.state.policy.turn_timeout_s == 600
            body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
            call = asyncio.create_task(gw.post("/v1/messages/count_tokens", json=body))
            try:
                await asyncio.wait_for(asked.wait(), 5)
                call.cancel()  # the client leaves: its connection to the gateway closes
                with contextlib.suppress(asyncio.CancelledError):
                    await call
                await asyncio.wait_for(closed.wait(), 5)
            finally:
                released.set()
            # The gateway serves counts on.
            r = await gw.post("/v1/messages/count_tokens", json=body)
            assert r.status_code == 200 and r.json() == {"input_tokens": 1}
    finally:
        telemetry.use(None)
        provider.shutdown()
    spans = [dict(span.attributes or {}) for span in exporter.get_finished_spans()]
    (left,) = [a for a in spans if "error.type" in a]
    (served,) = [a for a in spans if "error.type" not in a]
    assert left["error.type"] == "client_left" and "http.response.status_code" not in left
    assert served["http.response.status_code"] == 200


async def test_count_tokens_for_a_model_whose_replicas_are_down_says_what_the_probe_found() -> None:
    # As a turn's 503: the replica's last probe's reason, not only its name.
    async with gateway(
        endpoint("down", closed_port_url(), kind="openai", messages=True), probe_period=None
    ) as (gw, shell):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        r = await gw.post("/v1/messages/count_tokens", json=body)
        assert r.status_code == 503 and r.json()["type"] == "error"
        assert r.json()["error"]["message"] == (
            f"no healthy replica serves model '{MODEL}' (unhealthy at their last probe: "
            "down); down: cannot connect (All connection attempts failed)"
        )
        turn = await gw.post("/v1/messages", json={**body, "max_tokens": 4})
        assert turn.json()["error"]["message"] == r.json()["error"]["message"]
        assert not shell.state.turns


@pytest.mark.parametrize(
    ("sent", "engine_gets"),
    [
        ("text/plain", "application/json"),
        ("application/x-www-form-urlencoded", "application/json"),
        ("application/json; charset=utf-8", "application/json; charset=utf-8"),
    ],
)
async def test_a_count_goes_to_the_engine_as_json_whatever_the_client_said(
    sent: str, engine_gets: str
) -> None:
    # A count is passed on as a turn is (f0e9829): the body luftpause parsed as JSON
    # goes as application/json, which vLLM and SGLang check, whatever the client said.
    # The turn's test (test_proxy) does not reach this route's own header.
    seen: list[str | None] = []
    app = models_only()

    @app.post("/v1/messages/count_tokens")
    async def count(request: Request) -> Response:
        seen.append(request.headers.get("content-type"))
        return Response(json.dumps({"input_tokens": 1}), media_type="application/json")

    async with (
        serve(app) as url,
        gateway(endpoint("a", url, kind="openai", messages=True)) as (gw, _),
    ):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        r = await gw.post(
            "/v1/messages/count_tokens", content=json.dumps(body), headers={"content-type": sent}
        )
        assert r.status_code == 200, r.text
    assert seen == [engine_gets]


async def test_count_tokens_is_passed_to_a_replica_and_is_no_turn() -> None:
    async with (
        engine(time_scale=50) as (url, recorder),
        serve(models_only()) as other,
        gateway(
            endpoint("a", url),
            endpoint("b", other, kind="openai", models=("other",), messages=True),
        ) as (gw, shell),
        client(gw, api_key="k") as claude,
    ):
        count = await claude.messages.count_tokens(
            model=MODEL, messages=[{"role": "user", "content": "x" * 400}]
        )
        assert count.input_tokens > 100  # the engine's count, not a made-up one
        assert [path for path, _, _ in recorder.posts] == ["/v1/messages/count_tokens"]
        assert not shell.state.turns and not shell.state.runs
        (_, headers, _) = recorder.posts[0]
        assert "x-api-key" not in headers and "authorization" not in headers
        raw = await claude.messages.with_raw_response.count_tokens(
            model=MODEL, messages=[{"role": "user", "content": "x"}]
        )
        assert RUN not in raw.headers  # no turn, no run
        # A header value beyond ASCII goes on as the client sent it (httpx would refuse
        # it as a str: a 500 before).
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        beta = b"caf\xe9-2025"
        r = await gw.post("/v1/messages/count_tokens", json=body, headers={"anthropic-beta": beta})
        assert r.status_code == 200 and r.json()["input_tokens"] > 0
        assert recorder.posts[-1][1]["anthropic-beta"] == beta.decode("latin-1")
        # An engine without the route answers 404, which Claude Code reads as "not
        # supported" (a made-up count would stop its compaction).
        with pytest.raises(anthropic.NotFoundError):
            await claude.messages.count_tokens(
                model="other", messages=[{"role": "user", "content": "x"}]
            )


@pytest.mark.parametrize("tracing", [False, True])
async def test_count_tokens_carries_the_callers_trace_context(tracing: bool) -> None:
    # As a turn's: the engine got none (helper-181).
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from luftpause import telemetry

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    if tracing:
        telemetry.use(provider)
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    try:
        async with engine(time_scale=50) as (url, recorder), gateway(endpoint("a", url)) as (gw, _):
            sent = {"traceparent": parent, "tracestate": "vendor=1"}
            r = await gw.post("/v1/messages/count_tokens", json=body, headers=sent)
            assert r.status_code == 200 and r.json()["input_tokens"] > 0
    finally:
        telemetry.use(None)
        provider.shutdown()
    (_, got, _) = recorder.posts[0]
    if tracing:
        (span,) = exporter.get_finished_spans()
        assert span.name == f"count_tokens {MODEL}"
        assert span.context is not None and span.parent is not None
        assert span.parent.span_id == int(parent.split("-")[2], 16)  # the caller's
        trace_id, span_id = got["traceparent"].split("-")[1:3]
        assert (int(trace_id, 16), int(span_id, 16)) == (
            span.context.trace_id,
            span.context.span_id,
        ), "the engine continues luftpause's span"
        assert span.attributes is not None
        assert span.attributes["http.response.status_code"] == 200
    else:
        assert (got["traceparent"], got["tracestate"]) == (parent, "vendor=1")
        assert not exporter.get_finished_spans()


async def test_a_count_its_engine_never_answered_names_how_it_failed() -> None:
    # semconv's HTTP client span: a request that got no response has no status code, and
    # its error.type names the failure; it read as the engine's 502, which was the
    # gateway's (helper-200).  An engine's own 502 is still one.
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import StatusCode

    from luftpause import telemetry

    released = asyncio.Event()

    async def hung(scope: Scope, receive: Receive, send: Send) -> None:
        if await answered_health(scope, send):
            return
        await released.wait()  # accepts the request, never answers

    failing = models_only()

    @failing.post("/v1/messages/count_tokens")
    async def bad_gateway(request: Request) -> Response:
        error = {"type": "error", "error": {"type": "api_error", "message": "no backend"}}
        return Response(json.dumps(error), 502, media_type="application/json")

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry.use(provider)
    answered = {}
    try:
        async with (
            raw_engine(None) as broken,
            serve(hung) as slow,
            serve(failing) as bad,
            gateway(
                endpoint("broken", broken, kind="openai", models=("m-broken",), messages=True),
                endpoint("slow", slow, kind="openai", models=("m-slow",), messages=True),
                endpoint("bad", bad, kind="openai", models=("m-502",), messages=True),
                policy=Policy(turn_timeout_s=0.5),
            ) as (gw, _),
        ):
            try:
                for model in ("m-broken", "m-slow", "m-502"):
                    body = {"model": model, "messages": [{"role": "user", "content": "x"}]}
                    r = await gw.post("/v1/messages/count_tokens", json=body)
                    answered[model] = r.status_code
            finally:
                released.set()
    finally:
        telemetry.use(None)
        provider.shutdown()
    assert answered == {"m-broken": 502, "m-slow": 502, "m-502": 502}
    spans = {s.name.removeprefix("count_tokens "): s for s in exporter.get_finished_spans()}
    for model, error in (("m-broken", "RemoteProtocolError"), ("m-slow", "ReadTimeout")):
        got = dict(spans[model].attributes or {})
        assert got["error.type"] == error, model
        assert "http.response.status_code" not in got, model
        assert spans[model].status.status_code is StatusCode.ERROR
        assert (spans[model].status.description or "").startswith(f"engine {model[2:]}: ")
    answer = dict(spans["m-502"].attributes or {})
    assert (answer["error.type"], answer["http.response.status_code"]) == ("502", 502)


async def test_count_tokens_passes_the_engines_headers_and_the_clients_query() -> None:
    # Only content-type and retry-after came back (README: "passed as it is"), and the
    # query string (Anthropic's `?beta=true`) was dropped (helper-76).
    seen: list[str] = []
    ids: list[str | None] = []
    app = models_only()

    @app.post("/v1/messages/count_tokens")
    async def count(request: Request) -> Response:
        seen.append(request.url.query)
        ids.append(request.headers.get("x-request-id"))
        headers = {"request-id": "req_1", "anthropic-ratelimit-requests-remaining": "9"}
        return Response(b'{"input_tokens": 3}', media_type="application/json", headers=headers)

    async with (
        serve(app) as url,
        gateway(endpoint("a", url, kind="openai", messages=True)) as (gw, _),
    ):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        r = await gw.post(
            "/v1/messages/count_tokens?beta=true", json=body, headers={"x-request-id": "rq-7"}
        )
        assert r.status_code == 200 and r.json() == {"input_tokens": 3}
        assert ids == ["rq-7"]  # as a turn's request id (helper-83: it was dropped)
        assert r.headers["request-id"] == "req_1"
        assert r.headers["anthropic-ratelimit-requests-remaining"] == "9"
        assert r.headers["content-type"] == "application/json"
        assert RUN not in r.headers and seen == ["beta=true"]


# An engine's error: Anthropic's event, llama.cpp's own event body (after its `event:`
# line, in a chunk of its own), and a 400 before any stream.
ANTHROPIC_ERROR = {"type": "error", "error": {"type": "overloaded_error", "message": "KV full"}}
LLAMACPP_ERROR = {"code": 500, "message": "KV full", "type": "server_error"}


def failing(how: str, seen: list[dict[str, str]]) -> Any:
    async def answer(request: Request) -> Response:
        seen.append(dict(request.headers))
        if how == "400":
            return Response(json.dumps(ANTHROPIC_ERROR), 400, media_type="application/json")

        async def events() -> Any:
            start = {"type": "message_start", "message": {"usage": {"input_tokens": 7}}}
            yield f"event: message_start\ndata: {json.dumps(start)}\n\n"
            yield "event: error\n"
            error = ANTHROPIC_ERROR if how == "anthropic" else LLAMACPP_ERROR
            yield f"data: {json.dumps(error)}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return answer


@pytest.mark.parametrize("how", ["anthropic", "llamacpp", "400"])
async def test_an_engines_error_fails_the_turn_and_reaches_the_client(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOSTED_KEY", "hosted-key")
    app, seen = models_only(), []
    app.post("/v1/messages")(failing(how, seen))
    async with serve(app) as url:
        hosted = endpoint("a", url, kind="openai", messages=True, api_key_env="HOSTED_KEY")
        async with gateway(hosted) as (gw, shell):
            body = {"model": MODEL, "max_tokens": 5, "stream": True, "messages": []}
            body["messages"] = [{"role": "user", "content": "x"}]
            r = await gw.post("/v1/messages", json=body, headers={"x-api-key": "client-key"})
            assert r.status_code == (400 if how == "400" else 200)
            assert "KV full" in r.text  # passed through unchanged
            # The endpoint's own key, where Anthropic-compatible hosts read it too.
            assert (seen[0]["x-api-key"], seen[0]["authorization"]) == (
                "hosted-key",
                "Bearer hosted-key",
            )
            text = (await gw.get("/metrics")).text
            # A 400 is the engine's answer about the request, not its failure, and an
            # "overloaded_error" event is Anthropic's 529, busy (as a 503 is); llama.cpp's
            # event names a 500.
            outcome = "failed" if how == "llamacpp" else "error_status"
            assert f'luftpause_engine_turns_total{{outcome="{outcome}",replica="a"}} 1.0' in text
            assert f'luftpause_turns_total{{outcome="{outcome}"}} 1.0' in text
            await until(lambda: not shell.state.turns, "the slot is freed")
            # Only the engine failing counts toward ejecting it.
            assert shell.state.replicas["a"].failures == (1 if how == "llamacpp" else 0)


def test_the_watch_reads_a_stream_cut_anywhere_and_not_the_models_text() -> None:
    look_alike = '{"type": "tool_use", "id": "toolu_9", "usage": {"input_tokens": 99}}'
    events = [
        {"type": "message_start", "message": {"usage": {"input_tokens": 10, "output_tokens": 0}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text"}},
        # Text that looks like a tool use or usage is the model's words, not the answer's.
        {"type": "content_block_delta", "index": 0, "delta": {"text": look_alike}},
        {
            "type": "content_block_start",
            "index": 1,
            "content_block": {"type": "tool_use", "id": "toolu_1", "name": "x", "input": {}},
        },
        {
            "type": "message_delta",
            "delta": {"stop_reason": "tool_use"},
            "usage": {"output_tokens": 12, "cache_read_input_tokens": 30},
        },
        {"type": "message_stop"},
    ]
    stream = "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events).encode()
    for cut in range(0, len(stream), 7):
        watch = MessagesWatch(sse=True)
        watch.feed(stream[:cut])
        watch.feed(stream[cut:])
        watch.close()
        assert (watch.finish_reason, watch.tool_call_ids) == ("tool_calls", ["toolu_1"])
        assert (watch.prompt_tokens, watch.cached_tokens, watch.completion_tokens) == (40, 30, 12)
        assert watch.error is None
    for error in (ANTHROPIC_ERROR, LLAMACPP_ERROR):
        failed = f"event: error\ndata: {json.dumps(error)}\n\n".encode()
        for cut in range(0, len(failed), 5):
            watch = MessagesWatch(sse=True)
            watch.feed(stream[: stream.index(b"\n\n") + 2])  # message_start
            watch.feed(failed[:cut])
            watch.feed(failed[cut:])
            assert watch.error == "KV full"
    # An error event with no data line is an error still (helper-63: it counted as
    # finished), and one whose data follows says what it was.
    bare = MessagesWatch(sse=True)
    bare.feed(stream[: stream.index(b"\n\n") + 2] + b"event: error\n\n")
    bare.close()
    assert bare.error == "an error event without data"
    whole = MessagesWatch(sse=False, input_counts_cached=True)
    whole.feed(json.dumps({"type": "message", "stop_reason": "max_tokens", "content": []}).encode())
    whole.feed(b'\n{"usage": {"input_tokens": 50, "cache_read_input_tokens": 30}}')
    whole.close()  # not one JSON value: nothing read, nothing raised
    assert whole.finish_reason is None
    body = {  # (some engines leave out the body's "type")
        "stop_reason": "end_turn",
        "content": [{"type": "tool_use", "id": "toolu_2"}],
        "usage": {"input_tokens": 50, "output_tokens": 2, "cache_read_input_tokens": 30},
    }
    whole = MessagesWatch(sse=False, input_counts_cached=True)
    whole.feed(json.dumps(body).encode())
    whole.close()
    # (vLLM's /v1/messages says end_turn beside tool_use blocks: the client runs them.)
    # An SGLang's JSON answer is read as since 0.5.19: its input net of the cache.
    assert (whole.finish_reason, whole.prompt_tokens, whole.cached_tokens) == (
        "tool_calls", 80, 30,
    )  # fmt: skip
    assert whole.tool_call_ids == ["toolu_2"]


def test_an_sglang_stream_is_read_as_its_version_reports_usage() -> None:
    # helper-198: SGLang 0.5.19 (deploy/'s) says input_tokens net of the cache in
    # message_start, beside cache_read_input_tokens; the gateway read it as an older
    # SGLang's, whose message_delta carried the whole prompt: a turn of 7,237 prompt
    # tokens, 6,336 cached, counted 6,336.
    def stream(*events: dict[str, Any]) -> bytes:
        return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events).encode()

    def start(usage: dict[str, int]) -> dict[str, Any]:
        return {"type": "message_start", "message": {"type": "message", "usage": usage}}

    def delta(usage: dict[str, int]) -> dict[str, Any]:
        return {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": usage}

    now = stream(
        start({"input_tokens": 901, "output_tokens": 0, "cache_read_input_tokens": 6336}),
        delta({"output_tokens": 5}),
        {"type": "message_stop"},
    )
    before = stream(
        start({"input_tokens": 0, "output_tokens": 0}),
        delta({"output_tokens": 5, "input_tokens": 7237, "cache_read_input_tokens": 6336}),
        {"type": "message_stop"},
    )
    for body in (now, before):
        watch = MessagesWatch(sse=True, input_counts_cached=True)
        watch.feed(body)
        watch.close()
        assert (watch.prompt_tokens, watch.cached_tokens) == (7237, 6336)


async def test_an_auxiliary_request_echoing_the_sessions_tool_calls_stays_out_of_its_run() -> None:
    async with engine(time_scale=50) as (url, _), gateway(endpoint("a", url)) as (gw, shell):
        session = {"x-claude-code-session-id": "sess-1"}
        async with client(gw, api_key="k", default_headers=session) as claude:
            messages: list[Any] = [{"role": "user", "content": tool_task(2)}]
            message, run_id = await ask(claude, messages, stream=False)
            assert run_id == "claude-code:sess-1" and message.stop_reason == "tool_use"
            messages.append(
                {"role": "assistant", "content": [b.model_dump() for b in message.content]}
            )
            messages.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": b.id, "content": "ok"}
                        for b in message.content
                        if b.type == "tool_use"
                    ],
                }
            )
            # A check on the conversation, as Claude Code's auxiliary requests make.
            raw = await claude.messages.with_raw_response.create(
                model=MODEL,
                max_tokens=20,
                messages=messages,
                extra_headers={"x-claude-code-request-class": "auxiliary"},
            )
            await raw.parse()
        assert raw.headers[RUN] != run_id  # a run of its own
        assert shell.state.runs[run_id].phase is RunPhase.PAUSED  # the session still waits


async def test_a_screenshot_is_a_screenshot_not_hundreds_of_thousands_of_tokens() -> None:
    # 768 KiB of PNG is 1 MB of base64: by bytes / 4, 262k "tokens", more than the KV
    # pool, held behind every run with KV on the replica (here a paused one).
    png = base64.b64encode(b"\x89PNG" + bytes(range(256)) * 3072).decode()
    async with (
        engine(time_scale=50) as (url, _),
        gateway(endpoint("a", url, kv_tokens=100_000)) as (gw, shell),
    ):
        async with client(gw, api_key="k") as claude:
            _, paused = await ask(claude, [{"role": "user", "content": tool_task(2)}], stream=False)
            assert shell.state.runs[paused].phase is RunPhase.PAUSED
            content = [
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/png", "data": png},
                },
                {"type": "text", "text": "what is in this screenshot?"},
            ]
            answered = await asyncio.wait_for(
                claude.messages.create(
                    model=MODEL, max_tokens=8, messages=[{"role": "user", "content": content}]
                ),
                10,
            )
        assert answered.stop_reason in ("end_turn", "max_tokens")


async def test_count_tokens_for_a_model_whose_replicas_are_all_down_is_503() -> None:
    async with (
        engine() as (url, _),
        gateway(endpoint("a", url), endpoint("dead", closed_port_url(), models=("down",))) as (
            gw,
            _,
        ),
    ):
        # Down from the start: the first probe, before the gateway serves, says so.
        body = {"model": "down", "messages": [{"role": "user", "content": "x"}]}
        r = await gw.post("/v1/messages/count_tokens", json=body)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["type"] == "overloaded_error"
        assert "no healthy replica serves model 'down'" in r.json()["error"]["message"]


def test_a_gateway_timeout_is_anthropics_timeout_error() -> None:
    from gateway._proxy import error_response

    r = error_response(504, "engine a: no answer within 1 s", "r", anthropic=True)
    assert json.loads(bytes(r.body)) == {
        "type": "error",
        "error": {"type": "timeout_error", "message": "engine a: no answer within 1 s"},
    }


def test_the_prompt_estimate_counts_an_inlined_image_as_one_image() -> None:
    from gateway.app import INLINE_IMAGE_TOKENS, _prompt_tokens

    data = base64.b64encode(bytes(range(256)) * 400).decode()  # ~137k characters
    text = "x" * 4000
    anthropic_first = {"type": "base64", "media_type": "image/png", "data": data}
    data_first = {"data": data, "type": "base64", "media_type": "image/jpeg"}
    url = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}
    pdf = {"type": "base64", "media_type": "application/pdf", "data": data}
    for part in (anthropic_first, data_first, url):
        raw = json.dumps({"messages": [{"content": [part, text]}]}).encode()
        assert _prompt_tokens(raw) == (len(raw) - len(data)) // 4 + INLINE_IMAGE_TOKENS, part
    raw = json.dumps({"messages": [{"content": [pdf, text]}]}).encode()
    assert _prompt_tokens(raw) == len(raw) // 4  # a document's text is what is read
    raw = json.dumps({"messages": [{"content": text}]}).encode()
    assert _prompt_tokens(raw) == len(raw) // 4


def _vllm_stream(start_usage: dict[str, int], end_usage: dict[str, int]) -> bytes:
    """A Messages stream as vLLM writes it since its PR #40912 (helper-83): the
    `message_start` before the engine's cache figure is known (the whole prompt in
    `input_tokens`, no cache fields), the final `message_delta` net of the cache."""
    events = [
        {
            "type": "message_start",
            "message": {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "content": [],
                "model": MODEL,
                "stop_reason": None,
                "usage": start_usage,
            },
        },
        {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "tool_use", "id": "toolu_v", "name": "Bash", "input": {}},
        },
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": end_usage},
        {"type": "message_stop"},
    ]
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events).encode()


@pytest.mark.parametrize(
    ("start", "end", "prompt", "cached"),
    [
        # vLLM since PR #40912: 1,000 tokens of prompt, 900 of them from its prefix cache.
        (
            {"input_tokens": 1000, "output_tokens": 0},
            {
                "input_tokens": 100,
                "output_tokens": 9,
                "cache_read_input_tokens": 900,
                "cache_creation_input_tokens": 0,
            },
            1000,
            900,
        ),
        # vLLM before it: the whole prompt in both, no cache figure.
        (
            {"input_tokens": 1000, "output_tokens": 0},
            {"input_tokens": 1000, "output_tokens": 9},
            1000,
            0,
        ),
        # llama.cpp: net of the cache in message_start, output only in message_delta.
        (
            {"input_tokens": 100, "cache_read_input_tokens": 900, "output_tokens": 0},
            {"output_tokens": 9},
            1000,
            900,
        ),
    ],
)
async def test_a_cache_figure_known_only_at_the_end_is_not_counted_twice(
    start: dict[str, int], end: dict[str, int], prompt: int, cached: int
) -> None:
    # vLLM's message_start said the whole prompt (its cache figure not known yet), its
    # message_delta the part net of the cache and the cached part: the largest
    # `input_tokens` plus the cached part counted the cached tokens twice, so a Claude
    # Code run on vLLM (prefix hits of 90 % and more) was sized at nearly twice its
    # context.  Anthropic's usage in message_delta is cumulative: the last reading is
    # the count.
    stream = _vllm_stream(start, end)

    async def messages(request: Request) -> Response:
        return Response(stream, media_type="text/event-stream")

    app = models_only()
    app.get("/health")(lambda: {})
    app.post("/v1/messages")(messages)
    async with (
        serve(app) as url,
        gateway(endpoint("a", url, kind="vllm")) as (gw, shell),
    ):
        body = {"model": MODEL, "max_tokens": 16, "stream": True}
        body["messages"] = [{"role": "user", "content": "x"}]
        async with gw.stream("POST", "/v1/messages", json=body) as r:
            raw = b"".join([chunk async for chunk in r.aiter_raw()])
        assert raw == stream  # passed through as it came
        await until(lambda: not shell.state.turns, "turn finished")
        run = shell.state.runs[r.headers[RUN]]
        assert run.phase is RunPhase.PAUSED
        assert run.context_tokens == prompt + 9
        text = (await gw.get("/metrics")).text
        assert metric(text, "luftpause_prompt_tokens_total") == prompt
        assert metric(text, "luftpause_cached_tokens_total") == cached


async def test_count_tokens_prefers_an_ejected_replica_to_one_down_at_its_probe() -> None:
    # helper-117: sorting by "ejected" alone after "healthy first" sent count_tokens to
    # a replica nothing listens on, over one that was only ejected.
    a = models_only()

    @a.post("/v1/messages/count_tokens")
    async def count(request: Request) -> Response:
        return Response(json.dumps({"input_tokens": 7}), media_type="application/json")

    @a.post("/v1/chat/completions")
    async def chat_(request: Request) -> Response:
        return Response(json.dumps({"error": {"message": "CUDA"}}), 500)

    policy = Policy(eject_after_failures=1, eject_for_s=60)
    async with (
        serve(a) as up,
        gateway(
            endpoint("b", closed_port_url(), kind="openai", messages=True),
            endpoint("a", up, kind="openai", messages=True),
            policy=policy,
        ) as (gw, shell),
    ):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        await until(lambda: not shell.state.replicas["b"].healthy, "b's probe fails")
        r = await gw.post("/v1/chat/completions", json={**body, "max_tokens": 4})
        assert r.status_code == 500 and shell.state.replicas["a"].ejected_until is not None
        r = await gw.post("/v1/messages/count_tokens", json=body)
        assert r.status_code == 200 and r.json()["input_tokens"] == 7, r.text
