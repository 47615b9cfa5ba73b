"""The gateway app: `create_app(settings)` builds the FastAPI app whose lifespan owns the
upstream HTTP client, the admission shell (the scheduler core in this process), the
prober and the tick task.  Routes are thin: parse, ask the core, stream.

Built so far: the turns of three APIs, admitted and passed through: `POST
/v1/chat/completions`, `POST /v1/responses` (Codex's) and `POST /v1/messages` (Anthropic
Messages, Claude Code's; `/v1/messages/count_tokens` is passed to a replica as it is),
`POST /v1/decide` (gateway/decide.py),
`DELETE /v1/runs/{run_id}`, `GET /v1/models`, `GET /health`, `GET /status` and its
page `GET /`, `GET /metrics`, bearer-token auth on `/v1/*`, `/status` and `/`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import json
import logging
import math
import os
import re
import signal
import threading
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Container,
    Coroutine,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from opentelemetry import context as otel_context
from opentelemetry.trace import Span, SpanKind, StatusCode, set_span_in_context
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send
from temporalio.client import Client as TemporalClient

from activities.mcp_pool import McpPool
from gateway._http import Upstream, credentials_refused, no_answer_of, wait_disconnect
from gateway._proxy import (
    BEARER_CHALLENGE,
    CancelOnLeave,
    ClientLeft,
    TurnRequest,
    TurnResponse,
    api_not_served,
    dropped_upstream,
    error_response,
    response_key,
)
from gateway._runtrace import RunSpans
from gateway._shell import AdmissionShell, Awaited
from gateway.decide import (
    CLIENT_LEFT,
    ClassifierLoad,
    DecideError,
    DecideRequest,
    Spread,
    Unanswered,
    decide,
    decide_request,
    parse_decide,
    untold,
)
from gateway.discovery import Found, Resolver
from gateway.mcp_door import RUN_STORE_DOWN, DoorDeps, RunStoreDown, create_mcp_server
from gateway.metrics import GatewayMetrics
from gateway.pool import Pool, PoolChange, compare
from gateway.prober import Prober, ProbeResult, auth_headers, slots_unknown
from gateway.status import (
    PAGE_RUNS,
    RUNS_LIMIT,
    RUNS_MAX,
    WAITING,
    claims_of,
    render_status_page,
    run_view,
    runs_listing,
    status_snapshot,
    sub_agent_tree,
    waiting_view,
)
from luftpause import telemetry
from luftpause._process import freeze_heap, hold_hangups, take_held_hangups
from luftpause.config import MODEL_MAX_CHARS, Api, Config, ConfigError, Endpoint, load_config
from luftpause.headers import (
    CALLER_HEADER,
    CLASS_HEADER,
    RUN_HEADER,
    RUN_ID,
    RUN_ID_SHAPE,
    TENANT_HEADER,
    caller_name,
    caller_text,
    outside_the_run,
    session_run,
)
from luftpause.native import core_build
from luftpause.net import KEEPALIVE
from scheduler import (
    Action,
    Event,
    Forget,
    Policy,
    PolicyChanged,
    PoolChanged,
    ReplicaState,
    RunEnded,
    RunPhase,
    ServiceClass,
    State,
    Tick,
    unknown_model,
)
from workflows import Runs

__all__ = [
    "CALLER_HEADER",
    "CLASS_HEADER",
    "CONNECT_TIMEOUT_S",
    "RUN_HEADER",
    "TICK_PERIOD_S",
    "GatewaySettings",
    "create_app",
]

log = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
RESPONSES_PATH = "/v1/responses"
MCP_PATH = "/mcp"
# The status page and /status show this many recent sub-agent runs of this gateway's
# task queue, read from Temporal within this time (the page still answers without them).
STATUS_RUNS = 20
STATUS_RUNS_TIMEOUT_S = 3.0
# /metrics counts the sub-agent runs by state in Temporal at most this often (four
# visibility queries), whatever the scrape interval: scrapes in between show the last.
SUBAGENT_COUNT_EVERY_S = 5.0
STATUS_QUERY_TIMEOUT_S = 0.5  # a run no worker answers for shows what Temporal knows
ANONYMOUS_CALLER = "anonymous"
CONNECT_TIMEOUT_S = 2.0
TICK_PERIOD_S = 2.0
TOOL_CALL_SWEEP_S = 60.0
# Engines' HTTP servers close an idle connection after 5 s (uvicorn's default, which
# SGLang and vLLM keep); a pooled connection reused as the engine closes it fails the
# request.  So this client (probes, /v1/decide, the MCP door's ask) lets its idle
# connections go first.  (Proxied turns use gateway._http.Upstream, which sends a
# request again on a new connection when an idle one closes without a byte of answer.)
UPSTREAM_KEEPALIVE_S = 4.0
_UPSTREAM_LIMITS = httpx.Limits(
    max_connections=4096, max_keepalive_connections=512, keepalive_expiry=UPSTREAM_KEEPALIVE_S
)
# And clients' pools keep idle connections to the gateway up to 5 s (httpx, the OpenAI
# SDKs) or longer (load balancers: 60 s): the gateway keeps them longer still, so the
# client is the one that closes (uvicorn's 5 s would race them).
KEEPALIVE_S = 75
# How long a stop waits for the door's background work (a cut call's run to cancel
# once it has started): within the shutdown's margin (the manifests give 40 s to a
# 30 s grace, and the telemetry flush takes up to 5; helper-148).
BACKGROUND_SETTLE_S = 3.0
# A held turn's answer once the gateway is stopping (503, with Retry-After).
SHUTTING_DOWN = (
    "the gateway is shutting down: retry (another replica of the gateway takes it, or "
    "this one once it is back)"
)
# Open MCP sessions a caller with a token of its own may hold (the SDK closes one after
# 30 min idle, and holds at most 10,000 in all).
MCP_SESSIONS_PER_CALLER = 1_000


@dataclass(frozen=True, kw_only=True, slots=True)
class GatewaySettings:
    """Everything the gateway is built from."""

    config: Config
    # LUFTPAUSE_TOKEN: when set, /v1/*, /status and / need `Authorization: Bearer <token>`.
    token: str | None = None
    probe_period: float | None = None  # None: the file's [probes] period_s
    policy: Policy | None = None
    # Where the gateway is served: the MCP door accepts only this host in `Host`
    # (the SDK's DNS-rebinding guard, on for loopback hosts).
    host: str = "127.0.0.1"
    # The file `config` came from: SIGHUP and POST /reload read it again (gateway/pool.py).
    config_path: str | None = None
    # Once started, `luftpause._process.freeze_heap()`: full collections, which stop
    # every stream, then skip the startup heap (`bench.gc_pauses`: a third of the time
    # under load).  For the process `luftpause gateway` runs, not for tests that build
    # many apps in one process.
    freeze_heap: bool = False


@dataclass(slots=True)
class _Runtime:
    """What the lifespan provides to the routes."""

    shell: AdmissionShell
    client: httpx.AsyncClient  # probes and /v1/decide
    upstream: Upstream  # proxied turns
    loop: asyncio.AbstractEventLoop
    prober: Prober
    refused: Callable[[int], None]  # counts a turn refused before the core (metrics)


class _Live:
    """The pool the gateway serves now, and every endpoint a turn may still be on: the
    pool's replicas and the retired ones the core has not forgotten (rule 11).  `known`
    is one dict, changed in place: a turn held across a reload looks its replica up in
    it once admitted, and may be admitted to one the reload added."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.known: dict[str, Endpoint] = dict(pool.replicas)
        self.reloading = asyncio.Lock()  # one reload at a time: the last file read wins
        self.classifier_load = ClassifierLoad()  # /v1/decide's spread over classifiers
        self.count_load = _CountLoad()  # count_tokens' spread over a model's replicas

    def awaited(self, model: str) -> Awaited | None:
        """`Pool.awaited` of the pool served when asked (a held turn asks on its answer)."""
        return self.pool.awaited(model)

    def forget(self, still_known: Callable[[str], bool]) -> None:
        """Drop the retired endpoints the core has forgotten since (their last run
        ended or went idle): their names are free for other engines."""
        for name in [n for n in self.known if n not in self.pool.replicas and not still_known(n)]:
            del self.known[name]

    def replace(self, pool: Pool, still_known: Callable[[str], bool]) -> None:
        self.pool = pool
        self.forget(still_known)
        self.known.update(pool.replicas)


class _CountLoad(Spread):
    """Spreads `/v1/messages/count_tokens` over the replicas that serve its model, as a
    router spreads a request that is no turn (no admission, no run to keep together):
    those healthy at their last probe first, then those not ejected after failing turns
    (helper-116, helper-117), then those under their limit (cap and slots), then the
    fewest in flight there (the core's turns and the gateway's counts), ties taken in
    turn (helper-190: every count went to the replica whose name sorted first, beside
    its turns).  As `ClassifierLoad` spreads `/v1/decide`'s classify requests."""

    __slots__ = ()

    def target(
        self,
        serving: Sequence[Endpoint],
        down: Container[str],
        replicas: Mapping[str, ReplicaState],
    ) -> Endpoint:
        """The replica to count on; `serving` is not empty."""

        def rank(e: Endpoint) -> tuple[bool, bool, bool, int, int]:
            name = e.name
            busy, last = self.busy(name), self.last(name)
            r = replicas.get(name)
            if r is None:  # not in the core yet: no turns there
                return name in down, False, False, busy, last
            limit = r.limit
            full = limit is not None and r.in_flight >= limit
            ejected = r.ejected_until is not None
            return name in down, ejected, full, r.in_flight + busy, last

        return min(serving, key=rank)


class _NotRunning(Exception):
    """A request reached the app between shutdown and its last answer."""


