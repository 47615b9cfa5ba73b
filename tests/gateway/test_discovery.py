"""Engines found by name (`discover = "dns"`): a real gateway, fake engines on two
loopback addresses (127.0.0.1 and ::1, the same port, as two pods behind one headless
Service), and a real DNS server over loopback UDP whose answers the test changes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import MODEL, POLL_S, POLLS, Recorder, endpoint, engine, gateway, until
from test_reload import calling_task, chat, from_file, one_streaming_one_held, toml

from gateway._shell import AdmissionShell
from gateway.discovery import Found, Resolver
from gateway.pool import Pool
from luftpause.config import Discovery, Endpoint, parse_config
from testkit.fake_dns import fake_dns
from testkit.fake_engine import FakeEngineSettings
from testkit.fake_engine import create_app as create_engine
from testkit.loopback import serve

NAME = "engines.test"


def v4(port: int) -> str:
    return f"pod-127.0.0.1:{port}"  # a replica's name: the endpoint's, its address and port


def v6(port: int) -> str:
    return f"pod-[::1]:{port}"


def _free_on_both() -> int:
    """A port free on 127.0.0.1 and on ::1."""
    for _ in range(50):
        with socket.socket() as s4:
            s4.bind(("127.0.0.1", 0))
            port = int(s4.getsockname()[1])
            with socket.socket(socket.AF_INET6) as s6:
                try:
                    s6.bind(("::1", port))
                except OSError:
                    continue
                return port
    raise RuntimeError("no port free on both 127.0.0.1 and ::1")


@contextlib.asynccontextmanager
async def pods(**kw: Any) -> AsyncIterator[tuple[int, Recorder, Recorder]]:
    """Two fake engines on one port, at 127.0.0.1 and at ::1: their port and what
    reached each."""
    port = _free_on_both()
    rec4 = Recorder(create_engine(FakeEngineSettings(**kw)))
    rec6 = Recorder(create_engine(FakeEngineSettings(**kw)))
    async with serve(rec4, host="127.0.0.1", port=port), serve(rec6, host="::1", port=port):
        yield port, rec4, rec6


@contextlib.asynccontextmanager
async def discovering(
    port: int, dns: str, period_s: float = 0.05, **kw: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, AdmissionShell]]:
    """A gateway whose one endpoint is discovered by asking `dns` every `period_s`;
    every address is an engine (family "all": the two pods here are one IPv4 and one
    IPv6 address)."""
    pod = endpoint("pod", f"http://{NAME}:{port}", discover="dns", **kw)
    discovery = {"nameservers": [dns], "period_s": period_s, "timeout_s": 0.5, "family": "all"}
    async with gateway(pod, sections={"discovery": discovery}) as (gw, shell):
        yield gw, shell


def serving(shell: AdmissionShell) -> set[str]:
    state = shell.state
    return {n for n, r in state.replicas.items() if n not in state.retired and r.healthy}


async def discovery_of(gw: httpx.AsyncClient) -> Any:
    return (await gw.get("/status")).json()["discovery"]["pod"]


async def discovered(gw: httpx.AsyncClient, pred: Callable[[Any], bool], what: str) -> Any:
    """/status's discovery of "pod" once `pred` holds of it (bounded polling)."""
    for _ in range(POLLS // 10):
        found = await discovery_of(gw)
        if pred(found):
            return found
        await asyncio.sleep(POLL_S * 10)
    raise AssertionError(f"never happened: {what}")


def hello() -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def test_engines_join_and_leave_as_the_name_resolves(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "gateway.app")
    async with pods() as (port, rec4, rec6), fake_dns() as (dns, where):
        dns.records[NAME] = ["127.0.0.1"]
        V4, V6 = v4(port), v6(port)
        async with discovering(port, where) as (gw, shell):
            # resolved before the gateway serves: the core starts with the engine
            assert set(shell.state.replicas) == {V4}
            messages: list[Any] = [{"role": "user", "content": calling_task()}]
            paused = await chat(gw, "r1", messages)
            assert paused["finish_reason"] == "tool_calls"
            assert shell.state.runs["r1"].replica == V4 and len(rec4.chats) == 1

            # a second pod is ready: it joins once probed, and a new run goes there
            dns.records[NAME] = ["127.0.0.1", "::1"]
            await until(lambda: serving(shell) == {V4, V6}, "the new pod in rotation")
            await chat(gw, "r2", [{"role": "user", "content": "hello"}])
            assert len(rec6.chats) == 1 and shell.state.runs["r2"].replica == V6
            # the same answer, round after round, changes nothing
            asked = dns.asked
            await until(lambda: dns.asked >= asked + 20, "ten more rounds")
            changes = [r.getMessage() for r in caplog.records if "discovery:" in r.getMessage()]
            assert changes == [f"discovery: added {V6}"]
            text = (await gw.get("/metrics")).text
            assert 'luftpause_discovery_engines{endpoint="pod"} 2.0' in text
            assert 'luftpause_discovery_up{endpoint="pod"} 1.0' in text
            (stamp,) = re.findall(
                r'luftpause_discovery_last_answer_timestamp_seconds\{endpoint="pod"\} (\S+)', text
            )
            assert abs(float(stamp) - time.time()) < 30
            assert f'luftpause_replica_retired{{replica="{V4}"}} 0.0' in text

            # the first pod goes: retired, and the run paused on it moves at its next turn
            dns.records[NAME] = ["::1"]
            await until(lambda: V4 in shell.state.retired, "the old pod retired")
            # no longer probed, it reads unhealthy: retired says it left by choice
            text = (await gw.get("/metrics")).text
            assert f'luftpause_replica_retired{{replica="{V4}"}} 1.0' in text
            assert f'luftpause_replica_retired{{replica="{V6}"}} 0.0' in text
            messages.append(paused["message"])
            for call in paused["message"]["tool_calls"]:
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": "x"})
            await chat(gw, "r1", messages)
            assert (len(rec4.chats), len(rec6.chats)) == (1, 2)
            assert set(shell.state.replicas) == {V6}, "forgotten once nothing is bound there"
            metrics = (await gw.get("/metrics")).text
            assert f'replica="{V6}"' in metrics and V4 not in metrics, "its series are gone"
            found = await discovery_of(gw)
            assert (found["host"], found["engines"], found["error"]) == (
                NAME,
                [f"[::1]:{port}"],
                None,
            )
            page = (await gw.get("/")).text  # the status page shows it too
            assert "Engines found by name" in page and f"[::1]:{port}" in page

            # the DNS server stops answering: the last answer stands, and status says why
            dns.silent = True
            found = await discovered(gw, lambda f: f["error"] is not None, "a round unanswered")
            assert found["engines"] == [f"[::1]:{port}"]
            assert "no answer within 0.5 s" in found["error"]
            text = (await gw.get("/metrics")).text  # the last answer served, and said so
            assert 'luftpause_discovery_engines{endpoint="pod"} 1.0' in text
            assert 'luftpause_discovery_up{endpoint="pod"} 0.0' in text
            assert serving(shell) == {V6}
            r = await gw.post("/v1/chat/completions", json=hello())
            assert r.status_code == 200, r.text

            # the Service has no ready pod (NXDOMAIN): no engine, and turns are told to
            # come back (503), not that the model is unknown (404)
            dns.silent = False
            dns.records.clear()
            state = lambda: shell.state  # noqa: E731
            await until(lambda: state().retired == set(state().replicas), "every pod retired")
            r = await gw.post("/v1/chat/completions", json=hello())
            assert r.status_code == 503 and r.headers["retry-after"]
            message = r.json()["error"]["message"]
            assert f"model '{MODEL}' has no engine now" in message
            assert f"endpoint pod: {NAME} resolves to no engine" in message
            listed = (await gw.get("/v1/models")).json()["data"]
            assert [m["id"] for m in listed] == [MODEL], "still offered: its engines come back"
            r = await gw.post("/v1/decide", json={"input": "go?", "labels": ["yes", "no"]})
            assert r.status_code == 503 and "has no engine now" in r.json()["error"]["message"]

            dns.records[NAME] = ["127.0.0.1"]
            await until(lambda: serving(shell) == {V4}, "a pod back")
            r = await gw.post("/v1/chat/completions", json=hello())
            assert r.status_code == 200, r.text
            assert len(rec4.chats) == 2


async def test_a_name_with_no_engine_at_start_answers_503_until_one_appears() -> None:
    async with (
        pods() as (port, rec4, _),
        fake_dns() as (dns, where),
        discovering(port, where, period_s=1.5) as (gw, shell),
    ):
        assert not shell.state.replicas
        r = await gw.post("/v1/messages", json={**hello(), "max_tokens": 4})
        assert r.status_code == 503, r.text
        # An engine can appear at the next discovery round (1.5 s), not at the next
        # probe's (0.05 s): a client told 1 s would come back to the same answer.
        assert r.headers["retry-after"] == "2"
        assert r.json()["error"]["type"] == "overloaded_error"  # Anthropic's 503
        assert "has no engine now" in r.json()["error"]["message"]
        # Refused by the core as a model not served, answered 503: counted (an
        # operator whose pods are gone saw no refusals at all).  So is /v1/decide's.
        r = await gw.post("/v1/decide", json={"input": "go?", "labels": ["yes", "no"]})
        assert r.status_code == 503 and "has no engine now" in r.json()["error"]["message"]
        assert r.headers["retry-after"] == "2"
        text = (await gw.get("/metrics")).text
        assert 'luftpause_rejected_turns_total{status="503"} 2.0' in text
        assert 'luftpause_turns_total{outcome="rejected"} 2.0' in text
        r = await gw.post("/v1/messages/count_tokens", json=hello())
        assert r.status_code == 503 and "has no engine now" in r.json()["error"]["message"]
        assert r.headers["retry-after"] == "2"
        r = await gw.post("/v1/chat/completions", json=hello())
        assert (r.status_code, r.headers["retry-after"]) == (503, "2"), r.text

        dns.records[NAME] = ["127.0.0.1"]
        await until(lambda: serving(shell) == {v4(port)}, "the pod in rotation")
        r = await gw.post("/v1/chat/completions", json=hello())
        assert r.status_code == 200, r.text
        assert len(rec4.chats) == 1


async def test_the_system_resolver_finds_localhost() -> None:
    async with pods() as (port, rec4, rec6):
        pod = endpoint("pod", f"http://localhost:{port}", discover="dns")
        async with gateway(pod) as (gw, shell):
            # getaddrinfo reads /etc/hosts: localhost is 127.0.0.1 (and ::1 where listed,
            # which family "v4_preferred" leaves out: one engine, not two)
            assert set(shell.state.replicas) == {v4(port)}
            r = await gw.post("/v1/chat/completions", json=hello())
            assert r.status_code == 200, r.text
            assert (len(rec4.chats), len(rec6.chats)) == (1, 0)
            found = await discovery_of(gw)
            assert (found["host"], found["engines"]) == ("localhost", [f"127.0.0.1:{port}"])


async def test_a_reload_resolves_at_once_and_applies_discovery(tmp_path: Path) -> None:
    async with pods() as (port, _, rec6), fake_dns() as (dns, where):
        dns.records[NAME] = ["127.0.0.1"]
        dns.records["other.test"] = ["::1"]
        path = tmp_path / "luftpause.toml"

        def write(host: str, period: float) -> None:
            pod = {"name": "pod", "url": f"http://{host}:{port}", "models": [MODEL]}
            section = (
                f'\n[discovery]\nnameservers = ["{where}"]\nperiod_s = {period}\nfamily = "all"\n'
            )
            path.write_text(toml({**pod, "discover": '"dns"'}, extra=section))

        write(NAME, 0.05)
        V4, V6 = v4(port), v6(port)
        async with from_file(path) as (gw, shell):
            assert set(shell.state.replicas) == {V4}
            r = await gw.post("/reload")
            unchanged = {"added": [], "removed": [], "changed": [], "applied": []}
            assert r.json() == {**unchanged, "not_applied": []}

            # another name, resolved by the reload itself (the next round is a minute away)
            write("other.test", 60.0)
            r = await gw.post("/reload")
            assert r.json() == {
                **unchanged,
                "added": [V6],
                "removed": [V4],
                "applied": ["discovery"],
                "not_applied": [],
            }
            assert serving(shell) == {V6}
            r = await gw.post("/v1/chat/completions", json=hello())
            assert r.status_code == 200, r.text
            assert len(rec6.chats) == 1


async def test_a_reload_starts_the_discovery_period_anew_at_its_own_length(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A reload from period_s = 60 to 0.05 said "applied: discovery", but the round it
    # asked for waited out the old 60 s first (up to an hour at the largest period).
    async with pods() as (port, _, _), fake_dns() as (dns, where):
        dns.records[NAME] = ["127.0.0.1"]
        path = tmp_path / "luftpause.toml"

        def write(period: float, namespace: str = "default") -> None:
            pod = {"name": "pod", "url": f"http://{NAME}:{port}", "models": [MODEL]}
            section = (
                f'\n[discovery]\nnameservers = ["{where}"]\nperiod_s = {period}\n'
                f'\n[temporal]\nnamespace = "{namespace}"\n'
            )
            path.write_text(toml({**pod, "discover": '"dns"'}, extra=section))

        write(60.0)
        async with from_file(path) as (gw, shell):
            assert serving(shell) == {v4(port)}
            write(0.05, namespace="elsewhere")  # and a start-only section
            r = (await gw.post("/reload")).json()
            assert (r["applied"], r["not_applied"]) == (["discovery"], ["temporal"])
            with caplog.at_level(logging.INFO, logger="gateway.app"):
                dns.records[NAME] = ["127.0.0.2"]  # the pod moved: seen by the next round
                await until(lambda: f"pod-127.0.0.2:{port}" in shell.state.replicas, "a round")

                def said() -> list[str]:  # logged once the round's probe is back
                    lines = (r.getMessage() for r in caplog.records)
                    return [line for line in lines if "discovery:" in line]

                await until(lambda: bool(said()), "the round's log line")
            # the round says what it changed, not the reload's "restart to apply" again
            (line,) = said()
            assert line == f"discovery: added pod-127.0.0.2:{port}; removed {v4(port)}"


@pytest.mark.parametrize(
    ("family", "answer", "engines"),
    [
        # a dual-stack pod is one engine, not two
        (
            "v4_preferred",
            ["10.0.0.9", "fd00::9", "10.0.0.10", "10.0.0.9"],
            ["10.0.0.9", "10.0.0.10"],
        ),
        ("v4_preferred", ["fd00::9"], ["fd00::9"]),  # an IPv6-only cluster
        ("v4_only", ["fd00::9"], []),
        ("v6_only", ["10.0.0.9", "fd00::9"], ["fd00::9"]),
        ("all", ["fd00::9", "10.0.0.9"], ["10.0.0.9", "fd00::9"]),
    ],
)
async def test_which_addresses_are_engines(
    family: str, answer: list[str], engines: list[str]
) -> None:
    async with fake_dns() as (dns, where):
        dns.records[NAME] = answer
        pod = Endpoint(
            name="pod", url=f"http://{NAME}:1", kind="sglang", models=["m"], discover="dns"
        )
        section = Discovery(nameservers=[where], family=family)  # type: ignore[arg-type]
        found = await Resolver().resolve_all([pod], section, {})
        netlocs = tuple(f"[{a}]:1" if ":" in a else f"{a}:1" for a in engines)  # url's port
        assert found["pod"].engines == netlocs and found["pod"].error is None


async def test_the_system_resolvers_no_such_name_is_believed_at_the_second_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # glibc answers EAI_NONAME for a short name whose own query timed out when a search
    # domain's answered NXDOMAIN: one such answer retired every engine of the endpoint.
    # All of them vanishing at once is believed when the next answer says so too; a
    # failure to ask (EAI_AGAIN) keeps the last answer, as before.
    loop = asyncio.get_running_loop()
    answers: list[Any] = []

    async def getaddrinfo(host: str, port: Any, **kw: Any) -> Any:
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 0)) for a in answer]

    monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)
    pod = Endpoint(
        name="pod", url="http://sglang-headless:1", kind="sglang", models=["m"], discover="dns"
    )
    resolver, section = Resolver(), Discovery()
    no_name = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    again = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
    answers += [["10.0.0.9"], no_name, ["10.0.0.9"], again, no_name, no_name]
    first = await resolver.resolve_all([pod], section, {})
    assert first["pod"].engines == ("10.0.0.9:1",)
    once = await resolver.resolve_all([pod], section, first)
    assert once["pod"].engines == ("10.0.0.9:1",) and "resolved to no engine" in str(
        once["pod"].error
    )
    back = await resolver.resolve_all([pod], section, once)  # it was a blip
    assert back["pod"].engines == ("10.0.0.9:1",) and back["pod"].error is None
    failed = await resolver.resolve_all([pod], section, back)
    assert failed["pod"].engines == ("10.0.0.9:1",)
    assert "the system resolver failed: Temporary failure" in str(failed["pod"].error)
    once = await resolver.resolve_all([pod], section, failed)
    assert once["pod"].engines == ("10.0.0.9:1",)
    gone = await resolver.resolve_all([pod], section, once)
    assert gone["pod"].engines == () and gone["pod"].error is None and not answers


