"""The LLM turn activity against tiny upstreams over loopback, in Temporal's
ActivityEnvironment: what it sends, and how each failure is raised for the retry policy."""

from __future__ import annotations

import dataclasses
import json
import socket
from datetime import timedelta
from typing import Any

import httpx
import pytest
from fastapi import Request
from fastapi.responses import Response
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities import LlmActivities, TurnInput
from activities._arguments import ArgumentsError, depth, expected_shape, prepare_arguments
from activities._recover import recover_tool_calls
from activities.llm import ENGINE_FAULT_ATTEMPTS
from testkit.loopback import serve
from tests.gateway.harness import closed_port_url, upstream
from worker.main import gateway_client
from workflows.agent_run import RETRY

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


def turn(**kw: Any) -> TurnInput:
    base: dict[str, Any] = {
        "run_id": "run-1",
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "service_class": "batch",
        "caller": "carol",
    }
    return TurnInput(**{**base, **kw})


async def call(
    app: Any, t: TurnInput, token: str | None = None, env: ActivityEnvironment | None = None
) -> Any:
    async with serve(app) as url, httpx.AsyncClient() as http:
        llm = LlmActivities(http, base_url=url, token=token, heartbeat_every_s=0.05)
        return await (env or ActivityEnvironment()).run(llm.llm_turn, t)


def late_attempt(faults: int) -> tuple[ActivityEnvironment, list[tuple[Any, ...]]]:
    """The 500th attempt of a turn that failed `faults` times before (the count its last
    heartbeat carried), under the workflow's retry policy; and the heartbeats it sends."""
    env = ActivityEnvironment()
    env.info = dataclasses.replace(
        env.info, attempt=500, retry_policy=RETRY, heartbeat_details=[faults]
    )
    beats: list[tuple[Any, ...]] = []
    env.on_heartbeat = lambda *details: beats.append(details)
    return env, beats


def completion(message: dict[str, Any], finish: str = "stop") -> Response:
    body = {
        "choices": [{"message": message, "finish_reason": finish}],
        "usage": {
            "prompt_tokens": 7,
            "completion_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": 4},
        },
    }
    return Response(json.dumps(body), media_type="application/json")


async def test_the_turn_is_sent_as_the_runs_turn() -> None:
    seen: list[dict[str, str]] = []
    bodies: list[Any] = []

    def chat(request: Request) -> Response:
        return completion({"role": "assistant", "content": "hello"})

    app = upstream(chat, seen)

    @app.middleware("http")
    async def record(request: Request, call_next: Any) -> Any:
        bodies.append(await request.body())
        return await call_next(request)

    out = await call(app, turn(max_tokens=0, tools=TOOLS, parallel_tool_calls=True), token="tok")
    assert (out.message, out.finish_reason) == ({"role": "assistant", "content": "hello"}, "stop")
    assert (out.prompt_tokens, out.completion_tokens, out.cached_tokens) == (7, 3, 4)
    (headers,) = seen
    assert headers["x-luftpause-run-id"] == "run-1"
    assert headers["x-luftpause-class"] == "batch"
    assert headers["x-luftpause-caller"] == "carol"
    assert headers["authorization"] == "Bearer tok"
    body = json.loads(bodies[0])
    assert "max_tokens" not in body  # 0 = the engine decides
    assert body["tools"] == TOOLS and body["parallel_tool_calls"] is True


async def test_a_lone_surrogate_is_sent_escaped_not_retried_for_ever() -> None:
    # A task given from Python, or an engine's reply that escaped one, can hold a lone
    # surrogate, which UTF-8 cannot carry: the body goes as ASCII JSON escapes (it
    # raised UnicodeEncodeError, retried for ever).  Other text goes as UTF-8.
    bodies: list[bytes] = []

    def chat(request: Request) -> Response:
        return completion({"role": "assistant", "content": "ok"})

    app = upstream(chat, [])

    @app.middleware("http")
    async def record(request: Request, call_next: Any) -> Any:
        bodies.append(await request.body())
        assert request.headers["content-type"] == "application/json"
        return await call_next(request)

    odd = turn(messages=[{"role": "user", "content": "summarise \ud83d this é"}])
    out = await call(app, odd)
    assert out.message["content"] == "ok"
    assert b"\\ud83d" in bodies[0] and b"\\u00e9" in bodies[0]
    assert json.loads(bodies[0])["messages"][0]["content"] == "summarise \ud83d this é"
    await call(app, turn(messages=[{"role": "user", "content": "café"}]))
    assert "café".encode() in bodies[1]


