"""`/status`, its page `/` and `/metrics`: the snapshot as a pure function of a state
built with the core's `decide`, the metrics' observations of decisions, and the routes
over real loopback HTTP with a fake engine."""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest
from harness import chat, closed_port_url, endpoint, engine, gateway, until
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import gateway.app as app_module
import gateway.metrics as metrics_module
from gateway._shell import AdmissionShell
from gateway.app import anothers, owns
from gateway.metrics import GatewayMetrics
from gateway.prober import ProbeResult
from gateway.status import (
    PAGE_RUNS,
    TOP_CALLERS,
    WAITING,
    claims_of,
    render_status_page,
    run_view,
    runs_listing,
    status_snapshot,
)
from scheduler import (
    Event,
    Policy,
    ReplicaProbed,
    ReplicaSpec,
    ServiceClass,
    State,
    Tick,
    TurnAbandoned,
    TurnArrived,
    TurnFailed,
    TurnFinished,
    TurnStarted,
    decide,
)
from testkit.engine import EngineParams

MODEL = "llama-3.2-1b"
# Bounded polling: 1000 x 10 ms.
INTERACTIVE, BATCH = ServiceClass.INTERACTIVE, ServiceClass.BATCH
METRIC_NAMES = (
    "luftpause_held_turns",
    "luftpause_runs",
    "luftpause_replica_in_flight",
    "# TYPE luftpause_replica_cap gauge",  # no sample: the replica is uncapped
    "luftpause_engine_queued",
    "luftpause_engine_running",
    "luftpause_replica_healthy",
    "luftpause_admissions_total",
    "luftpause_affinity_hits_total",
    "luftpause_turns_total",
    "luftpause_held_seconds_count",
    "luftpause_turn_seconds_count",
    "luftpause_turn_first_byte_seconds_count",
)


def arrived(
    now: float,
    turn: str,
    run: str,
    caller: str,
    cls: ServiceClass = INTERACTIVE,
    prompt: int = 0,
    reply: int = 0,
) -> TurnArrived:
    return TurnArrived(
        now=now,
        turn_id=turn,
        run_id=run,
        service_class=cls,
        caller=caller,
        model=MODEL,
        prompt_tokens=prompt,
        max_tokens=reply,
    )


def pool() -> State:
    """Replica a (KV pool 10000 tokens) capped at 1 by its engine's queue; b down."""
    specs = [
        ReplicaSpec(name="a", models=frozenset({MODEL}), kv_tokens=10_000),
        ReplicaSpec(name="b", models=frozenset({MODEL})),
    ]
    return State.initial(specs, Policy())


def run_events(
    state: State, events: Sequence[Event], metrics: GatewayMetrics | None = None
) -> State:
    for ev in events:
        before = state
        state, actions = decide(state, ev)
        if metrics is not None:
            metrics.observe(before, ev, actions)
    return state


CAPPED: list[Event] = [
    # a queue in two probes in a row caps a (Policy.cap_after_queued_probes); its
    # engine runs 8 requests at once, as it says
    ReplicaProbed(now=0.0, replica="a", healthy=True, queued=1, running=1, slots=8),
    ReplicaProbed(now=0.0, replica="a", healthy=True, queued=1, running=1),
    ReplicaProbed(now=0.0, replica="b", healthy=False),
]
SCENE: list[Event] = [
    *CAPPED,
    arrived(1.0, "t1", "r1", "alice", prompt=100, reply=50),  # admitted to a
    arrived(2.0, "t2", "r2", "bob", BATCH),  # held: a is full
    arrived(3.0, "t3", "r3", "bob", prompt=40, reply=10),  # held
    arrived(4.0, "t4", "r4", "carol"),  # held
    # r1 pauses on a tool; a's slot goes to bob's interactive turn (bob's first in flight)
    TurnFinished(
        now=5.0,
        turn_id="t1",
        finish_reason="tool_calls",
        prompt_tokens=100,
        completion_tokens=20,
        cached_tokens=60,
    ),
]


