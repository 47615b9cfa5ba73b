"""The admission layers the simulator compares, behind one small interface.

`luftpause` is the real scheduler core, fed exactly what the gateway will feed it.
The others are approximations of what users would deploy instead, good for fast
iteration only; the real routers are measured in real time by `luftpause bench flood`
(testkit/bench_agents.py).
"""

from __future__ import annotations

import math
import zlib
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from scheduler import (
    Admit,
    Forget,
    Policy,
    Reject,
    ReplicaProbed,
    ReplicaSpec,
    RunEnded,
    ServiceClass,
    State,
    Tick,
    TurnArrived,
    TurnFinished,
    TurnStarted,
    decide,
)
from scheduler._types import Event


@dataclass(frozen=True, slots=True)
class Turn:
    """One LLM turn of a simulated run, as an admission layer sees it."""

    turn_id: str
    run_id: str
    service_class: ServiceClass
    caller: str
    prompt_blocks: tuple[tuple[int, int], ...]
    prompt_tokens: int
    max_tokens: int


# send(turn, engine_index) hands a turn to an engine.
Send = Callable[[Turn, int], None]


class Arm(ABC):
    """An admission layer between the agents and the engines."""

    name = "arm"
    probe_period_s = 2.0

    def __init__(self, n_engines: int, send: Send) -> None:
        self.n = n_engines
        self.send = send
        self.outstanding = [0] * n_engines

    @abstractmethod
    def arrive(self, turn: Turn, now: float) -> None:
        """A turn arrived from an agent: send it somewhere now or later."""

    def started(self, turn: Turn, now: float) -> None:  # noqa: B027 - optional hook
        """The turn's first token arrived (routers ignore it)."""

    def finished(
        self,
        turn: Turn,
        engine: int,
        now: float,
        *,
        tool_calls: bool,
        prompt: int,
        output: int,
        cached: int = 0,
    ) -> None:
        self.outstanding[engine] -= 1

    def run_ended(self, run_id: str, now: float) -> None:  # noqa: B027 - optional hook
        """The run ended (routers ignore it)."""

    def probe(self, now: float, engine: int, queued: int, running: int) -> None:  # noqa: B027
        """A probe of an engine's load (routers here ignore it)."""

    def _dispatch(self, turn: Turn, engine: int) -> None:
        self.outstanding[engine] += 1
        self.send(turn, engine)


class Direct(Arm):
    """No admission layer: each turn goes at once to the engine with the fewest
    outstanding requests and queues there."""

    name = "direct"

    def arrive(self, turn: Turn, now: float) -> None:
        e = min(range(self.n), key=lambda i: (self.outstanding[i], i))
        self._dispatch(turn, e)


class RoundRobin(Arm):
    name = "round_robin"

    def __init__(self, n_engines: int, send: Send) -> None:
        super().__init__(n_engines, send)
        self._next = 0

    def arrive(self, turn: Turn, now: float) -> None:
        e = self._next
        self._next = (self._next + 1) % self.n
        self._dispatch(turn, e)


class CacheAware(Arm):
    """An approximation of the SGLang router's cache_aware policy (sglang-router 0.3
    defaults): when the load is balanced, the worker whose approximate prefix tree
    matches the request best if the match ratio exceeds `cache_threshold`, else the
    worker with the smallest tree; when imbalanced (max - min > abs threshold and max >
    rel threshold × min), the least loaded.  The router's tree is modelled as the set
    of prompt blocks sent to each worker (it never sees engine evictions)."""

    name = "cache_aware"
    cache_threshold = 0.3
    balance_abs_threshold = 64
    balance_rel_threshold = 1.5

    def __init__(self, n_engines: int, send: Send) -> None:
        super().__init__(n_engines, send)
        self.trees: list[set[tuple[int, int]]] = [set() for _ in range(n_engines)]

    def _route(self, turn: Turn) -> int:
        loads = self.outstanding
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            return min(range(self.n), key=lambda i: (loads[i], i))
        best, best_match = 0, -1
        for i, tree in enumerate(self.trees):
            match = 0
            for b in turn.prompt_blocks:
                if b not in tree:
                    break
                match += 1
            if match > best_match:
                best, best_match = i, match
        ratio = best_match / max(1, len(turn.prompt_blocks))
        if ratio > self.cache_threshold:
            return best
        return min(range(self.n), key=lambda i: (len(self.trees[i]), i))

    def arrive(self, turn: Turn, now: float) -> None:
        e = self._route(turn)
        self.trees[e].update(turn.prompt_blocks)
        self._dispatch(turn, e)