async def test_retry_after_becomes_the_next_retry_delay() -> None:
    app = upstream(
        lambda r: Response(
            json.dumps({"error": {"message": "slow down"}}),
            status_code=429,
            headers={"retry-after": "7"},
        )
    )
    with pytest.raises(ApplicationError) as err:
        await call(app, turn())
    assert err.value.next_retry_delay == timedelta(seconds=7)
    assert not err.value.non_retryable
    assert "429: slow down" in str(err.value)


async def test_retry_after_is_a_floor_under_the_backoff_not_a_replacement() -> None:
    # The gateway's own 429 (a caller over max_held_per_caller) always says 1 s; the
    # fourth attempt still waits as the policy's backoff says (1 s doubling, 10 s most).
    app = upstream(
        lambda r: Response(json.dumps({"error": {"message": "held"}}), 429, {"retry-after": "1"})
    )
    delays = []
    # From about the 48th attempt the backoff overflowed a timedelta (helper-114: an
    # OverflowError took the place of the turn's error); unbounded, it stops at an hour.
    unbounded = dataclasses.replace(RETRY, maximum_interval=None)
    for attempt, policy in ((1, RETRY), (4, RETRY), (9, RETRY), (60, RETRY), (500, RETRY),
                            (500, unbounded)):  # fmt: skip
        env = ActivityEnvironment()
        env.info = dataclasses.replace(env.info, attempt=attempt, retry_policy=policy)
        with pytest.raises(ApplicationError) as err:
            await call(app, turn(), env=env)
        delays.append(err.value.next_retry_delay)
    assert delays == [timedelta(seconds=s) for s in (1, 8, 10, 10, 10, 3600)]


@pytest.mark.parametrize("status", [400, 404, 422])
async def test_a_request_the_gateway_refuses_is_not_retried(status: int) -> None:
    app = upstream(lambda r: Response(json.dumps({"error": {"message": "no"}}), status_code=status))
    with pytest.raises(ApplicationError) as err:
        await call(app, turn())
    assert err.value.non_retryable and f"{status}: no" in str(err.value)


@pytest.mark.parametrize("deep", [False, True], ids=["message", "nested-too-deep"])
@pytest.mark.parametrize(
    ("status", "before", "retried"),
    [
        (502, ENGINE_FAULT_ATTEMPTS - 2, True),
        (502, ENGINE_FAULT_ATTEMPTS - 1, False),  # the engine fails this turn every time
        (500, ENGINE_FAULT_ATTEMPTS + 5, False),
        (503, ENGINE_FAULT_ATTEMPTS * 10, True),  # no healthy replica yet: wait on
        (429, ENGINE_FAULT_ATTEMPTS * 10, True),
    ],
)
async def test_engine_failures_are_retried_a_bounded_number_of_times(
    status: int, before: int, retried: bool, deep: bool
) -> None:
    # (deep: an error body nested past the JSON decoder's limit raised RecursionError
    # while its message was read, and the failure went uncounted: helper-180's kind.)
    body = "[" * 5000 + "]" * 5000 if deep else json.dumps({"error": {"message": "x"}})
    app = upstream(lambda r: Response(body, status))
    # attempt 500: the attempts spent waiting (503s, an unreachable gateway) do not count
    env, beats = late_attempt(before)
    with pytest.raises(ApplicationError) as err:
        await call(app, turn(), env=env)
    assert err.value.non_retryable is not retried
    assert ("given up" in str(err.value)) is not retried
    # The count goes on to the next attempt in the last heartbeat's details.
    counted = before + 1 if status >= 500 and status != 503 else before
    assert beats[-1] == (counted,)


