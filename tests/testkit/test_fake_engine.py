"""Tests for testkit.fake_engine: real HTTP over loopback against an in-process uvicorn
(and one `python -m luftpause fake-engine` subprocess)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from testkit._fake_text import LONG_REPLY_TOKENS, render_message
from testkit.engine import EngineParams
from testkit.fake_engine import FLAVORS, FakeEngineSettings, create_app
from testkit.loopback import serve

ROOT = Path(__file__).resolve().parents[2]
MODEL = "llama-3.2-1b"
# Bounded polling: 400 x 10 ms.
POLLS, POLL_S = 400, 0.01

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look something up.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "limit": {"type": "integer"},
                    "exact": {"type": "boolean"},
                },
                "required": ["query", "limit", "exact"],
            },
        },
    }
]


@contextlib.asynccontextmanager
async def fake_engine(**kw: Any) -> AsyncIterator[httpx.AsyncClient]:
    """Serve a fake engine on a free loopback port; yield a client for it."""
    async with (
        serve(create_app(FakeEngineSettings(**kw))) as url,
        httpx.AsyncClient(base_url=url, timeout=20) as client,
    ):
        yield client


def chat(content: str = "Hello there, how are you?", **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


async def metric(client: httpx.AsyncClient, name: str) -> float:
    text = (await client.get("/metrics")).text
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics:\n{text}"
    return float(m.group(1))


async def wait_metric(client: httpx.AsyncClient, name: str, pred: Any) -> float:
    for _ in range(POLLS):
        value = await metric(client, name)
        if pred(value):
            return value
        await asyncio.sleep(POLL_S)
    raise AssertionError(f"{name} stayed at {value}")


async def read_events(response: httpx.Response) -> list[str]:
    return [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]


# --------------------------------------------------------------------------- completions


async def test_completion_with_usage() -> None:
    async with fake_engine(time_scale=50) as client:
        r = await client.post("/v1/chat/completions", json=chat(max_tokens=30))
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion"
        assert body["id"].startswith("chatcmpl-") and body["model"] == MODEL
        choice = body["choices"][0]
        assert choice["message"]["role"] == "assistant"
        assert choice["finish_reason"] == "length"  # replies are >= 40 tokens
        usage = body["usage"]
        assert usage["completion_tokens"] == 30
        assert len(choice["message"]["content"]) == 30 * 4
        assert usage["prompt_tokens"] > 0
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0

        # Without max_tokens the reply is 40..256 tokens and ends with "stop" (or
        # "length" at exactly 256).
        r = await client.post("/v1/chat/completions", json=chat("another conversation"))
        body = r.json()
        n = body["usage"]["completion_tokens"]
        assert 40 <= n <= 256
        assert body["choices"][0]["finish_reason"] == ("length" if n == 256 else "stop")

        # max_completion_tokens wins; a null one is not given (SDKs send it so).
        for limits, want in (({"max_completion_tokens": 7, "max_tokens": 30}, 7),
                             ({"max_completion_tokens": None, "max_tokens": 5}, 5)):  # fmt: skip
            r = await client.post("/v1/chat/completions", json=chat("a third", **limits))
            assert r.json()["usage"]["completion_tokens"] == want, limits


async def test_a_stopped_clock_holds_the_engine_where_it_stands() -> None:
    one = replace(EngineParams.reference(), max_running_requests=1)
    app = create_app(FakeEngineSettings(time_scale=20, engine=one))
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=20) as client:
        app.state.clock.stop()
        sent = [
            asyncio.create_task(
                client.post("/v1/chat/completions", json=chat(f"q {i}", max_tokens=60))
            )
            for i in range(2)
        ]
        await wait_metric(client, "sglang:num_queue_reqs", lambda v: v == 1)
        # At 20x both replies take ~70 ms of wall time; a clock that moved would have
        # finished them within the half second this waits.
        done, _ = await asyncio.wait(sent, timeout=0.5)
        assert not done
        assert await metric(client, "sglang:num_running_reqs") == 1
        assert await metric(client, "sglang:num_queue_reqs") == 1
        app.state.clock.go()
        replies = [r.json() for r in await asyncio.gather(*sent)]
        assert [r["usage"]["completion_tokens"] for r in replies] == [60, 60]
        assert await metric(client, "sglang:num_queue_reqs") == 0


async def test_data_parallel_ranks_keep_caches_of_their_own() -> None:
    async with fake_engine(time_scale=50, dp_size=2) as client:

        async def cached(rank: str) -> int:
            body = chat("a long context " * 40, max_tokens=5)
            r = await client.post("/v1/chat/completions", json=body, headers={H: rank})
            assert r.status_code == 200, r.text
            return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

        H = "X-Data-Parallel-Rank"
        assert await cached("1") == 0
        assert await cached("1") > 0  # the prefix is in rank 1's cache ...
        assert await cached("0") == 0  # ... and not in rank 0's
        for bad in ("2", "-1", "one"):
            r = await client.post("/v1/chat/completions", json=chat(), headers={H: bad})
            assert r.status_code == 400
            assert r.json()["error"]["message"] == (
                f"X-Data-Parallel-Rank must be a rank 0 to 1: {bad!r}"
            )
        text = (await client.get("/metrics")).text
        assert re.search(r'^sglang:num_running_reqs\{[^}]*dp_rank="1"[^}]*\} 0\.0$', text, re.M)
        info = (await client.get("/get_server_info")).json()
        assert info["dp_size"] == 2


async def test_an_instant_engine_reports_each_of_its_ranks() -> None:
    # It reported one unlabelled rank whatever its dp_size (helper-203): a gateway
    # reading its ranks saw one server, not two.
    async with fake_engine(instant=True, dp_size=2) as client:
        text = (await client.get("/metrics")).text
        for rank in ("0", "1"):
            pattern = rf'^sglang:num_running_reqs\{{[^}}]*dp_rank="{rank}"[^}}]*\}} 0\.0$'
            assert re.search(pattern, text, re.M), rank
        assert [r["dp_rank"] for r in (await client.get("/get_load")).json()] == [0, 1]


async def test_stream_chunks_arrive_over_time_and_end_with_done() -> None:
    # 1x: 60 tokens take ~0.7 s, so the engine is still generating when the first
    # content chunk arrives.
    async with fake_engine(time_scale=1) as client:
        req = chat("tell me a story", max_tokens=60, stream=True)
        req["stream_options"] = {"include_usage": True}
        events = []
        running_at_first_content = None
        async with client.stream("POST", "/v1/chat/completions", json=req) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if running_at_first_content is None and '"content": " ' in line:
                    running_at_first_content = await metric(client, "sglang:num_running_reqs")
        assert running_at_first_content == 1
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert len({c["id"] for c in chunks}) == 1
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        usage_chunk = chunks[-1]
        assert usage_chunk["choices"] == []
        assert usage_chunk["usage"]["completion_tokens"] == 60
        final = chunks[-2]["choices"][0]
        assert final["finish_reason"] == "length" and final["delta"] == {}
        pieces = [c["choices"][0]["delta"]["content"] for c in chunks[1:-2]]
        assert len(pieces) > 1, "content should arrive in several chunks as it is generated"
        assert all(0 < len(p) <= 5 * 4 for p in pieces)  # 1..5 tokens per chunk
        streamed = "".join(pieces)

        # The same conversation, not streamed, says the same thing.
        plain = await client.post(
            "/v1/chat/completions", json=chat("tell me a story", max_tokens=60)
        )
        assert plain.json()["choices"][0]["message"]["content"] == streamed

        # Without include_usage: no usage chunk.
        async with client.stream(
            "POST", "/v1/chat/completions", json=chat("short", max_tokens=3, stream=True)
        ) as r:
            events = await read_events(r)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"


async def test_repeated_and_growing_conversations_hit_the_cache() -> None:
    long_context = "You are a careful agent. " * 40  # ~250 tokens: several 16-token blocks
    messages = [
        {"role": "system", "content": long_context},
        {"role": "user", "content": "first question"},
    ]
    async with fake_engine(time_scale=50) as client:
        first = (await client.post("/v1/chat/completions", json={"messages": messages})).json()
        again = (await client.post("/v1/chat/completions", json={"messages": messages})).json()
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == again["usage"]["prompt_tokens"] - 1  # all but the last (its logits)

        grown = [
            *messages,
            first["choices"][0]["message"],
            {"role": "user", "content": "second question"},
        ]
        turn2 = (await client.post("/v1/chat/completions", json={"messages": grown})).json()
        usage = turn2["usage"]
        # The previous prompt and the reply (its output blocks) are both cached.
        assert usage["prompt_tokens_details"]["cached_tokens"] > first["usage"]["prompt_tokens"]
        assert usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]
        assert await metric(client, "sglang:cache_hit_rate") > 0


@pytest.mark.parametrize("flavor", FLAVORS)
@pytest.mark.parametrize("report", ["always", "hits", "never"])
async def test_cached_tokens_are_stated_as_the_engines_flags_say(flavor: str, report: str) -> None:
    # llama.cpp states them in every answer ("always"); SGLang with --enable-cache-report
    # and vLLM with --enable-prompt-tokens-details only when they found some ("hits");
    # without those flags neither does, nor Ollama ("never").  Each API asked twice with
    # one long system prompt: a miss, then a hit.
    def system(api: str) -> str:
        return f"You are a careful agent for {api}. " * 40

    def stated(api: str, body: dict[str, Any]) -> int | None:
        usage = body["usage"]
        if api == "messages":
            read = usage.get("cache_read_input_tokens")
            return None if read is None else int(read)
        details = usage["input_tokens_details" if api == "responses" else "prompt_tokens_details"]
        return None if details is None else int(details["cached_tokens"])

    hi = [{"role": "user", "content": "hi"}]
    requests = {
        "chat": (
            "/v1/chat/completions",
            {"messages": [{"role": "system", "content": system("chat")}, *hi]},
        ),
        "messages": (
            "/v1/messages",
            {"max_tokens": 32, "system": system("messages"), "messages": hi},
        ),
        "responses": ("/v1/responses", {"instructions": system("responses"), "input": "hi"}),
    }
    async with fake_engine(time_scale=50, flavor=flavor, cache_report=report) as client:
        for api, (path, body) in requests.items():
            miss, hit = [(await client.post(path, json=body)).json() for _ in range(2)]
            said = [stated(api, miss), stated(api, hit)]
            if api == "responses" and flavor == "sglang":
                # SGLang's Responses API says 0 of what its Chat Completions leaves out.
                assert said[0] == 0 and (said[1] == 0) == (report == "never"), said
                assert hit["usage"]["input_tokens"] == miss["usage"]["input_tokens"]
                continue
            if api == "messages" and flavor == "sglang" and report == "always":
                # SGLang's Messages API (0.5.19) leaves out a cache read of 0.
                assert said[0] is None and said[1] is not None and said[1] > 0, said
                assert hit["usage"]["input_tokens"] + said[1] == miss["usage"]["input_tokens"]
                continue
            if api == "responses" and flavor == "vllm":
                # vLLM's Responses API states them always, its flag not asked (helper-193).
                assert said[0] == 0 and said[1] is not None and said[1] > 0, said
                continue
            assert said[0] == (0 if report == "always" else None), (api, said)
            if report == "never":
                assert said[1] is None, (api, said)
            else:
                assert said[1] is not None and said[1] > 0, (api, said)
            if api == "messages":
                # The others count the prompt net of what they say was cached.
                whole = miss["usage"]["input_tokens"] + (said[0] or 0)
                assert hit["usage"]["input_tokens"] + (said[1] or 0) == whole

        # A stream's usage chunk says the same as its JSON answer.
        stream = {**requests["chat"][1], "stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", "/v1/chat/completions", json=stream) as r:
            events = await read_events(r)
        details = json.loads(events[-2])["usage"]["prompt_tokens_details"]
        assert (details is None) == (report == "never"), details


async def run_agent(client: httpx.AsyncClient, first_user: str) -> int:
    """Drive one tool-calling run to its answer; return its number of tool calls."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": first_user}]
    for calls in range(10):
        body = {"messages": messages, "tools": TOOLS, "fake_max_tool_calls": 3}
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        if choice["finish_reason"] != "tool_calls":
            assert choice["finish_reason"] in ("stop", "length")
            assert choice["message"]["content"]
            return calls
        message = choice["message"]
        assert message["content"] is None
        (call,) = message["tool_calls"]
        assert re.fullmatch(r"call_[0-9a-f]{16}", call["id"])
        assert call["type"] == "function"
        assert call["function"]["name"] == "lookup"
        args = json.loads(call["function"]["arguments"])
        # Strings carry a per-call salt, so repeated calls are told apart by arguments.
        assert args == {
            "query": f"lookup-{int(call['id'][5:], 16) % 16**10:010x}",
            "limit": 1,
            "exact": True,
        }
        assert r.json()["usage"]["completion_tokens"] <= 20
        messages += [message, {"role": "tool", "tool_call_id": call["id"], "content": "42"}]
    raise AssertionError("the run did not end")


