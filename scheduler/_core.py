"""The admission policy: `decide(state, event) -> (state, actions)`.

Rules, stated once (the README's "What it is" tells users), enforced here and nowhere else:

1. Everything that decides where and when a turn runs lives in `State`; the shell
   (the gateway's proxy and prober, or the simulator) only reports events and carries
   out actions.  No I/O, no clock, no randomness: `now` is a field of every event.
2. A replica that is unhealthy gets no turns.  A replica whose engine reports a queue
   (in `Policy.cap_after_queued_probes` probes in a row: one probe's queue is mostly
   the engine's next step) is capped at the number the engine was running; the cap grows by
   `Policy.cap_increase` at a probe that shows no queue while luftpause fills it, twice
   that at the next such probe in a row, and so on (`Policy.cap_growth_doubles`).  An
   engine that reports no load is never capped.  A replica whose engine's slots (the
   requests it runs at once) are known, configured or reported, takes no more turns
   than those at once either, capped or not: the turns past them wait here in this
   order, not in the engine's first-come queue.  A configured number stands; else
   the engine's latest report does.
3. A generating or paused run goes only to the replica that served its last turn
   (strict affinity) unless that replica is unhealthy, and so does the retry of a
   failed turn (its run is idle, but its prefix is cached there).  Any other idle run
   prefers its last replica but may move; a new run goes to the least loaded healthy
   replica.  A run's replica is that of its last admitted turn, except that a run
   generating on a healthy replica, or paused on a tool there or retrying a failed
   turn there (with strict affinity), stays there when another of its turns goes
   elsewhere (a model that replica does not serve, or affinity off): its prefix and KV
   claim stay where that turn runs or will come back, and the turn away claims KV
   where it runs, until it ends, for its own prompt and reply (its request is not the
   run's conversation); its usage is not the run's context, and a paused (or
   retrying) run stays so through it (a harness's side request to a small model while
   a tool runs does not cost the run its replica).  A turn of a model the run's
   replica does not serve prefers, as an idle run prefers its replica, where the run's
   last turn of that model ran (a turn away, or its own before it moved to another
   model): a side request that comes first when the run is idle moves the run, and
   the main model's next turn finds its prefix again.  A turn away of another model
   that carries the conversation (a prompt at least half the run's context) and
   finishes is no side request: the model was switched to while the run waited on a
   tool, and the run goes on where that turn ran, with its model, paused on a tool
   there (its turn asked for one) or idle.  (A
   turn's usage sets its run's
   context, which sizes the run's claim and its held turns, but does not shrink it
   while another turn of the run still runs there.)  A held turn waits where its run
   may go now, not where it was when the turn arrived: a run that goes idle, moves,
   ends or is forgotten, or whose replica leaves or rejoins rotation, takes its held
   turns with it.
4. Batch turns leave one slot (of the cap or the engine's slots) for every interactive
   run paused on a tool there, and stop at `Policy.batch_kv_fill` of a replica's KV
   pool (interactive runs may fill `Policy.kv_fill`).  A paused run's slot lapses
   with its claim on the pool, after `Policy.kv_retention_s` (a run paused that long
   waits on a person or a long tool: batch need not stand idle for it meanwhile).
5. Held turns are taken interactive first, then the caller with the fewest turns in
   flight, then arrival order.  A held turn waits until placed, abandoned or refused
   (rules 11 and 14).  With
   `Policy.max_held_per_caller`, a caller with that many turns of a class held is
   refused (429) a turn of that class that would start or resume an idle run; a run in
   progress (that the core knows) is never refused.
6. A run that is not yet bound to a replica is admitted there only while the KV working
   set of the runs bound to it fits the replica's pool (program-level admission), so
   the prefix caches of paused runs survive.  A paused run's claim on the pool lapses
   after `Policy.kv_retention_s`, and exists only under strict affinity (elsewhere it
   would not come back to it).  An unbound turn waiting for KV is not overtaken by
   unbound turns of its class or below; bound (continuing) runs go on.  A run's claim
   is its context and its last admitted turn's reply; another of its turns still
   running on its replica when a later one goes in there claims its own reply until it
   ends (parallel requests of one conversation generate both).  A turn larger than its
   class's limit on its own goes in once no other run of its class holds KV on the
   replica (it could never fit beside them).
7. A model no replica serves is rejected with 404 before it is queued, and a model
   whose every replica is unhealthy with 503 (waiting would hang the client until
   one comes back; it may retry).  Turns already held when that happens keep waiting.
8. Ticks free the slots of turns never reported finished after `turn_timeout_s` (as it
   was at their admission, as the gateway's wait for the engine) from their admission
   or their last sign of life (`TurnAlive`), and forget runs idle or paused for
   `idle_run_expiry_s` (a run with a turn held is not idle).
9. Interactive lanes (`Policy.lane_batch_kv_fill` set): a new interactive run goes first
   to the replica where the most interactive runs hold KV, and on a replica where any
   do, new batch runs stop at `lane_batch_kv_fill` of its pool; the other replicas take
   batch whole.  Interactive runs then share their replica with little batch KV, whose reads
   slow every decode step.
10. A replica whose engine failed `Policy.eject_after_failures` turns in a row is out
    of rotation (unhealthy, its runs free to move) for `Policy.eject_for_s`, though its
    health check passes; then it is back as its last probe left it.
11. The pool may change while turns run (`PoolChanged`, the whole pool as it is now).
    A new replica joins out of rotation until a probe finds it healthy (an engine still
    loading its weights would fail the turns sent to it); a known one takes its new
    spec (held turns pinned to it for a model it no longer serves may go elsewhere); one
    left out is retired: out of rotation as if unhealthy, probes ignored, its turns in
    flight finishing there, its runs moving at their next turn, and forgotten once no
    turn runs and no run is bound there.  A held turn whose model no replica serves any
    more is rejected with 404.
12. The policy may change while turns run (`PolicyChanged`).  What is counted stays as
    it is: turns keep the reply size they were held with, caps stand until the next
    probe, an ejected replica stays out for the time it was given, and KV claims made
    stay until their runs' next change; except that claims the new policy would not make
    (program-level admission or strict affinity switched off) are dropped at once, as
    are caps when capping from the engine's queue is switched off, and held turns pinned
    to a replica are freed when strict affinity is; and program-level admission switched
    on counts what runs on each replica at once, as where a replica's KV pool becomes
    known (`_claims_start`), as strict affinity switched on counts the paused runs.
    Then every replica is refilled under the new rules.
13. Shared devices (`Policy.pack_shared_devices`, replicas that declare a `device`):
    replicas on one GPU time-slice it, so each decodes at about half speed while the
    other has work.  While interactive runs hold KV on a device, the device's replica in
    rotation with the most of them (the first by name on a tie) leads it, and the
    device's other replicas take no new runs of the models it serves: with strict
    affinity their runs go on there (rule 3) and end, and the leader's decode steps get
    the whole GPU.
14. A drain (`Drained`: the gateway is stopping) refuses every held turn 503 and every
    turn that arrives after it, and admits nothing from then on; turns admitted go on
    to their end.  All held turns go in one decision, with no refill between them: a
    refusal that freed room would otherwise let a later held turn in, to start on a
    stopping gateway and be cut at the end of its grace.

After every event no held turn is admissible (except behind a turn waiting for KV, as
in rule 6): each event that frees capacity on a replica refills that replica, and one
that may change which replica leads a device (rule 13) refills the device's replicas.  Held
turns are bucketed by where they may go (one replica, or any replica serving a model)
and class; each bucket orders its callers by (turns in flight, oldest held turn) in a
persistent sorted set, so picking the next turn for a replica reads a few bucket heads
(O(1)) and updating the order is O(log n) comparisons.

Events about turns the core no longer knows (a finish after the turn timed out, an
abandon after admission raced) are ignored; contract violations (a duplicate turn id,
an unknown replica) raise `SchedulerError` and leave the state as it was.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Final

from immutables import Map, MapMutation

from scheduler._persistent import PSortedSet, Record, empty
from scheduler._types import (
    Action,
    Admit,
    Drained,
    Ejected,
    Event,
    Forget,
    Policy,
    PolicyChanged,
    PoolChanged,
    Reject,
    ReplicaProbed,
    ReplicaSpec,
    RunEnded,
    RunPhase,
    SchedulerError,
    ServiceClass,
    Tick,
    TimedOut,
    TurnAbandoned,
    TurnAlive,
    TurnArrived,
    TurnFailed,
    TurnFinished,
    TurnStarted,
    unknown_model,
)

__all__ = ["ReplicaState", "RunState", "State", "TurnState", "decide"]

_INTERACTIVE = ServiceClass.INTERACTIVE
_BATCH = ServiceClass.BATCH
_GENERATING = RunPhase.GENERATING
_PAUSED = RunPhase.PAUSED
_IDLE = RunPhase.IDLE
_CLASSES = (_INTERACTIVE, _BATCH)
_NO_MODELS: frozenset[str] = frozenset()
_PIN = "pin"
_MODEL = "model"

# A bucket key: ("pin", replica, class) or ("model", model, class).
BucketKey = tuple[str, str, ServiceClass]


# A learned prompt scale (Policy.learn_prompt_scale): each finished turn whose estimate
# was at least this many tokens (below, a chat template's own tokens dominate) and
# measures the whole prompt (TurnArrived.learnable) is a sample of engine count /
# estimate, kept within these bounds (a tokenizer is 0.7-1.4 of a quarter of the
# bytes; a template that drops the tools, lower), and weighs this much in the model's
# running average; its first sample is taken whole.
PROMPT_SCALE_MIN_TOKENS = 256
PROMPT_SCALE_BOUNDS = (0.5, 2.0)
PROMPT_SCALE_WEIGHT = 0.1
# A learned shared prefix (Policy.learn_shared_prefix): the lower quartile of the cached tokens
# of this many of a model's latest first turns.
SHARED_PREFIX_SAMPLES = 9
SHARED_PREFIX_MIN_SAMPLES = 3
# ... and it moves at most this often (virtual seconds): each move counts the model's
# runs' claims again, a walk over the runs (helper-124: with two harnesses on a model
# the quartile moved on 12 % of first turns, 60-80 ms each with 10,000 runs).
SHARED_PREFIX_MOVE_S = 10.0

# A model's learned shared prefix: (the prefix, when it last moved, the samples).
SharedPrefix = tuple[int, float, tuple[int, ...]]


class ReplicaState(Record):
    """A replica as the core counts it."""

    _FIELDS = (
        "spec", "probe_ok", "queued", "running", "cap", "in_flight", "paused_interactive",
        "bound_runs", "ws_tokens", "interactive_runs", "batch_ws", "queued_probes",
        "failures", "ejected_until", "cap_step", "slots_given", "kv_given", "reports_cache",
    )  # fmt: skip
    __slots__ = _FIELDS

    def __init__(
        self,
        spec: ReplicaSpec,
        probe_ok: bool = True,
        queued: int | None = None,
        running: int | None = None,
        cap: int | None = None,
        in_flight: int = 0,
        paused_interactive: int = 0,
        bound_runs: int = 0,
        ws_tokens: int = 0,
        interactive_runs: int = 0,
        batch_ws: int = 0,
        queued_probes: int = 0,
        failures: int = 0,
        ejected_until: float | None = None,
        cap_step: int = 0,
        slots_given: bool = False,
        kv_given: bool = False,
        reports_cache: bool = False,
    ) -> None:
        self.spec: Final = spec
        self.probe_ok: Final = probe_ok  # its last probe passed
        self.queued: Final = queued  # the engine's load at the last probe
        self.running: Final = running
        self.cap: Final = cap  # None: uncapped
        self.in_flight: Final = in_flight  # turns luftpause admitted here and not yet finished
        self.paused_interactive: Final = paused_interactive  # runs paused on a tool here
        self.bound_runs: Final = bound_runs  # generating or paused runs whose replica this is
        self.ws_tokens: Final = ws_tokens  # their KV working set (context + reply), while claimed
        self.interactive_runs: Final = interactive_runs  # interactive runs holding KV here (rule 9)
        self.batch_ws: Final = batch_ws  # the part of ws_tokens that batch runs claim
        self.queued_probes: Final = queued_probes  # probes in a row that showed a queue
        self.failures: Final = failures  # turns its engine failed in a row
        self.ejected_until: Final = ejected_until  # out of rotation until then (rule 10)
        self.cap_step: Final = cap_step  # the cap's next growth (0: Policy.cap_increase)
        # spec.slots is the configuration's (a probe's report does not replace it);
        # else it is None or the engine's last report.
        self.slots_given: Final = slots_given
        self.kv_given: Final = kv_given  # the same of spec.kv_tokens
        # Its engine said it found some of a prompt cached: it says so of every answer,
        # and one that says nothing found nothing (SGLang and vLLM leave cached_tokens
        # out at 0, and with their flag off always).  A 0 said is no such sign: SGLang's
        # Anthropic API says 0 with its flag off (helper-176).
        self.reports_cache: Final = reports_cache

    @property
    def healthy(self) -> bool:
        """In rotation: its last probe passed and it is not ejected (rule 10)."""
        return self.probe_ok and self.ejected_until is None

    @property
    def load(self) -> int:
        """What "least loaded" compares: turns running here and runs coming back."""
        return self.in_flight + self.bound_runs

    @property
    def limit(self) -> int | None:
        """The most turns luftpause has in flight here: the cap, the engine's slots,
        whichever is lower; None: no limit."""
        cap, slots = self.cap, self.spec.slots
        if cap is None:
            return slots
        return cap if slots is None or cap < slots else slots

    def has_slot(self) -> bool:
        if not self.healthy:
            return False
        limit = self.limit
        return limit is None or self.in_flight < limit

    def batch_room(self, policy: Policy) -> bool:
        limit = self.limit
        if limit is None or not policy.reserve_for_paused_interactive:
            return True
        return self.in_flight + self.paused_interactive < limit


def _joining(spec: ReplicaSpec, *, probe_ok: bool) -> ReplicaState:
    """A replica new to the core: its slots and KV pool given by the file when its spec
    has them."""
    return ReplicaState(
        spec,
        probe_ok=probe_ok,
        slots_given=spec.slots is not None,
        kv_given=spec.kv_tokens is not None,
    )


class RunState(Record):
    """A run the core knows: generating, paused on a tool, or idle."""

    _FIELDS = (
        "run_id", "service_class", "caller", "model", "phase", "replica", "in_flight",
        "context_tokens", "reply_tokens", "last_active", "bound", "ws_claim",
        "counted_paused", "ended", "retrying", "home_outcome", "first_cached", "side", "turn",
    )  # fmt: skip
    __slots__ = _FIELDS

    def __init__(
        self,
        run_id: str,
        service_class: ServiceClass,
        caller: str,
        model: str,
        phase: RunPhase,
        replica: str | None,
        in_flight: int,
        context_tokens: int,
        reply_tokens: int,
        last_active: float,
        bound: bool,
        ws_claim: int,
        counted_paused: bool,
        ended: bool = False,
        retrying: bool = False,
        home_outcome: str = "",
        first_cached: int = -1,
        side: tuple[str, str] | None = None,
        turn: str = "",
    ) -> None:
        self.run_id: Final = run_id
        self.service_class: Final = service_class
        self.caller: Final = caller
        self.model: Final = model
        self.phase: Final = phase
        self.replica: Final = replica  # the replica of its last admitted turn
        self.in_flight: Final = in_flight
        self.context_tokens: Final = context_tokens  # prompt + reply of its last turn
        self.reply_tokens: Final = reply_tokens  # the reply length reserved for its turns
        self.last_active: Final = last_active  # when it last changed phase
        self.bound: Final = bound  # counted in its replica's bound_runs
        self.ws_claim: Final = ws_claim  # tokens counted in its replica's ws_tokens (0: none)
        self.counted_paused: Final = counted_paused  # counted in its replica's paused_interactive
        self.ended: Final = ended  # ended by the client while turns were in flight
        self.retrying: Final = retrying  # idle because its last turn failed: the retry goes back
        # How its last turn on its replica ended while a turn of it away still ran
        # ("tool_calls", "stop", "failed"; "" none): what the run does when that one ends.
        self.home_outcome: Final = home_outcome
        # What its engine found cached of its first turn's prompt, or of its first turn of
        # its current model: the most of the model's shared prefix its claim leaves out
        # (learn_shared_prefix).  -1: not known yet (the prefix is left out); 0 also when
        # that turn failed or its engine reported no usage (counted whole).
        self.first_cached: Final = first_cached
        # (model, replica): where its last turn of another model than its own ran (a turn
        # away, or its own before the run moved to this model), its prefix for that
        # model cached there.  A turn of that model prefers it (rule 3).
        self.side: Final = side
        # Its last turn admitted on its replica (not away), whose reply its claim
        # reserves; "": none.  When another turn of it goes in there while that one
        # runs, that one claims its own reply (TurnState.claim) until it ends.
        self.turn: Final = turn

    @property
    def keeps_replica(self) -> bool:
        """Its next turn goes to its replica while that is healthy (rule 3)."""
        return self.phase is not _IDLE or self.retrying


class TurnState(Record):
    """A turn the core knows: held (in a bucket) or admitted (to a replica)."""

    _FIELDS = (
        "turn_id", "run_id", "service_class", "caller", "model", "arrived", "seq",
        "prompt_tokens", "reply_tokens", "bucket", "replica", "admitted_at", "started",
        "alive_at", "claim", "estimate", "first", "timeout_s",
    )  # fmt: skip
    __slots__ = _FIELDS

    def __init__(
        self,
        turn_id: str,
        run_id: str,
        service_class: ServiceClass,
        caller: str,
        model: str,
        arrived: float,
        seq: int,
        prompt_tokens: int,
        reply_tokens: int,
        bucket: BucketKey | None,
        replica: str | None,
        admitted_at: float,
        started: bool,
        alive_at: float = 0.0,
        claim: int = 0,
        estimate: int = 0,
        first: bool = False,
        timeout_s: float = 0.0,
    ) -> None:
        self.turn_id: Final = turn_id
        self.run_id: Final = run_id
        self.service_class: Final = service_class
        self.caller: Final = caller
        self.model: Final = model
        self.arrived: Final = arrived
        self.seq: Final = seq
        self.prompt_tokens: Final = prompt_tokens
        self.reply_tokens: Final = reply_tokens
        self.bucket: Final = bucket  # while held
        self.replica: Final = replica  # once admitted
        self.admitted_at: Final = admitted_at
        self.started: Final = started
        # Admission, or the last TurnAlive: the turn timeout counts from it.
        self.alive_at: Final = alive_at
        # KV this turn claims on its replica by itself: a turn admitted away from its
        # run's replica (rule 3), whose run's claim stays there (its prompt and reply);
        # or one on its run's replica that another turn of the run went in beside
        # while it ran (its reply: the run's claim reserves the later turn's).  0:
        # none (its run's claim counts).
        self.claim: Final = claim
        # The prompt as the turn arrived (the gateway's estimate), before the model's
        # learned scale made `prompt_tokens` of it; 0: none to learn from.
        self.estimate: Final = estimate
        # Admitted as its run's first turn (the core knew no run of it): what its engine
        # found cached of its prompt is shared with other runs (learn_shared_prefix).
        self.first: Final = first
        # The policy's turn_timeout_s at its admission (0 while held): a reload changes
        # it for turns admitted later, as the proxy's own wait for the engine
        # (helper-164: a shorter one freed the slots of turns still running).
        self.timeout_s: Final = timeout_s

    def deadline(self) -> float:
        """When it times out without another sign of life (its key in `timeouts`)."""
        return self.alive_at + self.timeout_s


class _Bucket(Record):
    """The turns held for one place (a replica, or any replica of a model) and class."""

    _FIELDS = ("queues", "order")
    __slots__ = _FIELDS

    def __init__(
        self,
        queues: Map[str, PSortedSet[tuple[int, str]]],
        order: PSortedSet[tuple[int, int, str]],
    ) -> None:
        # caller -> that caller's held turns here, as (seq, turn_id)
        self.queues: Final = queues
        # (caller's turns in flight, seq of its oldest held turn here, caller)
        self.order: Final = order


class _Caller(Record):
    _FIELDS = ("in_flight", "buckets")
    __slots__ = _FIELDS

    def __init__(self, in_flight: int, buckets: frozenset[BucketKey]) -> None:
        self.in_flight: Final = in_flight
        self.buckets: Final = buckets  # where it has held turns


_EMPTY_BUCKET = _Bucket(Map(), empty())
_NEW_CALLER = _Caller(0, frozenset())


class State:
    """The scheduler's whole state; immutable (every field is a persistent structure)."""

    __slots__ = (
        "_buckets",
        "_callers",
        "_draining",
        "_expiry",
        "_held_runs",
        "_models",
        "_policy",
        "_prompt_scale",
        "_replicas",
        "_retention",
        "_retired",
        "_runs",
        "_seq",
        "_shared_prefix",
        "_timeouts",
        "_turns",
    )

    def __init__(
        self,
        policy: Policy,
        models: Map[str, tuple[str, ...]],
        replicas: Map[str, ReplicaState],
        runs: Map[str, RunState],
        turns: Map[str, TurnState],
        callers: Map[str, _Caller],
        buckets: Map[BucketKey, _Bucket],
        seq: int,
        timeouts: PSortedSet[tuple[float, str]],
        expiry: PSortedSet[tuple[float, str]],
        retention: PSortedSet[tuple[float, str]],
        retired: frozenset[str] = frozenset(),
        held_runs: Map[str, tuple[str, ...]] | None = None,
        prompt_scale: Map[str, float] | None = None,
        shared_prefix: Map[str, SharedPrefix] | None = None,
        draining: str | None = None,
    ) -> None:
        self._policy = policy
        self._models = models
        self._replicas = replicas
        self._runs = runs
        self._turns = turns
        self._callers = callers
        self._buckets = buckets
        self._seq = seq
        self._timeouts = timeouts
        self._expiry = expiry
        self._retention = retention
        self._retired = retired  # replicas that left the pool and are not forgotten yet
        # run id -> its held turns' ids, in arrival order: where a change of the run
        # (its phase, its replica, its end) finds the turns to re-bucket.
        self._held_runs: Map[str, tuple[str, ...]] = Map() if held_runs is None else held_runs
        # model -> engine count / estimate of its prompts, learned (learn_prompt_scale)
        self._prompt_scale: Map[str, float] = Map() if prompt_scale is None else prompt_scale
        # model -> (the prefix its runs share, in tokens; when it last moved; the last
        # first turns' cached tokens it is the lower quartile of), learned
        # (learn_shared_prefix)
        self._shared_prefix: Map[str, SharedPrefix] = (
            Map() if shared_prefix is None else shared_prefix
        )
        # The refusal of every turn since the gateway began to stop (rule 14); None:
        # it is not stopping.
        self._draining = draining

    @classmethod
    def initial(cls, replicas: Sequence[ReplicaSpec], policy: Policy | None = None) -> State:
        """A state for this pool; replicas count as healthy until a probe says otherwise."""
        names = [r.name for r in replicas]
        if len(set(names)) != len(names):
            raise SchedulerError(f"replica names must be unique: {names}")
        return cls(
            policy or Policy(),
            _models_of(replicas),
            Map({r.name: _joining(r, probe_ok=True) for r in replicas}),
            Map(),
            Map(),
            Map(),
            Map(),
            0,
            empty(),
            empty(),
            empty(),
        )

    # ----------------------------------------------------------------- read access

    @property
    def policy(self) -> Policy:
        return self._policy

    @property
    def models(self) -> Map[str, tuple[str, ...]]:
        """Model -> the replicas of the pool that serve it (retired ones are not)."""
        return self._models

    @property
    def prompt_scale(self) -> Map[str, float]:
        """Model -> what its engines counted of a prompt per token estimated, learned
        from finished turns (Policy.learn_prompt_scale); a model with none yet is
        taken at its estimate."""
        return self._prompt_scale

    def shared_prefix(self, model: str) -> int:
        """The tokens of the prefix the model's runs share (a harness's system prompt
        and tools), learned from what engines found cached of runs' first turns
        (Policy.learn_shared_prefix); 0: none known."""
        learned = self._shared_prefix.get(model)
        return learned[0] if learned else 0

    def shared_once(self, replica: str) -> int:
        """The shared prefixes program-level admission counts once on a replica: those
        of every model it serves (0 with learn_shared_prefix off)."""
        models = self._replicas[replica].spec.models
        return _prefixes_once(self._shared_prefix, self._policy, models)

    @property
    def shared_prefixes(self) -> Map[str, SharedPrefix]:
        """Model -> (its shared prefix, when it last moved, the samples it is the lower
        quartile of)."""
        return self._shared_prefix

    @property
    def replicas(self) -> Map[str, ReplicaState]:
        """Every replica the core knows: the pool's, and retired ones not yet forgotten."""
        return self._replicas

    @property
    def retired(self) -> frozenset[str]:
        """The replicas that left the pool and are not forgotten yet (rule 11)."""
        return self._retired

    @property
    def runs(self) -> Map[str, RunState]:
        return self._runs

    @property
    def turns(self) -> Map[str, TurnState]:
        return self._turns

    @property
    def draining(self) -> str | None:
        """The 503's message for every turn since a drain (rule 14); None before one."""
        return self._draining

    def caller_in_flight(self, caller: str) -> int:
        c = self._callers.get(caller)
        return c.in_flight if c is not None else 0

    def held(self) -> list[TurnState]:
        """Held turns, in no particular order."""
        return [t for t in self._turns.values() if t.replica is None]

    def held_count(self) -> int:
        return sum(len(q) for b in self._buckets.values() for q in b.queues.values())

    def held_of(self, run_id: str) -> list[TurnState]:
        """A run's held turns (by its index: no walk over every turn)."""
        return [self._turns[tid] for tid in self._held_runs.get(run_id, ())]

    def admitted(self) -> list[TurnState]:
        return [t for t in self._turns.values() if t.replica is not None]

    def kv_limit(
        self, replica: str, service_class: ServiceClass = ServiceClass.INTERACTIVE
    ) -> float | None:
        """The working-set limit of program-level admission there, None when off."""
        r = self._replicas[replica]
        kv = r.spec.kv_tokens
        if kv is None or not self._policy.kv_admission:
            return None
        return kv * _kv_share(self._policy, service_class, r.interactive_runs > 0)

    def kv_need(self, turn: TurnState) -> int:
        """The KV working set the turn's run will claim if admitted as a new binding (a
        turn away from its run's replica claims its own prompt and reply, rule 3)."""
        shared = _learned_prefix(self._shared_prefix, self._policy, turn.model)
        run = self._runs.get(turn.run_id)
        return _kv_need(turn, run, _prefix_of(run, shared))

    def led_by(self, replica: str) -> str | None:
        """The replica of its device that takes the device's new runs while this one
        takes none and drains (rule 13), or None."""
        r = self._replicas[replica]
        if r.spec.device is None or not self._policy.pack_shared_devices:
            return None
        return _leader(self._replicas, self._replicas.keys(), self._retired, replica, r)