@pytest.mark.parametrize(
    "body",
    [
        {"choices": []},
        {"error": {"message": "overloaded"}},  # an error object sent with a 200
        {"choices": [{"message": {"role": "assistant", "tool_calls": [{"function": {}}]}}]},
        # JSON nested past the decoder's recursion limit: a RecursionError, retried
        # uncounted for ever (helper-180).
        '{"choices": [{"message": {"content": ' + "[" * 5000 + "]" * 5000 + "}}]}",
        # Read, but past what Temporal's converter carries (helper-182).
        '{"choices": [{"message": {"content": ' + "[" * 600 + "]" * 600 + "}}]}",
        # Carried by the activity, not by the run's next turn (helper-183).
        '{"choices": [{"message": {"content": ' + "[" * 100 + "]" * 100 + "}}]}",
    ],
    ids=[
        "no-choices",
        "error-object",
        "tool-call-without-a-name",
        "nested-too-deep",
        "nested-too-deep-to-carry",
        "nested-past-the-bound",
    ],
)
@pytest.mark.parametrize("before", [ENGINE_FAULT_ATTEMPTS - 2, ENGINE_FAULT_ATTEMPTS - 1])
async def test_a_200_without_a_usable_completion_counts_as_an_engine_failure(
    body: dict[str, Any] | str, before: int
) -> None:
    # The turn's retry policy has no attempt limit: uncounted, an engine (or a router)
    # that answers this turn so every time kept the run Running for ever.
    text = body if isinstance(body, str) else json.dumps(body)
    app = upstream(lambda r: Response(text, media_type="application/json"))
    env, beats = late_attempt(before)
    with pytest.raises(ApplicationError) as err:
        await call(app, turn(tools=TOOLS), env=env)
    assert err.value.type == "BadCompletion" and "gateway answered 200 with" in str(err.value)
    assert beats[-1] == (before + 1,)
    spent = before + 1 == ENGINE_FAULT_ATTEMPTS
    assert err.value.non_retryable is spent
    assert ("given up" in str(err.value)) is spent


@pytest.mark.parametrize(
    "usage",
    ["n/a", {"prompt_tokens": "12.0", "prompt_tokens_details": "x"}, {"prompt_tokens": True}],
)
async def test_usage_that_does_not_read_counts_nothing_and_the_answer_stands(usage: Any) -> None:
    # helper-160: it raised outside the completion's checks, neither counted nor given
    # up: the turn was sent to the engine again every few seconds for ever.
    body = {"choices": [{"message": {"role": "assistant", "content": "hi"}}], "usage": usage}
    out = await call(
        upstream(lambda r: Response(json.dumps(body), media_type="application/json")), turn()
    )
    assert out.message["content"] == "hi"
    assert (out.prompt_tokens, out.completion_tokens, out.cached_tokens) == (0, 0, 0)


async def test_usage_counts_read_as_before_where_they_read() -> None:
    # (helper-161: digits as text and fractions read as int() read them before.)
    usage = {"prompt_tokens": " 12 ", "completion_tokens": 7.9, "prompt_tokens_details": {}}
    body = {"choices": [{"message": {"role": "assistant", "content": "hi"}}], "usage": usage}
    out = await call(
        upstream(lambda r: Response(json.dumps(body), media_type="application/json")), turn()
    )
    assert (out.prompt_tokens, out.completion_tokens, out.cached_tokens) == (12, 7, 0)


async def test_arguments_sent_as_an_object_are_read_as_their_json() -> None:
    # Some llama-server and TGI builds send `arguments` as an object: its Python repr
    # was carried, refused by every schema check and sent back to the engine.
    written = {"query": "weather in Köln"}
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": written}}
        ],
    }
    out = await call(upstream(lambda r: completion(message, "tool_calls")), turn(tools=TOOLS))
    (c,) = out.tool_calls
    assert json.loads(c.arguments) == written and "Köln" in c.arguments
    assert out.message["tool_calls"][0]["function"]["arguments"] == c.arguments