class _Gateway(FastAPI):
    """FastAPI with one shortcut: the paths of turns (`POST /v1/chat/completions`,
    `/v1/responses`, `/v1/messages`) go straight to their handlers, past FastAPI's middleware,
    routing and dependency layers (about a sixth of the gateway's CPU per turn in a
    profile).  The handlers stay registered as routes too, so everything else about
    them is unchanged."""

    hot_paths: dict[str, Callable[[Request], Awaitable[Response]]] = {}  # noqa: RUF012

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.hot_paths.get(scope["path"]) if scope["type"] == "http" else None
        if handler is not None and scope["method"] == "POST":
            try:
                response = await handler(Request(scope, receive))
            except ClientDisconnect:  # left while sending its request: nobody to answer
                return
            except _NotRunning as exc:
                response = _failed(scope, 503, str(exc))
            except Exception:  # past FastAPI's handlers: answer as they would, in JSON
                log.exception("turn handler failed")
                response = _failed(scope, 500, "internal error in the gateway (logged)")
            try:
                await response(scope, receive, send)
            except Exception:
                # The turn itself runs here (admission, the engine's answer): a fault
                # before the engine's head is answered as the handler's is, in JSON
                # and with the turn's own run id (a retry naming it keeps its run), not
                # by uvicorn's plain-text 500 (helper-181, helper-183).  After it, the
                # connection closes: the client sees the answer cut.  (Known from the
                # turn, not by wrapping `send`: no extra call per streamed chunk.)
                if not isinstance(response, TurnResponse) or response.started:
                    raise
                log.exception("turn failed before its answer began")
                message = "internal error in the gateway (logged)"
                await response.turn.error(500, message)(scope, receive, send)
            return
        if scope["type"] == "http" and scope["path"] == MCP_PATH:
            # `/mcp` is the door's URL; the mount would answer it with a 307 to `/mcp/`,
            # which some MCP clients do not follow.
            scope = {**scope, "path": MCP_PATH + "/", "raw_path": (MCP_PATH + "/").encode()}
        await super().__call__(scope, receive, send)


_SERVED = (
    f"POST {CHAT_PATH}, POST {RESPONSES_PATH}, POST {MESSAGES_PATH} (Anthropic), "
    f"POST {COUNT_TOKENS_PATH}, "
    "GET /v1/models and /v1/models/{model}, POST /v1/decide, GET /v1/runs, "
    "GET and DELETE /v1/runs/{run id}"
)


def _model_object(model: str) -> dict[str, Any]:
    """A model as GET /v1/models lists it (OpenAI's shape)."""
    return {"id": model, "object": "model", "created": 0, "owned_by": "luftpause"}


def _anthropic(path: str) -> bool:
    """A path of the Anthropic API (also under a base URL that repeats /v1): its errors
    come in its shape, and its token may come in x-api-key."""
    return path.startswith((MESSAGES_PATH, "/v1" + MESSAGES_PATH))


def _answered(span: Span, status: int) -> None:
    """A client span's HTTP status, and semconv's error.type for an error status: the
    status code (helper-169)."""
    span.set_attribute("http.response.status_code", status)
    if status >= 400:
        span.set_attribute("error.type", str(status))
        span.set_status(StatusCode.ERROR, f"answered {status}")


@dataclass(slots=True)
class _NoAnswer:
    """Told how an engine request that got no answer failed (an `Unanswered`), for the
    span: the last one told, the one the route's answer is about."""

    error: str = ""  # none told: the engine answered (or no request was made)
    message: str = ""

    def __call__(self, error: str, message: str) -> None:
        self.error, self.message = error, message


def _unanswered(span: Span, error: str, message: str) -> None:
    """A client span whose engine answered nothing: semconv's error.type is then the
    failure's name (`Unanswered`), and there is no status code (helper-200: a refused
    connection read as the engine's 502)."""
    span.set_attribute("error.type", error)
    span.set_status(StatusCode.ERROR, message)


def _failed(scope: Scope, status: int, message: str) -> Response:
    """A turn that failed in the gateway itself, in its API's error shape."""
    return error_response(status, message, _named_run(scope), anthropic=_anthropic(scope["path"]))


@dataclass(frozen=True, slots=True)
class Who:
    """Who a request's token says it is from."""

    # The caller whose own token (`[[callers]]`) it sent; None: the operator's token
    # (or none is set), whose requests name their caller in the header.
    tenant: str | None = None


OPERATOR = Who()


def owns(shell: AdmissionShell, run_id: str, caller: str) -> bool:
    """Whether the run the core knows by `run_id` is `caller`'s (a run known by its
    held turns only: theirs, when they are all that caller's)."""
    return shell.callers_of(run_id) == {caller}


def anothers(shell: AdmissionShell, run_id: str, caller: str) -> bool:
    """Whether the core knows `run_id` as a run of a caller other than `caller` (by
    its last caller, or by held turns of another)."""
    return bool(shell.callers_of(run_id) - {caller})


def not_known(run_id: str) -> str:
    return (
        f"run '{run_id}' is not known: never seen, ended, idle longer than "
        "idle_run_expiry_s, or from before the gateway's last start"
    )


