"""The admission layers the simulator compares, behind one small interface.

`luftpause` is the real scheduler core, fed exactly what the gateway will feed it.
The others are approximations of what users would deploy instead, good for fast
iteration only; the real routers are measured in real time by `luftpause bench flood`
(testkit/bench_agents.py).
"""

from __future__ import annotations

import math
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


ARMS: Sequence[str] = ("luftpause", "direct", "round_robin", "cache_aware", "priority")