async def test_a_failing_aaaa_query_does_not_hide_the_a_records() -> None:
    # A server that mishandles AAAA (SERVFAIL) while it answers A: with v4_preferred the
    # A records are the engines whatever AAAA says; the system resolver agreed, the
    # nameservers path found no engine (at start: none ever).
    async with fake_dns() as (dns, where):
        dns.records[NAME] = ["10.0.0.9"]
        dns.failing_types.add("AAAA")
        pod = Endpoint(
            name="pod", url=f"http://{NAME}:1", kind="sglang", models=["m"], discover="dns"
        )
        found = await Resolver().resolve_all([pod], Discovery(nameservers=[where]), {})
        assert found["pod"].engines == ("10.0.0.9:1",) and found["pod"].error is None
        # Where AAAA decides (no A record, or v6 wanted), its failure is no answer.
        dns.records[NAME] = ["fd00::9"]
        for family in ("v4_preferred", "v6_only"):
            section = Discovery(nameservers=[where], family=family)  # type: ignore[arg-type]
            found = await Resolver().resolve_all([pod], section, {})
            assert found["pod"].engines == () and "SERVFAIL" in str(found["pod"].error), family


async def test_an_unanswered_name_keeps_the_last_answer_for_that_name_only() -> None:
    async with fake_dns() as (dns, where):
        dns.records[NAME] = ["10.0.0.9"]
        pod = Endpoint(
            name="pod", url=f"http://{NAME}:1", kind="sglang", models=["m"], discover="dns"
        )
        section = Discovery(nameservers=[where], timeout_s=0.2)
        resolver = Resolver()
        before = await resolver.resolve_all([pod], section, {})
        dns.silent = True
        kept = await resolver.resolve_all([pod], section, before)
        assert kept["pod"].engines == ("10.0.0.9:1",) and "no answer within 0.2 s" in str(
            kept["pod"].error
        )
        assert kept["pod"].resolved_at == before["pod"].resolved_at
        # the file now names another host: the old host's answer is not this one's
        for url in ("http://elsewhere.test:1", f"http://{NAME}:2"):  # another name, port
            moved = pod.model_copy(update={"url": url})
            fresh = await resolver.resolve_all([moved], section, before)
            assert fresh["pod"].engines == () and fresh["pod"].resolved_at is None