async def test_the_workers_client_waits_without_a_read_timeout_on_kept_alive_sockets() -> None:
    app = upstream(lambda r: Response("{}", media_type="application/json"))
    async with serve(app) as url, gateway_client() as http:
        assert http.timeout.read is None  # a turn is held as long as it takes
        async with http.stream("GET", url) as r:
            sock = r.extensions["network_stream"].get_extra_info("socket")
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            if hasattr(socket, "TCP_KEEPIDLE"):
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 30
            if hasattr(socket, "TCP_USER_TIMEOUT"):  # sent data unanswered (helper-183)
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 60_000


async def test_an_unreachable_gateway_is_retried() -> None:
    async with httpx.AsyncClient() as http:
        llm = LlmActivities(http, base_url=closed_port_url(), heartbeat_every_s=0.05)
        with pytest.raises(ApplicationError) as err:
            await ActivityEnvironment().run(llm.llm_turn, turn())
    assert not err.value.non_retryable and err.value.type == "GatewayUnreachable"


async def test_calls_written_as_text_are_recovered_only_for_offered_tools() -> None:
    text = '<tool_call>{"name": "lookup", "arguments": {"query": "x"}}</tool_call>'
    app = upstream(lambda r: completion({"role": "assistant", "content": text}))
    out = await call(app, turn(tools=TOOLS))
    assert out.recovered and out.finish_reason == "tool_calls"
    (c,) = out.tool_calls
    assert (c.name, json.loads(c.arguments)) == ("lookup", {"query": "x"})
    assert out.message["content"] is None and out.message["tool_calls"][0]["id"] == c.id
    # Not offered: an answer that happens to quote JSON stays an answer.
    out = await call(app, turn(tools=[]))
    assert not out.recovered and out.tool_calls == [] and out.message["content"] == text


async def test_call_ids_are_unique_in_the_run_whatever_the_engine_sends() -> None:
    # Ids key approvals and the tool servers' idempotency: an engine that sends none,
    # or "call_0" again every turn, must not make a later call reuse an earlier answer.
    def call_(name: str, call_id: str | None) -> dict[str, Any]:
        c: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": "{}"}}
        return c if call_id is None else {**c, "id": call_id}

    calls = [call_("lookup", None), call_("lookup", "call_0"), call_("lookup", "fresh")]
    app = upstream(
        lambda r: completion({"role": "assistant", "tool_calls": calls}, finish="tool_calls")
    )
    earlier = {
        "role": "assistant",
        "tool_calls": [call_("lookup", "call_0"), call_("lookup", "call_3_0")],
    }
    history = [
        {"role": "user", "content": "hi"},
        earlier,
        {"role": "tool", "tool_call_id": "call_0", "content": "x"},
    ]
    out = await call(app, turn(tools=TOOLS, messages=history))
    ids = [c.id for c in out.tool_calls]
    assert ids == ["call_3_0_1", "call_0_3_1", "fresh"]  # call_3_0 was taken already
    assert [c["id"] for c in out.message["tool_calls"]] == ids


def test_arguments_are_coerced_then_validated() -> None:
    schema = {
        "type": "object",
        "properties": {
            "query": {"type": "string"},
            "limit": {"type": "integer"},
            "exact": {"type": "boolean"},
        },
        "required": ["query"],
    }
    args = prepare_arguments("lookup", '{"query": 5, "limit": "3", "exact": "true"}', schema)
    assert args == {"query": "5", "limit": 3, "exact": True}
    assert expected_shape(schema) == '{"query": string, "limit"?: integer, "exact"?: boolean}'
    for raw, needle in [
        ("{}", "'query' is a required property"),
        ('{"query": "x", "limit": "many"}', "at 'limit'"),
        ("[1]", "must be a JSON object"),
        ("{nope", "not valid JSON"),
    ]:
        with pytest.raises(ArgumentsError, match=r"\{\"query\": string") as err:
            prepare_arguments("lookup", raw, schema)
        assert needle in str(err.value)
    # Valid JSON text, half a character: no UTF-8 carries it to the server (helper-114:
    # taken for an unreachable server and resent for 15 minutes).  The model is told.
    for raw in ('{"query": "B \\ud83d"}', '{"\\udc00": "x", "query": "y"}'):
        with pytest.raises(ArgumentsError, match="a lone UTF-16 surrogate") as err:
            prepare_arguments("lookup", raw, schema)
        assert "write the character whole" in str(err.value)
    assert prepare_arguments("lookup", '{"query": "\\ud83d\\ude00"}', schema) == {"query": "😀"}


