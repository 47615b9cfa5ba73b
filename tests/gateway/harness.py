"""What the gateway's tests share: the gateway and fake engines served over loopback,
an ASGI wrapper that records what reaches an upstream, tiny upstream apps, polling, and
an own-loop agent's tool loop on Chat Completions."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from gateway._server import BoundedHead
from gateway._shell import AdmissionShell
from gateway.app import GatewaySettings, create_app
from luftpause.config import parse_config
from testkit._fake_text import key
from testkit.fake_engine import FakeEngineSettings
from testkit.fake_engine import create_app as create_engine
from testkit.loopback import read_body, serve

MODEL = "llama-3.2-1b"
RUN = "x-luftpause-run-id"
CALLER = "x-luftpause-caller"
# Bounded polling: 1000 x 10 ms.
POLLS, POLL_S = 1000, 0.01


@dataclass
class Recorder:
    """An ASGI wrapper that records the POSTs reaching an upstream app."""

    app: Any
    posts: list[tuple[str, dict[str, str], Any]] = field(default_factory=list)

    @property
    def chats(self) -> list[Any]:
        """The bodies of chat completion requests, in order."""
        return [body for path, _, body in self.posts if path == "/v1/chat/completions"]

    @property
    def headers(self) -> list[dict[str, str]]:
        """The headers of chat completion requests, in order."""
        return [h for path, h, _ in self.posts if path == "/v1/chat/completions"]

    @property
    def bodies(self) -> list[Any]:
        """The bodies of every POST, in order."""
        return [body for _, _, body in self.posts]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        body, replay = await read_body(receive)
        headers = {k.decode(): v.decode("latin-1") for k, v in scope["headers"]}  # as servers do
        self.posts.append((scope["path"], headers, json.loads(body)))
        await self.app(scope, replay, send)


def endpoint(
    name: str, url: str, kind: str = "sglang", models: tuple[str, ...] = (MODEL,), **kw: Any
) -> dict[str, Any]:
    return {"name": name, "url": url, "kind": kind, "models": list(models), **kw}


@contextlib.asynccontextmanager
async def gateway(
    *endpoints: dict[str, Any],
    token: str | None = None,
    probe_period: float | None = 0.05,  # None: the file's [probes] period_s
    policy: Any = None,
    sections: dict[str, Any] | None = None,
) -> AsyncIterator[tuple[httpx.AsyncClient, AdmissionShell]]:
    """Serve the gateway over loopback; yield a client for it and its admission shell.
    `sections` are more of luftpause.toml (e.g. {"policy": {...}})."""
    config = parse_config({"endpoints": list(endpoints), **(sections or {})})
    app = create_app(
        GatewaySettings(config=config, token=token, probe_period=probe_period, policy=policy)
    )
    async with (
        serve(app, http=BoundedHead) as url,
        httpx.AsyncClient(base_url=url, timeout=30) as client,
    ):
        yield client, app.state.shell


@contextlib.asynccontextmanager
async def engine(**kw: Any) -> AsyncIterator[tuple[str, Recorder]]:
    """Serve a fake engine over loopback; yield its URL and what reached it."""
    recorder = Recorder(create_engine(FakeEngineSettings(**kw)))
    async with serve(recorder) as url:
        yield url, recorder


def upstream(
    chat: Callable[[Request], Response],
    recorded: list[dict[str, str]] | None = None,
    api_path: str = "/v1",
) -> FastAPI:
    """A tiny OpenAI-ish upstream: `/v1/models` for the probe, `chat` for turns (under
    `api_path` instead of /v1, as Gemini's /v1beta/openai)."""
    app = FastAPI()

    @app.get(f"{api_path}/models")
    async def models() -> Response:
        return Response(json.dumps({"object": "list", "data": []}), media_type="application/json")

    @app.post(f"{api_path}/chat/completions")
    async def completions(request: Request) -> Response:
        if recorded is not None:
            recorded.append(dict(request.headers) | {":path": request.url.path})
        return chat(request)

    return app


def models_only() -> FastAPI:
    """A hosted OpenAI-compatible API as far as the probe sees it (`/v1/models`), with
    no route of the API under test: add the ones a test needs."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> Response:
        return Response(json.dumps({"object": "list", "data": []}), media_type="application/json")

    return app


def chat(content: str = "Hello there", **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


async def until(pred: Callable[[], bool], what: str) -> None:
    for _ in range(POLLS):
        if pred():
            return
        await asyncio.sleep(POLL_S)
    raise AssertionError(f"never happened: {what}")


def closed_port_url() -> str:
    """A loopback URL nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@contextlib.asynccontextmanager
async def raw_engine(answer: bytes | None) -> AsyncIterator[str]:
    """An engine on a raw socket (an ASGI server cannot send every status, nor close a
    connection unanswered): a probe (a GET) gets an empty model list, a turn gets
    `answer` as it is, or with None has its connection closed unanswered (an engine that
    crashed meanwhile); yield its URL."""
    models = b'{"object": "list", "data": []}'
    probed = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(models), models)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
                # (Read, so that closing sends a FIN: a body left unread would be an RST.)
                await reader.readexactly(int(length[1]) if length else 0)
                if head.startswith(b"GET"):
                    writer.write(probed)
                elif answer is None:
                    break
                else:
                    writer.write(answer)
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


async def answered_health(scope: Scope, send: Send) -> bool:
    """For a raw ASGI engine: answer what is not a turn (lifespan, the health paths: the
    openai kind's /v1/models, a classifier's /health); True if answered."""
    if scope["type"] != "http":
        return True
    if scope["path"] in ("/v1/models", "/health"):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})
        return True
    return False


# --------------------------------------------------------------------------- tool loops

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look something up.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    }
]


def tool_task(calls: int, prefix: str = "task") -> str:
    """A first user message for which the fake engine makes at least `calls` tool calls
    (fake_max_tool_calls = 3)."""
    return next(
        f"{prefix} {i}" for i in range(1000) if key(0, "tool-calls", f"{prefix} {i}") % 4 >= calls
    )


async def turn(
    gw: httpx.AsyncClient, messages: list[dict[str, Any]], stream: bool, **headers: str
) -> tuple[str, dict[str, Any], str]:
    """One turn; returns the run id header, the assistant message and the finish reason."""
    body = {"model": MODEL, "messages": messages, "tools": TOOLS, "stream": stream}
    body["fake_max_tool_calls"] = 3
    if not stream:
        r = await gw.post("/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return r.headers[RUN], choice["message"], choice["finish_reason"]
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    finish = ""
    async with gw.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                finish = choice["finish_reason"] or finish
                delta = choice["delta"]
                message["content"] += delta.get("content") or ""
                for call in delta.get("tool_calls", []):
                    if "id" in call:
                        message.setdefault("tool_calls", []).append(call)
                    else:
                        message["tool_calls"][-1]["function"]["arguments"] += call["function"][
                            "arguments"
                        ]
        return r.headers[RUN], message, finish


async def tool_loop(gw: httpx.AsyncClient, task: str, **headers: str) -> tuple[list[str], int]:
    """Drive a run until its model answers; returns each turn's run id and the turns."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": task}]
    run_ids = []
    for n in range(10):
        run_id, message, finish = await turn(gw, messages, stream=n % 2 == 1, **headers)
        run_ids.append(run_id)
        messages.append(message)
        if finish != "tool_calls":
            return run_ids, n + 1
        for call in message["tool_calls"]:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "found"})
    raise AssertionError("the run never ended")
