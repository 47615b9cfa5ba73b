"""The proxy end to end over real loopback HTTP: fake engines and tiny upstream apps
behind the gateway, clients in front of it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response
from harness import (
    CALLER,
    MODEL,
    POLL_S,
    POLLS,
    RUN,
    TOOLS,
    Recorder,
    answered_health,
    chat,
    closed_port_url,
    endpoint,
    engine,
    gateway,
    models_only,
    raw_engine,
    tool_loop,
    tool_task,
    until,
    upstream,
)
from opentelemetry.sdk.trace import TracerProvider
from starlette.types import Receive, Scope, Send

import gateway._proxy as proxy_module
from gateway._proxy import StreamWatch
from gateway._shell import AdmissionShell
from luftpause import telemetry
from scheduler import Policy, RunPhase, ServiceClass, Tick
from testkit.engine import EngineParams
from testkit.fake_engine import EngineClock
from testkit.loopback import serve


def ok_chat(request: Request) -> Response:
    body = {"choices": [{"index": 0, "message": {"content": "hi"}, "finish_reason": "stop"}]}
    return Response(json.dumps(body), media_type="application/json")


def normalise(raw: bytes) -> bytes:
    return re.sub(rb"chatcmpl-[0-9a-f]{24}", b"chatcmpl-ID", raw)


# --------------------------------------------------------------------------- pass-through


async def test_completions_pass_through_byte_for_byte() -> None:
    async with (
        engine(instant=True) as (url, counted),
        gateway(endpoint("a", url)) as (gw, _),
        httpx.AsyncClient(base_url=url, timeout=30) as direct,
    ):
        for stream in (False, True):
            body = chat("pass me through", stream=stream, max_tokens=30)
            body["stream_options"] = {"include_usage": True}
            want = (await direct.post("/v1/chat/completions", json=body)).content
            async with gw.stream(
                "POST", "/v1/chat/completions", json=body, headers={RUN: "run-1"}
            ) as r:
                assert r.status_code == 200
                assert r.headers[RUN] == "run-1"
                got = b"".join([chunk async for chunk in r.aiter_raw()])
            assert normalise(got) == normalise(want)
            if stream:
                assert r.headers["content-type"].startswith("text/event-stream")
                events = [ln[6:] for ln in got.decode().split("\n") if ln.startswith("data: ")]
                assert events[-1] == "[DONE]"
                assert all(json.loads(e)["object"] == "chat.completion.chunk" for e in events[:-1])
            else:
                assert json.loads(got)["object"] == "chat.completion"
        assert len(counted.chats) == 4  # two direct, two through the gateway

        models = await gw.get("/v1/models")
        assert models.json()["data"][0]["id"] == MODEL
        assert (await gw.get("/health")).json() == {"status": "ok"}
        ended = await gw.delete("/v1/runs/run-1")
        assert ended.status_code == 204 and ended.headers[RUN] == "run-1"


async def test_streaming_through_a_generating_engine_reports_usage() -> None:
    async with engine(time_scale=20) as (url, _), gateway(endpoint("a", url)) as (gw, shell):
        body = chat("a story", stream=True, max_tokens=40)
        body["stream_options"] = {"include_usage": True}
        async with gw.stream("POST", "/v1/chat/completions", json=body) as r:
            events = [ln[6:] async for ln in r.aiter_lines() if ln.startswith("data: ")]
            run_id = r.headers[RUN]
        assert events[-1] == "[DONE]"
        usage = json.loads(events[-2])["usage"]
        assert usage["completion_tokens"] == 40
        await until(lambda: not shell.state.turns, "turn finished")
        run = shell.state.runs[run_id]
        assert (run.phase, run.replica, run.in_flight) == ("idle", "a", 0)
        assert run.context_tokens == usage["prompt_tokens"] + usage["completion_tokens"]


@pytest.mark.parametrize("options", [None, {"include_usage": False}])
async def test_a_stream_without_usage_still_reports_it_and_stays_as_asked(
    options: dict[str, Any] | None,
) -> None:
    # The OpenAI SDKs stream without usage by default; the core needs the engine's counts.
    async with engine(time_scale=20) as (url, _), gateway(endpoint("a", url)) as (gw, shell):
        body = chat("a saga", stream=True, max_tokens=40)
        if options is not None:
            body["stream_options"] = options
        async with gw.stream("POST", "/v1/chat/completions", json=body) as r:
            events = [ln[6:] async for ln in r.aiter_lines() if ln.startswith("data: ")]
            run_id = r.headers[RUN]
        assert events[-1] == "[DONE]"
        assert all("usage" not in json.loads(e) for e in events[:-1])  # as the client asked
        await until(lambda: not shell.state.turns, "turn finished")
        # The same turn with usage asked for: the engine's counts reached the core.
        body["stream_options"] = {"include_usage": True}
        async with gw.stream("POST", "/v1/chat/completions", json=body) as r:
            asked = [ln[6:] async for ln in r.aiter_lines() if ln.startswith("data: ")]
        usage = json.loads(asked[-2])["usage"]
        assert shell.state.runs[run_id].context_tokens == (
            usage["prompt_tokens"] + usage["completion_tokens"]
        )


@pytest.mark.parametrize(("kind", "asked"), [("sglang", True), ("openai", False)])
async def test_usage_is_asked_only_of_engines_known_to_take_the_option(
    kind: str, asked: bool
) -> None:
    async with engine(instant=True) as (url, counted), gateway(endpoint("a", url, kind)) as (gw, _):
        async with gw.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as r:
            events = [ln[6:] async for ln in r.aiter_lines() if ln.startswith("data: ")]
        (sent,) = counted.chats
        assert ("stream_options" in sent) is asked  # a hosted API gets the client's body
        assert all("usage" not in json.loads(e) for e in events[:-1])


@pytest.mark.parametrize(("flavor", "shown"), [("vllm", True), ("sglang", False)])
@pytest.mark.parametrize("router", [False, True], ids=["direct", "behind a router"])
async def test_stream_options_without_include_usage_read_as_the_engine_reads_them(
    flavor: str, shown: bool, router: bool
) -> None:
    # vLLM reads `stream_options` without `include_usage` as true (its default): its
    # clients got no usage event through luftpause, which hid it as its own (helper-76).
    # The same behind a router whose engines are vLLM's (vllm-router, SMG: helper-125).
    async with engine(instant=True, flavor=flavor) as (url, counted):
        endpoints = (
            [endpoint("a", url, "router", load_from=["e"]), endpoint("e", url, flavor)]
            if router
            else [endpoint("a", url, flavor)]
        )
        async with gateway(*endpoints) as (gw, shell):
            body = chat(stream=True, stream_options={"continuous_usage_stats": False})
            async with gw.stream("POST", "/v1/chat/completions", json=body) as r:
                events = [ln[6:] async for ln in r.aiter_lines() if ln.startswith("data: ")]
                run_id = r.headers[RUN]
            usages = [json.loads(e)["usage"] for e in events[:-1] if json.loads(e).get("usage")]
            assert bool(usages) is shown, events
            # vLLM gets the client's options as they came; SGLang is asked (and hides it).
            assert counted.chats[-1]["stream_options"] == (
                {"continuous_usage_stats": False}
                if flavor == "vllm"
                else {"continuous_usage_stats": False, "include_usage": True}
            )
            await until(lambda: not shell.state.turns, "turn finished")
            assert shell.state.runs[run_id].context_tokens > 0  # the engine's counts


@pytest.mark.parametrize("value", [1, "true"])
async def test_an_include_usage_that_is_no_boolean_goes_to_the_engine_as_sent(value: Any) -> None:
    # pydantic (vLLM, SGLang) reads 1 and "true" as true: rewritten to true, the usage
    # event was hidden from a client that had asked for it.
    async with engine(instant=True) as (url, counted), gateway(endpoint("a", url)) as (gw, _):
        body = chat(stream=True, stream_options={"include_usage": value})
        r = await gw.post("/v1/chat/completions", json=body)
        assert r.status_code == 200
        sent = counted.chats[-1]["stream_options"]["include_usage"]
        assert type(sent) is type(value) and sent == value  # (True == 1 in Python)


async def test_the_clients_query_string_reaches_the_engine() -> None:
    # Azure's api-version, or an SDK's extra_query, went nowhere (helper-76).
    def echo(request: Request) -> Response:
        body = {"choices": [{"index": 0, "message": {"content": request.url.query}}]}
        return Response(json.dumps(body), media_type="application/json")

    async with (
        serve(upstream(echo)) as url,
        gateway(endpoint("a", url, kind="openai")) as (gw, _),
    ):
        query = "api-version=2024-10-21&x=%C3%A9+1"
        r = await gw.post(f"/v1/chat/completions?{query}", json=chat())
        assert r.json()["choices"][0]["message"]["content"] == query
        r = await gw.post("/v1/chat/completions", json=chat())
        assert r.json()["choices"][0]["message"]["content"] == ""


async def test_an_answer_names_the_kind_of_engine_that_gave_it() -> None:
    # A sub-agent's run names it on its invoke_agent span (gen_ai.provider.name, which
    # the GenAI conventions require), and its worker sees only the gateway: the span had
    # none (helper-201).  Named with tracing off here too (the worker's is its own), as
    # the turn's chat span would name it, and an engine's own header is not passed on.
    def claims(request: Request) -> Response:
        response = ok_chat(request)
        response.headers["x-luftpause-provider"] = "not-the-gateways-word"
        return response

    assert telemetry.tracer() is None
    async with (
        engine(flavor="llamacpp", instant=True) as (llama, _),
        serve(upstream(claims)) as hosted,
        gateway(
            endpoint("a", llama, kind="llamacpp"),
            endpoint("h", hosted, kind="openai", models=("hosted",)),
        ) as (gw, _),
    ):
        for stream in (False, True):
            r = await gw.post("/v1/chat/completions", json=chat(max_tokens=2, stream=stream))
            assert r.status_code == 200, r.text
            assert r.headers.get_list("x-luftpause-provider") == ["llama.cpp"]
        r = await gw.post("/v1/chat/completions", json=chat(model="hosted"))
        assert r.status_code == 200, r.text
        assert r.headers.get_list("x-luftpause-provider") == ["openai"]


async def test_a_stream_whose_media_type_is_not_lower_case_is_still_a_stream() -> None:
    # Media types have no case: "Text/Event-Stream" was read as a JSON body, so the
    # turn failed on a healthy engine and the usage event the gateway added leaked.
    events = (
        b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n'
        b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}\n\n'
        b'data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 1}}\n\n'
        b"data: [DONE]\n\n"
    )
    answer = (
        b"HTTP/1.1 200 OK\r\nContent-Type: Text/Event-Stream; Charset=UTF-8\r\n"
        b"content-length: " + str(len(events)).encode() + b"\r\n\r\n" + events
    )
    async with raw_engine(answer) as url, gateway(endpoint("a", url)) as (gw, shell):
        async with gw.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as r:
            got = [ln[6:] async for ln in r.aiter_lines() if ln.startswith("data: ")]
            run_id = r.headers[RUN]
        assert len(got) == 3 and all("usage" not in e for e in got), got
        await until(lambda: not shell.state.turns, "turn finished")
        assert shell.state.runs[run_id].context_tokens == 8
        assert shell.state.replicas["a"].failures == 0


@pytest.mark.parametrize(
    ("details", "cached"),
    [({}, None), ({"prompt_tokens_details": None}, None), ({"prompt_tokens_details": {}}, None),
     ({"prompt_tokens_details": {"cached_tokens": 0}}, 0),
     ({"prompt_tokens_details": {"cached_tokens": 96}}, 96)],
)  # fmt: skip
def test_cached_tokens_are_none_unless_the_engine_says_them(
    details: dict[str, Any], cached: int | None
) -> None:
    # SGLang fills prompt_tokens_details only with --enable-cache-report, vLLM only with
    # --enable-prompt-tokens-details: what it did not say is not a cache miss (a 0
    # pulled the model's learned shared prefix down).
    from gateway._proxy import MessagesWatch, ResponsesWatch

    usage = {"prompt_tokens": 128, "completion_tokens": 4, **details}
    chat = StreamWatch(sse=False)
    chat.feed(json.dumps({"choices": [{"finish_reason": "stop"}], "usage": usage}).encode())
    chat.close()
    assert (chat.prompt_tokens, chat.cached_tokens) == (128, cached)
    responses = ResponsesWatch(sse=False)
    input_details = {"input_tokens_details": details["prompt_tokens_details"]} if details else {}
    body = {"object": "response", "status": "completed", "output": [],
            "usage": {"input_tokens": 128, "output_tokens": 4, **input_details}}  # fmt: skip
    responses.feed(json.dumps(body).encode())
    responses.close()
    assert (responses.prompt_tokens, responses.cached_tokens) == (128, cached)
    messages = MessagesWatch(sse=False, input_counts_cached=True)  # (an SGLang's)
    read = {} if cached is None else {"cache_read_input_tokens": cached}
    net = 128 - (cached or 0)  # as Anthropic's (SGLang's since 0.5.19)
    message = {"type": "message", "stop_reason": "end_turn", "content": [],
               "usage": {"input_tokens": net, "output_tokens": 4, **read}}  # fmt: skip
    messages.feed(json.dumps(message).encode())
    messages.close()
    assert (messages.prompt_tokens, messages.cached_tokens) == (128, cached)


def test_the_added_usage_event_is_dropped_however_the_stream_is_cut() -> None:
    from gateway._proxy import _AddedUsage

    stream = (
        b'data: {"choices": [{"delta": {"content": "hi"}}]}\r\n\r\n'
        b'data: {"choices": [{"delta": {}, "finish_reason": "stop"}], "usage": null}\n\n'
        b'data: {"id": "x", "choices": [], "usage": {"prompt_tokens": 3}}\n\n'
        b"data: [DONE]\n\n"
    )
    kept = stream.replace(
        b'data: {"id": "x", "choices": [], "usage": {"prompt_tokens": 3}}\n\n', b""
    )
    # Lines may end in CR alone too (the SSE grammar): such a stream was one event, and
    # dropped whole as the added one.
    cr = stream.replace(b"\r\n", b"\n").replace(b"\n", b"\r")
    cr_kept = kept.replace(b"\r\n", b"\n").replace(b"\n", b"\r")
    for whole, left in ((stream, kept), (cr, cr_kept)):
        for size in (1, 7, 50, len(whole)):
            hide = _AddedUsage()
            pieces = [whole[i : i + size] for i in range(0, len(whole), size)]
            out = b"".join(hide.filter(p) for p in pieces[:-1])
            out += hide.filter(pieces[-1], last=True)
            assert out == left, (size, out)


# --------------------------------------------------------------------------- runs


async def test_run_identity_by_header_and_by_echoed_tool_call_ids() -> None:
    async with engine(time_scale=50) as (url, _), gateway(endpoint("a", url)) as (gw, shell):
        ids, turns = await tool_loop(gw, tool_task(2))
        assert turns >= 3 and len(set(ids)) == 1  # recognised by the ids it echoed
        assert shell.remembered_tool_calls() == turns - 1

        mine, _ = await tool_loop(gw, tool_task(1, "other"), **{RUN: "mine"})
        assert set(mine) == {"mine"}

        # Without header or known ids every request is a run of its own.
        a = await gw.post("/v1/chat/completions", json=chat("one", max_tokens=5))
        b = await gw.post("/v1/chat/completions", json=chat("one", max_tokens=5))
        assert re.fullmatch("[0-9a-f]{32}", a.headers[RUN]) and a.headers[RUN] != b.headers[RUN]

        assert shell.remembered_tool_calls() > turns - 1
        assert (await gw.delete("/v1/runs/mine")).status_code == 204
        assert shell.remembered_tool_calls() == turns - 1  # only the first run's are kept


# What an upstream whose parser numbers calls, as Kimi-K2's (`functions.<name>:<n>`),
# answers every run's first turn: the same tool call id.
NUMBERED_CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"id": "functions.lookup:0", "type": "function", "function": {"name": "lookup"}}
    ],
}


def numbered_call(request: Request) -> Response:
    body = {"choices": [{"index": 0, "message": NUMBERED_CALL, "finish_reason": "tool_calls"}]}
    return Response(json.dumps(body), media_type="application/json")


async def test_an_echoed_id_never_joins_a_turn_to_another_run() -> None:
    async def turn(gw: httpx.AsyncClient, caller: str, echo: bool, run: str = "") -> str:
        body = chat("look it up", tools=TOOLS)
        if echo:
            echoed = {"role": "tool", "tool_call_id": "functions.lookup:0", "content": "found"}
            body["messages"] += [NUMBERED_CALL, echoed]
        headers = {"x-luftpause-caller": caller} | ({RUN: run} if run else {})
        r = await gw.post("/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
        return r.headers[RUN]

    async with (
        serve(upstream(numbered_call)) as url,
        gateway(endpoint("a", url, kind="openai")) as (gw, _),
    ):
        alice, bob = await turn(gw, "alice", False), await turn(gw, "bob", False)
        assert alice != bob
        # Each caller's echo names that caller's run, however alike the ids.
        assert await turn(gw, "alice", True) == alice
        assert await turn(gw, "bob", True) == bob
        assert await turn(gw, "carol", True) not in (alice, bob)
        # A second run of alice's is given the same id: its echo names neither run.
        second = await turn(gw, "alice", False, run="alice-2")
        echoed = await turn(gw, "alice", True)
        assert echoed not in (alice, second, bob)


async def test_a_harness_session_header_names_the_run() -> None:
    # Two Claude Code sessions of one caller on an engine whose call ids repeat (Kimi's
    # numbering): their echoes name neither run, their session headers do.
    async def turn(gw: httpx.AsyncClient, headers: dict[str, str], echo: bool = False) -> str:
        body = chat("look it up", tools=TOOLS)
        if echo:
            echoed = {"role": "tool", "tool_call_id": "functions.lookup:0", "content": "found"}
            body["messages"] += [NUMBERED_CALL, echoed]
        caller = {"x-luftpause-caller": "alice"}
        r = await gw.post("/v1/chat/completions", json=body, headers=caller | headers)
        assert r.status_code == 200, r.text
        return r.headers[RUN]

    def joined(text: str, by: str) -> float:
        found = re.search(rf'^luftpause_turn_runs_total\{{by="{by}"\}} (\S+)$', text, re.M)
        return float(found[1]) if found else 0.0

    session = "5f0c1a2e-0000-4000-8000-000000000001"
    cc = {"x-claude-code-session-id": session}
    async with (
        serve(upstream(numbered_call)) as url,
        gateway(endpoint("a", url, kind="openai")) as (gw, shell),
    ):
        first = await turn(gw, cc)
        assert first == f"claude-code:{session}"
        second = await turn(gw, {"x-claude-code-session-id": "s2"})
        assert second == "claude-code:s2"
        assert await turn(gw, cc, echo=True) == first
        assert await turn(gw, {}, echo=True) not in (first, second)  # the echo names neither
        # A sub-agent of the session (Claude Code 2.1.139+) is a run of its own.
        assert await turn(gw, cc | {"x-claude-code-agent-id": "a1b2"}) == f"{first}:a1b2"
        # Background requests (routing hints on) stay out of the conversation's run;
        # a compaction carries the conversation and joins it.
        hint = "x-claude-code-request-class"
        assert re.fullmatch("[0-9a-f]{32}", await turn(gw, cc | {hint: "auxiliary"}))
        assert await turn(gw, cc | {hint: "compaction"}) == first
        # The gateway's own header wins; Codex's and OpenCode's headers name runs too.
        assert await turn(gw, cc | {RUN: "mine"}) == "mine"
        assert await turn(gw, {"session-id": "c1"}) == "codex:c1"
        assert await turn(gw, {"session_id": "c1"}) == "codex:c1"  # earlier Codex versions
        assert await turn(gw, {"x-session-affinity": "ses_01"}) == "session:ses_01"
        # A value the run id cannot carry is named by its hash, the same each turn.
        odd = {"x-claude-code-session-id": "team/42 " + "x" * 200}
        hashed = await turn(gw, odd)
        assert re.fullmatch("claude-code:[0-9a-f]{32}", hashed)
        assert await turn(gw, odd) == hashed
        assert shell.state.runs[first].replica == "a"  # the core knows it by that name

        text = (await gw.get("/metrics")).text
        assert (joined(text, "session"), joined(text, "header")) == (10, 1)
        assert joined(text, "new") == 2  # the lone echo and the auxiliary request

    # Off in the file: the session header is not read.
    async with (
        serve(upstream(numbered_call)) as url,
        gateway(endpoint("a", url, kind="openai"), sections={"session_runs": False}) as (gw, _),
    ):
        a, b = await turn(gw, cc), await turn(gw, cc)
        assert a != b and not a.startswith("claude-code:")


async def test_a_paused_run_keeps_its_replica() -> None:
    async with (
        engine(time_scale=50) as (url_a, a),
        engine(time_scale=50) as (url_b, b),
        gateway(endpoint("a", url_a), endpoint("b", url_b)) as (gw, _),
    ):
        tasks = [tool_task(2, f"run {i}") for i in range(6)]
        results = await asyncio.gather(*(tool_loop(gw, t) for t in tasks))
        for task, (ids, _) in zip(tasks, results, strict=True):
            assert len(set(ids)) == 1
            on = {
                name
                for name, counted in (("a", a), ("b", b))
                for body in counted.chats
                if body["messages"][0]["content"] == task
            }
            assert len(on) == 1, f"run {task!r} moved between replicas: {on}"
        assert a.chats and b.chats  # new runs were spread over both


async def test_each_data_parallel_rank_is_a_replica_and_a_run_keeps_its_rank() -> None:
    # One server with two data-parallel ranks (SGLang --dp-size 2): two KV caches behind
    # one URL.  Named with dp_size, each rank is a replica, a@0 and a@1, and each turn
    # names its rank in X-Data-Parallel-Rank; unnamed, the engine's round robin moves a
    # run's next turn to the other rank's cache.
    def cached(text: str) -> float:
        values = re.findall(r"^luftpause_cached_tokens_total\{[^}]*\} (\S+)$", text, re.M)
        return sum(float(v) for v in values)

    task = tool_task(3, "a long context " * 40)  # several cache blocks
    async with (
        engine(time_scale=50, dp_size=2) as (url, counted),
        gateway(endpoint("a", url, dp_size=2)) as (gw, shell),
    ):
        assert set(shell.state.replicas) == {"a@0", "a@1"}
        assert shell.state.replicas["a@1"].spec.kv_tokens == 56_000  # one rank's pool
        ids, turns = await tool_loop(gw, task)
        assert turns >= 3 and len(set(ids)) == 1
        ranks = [h["x-data-parallel-rank"] for h in counted.headers]
        assert len(set(ranks)) == 1, f"the run moved between ranks: {ranks}"
        pinned = cached((await gw.get("/metrics")).text)

        # Runs at once are spread over the ranks, each staying on its own.
        tasks = [tool_task(2, f"run {i}") for i in range(6)]
        await asyncio.gather(*(tool_loop(gw, t) for t in tasks))
        on: dict[str, set[str]] = {}
        for h, body in zip(counted.headers, counted.chats, strict=True):
            on.setdefault(body["messages"][0]["content"], set()).add(h["x-data-parallel-rank"])
        assert all(len(r) == 1 for r in on.values()), on
        assert set().union(*on.values()) == {"0", "1"}

    async with (
        engine(time_scale=50, dp_size=2) as (url, counted),
        gateway(endpoint("a", url)) as (gw, shell),
    ):
        assert set(shell.state.replicas) == {"a"}
        ids, turns = await tool_loop(gw, task)
        assert "x-data-parallel-rank" not in counted.headers[0]
        unpinned = cached((await gw.get("/metrics")).text)
    # Round robin over two caches: only every other turn finds its prefix.
    assert 0 < unpinned < pinned


@pytest.mark.parametrize("stream", [False, True])
async def test_calls_written_as_text_pause_the_run_as_real_ones_do(stream: bool) -> None:
    # Engines without a tool-call parser answer "stop" with the call in the text; the
    # client recovers it and will come back, so the run is paused on a tool, not idle.
    async with (
        engine(instant=True) as (url, _),
        gateway(endpoint("a", url)) as (gw, shell),
    ):
        task = tool_task(2, "as text") + " [fake: text-tools]"
        body = chat(task, tools=TOOLS, stream=stream, fake_max_tool_calls=3)
        r = await gw.post("/v1/chat/completions", json=body, headers={RUN: "texty"})
        assert r.status_code == 200
        assert b"<tool_call>" in r.content  # passed through unchanged
        assert shell.state.runs["texty"].phase is RunPhase.PAUSED
        # The same answer without tools offered is an answer: the run is idle.
        plain = chat(task, stream=stream, fake_max_tool_calls=3)
        await gw.post("/v1/chat/completions", json=plain, headers={RUN: "plain"})
        assert shell.state.runs["plain"].phase is RunPhase.IDLE


async def test_a_routers_engines_are_probed_for_its_load_and_not_sent_turns() -> None:
    async with (
        engine() as (a, rec_a),
        engine() as (b, rec_b),
        engine() as (r, rec_r),  # stands in for the router in front of a and b
        gateway(
            endpoint("a", a),
            endpoint("b", b),
            endpoint("router", r, kind="router", load_from=["a", "b"]),
        ) as (client, shell),
    ):
        assert set(shell.state.replicas) == {"router"}
        # It runs no more at once than its engines: their slots' sum (each says its own).
        each = EngineParams.reference().max_running_requests
        await until(lambda: shell.state.replicas["router"].spec.slots == 2 * each, "its slots")
        for _ in range(3):
            response = await client.post("/v1/chat/completions", json=chat())
            assert response.status_code == 200
        assert len(rec_r.chats) == 3 and rec_a.chats == rec_b.chats == []


async def test_an_engines_kv_pool_turns_on_kv_admission_unless_the_file_sets_one() -> None:
    async with (
        engine() as (a, _),
        engine() as (b, _),
        gateway(endpoint("a", a), endpoint("b", b, kv_tokens=9000)) as (_, shell),
    ):
        replicas = shell.state.replicas
        assert replicas["a"].spec.kv_tokens == 56_000  # the fake engine's pool
        assert replicas["b"].spec.kv_tokens == 9000
        assert shell.state.kv_limit("a") == 56_000 * 0.8


async def test_the_files_policy_section_reaches_the_scheduler() -> None:
    async with (
        engine() as (url, _),
        gateway(
            endpoint("e", url, kv_tokens=56_000),
            sections={"policy": {"strict_affinity": False, "lane_batch_kv_fill": 0.25}},
        ) as (_, shell),
    ):
        assert shell.state.policy == Policy(strict_affinity=False, lane_batch_kv_fill=0.25)


async def test_later_turns_hit_the_prefix_cache() -> None:
    async with (
        engine(time_scale=50) as (url_a, _),
        engine(time_scale=50) as (url_b, _),
        gateway(endpoint("a", url_a), endpoint("b", url_b)) as (gw, _),
    ):
        task = tool_task(2, "a long context " * 40)  # several cache blocks
        messages: list[dict[str, Any]] = [{"role": "user", "content": task}]
        cached, reasons = [], []
        for _ in range(3):
            body: dict[str, Any] = {"model": MODEL, "messages": messages, "tools": TOOLS}
            body["fake_max_tool_calls"] = 3
            r = await gw.post("/v1/chat/completions", json=body)
            reasons.append(r.json()["choices"][0]["finish_reason"])
            cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            message = r.json()["choices"][0]["message"]
            messages.append(message)
            for call in message.get("tool_calls") or []:
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": "x"})
        assert reasons[:2] == ["tool_calls", "tool_calls"]
        assert cached[0] == 0 and all(c > 0 for c in cached[1:])


@pytest.mark.parametrize("report", ["always", "hits", "never"])
async def test_only_a_stated_cache_count_teaches_the_shared_prefix(report: str) -> None:
    # Four runs open with one long system prompt: the first finds nothing cached, the
    # others find the system prompt; a fifth has tools and a system prompt of their own
    # (nothing in common: the fake renders the tools first).  An engine states what it
    # found in every answer ("always": llama.cpp), only when it found some ("hits":
    # SGLang with --enable-cache-report, vLLM with --enable-prompt-tokens-details), or
    # never (both without their flag, their default).  What it did not state is no
    # sample of the shared prefix, and its run is counted whole; once it has stated a
    # hit, its silence is a miss.  The proxy passes the usage on as the engine wrote it.
    shared = {"role": "system", "content": "You are a careful agent. " * 40}
    other = {"role": "system", "content": "You are another agent entirely. " * 40}
    other_tools = [{"type": "function", "function": {**TOOLS[0]["function"], "description": "?"}}]
    async with (
        engine(time_scale=50, cache_report=report) as (url, _),
        gateway(endpoint("a", url)) as (gw, shell),
    ):
        runs, stated = [], []
        for i, (system, tools) in enumerate([(shared, TOOLS)] * 4 + [(other, other_tools)]):
            body = {"model": MODEL, "tools": tools, "fake_max_tool_calls": 3}
            body["messages"] = [system, {"role": "user", "content": tool_task(1, f"job {i}")}]
            r = await gw.post("/v1/chat/completions", json=body)
            assert r.json()["choices"][0]["finish_reason"] == "tool_calls", r.text
            runs.append(r.headers[RUN])
            stated.append(r.json()["usage"]["prompt_tokens_details"])
            await until(lambda: not shell.state.turns, "the turn's end")
        metrics = (await gw.get("/metrics")).text
        counted = re.findall(r"^luftpause_cached_tokens_total\{[^}]*\} (\S+)$", metrics, re.M)

    hit = stated[1]["cached_tokens"] if stated[1] else 0
    firsts = [shell.state.runs[run].first_cached for run in runs]
    learned = shell.state.shared_prefixes.get(MODEL)
    if report == "never":
        assert stated == [None] * 5
        assert firsts == [0] * 5  # each counted whole
        assert learned is None  # no sample at all
        assert sum(float(v) for v in counted) == 0
        return
    assert hit > 0 and stated[2:4] == [stated[1]] * 2
    assert stated[0] == stated[4] == ({"cached_tokens": 0} if report == "always" else None)
    assert firsts == [0, hit, hit, hit, 0]
    assert learned is not None
    # "hits": the first miss was silence from an engine not yet known to report (no
    # sample); the last, silence from one that has reported a hit (a miss).
    assert learned[2] == ((0,) if report == "always" else ()) + (hit, hit, hit, 0)
    assert sum(float(v) for v in counted) == 3 * hit


# --------------------------------------------------------------------------- holding


@contextlib.asynccontextmanager
async def capped(
    sections: dict[str, Any] | None = None,
) -> AsyncIterator[tuple[httpx.AsyncClient, AdmissionShell, Recorder, list[Any], EngineClock]]:
    """A gateway before an engine that runs one request at a time, with two long turns
    sent, so the engine reports a queue and the core holds further turns.  A vLLM
    engine: it does not report how many requests it runs at once (an SGLang engine
    would, and no queue would form: test_an_engine_that_reports_its_slots_...).

    The engine's clock stands still until the test calls `clock.go()`: the queue lasts
    as long as the test needs it, not one decode of wall time a busy machine can miss."""
    one = replace(EngineParams.reference(), max_running_requests=1)
    async with (
        engine(time_scale=1, engine=one, flavor="vllm") as (url, counted),
        gateway(endpoint("a", url, kind="vllm"), sections=sections) as (gw, shell),
    ):
        clock: EngineClock = counted.app.state.clock
        clock.stop()
        long = [
            asyncio.create_task(
                gw.post(
                    "/v1/chat/completions",
                    json=chat(f"long {i}", max_tokens=60),
                    headers={"x-luftpause-caller": "a"},
                )
            )
            for i in range(2)
        ]
        await until(lambda: shell.state.replicas["a"].cap == 1, "capped at the engine's 1")
        try:
            yield gw, shell, counted, long, clock
        finally:
            clock.go()
            for t in long:
                t.cancel()
            await asyncio.gather(*long, return_exceptions=True)


async def test_an_engine_that_reports_its_slots_gets_no_more_turns_than_those() -> None:
    """SGLang says in /server_info how many requests it runs at once: the gateway
    learns it from the first probe and holds the turns past it, in its own order,
    before any queue forms at the engine (from its queue alone, luftpause would have
    sent the second turn on, to wait there first come, first served)."""
    one = replace(EngineParams.reference(), max_running_requests=1)
    async with (
        engine(time_scale=1, engine=one) as (url, counted),
        gateway(endpoint("a", url)) as (gw, shell),
    ):
        await until(lambda: shell.state.replicas["a"].spec.slots == 1, "the engine's slots")
        clock: EngineClock = counted.app.state.clock
        clock.stop()

        def send(content: str, cls: str, caller: str, max_tokens: int) -> asyncio.Task[Any]:
            headers = {"x-luftpause-class": cls, "x-luftpause-caller": caller}
            body = chat(content, max_tokens=max_tokens)
            return asyncio.create_task(gw.post("/v1/chat/completions", json=body, headers=headers))

        try:
            tasks = [send("long", "batch", "job", 60)]
            await until(lambda: len(counted.chats) == 1, "the first turn at the engine")
            tasks.append(send("batch 2", "batch", "job", 5))
            await until(lambda: shell.state.held_count() == 1, "the second turn held")
            tasks.append(send("interactive", "interactive", "user", 5))
            await until(lambda: shell.state.held_count() == 2, "the third turn held")
            status = (await gw.get("/status")).json()["replicas"][0]
            assert (status["slots"], status["in_flight"]) == (1, 1)
            assert len(counted.chats) == 1, "only the engine's one slot's worth reached it"
            metrics = (await gw.get("/metrics")).text
            assert 'luftpause_engine_slots{replica="a"} 1.0' in metrics
        finally:
            clock.go()
        done = await asyncio.gather(*tasks)
        assert [r.status_code for r in done] == [200] * 3
        order = [body["messages"][0]["content"] for body in counted.chats]
        assert order == ["long", "interactive", "batch 2"]


async def test_held_turns_go_interactive_first_then_fewest_in_flight_caller() -> None:
    async with capped() as (gw, shell, counted, long, clock):

        async def send(content: str, cls: str, caller: str) -> httpx.Response:
            headers = {"x-luftpause-class": cls, "x-luftpause-caller": caller}
            body = chat(content, max_tokens=5)
            return await gw.post("/v1/chat/completions", json=body, headers=headers)

        held = []
        for content, cls, caller in [
            ("batch x", "batch", "x"),
            ("interactive a", "interactive", "a"),  # caller a has 2 turns in flight
            ("interactive c", "interactive", "c"),
        ]:
            held.append(asyncio.create_task(send(content, cls, caller)))
            n = len(held)
            await until(lambda: shell.state.held_count() == n, "turn held")  # noqa: B023
        clock.go()
        done = await asyncio.gather(*long, *held)
        assert [r.status_code for r in done] == [200] * 5
        order = [body["messages"][0]["content"] for body in counted.chats]
        assert order == ["long 0", "long 1", "interactive c", "interactive a", "batch x"] or (
            order[:2] == ["long 1", "long 0"]
            and order[2:] == ["interactive c", "interactive a", "batch x"]
        )


async def test_a_caller_over_the_files_held_bound_gets_429_for_new_work() -> None:
    limit = {"policy": {"max_held_per_caller": 1}}
    async with capped(limit) as (gw, shell, counted, long, clock):
        x = {"x-luftpause-caller": "x"}
        held = [asyncio.create_task(gw.post("/v1/chat/completions", json=chat("1"), headers=x))]
        await until(lambda: shell.state.held_count() == 1, "turn held")
        r = await gw.post("/v1/chat/completions", json=chat("2"), headers=x)
        assert (r.status_code, r.headers["retry-after"]) == (429, "1")
        assert r.json()["error"]["message"].startswith(
            "caller 'x' has 1 interactive turns waiting for admission (max_held_per_caller = 1)"
        )
        assert re.fullmatch("[0-9a-f]{32}", r.headers[RUN])
        body = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "3"}]}
        r = await gw.post("/v1/messages", json=body, headers=x)
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        # Another caller's work is held as before.
        y = {"x-luftpause-caller": "y"}
        held.append(asyncio.create_task(gw.post("/v1/chat/completions", json=chat(), headers=y)))
        await until(lambda: shell.state.held_count() == 2, "y's turn held")
        clock.go()
        assert [r.status_code for r in await asyncio.gather(*long, *held)] == [200] * 4
        text = (await gw.get("/metrics")).text
        assert 'luftpause_turns_total{outcome="rejected"} 2.0' in text
        assert 'luftpause_rejected_turns_total{status="429"} 2.0' in text
        assert len(counted.posts) == 4  # the refused turns never reached the engine


async def test_a_held_client_that_leaves_makes_no_engine_request() -> None:
    async with capped() as (gw, shell, counted, long, clock):
        waiting = asyncio.create_task(gw.post("/v1/chat/completions", json=chat("left")))
        await until(lambda: shell.state.held_count() == 1, "turn held")
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await until(lambda: shell.state.held_count() == 0, "held turn left the queue")
        clock.go()
        assert [r.status_code for r in await asyncio.gather(*long)] == [200, 200]
        await until(lambda: not shell.state.turns, "all turns done")
        assert len(counted.chats) == 2  # only the two long turns reached the engine


# --------------------------------------------------------------------------- failures


async def test_unreachable_engine_is_a_502_and_frees_the_slot() -> None:
    async with contextlib.AsyncExitStack() as upstream_alive:
        url = await upstream_alive.enter_async_context(serve(upstream(ok_chat)))
        # One probe round while it is up; the next is a minute away.
        async with gateway(endpoint("gone", url, kind="openai"), probe_period=60) as (gw, shell):
            assert (await gw.post("/v1/chat/completions", json=chat())).status_code == 200
            await upstream_alive.aclose()  # now nothing listens there
            for _ in range(2):  # the failed turn freed its slot: the retry is not held
                r = await gw.post("/v1/chat/completions", json=chat(), headers={RUN: "r"})
                assert r.status_code == 502 and r.headers[RUN] == "r"
                message = r.json()["error"]["message"]
                assert message.startswith("engine gone: cannot connect"), message
            assert not shell.state.turns
            assert shell.state.runs["r"].phase == "idle"


async def test_a_model_with_no_healthy_replica_is_503_at_once_not_a_hang() -> None:
    # Down from the start: the first probe (before the gateway serves) marks it unhealthy.
    # Retry-After is the next probe round, as the file sets it.
    async with gateway(
        endpoint("down", closed_port_url(), kind="openai"),
        probe_period=None,
        sections={"probes": {"period_s": 6.5}},
    ) as (gw, shell):
        r = await gw.post("/v1/chat/completions", json=chat(), headers={RUN: "r"})
        assert (r.status_code, r.headers[RUN], r.headers["retry-after"]) == (503, "r", "7")
        assert r.json() == {
            "error": {
                "message": f"no healthy replica serves model '{MODEL}' "
                "(unhealthy at their last probe: down); "
                # what the probe found, so that a wrong port or path is plain
                "down: cannot connect (All connection attempts failed)"
            }
        }
        assert not shell.state.turns


@pytest.mark.parametrize("api", ["chat", "messages"])
async def test_an_engine_refusing_the_gateways_key_is_a_502_not_the_clients_401(
    api: str, caplog: pytest.LogCaptureFixture
) -> None:
    # helper-133: a hosted endpoint's 401 (its api_key_env wrong) went to the client as
    # it was, who took its own key for wrong; and it never counted against the replica,
    # which got every turn of the runs it placed.
    def refuse(request: Request) -> Response:
        body = b'{"error": {"message": "Incorrect API key provided: sk-ab***yz."}}'
        return Response(body, 401, media_type="application/json")

    app = upstream(refuse)
    app.post("/v1/messages")(refuse)
    app.post("/v1/messages/count_tokens")(refuse)
    policy = Policy(eject_after_failures=1, eject_for_s=60)
    async with (
        serve(app) as url,
        gateway(endpoint("a", url, kind="openai", messages=True), policy=policy) as (gw, shell),
    ):
        path = "/v1/chat/completions" if api == "chat" else "/v1/messages"
        r = await gw.post(path, json=chat(max_tokens=4))
        assert r.status_code == 502
        message = r.json()["error"]["message"]
        assert message == (
            "engine a: refused luftpause's credentials for it (401); the gateway's operator "
            "should check the endpoint's api_key_env"
        )
        assert "sk-" not in r.text  # the engine's words are the operator's, in the log
        assert "engine a answered 401 to luftpause's key: " in caplog.text
        assert "Incorrect API key provided" in caplog.text
        assert shell.state.replicas["a"].ejected_until is not None  # the engine's fault
        if api == "messages":  # count_tokens, which Claude Code calls, says the same
            shell.apply(Tick(now=shell.state.replicas["a"].ejected_until + 1))  # back
            counted = await gw.post("/v1/messages/count_tokens", json=chat())
            assert counted.status_code == 502 and "sk-" not in counted.text
            assert counted.json()["error"]["message"] == message


@pytest.mark.parametrize("status", [429, 503])
async def test_engine_429_and_5xx_pass_through_with_retry_after(status: int) -> None:
    def busy(request: Request) -> Response:
        body = b'{"error": {"message": "slow down", "type": "rate_limit"}}'
        return Response(body, status, headers={"Retry-After": "7"}, media_type="application/json")

    async with (
        serve(upstream(busy)) as url,
        gateway(endpoint("a", url, kind="openai")) as (gw, shell),
    ):
        for _ in range(2):
            r = await gw.post("/v1/chat/completions", json=chat(), headers={RUN: "r"})
            assert r.status_code == status and r.headers["retry-after"] == "7"
            assert r.content == b'{"error": {"message": "slow down", "type": "rate_limit"}}'
            assert r.headers[RUN] == "r"
        await until(lambda: not shell.state.turns, "turns failed")
        # Streamed too; an error's body is no first token (helper-146: an instant 429
        # counted as a first byte, so the histogram read lowest when engines were busy).
        r = await gw.post("/v1/chat/completions", json=chat(stream=True))
        assert r.status_code == status
        metrics = (await gw.get("/metrics")).text
        assert 'luftpause_turn_first_byte_seconds_count{class="interactive"} 0.0' in metrics
        assert 'luftpause_turns_total{outcome="error_status"} 3.0' in metrics


async def test_the_retry_of_a_failed_turn_goes_back_to_its_runs_replica() -> None:
    # DESIGN: a failed turn leaves its run idle "with its affinity kept": the retry is
    # placed where the run's prefix is cached, even when the other replica is as free
    # and first in the tie-break.  "a" is busy (a held turn) when run r starts, so r
    # starts on "b"; b fails r's first turn; once a is free again, r's retries must
    # still go to b.
    release = asyncio.Event()
    seen: dict[str, list[str]] = {"a": [], "b": []}

    def engine_app(name: str) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> Response:
            return Response(b'{"object": "list", "data": []}', media_type="application/json")

        @app.post("/v1/chat/completions")
        async def completions(request: Request) -> Response:
            content = (await request.json())["messages"][0]["content"]
            seen[name].append(content)
            if content == "hold":
                await release.wait()
            elif name == "b" and seen["b"].count(content) == 1:
                return Response(b'{"error": {"message": "busy"}}', 503)
            return ok_chat(request)

        return app

    async with (
        serve(engine_app("a")) as url_a,
        serve(engine_app("b")) as url_b,
        gateway(endpoint("a", url_a, kind="openai"), endpoint("b", url_b, kind="openai")) as (
            gw,
            _,
        ),
    ):
        held = asyncio.create_task(
            gw.post("/v1/chat/completions", json=chat("hold"), headers={RUN: "h"})
        )
        await until(lambda: seen["a"] == ["hold"], "a holds a turn")
        first = await gw.post("/v1/chat/completions", json=chat("mine"), headers={RUN: "r"})
        assert first.status_code == 503 and seen["b"] == ["mine"]
        release.set()
        assert (await held).status_code == 200
        for _ in range(3):
            again = await gw.post("/v1/chat/completions", json=chat("mine"), headers={RUN: "r"})
            assert again.status_code == 200
        assert seen == {"a": ["hold"], "b": ["mine"] * 4}


async def test_engine_failing_mid_stream_closes_without_done() -> None:
    async def broken(scope: Scope, receive: Receive, send: Send) -> None:
        if await answered_health(scope, send):
            return
        start = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": start})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        raise RuntimeError("the engine crashed")  # uvicorn drops the connection

    async with (
        serve(broken) as url,
        gateway(endpoint("a", url, kind="openai")) as (gw, shell),
    ):
        assert await _cut_stream(gw) == b"data: {}\n\n"
        await until(lambda: not shell.state.turns, "turn failed")


@pytest.mark.parametrize(
    ("error", "outcome"),
    [
        (b'{"error": {"message": "CUDA out of memory", "code": 500}}', "failed"),
        (b'{"object": "error", "message": "CUDA out of memory", "code": 500}', "failed"),
        (b'{"error": {"message": "the engine died"}}', "failed"),  # names no status
        # vLLM's stream generators report every exception as BadRequestError, code 400,
        # a dead engine's included (helper-116); what a request gets wrong it refuses
        # before the head.  So a 400 in the stream is the engine's failure still.
        (
            b'{"error": {"object": "error", "message": "Background loop has errored already",'
            b' "type": "BadRequestError", "param": null, "code": 400}}',
            "failed",
        ),
        (b'{"error": {"message": "too long", "code": "400"}}', "failed"),
        (b'{"error": {"message": "odd", "code": "\xc2\xb2"}}', "failed"),  # "2" superscript
        # Busy, as a 429 or 503 says: no failure of the engine (helper-112: ejected).
        (b'{"error": {"message": "slow down", "code": 429}}', "error_status"),
        (b'{"error": {"message": "full", "code": 503}}', "error_status"),
        # An Anthropic-style error about the request means it.
        (b'{"error": {"message": "bad", "type": "invalid_request_error"}}', "error_status"),
    ],
)
async def test_an_error_event_in_a_200_stream_fails_the_turn(error: bytes, outcome: str) -> None:
    # vLLM and SGLang report a failure after the head as an event, then [DONE].
    stream = b'data: {"choices": [{"delta": {"content": "Hi"}}]}\n\n' + (
        b"data: " + error + b"\n\ndata: [DONE]\n\n"
    )
    await _two_turns_end(stream, outcome)


@pytest.mark.parametrize(
    ("error", "outcome"),
    [
        # What a request gets wrong that vLLM checks as its stream generator starts (a
        # schema it cannot compile) or SGLang's abort of a prompt past the context
        # (sgl-project/sglang#12081): the request's error (helper-181: ejected).
        (
            b'{"error": {"object": "error", "message": "Unsupported JSON schema",'
            b' "type": "BadRequestError", "param": null, "code": 400}}',
            "error_status",
        ),
        (b'{"object": "error", "message": "too long", "code": 400}', "error_status"),
        (b'{"error": {"message": "no such adapter", "code": "404"}}', "error_status"),
        (b'{"error": {"message": "CUDA out of memory", "code": 500}}', "failed"),
        (b'{"error": {"message": "the engine died"}}', "failed"),  # names no status
    ],
)
async def test_an_error_event_before_anything_else_fails_as_its_code_says(
    error: bytes, outcome: str
) -> None:
    await _two_turns_end(b"data: " + error + b"\n\ndata: [DONE]\n\n", outcome)


async def _two_turns_end(stream: bytes, outcome: str) -> None:
    """Two streamed turns, each answered `stream` in a 200, end as `outcome`, and eject
    the replica (two failures in a row) exactly when that is "failed"."""

    async def erring(scope: Scope, receive: Receive, send: Send) -> None:
        if await answered_health(scope, send):
            return
        start = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": start})
        await send({"type": "http.response.body", "body": stream})

    policy = Policy(eject_after_failures=2)
    async with (
        serve(erring) as url,
        gateway(endpoint("a", url, kind="openai"), policy=policy) as (gw, shell),
    ):
        for _ in range(2):
            r = await gw.post("/v1/chat/completions", json=chat(stream=True))
            assert r.status_code == 200 and r.content == stream  # passed through as it came
            await until(lambda: not shell.state.turns, "turn ended")
        metrics = (await gw.get("/metrics")).text
        assert f'luftpause_turns_total{{outcome="{outcome}"}} 2.0' in metrics
        assert 'luftpause_turns_total{outcome="finished"} 0.0' in metrics
        ejected = 'luftpause_ejections_total{replica="a"} 1.0' in metrics
        assert ejected == (outcome == "failed")
        assert shell.state.replicas["a"].healthy == (outcome != "failed")
        # Its probes pass: the gauges tell the ejection from a failed probe (helper-157).
        assert f'luftpause_replica_ejected{{replica="a"}} {float(ejected)}' in metrics
        assert f'luftpause_replica_healthy{{replica="a"}} {float(not ejected)}' in metrics


@pytest.mark.parametrize("stall", ["before the head", "mid-stream"])
async def test_a_hung_engine_fails_the_turn_after_the_idle_timeout(stall: str) -> None:
    released = asyncio.Event()
    engine_saw_close = asyncio.Event()

    async def hung(scope: Scope, receive: Receive, send: Send) -> None:
        if await answered_health(scope, send):
            return
        if stall == "mid-stream":
            start = [(b"content-type", b"text/event-stream")]
            await send({"type": "http.response.start", "status": 200, "headers": start})
            await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        while (await receive())["type"] != "http.disconnect":
            pass
        engine_saw_close.set()  # the gateway gave up and closed the request
        await released.wait()

    policy = Policy(turn_timeout_s=0.5)
    async with (
        serve(hung) as url,
        gateway(endpoint("a", url, kind="openai"), policy=policy) as (gw, shell),
    ):
        try:
            if stall == "before the head":
                r = await gw.post("/v1/chat/completions", json=chat())
                assert r.status_code == 504
                assert r.json() == {"error": {"message": "engine a: no answer within 0.5 s"}}
                assert r.headers[RUN]
                metrics = (await gw.get("/metrics")).text
                assert 'luftpause_turns_total{outcome="timed_out"} 1.0' in metrics
            else:
                got = b""
                with pytest.raises(httpx.RemoteProtocolError):
                    async with gw.stream(
                        "POST", "/v1/chat/completions", json=chat(stream=True)
                    ) as r:
                        async for chunk in r.aiter_raw():
                            got += chunk
                assert got == b"data: {}\n\n"  # what came, and no [DONE]
            await asyncio.wait_for(engine_saw_close.wait(), 5)
            await until(lambda: not shell.state.turns, "the turn failed and freed its slot")
        finally:
            released.set()


@pytest.mark.parametrize(
    ("kind", "stream", "slots", "waiting", "ejected"),
    [
        ("openai", True, 4, None, True),
        ("openai", False, 4, None, False),
        ("openai", True, None, None, False),
        ("vllm", True, None, 0, True),
        ("vllm", True, None, 3, True),
    ],
    ids=[
        "a stream into the slots luftpause fills",
        "not streamed",
        "a stream where it reports no load",
        "a stream where it reports no queue",
        "a stream within its cap, its probes showing a queue",
    ],
)
async def test_no_head_in_the_turn_timeout_counts_against_the_engine_only_where_it_is_one(
    kind: str, stream: bool, slots: int | None, waiting: int | None, ejected: bool
) -> None:
    # helper-125: an engine that reports no load queues turns itself (Ollama, hosted
    # APIs), and a non-streamed answer's head comes with its end: neither silence is the
    # engine failing, and counting it ejected a busy, healthy replica (every turn of its
    # model then got 503).  A stream sent into room the engine had starts at once
    # (helper-128: a vLLM, which says no slots, that hung was no longer ejected; and
    # helper-130: nor one whose probes still showed a queue, once capped).
    released = asyncio.Event()
    load = f"vllm:num_requests_waiting {waiting}\nvllm:num_requests_running 2\n".encode()

    async def silent(scope: Scope, receive: Receive, send: Send) -> None:
        if await answered_health(scope, send):
            return
        if scope["path"] == "/metrics":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": load})
            return
        await released.wait()

    policy = Policy(turn_timeout_s=0.5, eject_after_failures=1, eject_for_s=60)
    async with (
        serve(silent) as url,
        gateway(endpoint("a", url, kind=kind, slots=slots), policy=policy) as (gw, shell),
    ):
        try:
            if waiting is not None:
                await until(lambda: shell.state.replicas["a"].queued == waiting, "probed")
                if waiting:  # capped at what it runs after two probes with a queue
                    await until(lambda: shell.state.replicas["a"].cap == 2, "capped")
            r = await gw.post("/v1/chat/completions", json=chat(stream=stream))
            assert r.status_code == 504
            assert r.json() == {"error": {"message": "engine a: no answer within 0.5 s"}}
            await until(lambda: not shell.state.turns, "the turn failed and freed its slot")
            assert shell.state.replicas["a"].healthy != ejected
            metrics = (await gw.get("/metrics")).text
            assert ('luftpause_ejections_total{replica="a"} 1.0' in metrics) == ejected
        finally:
            released.set()


@contextlib.asynccontextmanager
async def ticking(shell: AdmissionShell) -> AsyncIterator[None]:
    """The core's clock every 20 ms (the gateway's comes every 2 s): its turn timeout
    comes as soon as it is due, not up to a tick later."""
    loop = asyncio.get_running_loop()

    async def tick() -> None:
        while True:
            await asyncio.sleep(0.02)  # a clock, not a synchronisation
            shell.apply(Tick(now=loop.time()))

    task = asyncio.create_task(tick())
    try:
        yield
    finally:
        task.cancel()


@pytest.mark.parametrize(
    ("slots", "ejected"), [(4, True), (None, False)], ids=["into its slots", "no load reported"]
)
async def test_a_head_with_nothing_after_it_counts_as_no_head(
    slots: int | None, ejected: bool
) -> None:
    # helper-133: Python engines (vLLM, SGLang, the fake) send a stream's head before
    # its first token, so a turn waiting in the engine's queue had its head and counted
    # as stalled mid-stream: the engine's fault wherever the turn was sent.  Nor is a
    # keep-alive comment its first byte.
    released = asyncio.Event()

    async def pings(scope: Scope, receive: Receive, send: Send) -> None:
        if await answered_health(scope, send):
            return
        start = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": start})
        await send({"type": "http.response.body", "body": b": ping\n\n", "more_body": True})
        await released.wait()

    policy = Policy(turn_timeout_s=0.5, eject_after_failures=1, eject_for_s=60)
    async with (
        serve(pings) as url,
        gateway(endpoint("a", url, kind="openai", slots=slots), policy=policy) as (gw, shell),
    ):
        try:
            got = b""
            with pytest.raises(httpx.RemoteProtocolError):
                async with gw.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as r:
                    async for chunk in r.aiter_raw():
                        got += chunk
            assert got == b": ping\n\n"  # what came, and no [DONE]
            await until(lambda: not shell.state.turns, "the turn failed and freed its slot")
            assert shell.state.replicas["a"].healthy != ejected
            metrics = (await gw.get("/metrics")).text
            assert ('luftpause_ejections_total{replica="a"} 1.0' in metrics) == ejected
            outcome = "failed" if ejected else "timed_out"  # (silence not the engine's fault)
            assert f'luftpause_turns_total{{outcome="{outcome}"}} 1.0' in metrics
            assert 'luftpause_turn_first_byte_seconds_count{class="interactive"} 0.0' in metrics
        finally:
            released.set()


@pytest.mark.parametrize("stream", [True, False])
async def test_data_that_starts_late_in_the_turn_timeout_keeps_the_turn(stream: bool) -> None:
    # helper-137: the watch that tells the core of progress came every tenth of the
    # timeout, so data that began after the last watch before the deadline was cut as
    # a stall (the replica ejected): a head sent early, then a long prefill.
    async def late(scope: Scope, receive: Receive, send: Send) -> None:
        if await answered_health(scope, send):
            return
        kind = b"text/event-stream" if stream else b"application/json"
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", kind)]}
        )
        # The engine's prefill: past the last watch before the proxy's deadline (4.5 s),
        # with 0.3 s to spare under load.
        await asyncio.sleep(4.2)
        delta = b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n'
        whole = b'{"choices": [{"message": {"content": "' + b"x" * 200 + b'"}}]}'
        pieces = [delta] * 20 if stream else [whole[i : i + 12] for i in range(0, 240, 12)]
        for piece in pieces:  # then its answer, in pieces
            await send({"type": "http.response.body", "body": piece, "more_body": True})
            await asyncio.sleep(0.05)
        end = b'data: {"choices": [{"delta": {}, "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n'
        await send({"type": "http.response.body", "body": end if stream else whole[240:]})

    policy = Policy(turn_timeout_s=5.0, eject_after_failures=1, eject_for_s=60)
    async with (
        serve(late) as url,
        gateway(endpoint("a", url, kind="openai", slots=4), policy=policy) as (gw, shell),
        ticking(shell),
    ):
        r = await gw.post("/v1/chat/completions", json=chat(stream=stream))
        assert r.status_code == 200
        assert r.text.endswith("data: [DONE]\n\n") if stream else r.json()["choices"]
        await until(lambda: not shell.state.turns, "the turn ended")
        metrics = (await gw.get("/metrics")).text
        assert 'luftpause_turns_total{outcome="finished"} 1.0' in metrics
        assert shell.state.replicas["a"].healthy


async def test_an_engine_hung_mid_stream_is_reported_before_the_core_times_it_out() -> None:
    # helper-133: the core times a turn out its turn timeout after it last heard the
    # turn alive, the proxy gave up that long after the engine's last data, which came
    # later: the core came first and ignored the proxy's report, so a hung engine was
    # counted timed out and never ejected.
    released = asyncio.Event()

    async def hangs(scope: Scope, receive: Receive, send: Send) -> None:
        if await answered_health(scope, send):
            return
        start = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": start})
        delta = b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n'
        for _ in range(20):
            await send({"type": "http.response.body", "body": delta, "more_body": True})
            await asyncio.sleep(0.05)  # the engine's pace
        await released.wait()  # hung

    policy = Policy(turn_timeout_s=1.5, eject_after_failures=1, eject_for_s=60)
    async with (
        serve(hangs) as url,
        gateway(endpoint("a", url, kind="openai"), policy=policy) as (gw, shell),
        ticking(shell),
    ):
        try:
            with pytest.raises(httpx.RemoteProtocolError):
                async with gw.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as r:
                    async for _ in r.aiter_raw():
                        pass
            await until(lambda: not shell.state.turns, "the turn failed and freed its slot")
            metrics = (await gw.get("/metrics")).text
            assert 'luftpause_turns_total{outcome="timed_out"} 0.0' in metrics
            assert 'luftpause_turns_total{outcome="failed"} 1.0' in metrics
            assert 'luftpause_ejections_total{replica="a"} 1.0' in metrics
            assert not shell.state.replicas["a"].healthy
        finally:
            released.set()


def _big_stream(chunks: int) -> Any:
    """An engine that streams `chunks` pieces of 64 KiB at once, then ends; it sets the
    event it returns once the gateway has closed its request."""
    closed = asyncio.Event()
    piece = b'data: {"choices": [{"delta": {"content": "' + b"x" * 65_000 + b'"}}]}\n\n'

    async def big(scope: Scope, receive: Receive, send: Send) -> None:
        if await answered_health(scope, send):
            return
        start = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": start})
        try:
            for _ in range(chunks):
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            end = b'data: {"choices": [{"delta": {}, "finish_reason": "stop"}]}\n\n'
            await send({"type": "http.response.body", "body": end + b"data: [DONE]\n\n"})
        finally:
            closed.set()

    big.closed = closed  # type: ignore[attr-defined]
    return big


async def _reader(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A client on a small receive buffer, its streamed turn sent: what the gateway
    writes beyond a few megabytes waits until it reads."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 20)
    body = json.dumps(chat(stream=True)).encode()
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()
    return reader, writer


async def test_a_client_reading_slowly_keeps_its_turn() -> None:
    # helper-133: the proxy told the core a stream was alive only between writes to
    # the client, so one blocked on a slow client for the turn timeout was timed out
    # by the core, its slot free while the engine still had it.  It reads nothing here
    # for most of the timeout, then all.
    big = _big_stream(256)  # 16 MiB: past what the sockets buffer
    policy = Policy(turn_timeout_s=3.0)
    async with (
        serve(big) as url,
        gateway(endpoint("a", url, kind="openai"), policy=policy) as (gw, shell),
        ticking(shell),
    ):
        reader, writer = await _reader(str(gw.base_url).rstrip("/"))
        try:
            assert (await reader.readline()).startswith(b"HTTP/1.1 200")
            await asyncio.sleep(2.2)  # the client's pause: most of the turn timeout
            got = await asyncio.wait_for(reader.read(), 60)
        finally:
            writer.close()
        assert got.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), got[-80:]  # (chunked)
        await until(lambda: not shell.state.turns, "the turn ended")
        metrics = (await gw.get("/metrics")).text
        assert 'luftpause_turns_total{outcome="timed_out"} 0.0' in metrics
        assert 'luftpause_turns_total{outcome="finished"} 1.0' in metrics


async def test_a_client_that_reads_again_late_in_a_write_leaves_the_engine_its_deadline() -> None:
    # helper-139: a write blocked on the client cut the proxy's deadline to the write's
    # own limit; the client read again in the last watch period before that limit, the
    # write ended, the deadline stayed, and it fired while the engine streamed: the
    # engine's fault, the replica ejected.
    async def engine_app(scope: Scope, receive: Receive, send: Send) -> None:
        if await answered_health(scope, send):
            return
        start = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": start})
        piece = b'data: {"choices": [{"delta": {"content": "' + b"x" * 65_000 + b'"}}]}\n\n'
        for _ in range(256):  # 16 MiB at once: the write to the client blocks
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        delta = b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n'
        for _ in range(150):  # then the engine's pace, past the write's limit
            await send({"type": "http.response.body", "body": delta, "more_body": True})
            await asyncio.sleep(0.02)
        end = b'data: {"choices": [{"delta": {}, "finish_reason": "stop"}]}\n\n'
        await send({"type": "http.response.body", "body": end + b"data: [DONE]\n\n"})

    # A write may wait 19 s, and the watch comes every 2 s from the head (the write
    # starts with it); the client reads again after 18.5 s, in the last watch period
    # before the write's limit, with half a second to spare either way.
    policy = Policy(turn_timeout_s=20.0, eject_after_failures=1, eject_for_s=60)
    async with (
        serve(engine_app) as url,
        gateway(endpoint("a", url, kind="openai"), policy=policy) as (gw, shell),
        ticking(shell),
    ):
        reader, writer = await _reader(str(gw.base_url).rstrip("/"))
        try:
            assert (await reader.readline()).startswith(b"HTTP/1.1 200")
            await asyncio.sleep(18.5)  # the client's pause
            got = await asyncio.wait_for(reader.read(), 60)
        finally:
            writer.close()
        assert got.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), got[-80:]
        await until(lambda: not shell.state.turns, "the turn ended")
        metrics = (await gw.get("/metrics")).text
        assert 'luftpause_turns_total{outcome="finished"} 1.0' in metrics
        assert shell.state.replicas["a"].healthy


async def test_a_client_that_stops_reading_is_cut_and_frees_the_engine() -> None:
    # ... but a client that reads nothing at all holds no engine for ever: it is cut,
    # counted as a client that left (not the engine's fault), and the engine's request
    # is closed.
    big = _big_stream(256)
    policy = Policy(turn_timeout_s=1.0, eject_after_failures=1)
    async with (
        serve(big) as url,
        gateway(endpoint("a", url, kind="openai"), policy=policy) as (gw, shell),
    ):
        reader, writer = await _reader(str(gw.base_url).rstrip("/"))
        try:
            assert (await reader.readline()).startswith(b"HTTP/1.1 200")
            await asyncio.wait_for(big.closed.wait(), 30)
            await until(lambda: not shell.state.turns, "the turn ended")
        finally:
            writer.close()
        metrics = (await gw.get("/metrics")).text
        assert 'luftpause_engine_turns_total{outcome="client_left",replica="a"} 1.0' in metrics
        assert 'luftpause_turns_total{outcome="timed_out"} 0.0' in metrics
        assert shell.state.replicas["a"].healthy


async def test_a_stream_longer_than_the_turn_timeout_keeps_its_slot() -> None:
    # The turn timeout frees the slots of lost turns; a reply that streams for longer
    # (a long reasoning turn) tells the core it is alive and is not one: every third of
    # the timeout where that is under 90 s (it was every 30 s whatever the timeout).
    chunks = 18  # one each 0.2 s: 3.6 s, past a tick (every 2 s) and twice the timeout

    async def slow(scope: Scope, receive: Receive, send: Send) -> None:
        if await answered_health(scope, send):
            return
        start = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": start})
        for _ in range(chunks):
            await asyncio.sleep(0.2)  # the engine's pace, not a synchronisation
            delta = b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n'
            await send({"type": "http.response.body", "body": delta, "more_body": True})
        done = b'data: {"choices": [{"delta": {}, "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n'
        await send({"type": "http.response.body", "body": done})

    policy = Policy(turn_timeout_s=1.5)
    async with (
        serve(slow) as url,
        gateway(endpoint("a", url, kind="openai"), policy=policy) as (gw, shell),
    ):
        r = await gw.post("/v1/chat/completions", json=chat(stream=True))
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        await until(lambda: not shell.state.turns, "turn ended")
        metrics = (await gw.get("/metrics")).text
        assert 'luftpause_turns_total{outcome="timed_out"} 0.0' in metrics
        assert 'luftpause_turns_total{outcome="finished"} 1.0' in metrics


async def test_a_client_leaving_as_the_engine_answers_is_one_leave() -> None:
    # The engine's head and the client's hang-up in one loop iteration: the first
    # block's callback was already scheduled when it ended, and cancelled the second
    # block as well as its own: a bare CancelledError escaped (the turn counted
    # abandoned, uvicorn logged a traceback) instead of ClientLeft.
    loop = asyncio.get_running_loop()
    disconnected: asyncio.Future[None] = loop.create_future()
    head: asyncio.Future[None] = loop.create_future()
    leave = proxy_module.CancelOnLeave(disconnected, lambda: False)
    streamed = asyncio.Event()

    async def turn() -> str:
        with leave:
            await head  # the engine's head
        try:
            with leave:
                streamed.set()
                await asyncio.Event().wait()  # streaming, until the client leaves
        except proxy_module.ClientLeft:
            return "left"
        return "finished"

    task = asyncio.create_task(turn())
    await asyncio.sleep(0)  # the task waits for the head
    head.set_result(None)
    disconnected.set_result(None)
    assert await asyncio.wait_for(task, 5) == "left"
    assert streamed.is_set() and task.cancelling() == 0


async def test_a_first_chunk_later_than_a_third_of_the_turn_timeout_tells_the_core_at_once() -> (
    None
):
    # The core counts the timeout from admission; the proxy counted its first alive
    # from the first chunk, so a long prefill (or a queue in the engine) over two
    # thirds of the timeout got a generating turn timed out.
    go, done = asyncio.Event(), asyncio.Event()

    async def late(scope: Scope, receive: Receive, send: Send) -> None:
        if await answered_health(scope, send):
            return
        await go.wait()  # the head comes with the first token, as some engines send it
        start = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": start})
        delta = b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n'
        await send({"type": "http.response.body", "body": delta, "more_body": True})
        await done.wait()
        end = b'data: {"choices": [{"delta": {}, "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n'
        await send({"type": "http.response.body", "body": end})

    policy = Policy(turn_timeout_s=3.0)
    async with (
        serve(late) as url,
        gateway(endpoint("a", url, kind="openai"), policy=policy) as (gw, shell),
    ):
        call = asyncio.create_task(gw.post("/v1/chat/completions", json=chat(stream=True)))
        await until(lambda: any(t.replica for t in shell.state.turns.values()), "admitted")
        (admitted,) = [t for t in shell.state.turns.values() if t.replica]
        await asyncio.sleep(1.2)  # the prefill: longer than a third of the timeout
        go.set()
        await until(
            lambda: shell.state.turns[admitted.turn_id].alive_at > admitted.alive_at,
            "the first chunk told the core the turn is alive",
        )
        done.set()
        r = await call
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")


async def test_client_leaving_mid_stream_stops_the_engine() -> None:
    # At 0.02x the reply takes some 60 s, past the polls' 10: the engine stops only if
    # the gateway closed its request (at 1x it ended in 1.25 s either way; helper-165).
    async with engine(time_scale=0.02) as (url, _), gateway(endpoint("a", url)) as (gw, shell):
        body = chat("a long story", stream=True, max_tokens=2000)
        async with gw.stream("POST", "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if '"content": "' in line and '"content": ""' not in line:
                    break  # generating: leave
        await until(lambda: not shell.state.turns, "turn failed")
        async with httpx.AsyncClient(base_url=url) as direct:
            for _ in range(POLLS):
                text = (await direct.get("/metrics")).text
                if re.search(r"^sglang:num_running_reqs\{.*\} 0\.0$", text, re.M):
                    break
                await asyncio.sleep(POLL_S)
            else:
                raise AssertionError("the engine kept generating")
        # Not the engine's failure: an alert on failed turns stays quiet.
        text = (await gw.get("/metrics")).text
        assert 'luftpause_engine_turns_total{outcome="client_left",replica="a"} 1.0' in text
        assert 'luftpause_engine_turns_total{outcome="failed",replica="a"}' not in text
        # ... nor one on all turns (helper-68: it counted `failed` there).
        assert 'luftpause_turns_total{outcome="client_left"} 1.0' in text
        assert 'luftpause_turns_total{outcome="failed"} 0.0' in text


async def test_unknown_model_is_404_before_queueing() -> None:
    async with engine(instant=True) as (url, counted), gateway(endpoint("a", url)) as (gw, shell):
        r = await gw.post("/v1/chat/completions", json={**chat(), "model": "gpt-9"})
        assert r.status_code == 404
        assert r.json() == {
            "error": {"message": f"no generative replica serves model 'gpt-9' (served: {MODEL})"}
        }
        assert RUN in r.headers
        assert not counted.chats and not shell.state.turns


# --------------------------------------------------------------------------- auth, input


async def test_token_is_required_and_never_forwarded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LUFTPAUSE_TEST_UPSTREAM_KEY", "sk-upstream")
    seen: list[dict[str, str]] = []
    async with (
        serve(upstream(ok_chat, seen)) as url,
        gateway(
            endpoint("a", url, kind="openai", api_key_env="LUFTPAUSE_TEST_UPSTREAM_KEY"),
            token="s3cret",
        ) as (gw, _),
    ):
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
            r = await gw.post("/v1/chat/completions", json=chat(), headers=headers)
            assert r.status_code == 401
            assert r.json() == {"error": {"message": "missing or wrong bearer token"}}
            assert RUN in r.headers
        assert (await gw.get("/v1/models")).status_code == 401
        assert (await gw.get("/v1/models/m")).status_code == 401
        # The Anthropic SDKs send the key in x-api-key (helper-128).
        keyed = await gw.get("/v1/models", headers={"x-api-key": "s3cret"})
        assert keyed.status_code == 200 and keyed.json()["data"]
        assert (await gw.delete("/v1/runs/x")).status_code == 401
        # The token is asked first: what the request is comes after who sends it.
        assert (await gw.delete("/v1/runs/a%20b")).status_code == 401
        bad_run = {RUN: "a b"}
        assert (
            await gw.post("/v1/chat/completions", json=chat(), headers=bad_run)
        ).status_code == 401
        refused = await gw.post("/v1/completions", json=chat(), headers={RUN: "r-401"})
        assert refused.status_code == 401 and "www-authenticate" in refused.headers
        assert refused.headers[RUN] == "r-401"
        models = await gw.get("/v1/models", headers={RUN: "r-models"})
        assert (models.status_code, models.headers[RUN]) == (401, "r-models")
        # helper-250: a route that is no turn answers its 401 without a run id unless the
        # request named one (/status, / and /v1/models made up a fresh one, naming no run).
        for path in ("/status", "/", "/v1/models", "/v1/models/m", "/v1/runs", "/v1/runs/a%20b"):
            for method in ("GET", "DELETE") if path == "/v1/runs/a%20b" else ("GET",):
                r = await gw.request(method, path)
                assert r.status_code == 401 and RUN not in r.headers, (method, path)
        assert (await gw.get("/health")).status_code == 200
        assert not seen

        auth = {"authorization": "Bearer s3cret"}
        r = await gw.post("/v1/chat/completions", json=chat(), headers=auth)
        assert r.status_code == 200
        assert (await gw.get("/v1/models", headers=auth)).status_code == 200
        assert (await gw.post("/v1/completions", json=chat(), headers=auth)).status_code == 404
        r = await gw.post("/v1/chat/completions", json=chat(), headers=auth | bad_run)
        assert r.status_code == 400 and RUN in r.headers
        assert [h["authorization"] for h in seen] == ["Bearer sk-upstream"]


async def test_a_401_says_it_wants_a_bearer_token_and_whether_the_one_sent_was_wrong(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # RFC 6750 section 3: a 401 carries WWW-Authenticate, with error="invalid_token"
    # only when a token was sent (3.1), on every door; no resource_metadata, as
    # luftpause serves no OAuth metadata: an OAuth client's discovery finds JSON 404s.
    monkeypatch.setenv("TEAM_A_TOKEN", "tok-a")
    sections = {"token": "op", "callers": [{"name": "team-a", "token_env": "TEAM_A_TOKEN"}]}
    asked = 'Bearer realm="luftpause"'
    wrong = 'Bearer realm="luftpause", error="invalid_token"'
    init = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "t", "version": "1"},
        },
    }
    mcp = {"accept": "application/json, text/event-stream"}
    body = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    async with (
        engine(instant=True) as (url, _),
        gateway(endpoint("a", url), token="op", sections=sections) as (gw, _),
    ):
        cases: list[tuple[str, str, dict[str, Any], Any, str | None]] = [
            ("POST", "/v1/chat/completions", {}, chat(), asked),
            ("POST", "/v1/chat/completions", {"authorization": "Bearer nope"}, chat(), wrong),
            # Another scheme, or a key where this route reads none: no token was sent.
            ("POST", "/v1/chat/completions", {"authorization": "Basic b3A6"}, chat(), asked),
            ("POST", "/v1/chat/completions", {"x-api-key": "nope"}, chat(), asked),
            ("GET", "/v1/models", {"x-api-key": "nope"}, None, wrong),
            # Every route that reads x-api-key counts it; no other route does.
            ("GET", f"/v1/models/{MODEL}", {"x-api-key": "nope"}, None, wrong),
            ("POST", "/v1/messages/count_tokens", {"x-api-key": "nope"}, body, wrong),
            ("GET", "/v1/messages", {"x-api-key": "nope"}, None, wrong),  # (its 405's route)
            ("GET", "/v1/runs", {"x-api-key": "nope"}, None, asked),
            ("GET", "/v1/runs", {"authorization": "Bearer"}, None, asked),  # (an empty one)
            ("POST", "/v1/messages", {}, body, asked),
            ("POST", "/v1/messages", {"x-api-key": "nope"}, body, wrong),
            ("POST", "/mcp", mcp, init, asked),
            ("POST", "/mcp", mcp | {"authorization": "Bearer nope"}, init, wrong),
            ("POST", "/mcp", mcp | {"x-api-key": "nope"}, init, asked),
            ("GET", "/status", {"authorization": "Bearer nope"}, None, wrong),
            ("GET", "/?token=nope", {}, None, wrong),
            ("GET", "/", {}, None, asked),
        ]
        for method, path, headers, payload, challenge in cases:
            r = await gw.request(method, path, headers=headers, json=payload)
            assert r.status_code == 401, (path, headers)
            assert r.headers["www-authenticate"] == challenge, (path, headers)
            assert "error" in r.json(), path  # the body as before
        # The right token, or a caller's on the operator's routes (403): no challenge.
        op, a = {"authorization": "Bearer op"}, {"authorization": "Bearer tok-a"}
        for method, path, headers, payload, status in (
            ("POST", "/v1/chat/completions", op, chat(), 200),
            ("POST", "/v1/messages", {"x-api-key": "tok-a"}, body, 200),
            ("POST", "/mcp", mcp | op, init, 200),
            ("POST", "/mcp", mcp | a, init, 200),
            ("GET", "/status", a, None, 403),
            ("POST", "/reload", a, None, 403),
            ("GET", "/status", op, None, 200),
        ):
            r = await gw.request(method, path, headers=headers, json=payload)
            assert r.status_code == status, (path, headers)
            assert "www-authenticate" not in r.headers, (path, headers)
        # What an OAuth client looks for first: a plain 404, which sends it no further.
        for path in (
            "/.well-known/oauth-protected-resource",
            "/.well-known/oauth-protected-resource/mcp",
            "/.well-known/oauth-authorization-server",
            "/.well-known/openid-configuration",
        ):
            r = await gw.get(path)
            assert r.status_code == 404 and "www-authenticate" not in r.headers, path
            assert r.json()["error"]["message"].startswith("luftpause does not serve"), path


async def test_a_callers_own_token_names_it_and_shows_it_only_its_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TEAM_A_TOKEN", "tok-a\n")  # a secret file's newline is dropped
    monkeypatch.setenv("TEAM_B_TOKEN", "tok-b")
    callers = [
        {"name": "team-a", "token_env": "TEAM_A_TOKEN"},
        {"name": "team-b", "token_env": "TEAM_B_TOKEN"},
    ]
    sections = {"token": "op", "callers": callers}
    a, b = {"authorization": "Bearer tok-a"}, {"authorization": "Bearer tok-b"}
    operator = {"authorization": "Bearer op"}
    async with (
        engine(instant=True) as (url, counted),
        gateway(endpoint("a", url), token="op", sections=sections) as (gw, shell),
    ):
        # The token names the caller: no header needed, and another's name is refused.
        r = await gw.post("/v1/chat/completions", json=chat("a's"), headers=a | {RUN: "ra"})
        assert r.status_code == 200 and shell.state.runs["ra"].caller == "team-a"
        r = await gw.post("/v1/chat/completions", json=chat(), headers=b | {CALLER: "team-b"})
        assert r.status_code == 200
        r = await gw.post("/v1/chat/completions", json=chat(), headers=a | {CALLER: "team-b"})
        assert r.status_code == 403 and RUN in r.headers
        assert r.json()["error"]["message"] == (
            "x-luftpause-caller says 'team-b', but this token is caller 'team-a''s: "
            "leave the header out, or name that caller"
        )
        body = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
        r = await gw.post("/v1/messages", json=body, headers={"x-api-key": "tok-b"})
        assert r.status_code == 200  # Claude Code's ANTHROPIC_API_KEY may be a caller's
        assert len(counted.chats) == 2  # the refused turn never reached the engine
        # The operator's token names any caller, as before.
        r = await gw.post(
            "/v1/chat/completions", json=chat(), headers=operator | {CALLER: "x", RUN: "rx"}
        )
        assert r.status_code == 200 and shell.state.runs["rx"].caller == "x"

        # Nor may a caller's token join another's run, which would make it its own.
        r = await gw.post("/v1/chat/completions", json=chat(), headers=b | {RUN: "ra"})
        assert r.status_code == 403 and r.headers[RUN] == "ra"
        assert r.json()["error"]["message"] == (
            "run 'ra' (named by x-luftpause-run-id) is another caller's; a caller's token "
            "joins only its own runs: send x-luftpause-run-id with a run id of your own"
        )
        # ... by a harness's session header either, in the API's own error shape.
        session = {"x-claude-code-session-id": "s-1"}
        r = await gw.post("/v1/messages", json=body, headers={"x-api-key": "tok-a"} | session)
        assert r.status_code == 200 and shell.state.runs[r.headers[RUN]].caller == "team-a"
        r = await gw.post("/v1/messages", json=body, headers={"x-api-key": "tok-b"} | session)
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
        assert "(named by the session header) is another caller's" in r.json()["error"]["message"]
        assert shell.state.runs["ra"].caller == "team-a" and len(counted.chats) == 3
        # The operator's token names any caller, into any run (the worker's turns).
        r = await gw.post(
            "/v1/chat/completions", json=chat(), headers=operator | {CALLER: "team-a", RUN: "ra"}
        )
        assert r.status_code == 200 and shell.state.runs["ra"].caller == "team-a"

        # Runs: a caller sees and ends only its own; another's is not known to it.
        listed = (await gw.get("/v1/runs", headers=a)).json()["runs"]
        assert [run["run_id"] for run in listed] == ["ra", "claude-code:s-1"]
        assert (await gw.get("/v1/runs?caller=team-b", headers=a)).status_code == 403
        assert (await gw.get("/v1/runs/ra", headers=a)).status_code == 200
        for method in ("GET", "DELETE"):
            r = await gw.request(method, "/v1/runs/ra", headers=b)
            assert r.status_code == 404
            assert r.json()["error"]["message"].startswith("run 'ra' is not known")
        assert "ra" in shell.state.runs  # b's DELETE ended nothing
        assert (await gw.delete("/v1/runs/ra", headers=a)).status_code == 204
        assert "ra" not in shell.state.runs
        assert len((await gw.get("/v1/runs", headers=operator)).json()["runs"]) >= 2

        # The operator's routes take only the operator's token.
        for method, path in (("GET", "/status"), ("GET", "/"), ("POST", "/reload")):
            r = await gw.request(method, path, headers=a)
            assert r.status_code == 403, path
            assert "caller 'team-a''s, which may not use this route" in r.json()["error"]["message"]
        # The page's ?token= as the header: a caller's own token is no wrong one (401).
        r = await gw.get("/", params={"token": a["authorization"].removeprefix("Bearer ")})
        assert r.status_code == 403 and "caller 'team-a''s" in r.json()["error"]["message"]
        op_token = operator["authorization"].removeprefix("Bearer ")
        assert (await gw.get("/", params={"token": op_token}, headers=a)).status_code == 200
        assert (await gw.get("/", params={"token": "nope"})).status_code == 401
        assert (await gw.get("/status", headers=operator)).status_code == 200
        assert (await gw.get("/v1/models", headers=b)).status_code == 200
        wrong = {"authorization": "Bearer tok"}
        assert (await gw.get("/v1/models", headers=wrong)).status_code == 401
        # Two callers naming one new run id at once: one starts it, the other is
        # refused (the check and the arrival are one step of the event loop).
        for i in range(20):
            pair = await asyncio.gather(
                gw.post("/v1/chat/completions", json=chat(), headers=a | {RUN: f"new-{i}"}),
                gw.post("/v1/chat/completions", json=chat(), headers=b | {RUN: f"new-{i}"}),
            )
            assert sorted(r.status_code for r in pair) == [200, 403], i


async def test_a_replica_that_fails_its_turns_is_taken_out_of_rotation() -> None:
    # Its health path answers, so its probe keeps it in rotation; each new run goes
    # there (least loaded: its failed turns hold nothing) and fails, until ejection.
    def broken(request: Request) -> Response:
        return Response('{"error": "CUDA error: an illegal memory access"}', 500)

    policy = Policy(eject_after_failures=2, eject_for_s=60)
    async with (
        serve(upstream(broken)) as bad,
        serve(upstream(ok_chat)) as good,
        gateway(
            endpoint("a", bad, kind="openai"), endpoint("b", good, kind="openai"), policy=policy
        ) as (gw, shell),
    ):
        codes = [(await gw.post("/v1/chat/completions", json=chat())).status_code for _ in range(4)]
        assert codes == [500, 500, 200, 200]
        assert not shell.state.replicas["a"].healthy
        metrics = (await gw.get("/metrics")).text
        assert 'luftpause_ejections_total{replica="a"} 1.0' in metrics
        assert 'luftpause_engine_turns_total{outcome="failed",replica="a"} 2.0' in metrics
        (a,) = [r for r in (await gw.get("/status")).json()["replicas"] if r["name"] == "a"]
        assert a["healthy"] is False and 55 < a["ejected_s"] <= 60


async def test_an_engine_saying_it_is_busy_is_not_ejected() -> None:
    # 503 (busy, retry later) and 4xx are answers, not failures of the engine.
    def busy(request: Request) -> Response:
        return Response('{"error": "busy"}', 503, headers={"retry-after": "1"})

    policy = Policy(eject_after_failures=2)
    async with (
        serve(upstream(busy)) as url,
        gateway(endpoint("a", url, kind="openai"), policy=policy) as (gw, shell),
    ):
        for _ in range(4):
            assert (await gw.post("/v1/chat/completions", json=chat())).status_code == 503
        assert shell.state.replicas["a"].healthy


async def test_a_body_over_the_limit_is_413_and_nothing_is_queued() -> None:
    limit = {"max_request_bytes": 4096}
    async with (
        engine(instant=True) as (url, counted),
        gateway(endpoint("a", url), sections=limit) as (gw, shell),
    ):
        big = chat("x" * 5000)
        message = "request body larger than 4,096 bytes (max_request_bytes)"
        r = await gw.post("/v1/chat/completions", json=big)
        assert r.status_code == 413 and r.json() == {"error": {"message": message}}
        assert r.headers[RUN]

        async def chunked() -> AsyncIterator[bytes]:  # no content-length: read, then cut
            raw = json.dumps(big).encode()
            for i in range(0, len(raw), 1000):
                yield raw[i : i + 1000]

        r = await gw.post("/v1/chat/completions", content=chunked())
        assert r.status_code == 413 and r.json() == {"error": {"message": message}}
        r = await gw.post("/v1/decide", json={"input": "x" * 5000, "labels": ["a", "b"]})
        assert r.status_code == 413 and r.json() == {"error": {"message": message}}
        assert not shell.state.turns and not shell.state.runs and not counted.bodies
        assert (await gw.post("/v1/chat/completions", json=chat("small"))).status_code == 200


async def test_models_are_listed_in_the_files_order() -> None:
    # The first is `spawn`'s default model: an operator puts the one sub-agents should
    # use first, whatever its name (sorted, a hosted "gpt-..." would go before "llama").
    async with (
        serve(upstream(ok_chat)) as url,
        gateway(
            endpoint("local", url, kind="openai", models=("llama-3.2-1b", "llama-guard")),
            endpoint("hosted", url, kind="openai", models=("gpt-4o", "llama-guard")),
        ) as (gw, _),
    ):
        listed = [m["id"] for m in (await gw.get("/v1/models")).json()["data"]]
        # One of them, as the OpenAI SDKs' models.retrieve asks (helper-125: a 404 of
        # a path not served), an id with a "/" in it too.
        one = await gw.get("/v1/models/gpt-4o")
        assert one.status_code == 200 and one.json()["id"] == "gpt-4o"
        assert one.json() == (await gw.get("/v1/models")).json()["data"][2]
        gone = await gw.get("/v1/models/meta-llama/Llama-3")
        assert gone.status_code == 404
        assert gone.json()["error"]["message"].startswith(
            "no generative replica serves model 'meta-llama/Llama-3' (served: gpt-4o,"
        )
        posted = await gw.post("/v1/models/gpt-4o", json={})
        assert (posted.status_code, posted.headers["allow"]) == (405, "GET")
    assert listed == ["llama-3.2-1b", "llama-guard", "gpt-4o"]


async def test_the_core_learns_what_a_models_engines_count_of_the_estimate() -> None:
    # The gateway estimates a prompt as a quarter of the request's bytes; the engine's
    # usage at the turn's end teaches the core the model's scale, and /status shows it.
    async with engine(instant=True) as (url, _), gateway(endpoint("a", url)) as (gw, shell):
        raw = json.dumps(chat("the quick brown fox jumps over the lazy dog " * 40)).encode()
        r = await gw.post(
            "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
        )
        assert r.status_code == 200
        counted = r.json()["usage"]["prompt_tokens"]
        await until(lambda: MODEL in shell.state.prompt_scale, "the turn's end")
        assert shell.state.prompt_scale[MODEL] == pytest.approx(counted / (len(raw) // 4))
        status = (await gw.get("/status")).json()
        assert status["prompt_scale"] == {MODEL: round(counted / (len(raw) // 4), 3)}
        # A turn with an inlined image is counted at a guess: no sample (helper-117).
        learned = shell.state.prompt_scale[MODEL]
        image = "data:image/png;base64," + "A" * 4096
        parts = [{"type": "text", "text": "what is this? " * 100},
                 {"type": "image_url", "image_url": {"url": image}}]  # fmt: skip
        body = {**chat(), "messages": [{"role": "user", "content": parts}]}
        r = await gw.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        await until(lambda: not shell.state.turns, "the image turn's end")
        assert shell.state.prompt_scale[MODEL] == learned
        # ... and one by URL is not counted at all (helper-118: it set the scale to 2).
        parts[1] = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
        r = await gw.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        await until(lambda: not shell.state.turns, "the image URL turn's end")
        assert shell.state.prompt_scale[MODEL] == learned


def test_what_no_estimate_measures_is_told_apart() -> None:
    from gateway.app import _chained, _has_media

    def media(body: Any) -> bool:
        return _has_media(json.dumps(body).encode())

    assert media({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]}]})  # fmt: skip
    assert media({"input": [{"role": "user", "content": [
        {"type": "input_file", "file_id": "file-1"}]}]})  # fmt: skip
    assert not media({"messages": [{"role": "user", "content": "an image of a file"}]})
    assert not media({"messages": [{"role": "user", "content": 'quote {"type": "image"}'}]})
    assert _chained({"previous_response_id": "resp_1", "input": "and then?"})
    assert _chained({"conversation": "conv_1", "input": "and then?"})
    assert not _chained({"input": "hi"})


async def test_an_http_1_0_client_gets_the_body_not_chunks() -> None:
    # RFC 9112 6.1: no chunked framing to an HTTP/1.0 client.  The engine's length went
    # unsent, so uvicorn chunked every answer, and a 1.0 client read "172\r\n{...".
    async with (
        engine(instant=True) as (url, _),
        gateway(endpoint("a", url)) as (gw, _),
    ):
        r = await gw.post("/v1/chat/completions", json=chat())  # HTTP/1.1: a length too
        assert r.status_code == 200 and r.headers["content-length"] == str(len(r.content))
        body = json.dumps(chat()).encode()
        host, port = gw.base_url.host, gw.base_url.port
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.0\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        raw = await reader.read()  # to EOF, as a 1.0 client reads
        writer.close()
        head, _, rest = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding" not in head.lower()
        assert json.loads(rest)["choices"][0]["message"]["role"] == "assistant"


async def test_a_router_gets_the_run_as_its_routing_key() -> None:
    # Behind a router whose policy keeps a session on one worker (SMG's manual and
    # consistent_hash: x-smg-routing-key; vllm-router's consistent_hash: x-session-id),
    # a run's turns then stay where its prefix is (helper-112: 4 and 4 of 8 turns on
    # two workers, where the client's own key kept them on one).  Engines get neither.
    seen: list[dict[str, str]] = []
    plain: list[dict[str, str]] = []
    async with (
        serve(upstream(ok_chat, seen)) as url,
        serve(upstream(ok_chat, plain)) as engine_url,
        gateway(
            endpoint("r", url, kind="router", health_path="/v1/models"),
        ) as (gw, _),
        gateway(endpoint("a", engine_url, kind="openai")) as (direct, _),
    ):
        for run in ("run-a", "run-a", "run-b"):
            r = await gw.post("/v1/chat/completions", json=chat(), headers={RUN: run})
            assert r.status_code == 200
        own = {RUN: "run-c", "x-session-id": "sess-9", "x-smg-routing-key": "key-9"}
        assert (await gw.post("/v1/chat/completions", json=chat(), headers=own)).is_success
        r = await direct.post("/v1/chat/completions", json=chat(), headers=own)
        assert r.status_code == 200
    keys = [(h["x-smg-routing-key"], h["x-session-id"]) for h in seen]
    assert keys == [("run-a", "run-a"), ("run-a", "run-a"), ("run-b", "run-b"), ("key-9", "sess-9")]
    (got,) = plain
    assert "x-smg-routing-key" not in got and "x-session-id" not in got


@pytest.mark.parametrize(
    ("sent", "engine_gets"),
    [
        # `curl -d` without -H: vLLM and SGLang answer it 400 (their
        # validate_json_request takes only application/json), SMG 400 too.
        ("application/x-www-form-urlencoded", "application/json"),
        ("text/plain", "application/json"),
        (None, "application/json"),
        ("application/json; charset=utf-8", "application/json; charset=utf-8"),
        ("Application/JSON", "Application/JSON"),
        # A space before the parameter is valid (RFC 9110's OWS), but vLLM's and
        # SGLang's check (lowercase, split at the first ";") reads the media type as
        # "application/json " and answers 400: not passed on (helper-253).
        ("application/json ; charset=utf-8", "application/json"),
        ("application/vnd.api+json", "application/json"),
    ],
)
async def test_the_engine_is_told_the_body_is_json_whatever_the_client_said(
    sent: str | None, engine_gets: str
) -> None:
    # helper-250: a turn luftpause had parsed as JSON and admitted went on with the
    # client's content type, and an engine that checks it refused the turn.
    seen: list[dict[str, str]] = []
    async with (
        serve(upstream(ok_chat, seen)) as url,
        gateway(endpoint("a", url, kind="openai")) as (gw, _),
    ):
        headers = {} if sent is None else {"content-type": sent}
        r = await gw.post("/v1/chat/completions", content=json.dumps(chat()), headers=headers)
        assert r.status_code == 200
    (got,) = seen
    assert got["content-type"] == engine_gets


@pytest.mark.parametrize("tracing", [False, True])
async def test_the_clients_request_id_and_trace_context_reach_the_engine(tracing: bool) -> None:
    provider = TracerProvider()  # exporting nowhere: only the trace context matters
    if tracing:
        telemetry.use(provider)
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    sent = {
        "x-request-id": "req-42",
        "x-correlation-id": "corr-7",
        "traceparent": parent,
        "tracestate": "vendor=1",
        "x-other": "kept here",
    }
    seen: list[dict[str, str]] = []
    try:
        async with (
            serve(upstream(ok_chat, seen)) as url,
            gateway(endpoint("a", url, kind="openai")) as (gw, _),
        ):
            r = await gw.post("/v1/chat/completions", json=chat(), headers=sent)
            assert r.status_code == 200
    finally:
        telemetry.use(None)
        provider.shutdown()
    (got,) = seen
    assert (got["x-request-id"], got["x-correlation-id"]) == ("req-42", "corr-7")
    assert "x-other" not in got
    if tracing:
        # luftpause's chat span continues the client's trace; the engine continues it.
        assert got["traceparent"].split("-")[1] == parent.split("-")[1]
        assert got["traceparent"] != parent
    else:
        assert (got["traceparent"], got["tracestate"]) == (parent, "vendor=1")


async def test_a_hosted_api_under_its_own_path_gets_turns_and_probes_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Gemini's OpenAI API is /v1beta/openai/chat/completions, not /v1/...
    monkeypatch.setenv("LUFTPAUSE_TEST_UPSTREAM_KEY", "sk-upstream")
    seen: list[dict[str, str]] = []
    async with (
        serve(upstream(ok_chat, seen, api_path="/v1beta/openai")) as url,
        gateway(
            endpoint(
                "gemini",
                url,
                kind="openai",
                api_key_env="LUFTPAUSE_TEST_UPSTREAM_KEY",
                api_path="/v1beta/openai",
            )
        ) as (gw, shell),
    ):
        # Probed healthy before serving, by its /v1beta/openai/models (the upstream has no
        # /v1/models: probed there, it would be unhealthy and the turn a 503).
        assert shell.state.replicas["gemini"].healthy
        r = await gw.post("/v1/chat/completions", json=chat())
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "hi"
        assert [(h[":path"], h["authorization"]) for h in seen] == [
            ("/v1beta/openai/chat/completions", "Bearer sk-upstream")
        ]


@pytest.mark.parametrize(
    ("content", "headers", "message"),
    [
        (b"{not json", {}, "request body is not valid JSON: "),
        (b"[1, 2]", {}, "request body is not valid JSON: "),
        (json.dumps(chat()).encode("utf-16-le"), {}, "expected UTF-8, not utf-16-le"),
        (json.dumps(chat()).encode("utf-32"), {}, "expected UTF-8, not utf-32"),
        (b'{"messages": [{"role": "user", "content": "x"}]}', {}, "'model'"),
        (b'{"model": 3, "messages": [{"role": "user"}]}', {}, "'model'"),
        (b'{"model": "llama-3.2-1b"}', {}, "'messages'"),
        (b'{"model": "llama-3.2-1b", "messages": []}', {}, "'messages'"),
        (
            json.dumps(chat()).encode(),
            {"x-luftpause-class": "urgent"},
            "x-luftpause-class must be 'interactive' or 'batch'",
        ),
    ],
)
async def test_malformed_requests_are_400(
    content: bytes, headers: dict[str, str], message: str
) -> None:
    seen: list[dict[str, str]] = []
    async with (
        serve(upstream(ok_chat, seen)) as url,
        gateway(endpoint("a", url, kind="openai")) as (gw, _),
    ):
        r = await gw.post("/v1/chat/completions", content=content, headers=headers)
        assert r.status_code == 400
        assert message in r.json()["error"]["message"]
        assert RUN in r.headers
        assert not seen


async def test_a_compressed_request_body_is_415_naming_its_encoding() -> None:
    # helper-156: a gzip body read as "not valid JSON: 'utf-8' codec can't decode byte
    # 0x8b"; the client is told what to change, on each door in its own shape.
    import gzip

    seen: list[dict[str, str]] = []
    coded = {"content-encoding": "gzip", "content-type": "application/json"}
    said = "request body in Content-Encoding 'gzip': send it uncompressed"
    async with (
        serve(upstream(ok_chat, seen)) as url,
        gateway(endpoint("a", url, kind="openai")) as (gw, _),
    ):
        for path, body in (
            ("/v1/chat/completions", chat()),
            ("/v1/messages", {"model": MODEL, "max_tokens": 5, "messages": []}),
            ("/v1/messages/count_tokens", {"model": MODEL, "messages": []}),
            ("/v1/decide", {"input": "x"}),
        ):
            r = await gw.post(path, content=gzip.compress(json.dumps(body).encode()), headers=coded)
            assert r.status_code == 415, (path, r.text)
            error = r.json()["error"]
            assert error["message"].startswith(said), (path, error)
            assert ("type" in error) == path.startswith("/v1/messages")  # Anthropic's shape
        # identity is no encoding
        r = await gw.post(
            "/v1/chat/completions", json=chat(), headers={"content-encoding": "identity"}
        )
        assert r.status_code == 200, r.text
        assert len(seen) == 1


async def test_caller_is_cut_to_128_bytes_utf8_safe() -> None:
    async with (
        serve(upstream(ok_chat)) as url,
        gateway(endpoint("a", url, kind="openai")) as (gw, shell),
    ):
        caller = "ä" * 100  # 200 bytes; the cut falls inside no character
        headers = {b"x-luftpause-caller": caller.encode(), RUN.encode(): b"c"}
        assert (await gw.post("/v1/chat/completions", json=chat(), headers=headers)).is_success
        assert shell.state.runs["c"].caller == "ä" * 64


async def test_a_turn_between_shutdown_and_the_last_answer_gets_a_json_503_naming_its_run() -> None:
    # The app's lifespan has not run (or has ended): no runtime to admit turns with.
    from gateway.app import GatewaySettings, create_app
    from luftpause.config import parse_config

    endpoints = [{"name": "a", "url": "http://127.0.0.1:9", "kind": "sglang", "models": [MODEL]}]
    app = create_app(GatewaySettings(config=parse_config({"endpoints": endpoints})))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        r = await c.post("/v1/chat/completions", json=chat(), headers={RUN: "r1"})
        assert (r.status_code, r.headers[RUN]) == (503, "r1")
        assert r.json() == {"error": {"message": "the gateway is shutting down"}}
        body = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
        r = await c.post("/v1/messages", json=body, headers={RUN: "r3"})
        assert (r.status_code, r.headers[RUN]) == (503, "r3")
        assert r.json() == {  # the Anthropic API's shape on its door
            "type": "error",
            "error": {"type": "overloaded_error", "message": "the gateway is shutting down"},
        }
        r = await c.delete("/v1/runs/r2")
        assert (r.status_code, r.headers[RUN]) == (503, "r2")
        r = await c.get("/status")
        assert r.status_code == 503 and r.json()["error"]["message"] == (
            "the gateway is shutting down"
        )


async def test_paths_no_route_serves_get_the_error_shape_too() -> None:
    async with engine(instant=True) as (url, _), gateway(endpoint("a", url)) as (gw, _):
        for method, path, status in (("GET", "/nope", 404), ("POST", "/status", 405)):
            r = await gw.request(method, path)
            assert r.status_code == status, (method, path)
            message = r.json()["error"]["message"]
            assert message.startswith(f"luftpause does not serve {method} {path}; it serves ")
            assert "GET /status" in message


async def test_an_empty_class_header_is_the_default_class_as_other_empty_headers() -> None:
    async with engine(instant=True) as (url, _), gateway(endpoint("a", url)) as (gw, shell):
        empty = {"x-luftpause-class": "", "x-luftpause-caller": "", RUN: "e"}
        r = await gw.post("/v1/chat/completions", json=chat(max_tokens=3), headers=empty)
        assert r.status_code == 200, r.text
        assert shell.state.runs["e"].service_class is ServiceClass.INTERACTIVE


async def test_hostile_run_ids_and_deep_json_get_400_not_500() -> None:
    async with engine(instant=True) as (url, _), gateway(endpoint("a", url)) as (gw, shell):
        for path in ("/v1/runs/%E2%82%AC", "/v1/runs/a%0D%0Ab", "/v1/runs/" + "x" * 129):
            r = await gw.delete(path)
            assert r.status_code == 400, path
            assert "run id: expected 1 to 128 printable ASCII" in r.json()["error"]["message"]
        ok = await gw.delete("/v1/runs/run-1")
        assert ok.status_code == 204
        # The proxy takes a run id header on the same terms, so every run can be ended.
        for bad in (b"x" * 129, "€uro".encode(), b"a b", b"team/run-1"):
            r = await gw.post("/v1/chat/completions", json=chat(), headers={RUN.encode(): bad})
            assert r.status_code == 400, bad
            message = r.json()["error"]["message"]
            assert message == (
                "x-luftpause-run-id: expected 1 to 128 printable ASCII characters, "
                "no spaces and no /"
            )
        assert not shell.state.runs
        deep = b"[" * 200_000
        for route in ("/v1/chat/completions", "/v1/decide"):
            r = await gw.post(route, content=deep, headers={"content-type": "application/json"})
            assert r.status_code == 400, route
            assert "nested too deeply" in r.json()["error"]["message"]


def _sse(*texts: str, finish: str = "stop") -> bytes:
    events = [{"choices": [{"index": 0, "delta": {"content": t}}]} for t in texts]
    events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + (
        b"data: [DONE]\n\n"
    )


@pytest.mark.parametrize(
    ("texts", "finish", "reported"),
    [
        (["Here is ", "the answer."], "stop", "stop"),  # prose
        (
            [
                "Let me look. ",
                "<tool_call>",
                '{"name": "lookup", ',
                '"arguments": {}}',
                "</tool_call>",
            ],
            "stop",
            "tool_calls",
        ),
        (['{"name": "lookup"', ', "arguments": {"query": "x"}}'], "stop", "tool_calls"),
        (['{"name": "other", "arguments": {}}'], "stop", "stop"),  # not offered
        (
            ["<tool_call>", '{"name": "lookup", "arguments": {}}', "</tool_call>"],
            "length",
            "length",
        ),
    ],
)
def test_the_watch_reads_calls_written_as_text_only_where_they_can_be(
    texts: list[str], finish: str, reported: str
) -> None:
    from gateway._proxy import StreamWatch

    watch = StreamWatch(sse=True, tools=frozenset({"lookup"}))
    for chunk in _sse(*texts, finish=finish).split(b"\n\n"):
        watch.feed(chunk + b"\n\n")
    watch.close()
    assert watch.finish_reason == reported


def test_a_prose_answer_keeps_nothing_after_its_first_words() -> None:
    from gateway._proxy import StreamWatch

    watch = StreamWatch(sse=True, tools=frozenset({"lookup"}))
    watch.feed(_sse("Sure, ", *(["word "] * 5000)))
    watch.close()
    assert watch.finish_reason == "stop" and watch._events == []


@pytest.mark.parametrize("sse", [True, False])
def test_text_nested_past_the_json_parsers_depth_is_an_answer(sse: bool) -> None:
    # A model may write anything; a "call" nested deeper than the JSON parser recurses
    # raised RecursionError out of the watch after the answer was sent: the turn was
    # counted abandoned and the run left retrying.
    from gateway._proxy import StreamWatch

    text = "[" * 3000 + "]" * 3000
    watch = StreamWatch(sse=sse, tools=frozenset({"lookup"}))
    if sse:
        watch.feed(_sse(text, finish="stop"))
    else:
        message = {"role": "assistant", "content": text}
        body = {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}
        watch.feed(json.dumps(body).encode())
    watch.close()
    assert watch.finish_reason == "stop" and watch.tool_call_ids == []


def test_a_caller_header_becomes_a_name_both_doors_share() -> None:
    from luftpause.headers import caller_name

    def sent(raw: bytes) -> str:  # what a server hands over: the bytes as latin-1
        return caller_name(raw.decode("latin-1"))

    assert sent(b"team-a") == "team-a"
    assert sent("jürgen".encode()) == "jürgen"  # UTF-8
    assert sent("José".encode("latin-1")) == "José"  # not UTF-8: read as latin-1
    assert sent(b"x" * 127 + b" tail") == "x" * 127  # no blank left at the cut
    assert sent(("ä" * 100).encode()) == "ä" * 64  # no character split
    assert sent(b"   ") == ""


def test_one_choice_ending_in_tool_calls_pauses_the_run_whatever_the_others_say() -> None:
    from gateway._proxy import StreamWatch

    events = [
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {"choices": [{"index": 1, "delta": {}, "finish_reason": "stop"}]},
    ]
    watch = StreamWatch(sse=True)
    watch.feed(b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events))
    watch.close()
    assert watch.finish_reason == "tool_calls"
    body = {"choices": [{"finish_reason": "tool_calls"}, {"finish_reason": "length"}]}
    watch = StreamWatch(sse=False)
    watch.feed(json.dumps(body).encode())
    watch.close()
    assert watch.finish_reason == "tool_calls"


async def test_health_answers_get_and_head() -> None:
    # Load balancers' health checks use either (a HEAD is a GET without the body).
    async with engine(instant=True) as (url, _), gateway(endpoint("a", url)) as (gw, _):
        got, head = await gw.get("/health"), await gw.head("/health")
        assert (got.status_code, got.json()) == (200, {"status": "ok"})
        assert (head.status_code, head.content) == (200, b"")
        assert (await gw.post("/health")).status_code == 405


@pytest.mark.parametrize(
    ("method", "path", "status", "allow"),
    [
        ("POST", "/v1/completions", 404, None),
        ("POST", "/v1/embeddings", 404, None),
        ("GET", "/v1/chat/completions", 405, "POST"),
        ("GET", "/v1/decide", 405, "POST"),
        ("POST", "/v1/models", 405, "GET"),
        ("POST", "/v1/runs/r1", 405, "GET, DELETE"),
        ("DELETE", "/v1/runs", 405, "GET"),
        ("GET", "/v1/runs/a/b", 404, None),  # was a 405 allowing the GET it refused
        ("DELETE", "/v1/runs/a/b", 404, None),
        ("GET", "/v1/runs/", 404, None),  # was a 405 allowing the GET it refused
        ("DELETE", "/v1/runs/", 404, None),
    ],
)
async def test_other_openai_routes_get_the_error_shape_and_what_is_served(
    method: str, path: str, status: int, allow: str | None
) -> None:
    async with engine(instant=True) as (url, counted), gateway(endpoint("a", url)) as (gw, _):
        r = await gw.request(method, path, json=chat(), headers={RUN: "keep-me"})
        # The run the client named is echoed, as on every /v1 answer (helper-65: a new
        # random id came back here).
        assert r.status_code == status and r.headers[RUN] == "keep-me"
        assert r.headers.get("allow") == allow  # RFC 9110: a 405 names the methods
        message = r.json()["error"]["message"]
        assert message.startswith(f"luftpause does not serve {method} {path}; it serves POST ")
        assert not counted.chats


# --------------------------------------------------------------------------- engines that misbehave
# (helper-63's hunt: each of these got a 500, a traceback, a wrong run state or a success)


def test_the_watch_takes_no_count_an_engine_could_not_mean() -> None:
    usage = {"prompt_tokens": -5, "completion_tokens": 10**40}
    for sse in (False, True):
        watch = StreamWatch(sse=sse)
        body = json.dumps({"choices": [], "usage": usage}).encode()
        watch.feed(b"data: " + body + b"\n\n" if sse else body)
        watch.close()
        assert (watch.prompt_tokens, watch.completion_tokens) == (0, 0)  # kept as estimated
    deep = b"[" * 200_000 + b"]" * 200_000  # past the parser's depth: no count, no crash
    for sse in (False, True):
        watch = StreamWatch(sse=sse)
        watch.feed(b'data: {"usage": ' + deep + b"}\n\n" if sse else deep)
        watch.close()
        assert watch.shapeless is not sse and watch.prompt_tokens == 0


def test_the_lines_after_an_oversized_one_in_its_last_chunk_are_read() -> None:
    watch = StreamWatch(sse=True)
    huge = b"data: " + b'{"choices": [{"delta": {"content": "' + b"x" * (6 << 20)
    watch.feed(huge[: 5 << 20])  # past the 4 MB a line is read up to
    end = (
        b'"}}]}\n\ndata: {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]}\n\n'
        b'data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2}}\n\n'
    )
    watch.feed(huge[5 << 20 :] + end)
    watch.close()
    assert watch.finish_reason == "tool_calls" and watch.prompt_tokens == 7


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        (b"HTTP/1.1 999 Odd\r\ncontent-length: 0\r\n\r\n", "answered status 999, which HTTP"),
        (
            b"HTTP/1.1 307 Moved\r\nlocation: http://elsewhere.example/v1\r\n"
            b"content-length: 0\r\n\r\n",
            "answered 307 (a redirect to http://elsewhere.example/v1); luftpause does not",
        ),
        (b"HTTP/1.1 204 No Content\r\n\r\n", "answered 204 without a body"),
    ],
)
async def test_a_status_that_is_no_answer_is_a_502_naming_the_engine(
    answer: bytes, said: str
) -> None:
    async with raw_engine(answer) as url, gateway(endpoint("a", url, kind="openai")) as (gw, shell):
        r = await gw.post("/v1/chat/completions", json=chat())
        message = r.json()["error"]["message"]
        assert r.status_code == 502 and message.startswith(f"engine a: {said}"), message
        await until(lambda: not shell.state.turns, "the turn failed and freed its slot")
        metrics = (await gw.get("/metrics")).text
        assert 'luftpause_turns_total{outcome="failed"} 1.0' in metrics


async def test_a_json_answer_that_is_no_json_object_fails_the_turn_on_the_engine() -> None:
    def garbled(request: Request) -> Response:
        return Response(b"<html>gateway error</html>", media_type="application/json")

    async with (
        serve(upstream(garbled)) as url,
        gateway(endpoint("a", url, kind="openai")) as (gw, shell),
    ):
        r = await gw.post("/v1/chat/completions", json=chat())
        assert r.status_code == 200 and r.content == b"<html>gateway error</html>"  # as sent
        await until(lambda: not shell.state.turns, "turn ended")
        metrics = (await gw.get("/metrics")).text
        assert 'luftpause_turns_total{outcome="failed"} 1.0' in metrics
        assert shell.state.replicas["a"].failures == 1  # the engine's fault


@pytest.mark.parametrize(
    "ping", [b": ping\n\n", b'event: ping\ndata: {"type": "ping"}\n\n'], ids=["comment", "event"]
)
async def test_an_engine_that_only_pings_is_stalled(ping: bytes) -> None:
    # (Anthropic's keep-alive is an event of its own: it kept a stalled stream open.)
    released = asyncio.Event()

    async def pinging(scope: Scope, receive: Receive, send: Send) -> None:
        if await answered_health(scope, send):
            return
        start = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": start})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        while not released.is_set():
            await send({"type": "http.response.body", "body": ping, "more_body": True})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(released.wait(), 0.1)  # the engine's pace

    policy = Policy(turn_timeout_s=0.5)
    async with (
        serve(pinging) as url,
        gateway(endpoint("a", url, kind="openai"), policy=policy) as (gw, shell),
    ):
        try:
            # (bounded: pings that kept the turn alive would keep this stream open)
            async with asyncio.timeout(30):
                with pytest.raises(httpx.RemoteProtocolError):
                    async with gw.stream(
                        "POST", "/v1/chat/completions", json=chat(stream=True)
                    ) as r:
                        async for _ in r.aiter_raw():
                            pass
            await until(lambda: not shell.state.turns, "the turn failed and freed its slot")
            metrics = (await gw.get("/metrics")).text
            assert 'luftpause_turns_total{outcome="failed"} 1.0' in metrics
        finally:
            released.set()


@pytest.mark.parametrize("code", [{"status": 500}, [500], None])
async def test_an_error_event_whose_code_is_no_string_is_the_engines(code: Any) -> None:
    # helper-141: a code that was an object or a list raised in the watch (TypeError:
    # unhashable): the stream cut without the error, the turn counted abandoned.
    async def failing(scope: Scope, receive: Receive, send: Send) -> None:
        if await answered_health(scope, send):
            return
        start = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": start})
        delta = b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n'
        error = {"error": {"message": "upstream failed", "code": code}}
        await send({"type": "http.response.body", "body": delta, "more_body": True})
        await send(
            {"type": "http.response.body", "body": f"data: {json.dumps(error)}\n\n".encode()}
        )

    async with (
        serve(failing) as url,
        gateway(endpoint("a", url, kind="openai")) as (gw, shell),
    ):
        r = await gw.post("/v1/chat/completions", json=chat(stream=True))
        assert r.status_code == 200 and "upstream failed" in r.text  # passed on, whole
        await until(lambda: not shell.state.turns, "the turn ended")
        metrics = (await gw.get("/metrics")).text
        assert 'luftpause_turns_total{outcome="failed"} 1.0' in metrics
        assert shell.state.replicas["a"].failures == 1


def test_keep_alives_are_told_from_data() -> None:
    assert not proxy_module._carries(b": ping\n\n")
    assert not proxy_module._carries(b"  \n")
    assert not proxy_module._carries(b": a\n: b\n\n")
    assert proxy_module._carries(b': ping\n\ndata: {"x": 1}\n\n')
    assert proxy_module._carries(b"data: {}\n\n")
    assert proxy_module._carries(b'{"choices"')
    ping = b'event: ping\ndata: {"type": "ping"}\n\n'
    assert not proxy_module._carries(ping)
    assert not proxy_module._carries(ping.replace(b"\n", b"\r\n") + b": x\n\n" + ping)
    assert proxy_module._carries(ping + b'event: message_start\ndata: {"type": "x"}\n\n')
    assert proxy_module._carries(b'event: ping_pong\ndata: {"type": "ping_pong"}\n\n')


@pytest.mark.parametrize(
    ("pieces", "carried"),
    [
        # helper-141: a keep-alive split anywhere is still no data, nor what follows
        # its end in the same piece unless it is data.
        ([b"event: response.created\n", b'data: {"type": "r"}\n', b"\n"], [0, 0, 0]),
        ([b'event: response.created\ndata: {"ty', b'pe": "r"}\n\n', b"data: {}\n\n"], [0, 0, 1]),
        ([b"event: response.created\ndata: {}\n", b"\ndata: {}\n\n"], [0, 1]),
        ([b": pi", b"ng\n\n", b"data: {}\n\n"], [0, 0, 1]),
        # lines ending in CR alone, or CRLF split between pieces
        ([b"data: {}\r\r", b": ping\r\r", b': ping\r\rdata: {"x": 1}\r\r'], [1, 0, 1]),
        ([b"event: response.created\r", b'\ndata: {"type": "r"}\r\n\r\n'], [0, 0]),
        # a piece that begins mid-line is data unless the line was a keep-alive's
        ([b'data: {"choices"', b': [{"delta": {}}]}\n\n'], [1, 1]),
        # helper-142: a keep-alive begun in a piece after its data is skipped next
        ([b"data: {}\n\n: p", b"ing\n\n"], [1, 0]),
        ([b'data: {"t": 1}\n\nevent: ping\n', b'data: {"type": "ping"}\n\n'], [1, 0]),
        ([b"data: {}\r\n\r\n: ping - 2025-01-01", b" 00:00:00\r\n\r\n"], [1, 0]),
        ([b'data: {"a"', b": 1}\n\n: p", b"ing\n\n"], [1, 1, 0]),
    ],
)
def test_keep_alives_split_across_pieces_are_still_no_data(
    pieces: list[bytes], carried: list[int]
) -> None:
    progress = proxy_module._Progress(sse=True)
    assert [int(progress.carries(p)) for p in pieces] == carried


_CHAT_CHUNK = {"choices": [{"index": 0, "delta": {"content": "par"}, "finish_reason": None}]}
_CHAT_END = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
_MESSAGE_START = {
    "type": "message_start",
    "message": {"id": "m1", "role": "assistant", "content": [], "usage": {"input_tokens": 5}},
}
_TEXT_DELTA = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta"}}
_MESSAGE_END = {"type": "message_delta", "delta": {"stop_reason": "end_turn"}}


@pytest.mark.parametrize(
    ("api", "events", "outcome"),
    [
        ("chat", [_CHAT_CHUNK, _CHAT_END, "[DONE]"], "finished"),
        ("chat", [_CHAT_CHUNK], "failed"),
        (
            "messages",
            [_MESSAGE_START, _TEXT_DELTA, _MESSAGE_END, {"type": "message_stop"}],
            "finished",
        ),
        ("messages", [_MESSAGE_START, _TEXT_DELTA], "failed"),
        # Either its finish reason or its end marker is enough (helper-152): an engine
        # whose finish reason the watch cannot read (a null finish_reason, the reason in
        # a key of its own, as Gemini's OpenAI API was seen to send) ...
        ("chat", [_CHAT_CHUNK, _CHAT_CHUNK, "[DONE]"], "finished"),
        ("messages", [_MESSAGE_START, _TEXT_DELTA, {"type": "message_stop"}], "finished"),
        # ... or lines ended by CR alone (the SSE grammar allows it; the watch reads LF).
        ("chat", [_CHAT_CHUNK, _CHAT_END, "[DONE]", "\r"], "finished"),
    ],
    ids=[
        "chat whole",
        "chat cut",
        "messages whole",
        "messages cut",
        "chat with no readable finish reason",
        "messages with no readable stop reason",
        "chat framed by CR",
    ],
)
async def test_a_stream_that_ends_before_its_finish_reason_failed(
    api: str, events: list[Any], outcome: str
) -> None:
    # helper-151: a stream ended cleanly (its chunked body closed, no error) before the
    # finish reason every engine sends last (a router that ends its own response when
    # its worker dies) counted as finished, an empty finish reason to the core.
    from fastapi.responses import StreamingResponse

    end = "\n\n"
    if events[-1] == "\r":  # every line ended by CR alone
        events, end = events[:-1], "\r\r"

    path = "/v1/chat/completions" if api == "chat" else "/v1/messages"
    app = models_only()

    @app.post(path)
    async def answer(request: Request) -> StreamingResponse:
        async def lines() -> AsyncIterator[str]:
            for e in events:
                yield f"data: {e if isinstance(e, str) else json.dumps(e)}{end}"

        return StreamingResponse(lines(), media_type="text/event-stream")

    body: dict[str, Any] = {"model": MODEL, "stream": True, "max_tokens": 8}
    body["messages"] = [{"role": "user", "content": "hi"}]
    async with (
        serve(app) as url,
        gateway(endpoint("a", url, kind="openai", messages=True)) as (gw, shell),
    ):
        r = await gw.post(path, json=body, headers={RUN: "r1"})
        assert r.status_code == 200 and r.text.count("data: ") == len(events)  # as sent
        await until(lambda: not shell.state.turns, "the turn ended")
        metrics = (await gw.get("/metrics")).text
        assert f'luftpause_turns_total{{outcome="{outcome}"}} 1.0' in metrics
        run = shell.state.runs["r1"]
        assert run.retrying == (outcome == "failed")  # the retry goes back to a
        assert shell.state.replicas["a"].failures == (outcome == "failed")


_CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}


def _chunk(delta: dict[str, Any], finish: str | None, **more: Any) -> str:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return (
        f"data: {json.dumps({'object': 'chat.completion.chunk', 'choices': [choice], **more})}\n\n"
    )


async def test_a_client_that_closes_at_done_had_a_finished_turn() -> None:
    """The OpenAI SDK (own-loop agents, the Agents SDK, LangChain) stops reading at
    `data: [DONE]` and closes.  When the engine's end of response came after that (a
    router between, a hosted endpoint far away), the turn counted as `client_left`: its
    usage was lost, and its run, which had asked for a tool, read idle, not paused
    (helper-156).  It had the whole answer: finished."""
    from fastapi.responses import StreamingResponse

    release = asyncio.Event()
    app = models_only()

    @app.post("/v1/chat/completions")
    async def answer(request: Request) -> StreamingResponse:
        async def lines() -> AsyncIterator[str]:
            yield _chunk({"role": "assistant", "tool_calls": [{**_CALL, "index": 0}]}, None)
            usage = {"prompt_tokens": 100, "completion_tokens": 7, "total_tokens": 107}
            yield _chunk({}, "tool_calls", usage=usage)
            yield "data: [DONE]\n\n"
            with contextlib.suppress(TimeoutError):  # its end of response: after the close
                await asyncio.wait_for(release.wait(), 30)

        return StreamingResponse(lines(), media_type="text/event-stream")

    async with serve(app) as url, gateway(endpoint("a", url, kind="openai")) as (gw, shell):
        body = json.dumps(chat(stream=True, tools=TOOLS)).encode()
        host, port = str(gw.base_url).split("//")[1].rstrip("/").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: luftpause\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        )
        got = b""
        try:
            async with asyncio.timeout(30):
                while b"data: [DONE]" not in got:
                    got += await reader.read(65536)
            writer.close()  # as the SDK does: the stream said it ended
            await until(lambda: not shell.state.turns, "the turn ended")
        finally:
            release.set()
        (run_id,) = re.findall(rb"x-luftpause-run-id: (\S+)", got)
        metrics = (await gw.get("/metrics")).text
        assert 'luftpause_turns_total{outcome="finished"} 1.0' in metrics
        assert 'luftpause_turns_total{outcome="client_left"} 0.0' in metrics
        assert re.search(r'luftpause_prompt_tokens_total\{[^}]*replica="a"[^}]*\} 100\.0', metrics)
        assert shell.state.runs[run_id.decode()].phase is RunPhase.PAUSED


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_tool_calls_said_to_stop_pause_their_run(stream: bool) -> None:
    """vLLM and OpenAI answer a named tool_choice with the calls and finish_reason
    "stop"; the client runs them and comes back.  The run read idle, neither pinned to
    its replica nor given room before batch turns (helper-156): it is paused."""
    from fastapi.responses import StreamingResponse

    app = models_only()

    @app.post("/v1/chat/completions")
    async def answer(request: Request) -> Response:
        if not stream:
            message = {"role": "assistant", "content": None, "tool_calls": [_CALL]}
            choice = {"index": 0, "message": message, "finish_reason": "stop"}
            usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
            body = {"object": "chat.completion", "choices": [choice], "usage": usage}
            return Response(json.dumps(body), media_type="application/json")

        async def lines() -> AsyncIterator[str]:
            yield _chunk({"role": "assistant", "tool_calls": [{**_CALL, "index": 0}]}, None)
            yield _chunk({}, "stop")
            yield "data: [DONE]\n\n"

        return StreamingResponse(lines(), media_type="text/event-stream")

    async with serve(app) as url, gateway(endpoint("a", url, kind="openai")) as (gw, shell):
        named = {"type": "function", "function": {"name": "lookup"}}
        r = await gw.post(
            "/v1/chat/completions", json=chat(stream=stream, tools=TOOLS, tool_choice=named)
        )
        assert r.status_code == 200, r.text
        assert shell.state.runs[r.headers[RUN]].phase is RunPhase.PAUSED


async def test_a_fault_in_a_turn_before_its_answer_began_is_answered_in_json(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The turn runs in its response, past the handler's try: a fault there reached
    # uvicorn, whose 500 is plain text (helper-181).  The slot is freed either way.
    from gateway._proxy import TurnResponse

    async def broken(self: Any, *args: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(TurnResponse, "_forward", broken)
    async with (
        serve(upstream(ok_chat)) as url,
        gateway(endpoint("a", url, kind="openai")) as (gw, shell),
    ):
        r = await gw.post("/v1/chat/completions", json=chat())
        assert r.status_code == 500
        assert r.json() == {"error": {"message": "internal error in the gateway (logged)"}}
        assert not shell.state.turns
        # The turn's own run: a retry that names it keeps it (helper-183: a new id).
        assert list(shell.state.runs) == [r.headers[RUN]]


async def test_a_fault_in_a_turn_after_its_head_cuts_the_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Once the engine's head went out, no second answer follows: the connection closes.
    from gateway._proxy import TurnResponse

    async def broken(self: Any, replica: str, scope: Any, receive: Any, send: Any, *a: Any) -> None:
        self.started = True
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        raise RuntimeError("a bug")

    monkeypatch.setattr(TurnResponse, "_forward", broken)
    async with (
        serve(upstream(ok_chat)) as url,
        gateway(endpoint("a", url, kind="openai")) as (gw, shell),
    ):
        assert await _cut_stream(gw) == b"data: {}\n\n"
        await until(lambda: not shell.state.turns, "the turn's slot is freed")


ERROR_400 = b'data: {"error": {"message": "bad", "type": "BadRequestError", "code": 400}}\n\n'


@pytest.mark.parametrize(
    ("watch", "chunks", "first"),
    [
        # A token passed over unparsed (the fast path) is data before the error.
        ("chat", [b'data: {"choices": [{"delta": {"content": "Hi"}}]}\n\n', ERROR_400], False),
        ("chat", [ERROR_400], True),
        # The events that open a Responses or Messages stream are no data: vLLM sends
        # response.created before its lazy request checks (helper-182).
        (
            "responses",
            [
                b'event: response.created\ndata: {"type": "response.created", '
                b'"response": {"id": "resp_1", "status": "in_progress"}}\n\n',
                b'event: response.in_progress\ndata: {"type": "response.in_progress"}\n\n',
                b'event: error\ndata: {"type": "error", "code": "400", "message": "bad"}\n\n',
            ],
            True,
        ),
        (
            "responses",
            [
                b'data: {"type": "response.created", "response": {"id": "r"}}\n\n'
                b'data: {"type": "response.output_text.delta", "delta": "Hi"}\n\n',
                b'data: {"type": "error", "code": "400", "message": "bad"}\n\n',
            ],
            False,
        ),
        (
            "messages",
            [
                b'event: message_start\ndata: {"type": "message_start", "message": '
                b'{"usage": {"input_tokens": 3}}}\n\n',
                b'event: error\ndata: {"type": "error", "error": {"message": "bad", '
                b'"code": 400}}\n\n',
            ],
            True,
        ),
        # vLLM writes its openai-python events with `type` last, after a response
        # whose tools and format carry types of their own (helper-184).
        (
            "responses",
            [
                b'event: response.created\ndata: {"response": {"id": "resp_1", "tools": '
                b'[{"type": "function", "name": "f", "parameters": {"type": "object"}}], '
                b'"text": {"format": {"type": "json_schema"}}}, "sequence_number": 0, '
                b'"type": "response.created"}\n\n',
                b'data: {"type": "error", "code": "400", "message": "bad"}\n\n',
            ],
            True,
        ),
        # By each event's own type (helper-183): an SSE id line is no data, and a tool
        # named "ping" is no ping.
        (
            "responses",
            [
                b'id: 1\nevent: response.created\ndata: {"type": "response.created"}\n\n',
                b'data: {"type": "error", "code": "400", "message": "bad"}\n\n',
            ],
            True,
        ),
        (
            "messages",
            [
                b'data: {"type": "content_block_start", "index": 0, "content_block": '
                b'{"type": "tool_use", "id": "t", "name": "ping", "input": {}}}\n\n',
                b'data: {"type": "error", "error": {"message": "bad", "code": 400}}\n\n',
            ],
            False,
        ),
    ],
)
def test_an_error_event_comes_first_unless_data_came_before_it(
    watch: str, chunks: list[bytes], first: bool
) -> None:
    from gateway._proxy import MessagesWatch, ResponsesWatch, stream_error_is_engines

    w = {"chat": StreamWatch, "responses": ResponsesWatch, "messages": MessagesWatch}[watch](
        sse=True
    )
    for chunk in chunks:
        w.feed(chunk)
    w.close()
    assert w.error is not None and w.error_status == 400
    assert w.error_first is first
    assert stream_error_is_engines(w.error_status, w.error_type, w.error_first) is not first


async def _cut_stream(gw: httpx.AsyncClient) -> bytes:
    """What a streamed chat turn's client got before its connection was cut: a 200,
    then the connection broken mid-body."""
    got = b""
    with pytest.raises(httpx.RemoteProtocolError):
        async with gw.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as r:
            assert r.status_code == 200
            async for chunk in r.aiter_raw():
                got += chunk
    return got