def test_arguments_json_cannot_carry_are_refused_and_odd_schemas_do_not_crash() -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "x": {"type": "number"}, "any": True},
    }
    # Boolean sub-schemas (`true`: anything) are valid JSON Schema: nothing to coerce.
    assert prepare_arguments("t", '{"any": "5", "n": " 42 ", "x": "-2.5e3"}', schema) == {
        "any": "5",
        "n": 42,
        "x": -2500.0,
    }
    # Python reads these as numbers; JSON cannot send them on, so they stay strings and
    # the schema refuses them, naming the shape.
    huge = "9" * 5_000  # past what Python's int() reads (helper-160: a bare ValueError)
    for raw in ('{"n": "1_000"}', '{"x": "nan"}', '{"x": "inf"}', '{"x": "1e999"}'):
        with pytest.raises(ArgumentsError, match="do not fit its input schema"):
            prepare_arguments("t", raw, schema)
    with pytest.raises(ArgumentsError, match="do not fit its input schema"):
        prepare_arguments("t", f'{{"n": "{huge}"}}', schema)
    for raw, needle in (
        ('{"x": NaN}', "NaN is not a JSON value"),
        ('{"x": 1e400}', "1e400 is too large for a number"),
        ("[" * 100_000, "nested"),
        (f'{{"n": {huge}}}', r"could not be read \(Exceeds the limit \(4300 digits\)"),
        # Read, but past what Temporal carries (about 450 levels; helper-182).
        ('{"any": ' + "[" * 500 + "]" * 500 + "}", "nested too deeply \\(past 64 levels\\)"),
    ):
        with pytest.raises(ArgumentsError, match=needle):
            prepare_arguments("t", raw, schema)
    inner = "[" * 63 + "]" * 63  # 64 levels with the object: taken
    assert depth(prepare_arguments("t", '{"any": ' + inner + "}", schema)) == 64


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"name": "lookup", "arguments": {"query": "a;b"}}', [("lookup", "a;b")]),
        (
            '{"name": "lookup", "arguments": {"query": "a"}}\n'
            '{"name": "lookup", "arguments": {"query": "b"}}',
            [("lookup", "a"), ("lookup", "b")],
        ),
        (
            '{"name": "lookup", "arguments": {"query": "a"}}; '
            '{"name": "lookup", "arguments": {"query": "b"}}',
            [("lookup", "a"), ("lookup", "b")],
        ),
        (
            '[{"name": "lookup", "arguments": {"query": "a"}}, '
            '{"type": "function", "function": {"name": "lookup", "parameters": {"query": "b"}}}]',
            [("lookup", "a"), ("lookup", "b")],
        ),
        (
            'Let me look. <tool_call>{"name": "lookup", "arguments": {"query": "a"}}',
            [("lookup", "a")],
        ),
        (
            '<tool_call>\n  {"name": "lookup", "arguments": {"query": "a"}}\n</tool_call>',
            [("lookup", "a")],
        ),
        (
            '<|python_tag|>{"name": "lookup", "parameters": {"query": "a"}}<|eom_id|>',
            [("lookup", "a")],
        ),
        ('```json\n{"name": "lookup", "arguments": {"query": "a"}}\n```', [("lookup", "a")]),
        # Mistral, before and after its v11 tokenizer (helper-114: neither was read).
        ('[TOOL_CALLS][{"name": "lookup", "arguments": {"query": "a"}}]', [("lookup", "a")]),
        (
            '[TOOL_CALLS]lookup[ARGS]{"query": "a"}[TOOL_CALLS]lookup[ARGS]{"query": "b"}',
            [("lookup", "a"), ("lookup", "b")],
        ),
        ('[TOOL_CALLS]lookup[ARGS]{"query": "a"} and more', []),
        ('[TOOL_CALLS]rm[ARGS]{"query": "a"}', []),
        # A reasoning model's thoughts first (helper-114: the call after them was lost).
        (
            '<think>I need a fact. {"name": "x"}</think>\n\n'
            '{"name": "lookup", "arguments": {"query": "a"}}',
            [("lookup", "a")],
        ),
        (
            '<think>hmm</think><tool_call>{"name": "lookup", "arguments": {"query": "a"}}'
            "</tool_call>",
            [("lookup", "a")],
        ),
        ('<think>about to write {"name": "lookup", "arguments": {"query": "a"}}', []),
        # helper-120: the marker inside a call's arguments is text, and prose before a
        # marker is an answer that quotes one; a template that opened <think> in the
        # prompt leaves only its close; Mistral's v13 writes a call id.
        (
            '<tool_call>{"name": "lookup", "arguments": {"query": "[TOOL_CALLS]"}}</tool_call>',
            [("lookup", "[TOOL_CALLS]")],
        ),
        (
            '{"name": "lookup", "arguments": {"query": "a [TOOL_CALLS] b"}}',
            [("lookup", "a [TOOL_CALLS] b")],
        ),
        ('[TOOL_CALLS]lookup[ARGS]{"query": "a [TOOL_CALLS] b"}', [("lookup", "a [TOOL_CALLS] b")]),
        # The words before Mistral's marker are its own, as before <tool_call> (helper-121).
        (
            'Let me look.[TOOL_CALLS][{"name": "lookup", "arguments": {"query": "a"}}]',
            [("lookup", "a")],
        ),
        ('[THINK]need it[/THINK][TOOL_CALLS]lookup[ARGS]{"query": "a"}', [("lookup", "a")]),
        (
            '[TOOL_CALLS][{"name": "lookup", "arguments": {"query": "a"}}][TOOL_CALLS]lookup[ARGS]'
            '{"query": "b"}',
            [("lookup", "a"), ("lookup", "b")],
        ),
        (
            '[TOOL_CALLS]{"name": "lookup", "arguments": {"query": "a"}}; '
            '{"name": "lookup", "arguments": {"query": "b"}}',
            [("lookup", "a"), ("lookup", "b")],
        ),
        # A lone </think>: the calls come after it; thoughts that mention one are no call,
        # and a call whose arguments hold the tag is still one (helper-121).
        (
            'maybe <tool_call>{"name": "lookup", "arguments": {"query": "a"}}</tool_call>? no.'
            "</think>The answer is 4.",
            [],
        ),
        (
            '<tool_call>{"name": "lookup", "arguments": {"query": "a </think> b"}}</tool_call>',
            [("lookup", "a </think> b")],
        ),
        ('A model prints <think>plan</think>{"name": "lookup", "arguments": {"query": "a"}}', []),
        (
            'I should look.\n</think>\n{"name": "lookup", "arguments": {"query": "a"}}',
            [("lookup", "a")],
        ),
        ('[TOOL_CALLS]lookup[CALL_ID]a1B2c3D4e[ARGS]{"query": "a"}', [("lookup", "a")]),
        ("<think>done</think>The answer is 4.", []),
        # Answers: prose around JSON, a tool not offered, anything besides the calls.
        ('I would call {"name": "lookup", "arguments": {"query": "a"}}', []),
        ('{"name": "rm", "arguments": {}}', []),
        ('{"name": "lookup", "arguments": {"query": "a"}} and then more words', []),
        ('[{"name": "lookup", "arguments": {"query": "a"}}, 3]', []),
    ],
)
def test_the_ways_models_write_calls_as_text(text: str, expected: list[tuple[str, str]]) -> None:
    calls = recover_tool_calls(text, {"lookup"}, salt="run/1")
    assert [(c.name, json.loads(c.arguments)["query"]) for c in calls] == expected
    assert len({c.id for c in calls}) == len(calls)