async def test_tool_calls_then_an_answer() -> None:
    async with fake_engine(time_scale=100) as client:
        counts = [await run_agent(client, f"task number {i}") for i in range(8)]
        assert all(0 <= k <= 3 for k in counts)
        assert any(k >= 1 for k in counts), counts
        # Deterministic: the same run makes the same number of calls.
        assert await run_agent(client, "task number 0") == counts[0]

        # Streaming tool calls: one delta with id/name, one with the arguments.
        k_runs = [i for i, k in enumerate(counts) if k >= 1]
        body = {
            "messages": [{"role": "user", "content": f"task number {k_runs[0]}"}],
            "tools": TOOLS,
            "fake_max_tool_calls": 3,
            "stream": True,
        }
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            events = [json.loads(e) for e in (await read_events(r))[:-1]]
        deltas = [e["choices"][0]["delta"] for e in events]
        calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
        assert len(calls) == 2
        assert calls[0]["function"]["name"] == "lookup" and calls[0]["id"].startswith("call_")
        assert json.loads(calls[1]["function"]["arguments"])["query"].startswith("lookup-")
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"

        # A call max_tokens cuts off is no call: its text so far, "length" (as an
        # engine's tool parser that finds no whole call answers).
        body = {"messages": body["messages"], "tools": TOOLS, "fake_max_tool_calls": 3}
        r = await client.post("/v1/chat/completions", json={**body, "max_tokens": 3})
        cut = r.json()["choices"][0]
        assert cut["finish_reason"] == "length" and "tool_calls" not in cut["message"]
        assert cut["message"]["content"] == "<tool_call>{"  # 3 tokens of 4 characters
        assert r.json()["usage"]["completion_tokens"] == 3

        # fake_max_tool_calls=0: never a tool call.
        body = {"messages": body["messages"], "tools": TOOLS, "fake_max_tool_calls": 0}
        r = await client.post("/v1/chat/completions", json=body)
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("instant", [False, True])
async def test_tool_choice_is_honoured(instant: bool) -> None:
    # As vLLM and SGLang: "none" makes no call, "required" or a named function at least
    # one (of that function) whatever the run would have done; in every API.
    tools = [*TOOLS, {"type": "function", "function": {"name": "other"}}]
    named = {"type": "function", "function": {"name": "other"}}
    async with fake_engine(time_scale=100, instant=instant) as client:

        async def finish(task: str, choice: Any, **kw: Any) -> tuple[str, list[str]]:
            body = {"messages": [{"role": "user", "content": task}], "tools": tools, **kw}
            r = await client.post("/v1/chat/completions", json={**body, "tool_choice": choice})
            assert r.status_code == 200, r.text
            choice0 = r.json()["choices"][0]
            names = [c["function"]["name"] for c in choice0["message"].get("tool_calls") or []]
            return choice0["finish_reason"], names

        calls = {i: await finish(f"task number {i}", "auto") for i in range(8)}
        silent = next(i for i, (f, _) in calls.items() if f != "tool_calls")
        busy = next(i for i, (f, _) in calls.items() if f == "tool_calls")
        assert (await finish(f"task number {busy}", "none"))[0] in ("stop", "length")
        assert (await finish(f"task number {silent}", "required"))[0] == "tool_calls"
        assert await finish(f"task number {silent}", named) == ("tool_calls", ["other"])
        assert await finish(f"task number {busy}", named, parallel_tool_calls=True) == (
            "tool_calls",
            ["other"] * len(calls[busy][1]),
        )
        # The same through the Messages and Responses APIs' own shapes.
        msg = {"max_tokens": 64, "messages": [{"role": "user", "content": f"task number {silent}"}]}
        anthropic_tools = [{"name": "lookup", "input_schema": {}}, {"name": "other"}]
        r = await client.post(
            "/v1/messages",
            json={
                **msg,
                "tools": anthropic_tools,
                "tool_choice": {"type": "tool", "name": "other"},
            },
        )
        assert r.json()["stop_reason"] == "tool_use", r.text
        assert [b["name"] for b in r.json()["content"] if b["type"] == "tool_use"] == ["other"]

        async def kinds(task: str, choice: str) -> list[str]:
            lookup = {"type": "function", "name": "lookup", "parameters": {}}
            body = {"input": task, "tools": [lookup], "tool_choice": choice}
            r = await client.post("/v1/responses", json=body)
            assert r.status_code == 200, r.text
            return [o["type"] for o in r.json()["output"]]

        tasks = [f"task number {i}" for i in range(8)]
        calling = [t for t in tasks if "function_call" in await kinds(t, "auto")]
        assert calling and await kinds(calling[0], "none") == ["message"]

        bad = [
            ("always", "'tool_choice' must be"),
            ({"type": "function", "function": {"name": "nope"}}, "'nope', which is not in"),
        ]
        for choice, says in bad:
            r = await client.post(
                "/v1/chat/completions", json={**chat(), "tools": tools, "tool_choice": choice}
            )
            assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
        r = await client.post("/v1/chat/completions", json={**chat(), "tool_choice": "required"})
        assert r.status_code == 400 and "needs 'tools'" in r.json()["error"]["message"]