class _BadRequest(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


def _cap_sessions_per_caller(manager: StreamableHTTPSessionManager, limit: int) -> None:
    """At most `limit` open MCP sessions per caller with a token of its own.

    The SDK caps sessions for all principals together (10,000, each closed after 30 min
    idle): one caller opening sessions without closing them filled the cap, and then
    every session-based client (Claude Code, Codex) was refused until they expired.
    Now such a caller is refused its own next session (503), and the others are not.
    The operator's token, shared by whoever holds it, has the SDK's cap alone."""
    admit = manager._admit_session
    owners = manager._session_owners

    def admit_within(requestor: Any) -> Any:
        caller = str(requestor.get("client_id", "")) if requestor is not None else ""
        if caller.startswith("caller:") and sum(o == requestor for o in owners.values()) >= limit:
            log.warning("refusing an MCP session to %s: it has %d open (its most)", caller, limit)
            return None
        return admit(requestor)

    manager._admit_session = admit_within  # type: ignore[method-assign]


def create_app(settings: GatewaySettings) -> FastAPI:
    """Build the gateway; nothing runs until the app's lifespan starts."""
    config = settings.config  # as at start: what a reload does not change
    live = _Live(Pool.of(config))  # discovered endpoints: none until resolved at start
    resolver = Resolver()
    run_spans = RunSpans()  # a proxied run's invoke_agent span, with tracing on
    runtime: _Runtime | None = None

    def drain() -> None:
        """The server began to stop (SIGTERM): the turns it holds are answered 503 now,
        while the turns in flight finish within the shutdown's grace (`luftpause
        gateway` calls this; see AdmissionShell.drain)."""
        door.stopping = True  # the door's calls cut from now on are the gateway's
        if runtime is None:
            return
        held = runtime.shell.drain(runtime.loop.time(), SHUTTING_DOWN)
        log.info("shutting down: %d held turns answered 503; the turns in flight go on", held)

    def seen() -> tuple[State, dict[str, ProbeResult]] | None:
        return (runtime.shell.state, runtime.prober.last) if runtime is not None else None

    metrics = GatewayMetrics(seen, live.awaited, lambda: live.pool.found)
    # The settings' policy (tests, benches) or the file's [policy] section.
    policy = settings.policy or config.policy.to_policy()
    if config.callers and settings.token is None:
        raise ConfigError(
            "callers: callers' tokens need the operator's token as well (token, or "
            "LUFTPAUSE_TOKEN); without one, every request would be let in"
        )
    # A caller's own token -> its name (`[[callers]]`), read once: a restart rotates them.
    tenants = config.caller_tokens(os.environ, settings.token)
    config.temporal.connect_options(os.environ)  # its TLS files and API key, or ConfigError
    door = _Door(config, settings.token)
    door_server = create_mcp_server(door.deps(live, lambda: runtime))
    door_app = door_server.streamable_http_app(streamable_http_path="/", host=settings.host)
    _cap_sessions_per_caller(door_server.session_manager, MCP_SESSIONS_PER_CALLER)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal runtime
        loop = asyncio.get_running_loop()
        for line in (*config.unset_keys(os.environ), *config.shared_urls()):
            log.warning("%s", line)
        if settings.token is None:
            log.warning(
                "no token is set (config token, LUFTPAUSE_TOKEN): "
                "/v1/*, /mcp and /status are open to all"
            )
        timeout = httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)
        # trust_env=False: probes go where turns go (Upstream uses no HTTP(S)_PROXY).
        # (Keepalive, as the turns' own connections: /v1/decide's and count_tokens'
        # requests go through this client.)
        transport = httpx.AsyncHTTPTransport(limits=_UPSTREAM_LIMITS, socket_options=KEEPALIVE)
        async with httpx.AsyncClient(
            timeout=timeout, transport=transport, trust_env=False
        ) as client:

            def observe(before: State, event: Event, actions: Sequence[Action]) -> None:
                for action in actions:  # a run the core forgot: its span ends
                    if isinstance(action, Forget):
                        run_spans.forgotten(action.run_id, expired=action.expired)
                metrics.observe(before, event, actions)
                after = shell.state.replicas
                # Replicas the core forgot (they left the pool and are done): a pool
                # change may forget one it retires at once, and add another.
                if len(after) < len(before.replicas) or isinstance(event, PoolChanged):
                    for name in set(before.replicas.keys()) - set(after.keys()):
                        metrics.forget_replica(name)

            # Discovered endpoints' engines first: the core starts with them.
            live.replace(await discovered(config, {}), lambda name: False)
            serving = live.pool.config
            shell = AdmissionShell(
                State.initial(serving.replica_specs(), policy),
                observer=observe,
                why_down=lambda name: _why_down(prober, name),
            )

            def report(results: list[ProbeResult]) -> None:
                now = loop.time()
                for r in results:
                    if r.endpoint in live.pool.replicas:
                        shell.apply(r.event(now))

            prober = Prober(serving, client, report, period=settings.probe_period)
            await prober.probe_once()  # serve only with a first view of the pool
            prober.start()
            ticks = loop.create_task(_tick(shell, loop), name="scheduler-tick")
            rediscover = loop.create_task(discover_again(), name="discovery")
            upstream = Upstream(connect_timeout=CONNECT_TIMEOUT_S)
            runtime = _Runtime(
                shell=shell, client=client, upstream=upstream, loop=loop, prober=prober,
                refused=metrics.refused,
            )  # fmt: skip
            app.state.shell = shell  # read-only view for tests
            app.state.drain = drain
            hangup = _on_hangup(loop, reload_on_signal)
            core = core_build()
            # Stale: compiled before its source last changed (`make core` rebuilds it).
            (log.warning if core.endswith("stale") else log.info)("scheduler core: %s", core)
            if settings.freeze_heap:
                log.info("%s", freeze_heap())
            try:
                async with door_server.session_manager.run():
                    try:
                        yield
                    finally:
                        # The calls the session manager cancels as it exits are the
                        # gateway's doing, not their clients' (a run call's run goes on).
                        door.stopping = True
                # What they began in the background (a cut call's run to cancel).
                await door_server.background.settle(BACKGROUND_SETTLE_S)
            finally:
                hangup()
                runtime = None
                upstream.close()
                await door.aclose()
                run_spans.close()
                # Blocks the loop (≤ 5 s), but the loop has nothing left to serve.
                telemetry.flush()
                for task in (rediscover, ticks):  # (rediscover before the prober it uses)
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                await prober.stop()

    # FastAPI's own telemetry off: with a tracer provider set it would trace every
    # other request as an HTTP span, `url.query` included, and the status page takes
    # the operator's token as `?token=` (helper-68); the gateway's spans are its own
    # (chat, admit, invoke_agent), and /metrics is Prometheus.
    # No /docs, /redoc or /openapi.json: they answered without a token (README lists
    # what is open), and Swagger UI loads scripts from a CDN into the gateway's origin.
    app = _Gateway(
        title="luftpause gateway",
        lifespan=lifespan,
        telemetry={"tracing": False, "metrics": False, "logs": False},
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )

    def identify(
        request: Request | Scope, *, api_key: bool = False, query: str | None = None
    ) -> Who | None:
        """Who the credentials say the request is from, or None (401): the bearer
        token, or with `api_key` (the Anthropic API's routes) the same in `x-api-key`,
        where Claude Code sends ANTHROPIC_API_KEY, or `query` (the status page's
        `?token=`, which a browser can send).  The operator's token (or none set: open
        access) names no caller; a caller's own token names that caller."""
        if settings.token is None:
            return OPERATOR
        tenant = None  # (the operator's token wins, wherever it is given)
        for value in _tokens(request, api_key=api_key, query=query):
            sent = value.encode("latin-1", errors="replace")
            if hmac.compare_digest(sent, settings.token.encode()):
                return OPERATOR
            # Every caller's token is compared, so the time taken tells nothing.
            found = [n for t, n in tenants.items() if hmac.compare_digest(sent, t.encode())]
            if found and tenant is None:
                tenant = found[0]
        return Who(tenant=tenant) if tenant is not None else None

    def authorized(request: Request, *, api_key: bool = False) -> bool:
        """Only the operator's token (or none set): /status, /, /reload."""
        return identify(request, api_key=api_key) == OPERATOR

    def unauthorized(
        request: Request | Scope,
        run_id: str,
        *,
        anthropic: bool = False,
        api_key: bool = False,
        query: str | None = None,
    ) -> Response:
        """The 401 for a request `identify` (given the same `api_key` and `query`) named
        no one from.  Its challenge says `invalid_token` when a token was sent where the
        route reads one, and no error when none was (RFC 6750 section 3.1)."""
        if anthropic:  # where Anthropic clients may send it
            answer = error_response(401, _NO_KEY, run_id, anthropic=True)
        else:
            answer = error_response(401, _NO_TOKEN, run_id)
        if any(_tokens(request, api_key=api_key, query=query)):
            answer.headers["www-authenticate"] = f'{BEARER_CHALLENGE}, error="invalid_token"'
        return answer

    def refused(
        request: Request,
        who: Who | None,
        run_id: str,
        *,
        anthropic: bool = False,
        query: str | None = None,
    ) -> Response:
        """401 for no (or a wrong) token; 403 for a caller's token where only the
        operator's is taken."""
        if who is None:
            return unauthorized(request, run_id, anthropic=anthropic, query=query)
        message = (
            f"this token is caller '{who.tenant}''s, which may not use this route; "
            "it takes the operator's token"
        )
        return error_response(403, message, run_id, anthropic=anthropic)

    def caller_of(request: Request, who: Who) -> str:
        """The caller a request is from: a caller's token says it; else the header."""
        return who.tenant if who.tenant is not None else _caller(request)

    def other_caller(request: Request, who: Who) -> str | None:
        """Why a caller's request may not go on: its header names another caller."""
        named = request.headers.get(CALLER_HEADER)
        if who.tenant is None or not named or caller_name(named) == who.tenant:
            return None
        return (
            f"{CALLER_HEADER} says '{caller_name(named)}', but this token is caller "
            f"'{who.tenant}''s: leave the header out, or name that caller"
        )

    async def mcp_gate(scope: Scope, receive: Receive, send: Send) -> None:
        """`/mcp` takes the same bearer tokens as `/v1/*`.  A caller's token makes the
        request that caller's: the door reads it from TENANT_HEADER, which only the gate
        sets (a client's own is dropped)."""
        if scope["type"] != "http":
            await door_app(scope, receive, send)
            return
        who = identify(scope)
        if who is None:
            await unauthorized(scope, "")(scope, receive, send)
            return
        request = Request(scope)
        if (why := other_caller(request, who)) is not None:
            await error_response(403, why, "")(scope, receive, send)
            return
        tenant = TENANT_HEADER.encode()
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != tenant]
        if who.tenant is not None:
            caller = CALLER_HEADER.lower().encode()
            headers = [(k, v) for k, v in headers if k.lower() != caller]
            name = who.tenant.encode()
            headers += [(tenant, name), (caller, name)]
        # The SDK binds a session to the principal that opened it, and answers 404
        # to the same session id sent with another caller's token.
        principal = "operator" if who.tenant is None else f"caller:{who.tenant}"
        user = AuthenticatedUser(AccessToken(token="", client_id=principal, scopes=[]))
        await door_app({**scope, "headers": headers, "user": user}, receive, send)

    app.mount(MCP_PATH, mcp_gate)

    def running() -> _Runtime:
        if runtime is None:  # only between shutdown and the last request
            raise _NotRunning("the gateway is shutting down")
        return runtime

    @app.exception_handler(_NotRunning)
    async def not_running(request: Request, exc: _NotRunning) -> Response:
        if not request.url.path.startswith("/v1/"):
            return error_response(503, str(exc), "")
        in_path = str(request.path_params.get("run_id", ""))  # DELETE /v1/runs/{run_id}
        run = in_path if RUN_ID.fullmatch(in_path) else _named_run(request.scope)
        return error_response(503, str(exc), run, anthropic=_anthropic(request.url.path))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        """A bug: the error body every other answer uses, not a text/plain 500 (its
        traceback is logged after, by the server; helper-143)."""
        path = request.url.path
        run = _named_run(request.scope) if path.startswith("/v1/") else ""
        message = f"internal error in the gateway ({type(exc).__name__}; its log has more)"
        return error_response(500, message, run, anthropic=_anthropic(path))

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, exc: ClientDisconnect) -> Response:
        """A client that left while sending its request: nobody to answer, nothing to
        log (the turn paths' shortcut does the same)."""
        return Response(status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """Paths and methods no route serves (outside /v1, e.g. POST /status): the
        error body every other answer uses, not FastAPI's `{"detail": ...}`."""
        message = (
            f"luftpause does not serve {request.method} {request.url.path}; it serves "
            f"{_SERVED}, /mcp, GET /status, GET /, GET /metrics, GET /health and POST /reload"
            if exc.status_code in (404, 405)
            else str(exc.detail)
        )
        response = error_response(exc.status_code, message, "")
        response.headers.update(exc.headers or {})
        return response

    async def discovered(file: Config, before: Mapping[str, Found]) -> Pool:
        """The pool of `file` with its discovered endpoints' names resolved now."""
        found = await resolver.resolve_all(file.discovered, file.discovery, before)
        return Pool.of(file, found)

    reloaded = asyncio.Event()  # a reload resolved the names: discovery's period restarts

    async def reload_pool() -> PoolChange:
        """Read the file again and serve its endpoints (gateway/pool.py says what may
        change).  Raises ConfigError, and changes nothing, when it cannot."""
        path = settings.config_path
        if path is None:
            raise ConfigError(
                "the gateway was not started from a configuration file: nothing to reload"
            )
        async with live.reloading:
            new = await asyncio.to_thread(load_config, path, os.environ)
            pool = await discovered(new, live.pool.found)
            old = live.pool.file
            before = {*old.unset_keys(os.environ), *old.shared_urls()}
            change = await serve(pool)
        reloaded.set()  # the next discovery round a period from now, at its period
        log.info("reloaded %s: %s", path, change)
        # As at start, for what the reload brought.
        for line in (*new.unset_keys(os.environ), *new.shared_urls()):
            if line not in before:
                log.warning("%s", line)
        return change

    async def discover_again() -> None:
        """Every [discovery] period_s: serve what the discovered endpoints' names resolve
        to now, when it changed (gateway/discovery.py).  A reload (which resolves at
        once) starts the period anew, at its own period_s."""
        while True:
            while True:
                reloaded.clear()
                try:
                    async with asyncio.timeout(live.pool.file.discovery.period_s):
                        await reloaded.wait()
                except TimeoutError:
                    break
            try:
                async with live.reloading:
                    file = live.pool.file
                    if not file.discovered:
                        continue
                    pool = await discovered(file, live.pool.found)
                    if pool.config == live.pool.config:
                        live.pool = pool  # the same engines: only what /status shows
                        continue
                    change = await serve(pool)
                # Only what the round changed: a start-only section a reload changed
                # is said by that reload, not again at every round.
                log.info("discovery: %s", dataclasses.replace(change, not_applied=()))
            except (ConfigError, _NotRunning) as exc:
                log.error("discovery: %s", exc)
            except Exception:  # the loop outlives a failed round: the next may succeed
                log.exception("discovery failed; the next round comes in a period")

    async def serve(pool: Pool) -> PoolChange:
        """Serve `pool` instead of the current one (under `live.reloading`).  Raises
        ConfigError, and changes nothing, when an endpoint would change its engine."""
        rt = running()
        new = pool.config
        live.forget(lambda name: name in rt.shell.state.replicas)
        change = compare(live.pool.config, new, live.known, started=config)
        # From here to the probe nothing awaits: no request sees half of it.  The core
        # first (what it admits next is looked up in `live`), then the prober.
        if "policy" in change.applied:  # first: the new pool is filled under it
            rt.shell.apply(PolicyChanged(now=rt.loop.time(), policy=new.policy.to_policy()))
        unknown = slots_unknown(live.pool.config, new)
        live.pool = pool  # first: the turns the core refuses now are counted by it
        rt.shell.apply(
            PoolChanged(
                now=rt.loop.time(), replicas=tuple(new.replica_specs()), slots_unknown=unknown
            )
        )
        live.replace(pool, lambda name: name in rt.shell.state.replicas)
        rt.prober.reconfigure(new)
        # Replicas that joined are out of rotation until probed: probe now, so that they
        # take turns as soon as they answer, and the answer says so.
        await rt.prober.next_round()
        return change

    async def reload_on_signal() -> None:
        try:
            await reload_pool()
        except (ConfigError, _NotRunning) as exc:
            log.error("reload on SIGHUP: %s", exc)
        except Exception:  # a task's error would otherwise be reported at exit only
            log.exception("reload on SIGHUP failed")

    async def take_turn(request: Request, api: Api) -> Response:
        """A turn of any API: identify its run, parse it, hold it, forward it."""
        rt = running()
        anthropic = api == "messages"
        header_run = request.headers.get(RUN_HEADER, "").strip()
        # As DELETE /v1/runs/{id} takes it (and it is echoed in a response header).
        bad_run = bool(header_run) and not RUN_ID.fullmatch(header_run)
        fallback_run = header_run if header_run and not bad_run else _new_id()
        who = identify(request, api_key=anthropic)
        if who is None:
            return unauthorized(request, fallback_run, anthropic=anthropic, api_key=anthropic)
        if (why := other_caller(request, who)) is not None:
            return error_response(403, why, fallback_run, anthropic=anthropic)
        if bad_run:
            message = f"{RUN_HEADER}: {RUN_ID_SHAPE}"
            return error_response(400, message, fallback_run, anthropic=anthropic)
        if (coded := _coded(request)) is not None:
            return error_response(415, coded, fallback_run, anthropic=anthropic)
        raw = await _body(request, config.max_request_bytes)
        if raw is None:
            return _too_large(config.max_request_bytes, fallback_run, anthropic=anthropic)
        pool = live.pool
        try:
            body = _parse_body(raw)
            if api == "chat":
                model, messages = _parse_chat(body)
            elif anthropic:
                model, messages = _parse_messages(body, pool.lacking["messages"])
            else:
                model, messages = _parse_responses(body, pool.lacking["responses"])
            service_class = _parse_class(request.headers.get(CLASS_HEADER))
        except _BadRequest as exc:
            return error_response(exc.status, exc.message, fallback_run, anthropic=anthropic)
        # (A model whose engines, found by name, are all gone goes on to the core, which
        # refuses it as one not served, answered 503 to be retried (`as_answered`): as
        # a turn, in its run's trace and metrics; helper-169, -170.)
        now = rt.loop.time()
        caller = caller_of(request, who)
        run_id: str | None = header_run
        joined_by = "header"
        aside = False  # a harness's request outside its session's run: a run of its own
        if not run_id and pool.file.session_runs:
            run_id = session_run(request.headers.get)
            joined_by = "session"
            aside = outside_the_run(request.headers.get)
        if not run_id:
            if not aside:
                echoed = _ECHOED[api](messages)
                run_id = rt.shell.run_for_tool_calls(caller, echoed, now)
            joined_by = "tool_calls" if run_id else "new"
        previous = body.get("previous_response_id") if api == "responses" else None
        if not run_id and not aside and isinstance(previous, str):
            # A chain by the id of the run's last answer (the Agents SDK's, and any
            # Responses client that lets the server keep the conversation): the engine
            # that stored it is the run's (helper-140: a new run went anywhere, to an
            # engine that answered 404 for the id).
            run_id = rt.shell.run_for_tool_calls(caller, [response_key(previous)], now)
            joined_by = "previous_response" if run_id else "new"
        if run_id and who.tenant is not None and anothers(rt.shell, run_id, caller):
            # A caller's token may not join (and so take over) another caller's run.
            # Nothing awaits from here to the arrival (TurnResponse -> hold ->
            # shell.arrive), so of two callers naming one new run id, one starts it.
            # 403, as other_caller's refusal: SDKs retry a 409, and this never changes.
            how = {
                "header": f"named by {RUN_HEADER}",
                "session": "named by the session header",
                "tool_calls": "found by the tool call ids this request echoes",
                "previous_response": "found by its previous_response_id",
            }[joined_by]
            message = (
                f"run '{run_id}' ({how}) is another caller's; a caller's token joins "
                f"only its own runs: send {RUN_HEADER} with a run id of your own"
            )
            return error_response(403, message, run_id, anthropic=anthropic)
        metrics.turn_runs.labels(joined_by).inc()
        turn = TurnRequest(
            turn_id=_new_id(),
            run_id=run_id or fallback_run,
            service_class=service_class,
            caller=caller,
            model=model,
            body=raw,
            usage_body=_with_stream_usage(raw, body) if api == "chat" else None,
            usage_by_default=api == "chat" and _usage_by_default(body),
            content_type=_json_content_type(request.headers.get("content-type")),
            accept=request.headers.get("accept"),
            prompt_tokens=_prompt_tokens(raw),
            max_tokens=_max_tokens(body),
            # Not a sample of the model's scale: a chained Responses turn's body is not
            # its whole prompt, and media are counted at a guess or not at all
            # (helper-117, helper-118).
            learnable=not ((api == "responses" and _chained(body)) or _has_media(raw)),
            # Calls written as text are recovered on Chat Completions only (engines that
            # serve the newer APIs parse tool calls themselves).
            tools=_tool_names(body) if api == "chat" else frozenset(),
            api=api,
            stream=body.get("stream") is True,
        )
        return TurnResponse(
            turn,
            shell=rt.shell,
            upstream=rt.upstream,
            endpoints=live.known,
            clock=rt.loop.time,
            answered_by=pool.answered_by,
            retry_after=rt.prober.retry_after,
            runs=run_spans,
            awaited=live.awaited,
        )

    @app.post(CHAT_PATH)
    async def chat_completions(request: Request) -> Response:
        return await take_turn(request, "chat")

    @app.post(MESSAGES_PATH)
    async def messages_turn(request: Request) -> Response:
        return await take_turn(request, "messages")

    @app.post(RESPONSES_PATH)
    async def responses_turn(request: Request) -> Response:
        return await take_turn(request, "responses")

    app.hot_paths = {
        CHAT_PATH: chat_completions,
        MESSAGES_PATH: messages_turn,
        RESPONSES_PATH: responses_turn,
    }

    @app.post(COUNT_TOKENS_PATH)
    async def count_tokens(request: Request) -> Response:
        """Claude Code's token count, passed to a healthy replica of the model as it is
        (no turn: nothing is generated), spread over them by `_CountLoad`.  An engine
        without the route answers 404, which Claude Code takes as "not supported"."""
        rt = running()
        run_id = ""  # no turn, no run: its answers carry no run id
        if identify(request, api_key=True) is None:
            return unauthorized(request, run_id, anthropic=True, api_key=True)
        if (coded := _coded(request)) is not None:
            return error_response(415, coded, run_id, anthropic=True)
        raw = await _body(request, config.max_request_bytes)
        if raw is None:
            return _too_large(config.max_request_bytes, run_id, anthropic=True)
        pool = live.pool
        try:
            model, _ = _parse_messages(_parse_body(raw), pool.lacking["messages"], count=True)
        except _BadRequest as exc:
            return error_response(exc.status, exc.message, run_id, anthropic=True)
        serving = [e for e in pool.replicas.values() if model in e.models]
        if (awaited := pool.awaited(model)) is not None:
            return error_response(
                503, awaited.message, run_id, anthropic=True, retry_after=awaited.retry_after
            )
        if not serving:
            return error_response(404, unknown_model(model, pool.models), run_id, anthropic=True)
        down = _down(rt.prober)
        if all(e.name in down for e in serving):  # as a turn is answered: 503, not 502
            names = sorted(e.name for e in serving)
            said = [f"{n}: {why}" for n in names if (why := _why_down(rt.prober, n))]
            message = (
                f"no healthy replica serves model '{model}' "
                f"(unhealthy at their last probe: {', '.join(names)})"
                + "".join(f"; {s}" for s in said)
            )
            return error_response(
                503, message, run_id, anthropic=True, retry_after=rt.prober.retry_after
            )
        counts = live.count_load
        target = counts.target(serving, down, rt.shell.state.replicas)
        # The client's header values as it sent them (the server decoded them as
        # latin-1; httpx would encode a str as ASCII and fail on anything else).
        sent = request.headers
        headers = {
            b"content-type": _json_content_type(sent.get("content-type")).encode("latin-1"),
            b"user-agent": b"luftpause-gateway",
        }
        # As a turn's: the API's headers, and the request ids (engine logs match them).
        for k in (*_ANTHROPIC_HEADERS, "x-request-id", "x-correlation-id"):
            if (v := sent.get(k)) is not None:
                headers[k.encode()] = v.encode("latin-1")
        for k, v in auth_headers(target, anthropic=True).items():
            headers[k.encode()] = v.encode()
        # The caller's trace context, as a turn's: with tracing on, a span of its own in
        # the caller's trace that the engine continues; else the caller's, as it came
        # (helper-181: the engine got none).
        carrier = {k: v for k in ("traceparent", "tracestate") if (v := sent.get(k))}
        tracer = telemetry.tracer()
        span = None
        if tracer is not None:
            span = tracer.start_span(
                f"count_tokens {model}",
                telemetry.extract(carrier) if carrier else None,
                kind=SpanKind.CLIENT,
                attributes={"gen_ai.request.model": model, "luftpause.replica": target.name},
            )
            carrier = {}
            telemetry.inject(carrier, set_span_in_context(span))
        for k, v in carrier.items():
            headers[k.encode()] = v.encode("latin-1")
        reply: Response | None = None
        left = False
        failed = _NoAnswer()
        try:
            with counts.using(target.name):
                reply = await _count_tokens(rt, target, request, raw, headers, run_id, failed)
        except ClientLeft:
            # (httpx closes the connection of a request cancelled before its answer.)
            left = True
            message = "client disconnected before the engine answered"
            reply = error_response(CLIENT_LEFT, message, run_id, anthropic=True)
        finally:
            if span is not None:
                if left:
                    # The engine answered nothing: named as a turn's (helper-194).
                    _unanswered(span, "client_left", "client disconnected")
                elif failed.error:
                    _unanswered(span, failed.error, failed.message)
                else:
                    _answered(span, reply.status_code if reply is not None else 500)
                span.end()
        return reply

    async def _count_tokens(
        rt: _Runtime,
        target: Endpoint,
        request: Request,
        raw: bytes,
        headers: dict[bytes, bytes],
        run_id: str,
        unanswered: Unanswered,
    ) -> Response:
        """The engine's count, as it answered (or why it did not: `unanswered` is told
        of a request that got no answer).  A client that leaves meanwhile is watched for
        as a turn's (`CancelOnLeave`): the engine's request is closed then, not kept open
        up to the turn timeout for nobody (ClientLeft)."""
        query = request.scope.get("query_string", b"").decode("latin-1")
        disconnected = asyncio.ensure_future(wait_disconnect(request.receive))
        try:
            with CancelOnLeave(disconnected, lambda: False):
                answer = await rt.client.post(
                    target.api_url("messages") + "/count_tokens" + (f"?{query}" if query else ""),
                    content=raw,
                    headers=headers,
                    timeout=httpx.Timeout(
                        rt.shell.state.policy.turn_timeout_s, connect=CONNECT_TIMEOUT_S
                    ),
                )
        except httpx.HTTPError as exc:
            detail = str(exc) or (
                "no answer in time" if isinstance(exc, httpx.TimeoutException) else "failed"
            )
            message = f"engine {target.name}: {type(exc).__name__}: {detail}"
            unanswered(type(exc).__name__, message)
            return error_response(502, message, run_id, anthropic=True)
        finally:
            disconnected.cancel()
        why = no_answer_of(answer)
        if why is not None:
            return error_response(502, f"engine {target.name}: {why}", run_id, anthropic=True)
        if answer.status_code == 401:  # to luftpause's own key, as a turn's (helper-137)
            message = credentials_refused(target.name, answer.text)
            return error_response(502, message, run_id, anthropic=True)
        # The engine's headers as a turn's answer gets them (request-id, rate limits),
        # but its content-encoding: httpx has decoded the body.
        reply = Response(answer.content, answer.status_code)  # sets content-length only
        engine_headers = [(k.lower(), v) for k, v in answer.headers.raw]
        drop = dropped_upstream(engine_headers) | {b"content-encoding"}
        reply.raw_headers += [(k, v) for k, v in engine_headers if k not in drop]
        return reply

    @app.post("/v1/decide")
    async def decide_label(request: Request) -> Response:
        rt = running()
        run_id = _new_id()
        who = identify(request)
        if who is None:
            return unauthorized(request, run_id)
        if (why := other_caller(request, who)) is not None:
            return error_response(403, why, run_id)
        if (coded := _coded(request)) is not None:
            return error_response(415, coded, run_id)
        raw = await _body(request, config.max_request_bytes)
        if raw is None:
            return _too_large(config.max_request_bytes, run_id)
        try:
            parsed = parse_decide(raw)
            # A batch classification flood waits as batch work does (helper-115: every
            # decide turn was interactive, ahead of earlier batch turns).
            service_class = _parse_class(request.headers.get(CLASS_HEADER))
        except DecideError as exc:
            return error_response(exc.status, exc.message, run_id)
        except _BadRequest as exc:
            return error_response(exc.status, exc.message, run_id)
        failed = _NoAnswer()
        answering = _decide(
            rt,
            live,
            parsed,
            run_id,
            caller_of(request, who),
            request.receive,
            service_class,
            failed,
        )
        tracer = telemetry.tracer()
        carrier = {k: v for k in ("traceparent", "tracestate") if (v := request.headers.get(k))}
        if tracer is None:
            if not carrier:
                return await answering
            # No span of its own: the caller's trace context goes on to the engine as a
            # proxied turn's does (helper-146: decide's turns sent none).
            token = otel_context.attach(telemetry.extract(carrier))
            try:
                return await answering
            finally:
                otel_context.detach(token)
        # A span the engine's request continues (its traceparent), in the caller's trace.
        with tracer.start_as_current_span(
            "decide",  # named for its model once answered (span names stay few)
            telemetry.extract(carrier) if carrier else None,
            kind=SpanKind.CLIENT,
            attributes={
                "luftpause.run_id": run_id,
                "luftpause.labels": len(parsed.labels or []),
                # (named for it only once answered: helper-148, a refusal lost it)
                **({"gen_ai.request.model": parsed.model} if parsed.model else {}),
            },
        ) as span:
            response = await answering
            if failed.error:
                _unanswered(span, failed.error, failed.message)
            else:
                _answered(span, response.status_code)
            if response.status_code < 400 and parsed.model is not None:
                span.update_name(f"decide {parsed.model}")
            return response

    @app.delete("/v1/runs/{run_id}")
    async def end_run(request: Request, run_id: str) -> Response:
        rt = running()
        who = identify(request)
        if who is None:
            return unauthorized(request, run_id if RUN_ID.fullmatch(run_id) else "")
        if not RUN_ID.fullmatch(run_id):
            # It goes back in a response header: printable ASCII only, or no echo.
            return error_response(400, _BAD_RUN_ID, "")
        if who.tenant is not None and not owns(rt.shell, run_id, who.tenant):
            return error_response(404, not_known(run_id), run_id)
        rt.shell.apply(RunEnded(now=rt.loop.time(), run_id=run_id))
        return Response(status_code=204, headers={RUN_HEADER: run_id})

    @app.get("/v1/runs")
    async def list_runs(request: Request) -> Response:
        """The runs luftpause knows, most recently active first (GET /v1/runs?caller=
        &phase=&class=&limit=): how a harness's user finds its session's run."""
        rt = running()
        who = identify(request)
        if who is None:
            return unauthorized(request, "")
        query = request.query_params
        unknown = sorted(set(query) - {"caller", "phase", "class", "limit"})
        phases = [p.value for p in RunPhase] + [WAITING]
        phase = query.get("phase")
        limit = query.get("limit", str(RUNS_LIMIT))
        if unknown:
            message = (
                f"unknown query parameter {unknown[0]!r}: expected caller, phase, class, limit"
            )
            return error_response(400, message, "")
        if phase is not None and phase not in phases:
            return error_response(400, f"phase: expected one of {', '.join(phases)}", "")
        if not (_decimal(limit) and 1 <= int(limit) <= RUNS_MAX):
            return error_response(400, f"limit: expected an integer from 1 to {RUNS_MAX}", "")
        try:
            # (Blank is refused, as `phase=` is; a blank header is an absent one.)
            cls = _parse_class(query["class"], blank=None) if "class" in query else None
        except _BadRequest as exc:
            return error_response(400, exc.message.replace(CLASS_HEADER, "class"), "")
        caller = query.get("caller")
        if who.tenant is not None:  # a caller's token lists that caller's runs only
            if caller is not None and caller_text(caller) != who.tenant:
                message = f"caller: this token is caller '{who.tenant}''s; it lists only its runs"
                return error_response(403, message, "")
            caller = who.tenant
        listing = await asyncio.to_thread(
            runs_listing,
            rt.shell.state,
            rt.loop.time(),
            caller=caller_text(caller) if caller is not None else None,
            phase=phase,
            service_class=cls,
            limit=int(limit),
        )
        return Response(json.dumps(listing), media_type="application/json")

    @app.get("/v1/runs/{run_id}")
    async def one_run(request: Request, run_id: str) -> Response:
        rt = running()
        who = identify(request)
        if who is None:
            return unauthorized(request, run_id if RUN_ID.fullmatch(run_id) else "")
        if not RUN_ID.fullmatch(run_id):
            return error_response(400, _BAD_RUN_ID, "")
        state, now = rt.shell.state, rt.loop.time()
        held = state.held_of(run_id)
        run = state.runs.get(run_id)
        mine = who.tenant is None or owns(rt.shell, run_id, who.tenant)
        if (run is None and not held) or not mine:
            return error_response(404, not_known(run_id), run_id)
        view = (
            run_view(run, now, state.replicas, len(held), claims_of(state, run_id))
            if run is not None
            else waiting_view(held, now)
        )
        return Response(
            json.dumps(view), media_type="application/json", headers={RUN_HEADER: run_id}
        )

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        # (The Anthropic SDKs list and retrieve models here too, with x-api-key.)
        if identify(request, api_key=True) is None:
            return unauthorized(request, _echoed_run(request.scope), api_key=True)
        data = [_model_object(m) for m in live.pool.offered]
        return Response(json.dumps({"object": "list", "data": data}), media_type="application/json")

    # The OpenAI SDKs' models.retrieve (SGLang and vLLM serve it; helper-125 found it
    # answered as a path not served).  A model id may hold "/" (an org/name id).
    @app.get("/v1/models/{model:path}")
    async def one_model(request: Request, model: str) -> Response:
        run = _echoed_run(request.scope)
        if identify(request, api_key=True) is None:
            return unauthorized(request, run, api_key=True)
        if model not in live.pool.offered:
            return error_response(404, unknown_model(model, live.pool.offered), run)
        return Response(json.dumps(_model_object(model)), media_type="application/json")

    def sub_agents_here() -> bool:
        """Whether this gateway has sub-agents to show: MCP servers configured, or a
        sub-agent tool called since it started, Temporal reached or not (else nothing
        waits for Temporal)."""
        return bool(config.mcp_servers) or not door.idle()

    async def with_runs(view: dict[str, Any]) -> dict[str, Any]:
        """Add the recent sub-agent runs as trees (or why they cannot be read)."""
        if not sub_agents_here():
            return view
        try:
            statuses = await asyncio.wait_for(door.recent(), STATUS_RUNS_TIMEOUT_S)
            view["sub_agents"] = sub_agent_tree(statuses)
        except Exception as exc:  # Temporal down or slow: the page still answers
            view["sub_agents"] = f"runs unavailable: {type(exc).__name__}: {exc}"[:300]
        return view

    async def snapshot(rt: _Runtime, recent: int = 0) -> dict[str, Any]:
        """`recent`: also list that many runs, the most recently active first."""
        # The shell's own counts on the loop (its dicts change there) ...
        counts = {"tool_call_ids_remembered": rt.shell.remembered_tool_calls()}
        state, probes, now = rt.shell.state, dict(rt.prober.last), rt.loop.time()
        wall = time.time()  # the same moment as `now`, which the ages count back from
        found = live.pool.found

        def walk() -> dict[str, Any]:
            view = status_snapshot(state, probes, counts, now)
            view["time"] = wall  # when this was seen (UNIX seconds); ages are _s
            if found:  # what each discovered endpoint's name resolved to
                view["discovery"] = {name: f.as_json(wall) for name, f in found.items()}
            if recent:
                view["recent_runs"] = runs_listing(state, now, limit=recent)["runs"]
            return view

        # ... and the walk over every run and turn in a thread: the state is immutable,
        # and with 100k runs (an hour of requests without a run id) it takes ~130 ms
        # here, which the event loop would otherwise spend not serving turns.
        return await asyncio.to_thread(walk)

    @app.get("/status")
    async def status(request: Request) -> Response:
        rt = running()
        if not authorized(request):
            return refused(request, identify(request), "")
        view = await with_runs(await snapshot(rt))
        return Response(json.dumps(view), media_type="application/json")

    @app.get("/")
    async def status_page(request: Request) -> Response:
        rt = running()
        # A browser cannot send the bearer header: the page also takes `?token=` (and
        # keeps it across its own refreshes, which reload the same URL).  A caller's
        # own token there is refused as in the header (403), not taken for a wrong one.
        who = identify(request, query=request.query_params.get("token"))
        if who != OPERATOR:
            return refused(request, who, "", query=request.query_params.get("token"))
        return HTMLResponse(
            render_status_page(await with_runs(await snapshot(rt, recent=PAGE_RUNS))),
            headers={"cache-control": "no-store", "referrer-policy": "no-referrer"},
        )

    counted_at = -math.inf  # when /metrics last asked Temporal (the loop's clock)

    async def count_subagent_runs() -> None:
        """Refresh `luftpause_subagent_runs` when it is due: where sub-agents run, at
        most every SUBAGENT_COUNT_EVERY_S (the scrape then waits for it, at most
        STATUS_RUNS_TIMEOUT_S).  Temporal down or slow: `luftpause_run_store_up` is 0
        and the scrape still answers."""
        nonlocal counted_at
        if not sub_agents_here():
            return
        now = asyncio.get_running_loop().time()
        if now - counted_at < SUBAGENT_COUNT_EVERY_S:
            return
        counted_at = now
        counts: dict[str, int] | None
        workers: int | None
        try:
            counts, workers = await asyncio.wait_for(door.count_open(), STATUS_RUNS_TIMEOUT_S)
        except Exception as exc:
            log.warning("counting sub-agent runs: %s: %s", type(exc).__name__, exc)
            counts = workers = None
        metrics.subagent_runs.counts = counts
        metrics.subagent_runs.workers = workers
        metrics.subagent_runs.tried = True

    @app.get("/metrics")
    async def prometheus() -> Response:
        # Unauthenticated on purpose, like most exporters: Prometheus scrapers are
        # usually configured without credentials, and the metrics carry counts and
        # replica names only — no callers, run ids or prompts.
        await count_subagent_runs()
        # In a thread, as the status snapshot: the gauges walk the core's (immutable)
        # state, ~75 ms with 100k runs; the counters take their own locks.
        exposition = await asyncio.to_thread(metrics.exposition)
        return Response(exposition, media_type=CONTENT_TYPE_LATEST)

    @app.post("/reload")
    async def reload(request: Request) -> Response:
        """Serve the configuration file's endpoints as they are now (as SIGHUP does)."""
        if not authorized(request):
            return refused(request, identify(request), "")
        try:
            change = await reload_pool()
        except ConfigError as exc:
            return error_response(400, str(exc), "")
        return Response(json.dumps(change.as_json()), media_type="application/json")

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        return Response(json.dumps({"status": "ok"}), media_type="application/json")

    @app.api_route(
        "/v1/{rest:path}",
        methods=["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"],
        include_in_schema=False,
    )
    async def not_served(request: Request, rest: str) -> Response:
        """Any other path or method under /v1 (`/v1/completions`, `/v1/embeddings`, a GET
        of the chat path): an OpenAI-shaped error that says what is served."""
        path = request.url.path
        anthropic = _anthropic(path)
        run = _named_run(request.scope)  # echoed, as on every /v1 answer
        if identify(request, api_key=anthropic) is None:
            return unauthorized(request, run, anthropic=anthropic, api_key=anthropic)
        # (A run's path: /v1/runs/{run id}, one segment; /v1/runs/a/b is no path served,
        # nor /v1/runs/: its GET or DELETE came here, so a 405 naming them would be
        # untrue, helper-125.)
        run_id = path.removeprefix("/v1/runs/")
        one_run = path.startswith("/v1/runs/") and "/" not in run_id and run_id != ""
        one_model = path.startswith("/v1/models/") and path != "/v1/models/"
        allow = _ALLOWED.get(path) or ("GET, DELETE" if one_run else "GET" if one_model else None)
        message = f"luftpause does not serve {request.method} {path}; it serves {_SERVED}"
        if path.startswith("/v1/v1/"):
            message = (
                f"luftpause does not serve {request.method} {path}: the client adds /v1 "
                "itself, so its base URL is the gateway's root (an Anthropic client's, as "
                "ANTHROPIC_BASE_URL), without /v1"
            )
        if allow is None:
            return error_response(404, message, run, anthropic=anthropic)
        response = error_response(405, message, run, anthropic=anthropic)
        response.headers["allow"] = allow  # RFC 9110: a 405 says what the path takes
        return response

    return app


class _Door:
    """What the MCP door needs from this process: a Temporal client (connected on
    first use, so the proxy serves while Temporal is down), the upstream tool servers,
    and `/v1/decide` in-process."""

    def __init__(self, config: Config, token: str | None) -> None:
        self._config = config
        self._runs: Runs | None = None
        self._lock = asyncio.Lock()
        self._pool = McpPool(config.mcp_servers)
        self._token = token
        self.stopping = False  # the gateway began to stop
        self._asked = False  # something needed Temporal: reached or not

    def idle(self) -> bool:
        """Nothing has asked for Temporal yet.  A connect that failed counts as asked:
        the spawn it was for makes this a gateway where sub-agents run, whose
        `luftpause_run_store_up` is then 0, not left out."""
        return not self._asked

    async def recent(self, limit: int = STATUS_RUNS) -> list[Any]:
        """The most recent runs' statuses, newest first."""
        runs = await self.runs()
        handles = await runs.list(limit=limit)
        return await runs.statuses(handles, query_timeout=STATUS_QUERY_TIMEOUT_S)

    async def count_open(self) -> tuple[dict[str, int], int | None]:
        """The sub-agent runs open in Temporal, by state, and the workers that poll
        their task queue (None: Temporal would not say, and the counts stand)."""
        runs = await self.runs()
        # The workers' count within part of the scrape's wait: one that hangs must not
        # take the run counts with it (helper-121).
        counts, workers = await asyncio.gather(
            runs.count_open(),
            asyncio.wait_for(runs.workers(), STATUS_RUNS_TIMEOUT_S * 2 / 3),
            return_exceptions=True,
        )
        if isinstance(counts, BaseException):
            raise counts
        if isinstance(workers, BaseException):
            log.warning("counting workers: %s: %s", type(workers).__name__, workers)
            return counts, None
        return counts, workers

    async def runs(self) -> Runs:
        self._asked = True
        if self._runs is None:
            async with self._lock:
                if self._runs is None:
                    t = self._config.temporal
                    try:
                        client = await TemporalClient.connect(
                            t.address,
                            **t.connect_options(os.environ),  # TLS, API key (checked at start)
                            interceptors=telemetry.temporal_interceptors(),  # spawns join traces
                        )
                    except RuntimeError as exc:  # the SDK's "Failed client connect: ..."
                        # Named with the address: a gateway left without [temporal]
                        # looks for it at the default, 127.0.0.1:7233.
                        raise RunStoreDown(
                            f"{RUN_STORE_DOWN} at {t.address} ([temporal] address, or "
                            f"LUFTPAUSE_TEMPORAL_ADDRESS) is unreachable: {exc}"
                        ) from exc
                    self._runs = Runs(client, task_queue=t.task_queue)
        return self._runs

    def deps(self, live: _Live, runtime: Callable[[], _Runtime | None]) -> DoorDeps:
        async def decide_in_process(
            text: str, labels: list[str] | None, model: str | None, caller: str
        ) -> tuple[int, Any]:
            rt = runtime()
            if rt is None:
                return 503, {"error": {"message": "the gateway is not running"}}
            never = asyncio.Event()

            async def receive() -> dict[str, Any]:  # the MCP client stays for the answer
                await never.wait()
                return {"type": "http.disconnect"}

            fields = {"input": text, "labels": labels, "model": model}
            try:  # the checks /v1/decide makes (distinct labels, their number, ...)
                request = decide_request({k: v for k, v in fields.items() if v is not None})
            except DecideError as exc:
                return exc.status, {"error": {"message": exc.message}}
            response = await _decide(rt, live, request, _new_id(), caller, receive)
            try:
                body = json.loads(bytes(response.body))
            except ValueError:
                body = {"error": {"message": bytes(response.body).decode(errors="replace")}}
            return response.status_code, body

        return DoorDeps(
            runs=self.runs,
            upstream_tools=self._pool.listing,
            decide=decide_in_process,
            models=lambda: live.pool.offered,
            token_identity="token" if self._token else None,
            # Rounds of a call survive a restart (the same token, the same key).
            state_key=_state_key(self._token) if self._token else None,
            stopping=lambda: self.stopping,
            approve_tool=self._config.mcp.approve_tool,  # read at start, as the door is made
        )

    async def aclose(self) -> None:
        await self._pool.aclose()


def _state_key(token: str) -> bytes:
    """The key sealing MCP request state, from the operator token: 32 bytes, as the
    codec asks, and not the token itself."""
    return hashlib.sha256(b"luftpause mcp request state\0" + token.encode()).digest()


def _on_hangup(
    loop: asyncio.AbstractEventLoop, reload: Callable[[], Coroutine[Any, Any, None]]
) -> Callable[[], None]:
    """Reload on SIGHUP, as daemons do; returns what undoes it.  Only where signals can
    be had: the main thread of a process on a POSIX system (a test's app in a thread of
    its own reloads by POST /reload)."""
    if not hasattr(signal, "SIGHUP") or threading.current_thread() is not threading.main_thread():
        return lambda: None
    tasks: set[asyncio.Task[None]] = set()

    def hangup() -> None:
        task = loop.create_task(reload(), name="reload")
        tasks.add(task)  # kept until done: the loop holds tasks weakly
        task.add_done_callback(tasks.discard)

    loop.add_signal_handler(signal.SIGHUP, hangup)
    if take_held_hangups():
        # Sent while the gateway started (`luftpause gateway` holds them from its
        # first line; SIGHUP's default would have ended it): carried out now, once.
        log.info("a SIGHUP came while starting: reloading now")
        hangup()

    def undo() -> None:
        loop.remove_signal_handler(signal.SIGHUP)  # (its default again: held instead)
        hold_hangups()

    return undo


def _decide(
    rt: _Runtime,
    live: _Live,
    request: DecideRequest,
    run_id: str,
    caller: str,
    receive: Receive,
    service_class: ServiceClass = ServiceClass.INTERACTIVE,
    unanswered: Unanswered = untold,
) -> Coroutine[Any, Any, Response]:
    """`/v1/decide` and the MCP door's `decide` tool alike, on the pool as it is now."""
    return decide(
        request,
        run_id=run_id,
        caller=caller,
        service_class=service_class,
        shell=rt.shell,
        client=rt.client,
        endpoints=live.known,
        models=live.pool.offered,
        awaited=live.awaited,
        classifiers=live.pool.classifiers,
        down=_down(rt.prober),
        load=live.classifier_load,
        clock=rt.loop.time,
        receive=receive,
        answer_timeout=rt.shell.state.policy.turn_timeout_s,
        retry_after=rt.prober.retry_after,
        refused=rt.refused,
        unanswered=unanswered,
    )


async def _tick(shell: AdmissionShell, loop: asyncio.AbstractEventLoop) -> None:
    """Feed the core its clock (turn timeouts, idle run expiry); sweep tool call ids."""
    last_sweep = loop.time()
    while True:
        await asyncio.sleep(TICK_PERIOD_S)
        now = loop.time()
        # The loop outlives a failed tick: without it no turn would time out and no
        # idle run expire.
        try:
            shell.apply(Tick(now=now))
            if now - last_sweep >= TOOL_CALL_SWEEP_S:
                shell.sweep_tool_calls(now)
                last_sweep = now
        except Exception:
            log.exception("tick failed; the next one comes in %g s", TICK_PERIOD_S)


# The methods of the /v1 paths luftpause serves, for a 405's Allow header.
_ALLOWED = {
    CHAT_PATH: "POST",
    MESSAGES_PATH: "POST",
    COUNT_TOKENS_PATH: "POST",
    RESPONSES_PATH: "POST",
    "/v1/decide": "POST",
    "/v1/models": "GET",
    "/v1/runs": "GET",
}
_NO_TOKEN = "missing or wrong bearer token"
# On the Anthropic door, where clients send their key in x-api-key or as a bearer token.
_NO_KEY = "missing or wrong token: the gateway's token, in x-api-key or as a bearer token"
# Anthropic API headers an engine reads, passed on from the client.
_ANTHROPIC_HEADERS = ("anthropic-version", "anthropic-beta")

# --------------------------------------------------------------------------- parsing


def _tokens(request: Request | Scope, *, api_key: bool, query: str | None) -> list[str]:
    """The tokens a request sends where `identify` reads them (empty ones included): a
    bearer token, with `api_key` the x-api-key header, and the `query` parameter given."""
    headers = request.headers if isinstance(request, Request) else Request(request).headers
    scheme, _, credentials = headers.get("authorization", "").partition(" ")
    given = [credentials.strip()] if scheme.lower() == "bearer" else []
    if api_key and (key := headers.get("x-api-key")) is not None:
        given.append(key.strip())
    if query is not None:
        given.append(query.strip())
    return given


async def _body(request: Request, limit: int) -> bytes | None:
    """The request's body, or None once it is longer than `limit` (read no further: a
    held turn keeps its body in memory until admitted)."""
    declared = request.headers.get("content-length")
    if declared is not None and _decimal(declared) and int(declared) > limit:
        return None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _coded(request: Request) -> str | None:
    """Why a request body with a Content-Encoding is refused, or None: the gateway reads
    a turn to place it, and a compressed one read as "not valid JSON: 'utf-8' codec
    can't decode byte 0x8b" (helper-156; Codex compresses its bodies to OpenAI)."""
    coding = request.headers.get("content-encoding", "").strip().lower()
    if coding in ("", "identity"):
        return None
    return (
        f"request body in Content-Encoding {coding[:64]!r}: send it uncompressed (the "
        "gateway reads each request to place it)"
    )


def _decimal(text: str) -> bool:
    """ASCII digits, short enough for int(): str.isdigit() also takes "²", which int()
    refuses, and int() refuses more than 4,300 digits."""
    return text.isascii() and text.isdigit() and len(text) <= 18


def _too_large(limit: int, run_id: str, *, anthropic: bool = False) -> Response:
    message = f"request body larger than {limit:,} bytes (max_request_bytes)"
    return error_response(413, message, run_id, anthropic=anthropic)


# Printable ASCII without "/", so that every run id fits DELETE /v1/runs/{id}.
_BAD_RUN_ID = f"run id: {RUN_ID_SHAPE}"


_RUN_HEADER_BYTES = RUN_HEADER.encode()


def _named_run(scope: Scope) -> str:
    """The run a request names in its header, if it is one a response may echo; else a
    new id (every /v1 answer carries one)."""
    return _echoed_run(scope) or _new_id()


def _echoed_run(scope: Scope) -> str:
    """The run a request names in its header, if it is one a response may echo; else
    none: the routes that are no turn (`/v1/models`) answer with it, where a fresh id
    would name a run that does not exist (helper-250); a turn adds one (`_named_run`)."""
    for key, value in scope["headers"]:
        if key == _RUN_HEADER_BYTES:
            named = value.decode("latin-1").strip()
            return named if RUN_ID.fullmatch(named) else ""
    return ""


def _new_id() -> str:
    """32 random hex digits, like uuid4().hex without building a UUID (twice a turn)."""
    return os.urandom(16).hex()


def _parse_body(raw: bytes) -> dict[str, Any]:
    encoding = json.detect_encoding(raw[:4])
    if encoding not in ("utf-8", "utf-8-sig"):
        # json.loads would take UTF-16 and UTF-32; the bytes go on to the engine, and
        # a streamed turn's get a field appended in UTF-8 (RFC 8259: JSON is UTF-8).
        raise _BadRequest(f"request body is not valid JSON: expected UTF-8, not {encoding}")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _BadRequest(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise _BadRequest("request body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise _BadRequest("request body is not valid JSON: expected an object")
    return body


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _BadRequest("'model' is required and must be a non-empty string")
    if len(model) > MODEL_MAX_CHARS:  # (helper-146: 4 MB of it went into spans, six times)
        raise _BadRequest(f"'model' is a model's name: at most {MODEL_MAX_CHARS} characters")
    return model


def _parse_chat(body: dict[str, Any]) -> tuple[str, list[Any]]:
    model = _model(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _BadRequest("'messages' is required and must be a non-empty list")
    return model, messages


def _parse_messages(
    body: dict[str, Any], lacking: Mapping[str, list[str]], *, count: bool = False
) -> tuple[str, list[Any]]:
    """An Anthropic Messages request's model and messages.  A model some of whose
    replicas do not serve the API is refused: the turn could be placed on one."""
    model = _model(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _BadRequest("'messages' is required and must be a non-empty list")
    max_tokens = body.get("max_tokens")
    if (
        not count
        and max_tokens is not None
        and not (
            isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > 0
        )
    ):
        raise _BadRequest(f"'max_tokens' must be a positive integer, got {max_tokens!r}")
    _check_served(model, lacking, "messages")
    return model, messages


def _parse_responses(
    body: dict[str, Any], lacking: Mapping[str, list[str]]
) -> tuple[str, list[Any]]:
    """An OpenAI Responses request's model and input items (a string input is one
    user message, and echoes nothing)."""
    model = _model(body)
    given = body.get("input")
    if not (isinstance(given, str) and given) and not (isinstance(given, list) and given):
        raise _BadRequest("'input' is required: a non-empty string or list of items")
    if body.get("background") not in (None, False):
        # A background response is answered `queued` at once and fetched later with
        # GET /v1/responses/{id}: the engine would go on generating after luftpause
        # counted the turn done (its slot free to another), and the fetch is not
        # served.  Refused before queueing, rather than a turn that is lost.
        raise _BadRequest(
            "'background': luftpause holds each turn while an engine runs it and does not "
            'serve GET /v1/responses/{id}; send the turn in the foreground ("stream": '
            "true for its progress as it is written)"
        )
    _check_served(model, lacking, "responses")
    return model, given if isinstance(given, list) else []


def _check_served(model: str, lacking: Mapping[str, list[str]], api: str) -> None:
    without = lacking.get(model)
    if without:
        raise _BadRequest(api_not_served(model, without, api), status=404)


def _echoed_tool_uses(messages: list[Any]) -> list[str]:
    """The tool use ids an Anthropic request's tool results echo (they join the turn to
    the run that made the calls).  Any role but the assistant's: Claude Code has sent
    roles of its own that engines read as the user's (vLLM's `ctx`, `msg`)."""
    return [
        block["tool_use_id"]
        for m in messages
        if isinstance(m, dict)
        and m.get("role") != "assistant"
        and isinstance(m.get("content"), list)
        for block in m["content"]
        if isinstance(block, dict)
        and block.get("type") == "tool_result"
        and isinstance(block.get("tool_use_id"), str)
    ]


def _parse_class(
    value: str | None, blank: ServiceClass | None = ServiceClass.INTERACTIVE
) -> ServiceClass:
    """The class a header or query value names; `blank`: what an absent or empty one
    means (None: refused)."""
    if blank is not None and (value is None or not value.strip()):  # as other headers
        return blank
    try:
        return ServiceClass((value or "").strip().lower())
    except ValueError:
        accepted = " or ".join(f"'{c.value}'" for c in ServiceClass)
        raise _BadRequest(f"{CLASS_HEADER} must be {accepted}, got {value!r}") from None


# An image inlined as base64 (Anthropic's `source.data`, an OpenAI `data:image/…` URL)
# costs a model about this many tokens (Anthropic's most for one image), where its
# characters / 4 would be hundreds of thousands: a screenshot made a turn "larger than
# the KV pool", held behind every other run on the replica, on every later turn too.
INLINE_IMAGE_TOKENS = 1_600
# Base64 of 1 KiB and more where media is inlined: a data URL's payload, or a `"data"`.
_BASE64_RUN = re.compile(rb'(?:;base64,|"data"\s*:\s*")([A-Za-z0-9+/]{1024,}={0,2})')


# A content part that carries media (OpenAI Chat, Anthropic Messages, Responses),
# inlined or by URL or file id: the engine counts it as it will, the estimate not.  One
# scan of the bytes, as the base64 test: no walk of the parsed body on the hot path
# (an agent's tool schemas name "file" everywhere).  A "type" inside a string is
# escaped (\"type\"), so text that quotes one does not match.
_MEDIA_PART = re.compile(
    rb'"type"\s*:\s*"(?:image_url|image|input_image|input_file|file|document|input_audio)"'
)


def _json_content_type(sent: str | None) -> str:
    """The content type a turn goes to its engine with: the client's when it says JSON,
    else application/json.  luftpause parsed the body as JSON whatever the client said,
    and vLLM and SGLang take only application/json (their validate_json_request
    answers anything else 400, after luftpause had admitted the turn), as `curl -d`
    without a header sends application/x-www-form-urlencoded.  The client's is kept only
    when it passes their check as they make it (lowercased, cut at the first ";", not
    stripped): "application/json ; charset=utf-8" is valid HTTP, and they refuse it."""
    if sent is not None and sent.lower().split(";", 1)[0] == "application/json":
        return sent
    return "application/json"


def _chained(body: dict[str, Any]) -> bool:
    """A Responses request whose body is not its whole prompt: it continues a stored
    response or conversation, which the engine counts in."""
    return bool(body.get("previous_response_id") or body.get("conversation"))


def _has_media(raw: bytes) -> bool:
    """Whether a request's messages carry a media part (`_MEDIA_PART`)."""
    return _MEDIA_PART.search(raw) is not None


def _prompt_tokens(raw: bytes) -> int:
    """A turn's prompt before its engine counts it: a token per 4 bytes of its body, but
    INLINE_IMAGE_TOKENS for each inlined image.  Other inlined media (a PDF) keep the
    byte count: their text is what the model reads.  The scan runs only for bodies
    that say "base64" (a memchr-fast test): text turns pay nothing for it."""
    if b"base64" not in raw:
        return len(raw) // 4
    images = image_bytes = 0
    for m in _BASE64_RUN.finditer(raw):
        start, end = m.span(1)
        # Its media type is beside it: before it (`data:image/png;base64,…`, Anthropic's
        # usual key order) or after it (a client that puts `data` first).
        if b"image/" in raw[max(0, start - 160) : start] + raw[end : end + 160]:
            images += 1
            image_bytes += end - start
    return (len(raw) - image_bytes) // 4 + images * INLINE_IMAGE_TOKENS


def _why_down(prober: Prober, name: str) -> str | None:
    """Why the last probe found the endpoint unhealthy (None: it found it healthy)."""
    r = prober.last.get(name)
    return r.error if r is not None and not r.healthy else None


def _down(prober: Prober) -> frozenset[str]:
    """The endpoints the last probe found unhealthy."""
    return frozenset(name for name, r in prober.last.items() if not r.healthy)


def _caller(request: Request) -> str:
    value = request.headers.get(CALLER_HEADER)
    if not value:
        return ANONYMOUS_CALLER
    return caller_name(value) or ANONYMOUS_CALLER


def _tool_names(body: dict[str, Any]) -> frozenset[str]:
    """The names of the function tools a request offers (for calls written as text)."""
    tools = body.get("tools")
    if not isinstance(tools, list):
        return frozenset()
    names = (
        t["function"].get("name")
        for t in tools
        if isinstance(t, dict) and isinstance(t.get("function"), dict)
    )
    return frozenset(n for n in names if isinstance(n, str))


def _with_stream_usage(raw: bytes, body: dict[str, Any]) -> bytes | None:
    """The body with `stream_options.include_usage` on, for a streamed request that does
    not ask for usage (the OpenAI SDKs' default): the core sizes runs by the engine's
    token counts, which a stream carries only when asked.  None: forward it as it is.
    The client still gets the stream it asked for: the proxy drops the usage-only event
    it added (`TurnRequest.usage_body`)."""
    if body.get("stream") is not True:
        return None
    options = body.get("stream_options")
    if options is None and "stream_options" not in body:
        end = raw.rstrip()
        if end.endswith(b"}"):  # one field more, the client's bytes otherwise unchanged
            return end[:-1] + b',"stream_options":{"include_usage":true}}'
        return None  # pragma: no cover - a JSON object always ends with }
    if not isinstance(options, dict) or options.get("include_usage") not in (False, None):
        # The client's own: true, or a value the engine reads its way ("1", 1, ...; a
        # malformed one it refuses).  (0 == False: a 0 is read as false, as pydantic
        # reads it.)
        return None
    return json.dumps({**body, "stream_options": {**options, "include_usage": True}}).encode()


def _usage_by_default(body: dict[str, Any]) -> bool:
    """The client sent `stream_options` without `include_usage`, which vLLM reads as
    true (its default there; SGLang's and OpenAI's is false)."""
    options = body.get("stream_options")
    return isinstance(options, dict) and "include_usage" not in options


def _max_tokens(body: dict[str, Any]) -> int:
    for key in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def _echoed_tool_calls(messages: list[Any]) -> list[str]:
    return [
        m["tool_call_id"]
        for m in messages
        if isinstance(m, dict)
        and m.get("role") == "tool"
        and isinstance(m.get("tool_call_id"), str)
    ]


def _echoed_function_calls(items: list[Any]) -> list[str]:
    """The call ids a Responses request's call results echo: `function_call_output`
    items, and the other kinds' (`custom_tool_call_output`, ...)."""
    return [
        item["call_id"]
        for item in items
        if isinstance(item, dict)
        and isinstance(item.get("type"), str)
        and item["type"].endswith("_output")
        and isinstance(item.get("call_id"), str)
    ]


# Per API: the tool call ids a request echoes back from an earlier answer.
_ECHOED: dict[str, Callable[[list[Any]], list[str]]] = {
    "chat": _echoed_tool_calls,
    "messages": _echoed_tool_uses,
    "responses": _echoed_function_calls,
}
