"""`GET /metrics`: the gateway's Prometheus metrics, in a registry of its own (one per
app, so two gateways in one process — as in the tests — never share counters).

Gauges (held turns, runs, replica load and caps) are read from the core's `State` at
scrape time by a custom collector.  Counters and histograms (admissions, affinity hits,
turn outcomes overall and per replica, tokens per replica, time held, turn latency) are
observed by `GatewayMetrics.observe`, which the admission shell calls after every
decision with the state before it, the event and the actions: it sees every `Admit`
and `Reject` and every terminal event it is given.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric

from gateway._shell import Awaited, Rejected, as_answered
from gateway.discovery import Found
from gateway.prober import ProbeResult
from gateway.status import WAITING
from scheduler import (
    Action,
    Admit,
    Ejected,
    Event,
    Reject,
    RunPhase,
    ServiceClass,
    State,
    TimedOut,
    TurnAbandoned,
    TurnFailed,
    TurnFinished,
    TurnStarted,
)

__all__ = ["ENGINE_OUTCOMES", "OUTCOMES", "GatewayMetrics", "Source"]

# luftpause_turns and luftpause_engine_turns: `failed` is the engine's fault only (what
# ejection counts); an error status about the request (4xx, 429, 503 busy) and a client
# that left mid-turn are apart, so that an alert on failures is not set off by users
# pressing Esc.
OUTCOMES = (
    "finished", "failed", "error_status", "client_left", "abandoned", "rejected", "timed_out",
)  # fmt: skip
ENGINE_OUTCOMES = (
    "finished", "failed", "error_status", "client_left", "abandoned", "timed_out",
)  # fmt: skip
_HELD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_TURN_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

_GC_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)

Source = Callable[[], tuple[State, Mapping[str, ProbeResult]] | None]
"""What the scrape-time gauges read: the core's state and the last probes (None while
the gateway is not running)."""


class _StateCollector:
    """Gauges computed from the core's state at scrape time (O(turns + runs))."""

    def __init__(self, source: Source) -> None:
        self._source = source

    def collect(self) -> Iterable[Metric]:
        seen = self._source()
        if seen is None:
            return []
        state, _ = seen
        held = GaugeMetricFamily(
            "luftpause_held_turns", "Turns held by luftpause, by class", labels=["class"]
        )
        counts = {c: 0 for c in ServiceClass}
        waiting: dict[str, ServiceClass] = {}  # runs known only by held turns -> class
        for t in state.held():
            counts[t.service_class] += 1
            if t.run_id not in state.runs:
                waiting.setdefault(t.run_id, t.service_class)
        for cls, n in counts.items():
            held.add_metric([cls.value], n)
        runs = GaugeMetricFamily(
            "luftpause_runs",
            "Runs by phase and class (waiting: known only by turns held, none admitted yet)",
            labels=["phase", "class"],
        )
        by = {(p, c): 0 for p in (*(p.value for p in RunPhase), WAITING) for c in ServiceClass}
        for run in state.runs.values():
            by[run.phase.value, run.service_class] += 1
        for cls in waiting.values():
            by[WAITING, cls] += 1
        for (phase, cls), n in by.items():
            runs.add_metric([phase, cls.value], n)

        def replica_gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=["replica"])

        in_flight = replica_gauge(
            "luftpause_replica_in_flight", "Turns luftpause admitted to the replica"
        )
        cap = replica_gauge(
            "luftpause_replica_cap", "luftpause's cap on in-flight turns (absent: uncapped)"
        )
        slots = replica_gauge(
            "luftpause_engine_slots",
            "Requests the engine runs at once, configured or reported (absent: unknown)",
        )
        queued = replica_gauge("luftpause_engine_queued", "The engine's queue at the last probe")
        running = replica_gauge(
            "luftpause_engine_running", "Requests the engine ran at the last probe"
        )
        healthy = replica_gauge(
            "luftpause_replica_healthy",
            "1 when in rotation: its last probe succeeded and it is not ejected",
        )
        # Probes pass, turns fail: the engine is out of rotation for a while (rule 10),
        # which healthy 0 alone does not tell from a failed probe (helper-157).
        ejected = replica_gauge(
            "luftpause_replica_ejected",
            "1 while the replica is out of rotation after failing turns in a row",
        )
        # A replica gone from the pool (a reload removed it, or its pod left discovery)
        # that finishes its turns: out of rotation by choice, which healthy 0 is not.
        retired = replica_gauge(
            "luftpause_replica_retired",
            "1 when the replica left the pool and only finishes its turns (rule 11)",
        )
        for name in sorted(state.replicas.keys()):
            r = state.replicas[name]
            in_flight.add_metric([name], r.in_flight)
            healthy.add_metric([name], 1 if r.healthy else 0)
            ejected.add_metric([name], 0 if r.ejected_until is None else 1)
            retired.add_metric([name], 1 if name in state.retired else 0)
            if r.cap is not None:
                cap.add_metric([name], r.cap)
            if r.spec.slots is not None:
                slots.add_metric([name], r.spec.slots)
            if name in state.retired:
                # Unprobed since it left: its last reading would stand for up to the
                # idle-run expiry (helper-146), counted in the pool's queue.
                continue
            if r.queued is not None:
                queued.add_metric([name], r.queued)
            if r.running is not None:
                running.add_metric([name], r.running)
        return [held, runs, in_flight, cap, slots, queued, running, healthy, ejected, retired]


