"""Tool calls of any shape, drawn at random, through the official client: each is
answered or refused with a reason, never the SDK's bare "Error executing tool <name>",
which is what a crash in a tool looks like to the caller.

The stack (Temporal dev server, gateway, fake engines, worker) runs in a thread's own
event loop, so that hypothesis drives the calls synchronously and shrinks a failure.
`spawn` and `run` are drawn with a model no pool serves, so no run is started: the
arguments' checks are what is driven there."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mcp import Client

from testkit.loopback import on_own_loop
from tests.workflows.harness import stack

Call = Callable[[str, dict[str, Any]], Any]

STATES = ["Running", "AwaitingApproval", "Completed", "Failed", "Cancelled", "Sleeping"]
# Handles as a client might mangle them: quotes and backslashes (Temporal's list query
# quotes values), control characters, non-ASCII, the length limit's edges.
handles = st.one_of(
    st.text(min_size=1, max_size=40),
    st.sampled_from(["run-nope", "'", "\\", "a' OR 'a'='a", "\x00", "run-" + "x" * 196, " "]),
    st.text(alphabet="run-'\"\\ \t\n", min_size=1, max_size=8),
)
max_chars = st.integers(-1, 2_000_000) | st.just(1000)
anything = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10)


def _args(**fields: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """Any subset of a tool's arguments, each well-typed or of any type at all."""
    return st.fixed_dictionaries({}, optional={k: v | anything for k, v in fields.items()})


CALLS = st.one_of(
    st.tuples(
        st.just("status"),
        _args(
            handles=st.lists(handles, max_size=3),
            state=st.sampled_from(STATES) | st.text(max_size=10),
            root=handles,
            parent=handles,
            serviceClass=st.sampled_from(["interactive", "batch", "x"]),
            model=st.text(max_size=10),
            maxChars=max_chars,
        ),
    ),
    st.tuples(
        st.just("await"),
        _args(
            handles=st.lists(handles, min_size=1, max_size=3),
            mode=st.sampled_from(["all", "any", "some"]),
            timeout=st.floats(min_value=-1, max_value=0.2) | st.just(601),
            maxChars=max_chars,
        ),
    ),
    st.tuples(
        st.just("answer"),
        _args(handle=handles, offset=st.integers(-2, 10**6), maxChars=max_chars),
    ),
    st.tuples(st.just("cancel"), _args(handle=handles)),
    st.tuples(
        st.just("approve"),
        _args(handle=handles, allow=st.booleans(), callId=st.text(max_size=10)),
    ),
    st.tuples(
        st.just("decide"),
        _args(
            input=st.text(max_size=20),
            labels=st.lists(st.text(max_size=4), max_size=4),
            model=st.sampled_from(["gpt-9", ""]) | st.text(max_size=5),
        ),
    ),
    st.tuples(
        st.sampled_from(["spawn", "run"]),
        _args(
            task=st.text(max_size=10),
            serviceClass=st.sampled_from(["interactive", "batch", "x"]),
            maxToolCalls=st.integers(-2, 70),
            maxTokens=st.integers(-2, 40_000),
            tools=st.lists(st.text(max_size=6), max_size=2),
            parent=handles,
            budgetTokens=st.integers(-1, 10),
            budgetSeconds=st.floats(allow_nan=True),
            approveTools=st.lists(st.text(max_size=6), max_size=2),
            timeout=st.floats(min_value=-1, max_value=0.2),
            maxChars=max_chars,
        ).map(lambda a: {**a, "model": "no-such-model"}),
    ),
)


@pytest.fixture(scope="module")
def call(temporal_address: str) -> Iterator[Call]:
    """call(tool, arguments) -> the CallToolResult, through the official client on a
    stack served from a thread's own loop."""

    @contextlib.asynccontextmanager
    async def client() -> AsyncIterator[Client]:
        async with stack(temporal_address) as s, Client(s.mcp_door, mode="legacy") as c:
            yield c

    with on_own_loop(client) as (c, loop):

        def call(tool: str, arguments: dict[str, Any]) -> Any:
            coroutine: Coroutine[Any, Any, Any] = c.call_tool(tool, arguments)
            return asyncio.run_coroutine_threadsafe(coroutine, loop).result(timeout=60)

        yield call


@settings(max_examples=400)
@given(drawn=CALLS)
def test_a_tool_call_of_any_shape_is_answered_or_refused_with_a_reason(
    call: Call, drawn: tuple[str, dict[str, Any]]
) -> None:
    tool, arguments = drawn
    r = call(tool, arguments)
    if r.is_error:
        text = " ".join(getattr(c, "text", "") for c in r.content)
        # A crash: the SDK hides what happened and says only this.
        assert text.strip() != f"Error executing tool {tool}", (tool, arguments)
        assert "Traceback" not in text and "pydantic" not in text, text
    else:
        assert tool in ("status", "await", "cancel", "approve", "decide"), (tool, arguments)
        assert isinstance(r.structured_content, dict), r