class PriorityQueue(CacheAware):
    """An approximation of SMG's priority scheduler: per-class FIFO queues in the
    gateway, interactive first, with a cap on concurrent requests per worker; the
    worker is chosen as cache_aware does among those with a free slot."""

    name = "priority"
    cap_per_engine = 24

    def __init__(self, n_engines: int, send: Send) -> None:
        super().__init__(n_engines, send)
        self.queues: dict[ServiceClass, deque[Turn]] = {
            ServiceClass.INTERACTIVE: deque(),
            ServiceClass.BATCH: deque(),
        }

    def arrive(self, turn: Turn, now: float) -> None:
        self.queues[turn.service_class].append(turn)
        self._drain()

    def finished(
        self,
        turn: Turn,
        engine: int,
        now: float,
        *,
        tool_calls: bool,
        prompt: int,
        output: int,
        cached: int = 0,
    ) -> None:
        super().finished(turn, engine, now, tool_calls=tool_calls, prompt=prompt, output=output)
        self._drain()

    def _drain(self) -> None:
        for cls in (ServiceClass.INTERACTIVE, ServiceClass.BATCH):
            q = self.queues[cls]
            while q and min(self.outstanding) < self.cap_per_engine:
                turn = q.popleft()
                e = self._route(turn)
                if self.outstanding[e] >= self.cap_per_engine:
                    e = min(range(self.n), key=lambda i: (self.outstanding[i], i))
                self.trees[e].update(turn.prompt_blocks)
                self._dispatch(turn, e)


@dataclass(slots=True)
class _Program:
    """A program (a run) as vllm-router's program scheduling keeps it."""

    run_id: str
    rank: int
    context: int = 0  # its prompt tokens: grows at once, never shrinks here
    active: bool = False  # holds logical capacity on its rank (else paused)
    charged: int = 0  # its tokens in the rank's ledger while active
    in_flight: int = 0
    waiting: deque[Turn] | None = None  # its requests held for admission
    last_finished: float = -math.inf
    queued_at: float = 0.0
    force_at: float = math.inf  # admitted past every gate but the engine's queue, then
    ttl_at: float | None = None  # acting (between requests) until then
    paused_at: float = 0.0
    activated_at: float = 0.0
    pause_when_idle: bool = False


def _ring_hash(key: str) -> int:
    return zlib.crc32(key.encode())