class _Discovery:
    """What each discovered endpoint's name resolved to (`[[endpoints]] discover`), at
    scrape time: how many engines, whether its last round answered, and when one last
    did (alert on `time() - luftpause_discovery_last_answer_timestamp_seconds`: the
    gateway serves the last answer while the resolver fails)."""

    def __init__(self, found: Callable[[], Mapping[str, Found]]) -> None:
        self._found = found

    def collect(self) -> Iterable[Metric]:
        found = self._found()
        if not found:
            return []

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=["endpoint"])

        engines = gauge(
            "luftpause_discovery_engines", "Engines the endpoint's name resolved to, as served"
        )
        up = gauge(
            "luftpause_discovery_up",
            "1 when the last lookup of the endpoint's name answered (0: it failed or "
            "timed out, and its last answer is served)",
        )
        answered = gauge(
            "luftpause_discovery_last_answer_timestamp_seconds",
            "When a lookup of the endpoint's name last answered (Unix time; absent: never)",
        )
        for name in sorted(found):
            f = found[name]
            engines.add_metric([name], len(f.engines))
            up.add_metric([name], 0 if f.error is not None else 1)
            if f.resolved_at is not None:
                answered.add_metric([name], f.resolved_at)
        return [engines, up, answered]


class _GcPauses:
    """How long the cyclic garbage collector stopped the process, by generation.

    A collection stops the event loop, so every turn the gateway is streaming waits it
    out; a full one walks every object the process holds.  Timed with `gc.callbacks`,
    which is process-wide: one instance, installed once, is exposed in every app's
    registry.  The callback only counts into plain lists: it runs inside whatever
    allocation set the collector off, which may be prometheus_client's own code holding
    a metric's (non-reentrant) lock, so it must not take one."""

    def __init__(self) -> None:
        # Per generation: observations per bucket (the last one +Inf), then the sum.
        self._stats = [[0.0] * (len(_GC_BUCKETS) + 2) for _ in range(3)]
        self._started = 0.0
        self._installed = False

    def install(self) -> None:
        if not self._installed:
            gc.callbacks.append(self._on_gc)
            self._installed = True

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        seconds = time.perf_counter() - self._started
        stats = self._stats[info["generation"]]
        stats[bisect.bisect_left(_GC_BUCKETS, seconds)] += 1
        stats[-1] += seconds

    def collect(self) -> Iterable[Metric]:
        pauses = HistogramMetricFamily(
            "luftpause_gc_pause_seconds",
            "Time the process stood still for the cyclic garbage collector, by generation "
            "(2: a full collection)",
            labels=["generation"],
        )
        for generation, stats in enumerate(self._stats):
            snapshot = list(stats)  # one copy: the callback may run between reads
            buckets, seen = [], 0.0
            for bound, n in zip((*_GC_BUCKETS, math.inf), snapshot[:-1], strict=True):
                seen += n
                buckets.append(("+Inf" if bound == math.inf else repr(float(bound)), seen))
            pauses.add_metric([str(generation)], buckets, sum_value=snapshot[-1])
        yield pauses
        yield GaugeMetricFamily(
            "luftpause_gc_frozen_objects",
            "Objects moved out of the collector's reach once the gateway had started "
            "(gc.freeze): a full collection does not walk them",
            value=gc.get_freeze_count(),
        )