async def test_parallel_tool_calls_and_directives() -> None:
    tools = [*TOOLS, {"type": "function", "function": {"name": "other"}}]
    async with fake_engine(time_scale=100) as client:
        # A run with k >= 2 calls: asked for parallel calls, it makes them all in one turn.
        found = [t for t in (f"parallel task {i}" for i in range(12))]
        ks = [await run_agent_calls(client, t, tools) for t in found]
        task = found[next(i for i, k in enumerate(ks) if k >= 2)]
        k = await run_agent_calls(client, task, tools)
        body = {
            "messages": [{"role": "user", "content": task}],
            "tools": tools,
            "fake_max_tool_calls": 3,
            "parallel_tool_calls": True,
        }
        message = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]
        assert message["finish_reason"] == "tool_calls"
        calls = message["message"]["tool_calls"]
        assert len(calls) == k and len({c["id"] for c in calls}) == k
        # Streamed, the calls come as indexed deltas: k heads, then k argument deltas.
        async with client.stream(
            "POST", "/v1/chat/completions", json={**body, "stream": True}
        ) as r:
            events = [json.loads(e) for e in (await read_events(r))[:-1]]
        deltas = [d for e in events for d in e["choices"][0]["delta"].get("tool_calls", [])]
        assert [d["index"] for d in deltas] == [*range(k), *range(k)]
        assert [d["id"] for d in deltas[:k]] == [c["id"] for c in calls]

        # [fake: text-tools]: the same calls written as text, finish_reason "stop".
        body["messages"] = [{"role": "user", "content": task + " [fake: text-tools]"}]
        body["parallel_tool_calls"] = False
        r = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]
        assert r["finish_reason"] == "stop", r
        text = r["message"]["content"]
        inner = json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>"))
        assert inner["name"] in ("lookup", "other") and isinstance(inner["arguments"], dict)

        # [fake: malformed-args]: arguments are {} although the schema requires fields.
        body["messages"] = [{"role": "user", "content": task + " [fake: malformed-args]"}]
        r = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]
        assert r["finish_reason"] == "tool_calls"
        assert r["message"]["tool_calls"][0]["function"]["arguments"] == "{}"

        # [fake: long]: a text reply of LONG_REPLY_TOKENS, past the usual 256 at most,
        # "length" only where max_tokens cut it.
        for max_tokens, finish in ((2 * LONG_REPLY_TOKENS, "stop"), (300, "length")):
            long = {"role": "user", "content": task + " [fake: long]"}
            body = {"messages": [long], "max_tokens": max_tokens}
            r = (await client.post("/v1/chat/completions", json=body)).json()
            tokens = min(max_tokens, LONG_REPLY_TOKENS)
            assert (r["choices"][0]["finish_reason"], r["usage"]["completion_tokens"]) == (
                finish,
                tokens,
            )
            assert len(r["choices"][0]["message"]["content"]) == 4 * tokens  # " " + 3 letters