def test_a_value_that_fits_is_kept_and_nested_values_are_coerced_too() -> None:
    # A union a value already fits was coerced anyway: "007" for `string | integer`
    # reached the tool as 7, "None" for `string | null` as null, 2.5 for `string |
    # number` as "2.5"; and nothing inside objects or arrays was coerced (helper-77).
    schema = {
        "type": "object",
        "properties": {
            "order": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
            "note": {"type": ["string", "null"]},
            "label": {"anyOf": [{"type": "string"}, {"type": "number"}]},
            "window": {"type": "object", "properties": {"days": {"type": "integer"}}},
            "ids": {"type": "array", "items": {"type": "integer"}},
        },
    }
    raw = (
        '{"order": "007", "note": "None", "label": 2.5, "window": {"days": "3"}, '
        '"ids": ["1", 2], "extra": "5"}'
    )
    assert prepare_arguments("t", raw, schema) == {
        "order": "007",
        "note": "None",
        "label": 2.5,
        "window": {"days": 3},
        "ids": [1, 2],
        "extra": "5",
    }
    # Coerced where the value fits none of the branches, as before (helper-78: a
    # branch of the right type that takes only one value is no fit).
    assert prepare_arguments("t", '{"note": 5, "order": 7.5}', schema) == {
        "note": "5",
        "order": "7.5",
    }
    count = {"properties": {"n": {"anyOf": [{"type": "integer"}, {"const": "all"}]}}}
    assert prepare_arguments("t", '{"n": "10"}', count) == {"n": 10}
    assert prepare_arguments("t", '{"n": "all"}', count) == {"n": "all"}


