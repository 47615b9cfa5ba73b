"""A fake MCP tool server for tests of sub-agents: `luftpause fake-mcp`.

Temporal workflows call MCP tools through activities; to test retries, cancellation and
exactly-once effects they need a tool server whose calls take a known, deterministic time
and which counts what it did. This one serves four tools over streamable HTTP (both
protocol generations: the session-based handshake and the stateless 2026-07-28 envelope)
or over stdio:

- `lookup(query)` — read-only, about 1 virtual second;
- `deep_search(query, depth)` — read-only, 2–4 virtual seconds;
- `delete_record(record_id)` — destructive, immediate;
- `fail(reason)` — always a tool error (`isError: true`).

Durations are drawn from `random.Random` seeded by the seed, the tool and its query (so a
run repeats exactly) and divided by `time_scale`. Every call is counted in
`FakeMcpState.started` when it begins and in `FakeMcpState.counts` only when it returns
successfully, keyed by tool name and the canonical JSON of its arguments (defaults
included). Another process reads the counts from `GET /counts`, or, for a stdio server,
from the `--counts-file` the server rewrites atomically after every completed call.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Annotated, Any

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import Field
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from activities.contract import IDEMPOTENCY_META_KEY
from luftpause._args import port, positive
from testkit.loopback import serve_until_signalled

__all__ = [
    "FakeMcpSettings",
    "FakeMcpState",
    "add_arguments",
    "create_app",
    "create_server",
    "run",
]

log = logging.getLogger(__name__)

# Virtual-second ranges of the slow tools, and deep_search's default depth.
LOOKUP_SECONDS = (0.5, 1.5)
DEEP_SEARCH_SECONDS = (2.0, 4.0)
DEEP_SEARCH_DEPTH = 2
# Arguments a tool fills in when the caller leaves them out: part of the counting key, so a
# call with and without an explicit default is the same call.
_DEFAULTS: Mapping[str, Mapping[str, Any]] = {"deep_search": {"depth": DEEP_SEARCH_DEPTH}}

_READ_ONLY = ToolAnnotations(read_only_hint=True, open_world_hint=False)
_DESTRUCTIVE = ToolAnnotations(
    read_only_hint=False, destructive_hint=True, idempotent_hint=False, open_world_hint=False
)

_FINDINGS = (
    "three independent sources agree on it",
    "the record was last revised two years ago",
    "the figures are consistent across the archive",
    "one source disagrees on a minor detail",
    "the earliest mention dates from the first edition",
    "no contradicting evidence was found",
)


@dataclass(frozen=True, kw_only=True)
class FakeMcpSettings:
    """How the fake server behaves: its clock rate and the seed of its durations and text."""

    time_scale: float = 1.0
    """Virtual seconds per wall second: 20 makes a 1 s lookup take 0.05 s."""
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.time_scale > 0:
            raise ValueError(f"time_scale must be positive, got {self.time_scale}")


def _opened(event: asyncio.Event) -> asyncio.Event:
    event.set()
    return event


def _canonical(arguments: Mapping[str, Any]) -> str:
    return json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass
class FakeMcpState:
    """What the server has done: calls begun and calls completed, per tool and arguments.

    Keys are `(tool name, canonical JSON of the arguments)` with `sort_keys=True` and
    the tool's defaults filled in. A call that fails or is cancelled is in `started` only.
    """

    counts: dict[tuple[str, str], int] = field(default_factory=dict)
    """Completed calls per (tool, canonical arguments)."""
    started: dict[tuple[str, str], int] = field(default_factory=dict)
    """Calls begun per (tool, canonical arguments)."""
    received: dict[tuple[str, str], int] = field(default_factory=dict)
    """Calls that reached a tool (past its input schema) per (tool, canonical
    arguments), answered from the idempotency key's memory or not: a call sent twice
    counts 2."""
    _: KW_ONLY
    counts_file: Path | None = None
    """When set, `snapshot()` is written here (atomically) after every completed call."""
    answers: dict[str, str] = field(default_factory=dict)
    """Answers by idempotency key: a retried call gets the first call's answer."""
    inflight: dict[str, asyncio.Future[str]] = field(default_factory=dict)
    replayed: int = 0
    """Calls answered from `answers` instead of running again."""
    gate: asyncio.Event = field(default_factory=lambda: _opened(asyncio.Event()))
    """`lookup` and `deep_search` wait here after their simulated time, `delete_record`
    once begun. Open unless a test closes it (`gate.clear()`) to hold calls in flight,
    then `gate.set()`."""

    @staticmethod
    def key(tool: str, arguments: Mapping[str, Any]) -> tuple[str, str]:
        """The counting key of a call: defaults of the tool filled in, JSON with sorted keys."""
        return tool, _canonical({**_DEFAULTS.get(tool, {}), **arguments})

    def receive(self, tool: str, arguments: Mapping[str, Any]) -> None:
        """Count a tools/call request as it arrives (before `once` looks at its key)."""
        k = self.key(tool, arguments)
        self.received[k] = self.received.get(k, 0) + 1

    def resent(self) -> list[tuple[str, str, int]]:
        """The (tool, canonical arguments, count) entries received more than once."""
        return [(t, a, n) for (t, a), n in sorted(self.received.items()) if n > 1]

    def begin(self, tool: str, arguments: Mapping[str, Any]) -> tuple[str, str]:
        """Count a call as started; return its key for `finish`."""
        k = self.key(tool, arguments)
        self.started[k] = self.started.get(k, 0) + 1
        return k

    def finish(self, key: tuple[str, str]) -> None:
        """Count a started call as completed (and publish the counts file, if any)."""
        self.counts[key] = self.counts.get(key, 0) + 1
        if self.counts_file is not None:
            self.write(self.counts_file)

    def completed(self, tool: str, /, **arguments: Any) -> int:
        """How many calls of `tool` with these arguments completed (defaults may be left out)."""
        return self.counts.get(self.key(tool, arguments), 0)

    def repeated(self) -> list[tuple[str, str, int]]:
        """The (tool, canonical arguments, count) entries completed more than once."""
        return [(t, a, n) for (t, a), n in sorted(self.counts.items()) if n > 1]

    def snapshot(self) -> dict[str, list[dict[str, Any]]]:
        """The counts as JSON (the body of `GET /counts` and of the counts file)."""

        def rows(table: dict[tuple[str, str], int]) -> list[dict[str, Any]]:
            return [
                {"tool": t, "arguments": json.loads(a), "count": n}
                for (t, a), n in sorted(table.items())
            ]

        return {
            "completed": rows(self.counts),
            "started": rows(self.started),
            "received": rows(self.received),
        }

    def write(self, path: Path) -> None:
        """Write `snapshot()` to `path` atomically: a reader sees the old or the new file."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.snapshot(), sort_keys=True), encoding="utf-8")
        try:
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)  # `path` is a directory, say: leave nothing behind
            raise


# --------------------------------------------------------------------------- the server


def _rng(settings: FakeMcpSettings, tool: str, query: str) -> random.Random:
    # A str seed is hashed with SHA-512, stable across processes (unlike hash()).
    return random.Random(f"{settings.seed}\x00{tool}\x00{query}")


def _finding(rng: random.Random) -> str:
    return rng.choice(_FINDINGS)


def create_server(settings: FakeMcpSettings, state: FakeMcpState) -> MCPServer:
    """Build the fake MCP server: four tools over `settings`, counting into `state`."""
    mcp: MCPServer = MCPServer(
        "luftpause-fake-mcp",
        instructions="A fake tool server for tests: answers are filler, durations simulated.",
        version="1",
    )

    async def wait(rng: random.Random, seconds: tuple[float, float]) -> None:
        await anyio.sleep(rng.uniform(*seconds) / settings.time_scale)
        await state.gate.wait()

    async def once(
        ctx: Context, tool: str, arguments: Mapping[str, Any], compute: Callable[[], Awaitable[str]]
    ) -> str:
        """Run a call at most once per idempotency key (`_meta`, sent by luftpause's
        worker): a retried call gets the first call's answer, and a retry that arrives
        while the first still runs waits for it.  Every arrival is counted (`received`)."""
        state.receive(tool, arguments)
        try:
            meta = ctx.request_context.meta or {}
        except ValueError:  # called in-process, outside a request: no _meta
            meta = {}
        key = meta.get(IDEMPOTENCY_META_KEY)
        if not isinstance(key, str):
            return await compute()
        while True:
            if key in state.answers:
                state.replayed += 1
                return state.answers[key]
            running = state.inflight.get(key)
            if running is None:
                break
            try:
                return await asyncio.shield(running)
            except asyncio.CancelledError:
                if not running.cancelled():
                    raise  # this call itself was cancelled
                # the first call was cancelled: this one runs it
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        state.inflight[key] = fut
        try:
            answer = await compute()
        except BaseException:
            fut.cancel()
            raise
        finally:
            state.inflight.pop(key, None)
        state.answers[key] = answer
        fut.set_result(answer)
        return answer

    @mcp.tool(annotations=_READ_ONLY)
    async def lookup(
        ctx: Context,
        query: Annotated[str, Field(description="What to look up, in a few words.")],
    ) -> str:
        """Look up a short fact about the query (takes about a second)."""

        async def compute() -> str:
            key = state.begin("lookup", {"query": query})
            rng = _rng(settings, "lookup", query)
            await wait(rng, LOOKUP_SECONDS)
            answer = f"Lookup of {query!r}: {_finding(rng)}."
            state.finish(key)
            return answer

        return await once(ctx, "lookup", {"query": query}, compute)

    @mcp.tool(annotations=_READ_ONLY)
    async def deep_search(
        ctx: Context,
        query: Annotated[str, Field(description="The question to research.")],
        depth: Annotated[
            int, Field(description="How many rounds of follow-up searches.", ge=1, le=5)
        ] = DEEP_SEARCH_DEPTH,
    ) -> str:
        """Research the query in depth across several sources (slow: two to four seconds)."""

        async def compute() -> str:
            key = state.begin("deep_search", {"query": query, "depth": depth})
            rng = _rng(settings, "deep_search", f"{query}\x00{depth}")
            await wait(rng, DEEP_SEARCH_SECONDS)
            findings = "; ".join(_finding(rng) for _ in range(depth))
            answer = f"Deep search of {query!r} ({depth} rounds): {findings}."
            state.finish(key)
            return answer

        return await once(ctx, "deep_search", {"query": query, "depth": depth}, compute)

    @mcp.tool(annotations=_DESTRUCTIVE)
    async def delete_record(
        ctx: Context,
        record_id: Annotated[str, Field(description="The id of the record to delete.")],
    ) -> str:
        """Delete a record permanently. Destructive: it cannot be undone."""

        async def compute() -> str:
            key = state.begin("delete_record", {"record_id": record_id})
            await state.gate.wait()
            state.finish(key)
            return f"deleted {record_id}"

        return await once(ctx, "delete_record", {"record_id": record_id}, compute)

    @mcp.tool(annotations=_READ_ONLY)
    async def fail(
        reason: Annotated[str, Field(description="The message the error carries.")],
    ) -> str:
        """Always fail with a tool error carrying the reason (for tests of failed calls)."""
        state.receive("fail", {"reason": reason})
        state.begin("fail", {"reason": reason})
        # ToolError: the result has isError true and our text; anything else would be
        # reported as a crash ("Error executing tool fail").
        raise ToolError(f"fail: {reason}")

    return mcp


def create_app(
    settings: FakeMcpSettings, state: FakeMcpState, *, host: str = "127.0.0.1"
) -> Starlette:
    """The ASGI app: streamable HTTP MCP at `/mcp` and the counts at `GET /counts`.

    `host` is where it is served; on loopback the SDK enables its DNS-rebinding guard,
    which accepts only loopback Host headers.
    """

    async def counts(request: Request) -> Response:
        return JSONResponse(state.snapshot())

    # The Starlette app the SDK returns already runs `mcp.session_manager.run()` in its
    # lifespan, so it is served as is rather than mounted (a mount would skip that).
    # `MCPServer.custom_route` is untyped, so /counts is added to the built app instead.
    app = create_server(settings, state).streamable_http_app(streamable_http_path="/mcp", host=host)
    app.add_route("/counts", counts, methods=["GET"])
    return app


# --------------------------------------------------------------------------- the CLI


def _description() -> str:
    """What `luftpause fake-mcp --help` says: every tool the server serves, read from the
    server itself so that the help cannot leave one out."""
    tools = create_server(FakeMcpSettings(), FakeMcpState())._tool_manager.list_tools()
    kinds = {True: "destructive", False: "read-only"}
    served = "; ".join(
        f"{t.name} ({kinds[bool(t.annotations and t.annotations.destructive_hint)]}): "
        f"{(t.description or '').rstrip('.')}"
        for t in tools
    )
    return f"Serve the fake MCP tool server for tests. Its tools: {served}."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the flags of `luftpause fake-mcp` to its subcommand parser."""
    parser.description = _description()
    parser.add_argument("--transport", choices=["http", "stdio"], default="http")
    parser.add_argument("--host", default="127.0.0.1", help="http: address to bind")
    parser.add_argument("--port", type=port, help="http: port to bind (required for http)")
    parser.add_argument(
        "--time-scale",
        type=positive,
        default=1.0,
        help="virtual seconds per wall second (20: a 1 s lookup takes 0.05 s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of durations and answers")
    parser.add_argument(
        "--counts-file",
        type=Path,
        help="rewrite the counts (the JSON of GET /counts) here after every completed call",
    )


