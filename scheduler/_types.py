"""The scheduler's vocabulary: what it is told (events), what it says (actions), and
how it is configured (replica specs and policy).  All frozen; time is a field."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum


class ServiceClass(StrEnum):
    """`x-luftpause-class`: interactive turns go before batch turns."""

    INTERACTIVE = "interactive"
    BATCH = "batch"


class RunPhase(StrEnum):
    """Where a run stands between its turns."""

    GENERATING = "generating"  # a turn of the run is admitted to its replica
    PAUSED = "paused"  # its last turn ended in tool calls: it will come back
    IDLE = "idle"  # its last turn ended otherwise (or failed): it may move


def unknown_model(model: str, served: Iterable[str]) -> str:
    """The 404's message for a model no replica serves, with the ones that are served
    (a harness asking for its own default model, e.g. Claude Code's sub-agents, learns
    what to set instead)."""
    names = ", ".join(sorted(served)) or "none"  # sorted: a map's order is its hashes'
    return f"no generative replica serves model '{model}' (served: {names})"


class SchedulerError(Exception):
    """An event that breaks the core's contract (a programming error in the shell).

    The state is left unchanged, as h11 does with a LocalProtocolError."""


# --------------------------------------------------------------------------- config


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaSpec:
    """One engine replica as the core sees it."""

    name: str
    models: frozenset[str]
    # KV pool size in tokens, when known: configured, or reported by the engine (SGLang
    # /server_info max_total_num_tokens, vLLM's cache_config_info) and set by the
    # first probe that carries it.  Enables program-level admission on this replica.
    kv_tokens: int | None = None
    # The accelerator it shares with other replicas (any label; the same label on two
    # replicas means they time-slice one GPU, as SGLang or vLLM processes started with
    # a --mem-fraction-static / --gpu-memory-utilization share of one device do).
    # None: a device of its own.  Enables rule 13 on it.
    device: str | None = None
    # How many requests its engine runs at once, when known: configured, or reported by
    # the engine (SGLang's effective max_running_requests in /server_info,
    # llama.cpp's total_slots in /props; a router's, its engines' sum) and set by the
    # probes that carry it (the latest; a configured number is never replaced).
    # luftpause has no more turns in flight there (rule 2): a turn past it would wait
    # in the engine's first-come queue, where it waits in luftpause's order instead,
    # and batch turns leave slots for paused interactive runs (rule 4).
    slots: int | None = None

    def __post_init__(self) -> None:
        # A pool of no tokens, or no slots, would hold every turn for ever.
        for field, value in (("kv_tokens", self.kv_tokens), ("slots", self.slots)):
            if value is not None and value < 1:
                raise ValueError(f"replica {self.name!r}: {field} must be >= 1, got {value}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Policy:
    """The rules' constants and switches.  Defaults are DESIGN.md's; the switches
    exist so the simulator can measure what each mechanism buys (an ablation)."""

    turn_timeout_s: float = 600.0
    idle_run_expiry_s: float = 1800.0
    # Replies with no max_tokens are assumed this long when sizing a run's KV need ...
    assumed_reply_tokens: int = 256
    # ... and a max_tokens above this counts as this much, as SGLang's scheduler sizes
    # requests (SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION, 4096): clients set max_tokens as
    # a ceiling (32k is common), and sized whole such a turn could never fit beside
    # other runs.  The engine still lets it generate up to its max_tokens.
    max_reply_estimate: int = 4096
    # Generating and paused runs stay on their replica (their prefix is cached there).
    strict_affinity: bool = True
    # Cap in-flight turns at the engine's running count once it reports a queue ...
    cap_from_engine_queue: bool = True
    # ... in this many probes in a row.  One probe's queue is mostly requests that arrived
    # during the engine's current step and start at its next (SGLang counts them in
    # num_queue_reqs): capping on it holds turns an engine with room would run.
    cap_after_queued_probes: int = 2
    # How much the cap grows at a probe that shows no queue while luftpause has the
    # engine full ...
    cap_increase: int = 1
    # ... doubling at each such probe in a row (1, 2, 4, ...), so that a cap set at a
    # low running count (a queue of a few long prompts) grows back in a few probes; a
    # queue, or a probe at which luftpause had room, starts it over.  False: the same
    # step each time.
    cap_growth_doubles: bool = True
    # Batch turns leave a slot for every interactive run paused on a tool there (for up
    # to kv_retention_s).
    reserve_for_paused_interactive: bool = True
    # Program-level admission: a run not yet bound to a replica is admitted there only
    # while the KV working set of the runs bound to it (context + reply) fits in
    # `kv_fill` of its pool, so paused runs keep their prefix cache.
    kv_admission: bool = True
    # A turn's prompt arrives as the gateway's estimate (a quarter of its bytes: 5-15 %
    # off on a real tokenizer, either way; bench/prompt_estimate.py), and ends with the
    # engine's count: scale each model's estimates by what its engines counted, so
    # that KV admission sizes runs by tokens, not bytes (see PROMPT_SCALE_*).
    learn_prompt_scale: bool = True
    # Runs of a model often begin alike (a harness's system prompt and tool schemas:
    # Claude Code's is about 15k tokens), and an engine's prefix cache holds that once.
    # Counted in every run's working set, it kept KV admission from runs that fit: with
    # a 4k-token shared prefix the flood's batch work fell to 0.47 of batch-alone (seeds
    # 1-3, bench/RESULTS.md).  Learn each model's shared prefix from what engines found
    # cached of runs' first turns (the lower quartile of the last few: a first turn may
    # carry a conversation the engine still holds), leave it out of each run's working
    # set (no more than its own first turn found cached), and count the prefixes of a
    # replica's models once there.
    learn_shared_prefix: bool = True
    kv_fill: float = 0.8
    # Batch runs stop at this share of the pool, leaving the rest for interactive runs
    # (rule 4 for KV); None: the same limit as interactive runs.
    batch_kv_fill: float | None = 0.7
    # How long a paused run's claims on the pool and (interactive) on a slot are honoured
    # (Continuum's KV TTL): a tool that runs longer than this no longer keeps new runs
    # out, nor batch turns off the slot.
    kv_retention_s: float = 60.0
    # Ejection (Envoy's outlier detection; SMG's circuit breaker): a replica whose engine
    # failed this many turns in a row (`TurnFailed.engine_fault`; a finished turn resets
    # the count) is out of rotation for `eject_for_s`, as if its probe had failed, though
    # its health check passes.  Its runs move.  None: never.
    eject_after_failures: int | None = 5
    eject_for_s: float = 30.0
    # Intake bound (the SGLang router's --queue-size, per caller and class): a caller with
    # this many turns of a class held gets 429 for a turn of that class that would start
    # or resume an idle run (its batch backlog does not refuse its interactive work); a
    # turn of a run in progress (generating, paused on a tool, retrying) is never refused,
    # while the core knows the run (not after idle_run_expiry_s, or a gateway restart).
    # None: no bound, as DESIGN.md has it (a held turn waits until placed or abandoned).
    max_held_per_caller: int | None = None
    # Interactive lanes: a new interactive run goes to the replica that already holds the
    # most interactive runs (if it has room), so interactive runs share few replicas, and
    # on a replica holding interactive runs batch runs stop at `lane_batch_kv_fill` of the
    # pool.  Batch fills the other replicas whole.  None: off.
    lane_batch_kv_fill: float | None = None
    # Shared devices (rule 13): replicas that time-slice one GPU each decode at about
    # half its speed while both have work.  While interactive runs hold KV on a replica
    # of a device, its other replicas take no new runs of the models it serves, so they
    # drain and the interactive runs' replica gets the whole device: interactive
    # runs/min 1.6x, batch runs/min 0.75x in the simulated flood (bench/RESULTS.md).
    # Only for replicas that declare a `device`.  Off by default, as it trades batch
    # work for interactive.
    pack_shared_devices: bool = False


# --------------------------------------------------------------------------- events


@dataclass(frozen=True, kw_only=True, slots=True)
class TurnArrived:
    now: float
    turn_id: str
    run_id: str
    service_class: ServiceClass
    caller: str
    model: str
    # Estimates for KV sizing; 0 = unknown (then the run's last known context is used).
    prompt_tokens: int = 0
    max_tokens: int = 0
    # Whether the engine's count of this prompt may teach the core its model's scale
    # (Policy.learn_prompt_scale): not where the estimate measures something else, a
    # body that is not the whole prompt (a Responses turn chained by
    # previous_response_id) or images counted at a guess.
    learnable: bool = True


@dataclass(frozen=True, kw_only=True, slots=True)
class TurnAbandoned:
    """The client left.  A held turn leaves the queue; an admitted one is failed."""

    now: float
    turn_id: str


@dataclass(frozen=True, kw_only=True, slots=True)
class TurnStarted:
    """The engine's first byte reached the proxy."""

    now: float
    turn_id: str