async def test_srv_records_give_the_engines_and_their_ports() -> None:
    async with fake_dns() as (dns, where):
        name = "_http._tcp.pods.test"
        dns.services[name] = [
            (10, 5, 8001, "a.test."),
            (10, 5, 8002, "b.test."),
            (10, 5, 8003, "a.test."),  # two engines on one host
            (20, 5, 9000, "c.test."),  # a fallback (a higher priority value): not an engine
        ]
        dns.records |= {"a.test": ["10.0.0.1", "fd00::1"], "b.test": ["10.0.0.2"]}
        dns.records["c.test"] = ["10.0.0.3"]
        pod = Endpoint(
            name="pod", url=f"http://{name}", kind="sglang", models=["m"], discover="dns-srv"
        )
        found = await Resolver().resolve_all([pod], Discovery(nameservers=[where]), {})
        assert found["pod"].engines == ("10.0.0.1:8001", "10.0.0.1:8003", "10.0.0.2:8002")
        # a target whose name gets no answer keeps its engines; a new one joins meanwhile
        dns.services[name] += [(10, 5, 8004, "d.test."), (10, 5, 8005, "e.test.")]
        dns.records["d.test"] = ["10.0.0.4"]
        dns.failing |= {"b.test", "e.test"}
        found = await Resolver().resolve_all([pod], Discovery(nameservers=[where]), found)
        assert found["pod"].engines == (
            "10.0.0.1:8001",
            "10.0.0.1:8003",
            "10.0.0.2:8002",
            "10.0.0.4:8004",
        )
        error = str(found["pod"].error)
        assert "target b.test." in error and "its last addresses kept" in error
        assert "target e.test." in error and "none known" in error
        dns.failing.clear()
        dns.services[name] = []  # the service has no instance: no engine, once two answers
        kept = await Resolver().resolve_all([pod], Discovery(nameservers=[where]), found)
        assert kept["pod"].engines == found["pod"].engines
        assert "resolved to no engine; the last answer stands" in str(kept["pod"].error)
        gone = await Resolver().resolve_all([pod], Discovery(nameservers=[where]), kept)
        assert gone["pod"].engines == () and gone["pod"].error is None


