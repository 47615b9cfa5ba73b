"""The OpenAI Responses door (`/v1/responses`, Codex's API) end to end over real loopback
HTTP: the official `openai` SDK in front of the gateway, fake engines behind it."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
from typing import Any

import openai
import pytest
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from harness import (
    CALLER,
    MODEL,
    RUN,
    endpoint,
    engine,
    gateway,
    models_only,
    tool_task,
    until,
)
from hypothesis import given
from hypothesis import strategies as st
from openai.types.responses import Response as OpenAIResponse

from gateway._proxy import ResponsesWatch
from gateway._shell import AdmissionShell
from gateway.app import _echoed_function_calls, _max_tokens
from scheduler import RunPhase
from testkit.loopback import serve

TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "lookup",
        "description": "Look something up.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}},
            "required": ["query"],
        },
    }
]
EXTRA = {"fake_max_tool_calls": 3}


def only_run(shell: AdmissionShell) -> Any:
    (run,) = shell.state.runs.values()
    return run


async def answer(
    codex: openai.AsyncOpenAI, items: list[Any], *, stream: bool
) -> tuple[OpenAIResponse, str | None]:
    """One turn as Codex makes it (store false, the whole input every time); the answer
    and, unstreamed, the run id it was given."""
    if stream:
        async with codex.responses.stream(
            model=MODEL, input=items, tools=TOOLS, store=False, extra_body=EXTRA
        ) as s:
            async for _ in s:
                pass
            return await s.get_final_response(), None
    raw = await codex.responses.with_raw_response.create(
        model=MODEL, input=items, tools=TOOLS, store=False, extra_body=EXTRA
    )
    return raw.parse(), raw.headers[RUN]


async def test_a_codex_tool_loop_is_one_run_with_its_usage_read() -> None:
    async with (
        engine(time_scale=50) as (url, recorder),
        gateway(endpoint("a", url)) as (gw, shell),
        openai.AsyncOpenAI(base_url=f"{gw.base_url}/v1", api_key="k", max_retries=0) as codex,
    ):
        items: list[Any] = [{"role": "user", "content": tool_task(2)}]
        answers, ids = [], set()
        for n in range(10):
            response, run_id = await answer(codex, items, stream=n % 2 == 1)
            answers.append(response)
            ids.add(run_id or only_run(shell).run_id)
            calls = [o for o in response.output if o.type == "function_call"]
            if not calls:
                assert only_run(shell).phase is RunPhase.IDLE
                break
            # The function calls reached the core: the run waits on them, not idle.
            assert only_run(shell).phase is RunPhase.PAUSED
            for call in calls:
                items.append(call.model_dump(include={"type", "call_id", "name", "arguments"}))
                items.append(
                    {"type": "function_call_output", "call_id": call.call_id, "output": "x"}
                )
        # Joined by the call ids its function_call_output items echo.
        assert len(answers) >= 3 and len(ids) == 1 and len(shell.state.runs) == 1
        assert {path for path, _, _ in recorder.posts} == {"/v1/responses"}
        text = (await gw.get("/metrics")).text
        usages = [r.usage for r in answers if r.usage is not None]
        assert len(usages) == len(answers)
        cached = sum(u.input_tokens_details.cached_tokens for u in usages)
        assert metric(text, "luftpause_prompt_tokens_total") == sum(u.input_tokens for u in usages)
        assert metric(text, "luftpause_cached_tokens_total") == cached > 0
        assert metric(text, "luftpause_completion_tokens_total") == sum(
            u.output_tokens for u in usages
        )


def metric(text: str, name: str) -> float:
    return sum(float(m) for m in re.findall(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M))


async def test_bad_input_and_a_model_lacking_the_api_are_refused_before_queueing() -> None:
    async with (
        engine(time_scale=50) as (url, recorder),
        serve(models_only()) as other,
        gateway(endpoint("engine", url), endpoint("hosted", other, kind="openai")) as (gw, shell),
    ):
        for body, status, message in (
            ({"model": MODEL}, 400, "'input' is required: a non-empty string or list"),
            ({"model": MODEL, "input": []}, 400, "'input' is required"),
            ({"input": "hi"}, 400, "'model' is required"),
            ({"model": MODEL, "input": "hi", "background": True}, 400, "'background': "),
            ({"model": MODEL, "input": "hi", "background": "yes"}, 400, "the foreground"),
            (
                {"model": MODEL, "input": "hi"},
                404,
                "do not take the OpenAI Responses API (hosted: responses = false",
            ),
        ):
            r = await gw.post("/v1/responses", json=body)
            assert r.status_code == status
            assert message in r.json()["error"]["message"]
            assert re.fullmatch("[0-9a-f]{32}", r.headers[RUN])
        assert recorder.posts == [] and not shell.state.turns
        # The same model over Chat Completions, which every replica serves.
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        assert (await gw.post("/v1/chat/completions", json=chat)).status_code == 200


def events(*payloads: dict[str, Any]) -> bytes:
    """SSE events; one without a type is a bare `data:` line (llama.cpp's errors)."""
    return "".join(
        (f"event: {p['type']}\n" if "type" in p else "") + f"data: {json.dumps(p)}\n\n"
        for p in payloads
    ).encode()


def final(status: str, output: list[Any], **more: Any) -> dict[str, Any]:
    usage = {"input_tokens": 50, "input_tokens_details": {"cached_tokens": 30}, "output_tokens": 7}
    return {"object": "response", "status": status, "output": output, "usage": usage, **more}


CALL = {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": "{}"}
TEXT = {"type": "message", "content": [{"type": "output_text", "text": "response.completed"}]}
# Codex's freeform apply_patch tool, and a reasoning item beside the answer.
PATCH = {"type": "custom_tool_call", "call_id": "call_2", "name": "apply_patch", "input": "*"}
THOUGHT = {"type": "reasoning", "id": "rs_1", "summary": []}
CUT = CALL | {"status": "incomplete", "call_id": "call_3"}


@pytest.mark.parametrize(
    ("end", "finish", "calls", "error"),
    [
        (
            {"type": "response.completed", "response": final("completed", [CALL])},
            "tool_calls",
            ["call_1"],
            None,
        ),
        ({"type": "response.completed", "response": final("completed", [TEXT])}, "stop", [], None),
        (
            {"type": "response.completed", "response": final("completed", [THOUGHT, TEXT, PATCH])},
            "tool_calls",
            ["call_2"],
            None,
        ),
        # Cut short while writing a call: no call the client will answer.
        (
            {"type": "response.incomplete", "response": final("incomplete", [CUT])},
            "length",
            [],
            None,
        ),
        # llama.cpp's error mid-stream: a bare error object.
        (
            {"error": {"code": 500, "message": "KV full", "type": "server_error"}},
            None,
            [],
            "KV full",
        ),
        (
            {"type": "response.incomplete", "response": final("incomplete", [TEXT])},
            "length",
            [],
            None,
        ),
        (
            {
                "type": "response.failed",
                "response": final("failed", [], error={"code": "x", "message": "KV full"}),
            },
            None,
            [],
            "KV full",
        ),
        ({"type": "error", "code": "server_error", "message": "KV full"}, None, [], "KV full"),
    ],
)
def test_the_watch_reads_the_final_response_of_a_stream_cut_anywhere(
    end: dict[str, Any], finish: str | None, calls: list[str], error: str | None
) -> None:
    created = {"type": "response.created", "response": final("in_progress", [])}
    created["response"]["usage"] = None
    delta = {"type": "response.output_text.delta", "delta": '"usage" response.completed'}
    stream = events(created, delta, end)
    for cut in range(0, len(stream), 11):
        watch = ResponsesWatch(sse=True)
        watch.feed(stream[:cut])
        watch.feed(stream[cut:])
        watch.close()
        assert (watch.finish_reason, watch.tool_call_ids, watch.error) == (finish, calls, error)
        if "response" in end:
            assert (watch.prompt_tokens, watch.cached_tokens, watch.completion_tokens) == (
                50,
                30,
                7,
            )
    # Calls only in `response.output_item.done`, a final response without output, and
    # usage named as Chat Completions names it (older SGLang).
    done = {"type": "response.output_item.done", "output_index": 0, "item": CALL}
    bare = final("completed", [])
    bare["usage"] = {"prompt_tokens": 40, "completion_tokens": 3}
    watch = ResponsesWatch(sse=True)
    watch.feed(events(done, {"type": "response.completed", "response": bare}))
    watch.close()
    assert (watch.finish_reason, watch.tool_call_ids) == ("tool_calls", ["call_1"])
    assert (watch.prompt_tokens, watch.completion_tokens) == (40, 3)
    whole = ResponsesWatch(sse=False)
    whole.feed(json.dumps(final("completed", [TEXT, CALL])).encode())
    whole.close()
    assert (whole.finish_reason, whole.tool_call_ids, whole.prompt_tokens) == (
        "tool_calls",
        ["call_1"],
        50,
    )


async def test_a_string_input_is_a_run_of_its_own_and_the_header_names_one() -> None:
    async with (
        engine(time_scale=50) as (url, _),
        gateway(endpoint("a", url)) as (gw, shell),
    ):
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 5}
        a = await gw.post("/v1/responses", json=body)
        b = await gw.post("/v1/responses", json=body, headers={RUN: "mine"})
        assert a.status_code == b.status_code == 200
        assert a.headers[RUN] != "mine" and b.headers[RUN] == "mine"
        assert a.json()["status"] == "incomplete"  # max_output_tokens reached the engine
        assert set(shell.state.runs) == {a.headers[RUN], "mine"}
        # ... and the core (sizing the reply's KV).
        assert _max_tokens({"max_output_tokens": 5}) == 5


def test_every_kind_of_call_result_joins_its_run() -> None:
    items = [
        {"type": "custom_tool_call", "call_id": "a"},  # the call itself echoes nothing
        {"type": "custom_tool_call_output", "call_id": "a", "output": "patched"},
        {"type": "function_call_output", "call_id": "b", "output": "found"},
        {"role": "user", "content": "and now?"},
    ]
    assert _echoed_function_calls(items) == ["a", "b"]


def failing_stream(request: Request) -> StreamingResponse:
    async def events() -> Any:
        created = {"type": "response.created", "response": final("in_progress", [])}
        yield f"event: response.created\ndata: {json.dumps(created)}\n\n"
        yield f"data: {json.dumps({'error': {'message': 'KV full', 'code': 500}})}\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def test_an_error_in_a_200_stream_fails_the_turn_as_the_engines_fault() -> None:
    app = models_only()
    app.post("/v1/responses")(failing_stream)
    async with (
        serve(app) as url,
        gateway(endpoint("a", url, kind="openai", responses=True)) as (gw, shell),
    ):
        body = {"model": MODEL, "input": "hi", "stream": True}
        r = await gw.post("/v1/responses", json=body)
        assert r.status_code == 200 and "KV full" in r.text  # passed through unchanged
        assert 'luftpause_turns_total{outcome="failed"} 1.0' in (await gw.get("/metrics")).text
        assert shell.state.replicas["a"].failures == 1
        assert not shell.state.turns


def _stream_of(*events: dict[str, Any]) -> Any:
    """A /v1/responses engine that streams these events, each with its `event:` line."""

    def answer(request: Request) -> StreamingResponse:
        async def lines() -> Any:
            for e in events:
                yield f"event: {e['type']}\ndata: {json.dumps(e)}\n\n"

        return StreamingResponse(lines(), media_type="text/event-stream")

    return answer


_CREATED = {"type": "response.created", "response": {"status": "in_progress"}}
_CALL = {
    "type": "response.output_item.done",
    "item": {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
}


@pytest.mark.parametrize(
    ("error", "outcome", "engines"),
    [
        ({"code": "context_length_exceeded", "message": "too long"}, "error_status", False),
        ({"code": "server_error", "message": "boom"}, "failed", True),
    ],
    ids=["context too long", "server error"],
)
async def test_a_json_response_that_failed_is_no_finished_turn(
    error: dict[str, Any], outcome: str, engines: bool
) -> None:
    # A 200 whose body is a failed response counted by its status, finished (as the
    # stream's response.failed does not).
    app = models_only()

    @app.post("/v1/responses")
    async def failed(request: Request) -> JSONResponse:
        body = {"id": "resp_1", "object": "response", "status": "failed", "error": error}
        return JSONResponse(body | {"output": []})

    async with (
        serve(app) as url,
        gateway(endpoint("a", url, kind="openai", responses=True)) as (gw, shell),
    ):
        r = await gw.post("/v1/responses", json={"model": MODEL, "input": "hi"})
        assert r.status_code == 200 and r.json()["status"] == "failed"  # as sent
        await until(lambda: not shell.state.turns, "the turn ended")
        metrics = (await gw.get("/metrics")).text
        assert f'luftpause_turns_total{{outcome="{outcome}"}} 1.0' in metrics
        assert shell.state.replicas["a"].failures == (1 if engines else 0)


@pytest.mark.parametrize(
    ("events", "outcome", "engines"),
    [
        (  # helper-140: a request's error, in OpenAI's words, ejected the replica
            [
                _CREATED,
                {
                    "type": "response.failed",
                    "response": {
                        "status": "failed",
                        "error": {"code": "context_length_exceeded", "message": "too long"},
                    },
                },
            ],
            "error_status",
            False,
        ),
        (  # a rate limit, flat
            [_CREATED, {"type": "error", "code": "rate_limit_exceeded", "message": "slow down"}],
            "error_status",
            False,
        ),
        (  # the engine's own
            [_CREATED, {"type": "error", "code": "server_error", "message": "boom"}],
            "failed",
            True,
        ),
        (  # closed before its end: every Responses client takes it for a failure
            [_CREATED, _CALL],
            "failed",
            True,
        ),
        (  # its end with no status (some adapters leave it out): ended, finished
            [_CREATED, {"type": "response.completed", "response": {"output": []}}],
            "finished",
            False,
        ),
    ],
    ids=["context too long", "rate limited", "server error", "no final event", "no status"],
)
async def test_how_a_responses_stream_ends_says_whose_fault_it_is(
    events: list[dict[str, Any]], outcome: str, engines: bool
) -> None:
    app = models_only()
    app.post("/v1/responses")(_stream_of(*events))
    async with (
        serve(app) as url,
        gateway(endpoint("a", url, kind="openai", responses=True)) as (gw, shell),
    ):
        r = await gw.post("/v1/responses", json={"model": MODEL, "input": "hi", "stream": True})
        assert r.status_code == 200
        await until(lambda: not shell.state.turns, "the turn ended")
        metrics = (await gw.get("/metrics")).text
        assert f'luftpause_turns_total{{outcome="{outcome}"}} 1.0' in metrics
        assert shell.state.replicas["a"].failures == (1 if engines else 0)


def test_a_responses_streams_first_events_are_no_sign_of_generation() -> None:
    # helper-140: vLLM sends response.created and .in_progress before it schedules the
    # request: taken for data, a turn in its queue looked started (and a stall then
    # counted against the engine wherever it was sent).
    from gateway._proxy import _carries

    created = b'event: response.created\ndata: {"type": "response.created"}\n\n'
    progress = b'event: response.in_progress\ndata: {"type": "response.in_progress"}\n\n'
    delta = b'event: response.output_text.delta\ndata: {"delta": "x"}\n\n'
    assert not _carries(created) and not _carries(created + progress)
    assert not _carries(b'event: response.created\ndata: {"type": "resp')  # cut: the rest next
    assert _carries(created + delta)
    # helper-139: a piece that goes on a line is data, even from a JSON colon.
    assert _carries(b': [{"delta": {"content": "x"}}]}\n\n', True, False)
    assert not _carries(b': [{"delta": {"content": "x"}}]}\n\n', True, True)  # a comment
    assert not _carries(b"\n: ping\n\n", True, False)  # the line before ended here
    assert not _carries(b"  \n ", False) and _carries(b": 1}", False)  # a JSON body


@pytest.mark.parametrize("stream", [False, True])
async def test_a_chain_by_previous_response_id_is_one_run(stream: bool) -> None:
    # helper-140: a Responses client that lets the engine keep the conversation names
    # the last answer's id; its next turn was a new run, placed anywhere, and an engine
    # without the answer refused the chain.
    made = iter(range(1, 100))

    def storing(request: Request) -> Any:  # an engine that keeps responses (vLLM's store)
        done = {"id": f"resp_{next(made)}", "object": "response", "status": "completed"}
        done |= {"output": [], "usage": {"input_tokens": 5, "output_tokens": 1}}
        if not stream:
            return JSONResponse(done)
        return _stream_of(
            {"type": "response.created", "response": {**done, "status": "in_progress"}},
            {"type": "response.completed", "response": done},
        )(request)

    app = models_only()
    app.post("/v1/responses")(storing)
    async with (
        serve(app) as url,
        gateway(endpoint("a", url, kind="openai", responses=True)) as (gw, _),
    ):
        ask = {"model": MODEL, "input": "hi", "stream": stream}
        first = await gw.post("/v1/responses", json=ask)
        assert first.status_code == 200 and "resp_1" in first.text
        run = first.headers[RUN]
        chained = {**ask, "input": "and then?", "previous_response_id": "resp_1"}
        second = await gw.post("/v1/responses", json=chained)
        assert second.status_code == 200 and second.headers[RUN] == run
        metrics = (await gw.get("/metrics")).text
        assert 'luftpause_turn_runs_total{by="previous_response"} 1.0' in metrics
        # Another caller naming the id is no turn of that run (ids are a caller's).
        other = await gw.post("/v1/responses", json=chained, headers={CALLER: "someone-else"})
        assert other.status_code == 200 and other.headers[RUN] != run
        # An id never given, or not a string, names no run.
        for previous in ("resp_unknown", 7):
            r = await gw.post("/v1/responses", json={**ask, "previous_response_id": previous})
            assert r.headers[RUN] != run


async def test_a_chain_to_a_run_ended_mid_turn_starts_a_run_of_its_own() -> None:
    # helper-141: DELETE /v1/runs/{id} while a turn was in flight; the turn's end then
    # remembered its answer's id (and call ids) for the ended run, and a chain naming
    # it brought the ended run back.
    go = asyncio.Event()

    async def slow(request: Request) -> Any:
        await go.wait()  # until the run is ended
        done = {"id": "resp_late", "object": "response", "status": "completed", "output": []}
        return JSONResponse(done)

    app = models_only()
    app.post("/v1/responses")(slow)
    async with (
        serve(app) as url,
        gateway(endpoint("a", url, kind="openai", responses=True)) as (gw, shell),
    ):
        ask = {"model": MODEL, "input": "hi"}
        first = asyncio.create_task(gw.post("/v1/responses", json=ask, headers={RUN: "job-1"}))
        await until(lambda: "job-1" in shell.state.runs, "the turn is in flight")
        assert (await gw.delete("/v1/runs/job-1")).status_code == 204
        go.set()
        assert (await first).status_code == 200
        chained = await gw.post("/v1/responses", json={**ask, "previous_response_id": "resp_late"})
        assert chained.status_code == 200 and chained.headers[RUN] != "job-1"


_EVENTS = st.sampled_from(
    [
        b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n',
        b"data: [DONE]\n\n",
        b": ping\n\n",
        b":\n\n",
        b'event: ping\ndata: {"type": "ping"}\n\n',
        b'event: content_block_delta\ndata: {"delta": {"text": "x"}}\n\n',
        b'event: response.created\ndata: {"type": "response.created"}\n\n',
        b'event: response.output_text.delta\ndata: {"delta": "x"}\n\n',
        b'data: {"a": 1}\r\n\r\n',
        b": keep-alive\r\r",
        b"\n",
    ]
)


@given(
    events=st.lists(_EVENTS, min_size=1, max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=8),
)
def test_the_fast_reading_of_whole_data_events_agrees_with_the_whole_reading(
    events: list[bytes], cuts: list[int]
) -> None:
    # _Progress.carries takes a piece of whole events that begins with a data line as
    # data without reading it (each token's piece: 3 us less); the full reading of
    # every piece, in any split, must say the same.
    from gateway._proxy import _Progress

    stream = b"".join(events)
    edges = sorted({0, len(stream), *(c % (len(stream) + 1) for c in cuts)})
    pieces = [stream[a:b] for a, b in itertools.pairwise(edges) if b > a]
    fast, full = _Progress(True), _Progress(True)
    assert [fast.carries(p) for p in pieces] == [full._read(p) for p in pieces]
