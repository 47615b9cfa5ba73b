"""The prober: load parsing per engine kind, health, failures, routers' summed load.

Socket-level behaviour (refusal, timeouts) runs over real loopback; response shapes
go through httpx.MockTransport."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

import gateway.app as gateway_app_module
import gateway.prober as prober_module
from gateway._http import describe_http_error
from gateway.prober import (
    Prober,
    ProbeResult,
    auth_headers,
    parse_load,
    parse_rank_loads,
    probe_endpoint,
    probe_pool,
    served_ranks,
)
from luftpause.config import Config, ConfigError, Endpoint, parse_config
from scheduler import ReplicaSpec, State, Tick, decide
from testkit.engine import EngineParams
from testkit.fake_engine import FakeEngineSettings, create_app
from testkit.loopback import serve

SGLANG = """# HELP sglang:num_queue_reqs The number of requests in the waiting queue
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="a"} 3.0
sglang:num_queue_reqs{model_name="b"} 1.0
# HELP sglang:num_running_reqs The number of running requests
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="a"} 7.0
sglang:num_running_reqs{model_name="b"} 2.0
sglang:token_usage{model_name="a"} 0.5
"""
VLLM = """# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 0.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 12.0
"""
LLAMACPP = """# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 2
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 4
"""


def test_parse_load_per_kind_sums_label_sets() -> None:
    assert parse_load("sglang", SGLANG) == (4, 9)
    assert parse_load("vllm", VLLM) == (0, 12)
    assert parse_load("llamacpp", LLAMACPP) == (2, 4)
    assert parse_load("sglang", VLLM) is None  # the wrong engine's names
    assert parse_load("ollama", SGLANG) is None  # reports no load


def test_parse_load_counts_each_request_once_across_ranks() -> None:
    """Ranks of one replica hold the same requests (SGLang exports every TP rank with
    --enable-metrics-for-all-schedulers; pipeline stages too): counted once.  Data-
    parallel ranks (SGLang's dp_rank, vLLM's engine) hold their own: summed.  SGLang's
    per-priority samples repeat the total (priority=""): skipped."""
    sglang_tp_dp = "".join(
        f'sglang:num_{name}_reqs{{engine_type="unified",model_name="m",moe_ep_rank="0",'
        f'pp_rank="0",tp_rank="{tp}",dp_rank="{dp}"}} {value + dp}\n'
        for name, value in (("queue", 3), ("running", 10))
        for dp in (0, 1)
        for tp in (0, 1, 2, 3)
    )
    assert parse_load("sglang", sglang_tp_dp) == (3 + 4, 10 + 11)
    with_priority = "".join(
        f'sglang:num_{name}_reqs{{model_name="m",tp_rank="0",priority="{p}"}} {v}\n'
        for name, values in (("queue", ("5", "2", "3")), ("running", ("8", "8", "0")))
        for p, v in zip(("", "0", "10"), values, strict=True)
    )
    assert parse_load("sglang", with_priority) == (5, 8)
    # Priorities without their total beside them (and two TP ranks of each): summed once.
    only_priorities = "".join(
        f'sglang:num_{name}_reqs{{model_name="m",tp_rank="{tp}",priority="{p}"}} {v}\n'
        for name, values in (("queue", ("2", "3")), ("running", ("8", "0")))
        for p, v in zip(("0", "10"), values, strict=True)
        for tp in (0, 1)
    )
    assert parse_load("sglang", only_priorities) == (5, 8)
    vllm_dp = "".join(
        f'vllm:num_requests_{name}{{engine="{e}",model_name="m"}} {v}\n'
        for name, v in (("waiting", 1), ("running", 6))
        for e in (0, 1, 2)
    )
    assert parse_load("vllm", vllm_dp) == (3, 18)


def test_parse_rank_loads_tells_the_data_parallel_ranks_apart() -> None:
    """Per rank as parse_load counts the whole: copies once, priorities skipped."""
    sglang = "".join(
        f'sglang:num_{name}_reqs{{model_name="m",tp_rank="{tp}",dp_rank="{dp}",'
        f'priority="{p}"}} {value + dp + (10 if p else 0)}\n'
        for name, value in (("queue", 3), ("running", 10))
        for dp in (0, 1)
        for tp in (0, 1)
        for p in ("", "5")
    )
    assert parse_rank_loads("sglang", sglang) == {0: (3, 10), 1: (4, 11)}
    vllm = "".join(
        f'vllm:num_requests_{name}{{engine="{e}",model_name="m"}} {v * (e + 1)}\n'
        for name, v in (("waiting", 1), ("running", 6))
        for e in (0, 1, 2)
    )
    assert parse_rank_loads("vllm", vllm) == {0: (1, 6), 1: (2, 12), 2: (3, 18)}
    odd = "".join(  # labels str.isdigit() takes and int() does not: not ranks
        f'vllm:num_requests_{name}{{engine="{e}",model_name="m"}} 1\n'
        for name in ("waiting", "running")
        for e in ("²", "9" * 5000, "0")
    )
    assert parse_rank_loads("vllm", odd) == {0: (1, 1)}
    assert parse_rank_loads("sglang", SGLANG) is None  # no rank labels: no rank's load
    assert parse_rank_loads("llamacpp", LLAMACPP) is None  # takes no rank
    # How many ranks a server says it has: SGLang's dp_size; vLLM's highest engine.
    assert served_ranks("sglang", {"dp_size": 4}, {}) == 4
    for info in (None, {}, {"dp_size": True}, {"dp_size": 0}, []):
        assert served_ranks("sglang", info, {0: (0, 0)}) is None  # it does not say
    assert served_ranks("vllm", None, {0: (1, 6), 2: (3, 18)}) == 3  # a gap is a rank
    assert served_ranks("vllm", None, {}) is None


def _counting(app: Any, path: str) -> tuple[Any, list[str]]:
    """The app, and a list of the requests for `path` that reached it."""
    seen: list[str] = []

    async def counted(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == path:
            seen.append(path)
        await app(scope, receive, send)

    return counted, seen


def _endpoint(kind: str = "sglang", url: str = "http://engine", **kw: object) -> Endpoint:
    return Endpoint.model_validate({"name": "e", "url": url, "kind": kind, "models": ["m"], **kw})


def _client(routes: dict[str, httpx.Response]) -> httpx.AsyncClient:
    def handler(request: httpx.Request) -> httpx.Response:
        return routes.get(request.url.path, httpx.Response(404))

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


async def test_healthy_engine_reports_its_load() -> None:
    async with _client(
        {"/health": httpx.Response(200), "/metrics": httpx.Response(200, text=SGLANG)}
    ) as c:
        r = await probe_endpoint(c, _endpoint())
    assert (r.healthy, r.queued, r.running, r.error) == (True, 4, 9, None)
    ev = r.event(5.0)
    assert (ev.replica, ev.healthy, ev.queued, ev.running, ev.now) == ("e", True, 4, 9, 5.0)


async def test_a_failed_health_check_or_metrics_error_marks_unhealthy() -> None:
    async with _client({"/health": httpx.Response(503)}) as c:
        r = await probe_endpoint(c, _endpoint())
    assert not r.healthy and r.error == "/health answered 503"
    async with _client({"/health": httpx.Response(200), "/metrics": httpx.Response(500)}) as c:
        r = await probe_endpoint(c, _endpoint())
    assert not r.healthy and r.error == "/metrics answered 500"


async def test_a_health_check_that_redirects_marks_unhealthy() -> None:
    # Turns are posted to the endpoint's URL only: one that redirects everything
    # (http -> https, a moved host) failed every turn 502 while /status said healthy.
    moved = {"location": "https://elsewhere.example/health"}
    async with _client({"/health": httpx.Response(308, headers=moved)}) as c:
        r = await probe_endpoint(c, _endpoint())
    assert not r.healthy
    assert r.error == (
        "/health answered 308 (a redirect to https://elsewhere.example/health); luftpause "
        "does not follow redirects: set the endpoint's url to where it points"
    )
    # /metrics alone redirecting: the engine serves, its load is unknown (and why).
    async with _client(
        {"/health": httpx.Response(200), "/metrics": httpx.Response(307, headers=moved)}
    ) as c:
        r = await probe_endpoint(c, _endpoint())
    assert (r.healthy, r.queued, r.running) == (True, None, None)
    assert r.error is not None and r.error.startswith("reports no load: /metrics answered 307")


@pytest.mark.parametrize(
    ("kind", "metrics", "why"),
    [
        (
            "sglang",
            httpx.Response(404),
            "/metrics answered 404 (start SGLang with --enable-metrics)",
        ),
        (
            "llamacpp",
            httpx.Response(200, text=""),
            "/metrics lacks llamacpp:requests_deferred and llamacpp:requests_processing "
            "(start llama-server with --metrics)",
        ),
    ],
)
async def test_an_engine_without_load_gauges_serves_uncapped(
    kind: str, metrics: httpx.Response, why: str
) -> None:
    # SGLang's metrics are off by default: the engine serves, only its load is unknown.
    async with _client({"/health": httpx.Response(200), "/metrics": metrics}) as c:
        r = await probe_endpoint(c, _endpoint(kind))
    assert (r.healthy, r.queued, r.running) == (True, None, None)
    assert r.error == f"reports no load: {why}; admitted uncapped"


async def test_endpoints_without_load_are_only_health_checked() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        return httpx.Response(200)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
        r = await probe_endpoint(c, _endpoint("openai"))
    assert r.healthy and r.queued is None and r.running is None
    assert seen == ["/v1/models"]


async def test_hosted_key_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    e = _endpoint("openai", api_key_env="HOSTED_KEY_FOR_TEST")
    assert auth_headers(e, {}) == {}
    monkeypatch.setenv("HOSTED_KEY_FOR_TEST", "sk-1")
    got: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        got.append(request.headers.get("authorization"))
        return httpx.Response(200)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
        await probe_endpoint(c, e)
    assert got == ["Bearer sk-1"]
    # A key read from a secret file keeps its newline: dropped, not sent (h11 refuses it).
    assert auth_headers(e, {"HOSTED_KEY_FOR_TEST": "sk-2\n"}) == {"Authorization": "Bearer sk-2"}
    assert auth_headers(e, {"HOSTED_KEY_FOR_TEST": " \n"}) == {}


@pytest.mark.parametrize(
    ("url", "header", "chat", "messages"),
    [
        # By default: Bearer, which vLLM and SGLang read, and x-api-key beside it on a
        # Messages request, where Anthropic-compatible hosts read it.
        ("https://api.example.com", None, {"Authorization": "Bearer k"},
         {"Authorization": "Bearer k", "x-api-key": "k"}),
        # api.anthropic.com takes a Bearer as an OAuth token: the key goes in x-api-key only.
        ("https://api.anthropic.com", None, {"x-api-key": "k"}, {"x-api-key": "k"}),
        ("https://API.Anthropic.com:443", None, {"x-api-key": "k"}, {"x-api-key": "k"}),
        ("https://anthropic.com.example.net", None, {"Authorization": "Bearer k"},
         {"Authorization": "Bearer k", "x-api-key": "k"}),
        # Chosen in the file, whatever the host.
        ("https://api.anthropic.com", "authorization", {"Authorization": "Bearer k"},
         {"Authorization": "Bearer k"}),
        ("https://llm.internal", "x-api-key", {"x-api-key": "k"}, {"x-api-key": "k"}),
        ("https://llm.internal", "authorization", {"Authorization": "Bearer k"},
         {"Authorization": "Bearer k"}),
    ],
)  # fmt: skip
def test_the_key_goes_in_the_header_the_endpoint_reads(
    url: str, header: str | None, chat: dict[str, str], messages: dict[str, str]
) -> None:
    e = _endpoint("openai", url=url, api_key_env="K", api_key_header=header)
    assert auth_headers(e, {"K": "k"}) == chat
    assert auth_headers(e, {"K": "k"}, anthropic=True) == messages
    assert auth_headers(e, {}, anthropic=True) == {}


async def test_a_key_no_header_can_carry_is_not_sent_and_fails_only_its_endpoint(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A pasted "…" or a control character in a key made httpx raise at every request,
    and one endpoint's exception failed the whole round: no endpoint's health changed
    again (helper-143).  The key is not sent, the probe says why (not what it is), and
    an endpoint whose probe raises anything else is unhealthy alone."""
    cfg = parse_config(
        {
            "endpoints": [
                {"name": "a", "url": "http://a", "kind": "openai", "models": ["m"],
                 "api_key_env": "KEY_A_FOR_TEST"},
                {"name": "b", "url": "http://b", "kind": "openai", "models": ["m"],
                 "api_key_env": "KEY_B_FOR_TEST"},
                {"name": "c", "url": "http://c", "kind": "sglang", "models": ["m"]},
                {"name": "d", "url": "http://d", "kind": "sglang", "models": ["m"]},
            ]
        }
    )  # fmt: skip
    monkeypatch.setenv("KEY_A_FOR_TEST", "sk-secret\u2026")
    monkeypatch.setenv("KEY_B_FOR_TEST", "sk-fine")
    a, b = cfg.endpoints[:2]
    assert auth_headers(a) == {} and auth_headers(a, anthropic=True) == {}
    assert auth_headers(a, {"KEY_A_FOR_TEST": "sk\x01x"}) == {}
    assert auth_headers(b) == {"Authorization": "Bearer sk-fine"}
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.host)
        if request.url.host == "c":
            raise RuntimeError("no one saw this coming")
        return httpx.Response(200, text="" if request.url.path == "/health" else SGLANG)

    with caplog.at_level("ERROR", logger="gateway.prober"):
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
            results = {r.endpoint: r for r in await probe_pool(c, cfg)}
    assert not results["a"].healthy
    assert results["a"].error == (
        "the key in $KEY_A_FOR_TEST has a character an HTTP header cannot carry "
        "(at position 10); it is not sent"
    )
    assert "a" not in seen  # nothing was asked with a key left out
    assert results["b"].healthy and results["d"].healthy and results["d"].running == 9
    assert not results["c"].healthy and results["c"].error == "probe failed: RuntimeError"
    assert "probe of c failed" in caplog.text
    assert "sk-secret" not in caplog.text


