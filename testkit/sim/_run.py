"""The virtual-time simulator: closed-loop agent runs through an admission layer and
N simulated engines, as a discrete-event simulation.

A run is a sequence of LLM turns separated by tool calls; its context grows by each
reply and tool result.  Closed loop: a finished run is replaced at once by a new run
of the same agent.  The admission layer sees the engines only as a gateway would:
turn lifecycle events, and a probe every 2 virtual seconds.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from scheduler import Policy, ServiceClass
from testkit.engine import EngineParams, EngineRequest, Finished, FirstToken, SimEngine
from testkit.sim._arms import (
    Arm,
    CacheAware,
    Direct,
    Luftpause,
    PriorityQueue,
    ProgramScheduling,
    RoundRobin,
    Send,
    Turn,
)

CHARS_PER_TOKEN = 4
MODEL = "llama-3.2-1b"


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """Every knob of a simulated workload (each one a CLI flag)."""

    name: str = "custom"
    engines: int = 2
    batch: int = 48
    interactive: int = 4
    context_chars: int = 8000  # the task's context at the first turn
    max_tool_calls: int = 3  # each run makes 0..max tool calls (uniform)
    tool_s: float = 2.0  # mean tool duration; each call takes 0.5..1.5 × this
    tool_result_chars: int = 1600  # what each tool result adds to the context
    reply_tokens: int = 256  # tokens generated per turn (= max_tokens)
    minutes: float = 3.0
    seed: int = 1
    # fanout: `runs` runs started together (and, as a second arm, one at a time)
    runs: int = 0
    engine: EngineParams = field(default_factory=EngineParams.reference)
    policy: Policy = field(default_factory=Policy)
    engine_priority: bool = False  # engines schedule by priority; interactive sent high
    # Replicas that time-share one GPU: each gets 1/k of it while k of them have work
    # (the reference bed runs two replicas on one GPU; a lone run gets all of it).
    replicas_per_gpu: int = 2
    # The luftpause arm knows the engines' running-request limit, as the gateway learns
    # SGLang's; False: as on vLLM (it exports none), only their queues cap it.
    slots_known: bool = True
    # The luftpause arm's estimate of a turn's prompt, as a multiple of the engine's
    # count.  The gateway estimates it from the request's bytes (a quarter of them),
    # which carry JSON and tool schemas besides the text; 1 is exact (helper-111: the
    # core's KV admission leans on it, so measure what an estimate off by 15 % costs).
    prompt_estimate: float = 1.0
    # A prefix every run's prompt begins with (a harness's system prompt and tool
    # schemas: Claude Code's is about 15k tokens), before its own context_chars.  Its
    # whole KV blocks are the same blocks in every run, so an engine caches them once.
    shared_prefix_chars: int = 0
    # The interactive runs' own prefix, when they come from another harness than the
    # batch runs (Claude Code's 15k tokens beside an own-loop agent's few hundred);
    # None: the same as the batch runs'.
    interactive_prefix_chars: int | None = None

    def __post_init__(self) -> None:
        for name in ("engines", "replicas_per_gpu"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "batch", "interactive", "runs", "max_tool_calls", "context_chars",
            "shared_prefix_chars", "interactive_prefix_chars",
        ):  # fmt: skip
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        for name in ("tool_s", "tool_result_chars"):
            if not 0 <= getattr(self, name) < math.inf:  # NaN too
                raise ValueError(f"{name} must be finite and >= 0, got {getattr(self, name)}")
        if self.reply_tokens < 1 or not 0 < self.minutes <= 10_000:
            raise ValueError(
                f"reply_tokens must be >= 1 and minutes 0 to 10000, got {self.reply_tokens}, "
                f"{self.minutes}"
            )
        if not 0.1 <= self.prompt_estimate <= 10:  # NaN too
            raise ValueError(f"prompt_estimate must be 0.1 to 10, got {self.prompt_estimate}")
        if self.context_chars < 1:
            raise ValueError("context_chars must be >= 1 (a turn has a prompt)")
        # A run's last turn must fit an engine's KV pool (as SGLang refuses a request
        # longer than its context): said here, not as a traceback minutes into a run.
        bt = self.engine.block_tokens
        need = -(-self.largest_prompt_tokens // bt) * bt + self.reply_tokens
        if need > self.engine.kv_pool_tokens:
            raise ValueError(
                f"a run's last turn needs {need:,} KV tokens ((its prefix's chars + "
                "context_chars)/4 + "
                f"max_tool_calls x (reply_tokens + tool_result_chars/4) = "
                f"{self.largest_prompt_tokens:,} prompt tokens in blocks of {bt}, and "
                f"{self.reply_tokens} to generate); an engine's KV pool has "
                f"{self.engine.kv_pool_tokens:,} (--kv-tokens)"
            )

    @property
    def largest_prompt_tokens(self) -> int:
        """The prompt of a run's last turn at most (see _Agent: the context grows by
        each reply and tool result)."""
        per_call = self.reply_tokens + math.ceil(self.tool_result_chars / CHARS_PER_TOKEN)
        first = max(self.first_prompt_tokens(c) for c in ServiceClass)
        return first + self.max_tool_calls * per_call

    def _own_prefix_chars(self, cls: ServiceClass) -> int | None:
        """The prefix of the class's own harness, if its runs have one."""
        return self.interactive_prefix_chars if cls is ServiceClass.INTERACTIVE else None

    def prefix_chars(self, cls: ServiceClass) -> int:
        """The prefix a run of the class begins with."""
        own = self._own_prefix_chars(cls)
        return self.shared_prefix_chars if own is None else own

    def prefix_stream(self, cls: ServiceClass) -> int:
        """The block stream of the class's prefix: 0 the batch runs' (and everyone's
        when they share it), -1 the interactive runs' own (streams of runs count
        from 1)."""
        return 0 if self._own_prefix_chars(cls) is None else -1

    def first_prompt_tokens(self, cls: ServiceClass) -> int:
        """A run's first prompt: its class's prefix, then its own context."""
        return math.ceil((self.prefix_chars(cls) + self.context_chars) / CHARS_PER_TOKEN)

    def shared_blocks(self, cls: ServiceClass) -> int:
        """The KV blocks the prompts of a class's runs share: its prefix's whole blocks
        (the one it ends in holds the run's own text too)."""
        return self.prefix_chars(cls) // CHARS_PER_TOKEN // self.engine.block_tokens