def run(args: argparse.Namespace) -> int:
    """Serve until stdin closes (stdio) or SIGINT/SIGTERM (http); return the exit code."""
    # stderr only: on stdio, stdout is the protocol channel.
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        settings = FakeMcpSettings(time_scale=args.time_scale, seed=args.seed)
    except ValueError as exc:
        print(f"luftpause fake-mcp: {exc}", file=sys.stderr)
        return 2
    state = FakeMcpState(counts_file=args.counts_file)
    if args.counts_file is not None:
        try:
            state.write(args.counts_file)  # readers find a file (all zero) from the start
        except OSError as exc:
            print(
                f"luftpause fake-mcp: --counts-file {args.counts_file}: "
                f"cannot write there ({exc.strerror or exc})",
                file=sys.stderr,
            )
            return 2
    if args.transport == "stdio":
        anyio.run(create_server(settings, state).run_stdio_async)
        return 0
    if args.port is None:
        print("luftpause fake-mcp: --port is required for --transport http", file=sys.stderr)
        return 2
    _serve_http(create_app(settings, state, host=args.host), host=args.host, port=args.port)
    return 0


def _serve_http(app: Starlette, *, host: str, port: int) -> None:
    def started() -> None:
        log.info("fake MCP server on http://%s:%d/mcp", host, port)

    serve_until_signalled(app, host=host, port=port, started=started)
