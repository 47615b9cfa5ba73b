"""Bad input, drawn at random: whatever a client sends to the gateway's routes, the
answer is a 4xx naming what was wrong (or the turn is served), never a 500.

The gateway and a fake engine run over loopback in a thread of their own, so that
hypothesis drives plain synchronous requests and shrinks a failure to its smallest
body.  Bodies are built from the APIs' own field names, so that they get past the
first check and into the parsers' corners, and from raw bytes, so that they do not."""

from __future__ import annotations

import contextlib
import json
import urllib.parse
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from harness import MODEL, endpoint, engine, gateway
from hypothesis import given, settings
from hypothesis import strategies as st

from testkit.loopback import on_own_loop

# The field names of Chat Completions, Messages, Responses and /v1/decide, and the
# values their parsers branch on.
KEYS = [
    "model", "messages", "max_tokens", "max_completion_tokens", "max_output_tokens",
    "stream", "stream_options", "tools", "tool_choice", "tool_calls", "tool_call_id",
    "role", "content", "type", "text", "name", "arguments", "function", "id", "input",
    "system", "instructions", "previous_response_id", "include_usage", "labels",
    "n", "temperature", "metadata", "call_id", "output", "image_url", "source",
]  # fmt: skip
WORDS = [
    MODEL, "user", "assistant", "system", "tool", "developer", "function", "text",
    "tool_use", "tool_result", "function_call", "function_call_output", "message",
    "input_text", "image", "auto", "none", "required", "",
]  # fmt: skip

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from(WORDS)
    | st.text(max_size=20)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=25,
)
messages = st.lists(
    st.dictionaries(st.sampled_from(KEYS), values, max_size=5)
    | st.fixed_dictionaries(
        {"role": st.sampled_from(WORDS), "content": values},
        optional={"tool_calls": values, "tool_call_id": values, "type": values},
    ),
    max_size=4,
)
# A body close to a valid one for each route, with any of its fields bent.
bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from([MODEL, "no-such-model"]) | values,
        "messages": messages | values,
        "input": messages | values,
        "max_tokens": st.integers(min_value=-5, max_value=2**40) | values,
        "stream": st.booleans() | values,
        "tools": values,
        "system": values,
        "labels": st.lists(st.text(max_size=5), max_size=4) | values,
    },
)
documents = (
    bodies.map(lambda b: json.dumps(b).encode())
    | values.map(lambda v: json.dumps(v).encode())
    | st.binary(max_size=64)
)
# What HTTP lets a header carry: visible ASCII, spaces, and Latin-1's upper half.
header_text = st.text(
    alphabet=st.characters(codec="latin-1", min_codepoint=0x20, exclude_characters="\x7f"),
    max_size=12,
)
headers = st.fixed_dictionaries(
    {},
    optional={
        "x-luftpause-run-id": header_text,
        "x-luftpause-class": st.sampled_from(["interactive", "batch", "BATCH", "x", ""]),
        "x-luftpause-caller": header_text,
        "x-claude-code-session-id": header_text,
        "content-type": st.sampled_from(["application/json", "text/plain", "x/y; charset=zz"]),
        "anthropic-version": st.sampled_from(["2023-06-01", "", "x"]) | header_text,
        "anthropic-beta": header_text,
    },
).map(lambda h: {k: v.strip().encode("latin-1") for k, v in h.items()})

ROUTES = [
    "/v1/chat/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/v1/decide",
]


@contextlib.asynccontextmanager
async def _gateway() -> AsyncIterator[str]:
    async with engine(instant=True) as (url, _), gateway(endpoint("a", url)) as (client, _):
        yield str(client.base_url).rstrip("/")


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    """The gateway, with one instant fake engine, served from a thread's own loop."""
    with on_own_loop(_gateway) as (url, _):
        yield url


def _said_what_was_wrong(r: httpx.Response) -> None:
    assert r.status_code != 500 and r.status_code < 600, (r.status_code, r.text[:300])
    if 400 <= r.status_code < 500:
        body = r.json()
        message = body["error"]["message"]
        assert isinstance(message, str) and message.strip(), body


@settings(max_examples=150)
@given(route=st.sampled_from(ROUTES), document=documents, sent=headers)
def test_a_turn_of_any_shape_is_served_or_refused_with_a_reason(
    base_url: str, route: str, document: bytes, sent: dict[str, bytes]
) -> None:
    with httpx.Client(timeout=30) as client:
        r = client.post(base_url + route, content=document, headers=sent)
    _said_what_was_wrong(r)
    if r.status_code == 200 and route != "/v1/decide":
        assert "x-luftpause-run-id" in r.headers


@settings(max_examples=80)
@given(
    query=st.dictionaries(
        st.sampled_from(["caller", "phase", "class", "limit", "x"]),
        st.text(max_size=8)
        | st.sampled_from(["idle", "waiting", "batch", "0", "1000", "-1", "²", "9" * 5000]),
        max_size=3,
    ),
    run_id=st.text(min_size=1, max_size=20),
)
def test_runs_answer_any_query_or_id_with_a_reason(
    base_url: str, query: dict[str, str], run_id: str
) -> None:
    with httpx.Client(timeout=30) as client:
        listed = client.get(base_url + "/v1/runs", params=query)
        _said_what_was_wrong(listed)
        if listed.status_code == 200:
            assert isinstance(listed.json()["runs"], list)
        path = base_url + "/v1/runs/" + urllib.parse.quote(run_id, safe="")
        for method in ("GET", "DELETE"):
            _said_what_was_wrong(client.request(method, path))