async def test_a_gateway_serves_the_engines_an_srv_name_gives() -> None:
    async with (
        engine() as (url_a, rec_a),
        engine() as (url_b, rec_b),
        fake_dns() as (dns, where),
    ):
        ports = [int(u.rsplit(":", 1)[1]) for u in (url_a, url_b)]
        name = "_http._tcp.engines.test"
        dns.services[name] = [(0, 1, ports[0], "node.test.")]
        dns.records["node.test"] = ["127.0.0.1"]
        pod = endpoint("pod", f"http://{name}", discover="dns-srv")
        section = {"nameservers": [where], "period_s": 0.05}
        async with gateway(pod, sections={"discovery": section}) as (gw, shell):
            first, second = (f"pod-127.0.0.1:{p}" for p in ports)
            assert set(shell.state.replicas) == {first}
            dns.services[name].append((0, 1, ports[1], "node.test."))  # one more instance
            await until(lambda: serving(shell) == {first, second}, "the second in rotation")
            for run in ("r1", "r2"):  # one run on each: the least loaded first
                await chat(gw, run, [{"role": "user", "content": calling_task()}])
            assert (len(rec_a.chats), len(rec_b.chats)) == (1, 1)


async def test_a_replica_that_leaves_with_nothing_bound_drops_its_series() -> None:
    async with pods() as (port, rec4, _), fake_dns() as (dns, where):
        dns.records[NAME] = ["127.0.0.1", "::1"]
        async with discovering(port, where) as (gw, shell):
            r = await gw.post("/v1/chat/completions", json=hello())  # no tools: run idle
            assert r.status_code == 200 and len(rec4.chats) == 1
            assert f'replica="{v4(port)}"' in (await gw.get("/metrics")).text
            dns.records[NAME] = ["::1"]  # retired and forgotten in one step
            await until(lambda: v4(port) not in shell.state.replicas, "the pod forgotten")
            assert v4(port) not in (await gw.get("/metrics")).text