def _leader(
    replicas: Map[str, ReplicaState] | MapMutation[str, ReplicaState],
    names: Iterable[str],
    retired: frozenset[str],
    name: str,
    r: ReplicaState,
) -> str | None:
    """Rule 13: the replica in rotation on r's device (of `names`) that holds the most
    interactive runs with KV, the first by name on a tie, if it is not r; None: r leads
    (or none holds any)."""
    best, most = name, r.interactive_runs
    device = r.spec.device
    for other in names:
        o = replicas.get(other)
        if (
            o is not None
            and o.interactive_runs >= most
            and o.interactive_runs
            and other != name
            and o.spec.device == device
            and o.healthy
            and other not in retired
            and (o.interactive_runs > most or other < best)
        ):
            best, most = other, o.interactive_runs
    return None if best == name else best


def _models_of(specs: Sequence[ReplicaSpec]) -> Map[str, tuple[str, ...]]:
    """Model -> the replicas that serve it, in the pool's order."""
    models: dict[str, list[str]] = {}
    for spec in specs:
        for m in sorted(spec.models):
            models.setdefault(m, []).append(spec.name)
    return Map({m: tuple(names) for m, names in models.items()})


def _lane(run: RunState) -> int:
    """1 if the run makes its replica an interactive lane: interactive, holding KV."""
    return 1 if run.ws_claim and run.service_class is _INTERACTIVE else 0