_GC_PAUSES = _GcPauses()


class _SubAgentRuns:
    """Sub-agent runs open in Temporal, by state, as the gateway last counted them
    (`luftpause_subagent_runs`), and whether that count came back
    (`luftpause_run_store_up`).  Neither is exposed until a count was tried: a gateway
    without sub-agents has no run store to ask."""

    def __init__(self) -> None:
        self.tried = False
        self.counts: Mapping[str, int] | None = None  # None: the last count failed
        self.workers: int | None = None  # pollers of the runs' task queue, with counts

    def collect(self) -> Iterable[Metric]:
        if not self.tried:
            return []
        counts = self.counts
        up = GaugeMetricFamily(
            "luftpause_run_store_up",
            "Whether the last count of sub-agent runs in Temporal succeeded",
            value=0 if counts is None else 1,
        )
        if counts is None:
            return [up]
        runs = GaugeMetricFamily(
            "luftpause_subagent_runs",
            "Sub-agent runs open in Temporal, by state (Temporal's visibility; counted "
            "at most every few seconds)",
            labels=["state"],
        )
        for state, n in sorted(counts.items()):
            runs.add_metric([state], n)
        if self.workers is None:
            return [up, runs]
        workers = GaugeMetricFamily(
            "luftpause_subagent_workers",
            "Workers polling the sub-agent runs' task queue (Temporal's pollers of the "
            "last few minutes): 0 while runs wait for none, or for a worker on another "
            "task queue",
            value=self.workers,
        )
        return [up, runs, workers]