async def test_held_turns_whose_engines_all_left_are_told_to_retry() -> None:
    # kv_tokens = 400: one run at a time, so the second turn is held by the gateway.
    # The first streams for some 6 s (time_scale 0.25), well past the discovery round
    # (1.2 s) that finds the engines gone: at 0.5 (3 s) a loaded machine once let it
    # end first, and the held turn went to the engine (session 41's make test).
    async with pods(time_scale=0.25) as (port, _, _), fake_dns() as (dns, where):
        dns.records[NAME] = ["127.0.0.1"]
        async with (
            discovering(port, where, period_s=1.2, kv_tokens=400) as (gw, shell),
            one_streaming_one_held(gw, shell) as (lines, second),
        ):
            # a decision too large for the KV left: held behind the two turns
            body = {"input": "x " * 200, "labels": ["yes", "no"]}
            decision = asyncio.ensure_future(gw.post("/v1/decide", json=body))
            await until(lambda: shell.state.held_count() == 2, "the decision held")
            dns.records.clear()
            answer = await decision
            assert answer.status_code == 503, answer.text
            assert "has no engine now" in answer.json()["error"]["message"]
            assert answer.headers["retry-after"] == "2"  # the discovery round's 1.2 s
            second_answer = await second  # the chat turn held too
            assert second_answer.status_code == 503, second_answer.text
            assert second_answer.headers["retry-after"] == "2"
            assert "has no engine now" in second_answer.json()["error"]["message"]
            # Counted as the clients were answered, not as the core's 404 ("unknown
            # model": an alert on it would call an outage a configuration error).
            text = (await gw.get("/metrics")).text
            assert 'luftpause_rejected_turns_total{status="503"} 2.0' in text
            assert 'status="404"' not in text
            events = [line async for line in lines]
            assert [e for e in events if e.startswith("data:")][-1] == "data: [DONE]"