def _batch_claim(run: RunState) -> int:
    return run.ws_claim if run.service_class is _BATCH else 0


def _batch_part(turn: TurnState, claim: int) -> int:
    """The part of a turn's own claim that counts in its replica's batch_ws."""
    return claim if turn.service_class is _BATCH else 0


def _kv_need(turn: TurnState, run: RunState | None, shared: int = 0) -> int:
    """The KV the turn's run needs on a replica that takes it: its context (the turn's
    prompt, or the run's context if larger) but the `shared` prefix its model's runs
    have in common, and the reply."""
    context = turn.prompt_tokens
    if run is not None and run.context_tokens > context:
        context = run.context_tokens
    return max(context - shared, 0) + turn.reply_tokens


def _learned_prefix(prefixes: Map[str, SharedPrefix], policy: Policy, model: str) -> int:
    """A model's shared prefix as program-level admission counts it (0 with
    learn_shared_prefix off, or none learned)."""
    if not policy.learn_shared_prefix:
        return 0
    learned = prefixes.get(model)
    return learned[0] if learned else 0


def _prefixes_once(prefixes: Map[str, SharedPrefix], policy: Policy, models: Iterable[str]) -> int:
    """The shared prefixes a replica caches once: those of every model it serves."""
    if not prefixes or not policy.learn_shared_prefix:
        return 0
    return sum(_learned_prefix(prefixes, policy, m) for m in models)


def _prefix_of(run: RunState | None, shared: int) -> int:
    """What a run's KV claim leaves out of its context: its model's `shared` prefix, at
    most what its first turn found cached.  Until that turn has said, a new run is taken
    to begin with the prefix, as most of the model's runs did (the prefix is their lower
    quartile); one that does not is counted whole from its first turn's end on.  (Counted
    whole until then, runs 15k tokens apart from a prefix each went in one at a time:
    the flood's batch was 0.26x cache_aware's against 0.74x; helper-123 showed the cost,
    a replica past its limit while such first turns run, bench/RESULTS.md.)"""
    if run is None or run.first_cached < 0:
        return shared
    return run.first_cached if run.first_cached < shared else shared


def _side_after(old: RunState | None, model: str) -> tuple[str, str] | None:
    """A run's `side` once a turn of `model` is its own: where its old model's prefix
    is, when the run moves to another model; else as it was."""
    if old is None:
        return None
    if old.model != model and old.replica is not None:
        return (old.model, old.replica)
    return old.side


def _away_need(turn: TurnState) -> int:
    """The KV a turn away from its run's replica claims where it runs (rule 3): its own
    prompt and reply.  Its request is not the run's conversation (a harness's side
    request to a small model), so the run's context does not size it."""
    return turn.prompt_tokens + turn.reply_tokens


def _expiry_key(run: RunState | None) -> tuple[float, str] | None:
    """The run's entry in the expiry timer (rule 8): while it is not generating and no
    turn of it runs (a paused run's turn away, rule 3, keeps it)."""
    if run is None or run.phase is _GENERATING or run.in_flight:
        return None
    return run.last_active, run.run_id


def _rekeyed(
    timer: PSortedSet[tuple[float, str]],
    before: tuple[float, str] | None,
    after: tuple[float, str] | None,
) -> PSortedSet[tuple[float, str]]:
    """The timer with its entry `before` replaced by `after` (None: no entry)."""
    if before != after:
        if before is not None:
            timer = timer.remove(before)
        if after is not None:
            timer = timer.add(after)
    return timer


def _retention_key(run: RunState | None) -> tuple[float, str] | None:
    """The run's entry in the retention timer (rules 4 and 6): while paused with a claim
    on the pool or on a slot."""
    if run is None or run.phase is not _PAUSED or not (run.ws_claim or run.counted_paused):
        return None
    return run.last_active, run.run_id


def _kv_share(policy: Policy, service_class: ServiceClass, lane: bool) -> float:
    """The share of a replica's KV pool that new runs of this class may fill there
    (`lane`: the replica holds interactive runs)."""
    share = policy.kv_fill
    if service_class is _BATCH:
        if policy.batch_kv_fill is not None and policy.batch_kv_fill < share:
            share = policy.batch_kv_fill
        if lane and policy.lane_batch_kv_fill is not None and policy.lane_batch_kv_fill < share:
            share = policy.lane_batch_kv_fill
    return share