def test_an_unsendable_request_is_described_without_its_headers() -> None:
    exc = httpx.LocalProtocolError("Illegal header value b'Bearer sk-secret\\x00'")
    assert "sk-secret" not in describe_http_error(exc)


async def test_refused_connection_is_unhealthy_at_once() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with httpx.AsyncClient() as c:
        r = await probe_endpoint(c, _endpoint(url=f"http://127.0.0.1:{port}"))
    assert not r.healthy and "connect" in (r.error or "")


async def test_an_endpoint_unhealthy_from_its_first_probe_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # helper-127: only a change of health was logged, so a wrong port or health_path
    # was silent from the start; the reason was on /status alone.
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = parse_config(
        {
            "endpoints": [
                {"name": "e", "url": f"http://127.0.0.1:{port}", "kind": "sglang", "models": ["m"]}
            ]
        }
    )
    async with httpx.AsyncClient() as c:
        prober = Prober(cfg, c, lambda results: None, period=60)
        for _ in range(3):
            await prober.probe_once()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("endpoint e ")]
    assert len(said) == 1 and said[0].startswith("endpoint e is now unhealthy: "), said
    assert "connect" in said[0]


async def test_silent_engine_times_out() -> None:
    accepted, hung_up = asyncio.Event(), asyncio.Event()

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set()
        await reader.read()  # never answers; returns when the prober hangs up
        writer.close()
        await writer.wait_closed()
        hung_up.set()

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with httpx.AsyncClient() as c:
            r = await probe_endpoint(c, _endpoint(url=f"http://127.0.0.1:{port}"), timeout=0.3)
        await asyncio.wait_for(hung_up.wait(), 5)  # the client closed its connection
    finally:
        server.close()
        await server.wait_closed()
    assert accepted.is_set()
    assert not r.healthy and r.error == "no answer within 0.3 s"