@pytest.mark.parametrize(
    ("calls", "chars", "fails"), [(4, 280_000, True), (4, 230_000, False), (1, 760_000, False)]
)
async def test_a_turn_too_large_for_temporal_fails_at_once(
    calls: int, chars: int, fails: bool
) -> None:
    # Four calls of 280 kB, carried twice (the message and the calls): Temporal took no
    # such result, the attempt failed after the fact as a retryable one, and the engine
    # wrote the same turn again for ever, the run Running all along (helper-163).
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": f"c{i}",
                "type": "function",
                "function": {"name": "lookup", "arguments": json.dumps({"q": "x" * chars})},
            }
            for i in range(calls)
        ],
    }
    app = upstream(lambda r: completion(message, "tool_calls"))
    if not fails:
        out = await call(app, turn(tools=TOOLS))
        assert len(out.tool_calls) == calls
        return
    with pytest.raises(ApplicationError) as err:
        await call(app, turn(tools=TOOLS))
    assert err.value.type == "TurnTooLarge" and err.value.non_retryable
    assert "(4 tool calls), past 1,900,000: Temporal carries" in str(err.value), err.value


async def test_an_engines_long_error_message_is_cut() -> None:
    # A validation error may quote the whole request: kept whole, it made the run's
    # failure too large for Temporal (helper-168).
    body = {"error": {"message": "input=" + "q" * 1_000_000}}
    app = upstream(lambda r: Response(json.dumps(body), 400))
    with pytest.raises(ApplicationError) as err:
        await call(app, turn())
    text = err.value.message
    assert text.startswith("gateway answered 400: input=qqq") and len(text) < 8_100
    assert text.endswith(" [luftpause: cut here, of 1,000,006 characters]"), text[-80:]


async def test_a_given_up_turns_error_keeps_saying_so_in_the_runs_error() -> None:
    # The last allowed 500, with a long message: the activity says "(this turn failed
    # 20 times: given up)" after its cut, and the run's own bound left that away
    # (helper-170).
    from activities.llm import RUN_ERROR_MAX_CHARS, bounded

    body = {"error": {"message": "input=" + "q" * 1_000_000}}
    app = upstream(lambda r: Response(json.dumps(body), 500))
    env, _ = late_attempt(ENGINE_FAULT_ATTEMPTS - 1)
    with pytest.raises(ApplicationError) as err:
        await call(app, turn(), env=env)
    assert err.value.non_retryable and "given up" in err.value.message
    run_error = bounded(str(err.value), RUN_ERROR_MAX_CHARS)  # as AgentRun.run bounds it
    assert run_error == str(err.value)
    assert f"failed {ENGINE_FAULT_ATTEMPTS} times: given up" in run_error, run_error[-120:]