# --------------------------------------------------------------------------- decide


def decide(state: State, event: Event) -> tuple[State, list[Action]]:
    """Apply one event; return the new state and what the shell must do."""
    tx = _Tx(state, event.now)
    if isinstance(event, TurnArrived):
        tx.arrive(event)
    elif isinstance(event, TurnFinished):
        tx.turn_done(
            event.turn_id,
            event.finish_reason,
            event.prompt_tokens,
            event.completion_tokens,
            cached=event.cached_tokens,
        )
    elif isinstance(event, TurnStarted):
        tx.started(event.turn_id)
    elif isinstance(event, TurnAlive):
        tx.alive(event.turn_id)
    elif isinstance(event, TurnFailed):
        tx.turn_done(event.turn_id, None, 0, 0, engine_fault=event.engine_fault)
    elif isinstance(event, TurnAbandoned):
        tx.abandon(event.turn_id)
    elif isinstance(event, ReplicaProbed):
        tx.probe(event)
    elif isinstance(event, Tick):
        tx.tick()
    elif isinstance(event, RunEnded):
        tx.run_ended(event.run_id)
    elif isinstance(event, PoolChanged):
        tx.pool_changed(event.replicas, event.slots_unknown)
    elif isinstance(event, PolicyChanged):
        tx.policy_changed(event.policy)
    elif isinstance(event, Drained):
        tx.drain(event.message)
    else:  # pragma: no cover - exhaustiveness
        raise SchedulerError(f"unknown event {event!r}")
    if tx.refill:
        # Replicas a change opened after their last look (rule 13: the device's leader
        # changed, or left rotation).
        names = list(dict.fromkeys(tx.refill))
        tx.refill.clear()
        tx._fill(names)
    return tx.finish(), tx.actions