def test_snapshot_of_a_hand_built_state() -> None:
    state = run_events(pool(), SCENE)
    probes = {
        "a": ProbeResult(endpoint="a", healthy=True, queued=1, running=1),
        "b": ProbeResult(endpoint="b", healthy=False, error="cannot connect"),
    }
    snap = status_snapshot(state, probes, {"tool_call_ids_remembered": 3}, 10.0)
    assert snap == {
        "replicas": [
            {
                "name": "a",
                "healthy": True,
                "retired": False,
                "probe_error": None,
                "ejected_s": None,
                "failures_in_a_row": 0,
                "engine_queued": 1,
                "engine_running": 1,
                "cap": 1,
                "slots": 8,
                "in_flight": 1,
                "paused_interactive": 1,
                "bound_runs": 2,
                # r1 paused: 120 context + 50 reply; r3 generating: 40 + 10
                "kv_working_set_tokens": 220,
                "kv_limit_tokens": 8000,
                "kv_batch_limit_tokens": 7000,  # 70 % of the pool (no lane here)
                "interactive_lane": False,
                "device": None,
                "led_by": None,
            },
            {
                "name": "b",
                "healthy": False,
                "retired": False,
                "probe_error": "cannot connect",
                "ejected_s": None,
                "failures_in_a_row": 0,
                "engine_queued": None,
                "engine_running": None,
                "cap": None,
                "slots": None,
                "in_flight": 0,
                "paused_interactive": 0,
                "bound_runs": 0,
                "kv_working_set_tokens": 0,
                "kv_limit_tokens": None,
                "kv_batch_limit_tokens": None,
                "interactive_lane": False,
                "device": None,
                "led_by": None,
            },
        ],
        "held": {
            "total": 2,
            "by_class": {"interactive": 1, "batch": 1},
            "oldest_wait_by_class_s": {"interactive": 6.0, "batch": 8.0},
            "callers": 2,
            "by_caller": [
                {"caller": "bob", "held": 1, "in_flight": 1, "oldest_wait_s": 8.0},
                {"caller": "carol", "held": 1, "in_flight": 0, "oldest_wait_s": 6.0},
            ],
            "oldest_wait_s": 8.0,
        },
        "runs": {
            "by_phase_and_class": {
                "generating": {"interactive": 1, "batch": 0},
                "paused": {"interactive": 1, "batch": 0},
                "idle": {"interactive": 0, "batch": 0},
                # r2 and r4: turns held, none admitted yet (as GET /v1/runs lists them)
                "waiting": {"interactive": 1, "batch": 1},
            },
            "total": 4,
        },
        "prompt_scale": {},  # no turn has finished: nothing learned
        # t1, its run's first turn, found 60 tokens cached: one sample, no prefix yet
        "shared_prefix": {"llama-3.2-1b": 0},
        "tool_call_ids_remembered": 3,
    }


def test_snapshot_lists_the_callers_with_most_held_turns_first() -> None:
    events = list(CAPPED)
    events.append(arrived(0.0, "busy", "busy", "busy"))  # takes a's one slot
    events += [arrived(1.0, f"t{i}", f"r{i}", f"caller {i:03}") for i in range(TOP_CALLERS + 10)]
    events += [arrived(2.0 + i, f"many{i}", f"many{i}", "many") for i in range(3)]
    state = run_events(pool(), events)
    snap = status_snapshot(state, {}, {}, 20.0)
    by_caller = snap["held"]["by_caller"]
    assert len(by_caller) == TOP_CALLERS
    assert snap["held"]["callers"] == TOP_CALLERS + 11  # the list says it is a part
    assert f"(the {TOP_CALLERS} with the most, of {TOP_CALLERS + 11})" in render_status_page(snap)
    assert by_caller[0] == {"caller": "many", "held": 3, "in_flight": 0, "oldest_wait_s": 18.0}
    assert by_caller[1]["caller"] == "caller 000"
    assert snap["held"]["total"] == TOP_CALLERS + 13
    assert snap["held"]["oldest_wait_s"] == 19.0


def test_page_escapes_what_callers_send() -> None:
    state = run_events(
        pool(),
        [
            *CAPPED,
            arrived(0.0, "t0", "r0", "first"),
            arrived(1.0, "t1", "r1", "<script>alert(1)</script>"),
        ],
    )
    snapshot = status_snapshot(state, {}, {}, 2.0)
    snapshot["recent_runs"] = runs_listing(state, 2.0, limit=PAGE_RUNS)["runs"]
    page = render_status_page(snapshot)
    assert '<meta http-equiv="refresh" content="2">' in page
    assert "<h2>Held turns by caller</h2>" in page  # all of them: no "of N"
    # in the held turns by caller, and in the runs
    assert page.count("&lt;script&gt;alert(1)&lt;/script&gt;") == 2
    assert "<script>" not in page