class ProgramScheduling(Arm):
    """An approximation of vllm-router's program-level scheduling (its opt-in
    `--enable-program-scheduling`; `src/program_scheduling/` and
    `docs/program_scheduling.md` of vllm-project/router, read 2026-12-06 as indexed:
    PR #286, its Progress-TTL design), with `token_capacity_per_dp_rank` set to the
    engine's KV pool, as a user running agents on it would set it:

    - a program (a run) is bound to an engine by consistent hash of its id (160
      virtual nodes per engine), for good;
    - a paused program's request waits in the router until its engine admits the
      program: not while the engine's last metrics (every second) showed a request
      waiting, at most 64 active programs, and the rank's ledger plus the program's
      tokens (prompt, plus 100 for the reply) within the capacity; the first that
      passes in (forced after 300 s, most recently finished, first queued) order;
    - an active program's next request goes at once, its growth charged;
    - a program whose request ended is "acting" for a TTL fitted to the intervals
      between a completion and the next request (at most 10 s and at most the cost of
      a cache miss by its prefill model; none until 100 intervals are seen), then
      paused: it gives its tokens back and holds nothing;
    - above the capacity, active programs are paused (idle ones at once, others when
      their request ends), the longest active first;
    - no classes: interactive and batch programs are alike (its priority hint is
      unused here, as no harness sends it).

    Left out: its growth reserve and batch-gain admission (which roughly cancel: one
    holds capacity back, the other admits past it), its queue timeout (600 s, a 429),
    segment yields (after 14 rounds), cross-rank moves (off by default), the KV usage
    it reads from vLLM's metrics beside its own ledger, and the shared prefix it takes
    off a program's tokens: here a prefix the runs share is counted in each (under
    `--shared-prefix-chars` the arm holds back programs an engine has room for)."""

    name = "program"
    probe_period_s = 1.0  # metrics_interval_seconds
    max_active = 64
    waiting_threshold = 1
    reply_tokens = 100  # decode_buffer_tokens
    max_ttl_s = 10.0
    window = 100
    force_after_s = 300.0
    release_after_s = 1800.0
    vnodes = 160
    # prefill_cost_model (intercept, per 1k tokens, per 1k² tokens, alpha): a miss's cost.
    miss_cost = (0.0660, 0.05702, 0.0044057, 0.15)

    def __init__(self, n_engines: int, send: Send, *, token_capacity: int | None) -> None:
        super().__init__(n_engines, send)
        self.capacity = token_capacity
        self.ring = sorted(
            (_ring_hash(f"engine-{e}#{v}"), e) for e in range(n_engines) for v in range(self.vnodes)
        )
        self.programs: dict[str, _Program] = {}
        self.used = [0] * n_engines
        self.active = [0] * n_engines
        self.engine_waiting = [0] * n_engines  # at the last metrics
        self.queues: list[dict[str, _Program]] = [{} for _ in range(n_engines)]
        self.intervals: deque[float] = deque(maxlen=self.window)
        self.completions: deque[int] = deque(maxlen=self.window)

    def _bind(self, run_id: str) -> int:
        h = _ring_hash(run_id)
        for key, engine in self.ring:
            if key >= h:
                return engine
        return self.ring[0][1]

    def _tokens(self, p: _Program) -> int:
        return p.context + self.reply_tokens

    def _charge(self, p: _Program) -> None:
        tokens = self._tokens(p)
        self.used[p.rank] += tokens - p.charged
        p.charged = tokens

    def _pause(self, p: _Program, now: float) -> None:
        if p.active:
            self.used[p.rank] -= p.charged
            self.active[p.rank] -= 1
        p.active, p.charged, p.ttl_at, p.pause_when_idle = False, 0, None, False
        p.paused_at = now

    def _ttl(self, p: _Program) -> float:
        """The acting TTL: the d that maximises P(T<d)·C − E[T; T<d] − d·P(T≥d) over
        the intervals seen (C: a cache miss's cost), within min(10 s, C)."""
        if len(self.intervals) < self.window:
            return 0.0
        a, b, q, alpha = self.miss_cost
        k = p.context / 1000
        c = (a + b * k + q * k * k) * (2 - alpha)
        cap = min(self.max_ttl_s, c)
        seen = sorted(self.intervals)
        best, best_u = 0.0, 0.0
        for d in [t for t in seen if t <= cap] + [cap]:
            below = [t for t in seen if t <= d]  # (a TTL of d keeps an interval of d)
            u = len(below) * c - sum(below) - d * (len(seen) - len(below))
            if u > best_u:
                best, best_u = d, u
        return best

    def _gate(self, p: _Program, now: float) -> bool:
        r = p.rank
        if self.engine_waiting[r] >= self.waiting_threshold:
            return False  # (forced or not)
        if p.force_at <= now:
            return True
        if self.active[r] + 1 > self.max_active:
            return False
        return self.capacity is None or self.used[r] + self._tokens(p) <= self.capacity

    def _schedule(self, rank: int, now: float) -> None:
        queue = self.queues[rank]
        while queue:
            order = sorted(
                queue.values(),
                key=lambda p: (p.force_at > now, -p.last_finished, p.queued_at, p.run_id),
            )
            chosen = next((p for p in order if self._gate(p, now)), None)
            if chosen is None:
                return
            del queue[chosen.run_id]
            chosen.active, chosen.activated_at = True, now
            self.active[rank] += 1
            self._charge(chosen)
            assert chosen.waiting is not None
            while chosen.waiting:
                chosen.in_flight += 1
                self._dispatch(chosen.waiting.popleft(), rank)

    def _repair(self, rank: int, now: float) -> None:
        """Above the capacity: pause active programs, idle ones at once, the others
        when their request ends, until the ledger and the replies due fit."""
        if self.capacity is None:
            return
        mine = [p for p in self.programs.values() if p.active and p.rank == rank]
        reasoning = sum(1 for p in mine if p.in_flight)
        avg_reply = sum(self.completions) / len(self.completions) if self.completions else 0
        projected = self.used[rank] + avg_reply * reasoning
        projected -= sum(p.charged for p in mine if p.pause_when_idle)
        for p in sorted(mine, key=lambda p: (p.activated_at, p.run_id)):
            if projected <= self.capacity:
                return
            if p.pause_when_idle:
                continue
            projected -= p.charged
            if p.in_flight:
                p.pause_when_idle = True
            else:
                self._pause(p, now)

    def _decide(self, now: float, ranks: Sequence[int] | None = None) -> None:
        for p in list(self.programs.values()):
            if p.active and p.ttl_at is not None and p.ttl_at <= now:
                self._pause(p, now)
            elif (
                not p.active
                and not p.in_flight
                and not p.waiting
                and now - p.paused_at >= self.release_after_s
            ):
                del self.programs[p.run_id]
        for r in range(self.n) if ranks is None else ranks:
            self._repair(r, now)
            self._schedule(r, now)

    def arrive(self, turn: Turn, now: float) -> None:
        p = self.programs.get(turn.run_id)
        if p is None:
            p = self.programs[turn.run_id] = _Program(turn.run_id, self._bind(turn.run_id))
        if p.last_finished > -math.inf:
            self.intervals.append(now - p.last_finished)
        p.context = max(p.context, turn.prompt_tokens)
        if p.active:
            p.ttl_at, p.pause_when_idle = None, False  # acting no more
            self._charge(p)
            p.in_flight += 1
            self._dispatch(turn, p.rank)
            return
        if not p.waiting:
            p.waiting = deque()
            p.queued_at, p.force_at = now, now + self.force_after_s
            self.queues[p.rank][p.run_id] = p
        p.waiting.append(turn)
        self._decide(now, (p.rank,))

    def finished(
        self,
        turn: Turn,
        engine: int,
        now: float,
        *,
        tool_calls: bool,
        prompt: int,
        output: int,
        cached: int = 0,
    ) -> None:
        super().finished(turn, engine, now, tool_calls=tool_calls, prompt=prompt, output=output)
        p = self.programs[turn.run_id]
        p.in_flight -= 1
        p.last_finished = now
        self.completions.append(output)
        p.context = max(p.context, prompt)
        if p.active:
            self._charge(p)
        if p.active and not p.in_flight and not p.waiting:
            # Acting: its next request (after the tool call) goes at once within the
            # TTL.  The router does not know whether the run ended (the HTTP path
            # never ends a program): an ended run is paused at its TTL too.
            ttl = self._ttl(p)
            if p.pause_when_idle or ttl <= 0:
                self._pause(p, now)
            else:
                p.ttl_at = now + ttl
        self._decide(now, (p.rank,))

    def probe(self, now: float, engine: int, queued: int, running: int) -> None:
        self.engine_waiting[engine] = queued
        if engine == self.n - 1:
            self._decide(now)


