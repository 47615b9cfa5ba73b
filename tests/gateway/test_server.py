"""The gateway's HTTP server protocol (gateway/_server.py): a request head is bounded,
a request's body is not counted against it.  Raw sockets to the gateway over loopback,
as an abusive client would send the bytes."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from gateway._server import MAX_HEAD_BYTES, BoundedHead
from testkit.loopback import serve
from tests.gateway.harness import chat, endpoint, engine, gateway

LIMIT_S = 10.0


@asynccontextmanager
async def connection() -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    async with engine() as (url, _), gateway(endpoint("e0", url)) as (client, _):
        reader, writer = await asyncio.open_connection(client.base_url.host, client.base_url.port)
        try:
            yield reader, writer
        finally:
            writer.close()
            await writer.wait_closed()


async def answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 answer: status, headers, body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), LIMIT_S)
    status_line, *lines = head.decode().split("\r\n")[:-2]
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    if "content-length" in headers:
        body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), LIMIT_S)
    else:  # chunked
        body = b""
        while size := int(await asyncio.wait_for(reader.readline(), LIMIT_S), 16):
            body += await asyncio.wait_for(reader.readexactly(size + 2), LIMIT_S)
            body = body[:-2]
        await reader.readline()
    return int(status_line.split()[1]), headers, body


def padding(n: int) -> bytes:
    """Header lines of about `n` bytes in all."""
    line = b"x-pad: " + b"a" * 1000 + b"\r\n"
    return line * (n // len(line))


async def test_a_head_without_end_is_refused_and_the_connection_closed() -> None:
    async with connection() as (reader, writer):
        writer.write(b"GET /health HTTP/1.1\r\nhost: gw\r\n")
        sent = 0
        try:  # header lines without end, in reads of their own
            while sent < 4 * MAX_HEAD_BYTES:
                writer.write(padding(16 * 1024))
                await writer.drain()
                sent += 16 * 1024
        except ConnectionError:
            pass  # the gateway closed it under us: what the test waits for anyway
        status, headers, body = await answer(reader)
        assert status == 431 and headers["connection"] == "close"
        assert str(MAX_HEAD_BYTES) in json.loads(body)["error"]["message"]
        assert await asyncio.wait_for(reader.read(), LIMIT_S) == b""  # closed


@pytest.mark.parametrize("value", [b"a\rb", b"a\x00b", b"a\x7fb"])
async def test_a_header_no_http_request_carries_is_refused_as_json(value: bytes) -> None:
    # helper-125: uvicorn answered these "Invalid HTTP request received." as text.
    async with connection() as (reader, writer):
        writer.write(b"GET /health HTTP/1.1\r\nhost: gw\r\nx-request-id: " + value + b"\r\n\r\n")
        status, headers, body = await answer(reader)
        assert status == 400 and headers["connection"] == "close"
        assert headers["content-type"] == "application/json"
        message = json.loads(body)["error"]["message"]
        assert message.startswith("the request is not valid HTTP/1.1: ") and "header" in message
        assert await asyncio.wait_for(reader.read(), LIMIT_S) == b""  # closed


async def test_a_url_uvicorn_refuses_is_named_in_the_400() -> None:
    # helper-131: the message was httptools' "User callback error".
    async with connection() as (reader, writer):
        writer.write(b"GET http://a:x/ HTTP/1.1\r\nhost: gw\r\n\r\n")
        status, _, body = await answer(reader)
        message = json.loads(body)["error"]["message"]
        assert status == 400 and "callback" not in message and "URL" in message.upper(), message


async def test_a_body_that_is_no_http_is_answered_400_too() -> None:
    # helper-128: a parse error in a body (a bad chunk size) cut the connection with
    # no answer, where uvicorn answered 400; and after a good request on the
    # connection, a bad one is answered as well.
    async with connection() as (reader, writer):
        writer.write(b"GET /health HTTP/1.1\r\nhost: gw\r\n\r\n")
        assert (await answer(reader))[0] == 200
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n"
            b"content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
            b"zz\r\n{}\r\n0\r\n\r\n"
        )
        status, headers, body = await answer(reader)
        assert status == 400 and headers["connection"] == "close"
        assert json.loads(body)["error"]["message"].startswith(
            "the request is not valid HTTP/1.1: "
        )
        assert await asyncio.wait_for(reader.read(), LIMIT_S) == b""  # closed


async def _slow_then_ok(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    if scope["path"] == "/slow":
        await asyncio.sleep(0.5)  # still at work when the next request's bytes come
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
    )
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.mark.parametrize(
    "second",
    [
        b"POST /x HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
        b"GET /y HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * (2 * MAX_HEAD_BYTES) + b"\r\n",
        b"GET http://a:x/ HTTP/1.1\r\nhost: x\r\n\r\n",  # helper-131
    ],
    ids=["a bad body", "a head too long", "a URL uvicorn refuses"],
)
async def test_a_bad_request_pipelined_behind_one_at_work_is_not_answered_in_its_place(
    second: bytes,
) -> None:
    # helper-130: the 400 (or 431) of the second request was written as the first's
    # answer (and the first's own answer then failed, or it was abandoned).  The
    # connection is cut instead: no answer is anyone else's.
    async with serve(_slow_then_ok, http=BoundedHead) as url:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n" + second)
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            got = b""
            with contextlib.suppress(ConnectionError):
                got = await asyncio.wait_for(reader.read(), LIMIT_S)
            assert not got.startswith((b"HTTP/1.1 400", b"HTTP/1.1 431")), got[:80]
        finally:
            writer.close()


async def test_a_bad_body_after_a_large_read_is_answered_not_reset() -> None:
    # helper-130: uvicorn pauses reading after a large body read; the lingering close
    # left the client's bytes unread, and the close was a reset that lost the 400.
    async with connection() as (reader, writer):
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n"
            b"content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
            b"11170\r\n" + b"a" * 0x11170 + b"\r\nzz\r\n" + b"b" * (4 << 20)
        )
        with contextlib.suppress(ConnectionError):
            await writer.drain()  # all of it, before reading, as httpx does
        status, _, body = await answer(reader)
        assert status == 400 and b"not valid HTTP/1.1" in body


async def test_heads_under_the_bound_pass_one_after_another_on_a_connection() -> None:
    # Each head is under the bound; together they are over it: each is counted alone.
    async with connection() as (reader, writer):
        for _ in range(3):
            writer.write(
                b"GET /health HTTP/1.1\r\nhost: gw\r\n" + padding(MAX_HEAD_BYTES // 2) + b"\r\n"
            )
            status, _, body = await answer(reader)
            assert status == 200, body


async def test_a_large_body_is_not_counted_as_head() -> None:
    # Sent in one write: the head and the first reads of the body arrive together.
    body = json.dumps(chat("x" * 150_000, max_tokens=2))  # over the bound, inside the KV pool
    async with connection() as (reader, writer):
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body.encode()
        )
        status, _, answered = await answer(reader)
        assert status == 200, answered
        assert json.loads(answered)["choices"][0]["finish_reason"] == "length"


async def test_a_trailer_without_end_is_cut_off() -> None:
    # A chunked body's trailer section is parsed like a head, after it: bounded too.
    async with connection() as (reader, writer):
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n"
            b"content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
            b"1\r\n{\r\n0\r\nx-trailer: "
        )
        try:
            for _ in range(4 * MAX_HEAD_BYTES // 16384):
                writer.write(b"a" * 16384)
                await writer.drain()
        except ConnectionError:
            pass  # cut off under us
        try:
            rest = await asyncio.wait_for(reader.read(), LIMIT_S)
        except ConnectionResetError:
            rest = b""
        assert rest == b""  # no answer: the connection was cut


async def test_pipelined_requests_past_the_bound_together_are_all_answered() -> None:
    # Complete requests in one read count for none of the heads after them.
    body = json.dumps(chat("x" * 100_000, max_tokens=2))
    post = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode()
        + body.encode()
    )
    get = b"GET /health HTTP/1.1\r\nhost: gw\r\n\r\n"
    async with connection() as (reader, writer):
        writer.write(post + get * 3000)
        statuses = [(await answer(reader))[0] for _ in range(3001)]
    assert statuses == [200] * 3001