async def run_agent_calls(client: httpx.AsyncClient, task: str, tools: list[Any]) -> int:
    """How many tool calls the run of `task` makes (one per turn)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": task}]
    for calls in range(10):
        body = {"messages": messages, "tools": tools, "fake_max_tool_calls": 3}
        choice = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]
        if choice["finish_reason"] != "tool_calls":
            return calls
        (call,) = choice["message"]["tool_calls"]
        messages += [
            choice["message"],
            {"role": "tool", "tool_call_id": call["id"], "content": "ok"},
        ]
    raise AssertionError("the run did not end")


async def test_unknown_fields_are_accepted() -> None:
    async with fake_engine(time_scale=100) as client:
        body = chat(max_tokens=5, ignore_eos=False, skip_special_tokens=True, rid="abc")
        body["sampling_params"] = {"temperature": 0}
        body["priority"] = 3
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize(("flavor", "first"), [("sglang", "p10"), ("vllm", "p0")])
async def test_priority_order_is_the_flavors(flavor: str, first: str) -> None:
    # With priority scheduling SGLang serves the higher value first, vLLM the lower.
    one = replace(EngineParams.reference(), max_running_requests=1, priority_scheduling=True)
    app = create_app(FakeEngineSettings(flavor=flavor, time_scale=20, engine=one))
    running, queued = RUNNING[flavor]
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=20) as client:
        app.state.clock.stop()
        done: list[str] = []

        async def send(tag: str, priority: int) -> None:
            body = chat(f"question {tag}", max_tokens=5, priority=priority)
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            done.append(tag)

        sent = [asyncio.create_task(send("blocker", 0))]
        await wait_metric(client, running, lambda v: v == 1)
        sent.append(asyncio.create_task(send("p0", 0)))
        await wait_metric(client, queued, lambda v: v == 1)
        sent.append(asyncio.create_task(send("p10", 10)))
        await wait_metric(client, queued, lambda v: v == 2)
        app.state.clock.go()
        await asyncio.gather(*sent)
        assert done == ["blocker", first, ({"p0", "p10"} - {first}).pop()]


@pytest.mark.parametrize("instant", [False, True])
async def test_bad_requests_are_4xx_with_a_message(instant: bool) -> None:
    async with fake_engine(time_scale=100, instant=instant) as client:
        cases: list[tuple[bytes, int, str]] = [
            (b"{not json", 400, "invalid JSON"),
            (b"[1, 2]", 400, "JSON object"),
            (json.dumps({"model": MODEL}).encode(), 400, "messages"),
            (json.dumps({"messages": []}).encode(), 400, "messages"),
            (json.dumps({"messages": [{"content": "hi"}]}).encode(), 400, "messages[0]"),
            (json.dumps(chat(max_tokens="many")).encode(), 400, "max_tokens"),
            (json.dumps(chat(max_tokens=0)).encode(), 400, "max_tokens"),
            (json.dumps(chat(max_completion_tokens=-1)).encode(), 400, "'max_completion_tokens'"),
            (json.dumps(chat(n=3)).encode(), 400, "'n': the fake engine makes one choice"),
            (json.dumps(chat(tools=[{"type": "function"}])).encode(), 400, "tools[0]"),
            (json.dumps(chat(top_logprobs=99, logprobs=True)).encode(), 400, "top_logprobs"),
            (b"\xff\xfe", 400, "invalid JSON"),
        ]
        for raw, status, needle in cases:
            r = await client.post(
                "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
            )
            assert r.status_code == status, (raw, r.text)
            assert needle in r.json()["error"]["message"], (raw, r.text)

        r = await client.post("/v1/chat/completions", json={**chat(), "model": "x"})
        assert r.status_code == 404
        assert r.json() == {"error": {"message": "model 'x' not found"}}
        r = await client.post("/classify", json={"model": "x", "input": "a"})
        assert r.status_code == 404
        r = await client.post("/classify", json={"input": 5})
        assert r.status_code == 400 and "input" in r.json()["error"]["message"]


@pytest.mark.parametrize("instant", [False, True])
async def test_a_body_not_sent_as_json_is_refused_as_vllm_and_sglang_refuse_it(
    instant: bool,
) -> None:
    # helper-250: the fake took any Content-Type, which hid a gateway that sent its JSON
    # as something else; vLLM and SGLang (validate_json_request) answer 400 for all but
    # application/json, its case and parameters aside.
    anthropic = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    routes = {
        "/v1/chat/completions": chat(),
        "/v1/responses": {"model": MODEL, "input": "hi"},
        "/v1/messages": anthropic,
    }
    async with fake_engine(time_scale=100, instant=instant) as client:
        for path, body in routes.items():
            raw = json.dumps(body).encode()
            for media in (None, "text/plain", "application/x-www-form-urlencoded", "json"):
                headers = {} if media is None else {"content-type": media}
                r = await client.post(path, content=raw, headers=headers)
                assert r.status_code == 400, (path, media, r.text)
                message = r.json()["error"]["message"]
                assert "Only 'application/json' is allowed" in message, (path, media, message)
            json_media = ("application/json", "Application/JSON", "application/json; charset=utf-8")
            for media in json_media:
                r = await client.post(path, content=raw, headers={"content-type": media})
                assert r.status_code == 200, (path, media, r.text)


async def test_small_kv_pool_caps_the_reply_or_rejects_the_prompt() -> None:
    params = replace(EngineParams.reference(), kv_pool_tokens=64)
    async with fake_engine(time_scale=100, engine=params) as client:
        # 16-token prompt block + at most 48 new tokens fit the pool.
        r = await client.post("/v1/chat/completions", json=chat("hi"))
        body = r.json()
        assert r.status_code == 200, r.text
        assert body["usage"]["completion_tokens"] == 48
        assert body["choices"][0]["finish_reason"] == "length"
        r = await client.post("/v1/chat/completions", json=chat("x" * 400))
        assert r.status_code == 400 and "KV pool" in r.json()["error"]["message"]


async def test_served_models() -> None:
    async with fake_engine(time_scale=100, models=("a", "b")) as client:
        listed = (await client.get("/v1/models")).json()
        assert listed["object"] == "list"
        assert [m["id"] for m in listed["data"]] == ["a", "b"]
        assert {m["owned_by"] for m in listed["data"]} == {"sglang"}  # as the engine says
        r = await client.post("/v1/chat/completions", json={**chat(max_tokens=2), "model": "b"})
        assert r.status_code == 200 and r.json()["model"] == "b"
        r = await client.post("/v1/chat/completions", json={**chat(), "model": MODEL})
        assert r.status_code == 404


# --------------------------------------------------------------------------- engine state

RUNNING = {
    "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs"),
    "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting"),
    "llamacpp": ("llamacpp:requests_processing", "llamacpp:requests_deferred"),
}


@pytest.mark.parametrize("flavor", FLAVORS)
async def test_metrics_follow_the_engine(flavor: str) -> None:
    running, queued = RUNNING[flavor]
    # 0.02 virtual s per wall s: a 40+ token reply takes > 20 wall seconds.
    async with fake_engine(flavor=flavor, time_scale=0.02) as client:
        text = (await client.get("/metrics")).text
        engine = ',engine="0"' if flavor == "vllm" else ""  # vLLM labels even its one engine
        for name in (running, queued):
            assert f"# HELP {name} " in text
            assert f"# TYPE {name} gauge" in text
            assert f'{name}{{model_name="{MODEL}"{engine}}} 0.0' in text
        if flavor == "vllm":  # its name since 0.10 (gpu_cache_usage_perc is gone)
            assert f'vllm:kv_cache_usage_perc{{model_name="{MODEL}",engine="0"}} 0.0' in text
        generation = asyncio.create_task(client.post("/v1/chat/completions", json=chat()))
        assert await wait_metric(client, running, lambda v: v > 0) == 1
        assert await metric(client, queued) == 0
        # A client that leaves a non-streamed request cancels it in the engine, too.
        generation.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await generation
        await wait_metric(client, running, lambda v: v == 0)


async def test_queue_shows_in_metrics() -> None:
    params = replace(EngineParams.reference(), max_running_requests=1)
    async with fake_engine(time_scale=0.02, engine=params, flavor="vllm") as client:
        gens = [
            asyncio.create_task(client.post("/v1/chat/completions", json=chat(f"q{i}")))
            for i in range(3)
        ]
        await wait_metric(client, "vllm:num_requests_waiting", lambda v: v == 2)
        assert await metric(client, "vllm:num_requests_running") == 1
        for g in gens:
            g.cancel()
        await asyncio.gather(*gens, return_exceptions=True)
        # Every request left: none runs and none waits.  (Not read one after the other:
        # between the running one's end and the next's admission, running reads 0 with
        # two still waiting; the engine admits one, and it leaves in its turn.)
        for _ in range(POLLS):
            running = await metric(client, "vllm:num_requests_running")
            waiting = await metric(client, "vllm:num_requests_waiting")
            if running == waiting == 0:
                break
            await asyncio.sleep(POLL_S)
        assert (running, waiting) == (0, 0)


async def test_load_reports_are_sglangs_current_shapes() -> None:
    # /get_load as SGLang's shim over /v1/loads answers it: a list, one entry per rank,
    # num_tokens the KV tokens in use and the waiting prompts' tokens (the SGLang
    # router's power_of_two sums num_tokens; a single object it reads as no load, -1).
    # /v1/loads (and /loads?model=, which SMG 1.13 polls) per rank as SGLang reports it.
    params = replace(EngineParams.reference(), max_running_requests=1)
    async with fake_engine(time_scale=0.02, engine=params, dp_size=2) as client:
        rank1 = {"X-Data-Parallel-Rank": "1"}
        gens = [
            asyncio.create_task(
                client.post("/v1/chat/completions", json=chat(f"q{i} " * 50), headers=rank1)
            )
            for i in range(3)
        ]
        for _ in range(POLLS):
            get_load = (await client.get("/get_load")).json()
            if get_load[1]["num_waiting_reqs"] == 2:
                break
            await asyncio.sleep(POLL_S)
        v1 = (await client.get("/v1/loads")).json()
        by_model = (await client.get("/loads", params={"model": MODEL})).json()
        for g in gens:
            g.cancel()
        await asyncio.gather(*gens, return_exceptions=True)

    keys = {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens", "num_pending_tokens"}
    assert [set(r) for r in get_load] == [keys | {"ts_tic"}] * 2
    idle, busy = get_load
    assert (idle["dp_rank"], idle["num_reqs"], idle["num_tokens"]) == (0, 0, 0)
    assert (busy["dp_rank"], busy["num_reqs"], busy["num_waiting_reqs"]) == (1, 3, 2)
    # Two prompts wait, of one length each (4 characters a token).
    prompt = -(-len(render_message(chat("q0 " * 50)["messages"][0])) // 4)
    assert busy["num_pending_tokens"] == 2 * prompt

    assert set(v1) >= {"timestamp", "version", "loads"}
    ranks = v1["loads"]
    assert [r["dp_rank"] for r in ranks] == [0, 1]
    assert (ranks[1]["num_running_reqs"], ranks[1]["num_waiting_reqs"]) == (1, 2)
    assert ranks[1]["max_total_num_tokens"] == 56_000 and ranks[1]["max_running_requests"] == 1
    used = ranks[1]["num_used_tokens"]
    assert used > 0 and ranks[1]["token_usage"] == pytest.approx(used / 56_000, abs=1e-4)
    assert ranks[1]["num_total_tokens"] - used == busy["num_pending_tokens"]
    assert ranks[1]["num_total_tokens"] == busy["num_tokens"]
    assert ranks[0]["num_used_tokens"] == ranks[0]["num_running_reqs"] == 0
    assert by_model["loads"] == ranks
    assert (by_model["load"], by_model["num_reqs"], by_model["num_waiting_reqs"]) == (3, 1, 2)


async def test_client_disconnect_mid_stream_stops_generation() -> None:
    # ~11 ms virtual per decode step at 0.02x: a 40+ token reply would take > 20 s of wall
    # time; the disconnect must free the engine well before that (polls last ~4 s).
    async with fake_engine(time_scale=0.02) as client:
        req = chat("a long story please", stream=True)
        async with client.stream("POST", "/v1/chat/completions", json=req) as r:
            lines = r.aiter_lines()
            seen = 0
            async for line in lines:
                if line.startswith("data: ") and '"content": "' in line and '"role"' not in line:
                    seen += 1
                    break
            assert seen == 1
            assert await metric(client, "sglang:num_running_reqs") == 1
        # Leaving the `stream` block closed the connection mid-stream.
        await wait_metric(client, "sglang:num_running_reqs", lambda v: v == 0)
        assert await metric(client, "sglang:num_queue_reqs") == 0


async def test_a_request_whose_waiting_handler_was_cancelled_does_not_stop_the_engine() -> None:
    # A client leaving a streamed tool-call turn cancels the future its handler waits
    # on; when the request ends in the engine before the handler's `finally` cancels it,
    # the driver must carry on (it died on setting the cancelled future's result, and
    # every later request hung).
    from testkit.engine import EngineRequest
    from testkit.fake_engine import _Driver

    def request(rid: str, block: int) -> EngineRequest:
        return EngineRequest(
            request_id=rid, prompt_blocks=(block,), prompt_tokens=10, output_tokens=4,
            max_new_tokens=4,
        )  # fmt: skip

    driver = _Driver(EngineParams.reference(), 1000.0)
    task = driver.start()
    try:
        left = driver.submit(request("left", 1))
        await left.first
        left.done.cancel()  # as the handler's cancellation does; it has not cancelled yet
        nxt = driver.submit(request("next", 2))
        finished = await asyncio.wait_for(asyncio.shield(nxt.done), 10)
        assert finished.request_id == "next" and driver.running and not task.done()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_an_engine_whose_driver_died_is_not_healthy() -> None:
    # A crash in the engine's loop (a bug, injected here) must show at /health, which
    # routers and luftpause probe, not only to the requests that then fail.
    app = create_app(FakeEngineSettings(time_scale=100))
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=20) as client:
        assert (await client.get("/health")).status_code == 200
        (driver,) = app.state.clock._drivers

        def broken(now: float) -> list[Any]:
            raise RuntimeError("injected")

        driver.engine.advance = broken  # type: ignore[method-assign]
        r = await client.post("/v1/chat/completions", json=chat())
        assert r.status_code == 503 and r.json()["error"]["message"] == "the engine is not running"
        r = await client.get("/health")
        assert r.status_code == 503 and "not running" in r.json()["error"]["message"]


# --------------------------------------------------------------------------- other endpoints


async def test_classify() -> None:
    async with fake_engine(time_scale=100, labels=("spam", "ham", "eggs")) as client:
        r = await client.post("/classify", json={"model": MODEL, "input": ["hello", "world"]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and body["model"] == MODEL
        assert body["id"] and body["created"] > 0
        assert [d["index"] for d in body["data"]] == [0, 1]
        for d in body["data"]:
            assert d["label"] in ("spam", "ham", "eggs")
            assert d["num_classes"] == 3 and len(d["probs"]) == 3
            assert abs(sum(d["probs"]) - 1) < 1e-9
            assert ("spam", "ham", "eggs")[d["probs"].index(max(d["probs"]))] == d["label"]
        assert body["usage"]["prompt_tokens"] > 0
        again = (await client.post("/classify", json={"input": "hello"})).json()
        assert again["data"][0]["label"] == body["data"][0]["label"]


async def test_probe_endpoints() -> None:
    params = replace(EngineParams.reference(), kv_pool_tokens=30_000, max_running_requests=7)
    async with fake_engine(time_scale=100, engine=params) as client:
        for path in (
            "/health",
            "/v1/models",
            "/server_info",
            "/get_server_info",
            "/model_info",
            "/get_model_info",
            "/get_load",
            "/version",
            f"/loads?model={MODEL}",
            "/v1/loads",
            "/metrics",
        ):
            r = await client.get(path)
            assert r.status_code == 200, path
        info = (await client.get("/server_info")).json()
        assert info["max_total_num_tokens"] == 30_000
        assert info["max_running_requests"] == 7
        assert info["model_path"] == MODEL
        assert (await client.get("/get_model_info")).json()["is_generation"] is True
        [rank] = (await client.get("/get_load")).json()  # one per data-parallel rank
        assert rank["dp_rank"] == rank["num_reqs"] == rank["num_tokens"] == 0
        assert (await client.get("/version")).json() == {"version": "fake-sglang"}
        assert (await client.get("/loads", params={"model": MODEL})).json()["load"] == 0


async def test_logprobs_with_labels() -> None:
    prompt = "Is this message urgent?\nThe server is on fire.\nLabels: urgent, routine, spam"
    async with fake_engine(time_scale=100) as client:
        req = chat(prompt, logprobs=True, top_logprobs=4, max_tokens=1)
        body = (await client.post("/v1/chat/completions", json=req)).json()
        choice = body["choices"][0]
        first = choice["logprobs"]["content"][0]
        tops = first["top_logprobs"]
        assert len(tops) == 4 and {t["token"] for t in tops} >= {"urgent", "routine", "spam"}
        # As many as asked, the likeliest first (the labels).
        fewer = chat(prompt, logprobs=True, top_logprobs=2, max_tokens=1)
        two = (await client.post("/v1/chat/completions", json=fewer)).json()
        assert two["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == tops[:2]
        best = max(tops, key=lambda t: t["logprob"])
        assert first["token"] == best["token"] and first["logprob"] == best["logprob"]
        assert choice["message"]["content"].startswith(first["token"])
        assert all(t["logprob"] <= 0 for t in tops)
        again = (await client.post("/v1/chat/completions", json=req)).json()
        assert again["choices"][0]["logprobs"] == choice["logprobs"]

        # Without labels: an entry per token, top_logprobs of the size asked for.
        req = chat("plain", logprobs=True, top_logprobs=3, max_tokens=4)
        content = (await client.post("/v1/chat/completions", json=req)).json()["choices"][0]
        entries = content["logprobs"]["content"]
        assert len(entries) == 4
        assert "".join(e["token"] for e in entries) == content["message"]["content"]
        assert all(len(e["top_logprobs"]) == 3 for e in entries)
        assert all(e["top_logprobs"][0]["token"] == e["token"] for e in entries)

        # Streamed: logprobs ride on the content chunks.
        req = chat(prompt, logprobs=True, top_logprobs=1, max_tokens=3, stream=True)
        async with client.stream("POST", "/v1/chat/completions", json=req) as r:
            events = [json.loads(e) for e in (await read_events(r))[:-1]]
        lps = [e["choices"][0]["logprobs"] for e in events[1:-1]]
        assert lps[0]["content"][0]["token"] == first["token"]


async def test_instant_mode() -> None:
    async with fake_engine(instant=True, flavor="llamacpp") as client:
        req = chat("instant please", max_tokens=12)
        a = (await client.post("/v1/chat/completions", json=req)).json()
        b = (await client.post("/v1/chat/completions", json=req)).json()
        assert a["id"] != b["id"]  # fresh ids although the body is cached
        assert a["choices"] == b["choices"]
        assert a["usage"]["completion_tokens"] == 12
        assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert len(a["choices"][0]["message"]["content"]) == 48

        req = chat("instant please", max_tokens=12, stream=True)
        req["stream_options"] = {"include_usage": True}
        for _ in range(2):
            async with client.stream("POST", "/v1/chat/completions", json=req) as r:
                events = await read_events(r)
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
            assert text == a["choices"][0]["message"]["content"]
            assert chunks[-1]["usage"]["completion_tokens"] == 12
            assert len({c["id"] for c in chunks}) == 1

        assert await run_agent(client, "task number 3") <= 3
        assert await metric(client, "llamacpp:requests_processing") == 0


# --------------------------------------------------------------------------- the CLI


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_cli_subprocess_serves_and_exits_cleanly_on_sigterm() -> None:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "luftpause", "fake-engine", "--flavor", "vllm"]
    cmd += ["--port", str(port), "--time-scale", "50", "--model", "m1", "--model", "m2"]
    cmd += ["--cache-report", "never"]  # vLLM's default: no --enable-prompt-tokens-details
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            for _ in range(1000):  # bounded: ~10 s for the interpreter to start
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                try:
                    if (await client.get("/health")).status_code == 200:
                        break
                except httpx.TransportError:
                    await asyncio.sleep(POLL_S)
            else:
                raise AssertionError("fake engine subprocess did not come up")
            r = await client.post(
                "/v1/chat/completions", json={**chat(max_tokens=8), "model": "m2"}
            )
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
            assert r.json()["usage"]["prompt_tokens_details"] is None
            assert "vllm:num_requests_running" in (await client.get("/metrics")).text
    finally:
        proc.terminate()
        try:
            code = proc.wait(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stderr:
                proc.stderr.close()
    assert code == 0
