"""Pass-through fidelity of the proxy over real loopback HTTP, against an engine on a raw
socket that sends exactly the bytes a test chooses and records what it got (helper-81):
the usage event the gateway adds is removed however it is spaced or cut, and every
other byte and header of the answer is the one sent, but for hop-by-hop headers."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from harness import RUN, chat, endpoint, gateway, until

from gateway._proxy import _AddedUsage

Write = Callable[[bytes], Awaitable[None]]

CONTENT = b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
FINISH = (
    b'data: {"id":"x","choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":null}\n\n'
)
DONE = b"data: [DONE]\n\n"


def usage_event(choices: bytes = b'"choices":[]') -> bytes:
    return (
        b'data: {"id":"x",' + choices + b',"usage":{"prompt_tokens":7,"completion_tokens":1,'
        b'"total_tokens":8}}\n\n'
    )


def head(extra: bytes = b"", media: bytes = b"text/event-stream") -> bytes:
    """A head whose body ends when the engine closes the connection."""
    return b"HTTP/1.1 200 OK\r\ncontent-type: " + media + b"\r\n" + extra + b"\r\n"


@contextlib.asynccontextmanager
async def scripted_engine(
    answer: Callable[[Write], Awaitable[None]],
) -> AsyncIterator[tuple[str, list[tuple[bytes, bytes]]]]:
    """An engine on a raw socket: probes get an empty model list; a turn (a POST) gets
    what `answer` writes (each piece drained), then the connection closes.  Yields its
    URL and the turns it got (head, body)."""
    posts: list[tuple[bytes, bytes]] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def write(piece: bytes) -> None:
            writer.write(piece)
            await writer.drain()

        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                got = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length: *(\d+)", got)
                body = await reader.readexactly(int(length.group(1)) if length else 0)
                if got.startswith(b"GET"):
                    models = b'{"object": "list", "data": []}'
                    size = str(len(models)).encode()
                    await write(
                        b"HTTP/1.1 200 OK\r\ncontent-length: " + size + b"\r\n\r\n" + models
                    )
                    continue
                posts.append((got, body))
                await answer(write)
                break
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", posts
    finally:
        server.close()
        await server.wait_closed()


def sent(*pieces: bytes) -> Callable[[Write], Awaitable[None]]:
    async def answer(write: Write) -> None:
        for piece in pieces:
            await write(piece)

    return answer


def header(raw_head: bytes, name: bytes) -> bytes | None:
    for line in raw_head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip()
    return None


async def streamed(
    answer: Callable[[Write], Awaitable[None]],
    body: dict[str, Any] | None = None,
    kind: str = "sglang",
) -> tuple[list[tuple[bytes, bytes]], Any, bytes, int]:
    """One turn through the gateway: what the engine got, the client's response, its
    raw bytes, and the context the core counted for the run."""
    async with (
        scripted_engine(answer) as (url, posts),
        gateway(endpoint("a", url, kind=kind)) as (gw, shell),
    ):
        async with gw.stream("POST", "/v1/chat/completions", json=body or chat(stream=True)) as r:
            raw = b"".join([chunk async for chunk in r.aiter_raw()])
        await until(lambda: not shell.state.turns, "turn finished")
        return posts, r, raw, shell.state.runs[r.headers[RUN]].context_tokens


# --------------------------------------------------------------------------- 1: spelling


@pytest.mark.parametrize(
    "choices",
    [b'"choices":[]', b'"choices": []', b'"choices":[ ]', b'"choices" : []', b'"choices":\t[ ]'],
)
async def test_the_added_usage_event_is_dropped_however_its_json_is_spaced(
    choices: bytes,
) -> None:
    # The test was for `"choices":[]` and `"choices": []` only: another JSON writer's
    # spacing put the gateway's own usage event in front of a client that never asked.
    stream = CONTENT + FINISH + usage_event(choices) + DONE
    posts, _, raw, context = await streamed(sent(head(), stream))
    assert json.loads(posts[0][1])["stream_options"] == {"include_usage": True}
    assert raw == CONTENT + FINISH + DONE
    assert context == 8  # the core read it all the same


# --------------------------------------------------------------------------- 3: cuts


LINE_ENDS = {
    "LF": lambda b: b,
    "CRLF": lambda b: b.replace(b"\n", b"\r\n"),
    "CR": lambda b: b.replace(b"\n", b"\r"),
}


@pytest.mark.parametrize("ends", list(LINE_ENDS))
def test_the_added_usage_event_is_dropped_byte_exactly_wherever_the_reads_end(
    ends: str,
) -> None:
    # Cut after the CR of a CRLF that ends an event, the LF went with the next event:
    # dropped with the usage event (the client's `\r\n\r` + next event), or passed on
    # as a blank line of its own.
    conv = LINE_ENDS[ends]
    whole = conv(CONTENT + FINISH + usage_event(b'"choices": []') + DONE)
    want = conv(CONTENT + FINISH + DONE)
    n = len(whole)
    for cut in itertools.chain(((i,) for i in range(n)), itertools.combinations(range(1, n), 2)):
        bounds = (0, *cut, n)
        hide = _AddedUsage()
        pieces = [whole[a:b] for a, b in itertools.pairwise(bounds)]
        out = b"".join(hide.filter(p) for p in pieces[:-1]) + hide.filter(pieces[-1], last=True)
        assert out == want, (ends, cut, out)


async def test_a_crlf_cut_between_the_cr_and_lf_before_the_usage_event_loses_no_byte() -> None:
    # Over real HTTP: the engine writes the rest only once the client has the events
    # before the cut, so the gateway read them apart from it.
    crlf = LINE_ENDS["CRLF"]
    whole = crlf(CONTENT + FINISH + usage_event() + DONE)
    cut = len(crlf(CONTENT + FINISH)) - 1  # between the last CR and LF of the finish
    seen = asyncio.Event()

    async def answer(write: Write) -> None:
        await write(head() + whole[:cut])
        await seen.wait()
        await write(whole[cut:])

    async with (
        scripted_engine(answer) as (url, _),
        gateway(endpoint("a", url)) as (gw, shell),
    ):
        got = b""
        async with gw.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as r:
            async for chunk in r.aiter_raw():
                got += chunk
                if got == whole[:cut]:
                    seen.set()
        await until(lambda: not shell.state.turns, "turn finished")
    assert seen.is_set()
    assert got == crlf(CONTENT + FINISH + DONE)


# --------------------------------------------------------------------------- 4: headers


async def test_the_engines_headers_reach_the_client_except_hop_by_hop_ones() -> None:
    engine_headers = (
        b"Server: engine/1.0\r\n"
        b"Date: Mon, 01 Jan 2024 00:00:00 GMT\r\n"
        b"x-request-id: req-abc\r\n"
        b"openai-processing-ms: 123\r\n"
        b"x-ratelimit-limit-requests: 100\r\n"
        b"X-RateLimit-Remaining-Tokens: 999\r\n"
        b"x-multi: a\r\n"
        b"x-multi: b\r\n"
        b"Connection: x-hop, keep-alive\r\n"
        b"x-hop: named by Connection\r\n"
    )
    body = chat(stream=True, stream_options={"include_usage": True})
    stream = CONTENT + FINISH + usage_event() + DONE
    _, r, raw, _ = await streamed(sent(head(engine_headers), stream), body=body)
    assert raw == stream  # asked for by the client: its usage event is its own
    got = r.headers
    assert got["x-request-id"] == "req-abc"
    assert got["openai-processing-ms"] == "123"
    assert got["x-ratelimit-limit-requests"] == "100"
    assert got["x-ratelimit-remaining-tokens"] == "999"
    assert got.get_list("x-multi") == ["a", "b"]
    # RFC 9110 7.6.1: a header the Connection header names is hop-by-hop.
    assert "x-hop" not in got
    # The server's own Date and Server, as nginx's proxy does by default (one of each).
    assert got.get_list("server") == ["uvicorn"] and len(got.get_list("date")) == 1