class Luftpause(Arm):
    """The real scheduler core, seeing the engines as the gateway does: a probe every
    2 s with the engine's queued/running counts at that moment, plus turn events."""

    name = "luftpause"

    def __init__(
        self,
        n_engines: int,
        send: Send,
        *,
        model: str,
        kv_tokens: int | None,
        policy: Policy,
        replicas_per_gpu: int = 1,
        slots: int | None = None,
        prompt_estimate: float = 1.0,
        interactive_model: str | None = None,
    ) -> None:
        super().__init__(n_engines, send)
        self.model = model
        # The model the interactive turns name, when not `model`: their prefix is then
        # learned and counted apart (bench/shared_prefix_sweep.py's per-harness bound).
        self.interactive_model = interactive_model or model
        self.prompt_estimate = prompt_estimate  # Scenario.prompt_estimate
        # The replicas know the GPU they share, as a pool's config says it (rule 13).
        k = max(1, replicas_per_gpu)
        specs = [
            ReplicaSpec(
                name=str(i),
                models=frozenset({model, self.interactive_model}),
                kv_tokens=kv_tokens,
                device=f"gpu{i // k}" if k > 1 else None,
                slots=slots,
            )
            for i in range(n_engines)
        ]
        self.state = State.initial(specs, policy)
        self.pending: dict[str, Turn] = {}

    def _apply(self, event: Event) -> None:
        self.state, actions = decide(self.state, event)
        for a in actions:
            if isinstance(a, Admit):
                self._dispatch(self.pending.pop(a.turn_id), int(a.replica))
            elif isinstance(a, Reject):
                raise RuntimeError(f"simulated turn rejected: {a.message}")
            elif isinstance(a, Forget):
                pass

    def arrive(self, turn: Turn, now: float) -> None:
        self.pending[turn.turn_id] = turn
        self._apply(
            TurnArrived(
                now=now,
                turn_id=turn.turn_id,
                run_id=turn.run_id,
                service_class=turn.service_class,
                caller=turn.caller,
                model=self.interactive_model
                if turn.service_class is ServiceClass.INTERACTIVE
                else self.model,
                prompt_tokens=math.ceil(turn.prompt_tokens * self.prompt_estimate),
                max_tokens=turn.max_tokens,
            )
        )

    def started(self, turn: Turn, now: float) -> None:
        self._apply(TurnStarted(now=now, turn_id=turn.turn_id))

    def finished(
        self,
        turn: Turn,
        engine: int,
        now: float,
        *,
        tool_calls: bool,
        prompt: int,
        output: int,
        cached: int = 0,
    ) -> None:
        super().finished(turn, engine, now, tool_calls=tool_calls, prompt=prompt, output=output)
        self._apply(
            TurnFinished(
                now=now,
                turn_id=turn.turn_id,
                finish_reason="tool_calls" if tool_calls else "stop",
                prompt_tokens=prompt,
                completion_tokens=output,
                cached_tokens=cached,
            )
        )

    def run_ended(self, run_id: str, now: float) -> None:
        self._apply(RunEnded(now=now, run_id=run_id))

    def probe(self, now: float, engine: int, queued: int, running: int) -> None:
        self._apply(
            ReplicaProbed(
                now=now, replica=str(engine), healthy=True, queued=queued, running=running
            )
        )
        if engine == self.n - 1:
            self._apply(Tick(now=now))


ARMS: Sequence[str] = ("luftpause", "direct", "round_robin", "cache_aware", "priority", "program")