class _Tx:
    """One decision's working copy: mutable maps over the persistent ones, like a
    Clojure transient.  It never touches the `State` it started from."""

    def __init__(self, state: State, now: float) -> None:
        self.state = state
        self.now = now
        self.policy = state._policy
        self.models = state._models
        self.replicas = state._replicas.mutate()
        self.runs = state._runs.mutate()
        self.turns = state._turns.mutate()
        self.callers = state._callers.mutate()
        self.buckets = state._buckets.mutate()
        self.seq = state._seq
        self.timeouts = state._timeouts
        self.expiry = state._expiry
        self.retention = state._retention
        self.retired = state._retired
        self.held_runs = state._held_runs.mutate()
        self.prompt_scale = state._prompt_scale
        self.shared_prefix = state._shared_prefix
        self.draining = state._draining
        self.actions: list[Action] = []
        self.refill: list[str] = []
        self.changes = 0  # admissions and re-pins so far: what makes a second look useful

    def finish(self) -> State:
        retired = self._sweep_retired() if self.retired else self.retired
        return State(
            self.policy,
            self.models,
            self.replicas.finish(),
            self.runs.finish(),
            self.turns.finish(),
            self.callers.finish(),
            self.buckets.finish(),
            self.seq,
            self.timeouts,
            self.expiry,
            self.retention,
            retired,
            self.held_runs.finish(),
            self.prompt_scale,
            self.shared_prefix,
            self.draining,
        )

    def _sweep_retired(self) -> frozenset[str]:
        """Forget the retired replicas nothing runs on or is bound to any more; the
        ones left."""
        left = []
        for name in self.retired:
            r = self.replicas[name]
            if r.in_flight or r.bound_runs:
                left.append(name)
            else:
                del self.replicas[name]
        return frozenset(left)

    # ------------------------------------------------------------------ events

    def arrive(self, ev: TurnArrived) -> None:
        if ev.turn_id in self.turns:
            raise SchedulerError(f"turn {ev.turn_id!r} arrived twice")
        if self.draining is not None:  # rule 14: before any other answer
            self.actions.append(Reject(turn_id=ev.turn_id, status=503, message=self.draining))
            return
        serving = self.models.get(ev.model)
        if not serving:
            self.actions.append(
                Reject(
                    turn_id=ev.turn_id,
                    status=404,
                    message=unknown_model(ev.model, self.models),
                )
            )
            return
        if not any(self.replicas[n].healthy for n in serving):
            ejected = [n for n in serving if self.replicas[n].ejected_until is not None]
            probed = [n for n in serving if n not in ejected]
            why = []
            if probed:
                why.append(f"unhealthy at their last probe: {', '.join(probed)}")
            if ejected:
                why.append(f"out of rotation after failed turns: {', '.join(ejected)}")
            self.actions.append(
                Reject(
                    turn_id=ev.turn_id,
                    status=503,
                    message=f"no healthy replica serves model '{ev.model}' ({'; '.join(why)})",
                    down=tuple(probed),
                )
            )
            return
        limit = self.policy.max_held_per_caller
        held = 0 if limit is None else self._held_of(ev.caller, ev.service_class)
        if limit is not None and held >= limit:
            run = self.runs.get(ev.run_id)
            if run is None or not run.keeps_replica:
                message = (
                    f"caller '{ev.caller}' has {held} {ev.service_class.value} turns waiting "
                    f"for admission (max_held_per_caller = {limit}); retry later (a run in "
                    "progress is never refused)"
                )
                self.actions.append(Reject(turn_id=ev.turn_id, status=429, message=message))
                return
        self.seq += 1
        p = self.policy
        reply = (
            min(ev.max_tokens, p.max_reply_estimate)
            if ev.max_tokens > 0
            else (p.assumed_reply_tokens)
        )
        run = self.runs.get(ev.run_id)
        pinned = self._pinned_replica(run, ev.model)
        key = (
            (_MODEL, ev.model, ev.service_class)
            if pinned is None
            else (_PIN, pinned, ev.service_class)
        )
        prompt = ev.prompt_tokens
        scale = self.prompt_scale.get(ev.model) if self.policy.learn_prompt_scale else None
        if scale is not None and prompt > 0:
            prompt = max(1, round(prompt * scale))
        turn = TurnState(
            ev.turn_id,
            ev.run_id,
            ev.service_class,
            ev.caller,
            ev.model,
            ev.now,
            self.seq,
            prompt,
            reply,
            key,
            None,
            0.0,
            False,
            estimate=ev.prompt_tokens if ev.learnable else 0,
        )
        self._hold(turn, key)
        self.held_runs[ev.run_id] = self.held_runs.get(ev.run_id, ()) + (ev.turn_id,)
        if pinned is not None:
            self._fill((pinned,))
            return
        replicas = self.replicas
        for n in serving:
            if replicas[n].has_slot():
                break
        else:
            return  # all full: the common case under load, and nothing to pick
        # An idle run goes back to its last replica if it can; others least loaded first,
        # or, with lanes, interactive runs where most interactive runs are (rule 9).
        if ev.service_class is _INTERACTIVE and self.policy.lane_batch_kv_fill is not None:
            order = sorted(
                serving, key=lambda n: (-replicas[n].interactive_runs, replicas[n].load, n)
            )
        else:
            order = sorted(serving, key=lambda n: (replicas[n].load, n))
        if run is not None:
            # (A turn of another model than its replica serves: where that model's last
            # turn of the run ran, rule 3: a harness's side requests on a small model,
            # the main model's turns beside them, a model switched to mid-run.)
            back = run.replica
            if back not in serving and run.side is not None and run.side[0] == ev.model:
                back = run.side[1]
            if back in serving:
                order.remove(back)
                order.insert(0, back)
        self._fill(order)

    def started(self, turn_id: str) -> None:
        t = self.turns.get(turn_id)
        if t is not None and t.replica is not None and not t.started:
            self.turns[turn_id] = TurnState(
                t.turn_id, t.run_id, t.service_class, t.caller, t.model, t.arrived, t.seq,
                t.prompt_tokens, t.reply_tokens, t.bucket, t.replica, t.admitted_at, True,
                t.alive_at, t.claim, t.estimate, t.first, t.timeout_s,
            )  # fmt: skip

    def alive(self, turn_id: str) -> None:
        t = self.turns.get(turn_id)
        if t is not None and t.replica is not None and self.now > t.alive_at:
            self.turns[turn_id] = alive = t._replace(alive_at=self.now)
            self.timeouts = _rekeyed(
                self.timeouts, (t.deadline(), turn_id), (alive.deadline(), turn_id)
            )

    def abandon(self, turn_id: str) -> None:
        t = self.turns.get(turn_id)
        if t is None:
            return
        if t.replica is None:
            assert t.bucket is not None
            self._unhold(t)
            self._unindex(t)
            del self.turns[turn_id]
            self._drop_caller_if_unused(t.caller)
            # It may have been the better turn that kept others from a replica's KV.
            kind, target, _ = t.bucket
            self._fill((target,) if kind == _PIN else self.models[target])
        else:
            self.turn_done(turn_id, None, 0, 0)

    def turn_done(
        self,
        turn_id: str,
        finish_reason: str | None,
        prompt: int,
        completion: int,
        *,
        engine_fault: bool = False,
        cached: int | None = None,
        defer: list[str] | None = None,
    ) -> None:
        """A turn finished (reason given) or failed (reason None): free its slot, and
        refill the replicas that may take a held turn now (`defer`: name them there,
        for the caller to refill once it has freed every slot it frees)."""
        t = self.turns.get(turn_id)
        if t is None or t.replica is None:
            return  # unknown (timed out already) or still held: nothing to free
        if prompt > 0 and t.estimate >= PROMPT_SCALE_MIN_TOKENS:
            self._learn_prompt_scale(t.model, prompt / t.estimate)
        if finish_reason is not None:
            r = self.replicas[t.replica]
            if cached is not None:
                if cached > 0 and not r.reports_cache:
                    self.replicas[t.replica] = r._replace(reports_cache=True)
            elif r.reports_cache and prompt > 0:
                cached = 0  # nothing was found cached (its engine would have said)
        first_cached = -1
        if t.first and prompt > 0 and cached is not None:
            first_cached = min(max(cached, 0), prompt)
            if self.policy.learn_shared_prefix:
                self._learn_shared_prefix(t.model, first_cached)
        elif t.first:
            # Its first turn failed, timed out or was abandoned, or its engine reported
            # no usage or no cache hit: nothing says the run begins with the prefix, and
            # a retry may find what this one cached.  Counted whole (helper-123: left
            # unknown, it was discounted for life).
            first_cached = 0
        del self.turns[turn_id]
        self.timeouts = self.timeouts.remove((t.deadline(), turn_id))
        name = t.replica
        self._adjust(name, in_flight=-1, ws=-t.claim, batch_ws=-_batch_part(t, t.claim))
        self._count_failure(name, engine_fault, finish_reason is not None)
        self._caller_in_flight(t.caller, -1)
        self._drop_caller_if_unused(t.caller)
        run = self.runs.get(t.run_id)
        shrank = False  # the context its other (held) turns are sized by got smaller
        grown = False  # ... or larger
        if run is not None:
            context = prompt + completion if prompt else run.context_tokens
            if run.replica != name:
                context = run.context_tokens  # a turn away from the run's prefix (rule 3)
            elif run.in_flight > 1 and context < run.context_tokens:
                context = run.context_tokens  # another of its turns still holds more there
            shrank = context < run.context_tokens or (run.ended and run.in_flight == 1)
            grown = context > run.context_tokens
            if run.in_flight > 1:
                outcome = run.home_outcome
                if run.replica == name:  # the run's own turn ended; one may run away
                    outcome = "failed" if finish_reason is None else finish_reason
                self._set_run(
                    run._replace(
                        in_flight=run.in_flight - 1,
                        context_tokens=context,
                        home_outcome=outcome,
                        first_cached=first_cached if first_cached >= 0 else run.first_cached,
                        turn="" if run.turn == turn_id else run.turn,
                    )
                )
            elif run.ended:
                self._replace_run(run, None)  # its last turn is done: forget it now
            else:
                # Paused on a tool, or idle (retrying if it failed): built whole, as
                # the finish path is the core's hottest (a _replace costs twice as much).
                # A turn away from a run paused on a tool (or idle, retrying a failed
                # turn) leaves it so, and the last turn to end, if it ran away, leaves
                # the run as its own turn did (rule 3).
                kept = run.phase is not _GENERATING
                if (
                    kept
                    and run.phase is _PAUSED
                    and finish_reason is not None
                    and run.replica != name
                    and t.model != run.model
                    and 2 * (prompt or t.prompt_tokens) >= run.context_tokens
                ):
                    # A turn away of another model that carried the conversation (its
                    # prompt at least half the run's context, tokenizers differ) and
                    # finished: the conversation went on there (a model switched to
                    # while the run waited on a tool: Claude Code's opusplan after its
                    # plan's approval), and its next turn comes back to it (rule 3).
                    # A side request is shorter.  What the turn found cached counts as
                    # a first turn's (its model's shared prefix; helper-166).
                    seen = min(max(cached, 0), prompt) if prompt > 0 and cached is not None else 0
                    self._switched(run, t, name, prompt + completion if prompt else 0,
                                   finish_reason == "tool_calls", seen)  # fmt: skip
                    old = run.replica
                    self._fill([name] if old is None or old not in self.replicas else [name, old])
                    return
                reason = finish_reason
                if run.home_outcome and run.replica != name:
                    reason = None if run.home_outcome == "failed" else run.home_outcome
                if kept:
                    phase = run.phase
                    retrying = run.retrying
                else:
                    phase = _PAUSED if reason == "tool_calls" else _IDLE
                    retrying = reason is None
                    if not (self.policy.strict_affinity and (retrying or phase is _PAUSED)):
                        grown = True  # it may move now: its held turns are sized by its context
                after = RunState(
                    run.run_id, run.service_class, run.caller, run.model, phase, run.replica,
                    0, context, run.reply_tokens, run.last_active if kept else self.now,
                    run.bound, run.ws_claim, run.counted_paused, run.ended, retrying, "",
                    first_cached if first_cached >= 0 else run.first_cached, run.side,
                )  # fmt: skip
                self._set_run(after)
        names = [name]
        if run is not None and run.replica not in (None, name) and run.replica in self.replicas:
            names.append(run.replica)  # the run moved, or this turn ran away from it
        if run is not None and grown:
            names += [n for n in self._grown() if n not in names]
        if shrank and self.buckets:
            # A held turn of this run may fit a replica's KV now, wherever it may go: a
            # report shorter than the gateway's estimate, or the run's end.  (Only when
            # turns are held; a replica without a free slot answers at once.)
            names += sorted(
                (n for n in self.state._replicas if n not in names),
                key=lambda n: (self.replicas[n].load, n),
            )
        if defer is not None:
            defer += names
        else:
            self._fill(names)

    def _switched(
        self, run: RunState, t: TurnState, name: str, context: int, paused: bool, cached: int
    ) -> None:
        """The paused run goes on with `t`'s model on `name`, where `t` ran: paused there
        on a tool (its claim moves there, its pause starts now), or idle there;
        `side` keeps where its old model's prefix is, and `cached` is what `t` found
        cached (as its run's first turn of the model).  (Left paused on its old
        replica, every later turn ran as a side turn: preferred, not kept, on the new
        model's replica, and the run expired 30 minutes after the switch while it kept
        taking turns; helper-164.)"""
        self._replace_run(
            run,
            RunState(
                run.run_id, run.service_class, run.caller, t.model,
                _PAUSED if paused else _IDLE, name, 0,
                context or t.prompt_tokens, t.reply_tokens, self.now, False, 0,
                # True: its claims start now, even where its old ones had lapsed
                # (_replace_run computes them; both 0 would read as lapsed).
                True,
                run.ended, False, "", cached, (run.model, run.replica) if run.replica else None,
            ),
        )  # fmt: skip
        self.refill += self._grown()

    def _learn_shared_prefix(self, model: str, cached: int) -> None:
        """One first turn's cached tokens into its model's shared prefix: the lower
        quartile of the last SHARED_PREFIX_SAMPLES.  Low, not the median: a first turn
        the core sees may carry a whole conversation its engine still holds (the core
        forgot the run, or the gateway restarted; helper-122), and a prefix learned too
        large would admit runs that do not fit.  It moves to the new quartile at most
        every SHARED_PREFIX_MOVE_S."""
        old = self.shared_prefix.get(model)
        samples = ((old[2] if old else ()) + (cached,))[-SHARED_PREFIX_SAMPLES:]
        ranked = sorted(samples)
        # Nothing on one or two samples: one resumed conversation is not a prefix.
        quartile = ranked[len(ranked) // 4] if len(ranked) >= SHARED_PREFIX_MIN_SAMPLES else 0
        if old is None or (quartile != old[0] and self.now - old[1] >= SHARED_PREFIX_MOVE_S):
            estimate, moved = quartile, self.now
        else:
            estimate, moved = old[0], old[1]
        self.shared_prefix = self.shared_prefix.set(model, (estimate, moved, samples))
        if (old[0] if old else 0) != estimate:
            # The model's runs' claims are sized by it: recounted (helper-123: claims
            # left at a larger prefix undercounted their replicas once it fell).  By run
            # id, as policy_changed does.  (A run this decision made is sized by the new
            # prefix already, and the one whose turn ends now is set again by its
            # caller.)
            claimed = [
                k
                for k, run in self.state._runs.items()
                if run.ws_claim and run.model == model and run.first_cached != 0
            ]
            for run_id in sorted(claimed):
                run = self.runs.get(run_id)
                if run is not None:
                    self._set_run(run)

    def _shared(self, model: str) -> int:
        return _learned_prefix(self.shared_prefix, self.policy, model)

    def _learn_prompt_scale(self, model: str, sample: float) -> None:
        """One finished turn's engine count / estimate into its model's scale."""
        low, high = PROMPT_SCALE_BOUNDS
        sample = min(max(sample, low), high)
        old = self.prompt_scale.get(model)
        new = sample if old is None else old + PROMPT_SCALE_WEIGHT * (sample - old)
        self.prompt_scale = self.prompt_scale.set(model, new)

    def _kept_changed(self) -> None:
        """A replica left or rejoined rotation: its runs may move now, or are kept there
        again (rule 3), so their held turns elsewhere are sized by their run's context,
        or by their own requests (smaller), from now on, and wait where they may go."""
        self.refill += self._grown()
        self._rebucket_all()

    def _grown(self) -> list[str]:
        """A run's context grew: its held turns are larger now, and one larger than its
        class's limit on its own may go in (rule 6) where it waited.  The replicas
        where that can happen: KV known, a slot free (in the pool's order)."""
        if not self.buckets or not self.policy.kv_admission:
            return []
        replicas = self.replicas
        return [
            n
            for n in sorted(self.state._replicas.keys())
            if replicas[n].spec.kv_tokens is not None and replicas[n].has_slot()
        ]

    def run_ended(self, run_id: str) -> None:
        run = self.runs.get(run_id)
        if run is None:
            return
        if run.in_flight:
            # Its turns still hold slots: keep counting them; forget at the last one.
            self._set_run(run._replace(ended=True))
        else:
            self._replace_run(run, None)
        self.actions.append(Forget(run_id=run_id))
        # Its claims are gone, and so is the context its held turns were sized by.
        self._fill_all()

    def probe(self, ev: ReplicaProbed) -> None:
        r = self.replicas.get(ev.replica)
        if r is None:
            raise SchedulerError(f"probe of unknown replica {ev.replica!r}")
        if ev.replica in self.retired:
            return  # a probe that was under way when it left the pool
        p = self.policy
        cap, queued_probes, step = r.cap, r.queued_probes, r.cap_step
        if ev.repeated:
            pass  # the last result again (a late answer): no new reading of the queue
        elif not p.cap_from_engine_queue or ev.queued is None or ev.running is None:
            cap, queued_probes, step = None, 0, 0
        elif ev.queued > 0:
            queued_probes += 1
            step = 0  # near the engine's limit: growth starts over
            if queued_probes >= p.cap_after_queued_probes:
                cap = max(1, ev.running)
        else:
            queued_probes = 0
            if cap is not None and r.in_flight >= cap:
                grow = max(step, p.cap_increase) if p.cap_growth_doubles else p.cap_increase
                cap += grow
                step = 2 * grow if p.cap_growth_doubles else 0
            else:
                step = 0  # luftpause had room: no sign the engine has more
        spec = r.spec
        if ev.kv_tokens is not None and ev.kv_tokens > 0 and spec.kv_tokens is None:
            # The engine told its pool size; a configured one wins.  What runs there is
            # counted from now on (below).
            spec = replace(spec, kv_tokens=ev.kv_tokens)
        if ev.slots is not None and ev.slots > 0 and not r.slots_given and ev.slots != spec.slots:
            # The engine's latest word (asked again when what stands behind the replica
            # changed: a router's engines); a configured number wins.
            spec = replace(spec, slots=ev.slots)
        after = r._replace(
            spec=spec,
            probe_ok=ev.healthy,
            queued=ev.queued,
            running=ev.running,
            cap=cap,
            queued_probes=queued_probes,
            cap_step=step,
        )
        self.replicas[ev.replica] = after
        if r.spec.kv_tokens is None and spec.kv_tokens is not None:
            self._claims_start((ev.replica,))
        healthy = after.healthy
        if healthy != r.healthy:
            self._kept_changed()
            if spec.device is not None:
                self._refill_device(ev.replica)
        # (Leaving rotation, its pinned turns were freed by _kept_changed.)
        if healthy:
            self._fill((ev.replica,))

    def drain(self, message: str) -> None:
        """Rule 14: every held turn refused, in arrival order, and no refill."""
        if self.draining is not None:
            return
        self.draining = message
        held = sorted(
            (self.turns[tid] for ids in self.state._held_runs.values() for tid in ids),
            key=lambda t: t.seq,
        )
        for t in held:
            self._unhold(t)
            self._reject_held(t, 503, message)

    def _reject_held(self, t: TurnState, status: int, message: str) -> None:
        """A held turn (already out of its bucket) refused: it can never be placed (its
        model left the pool), or the gateway drains."""
        self._unindex(t)
        del self.turns[t.turn_id]
        self._drop_caller_if_unused(t.caller)
        self.actions.append(Reject(turn_id=t.turn_id, status=status, message=message))

    def pool_changed(
        self, specs: tuple[ReplicaSpec, ...], slots_unknown: frozenset[str] = frozenset()
    ) -> None:
        """Rule 11: the pool is now `specs` (`slots_unknown`: see PoolChanged)."""
        given = {s.name: s for s in specs}
        if len(given) != len(specs):
            raise SchedulerError(f"replica names must be unique: {[s.name for s in specs]}")
        retired = set(self.retired)
        learned: list[str] = []  # the replicas whose KV pool is known from now on
        for name in sorted(self.state._replicas.keys()):
            r = self.replicas[name]
            spec = given.get(name)
            if spec is None:
                if name not in retired:
                    self.replicas[name] = r._replace(probe_ok=False, cap=None, cap_step=0)
                    retired.add(name)
                continue
            given_kv = spec.kv_tokens is not None
            if not given_kv and r.spec.kv_tokens is not None and not r.kv_given:
                # As its engine reported.  One the file gave and gives no more is gone:
                # the engine is asked again (KV admission off there until it says).
                spec = replace(spec, kv_tokens=r.spec.kv_tokens)
            given_slots = spec.slots is not None
            if not given_slots and r.spec.slots is not None and name not in slots_unknown:
                # As reported, or as the file gave it before: until the engine says.
                spec = replace(spec, slots=r.spec.slots)
            if name in retired:  # back before it was forgotten: as a new one, its runs kept
                r = r._replace(
                    probe_ok=False,
                    queued=None,
                    running=None,
                    cap=None,
                    queued_probes=0,
                    failures=0,
                    ejected_until=None,
                    cap_step=0,
                )
                retired.discard(name)
            self.replicas[name] = r._replace(spec=spec, slots_given=given_slots, kv_given=given_kv)
            if r.spec.kv_tokens is None and spec.kv_tokens is not None:
                learned.append(name)
        for name, spec in given.items():
            if name not in self.replicas:
                self.replicas[name] = _joining(spec, probe_ok=False)
        self.models = _models_of(specs)
        self.retired = frozenset(retired)
        self._claims_start(learned)
        # Held turns wait where their runs may go in the new pool: off a replica that
        # left or no longer serves their model, onto one that serves it now or is back
        # with their run kept there; rejected if no replica serves their model.
        self._rebucket_all()
        names = self.state._replicas.keys() | given.keys()
        self._fill(sorted(names, key=lambda n: (self.replicas[n].load, n)))

    def policy_changed(self, policy: Policy) -> None:
        """Rule 12: the policy is now `policy`."""
        old, self.policy = self.policy, policy
        names = sorted(self.state._replicas.keys())
        if old.cap_from_engine_queue and not policy.cap_from_engine_queue:
            for name in names:
                r = self.replicas[name]
                if r.cap is not None or r.queued_probes or r.cap_step:
                    self.replicas[name] = r._replace(cap=None, queued_probes=0, cap_step=0)
        elif (old.cap_increase, old.cap_growth_doubles) != (
            policy.cap_increase,
            policy.cap_growth_doubles,
        ):
            for name in names:  # the growth starts over under the new rule
                r = self.replicas[name]
                if r.cap_step:
                    self.replicas[name] = r._replace(cap_step=0)
        if old.kv_admission and not policy.kv_admission:
            for t in self.state._turns.values():
                if t.claim:  # a turn away (rule 3), or one beside a later turn (rule 6)
                    assert t.replica is not None
                    self._adjust(t.replica, ws=-t.claim, batch_ws=-_batch_part(t, t.claim))
                    self.turns[t.turn_id] = t._replace(claim=0)
        if (
            (old.kv_admission and not policy.kv_admission)
            or (old.strict_affinity and not policy.strict_affinity)
            or old.learn_shared_prefix != policy.learn_shared_prefix
        ):
            # Only claims the new policy would not make: dropped (a recount makes none
            # where there was none, so no timer needs adding).
            # By run id, not the map's order (its hashes'): dropping an interactive
            # run's claim queues its device's replicas for a refill (rule 13), and
            # the fill below visits them in that order.
            runs = self.state._runs  # (the runs are unchanged so far)
            for run_id in sorted(k for k, run in runs.items() if run.ws_claim):
                self._set_run(runs[run_id])
        counted = [n for n in names if self.replicas[n].spec.kv_tokens is not None]
        # A retention that changed too: a paused run's claim is judged lapsed under the
        # shorter (a tick may have lapsed it under the old one; helper-192).
        lasts = min(old.kv_retention_s, policy.kv_retention_s)
        if policy.kv_admission and not old.kv_admission:
            self._claims_start(counted, lasts)
        elif policy.kv_admission and policy.strict_affinity and not old.strict_affinity:
            # Paused runs claim now (they will come back): at once, as where counting
            # starts (helper-192); their turns were counted all along.
            self._claims_start(counted, lasts, turns=False)
        if old.strict_affinity != policy.strict_affinity:
            self._rebucket_all()  # pinned to their runs' replicas now, or free to go
        self._fill_all()

    def _claims_start(
        self, names: Iterable[str], retention_s: float | None = None, *, turns: bool = True
    ) -> None:
        """Program-level admission counts KV on these replicas from now on (their pool
        became known, or it was switched on): what runs there claims at once what it
        would have claimed had it been counted all along (rule 6).  Left to their next
        change, the runs already there counted nothing, and new runs went in beside
        them as into an empty pool.  A run claims its context and reply (a paused one
        only while its claim would not have lapsed); a turn of it on its replica other
        than its last one there, its own reply; a turn away from it, its prompt and
        reply.  One walk over the runs and the turns (a rare event).  A turn that went
        away from its run, whose run has come to its replica since, is taken for one of
        the run's own: it claims its reply, not its prompt too (the core keeps no mark
        of how a turn went in).  `retention_s`: how long a paused run's claim lasts, if
        not the policy's; `turns`: whether turns claim too (not where only strict
        affinity was switched on: paused runs claim from then on, turns did all along)."""
        where = set(names)
        if not where or not self.policy.kv_admission:
            return
        if retention_s is None:
            retention_s = self.policy.kv_retention_s
        lapsed_by = self.now - retention_s
        runs = self.state._runs  # (not changed by this event before it)
        for run_id in sorted(k for k, run in runs.items() if run.bound and run.replica in where):
            run = self.runs[run_id]
            # Lapsed by the time, or (an interactive run not counted paused) lapsed
            # already: its slot and its claim lapse together (rule 4; helper-192).  A
            # batch run keeps no such mark.
            lapsed = run.last_active <= lapsed_by or (
                run.service_class is _INTERACTIVE and not run.counted_paused
            )
            if run.ws_claim:
                continue
            if run.phase is _PAUSED and lapsed:
                if run.counted_paused:
                    # Its slot lapses with it, as at a tick (the retention lowered, or no
                    # tick since it ran out: helper-196).
                    self._set_run(run._replace(ws_claim=0, counted_paused=False))
                continue
            # (A claim given, so that a paused run's recount does not read it as lapsed.)
            self._set_run(run._replace(ws_claim=1))
        if not turns:
            return
        for t in self.state._turns.values():
            if t.replica not in where or t.claim:
                continue
            of = self.runs.get(t.run_id)
            if of is None:
                continue
            if of.replica == t.replica:
                if of.turn == t.turn_id:
                    continue  # the run's claim reserves its reply
                claim = t.reply_tokens
            else:
                claim = _away_need(t)
            self.turns[t.turn_id] = t._replace(claim=claim)
            self._adjust(t.replica, ws=claim, batch_ws=_batch_part(t, claim))

    def _count_failure(self, name: str, engine_fault: bool, finished: bool) -> None:
        """Rule 10: count the engine's failures in a row; eject at the limit."""
        r = self.replicas[name]
        limit = self.policy.eject_after_failures
        if name in self.retired:
            return  # it has left the pool: nothing to eject it from
        if finished or not engine_fault:
            if finished and r.failures:
                self.replicas[name] = r._replace(failures=0)
            return
        failures = r.failures + 1
        if limit is None or failures < limit or r.ejected_until is not None:
            self.replicas[name] = r._replace(failures=failures)
            return
        until = self.now + self.policy.eject_for_s
        self.replicas[name] = r._replace(failures=0, ejected_until=until)
        self.actions.append(Ejected(replica=name, until=until, failures=failures))
        self._kept_changed()  # frees the turns pinned here
        if r.healthy:
            self._refill_device(name)

    def tick(self) -> None:
        touched: list[str] = []
        forgot = False
        for name in sorted(self.state._replicas.keys()):  # sorted: a map's order is its hashes'
            r = self.replicas[name]
            if r.ejected_until is not None and r.ejected_until <= self.now:
                # Back in rotation as its last probe left it.
                self.replicas[name] = r._replace(ejected_until=None)
                if r.probe_ok:
                    touched.append(name)
                    self._kept_changed()
                    self._refill_device(name)
        # Each timer holds an entry (time, id) exactly while its subject waits for it,
        # so handling the earliest entry removes it (through turn_done and
        # _replace_run): nothing stale piles up behind a busy gateway.
        while self.timeouts and self.timeouts.min()[0] <= self.now:
            tid = self.timeouts.min()[1]
            t = self.turns[tid]
            assert t.replica is not None
            touched.append(t.replica)
            self.actions.append(TimedOut(turn_id=tid, run_id=t.run_id, replica=t.replica))
            # Refilled once every slot that times out now is free: refilled at each,
            # a batch turn took a slot an interactive turn was free for at the next
            # (its run's last turn timing out; found by a draw, 2026-12-06).
            self.turn_done(tid, None, 0, 0, defer=touched)
        deadline = self.now - self.policy.kv_retention_s
        while self.retention and self.retention.min()[0] <= deadline:
            run = self.runs[self.retention.min()[1]]
            self._set_run(run._replace(ws_claim=0, counted_paused=False))  # its claims lapse
            assert run.replica is not None
            touched.append(run.replica)
        deadline = self.now - self.policy.idle_run_expiry_s
        waiting: list[tuple[float, str]] = []
        while self.expiry and self.expiry.min()[0] <= deadline:
            entry = self.expiry.min()
            run = self.runs[entry[1]]
            if entry[1] in self.held_runs:
                # A turn of it waits for admission: not idle.  Its entry stays as it is
                # (its claims keep their own retention), looked at again at each tick.
                self.expiry = self.expiry.remove(entry)
                waiting.append(entry)
                continue
            self._replace_run(run, None)
            self.actions.append(Forget(run_id=entry[1], expired=True))
            forgot = True
        for entry in waiting:
            self.expiry = self.expiry.add(entry)
        if forgot:
            self._fill_all()  # as in run_ended
        elif touched:
            self._fill(tuple(dict.fromkeys(touched)))

    # ------------------------------------------------------------------ placement

    def _pinned_replica(self, run: RunState | None, model: str) -> str | None:
        if run is None or run.replica is None or not self.policy.strict_affinity:
            return None
        if not run.keeps_replica:
            return None
        r = self.replicas.get(run.replica)  # None: it left the pool and was forgotten
        if r is None or not r.healthy or model not in r.spec.models:
            return None
        return run.replica

    def _kept(self, run: RunState | None) -> bool:
        """Whether the run stays on its replica when a turn of it goes elsewhere (rule
        3): a turn of it generates there or (strict affinity) it is paused there on a
        tool or idle with a failed turn to retry there, and the replica is healthy."""
        if run is None or run.replica is None:
            return False
        if run.phase is not _GENERATING and not (
            self.policy.strict_affinity and (run.phase is _PAUSED or run.retrying)
        ):
            return False
        home = self.replicas.get(run.replica)
        return home is not None and home.healthy

    def _runs_away(self, run: RunState | None, name: str) -> bool:
        """Whether a turn of the run admitted to `name` runs away from it: the run, its
        phase, its prefix and its KV claim stay on its replica."""
        return run is not None and run.replica != name and self._kept(run)

    def _kv_fits(self, t: TurnState, name: str, r: ReplicaState) -> bool:
        kv = r.spec.kv_tokens
        if kv is None or not self.policy.kv_admission or r.ws_tokens == 0:
            return True
        run = self.runs.get(t.run_id)
        if run is not None and run.replica == name and run.ws_claim:
            return True  # already claimed here
        if self._runs_away(run, name):
            need = _away_need(t)
        else:
            need = _kv_need(t, run, _prefix_of(run, self._shared(t.model)))
        # The prefixes its models' runs share are cached once on a replica: counted once.
        shared = _prefixes_once(self.shared_prefix, self.policy, r.spec.models)
        limit = kv * _kv_share(self.policy, t.service_class, r.interactive_runs > 0)
        if r.ws_tokens + need + shared <= limit:
            return True
        if need + shared <= limit:
            return False
        # Larger than its class's limit here on its own: it could never fit beside the
        # others, and waiting for an empty replica would hold every new run of its class
        # behind it.  It goes in once no other run of its class holds KV here: one at a
        # time, so a small share cannot let a class overfill the pool.
        own = r.batch_ws if t.service_class is _BATCH else r.ws_tokens - r.batch_ws
        return own == 0

    def _fill(self, names: Sequence[str]) -> None:
        """Admit held turns to these replicas until none can take one more.

        Rounds of one admission per replica spread a burst over the replicas."""
        active = list(names)
        idle: set[str] = set()  # found nothing to take since the state last changed
        while active:
            still = []
            for name in active:
                changes = self.changes
                t = self._pick(name)
                if t is not None:
                    self._admit(t, name)
                    still.append(name)
                elif self.changes == changes:
                    idle.add(name)
                if self.changes != changes:
                    idle.clear()
            # Replicas whose held turns may have become admissible meanwhile: turns
            # re-pinned there, KV released there by a run that moved away, or a turn
            # that waits here whose run holds KV there.  A replica that found nothing
            # since the last change would find nothing again: two replicas asking each
            # other to look must not loop.
            still += [n for n in self.refill if n not in still and n not in idle]
            self.refill.clear()
            active = still

    def _fill_all(self) -> None:
        names = self.state._replicas.keys()  # (a decision that changes the pool fills itself)
        self._fill(sorted(names, key=lambda n: (self.replicas[n].load, n)))

    def _head(self, key: BucketKey) -> tuple[tuple[int, int, str], str] | None:
        b = self.buckets.get(key)
        if b is None:
            return None
        order = b.order.min()
        return order, b.queues[order[2]].min()[1]

    def _pick(self, name: str) -> TurnState | None:
        """The held turn this replica should take next, if any."""
        r = self.replicas[name]
        if not r.has_slot():
            return None
        # A replica whose device another one leads (rule 13) takes no unbound run of a
        # model the leader serves.
        closed = self._led_models(name, r) if r.spec.device is not None else _NO_MODELS
        kv_blocked = False  # a better unbound run waits for KV: no unbound run jumps it
        for cls in _CLASSES:
            if cls is _BATCH and not r.batch_room(self.policy):
                return None
            skip_models = kv_blocked
            while True:
                pin = self._head((_PIN, name, cls))
                best = None
                if not skip_models:
                    for m in r.spec.models:
                        if m in closed:
                            continue
                        h = self._head((_MODEL, m, cls))
                        if h is not None and (best is None or h[0] < best[0]):
                            best = h
                if pin is not None and (best is None or pin[0] < best[0]):
                    t = self.turns[pin[1]]
                elif best is not None:
                    t = self.turns[best[1]]
                else:
                    break
                if t.bucket is not None and t.bucket[0] == _PIN:
                    return t
                if self._kv_fits(t, name, r):
                    return t
                # It waits for KV here, and unbound runs behind it (of its class, and
                # batch after interactive) wait too: the buckets show only their heads,
                # and one of the turns behind may be interactive and fit.  If its run
                # holds KV elsewhere (affinity off), that replica may take it first.
                skip_models = True
                kv_blocked = True
                run = self.runs.get(t.run_id)
                home = None if run is None or not run.ws_claim else run.replica
                if home is not None and home != name and t.model in self.replicas[home].spec.models:
                    self.refill.append(home)
        return None

    def _led_models(self, name: str, r: ReplicaState) -> frozenset[str]:
        """Rule 13: the models whose new runs go to the replica that leads its device
        (those the leader serves), none if it leads or packing is off."""
        if not self.policy.pack_shared_devices:
            return _NO_MODELS
        # (the pool as this event found it: a replica that joins starts out of rotation)
        leader = _leader(self.replicas, self.state._replicas.keys(), self.retired, name, r)
        return _NO_MODELS if leader is None else self.replicas[leader].spec.models

    def _refill_device(self, name: str) -> None:
        """Rule 13: which replica leads this one's device may change (its interactive
        claims, its health): every replica of the device may take new runs now."""
        device = self.replicas[name].spec.device
        if device is None or not self.policy.pack_shared_devices:
            return
        replicas = self.replicas
        self.refill += sorted(
            n for n in self.state._replicas if n in replicas and replicas[n].spec.device == device
        )

    def _admit(self, t: TurnState, name: str) -> None:
        """Admit a held turn that heads its caller's queue in its bucket."""
        self.changes += 1
        key = t.bucket
        assert key is not None
        caller = t.caller
        c = self.callers[caller]
        n = c.in_flight + 1
        # Leave the queue and move the caller to one more turn in flight, in one step.
        b = self.buckets[key]
        q = b.queues[caller].remove((t.seq, t.turn_id))
        order = b.order.remove((c.in_flight, t.seq, caller))
        buckets = c.buckets
        if q:
            self.buckets[key] = _Bucket(b.queues.set(caller, q), order.add((n, q.min()[0], caller)))
        else:
            queues = b.queues.delete(caller)
            if queues:
                self.buckets[key] = _Bucket(queues, order)
            else:
                del self.buckets[key]
            buckets = buckets - {key}
        for other in buckets:
            if other != key:
                self._rekey(other, caller, c.in_flight, n)
        self.callers[caller] = _Caller(n, buckets)
        self._unindex(t)
        old = self.runs.get(t.run_id)
        away = self._runs_away(old, name)  # the run stays: this turn claims for itself
        claim = 0
        if away and self.policy.kv_admission and self.replicas[name].spec.kv_tokens is not None:
            claim = _away_need(t)  # as _kv_fits sized it
        self._adjust(name, in_flight=1, ws=claim, batch_ws=_batch_part(t, claim))
        if key[0] == _MODEL and self.policy.kv_admission:
            # It may have been the better turn that kept the others of its bucket from
            # another replica's KV (see _pick): that replica may go on now.
            for peer in self.models[t.model]:
                if peer != name:
                    r = self.replicas[peer]
                    if r.spec.kv_tokens is not None and r.has_slot():
                        self.refill.append(peer)
        # Its run's first turn, or its first of another model (helper-124: a run whose
        # turns moved to another model was discounted by that model's prefix for life).
        first = old is None or (old.model != t.model and not away)
        self.turns[t.turn_id] = TurnState(
            t.turn_id, t.run_id, t.service_class, caller, t.model, t.arrived, t.seq,
            t.prompt_tokens, t.reply_tokens, None, name, self.now, False, self.now, claim,
            t.estimate, first, self.policy.turn_timeout_s,
        )  # fmt: skip
        self.timeouts = self.timeouts.add((self.now + self.policy.turn_timeout_s, t.turn_id))
        self.actions.append(
            Admit(
                turn_id=t.turn_id,
                run_id=t.run_id,
                replica=name,
                service_class=t.service_class,
                held_s=self.now - t.arrived,
            )
        )
        if away:
            # Another of its turns is generating on its replica, or it is paused there on
            # a tool (this one is for a model that replica does not serve, or affinity is
            # off): the run, its phase, its prefix and its KV claim stay there; this
            # turn's claim is its own.
            # A paused (or retrying) run stays so since its pause (or failed turn): its
            # claim's retention (rule 6) and its expiry (rule 8) do not restart for a
            # side turn.
            assert old is not None
            active = self.now if old.phase is _GENERATING else old.last_active
            self._replace_run(
                old,
                old._replace(
                    in_flight=old.in_flight + 1,
                    caller=caller,
                    last_active=active,
                    # (A turn of its own model away, affinity off, is no side turn.)
                    side=(t.model, name) if t.model != old.model else old.side,
                ),
            )
            return
        context = t.prompt_tokens
        in_flight = 1
        if old is not None:
            in_flight += old.in_flight
            prev = self._reply_left(old, name, t.turn_id)
            if prev is not None:
                # (Its reply left the run's claim, which reserves this turn's now.)
                self.turns[prev.turn_id] = prev._replace(claim=prev.reply_tokens)
                self._adjust(
                    name, ws=prev.reply_tokens, batch_ws=_batch_part(prev, prev.reply_tokens)
                )
            if context > old.context_tokens or not self._kept(old):
                # The run's other held turns are larger now, or (kept on its replica
                # from now on) sized by their own requests where they would run away to.
                self.refill += self._grown()
            if old.context_tokens > context:
                context = old.context_tokens
            if old.bound and old.replica is not None and old.replica != name:
                self.refill.append(old.replica)
        self._replace_run(
            old,
            RunState(
                t.run_id,
                t.service_class,
                caller,
                t.model,
                _GENERATING,
                name,
                in_flight,
                context,
                t.reply_tokens,
                self.now,
                False,
                0,
                False,
                # What its first turn found cached speaks of its model's prefix: a turn of
                # another model starts the count again.
                first_cached=-1 if old is None or old.model != t.model else old.first_cached,
                side=_side_after(old, t.model),
                turn=t.turn_id,
            ),
        )

    def _reply_left(self, run: RunState, name: str, turn_id: str) -> TurnState | None:
        """The turn of `run` whose reply its claim reserves, still running on its
        replica `name`, when another turn (`turn_id`) of the run goes in there: that
        one claims its own reply from then on, until it ends (both replies are
        generated at once; their conversation is the run's context).  None: no such
        turn, or no claims are counted there."""
        if run.phase is not _GENERATING or run.replica != name or run.turn == turn_id:
            return None
        prev = self.turns.get(run.turn) if run.turn else None
        if (
            prev is None
            or prev.run_id != run.run_id
            or prev.replica != name
            or prev.claim
            or not self.policy.kv_admission
            or self.replicas[name].spec.kv_tokens is None
        ):
            return None
        return prev

    # ------------------------------------------------------------------ bookkeeping

    def _adjust(
        self,
        name: str,
        *,
        in_flight: int = 0,
        bound: int = 0,
        ws: int = 0,
        paused: int = 0,
        interactive: int = 0,
        batch_ws: int = 0,
    ) -> None:
        """Change a replica's counters (one copy of its record)."""
        r = self.replicas[name]
        if interactive and r.spec.device is not None:
            self._refill_device(name)
        self.replicas[name] = ReplicaState(
            r.spec, r.probe_ok, r.queued, r.running, r.cap, r.in_flight + in_flight,
            r.paused_interactive + paused, r.bound_runs + bound, r.ws_tokens + ws,
            r.interactive_runs + interactive, r.batch_ws + batch_ws, r.queued_probes,
            r.failures, r.ejected_until, r.cap_step, r.slots_given, r.kv_given, r.reports_cache,
        )  # fmt: skip

    def _set_run(self, run: RunState) -> None:
        self._replace_run(self.runs.get(run.run_id), run)

    def _replace_run(self, old: RunState | None, run: RunState | None) -> None:
        """Store a run (None: delete it) and keep every counter derived from it in
        step: its replica's bound runs, KV working set and paused interactive runs,
        and its timers.  `run`'s own bound/ws_claim/counted_paused are recomputed,
        except that a paused run whose claims lapsed (ws_claim 0, not counted_paused)
        keeps none."""
        if run is None:
            if old is not None:
                self._unbind(old)
                self._retime(old, None)
                del self.runs[old.run_id]
                if old.run_id in self.held_runs:
                    self._rebucket(old.run_id)  # its turns are a new run's now
            return
        phase = run.phase
        name = run.replica
        bound = phase is not _IDLE and name is not None
        claim = 0
        counted_paused = False
        if bound:
            assert name is not None
            lapsed = (
                old is not None
                and old.phase is _PAUSED
                and phase is _PAUSED
                and not run.ws_claim
                and not run.counted_paused
            )
            kv = self.replicas[name].spec.kv_tokens
            # A paused run claims KV only where it will come back: with strict affinity.
            keeps = phase is _GENERATING or self.policy.strict_affinity
            if keeps and not lapsed and self.policy.kv_admission and kv is not None:
                own = run.context_tokens - _prefix_of(run, self._shared(run.model))
                claim = max(own, 0) + run.reply_tokens
            counted_paused = phase is _PAUSED and run.service_class is _INTERACTIVE and not lapsed
        if (run.bound, run.ws_claim, run.counted_paused) != (bound, claim, counted_paused):
            run = RunState(
                run.run_id, run.service_class, run.caller, run.model, run.phase, run.replica,
                run.in_flight, run.context_tokens, run.reply_tokens, run.last_active, bound,
                claim, counted_paused, run.ended, run.retrying, run.home_outcome,
                run.first_cached, run.side, run.turn,
            )  # fmt: skip
        if old is not None and old.bound and name is not None and old.replica == name:
            self._adjust(
                name,
                bound=bound - 1,
                ws=claim - old.ws_claim,
                paused=counted_paused - old.counted_paused,
                interactive=_lane(run) - _lane(old),
                batch_ws=_batch_claim(run) - _batch_claim(old),
            )
        else:
            if old is not None:
                self._unbind(old)
            if bound:
                assert name is not None
                self._adjust(
                    name,
                    bound=1,
                    ws=claim,
                    paused=counted_paused,
                    interactive=_lane(run),
                    batch_ws=_batch_claim(run),
                )
        self._retime(old, run)
        self.runs[run.run_id] = run
        if (
            old is None or old.replica != run.replica or old.keeps_replica != run.keeps_replica
        ) and run.run_id in self.held_runs:
            self._rebucket(run.run_id)  # where its held turns may go changed (rule 3)

    def _retime(self, old: RunState | None, run: RunState | None) -> None:
        """Keep a run's timers in step with its record: an expiry entry while it is not
        generating, a retention entry while it is paused with a claim on the pool."""
        self.expiry = _rekeyed(self.expiry, _expiry_key(old), _expiry_key(run))
        self.retention = _rekeyed(self.retention, _retention_key(old), _retention_key(run))

    def _unbind(self, run: RunState) -> None:
        if run.bound and run.replica is not None:
            self._adjust(
                run.replica,
                bound=-1,
                ws=-run.ws_claim,
                paused=-run.counted_paused,
                interactive=-_lane(run),
                batch_ws=-_batch_claim(run),
            )

    def _held_of(self, caller: str, service_class: ServiceClass) -> int:
        """The caller's held turns of a class (a few buckets: its model's, its runs'
        replicas')."""
        c = self.callers.get(caller)
        if c is None:
            return 0
        return sum(
            len(self.buckets[k].queues.get(caller, ())) for k in c.buckets if k[2] is service_class
        )

    def _hold(self, t: TurnState, key: BucketKey) -> None:
        if t.bucket != key:
            t = t._replace(bucket=key)
        self.turns[t.turn_id] = t
        c = self.callers.get(t.caller, _NEW_CALLER)
        b = self.buckets.get(key, _EMPTY_BUCKET)
        q = b.queues.get(t.caller)
        entry = (t.seq, t.turn_id)
        if q is None:
            order = b.order.add((c.in_flight, t.seq, t.caller))
            q = empty().add(entry)
        else:
            head = q.min()
            q = q.add(entry)
            order = b.order
            if entry < head:
                order = order.remove((c.in_flight, head[0], t.caller))
                order = order.add((c.in_flight, t.seq, t.caller))
        self.buckets[key] = _Bucket(b.queues.set(t.caller, q), order)
        if key not in c.buckets:
            c = _Caller(c.in_flight, c.buckets | {key})
        self.callers[t.caller] = c

    def _unhold(self, t: TurnState) -> None:
        key = t.bucket
        assert key is not None
        c = self.callers[t.caller]
        b = self.buckets[key]
        q = b.queues[t.caller]
        entry = (t.seq, t.turn_id)
        head = q.min()
        q = q.remove(entry)
        order = b.order
        if entry == head:
            order = order.remove((c.in_flight, head[0], t.caller))
            if q:
                order = order.add((c.in_flight, q.min()[0], t.caller))
        if q:
            self.buckets[key] = _Bucket(b.queues.set(t.caller, q), order)
        else:
            queues = b.queues.delete(t.caller)
            if queues:
                self.buckets[key] = _Bucket(queues, order)
            else:
                del self.buckets[key]
            self.callers[t.caller] = _Caller(c.in_flight, c.buckets - {key})

    def _caller_in_flight(self, caller: str, delta: int) -> None:
        c = self.callers.get(caller, _NEW_CALLER)
        n = c.in_flight + delta
        for key in c.buckets:
            self._rekey(key, caller, c.in_flight, n)
        self.callers[caller] = _Caller(n, c.buckets)

    def _rekey(self, key: BucketKey, caller: str, was: int, now_in_flight: int) -> None:
        b = self.buckets[key]
        head = b.queues[caller].min()[0]
        order = b.order.remove((was, head, caller)).add((now_in_flight, head, caller))
        self.buckets[key] = _Bucket(b.queues, order)

    def _drop_caller_if_unused(self, caller: str) -> None:
        c = self.callers.get(caller)
        if c is not None and c.in_flight == 0 and not c.buckets:
            del self.callers[caller]

    def _unindex(self, t: TurnState) -> None:
        """The held turn leaves the held set (admitted, abandoned, rejected)."""
        ids = self.held_runs[t.run_id]
        if len(ids) == 1:
            del self.held_runs[t.run_id]
        else:
            self.held_runs[t.run_id] = tuple(i for i in ids if i != t.turn_id)

    def _rebucket(self, run_id: str) -> None:
        """Rule 3 for a run's held turns, after a change of the run or of what it may
        keep: each waits where it may go now (its run's replica while the run keeps it
        and serves the turn's model, else any replica of its model).  Held where the
        run was when it arrived, a turn would otherwise wait for a replica its run has
        left, or be taken as a new run where its run is bound."""
        run = self.runs.get(run_id)
        for tid in self.held_runs[run_id]:
            self._rebucket_turn(self.turns[tid], run)

    def _rebucket_all(self) -> None:
        """Every held turn: a replica left or rejoined rotation, the pool or the policy
        changed.  In arrival order, so that turns rejected for a model gone from the
        pool are answered in it (a map's order is its hashes').  (No turn arrives in
        the decisions that call this, so the runs with held turns are the state's; their
        turns are read from the decision's own index, which admissions keep.)"""
        held = sorted(
            (self.turns[tid].seq, tid)
            for run_id in self.state._held_runs
            if run_id in self.held_runs
            for tid in self.held_runs[run_id]
        )
        for _, tid in held:
            t = self.turns[tid]
            self._rebucket_turn(t, self.runs.get(t.run_id))

    def _rebucket_turn(self, t: TurnState, run: RunState | None) -> None:
        if t.model not in self.models:
            # Its model left the pool (rule 11), in this decision.
            self._unhold(t)
            gone = (
                unknown_model(t.model, self.models) + "; it left the pool while the turn was held"
            )
            self._reject_held(t, 404, gone)
            return
        pinned = self._pinned_replica(run, t.model)
        cls = t.service_class
        key = (_MODEL, t.model, cls) if pinned is None else (_PIN, pinned, cls)
        if key == t.bucket:
            return
        self._unhold(t)
        self._hold(t, key)
        self.changes += 1
        if pinned is not None:
            self.refill.append(pinned)
        else:
            serving = self.models.get(t.model, ())
            self.refill += sorted(serving, key=lambda n: (self.replicas[n].load, n))