async def test_a_server_that_does_not_answer_leaves_time_for_the_next() -> None:
    async with fake_dns() as (dead, first), fake_dns() as (live, second):
        dead.silent = True
        live.records[NAME] = ["10.0.0.9"]
        pod = Endpoint(
            name="pod", url=f"http://{NAME}:1", kind="sglang", models=["m"], discover="dns"
        )
        section = Discovery(nameservers=[first, second], timeout_s=1.0)
        found = await Resolver().resolve_all([pod], section, {})
        assert found["pod"].engines == ("10.0.0.9:1",) and found["pod"].error is None
        assert dead.asked >= 1 and live.asked >= 1


def test_models_awaiting_engines_keep_their_place_and_their_apis() -> None:
    file = parse_config(
        {
            "endpoints": [
                {
                    "name": "pod",
                    "url": "http://hosted.test:8000",
                    "kind": "openai",
                    "models": ["big"],
                    "discover": "dns",
                },
                {"name": "a", "url": "http://h:1", "kind": "sglang", "models": ["small"]},
            ]
        }
    )
    pool = Pool.of(file, {})
    assert pool.models == ("small",) and pool.awaiting == {"big": ("pod",)}
    assert pool.offered == ("big", "small"), "the file's first is the default, up or not"
    assert pool.lacking["messages"]["big"] == ["pod"], "an openai kind serves no Messages"
    assert pool.awaited("small") is None and "not resolved yet" in str(pool.awaited("big"))
    found = {"pod": Found("hosted.test", ("10.0.0.9:8000",), 1.0)}
    up = Pool.of(file, found)
    assert up.models == ("big", "small") and not up.awaiting and up.awaited("big") is None