def _router_pool(**more: Any) -> Config:
    """Engines a (SGLang) and b (vLLM), and router r whose load is theirs."""
    return parse_config(
        {
            "endpoints": [
                {"name": "a", "url": "http://a", "kind": "sglang", "models": ["m"]},
                {"name": "b", "url": "http://b", "kind": "vllm", "models": ["m"]},
                {"name": "r", "url": "http://r", "kind": "router", "models": ["m"],
                 "load_from": ["a", "b"]},
            ],
            **more,
        }
    )  # fmt: skip


async def test_router_load_is_the_sum_of_its_engines() -> None:
    cfg = _router_pool()

    def handler(request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        if path == "/metrics":
            return httpx.Response(200, text={"a": SGLANG, "b": VLLM}[host])
        return httpx.Response(200)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
        results = await probe_pool(c, cfg)
    assert [(r.endpoint, r.queued, r.running) for r in results] == [
        ("a", 4, 9),
        ("b", 0, 12),
        ("r", 4, 21),
    ]


async def test_router_load_leaves_out_unhealthy_engines_and_is_unknown_with_a_silent_one() -> None:
    """A router places turns only on its healthy engines, so their sum is its load; a
    healthy engine whose load is unknown makes the router's unknown (never capped), as
    the part it knows would cap the router at part of what it runs."""
    cfg = _router_pool()
    b_health = 200
    b_metrics = 200

    def handler(request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        if host == "b" and path == "/metrics":
            return httpx.Response(b_metrics, text=VLLM)
        if path == "/metrics":
            return httpx.Response(200, text=SGLANG)
        return httpx.Response(b_health if host == "b" else 200)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
        b_health = 503  # b is down: the router places nothing there
        down = {r.endpoint: r for r in await probe_pool(c, cfg)}
        b_health, b_metrics = 200, 404  # b serves, but its load is not known
        silent = {r.endpoint: r for r in await probe_pool(c, cfg)}
    assert not down["b"].healthy
    assert (down["r"].healthy, down["r"].queued, down["r"].running) == (True, 4, 9)
    assert silent["b"].healthy and silent["b"].queued is None
    r = silent["r"]
    assert (r.healthy, r.queued, r.running) == (True, None, None)
    assert r.error == "load unknown: no load from b (load_from)"
    assert r.event(0.0).queued is None  # the core leaves it uncapped


async def test_a_late_engine_keeps_its_routers_last_load_as_it_keeps_its_own() -> None:
    """An engine that answers one probe late stays in rotation with its last load, so
    its router keeps its last load too: not the sum without that engine's part."""
    cfg = _router_pool(probes={"timeout_s": 0.2, "late_to_unhealthy": 2})
    late = asyncio.Event()  # b answers after the probe's timeout while set

    async def handler(request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        if host == "b" and late.is_set():
            await asyncio.sleep(5)
        if path == "/metrics":
            return httpx.Response(200, text={"a": SGLANG, "b": VLLM}[host])
        return httpx.Response(200)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
        prober = Prober(cfg, c, lambda results: None)
        first = {r.endpoint: r for r in await prober.probe_once()}
        late.set()
        second = {r.endpoint: r for r in await prober.probe_once()}
        third = {r.endpoint: r for r in await prober.probe_once()}
    assert (first["r"].queued, first["r"].running) == (4, 21)
    b, r = second["b"], second["r"]
    assert b.healthy and b.repeated and (b.queued, b.running) == (0, 12)
    assert r.healthy and r.repeated and (r.queued, r.running) == (4, 21)
    assert r.event(0.0).repeated  # the core reads no new queue from it
    # Late twice in a row: b is out of rotation, and the router's load is a's alone.
    assert not third["b"].healthy
    assert (third["r"].healthy, third["r"].queued, third["r"].running) == (True, 4, 9)


async def test_prober_reports_each_round() -> None:
    cfg = parse_config(
        {"endpoints": [{"name": "a", "url": "http://a", "kind": "ollama", "models": ["m"]}]}
    )
    rounds: asyncio.Queue[list[str]] = asyncio.Queue()

    async def report(results: list) -> None:  # type: ignore[type-arg]
        await rounds.put([r.endpoint for r in results])

    async with httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(200))) as c:
        prober = Prober(cfg, c, report, period=0.01)
        prober.start()
        assert await asyncio.wait_for(rounds.get(), 5) == ["a"]
        assert await asyncio.wait_for(rounds.get(), 5) == ["a"]
        await prober.stop()
    assert prober.last["a"].healthy


@pytest.mark.parametrize("flavor", ["sglang", "vllm", "llamacpp"])
async def test_against_the_fake_engine_over_loopback(flavor: str) -> None:
    """The fake engine's /metrics in each flavor's names reaches the core as load."""
    one_at_a_time = replace(EngineParams.reference(), max_running_requests=1)
    settings = FakeEngineSettings(flavor=flavor, time_scale=0.05, engine=one_at_a_time)
    async with serve(create_app(settings)) as url, httpx.AsyncClient(timeout=30) as c:
        ep = _endpoint(flavor, url=url)
        idle = await probe_endpoint(c, ep)
        assert (idle.healthy, idle.queued, idle.running) == (True, 0, 0)
        body = {"model": "llama-3.2-1b", "messages": [{"role": "user", "content": "hi"}]}
        # two long generations on an engine that runs one at a time: one runs, one queues
        tasks = [asyncio.create_task(c.post(url + "/v1/chat/completions", json=body))
                 for _ in range(2)]  # fmt: skip
        for _ in range(500):  # bounded: the engine admits at its next step
            busy = await probe_endpoint(c, ep)
            if (busy.queued, busy.running) == (1, 1):
                break
            await asyncio.sleep(0.01)
        assert (busy.healthy, busy.queued, busy.running) == (True, 1, 1)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.parametrize("flavor", ["sglang", "vllm"])
async def test_a_data_parallel_server_is_probed_once_for_its_ranks(flavor: str) -> None:
    """dp_size = 2: the ranks are replicas `a@0`, `a@1`, probed with one /metrics a
    round; each rank's load and KV pool are its own."""
    one_at_a_time = replace(EngineParams.reference(), max_running_requests=1)
    settings = FakeEngineSettings(flavor=flavor, time_scale=0.05, engine=one_at_a_time, dp_size=2)
    counted, scrapes = _counting(create_app(settings), "/metrics")
    async with serve(counted) as url, httpx.AsyncClient(timeout=30) as c:
        endpoint = {"name": "a", "url": url, "kind": flavor, "models": ["m"], "dp_size": 2}
        config = parse_config({"endpoints": [endpoint]}).expanded({})
        assert [(e.name, e.dp_rank, e.server) for e in config.endpoints] == [
            ("a@0", 0, "a"),
            ("a@1", 1, "a"),
        ]
        body = {"model": "llama-3.2-1b", "messages": [{"role": "user", "content": "hi"}]}
        # Two long generations on rank 1, which runs one at a time: it runs one and
        # queues one; rank 0 is idle.
        rank_1 = {"X-Data-Parallel-Rank": "1"}
        tasks = [asyncio.create_task(c.post(url + "/v1/chat/completions", json=body,
                                            headers=rank_1)) for _ in range(2)]  # fmt: skip
        for _ in range(500):  # bounded: the engine admits at its next step
            before = len(scrapes)
            results = await probe_pool(c, config, want_limits=frozenset({"a@0", "a@1"}))
            assert len(scrapes) == before + 1  # one scrape for both ranks
            if [(r.queued, r.running) for r in results] == [(0, 0), (1, 1)]:
                break
            await asyncio.sleep(0.01)
        assert [(r.endpoint, r.healthy, r.queued, r.running, r.error) for r in results] == [
            ("a@0", True, 0, 0, None),
            ("a@1", True, 1, 1, None),
        ]
        assert [r.kv_tokens for r in results] == [56_000, 56_000]  # one rank's pool each
        # SGLang's schedulers say each rank's running-request limit; vLLM's, nothing.
        assert [r.slots for r in results] == ([1, 1] if flavor == "sglang" else [None, None])
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # A rank the server does not have (dp_size set too large): every turn sent
        # there would be a 400, so it is out of rotation, and /status says why.
        three = parse_config({"endpoints": [{**endpoint, "dp_size": 3}]}).expanded({})
        results = await probe_pool(c, three)
        assert [(r.endpoint, r.healthy) for r in results] == [
            ("a@0", True),
            ("a@1", True),
            ("a@2", False),
        ]
        assert results[2].error == (
            "the server has 2 data-parallel ranks, not rank 2: set dp_size = 2 for a"
        )
    # A server down is every rank down.
    down = await probe_pool(httpx.AsyncClient(), config)
    assert [(r.endpoint, r.healthy) for r in down] == [("a@0", False), ("a@1", False)]


@pytest.mark.parametrize(
    ("flavor", "kv", "slots"),
    [("sglang", 56_000, 48), ("vllm", 56_000, None), ("llamacpp", None, 48)],
)
async def test_an_engines_kv_pool_and_slots_are_asked_when_wanted(
    flavor: str, kv: int | None, slots: int | None
) -> None:
    """SGLang's /server_info gives the pool in tokens and the requests it runs at
    once; vLLM's cache_config_info the pool (it exports no max_num_seqs); llama.cpp's
    /props its slots."""
    async with (
        serve(create_app(FakeEngineSettings(flavor=flavor))) as url,
        httpx.AsyncClient() as c,
    ):
        ep = _endpoint(flavor, url=url)
        unasked = await probe_endpoint(c, ep)
        assert (unasked.kv_tokens, unasked.slots) == (None, None)
        asked = await probe_endpoint(c, ep, want_limits=True)
        assert asked.healthy and (asked.kv_tokens, asked.slots) == (kv, slots)
        event = asked.event(1.0)
        assert (event.kv_tokens, event.slots) == (kv, slots)


async def test_the_prober_asks_until_told_and_a_configured_pool_wins() -> None:
    engine_app = create_app(FakeEngineSettings(flavor="sglang"))
    async with serve(engine_app) as url, httpx.AsyncClient() as c:
        cfg = parse_config(
            {"endpoints": [
                {"name": "told", "url": url, "kind": "sglang", "models": ["m"]},
                {"name": "set", "url": url, "kind": "sglang", "models": ["m"], "kv_tokens": 9},
                {"name": "both", "url": url, "kind": "sglang", "models": ["m"], "kv_tokens": 9,
                 "slots": 4},
            ]}
        )  # fmt: skip
        rounds: list[list[Any]] = []
        prober = Prober(cfg, c, rounds.append, period=60)
        await prober.probe_once()
        await prober.probe_once()
    first, second = ({r.endpoint: (r.kv_tokens, r.slots) for r in results} for results in rounds)
    # "set" is asked for its slots (one call tells both: the file's 9 wins in the core);
    # "both" gives both in the file: not asked.
    assert first == {"told": (56_000, 48), "set": (56_000, 48), "both": (None, None)}
    assert all(told == (None, None) for told in second.values())  # told once: not again
    assert cfg.replica_specs()[2].slots == 4


@pytest.mark.parametrize(
    ("router", "warning"),
    [
        (False, "endpoint llama did not say its slots: set slots to give them (3 asks)"),
        (
            True,
            "endpoint r did not say its slots (its engines' sum: llama): set slots on it or "
            "on llama to give them (3 asks)",
        ),
    ],
)
async def test_an_engine_that_never_says_is_asked_three_times_and_told_what_to_set(
    router: bool, warning: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A llama-server too old for /props' total_slots (here: no /props at all), alone
    # or behind a router, whose sum it leaves unknown.
    counted, asked = _counting(create_app(FakeEngineSettings(flavor="sglang")), "/props")
    async with serve(counted) as url, httpx.AsyncClient() as c:
        llama = {"name": "llama", "url": url, "kind": "llamacpp", "models": ["m"]}
        r = {"name": "r", "url": url, "kind": "router", "models": ["m"], "load_from": ["llama"]}
        cfg = parse_config({"endpoints": [llama, r] if router else [llama]})
        prober = Prober(cfg, c, lambda results: None, period=60)
        for _ in range(4):
            await prober.probe_once()
    assert len(asked) == 3, "asked LIMIT_ASKS times, then not again"
    warned = [r.getMessage() for r in caplog.records if "did not say" in r.getMessage()]
    assert warned == [warning]


def _engine_app(flavor: str, slots: int) -> Any:
    params = replace(EngineParams.reference(), max_running_requests=slots)
    return create_app(FakeEngineSettings(flavor=flavor, engine=params))  # type: ignore[arg-type]


def _slots_of(name: str, rounds: list[list[ProbeResult]]) -> list[int | None]:
    """The slots each round's result for `name` carried."""
    return [next(r.slots for r in results if r.endpoint == name) for results in rounds]


async def test_a_routers_slots_are_the_sum_of_its_engines_given_or_asked() -> None:
    """A router runs no more at once than its engines: its slots are their sum, each
    as the file gives it or as the engine says.  Only engines whose slots the file
    lacks are asked (once), and the router is told the sum once all are known."""
    a, asked_a = _counting(_engine_app("sglang", 3), "/server_info")
    b, asked_b = _counting(_engine_app("llamacpp", 2), "/props")
    async with (
        serve(a) as url_a,
        serve(b) as url_b,
        serve(_engine_app("vllm", 64)) as url_c,
        serve(_engine_app("sglang", 1)) as url_r,  # stands in for the router
        httpx.AsyncClient() as c,
    ):
        engines = [
            {"name": "a", "url": url_a, "kind": "sglang", "models": ["m"]},
            {"name": "b", "url": url_b, "kind": "llamacpp", "models": ["m"]},
            {"name": "c", "url": url_c, "kind": "vllm", "models": ["m"], "slots": 5},
        ]
        router = {"name": "r", "url": url_r, "kind": "router", "models": ["m"]}
        cfg = parse_config({"endpoints": [*engines, {**router, "load_from": ["a", "b", "c"]}]})
        assert cfg.replica_specs()[0].slots is None, "the file does not give a's and b's"
        rounds: list[list[ProbeResult]] = []
        prober = Prober(cfg, c, rounds.append, period=60)
        await prober.probe_once()
        await prober.probe_once()
        first, second = ({r.endpoint: r.slots for r in results} for results in rounds)
        assert first["r"] == 3 + 2 + 5
        assert second["r"] is None and (len(asked_a), len(asked_b)) == (1, 1), "told once"
        # A vLLM engine behind it that the file gives no slots (vLLM says none): the
        # sum cannot be known, and nothing is asked for it.
        silent = [*engines[:2], {**engines[2], "slots": None}]
        unknown = parse_config({"endpoints": [*silent, {**router, "load_from": ["a", "b", "c"]}]})
        (r,) = [
            r for r in await Prober(unknown, c, lambda rs: None).probe_once() if r.endpoint == "r"
        ]
        assert r.slots is None and (len(asked_a), len(asked_b)) == (1, 1)
        # Every engine's slots in the file: the router's are their sum from the start.
        given = [{**e, "slots": n} for e, n in zip(engines, (4, 4, 5), strict=True)]
        known = parse_config({"endpoints": [*given, {**router, "load_from": ["a", "b", "c"]}]})
        assert known.replica_specs()[0].slots == 13
        # ... unless the router's own are given.
        own = parse_config(
            {"endpoints": [*given, {**router, "load_from": ["a", "b", "c"], "slots": 6}]}
        )
        assert own.replica_specs()[0].slots == 6


async def test_a_router_whose_engines_change_in_a_reload_is_asked_its_slots_again() -> None:
    """An engine added behind a router (a reload) raises what the router runs at once:
    it is asked again, and the core takes the new sum (test_core: the latest report
    counts).  A reload that changes nothing asks nothing."""
    a, asked_a = _counting(_engine_app("sglang", 3), "/server_info")
    async with (
        serve(a) as url_a,
        serve(_engine_app("llamacpp", 2)) as url_b,
        serve(_engine_app("sglang", 1)) as url_r,
        httpx.AsyncClient() as c,
    ):

        def pool(*behind: str) -> Config:
            return parse_config(
                {"endpoints": [
                    {"name": "a", "url": url_a, "kind": "sglang", "models": ["m"]},
                    {"name": "b", "url": url_b, "kind": "llamacpp", "models": ["m"]},
                    {"name": "r", "url": url_r, "kind": "router", "models": ["m"],
                     "load_from": list(behind)},
                ]}
            )  # fmt: skip

        rounds: list[list[ProbeResult]] = []
        prober = Prober(pool("a"), c, rounds.append, period=60)
        await prober.probe_once()
        prober.reconfigure(pool("a"))
        await prober.probe_once()
        prober.reconfigure(pool("a", "b"))
        await prober.probe_once()
        state = State.initial(pool("a").replica_specs())
        for results in rounds:
            for r in results:
                if r.endpoint == "r":
                    state, _ = decide(state, r.event(1.0))
    assert _slots_of("r", rounds) == [3, None, 5]
    assert len(asked_a) == 2, "asked again only with b added"
    assert state.replicas["r"].spec.slots == 5


async def test_slots_the_file_no_longer_gives_are_asked_of_the_engine() -> None:
    a, asked = _counting(_engine_app("sglang", 3), "/server_info")
    async with serve(a) as url, httpx.AsyncClient() as c:

        def pool(**given: int) -> Config:
            e = {"name": "a", "url": url, "kind": "sglang", "models": ["m"], "kv_tokens": 9}
            return parse_config({"endpoints": [{**e, **given}]})

        rounds: list[list[ProbeResult]] = []
        prober = Prober(pool(slots=4), c, rounds.append, period=60)
        await prober.probe_once()
        prober.reconfigure(pool(slots=5))  # still the file's: nothing to ask
        await prober.probe_once()
        prober.reconfigure(pool())
        await prober.probe_once()
        await prober.probe_once()
    assert [r.slots for (r,) in rounds] == [None, None, 3, None]
    assert len(asked) == 1


async def test_a_router_whose_engine_is_down_spends_no_asks_until_it_answers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The sum needs every engine's word: rounds in which one of them could not say
    (down, or late) are not counted against the router's asks."""
    up = {"b": False}
    info = {"internal_states": [{"effective_max_running_requests_per_dp": 3}]}

    def handler(request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        if host == "b" and not up["b"]:
            return httpx.Response(503)
        return {
            "/metrics": httpx.Response(200, text={"a": SGLANG, "b": LLAMACPP}.get(host, "")),
            "/server_info": httpx.Response(200, json=info),
            "/props": httpx.Response(200, json={"total_slots": 2}),
        }.get(path, httpx.Response(200))

    cfg = parse_config(
        {"endpoints": [
            {"name": "a", "url": "http://a", "kind": "sglang", "models": ["m"]},
            {"name": "b", "url": "http://b", "kind": "llamacpp", "models": ["m"]},
            {"name": "r", "url": "http://r", "kind": "router", "models": ["m"],
             "load_from": ["a", "b"]},
        ]}
    )  # fmt: skip
    rounds: list[list[ProbeResult]] = []
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
        prober = Prober(cfg, c, rounds.append, period=60)
        for _ in range(5):
            await prober.probe_once()
        up["b"] = True
        await prober.probe_once()
    assert _slots_of("r", rounds) == [None] * 5 + [5]
    assert not [r for r in caplog.records if "did not say" in r.getMessage()]


async def test_a_round_under_way_at_a_reload_reports_no_limits_the_reload_changed() -> None:
    """A round begun before a reload reads a router's sum over its old engines; once the
    reload has changed them, that sum is not reported (it would stand for a pool that no
    longer is, over the reload's "unknown" or before the new sum), and no ask is spent."""
    answer_b = asyncio.Event()
    b_asked = asyncio.Event()
    info = {"internal_states": [{"effective_max_running_requests_per_dp": 3}]}

    async def handler(request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        if host == "b" and path == "/props":
            b_asked.set()
            await answer_b.wait()
        return {
            "/metrics": httpx.Response(200, text={"a": SGLANG, "b": LLAMACPP}.get(host, "")),
            "/server_info": httpx.Response(200, json=info),
            "/props": httpx.Response(200, json={"total_slots": 2}),
        }.get(path, httpx.Response(200))

    def pool(*behind: str) -> Config:
        return parse_config(
            {"endpoints": [
                {"name": "a", "url": "http://a", "kind": "sglang", "models": ["m"]},
                {"name": "b", "url": "http://b", "kind": "llamacpp", "models": ["m"]},
                {"name": "c", "url": "http://c", "kind": "sglang", "models": ["m"]},
                {"name": "r", "url": "http://r", "kind": "router", "models": ["m"],
                 "load_from": list(behind)},
            ]}
        )  # fmt: skip

    rounds: list[list[ProbeResult]] = []
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
        prober = Prober(pool("a", "b"), c, rounds.append, period=60)
        round_ = asyncio.create_task(prober.probe_once())
        await b_asked.wait()  # the round is under way, a's and b's slots being read
        prober.reconfigure(pool("a", "b", "c"))
        answer_b.set()
        await round_
        await prober.probe_once()  # the new sum
    assert _slots_of("r", rounds) == [None, 3 + 2 + 3]
    # b kept its own: what it follows from did not change.
    assert {r.endpoint: r.slots for r in rounds[0]}["b"] == 2


def test_slots_parsers_read_each_engines_limit_and_refuse_what_is_none() -> None:
    from gateway.prober import parse_llamacpp_slots, parse_sglang_slots

    def state(n: object) -> dict[str, object]:
        return {"effective_max_running_requests_per_dp": n}

    # The scheduler's effective limit, per rank, times the ranks (one rank's replica:
    # its own); it wins over the argument, which SGLang may have lowered.
    info = {"dp_size": 2, "max_running_requests": 999, "internal_states": [state(64)] * 2}
    assert parse_sglang_slots(info) == 128
    assert parse_sglang_slots(info, one_rank=True) == 64
    # An older SGLang: the argument given, where no data parallelism splits it.
    assert parse_sglang_slots({"max_running_requests": 32, "internal_states": [{}]}) == 32
    assert parse_sglang_slots({"max_running_requests": 32, "dp_size": 2}) is None
    for bad in (
        {},
        {"max_running_requests": None},  # SGLang's default: chosen by the scheduler
        {"internal_states": [state(True)]},
        {"internal_states": [state("64")], "max_running_requests": 0},
        {"internal_states": "x"},
        [],
        None,
    ):
        assert parse_sglang_slots(bad) is None, bad
    assert parse_llamacpp_slots({"total_slots": 4}) == 4
    for bad in ({}, {"total_slots": 0}, {"total_slots": "4"}, None):
        assert parse_llamacpp_slots(bad) is None


def test_kv_pool_parsers_refuse_what_is_not_a_pool() -> None:
    from gateway.prober import parse_sglang_kv_tokens, parse_vllm_kv_pools, parse_vllm_kv_tokens

    assert parse_sglang_kv_tokens({"max_total_num_tokens": 1234}) == 1234
    for bad in ({}, {"max_total_num_tokens": True}, {"max_total_num_tokens": "9"}, [], None):
        assert parse_sglang_kv_tokens(bad) is None
    info = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="%s"} 1.0\n'
    assert parse_vllm_kv_tokens(info % "100") == 1600
    assert parse_vllm_kv_tokens(info % "x") is None
    assert parse_vllm_kv_tokens("vllm:num_requests_running 0\n") is None
    # Data parallelism: SGLang reports one rank's pool and dp_size; vLLM one sample per
    # engine, each with the sum of the engines' blocks.  The pool is the whole engine's,
    # as its load is, and each rank's is its share (helper-175: read as each rank's
    # own, it was 2x with 2 ranks).
    assert parse_sglang_kv_tokens({"max_total_num_tokens": 56000, "dp_size": 4}) == 224_000
    per_engine = 'vllm:cache_config_info{block_size="16",engine="%d",num_gpu_blocks="5000"} 1.0\n'
    assert parse_vllm_kv_tokens(per_engine % 0 + per_engine % 1) == 80_000
    assert parse_vllm_kv_pools(per_engine % 0 + per_engine % 1) == {"0": 40_000, "1": 40_000}
    # A vLLM that says each engine's pool in kv_cache_size_tokens is taken at its word:
    # rank 0 under external load balancing carries every rank's blocks, not its own.
    told = (
        'vllm:cache_config_info{block_size="16",engine="0",kv_cache_size_tokens="%s",'
        'num_gpu_blocks="28000"} 1.0\n'
    )
    assert parse_vllm_kv_pools(told % "112000") == {"0": 112_000}
    assert parse_vllm_kv_tokens(told % "None") == 448_000  # an attention-free model


def sglang_stub(
    server_info: Callable[[], Awaitable[PlainTextResponse]], path: str = "/get_server_info"
) -> FastAPI:
    """An SGLang-like engine: healthy, running 2, and this server info at `path` (an
    SGLang from before `/server_info` by default)."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("ok")

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse("sglang:num_queue_reqs 0\nsglang:num_running_reqs 2\n")

    app.add_api_route(path, server_info, methods=["GET"])
    return app


async def test_sglangs_server_info_is_asked_where_it_is_not_deprecated() -> None:
    # /get_server_info logs a deprecation warning at every call on today's SGLang, and
    # is to go (helper-175); an SGLang from before /server_info has only it.
    asked: list[str] = []

    def answer(path: str) -> Callable[[], Awaitable[PlainTextResponse]]:
        async def info() -> PlainTextResponse:
            asked.append(path)
            return PlainTextResponse('{"max_total_num_tokens": 5000}')

        return info

    new = sglang_stub(answer("/server_info"), "/server_info")
    new.add_api_route("/get_server_info", answer("/get_server_info"), methods=["GET"])
    old = sglang_stub(answer("/get_server_info"))
    for app, said in ((new, ["/server_info"]), (old, ["/get_server_info"])):
        asked.clear()
        async with serve(app) as url, httpx.AsyncClient() as c:
            r = await probe_endpoint(c, _endpoint("sglang", url=url), want_limits=True)
        assert (r.healthy, r.kv_tokens, asked) == (True, 5000, said)


async def test_a_slow_server_info_does_not_make_a_healthy_engine_unhealthy() -> None:
    release = asyncio.Event()

    async def slow() -> PlainTextResponse:
        await release.wait()  # busy asking its scheduler
        return PlainTextResponse("{}")

    async with serve(sglang_stub(slow)) as url, httpx.AsyncClient() as c:
        r = await probe_endpoint(c, _endpoint("sglang", url=url), timeout=0.3, want_limits=True)
        release.set()
    assert (r.healthy, r.running, r.kv_tokens, r.error) == (True, 2, None, None)


async def test_an_engine_that_does_not_report_its_pool_is_asked_three_times() -> None:
    asked = []

    async def old_sglang() -> PlainTextResponse:
        asked.append(1)
        return PlainTextResponse("not found", status_code=404)

    async with serve(sglang_stub(old_sglang)) as url, httpx.AsyncClient() as c:
        cfg = parse_config(
            {"endpoints": [{"name": "old", "url": url, "kind": "sglang", "models": ["m"]}]}
        )
        prober = Prober(cfg, c, lambda results: None, period=60)
        for _ in range(5):
            (r,) = await prober.probe_once()
            assert r.healthy
    assert len(asked) == 3


async def test_vllm_without_metrics_asked_its_kv_pool_is_healthy_not_a_crash() -> None:
    # FastAPI's 404 body, which the exposition parser cannot read (it raised).
    missing = httpx.Response(404, json={"detail": "Not Found"})
    async with _client({"/health": httpx.Response(200), "/metrics": missing}) as c:
        r = await probe_endpoint(c, _endpoint("vllm"), want_limits=True)
    assert (r.healthy, r.queued, r.kv_tokens) == (True, None, None)


async def test_one_late_probe_keeps_a_healthy_engine_in_rotation_two_do_not() -> None:
    cfg = parse_config({"endpoints": [_endpoint().model_dump()]})
    async with httpx.AsyncClient() as c:
        prober = Prober(cfg, c, lambda results: None, period=60)
    late = ProbeResult(endpoint="e", healthy=False, error="no answer within 2 s", timed_out=True)
    prober.last["e"] = ProbeResult(endpoint="e", healthy=True, queued=1, running=3)
    first = prober._forgive_late(late)
    assert (first.healthy, first.queued, first.running) == (True, 1, 3)
    assert first.error == "no answer within 2 s once; still in rotation"
    # The repeated load is no second reading of the engine's queue: no cap from it.
    assert first.repeated and first.event(1.0).repeated
    state = State.initial([ReplicaSpec(name="e", models=frozenset({"m"}))])
    for result in (prober.last["e"], first):
        state, _ = decide(state, result.event(1.0))
    assert (state.replicas["e"].cap, state.replicas["e"].queued_probes) == (None, 1)
    prober.last["e"] = first
    assert not prober._forgive_late(late).healthy  # the second in a row counts
    # An answer resets the count; a refusal or an error status counts at once.
    prober._forgive_late(ProbeResult(endpoint="e", healthy=True))
    refused = ProbeResult(endpoint="e", healthy=False, error="cannot connect")
    assert prober._forgive_late(refused) is refused
    assert prober._forgive_late(late).healthy


def _stalling_client(stalls: list[bool], stalled: asyncio.Event) -> httpx.AsyncClient:
    """/health answers at once, or (the next of `stalls` True) never: `stalled` is set
    when such a request has arrived."""
    never = asyncio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            if stalls and stalls.pop(0):
                stalled.set()
                await never.wait()
            return httpx.Response(200)
        return httpx.Response(200, text=SGLANG)

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


async def test_rounds_at_once_count_one_slow_moment_once() -> None:
    # A reload (or a pod change) probes at once beside the periodic round: both waited
    # through one slow moment, which took a healthy engine out as two late probes in
    # a row (helper-100).  The next round late again does count.
    cfg = parse_config(
        {
            "endpoints": [_endpoint().model_dump()],
            "probes": {"timeout_s": 0.2, "late_to_unhealthy": 2},
        }
    )
    stalled = asyncio.Event()
    async with _stalling_client([False, True, True, True], stalled) as c:
        prober = Prober(cfg, c, lambda results: None, period=60)
        assert (await prober.probe_once())[0].healthy
        periodic = asyncio.ensure_future(prober.probe_once())
        await stalled.wait()
        extra = await prober.probe_once()  # begun while the periodic one waits
        (a,), (b,) = await periodic, extra
        for r in (a, b):  # each forgiven: late once
            assert r.healthy and r.repeated and r.error is not None
            assert r.error.endswith("once; still in rotation")
        assert prober.last["e"].healthy
        (later,) = await prober.probe_once()
        assert not later.healthy and later.timed_out


async def test_a_round_that_ends_after_a_later_one_does_not_undo_its_reading() -> None:
    stalled = asyncio.Event()
    cfg = parse_config({"endpoints": [_endpoint().model_dump()], "probes": {"timeout_s": 0.3}})
    reported: list[list[ProbeResult]] = []
    async with _stalling_client([False, True, False], stalled) as c:
        prober = Prober(cfg, c, reported.append, period=60)
        await prober.probe_once()
        slow = asyncio.ensure_future(prober.probe_once())
        await stalled.wait()
        (fresh,) = await prober.probe_once()  # answered while the first still waits
        assert fresh.healthy and not fresh.repeated
        assert await slow == []  # its late answer is older than what was reported
        assert prober.last["e"] is fresh
        assert [len(r) for r in reported] == [1, 1, 0]


@pytest.mark.parametrize("value", ["+Inf", "NaN"])
async def test_a_load_that_is_no_count_leaves_the_load_unknown(value: str) -> None:
    # The exposition format allows +Inf and NaN; int() of them raised past the probe
    # and ended the prober's task for good.
    text = f"sglang:num_queue_reqs {value}\nsglang:num_running_reqs 3\n"
    with pytest.raises(ValueError, match="sglang:num_queue_reqs is"):
        parse_load("sglang", text)
    async with _client(
        {"/health": httpx.Response(200), "/metrics": httpx.Response(200, text=text)}
    ) as c:
        r = await probe_endpoint(c, _endpoint())
    assert (r.healthy, r.queued, r.running) == (True, None, None)
    assert r.error is not None and r.error.startswith("reports no load: /metrics: sglang:num_q")


async def test_the_probe_loop_outlives_a_round_that_fails() -> None:
    cfg = parse_config(
        {"endpoints": [{"name": "a", "url": "http://a", "kind": "ollama", "models": ["m"]}]}
    )
    rounds: asyncio.Queue[int] = asyncio.Queue()
    calls = 0

    async def report(results: list) -> None:  # type: ignore[type-arg]
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug in the shell")
        await rounds.put(calls)

    async with httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(200))) as c:
        prober = Prober(cfg, c, report, period=0.01)
        prober.start()  # the loop the gateway runs
        try:
            assert await asyncio.wait_for(rounds.get(), 5) == 2
        finally:
            await prober.stop()


async def test_the_tick_loop_outlives_a_tick_that_fails() -> None:
    ticks: asyncio.Queue[float] = asyncio.Queue()

    class Shell:  # the two calls _tick makes, the first one failing
        calls = 0

        def apply(self, event: Tick) -> None:
            Shell.calls += 1
            if Shell.calls == 1:
                raise RuntimeError("a bug in the core")
            ticks.put_nowait(event.now)

        def sweep_tool_calls(self, now: float) -> None:
            pass

    task = asyncio.create_task(
        gateway_app_module._tick(Shell(), asyncio.get_running_loop())  # type: ignore[arg-type]
    )
    try:
        await asyncio.wait_for(ticks.get(), 10)
        assert Shell.calls == 2
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_only_the_load_gauges_are_read() -> None:
    # The whole exposition is not parsed (vLLM's is ~90 KB of histograms, ~50 ms on the
    # event loop per probe): a line the parser would refuse, elsewhere, does not hide
    # the load.
    text = "vllm:some_histogram_bucket{le=oops} 1\n" + (
        'vllm:num_requests_waiting{engine="0"} 2.0\nvllm:num_requests_running{engine="0"} 5.0\n'
    )
    assert parse_load("vllm", text) == (2, 5)


async def test_the_files_probes_section_sets_timeout_period_and_late_limit() -> None:
    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # never answers
        writer.close()

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    cfg = parse_config(
        {
            "endpoints": [_endpoint(url=f"http://127.0.0.1:{port}").model_dump()],
            "probes": {"period_s": 7.5, "timeout_s": 0.2, "late_to_unhealthy": 3},
        }
    )
    try:
        async with httpx.AsyncClient() as c:
            prober = Prober(cfg, c, lambda results: None)
            assert prober.period == 7.5
            prober.last["e"] = ProbeResult(endpoint="e", healthy=True)
            seen = [(await prober.probe_once())[0] for _ in range(3)]
    finally:
        server.close()
        await server.wait_closed()
    # Two late answers in a row keep it in rotation, the third takes it out.
    assert [r.healthy for r in seen] == [True, True, False]
    assert seen[2].error == "no answer within 0.2 s"
    with pytest.raises(
        ConfigError, match=r"probes\.timeout_s: Input should be greater than or equal to 0\.05"
    ):
        parse_config({"endpoints": [_endpoint().model_dump()], "probes": {"timeout_s": 0}})


async def test_a_reload_that_shortens_the_period_takes_effect_at_once() -> None:
    """The loop slept out the old period (up to 300 s) after a reload that shortened
    it: a dead engine stayed in rotation that long, while Retry-After already named
    the new period (helper-143)."""
    cfg = parse_config({"endpoints": [_endpoint().model_dump()], "probes": {"period_s": 300}})
    rounds: list[int] = []
    more = asyncio.Event()

    def report(results: list[ProbeResult]) -> None:
        rounds.append(len(results))
        more.set()

    async with _client({"/health": httpx.Response(200)}) as c:
        prober = Prober(cfg, c, report)
        prober.start()
        try:
            await asyncio.sleep(0)  # the loop is waiting out its first period
            prober.reconfigure(parse_config({**cfg.model_dump(), "probes": {"period_s": 0.1}}))
            assert prober.period == 0.1 and prober.retry_after == "1"
            async with asyncio.timeout(10):
                while len(rounds) < 3:
                    await more.wait()
                    more.clear()
        finally:
            await prober.stop()
    # An unchanged period leaves the loop's schedule alone.
    prober.reconfigure(parse_config({**cfg.model_dump(), "probes": {"period_s": 0.1}}))
    assert not prober._rescheduled.is_set()


@pytest.mark.parametrize("kind", ["sglang", "llamacpp"])
async def test_an_engines_limits_answer_that_cannot_be_read_fails_nothing(kind: str) -> None:
    """A /server_info (SGLang, asked every round with data-parallel ranks) or /props
    (llama.cpp's slots) nested too deeply for the JSON parser raised RecursionError,
    which failed the whole round, every endpoint's (helper-145)."""
    nested = b"[" * 100_000 + b"]" * 100_000

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/server_info", "/get_server_info", "/props"):
            return httpx.Response(200, content=nested)
        if request.url.path == "/metrics":
            return httpx.Response(404)
        return httpx.Response(200, json={})

    bad: dict[str, Any] = {"name": "bad", "url": "http://bad", "kind": kind, "models": ["m"]}
    if kind == "sglang":
        bad["dp_size"] = 2
    good = {"name": "good", "url": "http://good", "kind": "openai", "models": ["m"]}
    config = parse_config({"endpoints": [good, bad]})
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
        results = await probe_pool(
            c, config, want_limits=frozenset(e.name for e in config.replicas)
        )
    assert all(r.healthy for r in results), results
    assert all(r.slots is None and r.kv_tokens is None for r in results)


class _ServerInfoEngine:
    """A fake SGLang with two data-parallel ranks whose server-info routes in `lacks`
    answer 404 (one from before `/server_info`, or after `/get_server_info`), each ask
    recorded in `asked` (route, status); its health check fails while `down`."""

    def __init__(self, lacks: set[str]) -> None:
        self.lacks = lacks
        self.down = False
        self.asked: list[tuple[str, int]] = []
        self._app = create_app(FakeEngineSettings(flavor="sglang", dp_size=2))

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path")
        if scope["type"] == "http" and self.down and path == "/health":
            await PlainTextResponse("restarting", status_code=503)(scope, receive, send)
            return
        if scope["type"] == "http" and path in ("/server_info", "/get_server_info"):
            status = 404 if path in self.lacks else 200
            self.asked.append((path, status))
            if status == 404:
                await PlainTextResponse("not found", status_code=404)(scope, receive, send)
                return
        await self._app(scope, receive, send)


async def test_an_sglang_upgraded_behind_its_url_is_asked_the_new_route_in_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An SGLang found only at `/get_server_info` is asked there first, but not for
    ever: one upgraded in place without a round down (a rolling restart behind one URL)
    still answers there, with a deprecation warning at each ask, and was asked there
    every 2 s for good (helper-193).  After OLD_ROUTE_S `/server_info` is tried first
    again: an old one pays one 404, an upgraded one is asked there from then on."""
    clock = [1000.0]
    monkeypatch.setattr(prober_module, "_clock", lambda: clock[0])
    engine = _ServerInfoEngine({"/server_info"})
    asked = engine.asked

    async with serve(engine) as url, httpx.AsyncClient() as c:
        endpoint = {"name": "a", "url": url, "kind": "sglang", "models": ["m"], "dp_size": 2}
        prober = Prober(parse_config({"endpoints": [endpoint]}).expanded({}), c, lambda _: None)

        async def round_() -> list[tuple[str, int]]:
            asked.clear()
            assert all(r.healthy for r in await prober.probe_once())
            return list(asked)

        old, new = [("/get_server_info", 200)], [("/server_info", 200)]
        assert await round_() == [("/server_info", 404), *old]
        clock[0] += prober_module.OLD_ROUTE_S - 1
        assert await round_() == old
        clock[0] += 1  # still old: one 404, and asked at the old route again from now
        assert await round_() == [("/server_info", 404), *old]
        clock[0] += prober_module.OLD_ROUTE_S - 1
        assert await round_() == old
        engine.lacks = set()  # upgraded in place: both routes answer
        assert await round_() == old
        clock[0] += 1
        assert await round_() == new
        clock[0] += 10 * prober_module.OLD_ROUTE_S
        assert await round_() == new


async def test_a_reload_during_a_round_keeps_no_route_of_a_server_it_removed() -> None:
    """The round under way when a reload removed a server wrote its route back after
    the reload forgot it (helper-193): kept until the next reload, and asked first if
    the URL came back with another SGLang."""
    app = create_app(FakeEngineSettings(flavor="sglang", dp_size=2))
    arrived, release = asyncio.Event(), asyncio.Event()

    async def engine(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("path") == "/server_info":
            await PlainTextResponse("not found", status_code=404)(scope, receive, send)
            return
        if scope["type"] == "http" and scope.get("path") == "/get_server_info":
            arrived.set()
            await release.wait()
        await app(scope, receive, send)

    async with serve(engine) as url, serve(app) as other, httpx.AsyncClient() as c:
        endpoint = {"name": "a", "url": url, "kind": "sglang", "models": ["m"], "dp_size": 2}
        prober = Prober(parse_config({"endpoints": [endpoint]}).expanded({}), c, lambda _: None)
        round_ = asyncio.create_task(prober.probe_once())
        await asyncio.wait_for(arrived.wait(), 5)
        moved = {**endpoint, "url": other}
        prober.reconfigure(parse_config({"endpoints": [moved]}).expanded({}))
        release.set()
        await asyncio.wait_for(round_, 5)
        assert url not in prober._info_routes


async def test_an_old_sglangs_server_info_route_is_remembered_across_rounds() -> None:
    """A data-parallel SGLang is asked its server info every round (its dp_size says
    which ranks exist).  One from before `/server_info` was asked there first every
    round, a 404 in its log each 2 s: the route that answered is asked first from the
    next round on.  A server that loses that route (upgraded or downgraded in place)
    is asked the other one within the same round; one seen down may come back another
    version, and is asked `/server_info` first again."""
    engine = _ServerInfoEngine({"/server_info"})  # an SGLang from before it
    asked = engine.asked

    async with serve(engine) as url, httpx.AsyncClient() as c:
        endpoint = {"name": "a", "url": url, "kind": "sglang", "models": ["m"], "dp_size": 2}
        # dp_size 3: the server's info (dp_size 2) says rank 2 does not exist.
        cfg = parse_config({"endpoints": [{**endpoint, "dp_size": 3}]}).expanded({})
        prober = Prober(cfg, c, lambda results: None, period=60)

        async def round_() -> list[tuple[str, int]]:
            asked.clear()
            results = await prober.probe_once()
            assert [r.healthy for r in results] == [not engine.down] * 2 + [False]
            return list(asked)

        old = [("/get_server_info", 200)]
        assert await round_() == [("/server_info", 404), *old]
        for _ in range(3):
            assert await round_() == old, "asked where it answered"
        # Upgraded in place to an SGLang without the deprecated route.
        engine.lacks = {"/get_server_info"}
        assert await round_() == [("/get_server_info", 404), ("/server_info", 200)]
        assert await round_() == [("/server_info", 200)]
        # Downgraded again; then down for a round (a restart), and back.
        engine.lacks = {"/server_info"}
        assert await round_() == [("/server_info", 404), *old]
        assert await round_() == old
        engine.down = True
        await round_()
        engine.down = False
        assert await round_() == [("/server_info", 404), *old]
        assert await round_() == old