def sample(metrics: GatewayMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_metrics_observe_admissions_outcomes_and_affinity() -> None:
    state = pool()
    metrics = GatewayMetrics(lambda: (state, {}))
    state = run_events(
        state,
        [
            *SCENE,
            arrived(6.0, "t5", "r1", "alice"),  # r1 comes back: held for a (affinity)
            TurnAbandoned(now=6.5, turn_id="t4"),  # carol leaves while held
            TurnFailed(now=7.0, turn_id="t3", engine_fault=True),  # frees a: r1's turn goes there
            TurnStarted(now=7.25, turn_id="t5"),  # its first byte 0.25 s after admission
            TurnStarted(now=7.5, turn_id="t2"),  # still held (no such report): not counted
            TurnAbandoned(now=9.0, turn_id="unknown"),  # the core never knew it: not counted
        ],
        metrics,
    )
    rejected = TurnArrived(
        now=9.0, turn_id="t7", run_id="r7", service_class=BATCH, caller="eve", model="nope"
    )
    state = run_events(state, [rejected], metrics)
    assert (
        sample(metrics, "luftpause_admissions_total", replica="a", **{"class": "interactive"}) == 3
    )
    assert sample(metrics, "luftpause_affinity_hits_total") == 1
    assert sample(metrics, "luftpause_turns_total", outcome="finished") == 1
    assert sample(metrics, "luftpause_turns_total", outcome="failed") == 1
    assert sample(metrics, "luftpause_turns_total", outcome="abandoned") == 1
    assert sample(metrics, "luftpause_turns_total", outcome="rejected") == 1
    # Per replica: only turns that reached one (t4 was abandoned while held).
    assert sample(metrics, "luftpause_engine_turns_total", replica="a", outcome="finished") == 1
    assert sample(metrics, "luftpause_engine_turns_total", replica="a", outcome="failed") == 1
    assert sample(metrics, "luftpause_engine_turns_total", replica="a", outcome="abandoned") is None
    # Tokens as the engine reported them for t1: cached / prompt is a's cache hit rate.
    on_a = {"replica": "a", "class": "interactive"}
    assert sample(metrics, "luftpause_prompt_tokens_total", **on_a) == 100
    assert sample(metrics, "luftpause_cached_tokens_total", **on_a) == 60
    assert sample(metrics, "luftpause_completion_tokens_total", **on_a) == 20
    # t1 held 0 s, t3 held 2 s (3 -> 5), t5 held 1 s (6 -> 7)
    assert sample(metrics, "luftpause_held_seconds_count", **{"class": "interactive"}) == 3
    assert sample(metrics, "luftpause_held_seconds_sum", **{"class": "interactive"}) == 3.0
    # and those that left unadmitted: t4 after 2.5 s (4 -> 6.5); t7 was never held
    # (helper-146: the longest waits were in no histogram)
    left = {"class": "interactive"}
    assert sample(metrics, "luftpause_held_unadmitted_seconds_count", **left) == 1
    assert sample(metrics, "luftpause_held_unadmitted_seconds_sum", **left) == 2.5
    assert sample(metrics, "luftpause_held_unadmitted_seconds_count", **{"class": "batch"}) == 0
    # t1 ran 1 -> 5, t3 ran 5 -> 7 (an abandoned held turn never ran)
    assert sample(metrics, "luftpause_turn_seconds_count", **{"class": "interactive"}) == 2
    assert sample(metrics, "luftpause_turn_seconds_sum", **{"class": "interactive"}) == 6.0
    first = {"class": "interactive"}
    assert sample(metrics, "luftpause_turn_first_byte_seconds_count", **first) == 1
    assert sample(metrics, "luftpause_turn_first_byte_seconds_sum", **first) == 0.25
    assert sample(metrics, "luftpause_turn_first_byte_seconds_count", **{"class": "batch"}) == 0
    # gauges from the state at scrape time
    assert sample(metrics, "luftpause_held_turns", **{"class": "batch"}) == 1
    assert sample(metrics, "luftpause_held_turns", **{"class": "interactive"}) == 0
    assert sample(metrics, "luftpause_runs", phase="generating", **{"class": "interactive"}) == 1
    assert sample(metrics, "luftpause_replica_in_flight", replica="a") == 1
    assert sample(metrics, "luftpause_replica_cap", replica="a") == 1
    assert sample(metrics, "luftpause_engine_slots", replica="a") == 8
    assert sample(metrics, "luftpause_engine_slots", replica="b") is None  # unknown
    # A turn never reported finished times out after 10 minutes: counted as timed_out.
    assert sample(metrics, "luftpause_turns_total", outcome="timed_out") == 0
    state = run_events(state, [Tick(now=7.0 + 600)], metrics)
    assert sample(metrics, "luftpause_turns_total", outcome="timed_out") == 1
    assert sample(metrics, "luftpause_engine_turns_total", replica="a", outcome="timed_out") == 1
    # ... and in the turns' time, which without it lacked exactly the slowest (t5: 600 s)
    assert sample(metrics, "luftpause_turn_seconds_count", **{"class": "interactive"}) == 3
    assert sample(metrics, "luftpause_turn_seconds_sum", **{"class": "interactive"}) == 606.0
    assert sample(metrics, "luftpause_replica_cap", replica="b") is None  # uncapped
    assert sample(metrics, "luftpause_replica_healthy", replica="b") == 0
    assert sample(metrics, "luftpause_engine_running", replica="a") == 1


# --------------------------------------------------------------------------- over HTTP


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse_metrics(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(parsed: Samples, name: str, **labels: str) -> float:
    return parsed[name, frozenset(labels.items())]


async def test_status_page_and_metrics_with_held_turns() -> None:
    one = replace(EngineParams.reference(), max_running_requests=1)
    async with (
        # vLLM: it does not report the requests it runs at once, so luftpause caps
        # from its queue (an SGLang engine's slots would hold the second turn).
        engine(time_scale=1, engine=one, flavor="vllm") as (url, counted),
        gateway(endpoint("a", url, kind="vllm")) as (gw, shell),
    ):
        # The engine's clock stands still: the queue of one lasts until the test ends.
        counted.app.state.clock.stop()

        def send(content: str, cls: str, caller: str, max_tokens: int) -> asyncio.Task[Any]:
            headers = {"x-luftpause-class": cls, "x-luftpause-caller": caller}
            body = chat(content, max_tokens=max_tokens)
            return asyncio.create_task(gw.post("/v1/chat/completions", json=body, headers=headers))

        tasks = [send(f"long {i}", "interactive", "a", 60) for i in range(2)]
        try:
            await until(lambda: shell.state.replicas["a"].cap == 1, "capped at the engine's 1")
            tasks.append(send("held i", "interactive", "<b>x</b>", 5))
            await until(lambda: shell.state.held_count() == 1, "interactive turn held")
            tasks.append(send("held b", "batch", "bob", 5))
            await until(lambda: shell.state.held_count() == 2, "batch turn held")
            await asyncio.sleep(0.05)

            r = await gw.get("/status")
            assert r.status_code == 200
            snap = r.json()
            held = snap["held"]
            assert held["total"] == 2
            assert held["by_class"] == {"interactive": 1, "batch": 1}
            callers = {c["caller"]: c for c in held["by_caller"]}
            assert set(callers) == {"<b>x</b>", "bob"}
            assert callers["<b>x</b>"]["held"] == 1 and callers["<b>x</b>"]["oldest_wait_s"] > 0
            assert callers["bob"]["in_flight"] == 0
            assert held["oldest_wait_s"] >= callers["bob"]["oldest_wait_s"] > 0
            (a,) = snap["replicas"]
            assert a["name"] == "a" and a["healthy"] and a["probe_error"] is None
            assert (a["engine_running"], a["cap"], a["in_flight"]) == (1, 1, 2)
            assert snap["runs"]["by_phase_and_class"]["generating"] == {
                "interactive": 2,
                "batch": 0,
            }
            # the two waiting for admission too, as the page and GET /v1/runs count them
            assert snap["runs"]["by_phase_and_class"]["waiting"] == {"interactive": 1, "batch": 1}
            assert snap["runs"]["total"] == 4
            assert snap["tool_call_ids_remembered"] == 0
            assert abs(snap["time"] - time.time()) < 60  # wall time, not the loop's clock

            page = await gw.get("/")
            assert page.status_code == 200
            assert page.headers["content-type"].startswith("text/html")
            assert '<meta http-equiv="refresh" content="2">' in page.text
            assert "&lt;b&gt;x&lt;/b&gt;" in page.text
            assert "<b>x</b>" not in page.text
            # The runs themselves, the two generating and the two waiting for admission.
            assert "Runs, the most recently active first" in page.text
            ids = {*shell.state.runs.keys(), *(t.run_id for t in shell.state.held())}
            assert len(ids) == 4 and all(i in page.text for i in ids)
            assert page.text.count("<td>waiting</td><td></td>") == 2  # no replica yet
            assert page.text.count("<td>generating</td><td>a</td>") == 2

            m = await gw.get("/metrics")
            assert m.status_code == 200
            parsed = parse_metrics(m.text)
            assert value(parsed, "luftpause_held_turns", **{"class": "interactive"}) == 1
            assert value(parsed, "luftpause_held_turns", **{"class": "batch"}) == 1
            assert value(parsed, "luftpause_replica_in_flight", replica="a") == 2
            assert value(parsed, "luftpause_replica_cap", replica="a") == 1
            assert value(parsed, "luftpause_engine_running", replica="a") == 1
            assert value(parsed, "luftpause_replica_healthy", replica="a") == 1
            assert (
                value(parsed, "luftpause_runs", phase="generating", **{"class": "interactive"}) == 2
            )
            assert value(parsed, "luftpause_runs", phase="waiting", **{"class": "batch"}) == 1
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def test_metrics_after_one_turn() -> None:
    async with engine(instant=True) as (url, _), gateway(endpoint("a", url)) as (gw, shell):
        run = {"x-luftpause-run-id": "r"}
        r = await gw.post("/v1/chat/completions", json=chat("one"), headers=run)
        assert r.status_code == 200
        await until(lambda: not shell.state.turns, "turn finished")
        text = (await gw.get("/metrics")).text
        for name in METRIC_NAMES:
            assert f"\n{name}" in text, name
        parsed = parse_metrics(text)
        assert ("luftpause_replica_cap", frozenset({("replica", "a")})) not in parsed  # uncapped
        interactive = {"class": "interactive"}
        assert value(parsed, "luftpause_admissions_total", replica="a", **interactive) == 1
        assert value(parsed, "luftpause_turns_total", outcome="finished") == 1
        assert value(parsed, "luftpause_turns_total", outcome="failed") == 0
        assert value(parsed, "luftpause_held_seconds_count", **interactive) == 1
        assert value(parsed, "luftpause_turn_seconds_count", **interactive) == 1
        assert value(parsed, "luftpause_affinity_hits_total") == 0
        assert value(parsed, "luftpause_runs", phase="idle", **interactive) == 1
        assert value(parsed, "luftpause_held_turns", **interactive) == 0

        again = await gw.post("/v1/chat/completions", json=chat("two"), headers=run)
        assert again.status_code == 200
        parsed = parse_metrics((await gw.get("/metrics")).text)
        assert value(parsed, "luftpause_affinity_hits_total") == 1
        assert value(parsed, "luftpause_admissions_total", replica="a", **interactive) == 2


async def test_metrics_show_the_process_and_its_gc_pauses() -> None:
    async with engine(instant=True) as (url, _), gateway(endpoint("a", url)) as (gw, _):
        before = parse_metrics((await gw.get("/metrics")).text)
        full = {"generation": "2"}
        count = before.get(("luftpause_gc_pause_seconds_count", frozenset(full.items())), 0.0)
        gc.collect()  # a full collection: the gateway's loop stood still for it
        after = parse_metrics((await gw.get("/metrics")).text)
        assert value(after, "luftpause_gc_pause_seconds_count", **full) == count + 1
        assert value(after, "luftpause_gc_pause_seconds_sum", **full) > 0
        # The process's own, as prometheus_client's default registry has them.
        assert value(after, "process_resident_memory_bytes") > 0
        assert value(after, "python_gc_collections_total", **full) >= count + 1
        assert any(name == "python_info" for name, _ in after)
        # Tests build gateways in one process and do not freeze its heap.
        assert value(after, "luftpause_gc_frozen_objects") == gc.get_freeze_count()


def test_the_gc_pause_timer_takes_no_lock() -> None:
    # A collection starts inside whatever allocation set it off, which may be
    # prometheus_client's own code holding a metric's lock (a scrape copying a metric's
    # children); a timer that took such a lock would hang the gateway's event loop.
    pauses = metrics_module._GcPauses()
    calls: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            calls.append(frame.f_code.co_qualname)
        elif event == "c_call":
            calls.append(arg.__qualname__)

    info = {"generation": 2, "collected": 0, "uncollectable": 0}
    sys.setprofile(profile)
    try:
        for _ in range(2):  # the first time, and once anything it made exists
            pauses._on_gc("start", info)
            pauses._on_gc("stop", info)
    finally:
        sys.setprofile(None)
    # Nothing but itself, the clock and a bisection: no metric object, so no lock.
    assert set(calls) <= {"_GcPauses._on_gc", "perf_counter", "bisect_left", "setprofile"}, calls
    registry = CollectorRegistry()
    registry.register(pauses)
    parsed = parse_metrics(generate_latest(registry).decode())
    assert value(parsed, "luftpause_gc_pause_seconds_count", generation="2") == 2
    assert value(parsed, "luftpause_gc_pause_seconds_bucket", generation="2", le="+Inf") == 2
    assert value(parsed, "luftpause_gc_pause_seconds_count", generation="0") == 0


async def test_status_needs_the_token_and_the_page_takes_it_as_a_query() -> None:
    token = "s3cret"
    async with (
        engine(instant=True) as (url, _),
        gateway(endpoint("a", url), token=token) as (gw, _),
    ):
        denied = await gw.get("/status")
        assert denied.status_code == 401
        assert denied.json() == {"error": {"message": "missing or wrong bearer token"}}
        assert (
            await gw.get("/status", headers={"Authorization": "Bearer nope"})
        ).status_code == 401
        assert (await gw.get("/status", params={"token": token})).status_code == 401  # page only
        ok = await gw.get("/status", headers={"Authorization": f"Bearer {token}"})
        assert ok.status_code == 200 and ok.json()["replicas"][0]["name"] == "a"

        assert (await gw.get("/")).status_code == 401
        assert (await gw.get("/", params={"token": "nope"})).status_code == 401
        page = await gw.get("/", params={"token": token})
        assert page.status_code == 200 and "<h2>Replicas</h2>" in page.text
        bearer = await gw.get("/", headers={"Authorization": f"Bearer {token}"})
        assert bearer.status_code == 200

        metrics = await gw.get("/metrics")
        assert metrics.status_code == 200 and "luftpause_held_turns" in metrics.text


async def test_status_when_open() -> None:
    async with engine(instant=True) as (url, _), gateway(endpoint("a", url)) as (gw, _):
        assert (await gw.get("/status")).status_code == 200
        assert (await gw.get("/")).status_code == 200


async def test_status_answers_when_temporal_is_unreachable() -> None:
    import httpx

    from gateway.app import GatewaySettings, create_app
    from luftpause.config import parse_config
    from testkit.loopback import serve

    async with engine(instant=True) as (url, _):
        temporal = closed_port_url().removeprefix("http://")
        config = parse_config(
            {
                "endpoints": [endpoint("a", url)],
                "mcp_servers": [{"name": "t", "url": closed_port_url() + "/mcp"}],
                "temporal": {"address": temporal},
            }
        )
        app = create_app(GatewaySettings(config=config, probe_period=0.05))
        async with serve(app) as gw, httpx.AsyncClient(base_url=gw, timeout=30) as http:
            r = await http.get("/status")
            assert r.status_code == 200
            assert r.json()["sub_agents"].startswith("runs unavailable: ")
            page = await http.get("/")
            assert page.status_code == 200 and "runs unavailable" in page.text
            # /metrics answers too, and says the count of sub-agent runs failed.
            scrape = await http.get("/metrics")
            assert scrape.status_code == 200
            assert "\nluftpause_run_store_up 0.0\n" in scrape.text
            assert "luftpause_subagent_runs" not in scrape.text


async def test_metrics_leave_out_sub_agents_where_none_run() -> None:
    """No MCP servers and no sub-agent asked for: /metrics does not look for Temporal."""
    import httpx

    from gateway.app import GatewaySettings, create_app
    from luftpause.config import parse_config
    from testkit.loopback import serve

    async with engine(instant=True) as (url, _):
        config = parse_config(
            {
                "endpoints": [endpoint("a", url)],
                "temporal": {"address": closed_port_url().removeprefix("http://")},
            }
        )
        app = create_app(GatewaySettings(config=config, probe_period=0.05))
        async with serve(app) as gw, httpx.AsyncClient(base_url=gw, timeout=30) as http:
            scrape = await http.get("/metrics")
    assert scrape.status_code == 200 and "luftpause_held_turns" in scrape.text
    assert "luftpause_run_store_up" not in scrape.text


async def test_a_sub_agent_asked_for_with_temporal_down_shows_the_run_store_down() -> None:
    """No MCP servers, and a spawn that could not reach Temporal: a sub-agent was asked
    for, so /metrics says the run store is down (helper-250: it said nothing, as if no
    one wanted sub-agents, since the door had never connected)."""
    import httpx
    from mcp import Client

    from gateway.app import GatewaySettings, create_app
    from luftpause.config import parse_config
    from testkit.loopback import serve

    async with engine(instant=True) as (url, _):
        config = parse_config(
            {
                "endpoints": [endpoint("a", url)],
                "temporal": {"address": closed_port_url().removeprefix("http://")},
            }
        )
        app = create_app(GatewaySettings(config=config, probe_period=0.05))
        async with serve(app) as gw, httpx.AsyncClient(base_url=gw, timeout=30) as http:
            async with Client(f"{gw}/mcp", mode="legacy") as c:
                r = await c.call_tool("spawn", {"task": "t"})
                assert r.is_error and "the run store (Temporal)" in r.content[0].text
            scrape = await http.get("/metrics")
            assert scrape.status_code == 200
            assert "\nluftpause_run_store_up 0.0\n" in scrape.text
            status = await http.get("/status")
            assert status.json()["sub_agents"].startswith("runs unavailable: ")


def test_snapshot_shows_an_interactive_lane_and_its_batch_limit() -> None:
    specs = [ReplicaSpec(name="a", models=frozenset({MODEL}), kv_tokens=10_000)]
    lanes = Policy(lane_batch_kv_fill=0.25)
    state = run_events(State.initial(specs, lanes), [arrived(1.0, "t1", "r1", "alice", prompt=9)])
    (a,) = status_snapshot(state, {}, {}, 2.0)["replicas"]
    assert a["interactive_lane"] is True and a["kv_batch_limit_tokens"] == 2500
    assert a["kv_limit_tokens"] == 8000


def test_snapshot_shows_which_replica_of_a_shared_gpu_takes_its_new_runs() -> None:
    specs = [
        ReplicaSpec(name=n, models=frozenset({MODEL}), kv_tokens=10_000, device="gpu0")
        for n in ("a", "b")
    ]
    pack = Policy(pack_shared_devices=True)
    state = run_events(State.initial(specs, pack), [arrived(1.0, "t1", "r1", "alice", prompt=9)])
    a, b = status_snapshot(state, {}, {}, 2.0)["replicas"]
    assert (a["device"], a["led_by"]) == ("gpu0", None)
    assert (b["device"], b["led_by"]) == ("gpu0", "a")  # a holds the interactive run
    off = run_events(State.initial(specs), [arrived(1.0, "t1", "r1", "alice", prompt=9)])
    assert [r["led_by"] for r in status_snapshot(off, {}, {}, 2.0)["replicas"]] == [None, None]


async def test_the_state_is_walked_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    # /metrics, /status and / walk every run and turn (~75 and ~130 ms with 100k runs):
    # in a thread over the immutable state, not on the loop that serves turns.
    threads: dict[str, threading.Thread] = {}
    collect = metrics_module._StateCollector.collect
    snapshot = app_module.status_snapshot

    def collect_where(self: Any) -> Any:
        threads["metrics"] = threading.current_thread()
        return collect(self)

    def snapshot_where(*args: Any) -> Any:
        threads["status"] = threading.current_thread()
        return snapshot(*args)

    monkeypatch.setattr(metrics_module._StateCollector, "collect", collect_where)
    monkeypatch.setattr(app_module, "status_snapshot", snapshot_where)
    loop_thread = threading.current_thread()
    async with engine(instant=True) as (url, _), gateway(endpoint("a", url)) as (gw, _):
        assert (await gw.post("/v1/chat/completions", json=chat())).status_code == 200
        metrics = (await gw.get("/metrics")).text
        assert 'luftpause_replica_in_flight{replica="a"} 0.0' in metrics
        assert (await gw.get("/status")).json()["replicas"][0]["name"] == "a"
    assert set(threads) == {"metrics", "status"}
    assert all(t is not loop_thread for t in threads.values())


# --------------------------------------------------------------------------- GET /v1/runs


def test_runs_listing_filters_and_orders_what_the_core_knows() -> None:
    # SCENE at 10 s: r1 (alice) paused on a; r3 (bob) generating there; r2 (bob, batch)
    # and r4 (carol) held before any of their turns was admitted.
    state = run_events(pool(), SCENE)
    listing = runs_listing(state, 10.0)
    assert [(v["run_id"], v["phase"]) for v in listing["runs"]] == [
        ("r3", "generating"),  # admitted at 5 s (a tie is broken by run id)
        ("r1", "paused"),  # paused at 5 s
        ("r4", WAITING),  # held since 4 s
        ("r2", WAITING),  # held since 2 s
    ]
    assert listing["total"] == 4
    r1 = listing["runs"][1]
    assert r1 == {
        "run_id": "r1",
        "caller": "alice",
        "class": "interactive",
        "model": MODEL,
        "phase": "paused",
        "replica": "a",
        "turns_in_flight": 0,
        "turns_held": 0,
        "context_tokens": 120,
        "kv_claim_tokens": 170,  # 120 context + 50 reply, against a's pool
        "since_s": 5.0,
    }
    assert listing["runs"][3]["turns_held"] == 1 and listing["runs"][3]["class"] == "batch"
    only = runs_listing(state, 10.0, caller="bob")
    assert [v["run_id"] for v in only["runs"]] == ["r3", "r2"]
    assert [v["run_id"] for v in runs_listing(state, 10.0, phase=WAITING)["runs"]] == ["r4", "r2"]
    assert [v["run_id"] for v in runs_listing(state, 10.0, phase="paused")["runs"]] == ["r1"]
    batch = runs_listing(state, 10.0, service_class=BATCH)
    assert [v["run_id"] for v in batch["runs"]] == ["r2"]
    top = runs_listing(state, 10.0, limit=1)
    assert [v["run_id"] for v in top["runs"]] == ["r3"] and top["total"] == 4


def test_a_runs_kv_claim_counts_what_its_turns_claim_by_themselves() -> None:
    # r5's second turn goes in on a while its first runs: the first's reply leaves the
    # run's claim (which reserves the second's) and that turn claims it itself (rule 6).
    # The run holds both on a's pool; the listing showed only the run's own claim.
    state = run_events(
        pool(),
        [
            ReplicaProbed(now=0.0, replica="a", healthy=True, queued=0, running=0),
            arrived(1.0, "t5", "r5", "alice", prompt=100, reply=50),
            arrived(2.0, "t6", "r5", "alice", prompt=200, reply=30),
        ],
    )
    assert sorted((t.turn_id, t.replica, t.claim) for t in state.admitted()) == [
        ("t5", "a", 50),
        ("t6", "a", 0),
    ]
    assert state.runs["r5"].ws_claim == 230  # 200 context + 30 reply
    assert state.replicas["a"].ws_tokens == 280
    (view,) = runs_listing(state, 3.0)["runs"]
    assert view["kv_claim_tokens"] == 280
    assert claims_of(state, "r5") == 50 and claims_of(state, "r1") == 0
    one = run_view(state.runs["r5"], 3.0, state.replicas, 0, claims_of(state, "r5"))
    assert one == view


async def test_a_caller_finds_its_runs_and_one_run_by_id() -> None:
    async with engine(instant=True) as (url, _), gateway(endpoint("a", url), token="t") as (gw, _):
        auth = {"Authorization": "Bearer t"}
        for n in range(3):
            r = await gw.post(
                "/v1/chat/completions",
                json=chat(f"q{n}"),
                headers={**auth, "x-luftpause-caller": "alice" if n else "bob"},
            )
            assert r.status_code == 200
        for name in ("😀bot", "?bot"):  # a header carries UTF-8 bytes; a query, text
            r = await gw.post(
                "/v1/chat/completions",
                json=chat(name),
                headers={**auth, "x-luftpause-caller": name.encode()},
            )
            assert r.status_code == 200
            found = (await gw.get("/v1/runs", params={"caller": name}, headers=auth)).json()
            assert [v["caller"] for v in found["runs"]] == [name]
        assert (await gw.get("/v1/runs")).status_code == 401
        mine = (await gw.get("/v1/runs", params={"caller": "alice"}, headers=auth)).json()
        assert mine["total"] == 2 and {v["caller"] for v in mine["runs"]} == {"alice"}
        assert all(v["phase"] == "idle" and v["replica"] == "a" for v in mine["runs"])
        run_id = mine["runs"][0]["run_id"]
        one = await gw.get(f"/v1/runs/{run_id}", headers=auth)
        assert one.status_code == 200 and one.headers["x-luftpause-run-id"] == run_id
        assert {k: v for k, v in one.json().items() if k != "since_s"} == {
            k: v for k, v in mine["runs"][0].items() if k != "since_s"
        }
        missing = await gw.get("/v1/runs/nope", headers=auth)
        assert missing.status_code == 404 and "'nope' is not known" in missing.text
        for params, what in (
            ({"phase": "asleep"}, "phase: expected one of generating, paused, idle, waiting"),
            ({"limit": "0"}, "limit: expected an integer from 1 to 1000"),
            ({"limit": "²"}, "limit: expected an integer from 1 to 1000"),  # isdigit()
            ({"limit": "9" * 5000}, "limit: expected an integer from 1 to 1000"),  # int()
            ({"class": "urgent"}, "class must be 'interactive' or 'batch'"),
            ({"class": ""}, "class must be 'interactive' or 'batch', got ''"),  # not a filter
            ({"who": "x"}, "unknown query parameter 'who'"),
        ):
            bad = await gw.get("/v1/runs", params=params, headers=auth)
            assert bad.status_code == 400 and what in bad.json()["error"]["message"], bad.text


async def test_whose_a_run_is_by_its_run_or_by_its_held_turns_alone() -> None:
    """owns() (GET/DELETE of a run), anothers() (a caller's turn joining it) and the
    listing's caller filter agree: a run known only by held turns is its callers'
    when they are one caller, no one's alone when they are several."""
    shell = AdmissionShell(pool())
    for ev in CAPPED:
        shell.apply(ev)
    admitted = shell.arrive(arrived(0.0, "busy", "admitted", "ann"))  # a's one slot
    for ev in (
        arrived(1.0, "h1", "held", "bob"),  # held: known by this turn only
        arrived(1.0, "m1", "mixed", "bob"),
        arrived(1.0, "m2", "mixed", "cat"),  # two callers' held turns, one run id
        arrived(1.0, "m3", "mixed", "cat"),
    ):
        shell.arrive(ev)
    state = shell.state
    assert admitted.done() and "admitted" in state.runs and "held" not in state.runs
    cases = {
        # run id, caller: owns, anothers
        ("admitted", "ann"): (True, False),
        ("admitted", "bob"): (False, True),
        ("held", "bob"): (True, False),
        ("held", "ann"): (False, True),
        ("mixed", "bob"): (False, True),
        ("never", "bob"): (False, False),  # unknown: a new run, anyone's to start
    }
    for (run_id, caller), expected in cases.items():
        assert (owns(shell, run_id, caller), anothers(shell, run_id, caller)) == expected
    for caller, ids in (("ann", ["admitted"]), ("bob", ["held"]), ("cat", [])):
        listed = runs_listing(state, 2.0, caller=caller)["runs"]
        assert [r["run_id"] for r in listed] == ids, caller
    # As turns stop waiting, the index follows: bob's turn given up leaves cat's run.
    shell.apply(TurnAbandoned(now=2.0, turn_id="m1"))
    shell.forget_turn("m1")
    assert owns(shell, "mixed", "cat") and not anothers(shell, "mixed", "cat")
    for turn in ("h1", "m2", "m3"):
        shell.apply(TurnAbandoned(now=2.0, turn_id=turn))
        shell.forget_turn(turn)
    assert shell.callers_of("held") == shell.callers_of("mixed") == frozenset()