@dataclass(frozen=True, kw_only=True, slots=True)
class TurnAlive:
    """The admitted turn's engine is still sending.  The shell reports it now and then
    while a reply streams; the turn timeout counts from the turn's last sign of life,
    so a long healthy stream keeps its slot."""

    now: float
    turn_id: str


@dataclass(frozen=True, kw_only=True, slots=True)
class TurnFinished:
    now: float
    turn_id: str
    finish_reason: str  # "tool_calls" pauses the run on its replica
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # What the engine found cached of the prompt; None: it did not say (SGLang without
    # --enable-cache-report, vLLM without --enable-prompt-tokens-details; with them,
    # both leave it out when they found nothing).  On a replica whose engine has said
    # it found some, None is 0 (ReplicaState.reports_cache).  Elsewhere a first turn that
    # did not say teaches nothing of the shared prefix, and its run is counted whole: a
    # 0 would have pulled the model's prefix down for every replica.
    cached_tokens: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class TurnFailed:
    now: float
    turn_id: str
    reason: str = ""
    # The engine failed it: unreachable, a 5xx, broke off or went silent mid-answer.
    # Not the client leaving, and not an answer about the request (4xx, 429).
    engine_fault: bool = False
    # The client went away before the answer was whole (for the metrics; the core
    # treats it as any failure that is not the engine's).
    client_left: bool = False
    # Nothing came within the turn timeout, and the gateway gave up on it (for the
    # metrics, `timed_out`; the core treats it as any failure of its kind).
    timed_out: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class RunEnded:
    now: float
    run_id: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaProbed:
    """A probe result.  `queued`/`running` None: the engine reports no load.
    `kv_tokens` and `slots`: the KV pool size and the running-request limit the
    engine reported, if asked (each becomes the replica's when the configuration gave
    none: the pool size the first reported, the slots the latest).  `repeated`: the
    engine did not answer in time and the shell repeats its last result to keep it in
    rotation; it is no new reading of the engine's queue (the cap and the count of
    queued probes stay)."""

    now: float
    replica: str
    healthy: bool
    queued: int | None = None
    running: int | None = None
    kv_tokens: int | None = None
    slots: int | None = None
    repeated: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class PoolChanged:
    """The pool is now `replicas` (rule 11): names not known yet join it (in rotation
    once a probe finds them healthy), known names take their new spec, and names left out are
    retired.  A retired replica takes no turns; its turns in flight finish there and its
    runs move at their next turn; it is forgotten once nothing runs or is bound there.
    A spec whose `slots` is None keeps the slots the replica has (reported by its
    engine, or given before: then until its engine reports its own), except that the
    replicas named in `slots_unknown` drop them: what they stand for changed and nothing
    will report it (a router whose engines' sum cannot be known any more, an engine that
    does not report its own whose configured slots were taken out).  A spec whose
    `kv_tokens` is None keeps the pool size its engine reported; one given before is
    dropped (KV admission is off there until the engine reports its own, if its kind
    does: the pool size is taken once, and a configured one stood for the engine's).
    A held turn whose model no replica serves any more is rejected (404)."""

    now: float
    replicas: tuple[ReplicaSpec, ...]
    slots_unknown: frozenset[str] = frozenset()