SCENARIOS: dict[str, Scenario] = {
    "flood": Scenario(name="flood", batch=48, interactive=4, context_chars=8000),
    "light": Scenario(name="light", batch=24, interactive=4, context_chars=2000),
    "routing": Scenario(name="routing", batch=0, interactive=8, context_chars=8000),
    "fanout": Scenario(
        name="fanout", batch=0, interactive=0, runs=16, context_chars=11200, minutes=30.0
    ),
}


@dataclass
class RunRecord:
    service_class: ServiceClass
    started: float
    ended: float
    turns: int
    replicas: int  # distinct engines its turns ran on


@dataclass
class TurnTimes:
    """When one turn reached each stage (`simulate(..., timeline=True)`)."""

    service_class: ServiceClass
    arrived: float
    sent: float | None = None  # handed to an engine
    engine: int | None = None
    first_token: float | None = None
    finished: float | None = None


@dataclass
class ArmResult:
    arm: str
    minutes: float
    interactive_runs: int = 0
    batch_runs: int = 0
    interactive_durations: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    moved_runs: int = 0
    makespan_s: float = 0.0
    wall_s: float = 0.0
    # With timeline=True: every turn's times, and each engine's prefill steps (start, end)
    turns: dict[str, TurnTimes] = field(default_factory=dict)
    prefill_steps: list[list[tuple[float, float]]] = field(default_factory=list)

    @property
    def interactive_per_min(self) -> float:
        return self.interactive_runs / self.minutes

    @property
    def batch_per_min(self) -> float:
        return self.batch_runs / self.minutes

    @property
    def cached_share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def percentile(self, q: float) -> float | None:
        return percentile(self.interactive_durations, q)

    def as_json(self) -> dict[str, Any]:
        return {
            "interactive_runs": self.interactive_runs,
            "batch_runs": self.batch_runs,
            "interactive_runs_per_min": round(self.interactive_per_min, 2),
            "interactive_p50_s": _round(self.percentile(0.5)),
            "interactive_p90_s": _round(self.percentile(0.9)),
            "batch_runs_per_min": round(self.batch_per_min, 2),
            "cached_prompt_token_share": round(self.cached_share, 3),
            "runs_that_moved": self.moved_runs,
            "makespan_s": round(self.makespan_s, 2) if self.makespan_s else None,
            "wall_s": round(self.wall_s, 2),
        }


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-quantile (0.5, 0.9, ...) of `values`, inclusive method; None when empty."""
    d = sorted(values)
    if not d:
        return None
    if len(d) == 1:
        return d[0]
    return statistics.quantiles(d, n=100, method="inclusive")[int(q * 100) - 1]


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


class _Agent:
    """One closed-loop agent: it runs one run after another."""

    def __init__(self, sim: Simulation, index: int, cls: ServiceClass, caller: str) -> None:
        self.sim = sim
        self.index = index
        self.service_class = cls
        self.caller = caller
        self.rng = random.Random(sim.scenario.seed * 1_000_003 + index)
        self.run_no = 0
        self.active = True

    def start_run(self, now: float) -> None:
        sc = self.sim.scenario
        self.run_no += 1
        self.run_id = f"a{self.index}-r{self.run_no}"
        self.stream = self.sim.new_stream()
        self.tool_calls_left = self.rng.randint(0, sc.max_tool_calls)
        self.context = sc.first_prompt_tokens(self.service_class)
        self.run_started = now
        self.turn_no = 0
        self.engines_used: set[int] = set()
        self.submit_turn(now)

    def submit_turn(self, now: float) -> None:
        sc = self.sim.scenario
        self.turn_no += 1
        block = self.sim.scenario.engine.block_tokens
        n_blocks = math.ceil(self.context / block)
        shared = min(sc.shared_blocks(self.service_class), n_blocks)
        prefix_stream = sc.prefix_stream(self.service_class)
        turn = Turn(
            turn_id=f"{self.run_id}-t{self.turn_no}",
            run_id=self.run_id,
            service_class=self.service_class,
            caller=self.caller,
            prompt_blocks=tuple(
                (prefix_stream if i < shared else self.stream, i) for i in range(n_blocks)
            ),
            prompt_tokens=self.context,
            max_tokens=sc.reply_tokens,
        )
        self.sim.arrive(turn, self, now)

    def turn_finished(self, turn: Turn, engine: int, now: float) -> bool:
        """Returns whether the turn ended in a tool call."""
        sc = self.sim.scenario
        self.engines_used.add(engine)
        self.context += sc.reply_tokens
        if self.tool_calls_left > 0:
            self.tool_calls_left -= 1
            self.context += math.ceil(sc.tool_result_chars / CHARS_PER_TOKEN)
            duration = sc.tool_s * self.rng.uniform(0.5, 1.5)
            self.sim.at(now + duration, lambda t: self.submit_turn(t))
            return True
        return False

    def run_done(self, now: float) -> RunRecord:
        return RunRecord(
            self.service_class, self.run_started, now, self.turn_no, len(self.engines_used)
        )


class Simulation:
    """One arm on one scenario, in virtual time."""

    def __init__(
        self, scenario: Scenario, arm: str, *, closed_loop: bool = True, timeline: bool = False
    ) -> None:
        self.scenario = scenario
        params = scenario.engine
        if scenario.engine_priority:
            params = replace(params, priority_scheduling=True)
        self.engines = [SimEngine(params) for _ in range(scenario.engines)]
        self.timeline: dict[str, TurnTimes] | None = {} if timeline else None
        if timeline:
            for engine in self.engines:
                engine.prefill_log = []
        k = max(1, scenario.replicas_per_gpu)
        self.gpus = [
            list(range(i, min(i + k, len(self.engines)))) for i in range(0, len(self.engines), k)
        ]
        self._gpu_of = {e: g for g in self.gpus for e in g}
        self.arm = make_arm(arm, scenario, self._send)
        self.closed_loop = closed_loop
        self.clock = 0.0
        self._events: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = 0
        self._wake: list[float | None] = [None] * len(self.engines)
        self._inflight: dict[str, tuple[Turn, _Agent]] = {}
        self._streams = 0
        self.records: list[RunRecord] = []
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def new_stream(self) -> int:
        self._streams += 1
        return self._streams

    def at(self, t: float, fn: Callable[[float], None]) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, fn))

    # ---------------------------------------------------------------- turn path

    def arrive(self, turn: Turn, agent: _Agent, now: float) -> None:
        self._inflight[turn.turn_id] = (turn, agent)
        if self.timeline is not None:
            self.timeline[turn.turn_id] = TurnTimes(turn.service_class, now)
        self.arm.arrive(turn, now)

    def _send(self, turn: Turn, engine: int) -> None:
        sc = self.scenario
        ranked = sc.engine_priority or sc.engine.low_priority_decode_cap is not None
        high = turn.service_class is ServiceClass.INTERACTIVE and ranked
        n_out = math.ceil(sc.reply_tokens / sc.engine.block_tokens)
        first = len(turn.prompt_blocks)
        # The run's own stream (its last block's: the first ones may be the shared prefix).
        stream = turn.prompt_blocks[-1][0] if turn.prompt_blocks else 0
        self.engines[engine].submit(
            EngineRequest(
                request_id=turn.turn_id,
                prompt_blocks=turn.prompt_blocks,
                prompt_tokens=turn.prompt_tokens,
                output_tokens=sc.reply_tokens,
                max_new_tokens=sc.reply_tokens,
                output_blocks=tuple((stream, first + i) for i in range(n_out)),
                priority=1 if high else 0,
            ),
            self.clock,
        )
        if self.timeline is not None:
            times = self.timeline[turn.turn_id]
            times.sent, times.engine = self.clock, engine
        self._share_gpu(engine)

    def _schedule_engine(self, e: int) -> None:
        t = self.engines[e].next_event_time()
        if t is None:
            return
        t = max(t, self.clock)
        if self._wake[e] is not None and self._wake[e] <= t:  # type: ignore[operator]
            return
        self._wake[e] = t
        self.at(t, lambda now, e=e: self._engine_wake(e, now))  # type: ignore[misc]

    def _engine_wake(self, e: int, now: float) -> None:
        if self._wake[e] != now:
            return  # superseded by an earlier wake-up
        self._wake[e] = None
        for out in self.engines[e].advance(now):
            turn, agent = self._inflight[out.request_id]
            if isinstance(out, FirstToken):
                if self.timeline is not None:
                    self.timeline[out.request_id].first_token = out.time
                self.arm.started(turn, out.time)
            elif isinstance(out, Finished):
                self._finished(turn, agent, e, out)
        self._share_gpu(e)

    def _share_gpu(self, e: int) -> None:
        """Re-divide engine e's GPU among its replicas that have work, then plan their
        next wake-ups."""
        group = self._gpu_of[e]
        busy = sum(1 for i in group if self.engines[i].busy)
        share = 1.0 / max(1, busy)
        for i in group:
            self.engines[i].set_gpu_share(share, self.clock)
            self._schedule_engine(i)

    def _finished(self, turn: Turn, agent: _Agent, e: int, out: Finished) -> None:
        del self._inflight[turn.turn_id]
        if self.timeline is not None:
            self.timeline[turn.turn_id].finished = out.time
        self.prompt_tokens += out.prompt_tokens
        self.cached_tokens += out.cached_tokens
        tool = agent.turn_finished(turn, e, out.time)
        self.arm.finished(
            turn,
            e,
            out.time,
            tool_calls=tool,
            prompt=out.prompt_tokens,
            output=out.completion_tokens,
            cached=out.cached_tokens,
        )
        if not tool:
            self.records.append(agent.run_done(out.time))
            self.arm.run_ended(turn.run_id, out.time)
            if self.closed_loop and agent.active:
                agent.start_run(out.time)

    def _probe(self, now: float) -> None:
        for e, engine in enumerate(self.engines):
            # Engines change state only at their own wake-ups, so this is current.
            m = engine.metrics()
            self.arm.probe(now, e, m.queued, m.running)
        self.at(now + self.arm.probe_period_s, self._probe)

    # ---------------------------------------------------------------- driving

    def run(
        self, agents: list[tuple[ServiceClass, str]], until: float, *, first_index: int = 0
    ) -> None:
        """Start the agents at t=0 and simulate until `until` (or, open loop, until
        every agent's run has ended).  Agent i's runs are seeded by first_index + i."""
        self.at(0.0, self._probe)
        for i, (cls, caller) in enumerate(agents):
            agent = _Agent(self, first_index + i, cls, caller)
            self.at(0.0, agent.start_run)
        while self._events:
            t, _, fn = heapq.heappop(self._events)
            if t > until:
                break
            self.clock = t
            fn(t)
            if not self.closed_loop and len(self.records) >= len(agents):
                break


def make_arm(name: str, scenario: Scenario, send: Send) -> Arm:
    n = scenario.engines
    if name == "luftpause":
        return Luftpause(
            n,
            send,
            model=MODEL,
            kv_tokens=scenario.engine.kv_pool_tokens,
            policy=scenario.policy,
            replicas_per_gpu=scenario.replicas_per_gpu,
            # As the gateway learns both from SGLang's /server_info.
            slots=scenario.engine.max_running_requests if scenario.slots_known else None,
            prompt_estimate=scenario.prompt_estimate,
        )
    if name == "program":
        # token_capacity_per_dp_rank: the KV pool, as vllm-router's docs have it set.
        return ProgramScheduling(n, send, token_capacity=scenario.engine.kv_pool_tokens)
    arms: dict[str, type[Arm]] = {
        "direct": Direct,
        "round_robin": RoundRobin,
        "cache_aware": CacheAware,
        "priority": PriorityQueue,
    }
    if name not in arms:
        raise ValueError(f"unknown arm {name!r}; known: luftpause, program, {', '.join(arms)}")
    return arms[name](n, send)


def _agents(
    sc: Scenario, *, batch: bool = True, interactive: bool = True
) -> list[tuple[ServiceClass, str]]:
    # Batch agents are one job (one caller); each interactive agent is its own user.
    out: list[tuple[ServiceClass, str]] = []
    if batch:
        out += [(ServiceClass.BATCH, "batch-job")] * sc.batch
    if interactive:
        out += [(ServiceClass.INTERACTIVE, f"user-{i}") for i in range(sc.interactive)]
    return out


def simulate(
    sc: Scenario,
    arm: str,
    *,
    batch: bool = True,
    interactive: bool = True,
    timeline: bool = False,
) -> ArmResult:
    """Run one arm closed-loop for `sc.minutes` virtual minutes (`timeline`: keep every
    turn's times and the engines' prefill steps in the result)."""
    import time

    t0 = time.perf_counter()
    sim = Simulation(sc, arm, timeline=timeline)
    until = sc.minutes * 60.0
    # Agents keep their indices, so their runs, without the others: the interactive
    # agents alone (the reference) are the mixed arms' very agents, not the first
    # batch agents' seeds.
    first = 0 if batch else sc.batch
    sim.run(_agents(sc, batch=batch, interactive=interactive), until, first_index=first)
    res = ArmResult(arm=arm, minutes=sc.minutes)
    for rec in sim.records:
        if rec.ended > until:
            continue
        if rec.replicas > 1:
            res.moved_runs += 1
        if rec.service_class is ServiceClass.INTERACTIVE:
            res.interactive_runs += 1
            res.interactive_durations.append(rec.ended - rec.started)
        else:
            res.batch_runs += 1
    res.prompt_tokens = sim.prompt_tokens
    res.cached_tokens = sim.cached_tokens
    if sim.timeline is not None:
        res.turns = sim.timeline
        res.prefill_steps = [e.prefill_log or [] for e in sim.engines]
    res.wall_s = time.perf_counter() - t0
    return res


def simulate_fanout(sc: Scenario, arm: str, *, together: bool) -> ArmResult:
    """`sc.runs` interactive runs from one caller: all at once, or one after another."""
    import time

    if sc.runs < 1:
        raise ValueError(f"fanout needs runs >= 1, got {sc.runs}")
    t0 = time.perf_counter()
    res = ArmResult(arm=arm if together else f"{arm} one-at-a-time", minutes=sc.minutes)
    agents = [(ServiceClass.INTERACTIVE, "harness")] * sc.runs
    unfinished = ValueError(
        f"{arm}: not every one of the {sc.runs} runs ended within {sc.minutes:g} minutes "
        f"(--minutes){'' if together else ', one at a time'}: give it more"
    )
    if together:
        sim = Simulation(sc, arm, closed_loop=False)
        sim.run(agents, sc.minutes * 60.0)
        records = sim.records
        if len(records) < sc.runs:
            raise unfinished
        res.prompt_tokens, res.cached_tokens = sim.prompt_tokens, sim.cached_tokens
    else:
        records = []
        offset = 0.0
        for i in range(sc.runs):
            # The i-th run alone: the same run (same seed) as when fanned out.
            sim = Simulation(sc, arm, closed_loop=False)
            sim.run(agents[i : i + 1], sc.minutes * 60.0, first_index=i)
            if not sim.records:
                raise unfinished
            rec = sim.records[0]
            records.append(replace(rec, started=offset, ended=offset + rec.ended))
            offset += rec.ended
            res.prompt_tokens += sim.prompt_tokens
            res.cached_tokens += sim.cached_tokens
    res.interactive_runs = len(records)
    res.interactive_durations = [r.ended - r.started for r in records]
    res.makespan_s = max(r.ended for r in records) - min(r.started for r in records)
    res.wall_s = time.perf_counter() - t0
    return res