class GatewayMetrics:
    """The gateway's metrics and the registry `/metrics` exposes."""

    def __init__(
        self,
        source: Source,
        awaited: Callable[[str], Awaited | None] = lambda model: None,
        found: Callable[[], Mapping[str, Found]] = dict,
    ) -> None:
        # Why a model has no engine for now (discovered endpoints with none up): the
        # core's 404 for a turn of it reaches its client as a 503, and is counted so.
        self._awaited = awaited
        self.registry = CollectorRegistry()
        self.registry.register(_StateCollector(source))
        self.registry.register(_Discovery(found))
        self.subagent_runs = _SubAgentRuns()  # set by the /metrics handler, which asks
        self.registry.register(self.subagent_runs)
        # The process's own, as any prometheus_client service has them in its default
        # registry: CPU, memory, file descriptors, the Python version, collections
        # (each registers itself; the GC collector only on CPython).
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        _GC_PAUSES.install()
        self.registry.register(_GC_PAUSES)
        self.admissions = Counter(
            "luftpause_admissions",
            "Turns admitted, by replica and class",
            ["replica", "class"],
            registry=self.registry,
        )
        self.affinity_hits = Counter(
            "luftpause_affinity_hits",
            "Admissions of a run to the replica of its previous turn",
            registry=self.registry,
        )
        self.turns = Counter(
            "luftpause_turns", "Turns ended, by outcome", ["outcome"], registry=self.registry
        )
        # What named the run of a turn that arrived: x-luftpause-run-id, a harness's
        # session header, the tool calls it echoed, or nothing (a run of its own).
        self.turn_runs = Counter(
            "luftpause_turn_runs",
            "Turns that arrived, by what named their run: header, session, tool_calls, "
            "previous_response, new",
            ["by"],
            registry=self.registry,
        )
        # Which refusal: 404 (no replica serves the model, or it left the pool while
        # the turn was held), 503 (none healthy, no engine now, or the gateway drains),
        # 429 (a caller over max_held_per_caller).
        self.rejected = Counter(
            "luftpause_rejected_turns",
            "Turns refused before they reached an engine, by HTTP status as answered",
            ["status"],
            registry=self.registry,
        )
        # Per replica: a replica that fails every turn while its health check passes
        # shows here first.  Turns that reached no replica (rejected, abandoned while
        # held) are in luftpause_turns only.
        self.engine_turns = Counter(
            "luftpause_engine_turns",
            "Turns admitted to a replica that ended, by replica and outcome: failed (the "
            "engine's fault), error_status (it answered 4xx/429/503 busy), client_left, "
            "abandoned (the gateway stopped it: shutdown), finished, timed_out",
            ["replica", "outcome"],
            registry=self.registry,
        )
        self.ejections = Counter(
            "luftpause_ejections",
            "Times a replica was taken out of rotation after its engine failed turns in "
            "a row, by replica",
            ["replica"],
            registry=self.registry,
        )
        # As the engines report them (usage): cached / prompt is the prefix cache's hit
        # rate, per replica, which run affinity and KV admission are there to raise.
        self.prompt_tokens = Counter(
            "luftpause_prompt_tokens",
            "Prompt tokens of finished turns, by replica and class",
            ["replica", "class"],
            registry=self.registry,
        )
        self.cached_tokens = Counter(
            "luftpause_cached_tokens",
            "Prompt tokens served from the engine's prefix cache, by replica and class",
            ["replica", "class"],
            registry=self.registry,
        )
        self.completion_tokens = Counter(
            "luftpause_completion_tokens",
            "Completion tokens of finished turns, by replica and class",
            ["replica", "class"],
            registry=self.registry,
        )
        self.held_seconds = Histogram(
            "luftpause_held_seconds",
            "Time a turn was held before admission, by class",
            ["class"],
            buckets=_HELD_BUCKETS,
            registry=self.registry,
        )
        # (helper-146: held_seconds has only the turns admitted, so under a flood it
        # showed the waits of those who stayed.)
        self.held_unadmitted_seconds = Histogram(
            "luftpause_held_unadmitted_seconds",
            "Time a turn was held before it left unadmitted (its client gave up, or it "
            "was refused: its model left, the gateway stopped), by class",
            ["class"],
            buckets=_HELD_BUCKETS,
            registry=self.registry,
        )
        self.turn_seconds = Histogram(
            "luftpause_turn_seconds",
            "Time from admission to the turn's end, by class",
            ["class"],
            buckets=_TURN_BUCKETS,
            registry=self.registry,
        )
        self.first_byte_seconds = Histogram(
            "luftpause_turn_first_byte_seconds",
            "Time from admission to the engine's first byte (streams: its first token), "
            "by class; with luftpause_held_seconds, a client's time to first token",
            ["class"],
            buckets=_HELD_BUCKETS,
            registry=self.registry,
        )
        for outcome in OUTCOMES:
            self.turns.labels(outcome)
        for cls in ServiceClass:
            self.held_seconds.labels(cls.value)
            self.held_unadmitted_seconds.labels(cls.value)
            self.turn_seconds.labels(cls.value)
            self.first_byte_seconds.labels(cls.value)

    def refused(self, status: int) -> None:
        """A turn refused: by the core (`observe`), or before it reached the core
        (`/v1/decide` with no generative endpoint to ask)."""
        self.turns.labels("rejected").inc()
        self.rejected.labels(str(status)).inc()

    def observe(self, before: State, event: Event, actions: Sequence[Action]) -> None:
        """Count one decision: `before` is the state the event was applied to."""
        placed: dict[str, str | None] = {}  # run -> replica of its latest admitted turn
        for action in actions:
            if isinstance(action, Admit):
                cls = action.service_class.value
                self.admissions.labels(action.replica, cls).inc()
                self.held_seconds.labels(cls).observe(max(0.0, action.held_s))
                if action.run_id in placed:
                    previous = placed[action.run_id]
                else:
                    run = before.runs.get(action.run_id)
                    previous = run.replica if run is not None else None
                if previous == action.replica:
                    self.affinity_hits.inc()
                placed[action.run_id] = action.replica
            elif isinstance(action, Reject):
                held = before.turns.get(action.turn_id)
                model = held.model if held is not None else getattr(event, "model", "")
                if held is not None and held.replica is None:  # (not one just arrived)
                    waited = max(0.0, event.now - held.arrived)
                    self.held_unadmitted_seconds.labels(held.service_class.value).observe(waited)
                answered = as_answered(
                    Rejected(action.status, action.message), model, self._awaited
                )
                self.refused(answered.status)
            elif isinstance(action, Ejected):
                self.ejections.labels(action.replica).inc()
            elif isinstance(action, TimedOut):
                self.turns.labels("timed_out").inc()
                self.engine_turns.labels(action.replica, "timed_out").inc()
                timed = before.turns.get(action.turn_id)
                if timed is not None:  # the slowest turns belong in the histogram too
                    elapsed = max(0.0, event.now - timed.admitted_at)
                    self.turn_seconds.labels(timed.service_class.value).observe(elapsed)
        if isinstance(event, TurnStarted):
            started = before.turns.get(event.turn_id)
            if started is not None and started.replica is not None:
                elapsed = max(0.0, event.now - started.admitted_at)
                self.first_byte_seconds.labels(started.service_class.value).observe(elapsed)
            return
        if isinstance(event, TurnFinished | TurnFailed | TurnAbandoned):
            turn = before.turns.get(event.turn_id)
            if turn is None or (turn.replica is None and not isinstance(event, TurnAbandoned)):
                return  # the core ignores it (timed out already): counted nowhere
            if isinstance(event, TurnFinished):
                outcome = "finished"
            elif isinstance(event, TurnFailed):
                outcome = (
                    "failed"
                    if event.engine_fault
                    else "client_left"
                    if event.client_left
                    else "timed_out"
                    if event.timed_out  # (helper-146: a hung hosted API was error_status)
                    else "error_status"
                )
            else:
                outcome = "abandoned"
                if turn.replica is None:
                    waited = max(0.0, event.now - turn.arrived)
                    self.held_unadmitted_seconds.labels(turn.service_class.value).observe(waited)
            self.turns.labels(outcome).inc()
            if turn.replica is not None:
                cls = turn.service_class.value
                elapsed = max(0.0, event.now - turn.admitted_at)
                self.turn_seconds.labels(cls).observe(elapsed)
                self.engine_turns.labels(turn.replica, outcome).inc()
                if isinstance(event, TurnFinished):
                    self.prompt_tokens.labels(turn.replica, cls).inc(event.prompt_tokens)
                    self.cached_tokens.labels(turn.replica, cls).inc(event.cached_tokens or 0)
                    self.completion_tokens.labels(turn.replica, cls).inc(event.completion_tokens)

    def forget_replica(self, name: str) -> None:
        """Drop the series of a replica the core forgot (it left the pool): a pool that
        scales by discovery would otherwise add series for every address it ever had.
        Its counts leave the sums; Prometheus keeps what it scraped."""
        classes = [cls.value for cls in ServiceClass]
        for counter, second in (
            (self.admissions, classes),
            (self.prompt_tokens, classes),
            (self.cached_tokens, classes),
            (self.completion_tokens, classes),
            (self.engine_turns, ENGINE_OUTCOMES),
        ):
            for value in second:
                with contextlib.suppress(KeyError):
                    counter.remove(name, value)
        with contextlib.suppress(KeyError):
            self.ejections.remove(name)

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)