@dataclass(frozen=True, kw_only=True, slots=True)
class PolicyChanged:
    """The rules' constants and switches are now `policy` (rule 12), for the turns held
    and the runs known as well as for what comes next."""

    now: float
    policy: Policy


@dataclass(frozen=True, kw_only=True, slots=True)
class Drained:
    """The gateway is stopping (rule 14): every held turn is refused 503 `message`, and
    so is every turn that arrives from now on; nothing more is admitted.  Turns
    admitted go on to their end.  A second drain changes nothing."""

    now: float
    message: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Tick:
    now: float


Event = (
    TurnArrived
    | TurnAbandoned
    | TurnStarted
    | TurnAlive
    | TurnFinished
    | TurnFailed
    | RunEnded
    | ReplicaProbed
    | PoolChanged
    | PolicyChanged
    | Drained
    | Tick
)


# --------------------------------------------------------------------------- actions


@dataclass(frozen=True, kw_only=True, slots=True)
class Admit:
    """Send the turn to the replica now."""

    turn_id: str
    run_id: str
    replica: str
    service_class: ServiceClass
    held_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Reject:
    """Answer the turn with this status and message: at its arrival (it was never
    queued), or while held, once its model has left the pool (rule 11) or the gateway
    drains (rule 14)."""

    turn_id: str
    status: int
    message: str
    # A 503's replicas of the model that were unhealthy at their last probe: the shell,
    # which has the probes, may say why.
    down: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class Forget:
    """The run's state is gone: drop what the shell keeps for it.  `expired`: idle (or
    paused on a tool) for `Policy.idle_run_expiry_s`; else the client ended it."""

    run_id: str
    expired: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class TimedOut:
    """The admitted turn was never reported finished, and gave no sign of life, for
    `Policy.turn_timeout_s`: the core freed its slot.  A later report about it is ignored."""

    turn_id: str
    run_id: str
    replica: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Ejected:
    """The replica's engine failed `failures` turns in a row: out of rotation until
    `until` (rule 10).  For the shell to say so."""

    replica: str
    until: float
    failures: int


Action = Admit | Reject | Forget | TimedOut | Ejected
