"""A simulated SGLang-like inference engine, driven by an external clock.

The engine never reads a clock and uses no randomness: the caller passes `now` (seconds,
float) to every method and asks `next_event_time()` when it must call `advance(now)` again.
The virtual-time simulator and the real-time HTTP fake engine drive the same class this way:

    engine.submit(request, now); engine.advance(now)      # or cancel(...)
    ...
    t = engine.next_event_time()                          # None when idle
    when the clock reaches t: outputs = engine.advance(t)

`submit`, `cancel` first bring the engine up to `now` (outputs produced on the way are
buffered and returned by the next `advance`), so a late `advance` never lets the engine
act on a request before it was submitted.  An idle engine starts working on a submitted
request at the next `advance`, so requests submitted at the same instant before that call
share one prefill step.

Model (continuous batching, as SGLang's scheduler with default settings):

* At every step boundary, if waiting requests can be admitted, a *prefill step* runs for
  them (no decoding meanwhile).  Admission walks the waiting queue in order (FCFS, or by
  priority with `priority_scheduling`), stops at the first request that does not fit (KV or
  `max_running_requests`) and limits one prefill step to `chunked_prefill_tokens` uncached
  tokens (the first request of a step is always taken, its prefill just takes longer).
  Prefill step time = overhead + uncached_tokens / (prefill rate * share).  At its
  end every admitted request has its first token.
* Otherwise a *decode step* produces one token for every running request (with
  `low_priority_decode_cap`, which SGLang lacks: for the highest-priority ones and at most
  that many others).  Step time =
  overhead + (weights + kv_bytes_per_token * total context) / (bandwidth * share).
  Between state changes the batch is fixed and its context grows by `batch` tokens per
  step, so a run of k steps costs k*base + inc*k*(k-1)/2 and is jumped over in closed form.
  A request submitted (or space freed by a cancel) mid-step is considered at the next
  step boundary.
* KV pool: running reservations (uncached prompt blocks + max_new_tokens, reserved at
  admission) plus the radix-style prefix cache (blocks of `block_tokens`).  A request's
  prompt blocks enter the cache at the end of its prefill (referenced while it runs, so
  concurrent requests share them); its `output_blocks` enter when it finishes.  Admission
  evicts unreferenced blocks least recently used first, deepest first among equal access
  times, so a conversation is trimmed from its tail.

GPU share: replicas on one GPU time-slice it, so `share` starts at `params.gpu_share` and
the driver calls `set_gpu_share(share, now)` when the other replica turns busy or idle
(e.g. 1.0 alone, 0.5 when both have work; `busy` tells whether an engine has work).  Whole
steps completed by `now` keep their old timing; the step in flight at `now` keeps the
fraction of it already done and runs its remaining fraction at the new share (its length
at the new share times the fraction left); later steps use the new share throughout.

Determinism and time slicing: step boundaries are computed as `anchor + f(k)` from an
anchor that only moves on state changes, so calling `advance` at extra intermediate times
yields exactly the same outputs (bit-identical times) as one big `advance`.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import TypeAlias

__all__ = [
    "EngineMetrics",
    "EngineOutput",
    "EngineParams",
    "EngineRequest",
    "Finished",
    "FirstToken",
    "SimEngine",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineParams:
    """Engine configuration.  Defaults model the reference test bed: one RTX 4060 Laptop GPU
    (8 GB GDDR6, ~256 GB/s) shared by two SGLang replicas of Llama-3.2-1B-Instruct FP8."""

    # SGLang derives a much larger default from the pool size; with ~56k tokens of KV and
    # multi-thousand-token agent prompts the KV pool is the binding limit, so 48 is ample.
    max_running_requests: int = 48
    # 8 GB minus 2 x (1.3 GB FP8 weights + activations/CUDA graphs/context) leaves each of
    # the two replicas ~1.5-2 GB for KV; at 32 KiB/token that is 50-60k tokens.
    kv_pool_tokens: int = 56_000
    # Prefix-cache granularity; a paged radix cache with 16-token pages.
    block_tokens: int = 16
    # Prefill chunk.  SGLang's own default for a GPU under 35 GB is 2048 (8192 for
    # larger ones); re-running the flood at 2048 moved the luftpause and cache_aware
    # arms by at most 0.7 runs/min (2026-12-05), so the value is not load-bearing.
    chunked_prefill_tokens: int = 8192
    # ~1.24 B parameters at 1 byte (FP8) ~= 1.3 GB streamed from memory per decode step.
    weights_bytes: float = 1.3e9
    # Llama-3.2-1B: 16 layers * 8 KV heads * head dim 64 * (K and V) * 2 bytes (bf16 KV)
    # = 32 KiB per token of context, read once per decode step.
    kv_bytes_per_token: float = float(16 * 8 * 64 * 2 * 2)
    # RTX 4060 Laptop: 128-bit GDDR6 at 16 Gbps = 256 GB/s peak.
    bandwidth_bytes_per_s: float = 256e9
    # Two replicas time-share one GPU, each gets about half of bandwidth and compute.
    gpu_share: float = 0.5
    # Prefill is compute bound: ~2 * 1.24e9 ~= 2.5 GFLOP/token (incl. attention at 2k ctx).
    # First-principles bounds: 12k tokens/s (~30 TFLOP/s, FP16 tensor cores at ~50%) to
    # ~45k (FP8 at ~100 TFLOP/s dense peak).  Within that range the value is fixed by the
    # reference bed's *baseline* arm, not by luftpause: SGLang's cache_aware router on the
    # 48-batch + 4-interactive flood measured 6.0/6.7 interactive and 83.7/82.3 batch
    # runs/min; the simulated cache_aware arm gives 4.7-5.0/69 at 18k, 5.7/79 at 24k,
    # 6.3-6.7/83.5 at 30k, 7.0-7.7/92 at 40k (seeds 1-2).  30k it is (~75 TFLOP/s, FP8).
    prefill_tokens_per_s: float = 30_000.0
    # SGLang's Python scheduler + kernel launches per step for a 1B model with CUDA graphs.
    step_overhead_s: float = 1e-3
    # SGLang default is FCFS; True mimics --enable-priority-scheduling (higher value
    # first), without its preemption of a running request by one whose priority is more
    # than --priority-scheduling-preemption-threshold (10) above it: the priorities the
    # simulator sends (interactive 1, batch 0) are under it.  A client sending 100 vs 0
    # to the fake engine gets no preemption, where SGLang would preempt.
    priority_scheduling: bool = False
    # Decode preemption, which SGLang does not have: while running requests of the
    # highest priority present decode, at most this many lower-priority running requests
    # (the first admitted) decode in the same steps; the others keep their KV and their
    # running slots, and wait for as long as higher-priority requests decode.
    # None: every running request decodes in every step, as in SGLang.  For measuring
    # what an engine that preempts batch decode would buy (bench/RESULTS.md).
    low_priority_decode_cap: int | None = None
    # SGLang's --enable-mixed-chunk (off by default): the running requests decode one
    # token in each prefill step, which then takes the longer of its prefill compute and
    # the decode's memory reads (overhead + max(prefill, decode time)).
    mixed_chunk: bool = False

    def __post_init__(self) -> None:
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.low_priority_decode_cap is not None and self.low_priority_decode_cap < 0:
            raise ValueError("low_priority_decode_cap must be >= 0 or None")
        if self.block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        if self.kv_pool_tokens < self.block_tokens:
            raise ValueError("kv_pool_tokens must hold at least one block")
        if self.chunked_prefill_tokens < 1:
            raise ValueError("chunked_prefill_tokens must be >= 1")
        if self.weights_bytes < 0 or self.kv_bytes_per_token < 0 or self.step_overhead_s < 0:
            raise ValueError("weights_bytes, kv_bytes_per_token, step_overhead_s must be >= 0")
        if self.bandwidth_bytes_per_s <= 0 or self.prefill_tokens_per_s <= 0:
            raise ValueError("bandwidth_bytes_per_s and prefill_tokens_per_s must be > 0")
        if not 0 < self.gpu_share <= 1:
            raise ValueError("gpu_share must be in (0, 1]")
        if self.step_overhead_s == 0 and self.weights_bytes == 0:
            raise ValueError("a decode step must take time: step_overhead_s or weights_bytes > 0")

    @classmethod
    def reference(cls) -> EngineParams:
        """The reference test bed defaults (same as `EngineParams()`)."""
        return cls()


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineRequest:
    """One generation request.

    `prompt_blocks` are chained block ids: block i's id identifies the whole prefix up to
    and including block i (a radix-tree path).  `len(prompt_blocks)` must equal
    `ceil(prompt_tokens / block_tokens)` (the last block may be partial).  `output_blocks`
    continue the chain over the reply and are cached when the request finishes.
    """

    request_id: str
    prompt_blocks: tuple[Hashable, ...]
    prompt_tokens: int
    output_tokens: int
    max_new_tokens: int
    output_blocks: tuple[Hashable, ...] = ()
    priority: int = 0


@dataclass(frozen=True, slots=True)
class FirstToken:
    request_id: str
    time: float
    cached_tokens: int = 0  # of its prompt, found in the prefix cache


@dataclass(frozen=True, slots=True)
class Finished:
    request_id: str
    time: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


EngineOutput: TypeAlias = FirstToken | Finished


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineMetrics:
    queued: int
    running: int
    # cached prompt tokens / prompt tokens over all admitted requests (0.0 if none)
    cache_hit_rate: float
    # fraction of the pool held by running requests (reservations + referenced cached
    # blocks); cached-but-unreferenced blocks do not count (SGLang's token_usage)
    token_usage: float
    prompt_tokens_total: int  # over admitted requests
    cached_tokens_total: int  # over admitted requests
    completion_tokens_total: int  # over finished requests
    evicted_tokens_total: int


# --------------------------------------------------------------------------- internals


class _Phase(enum.Enum):
    IDLE = enum.auto()
    PREFILL = enum.auto()
    DECODE = enum.auto()


@dataclass(eq=False, slots=True)
class _Node:
    """A cached block."""

    key: Hashable
    depth: int
    last_access: float
    refs: int = 0
    version: int = 0
    alive: bool = True


@dataclass(eq=False, slots=True)
class _Waiting:
    request: EngineRequest
    seq: int


@dataclass(eq=False, slots=True)
class _Running:
    request: EngineRequest
    match_blocks: int
    cached_tokens: int
    reservation: int  # KV tokens reserved outside the cache
    path: list[_Node] = field(default_factory=list)  # referenced cache nodes
    gen_base: int = 0  # tokens generated as of the decode anchor (or in total outside decode)
    prefilled: bool = False


_HeapEntry: TypeAlias = tuple[float, int, int, int, _Node]


class SimEngine:
    """Simulated SGLang-like engine in externally driven time (see module docstring)."""

    def __init__(self, params: EngineParams) -> None:
        self._p = params
        self._bt = params.block_tokens
        self._share = params.gpu_share
        self._bw = params.bandwidth_bytes_per_s * params.gpu_share
        self._prefill_rate = params.prefill_tokens_per_s * params.gpu_share

        self._phase = _Phase.IDLE
        self._clock = -math.inf  # time of the last processed step boundary
        self._wake: float | None = None  # IDLE: when waiting requests get considered
        self._pending: list[EngineOutput] = []  # produced by submit/cancel syncs

        # waiting queue: heap of (order key, seq, id) with lazy deletion via _waiting
        self._waiting: dict[str, _Waiting] = {}
        self._wheap: list[tuple[int, int, str]] = []
        self._seq = 0

        # running set (insertion order = admission order)
        self._running: dict[str, _Running] = {}
        # the running requests the decode segment steps (all of them unless
        # low_priority_decode_cap holds some back)
        self._active: list[_Running] = []
        self._prefill_batch: list[_Running] = []
        self._prefill_end = 0.0
        self._prefill_start = 0.0
        self._prefill_uncached = 0  # tokens the prefill step in flight computes
        # mixed_chunk: the running requests that decode a token in that step, and the
        # bytes the step reads for them (weights and their KV)
        self._mixed: list[_Running] = []
        self._mixed_bytes = 0.0
        # Set to a list to have every completed prefill step appended as (start, end):
        # the time no request decodes (bench/interactive_time.py).
        self.prefill_log: list[tuple[float, float]] | None = None

        # decode segment: boundary k is at t0 + k*base + inc*k*(k-1)/2, where base and inc
        # follow from the batch (size n, total context ctx at step 1) and the bandwidth
        self._t0 = 0.0
        self._seg_n = 0
        self._seg_ctx = 0
        self._base = 0.0
        self._inc = 0.0
        self._seg_steps = 0  # steps of this segment already processed
        self._k_finish: int | None = None  # step at which the earliest running request ends
        self._check_at: int | None = None  # step boundary at which to reconsider the queue
        self._dirty = False  # running set changed since the anchor (cancel)

        # KV pool and prefix cache
        self._reserved = 0
        self._cache: dict[Hashable, _Node] = {}
        self._unref_blocks = 0
        self._eheap: list[_HeapEntry] = []
        self._eseq = 0

        # counters
        self._prompt_total = 0
        self._cached_total = 0
        self._completion_total = 0
        self._evicted_total = 0

    # ------------------------------------------------------------------ public API

    def submit(self, request: EngineRequest, now: float) -> None:
        """Enqueue `request` at time `now`.

        Raises ValueError on a duplicate (queued or running) id, inconsistent sizes, or a
        request that can never fit: prompt (rounded up to whole blocks) + max_new_tokens
        larger than the KV pool.
        """
        rid = request.request_id
        if rid in self._waiting or rid in self._running:
            raise ValueError(f"duplicate request id {rid!r}")
        bt = self._bt
        if request.prompt_tokens < 1:
            raise ValueError("prompt_tokens must be >= 1")
        if len(request.prompt_blocks) != -(-request.prompt_tokens // bt):
            raise ValueError(
                f"len(prompt_blocks)={len(request.prompt_blocks)} must be "
                f"ceil(prompt_tokens / block_tokens)={-(-request.prompt_tokens // bt)}"
            )
        if not 1 <= request.output_tokens <= request.max_new_tokens:
            raise ValueError("need 1 <= output_tokens <= max_new_tokens")
        if len(request.prompt_blocks) * bt + request.max_new_tokens > self._p.kv_pool_tokens:
            raise ValueError(f"request {rid!r} can never fit in the KV pool")
        self._sync(now, start_idle=False)
        key = -request.priority if self._p.priority_scheduling else 0
        self._seq += 1
        self._waiting[rid] = _Waiting(request, self._seq)
        heapq.heappush(self._wheap, (key, self._seq, rid))
        self._request_check(now)

    def cancel(self, request_id: str, now: float) -> bool:
        """Drop a queued or running request (client went away) and free its KV.

        Prompt blocks it already computed stay in the cache (unreferenced).  Returns False
        if the id is unknown or already finished.
        """
        self._sync(now, start_idle=False)
        if self._waiting.pop(request_id, None) is not None:
            if not self._waiting and self._phase is _Phase.IDLE:
                self._wake = None
            return True
        run = self._running.pop(request_id, None)
        if run is None:
            return False
        self._release(run, now)
        if self._phase is _Phase.PREFILL:
            if run in self._prefill_batch:
                self._prefill_batch.remove(run)
            if not self._running and not self._waiting:
                self._phase = _Phase.IDLE
                self._clock = self._prefill_end  # the launched step still occupies the GPU
        elif self._phase is _Phase.DECODE:
            # The step in flight finishes with the old batch; re-batch at its boundary.
            k_next = self._steps_by(now) + 1
            if not self._running and not self._waiting:
                self._phase = _Phase.IDLE
                self._clock = self._boundary_time(k_next)
            else:
                self._dirty = True
                self._k_finish = self._min_remaining()
                self._check_at = k_next if self._check_at is None else min(self._check_at, k_next)
        return True

    def next_event_time(self) -> float | None:
        """When the engine next produces an output or changes state; None when idle.

        If submit/cancel buffered outputs not yet returned by `advance`, this is the time of
        the earliest of them (<= the last `now` passed in): call `advance` right away.
        """
        if self._pending:
            return self._pending[0].time
        if self._phase is _Phase.IDLE:
            return self._wake
        if self._phase is _Phase.PREFILL:
            return self._prefill_end
        return self._boundary_time(self._k_target())

    def advance(self, now: float) -> list[EngineOutput]:
        """Run all steps completing at or before `now`; return the outputs in time order."""
        self._sync(now)
        out, self._pending = self._pending, []
        return out

    @property
    def busy(self) -> bool:
        """True while the engine has running or waiting requests (as of the last call)."""
        return bool(self._running or self._waiting)

    @property
    def gpu_share(self) -> float:
        """The current GPU share (initially `params.gpu_share`)."""
        return self._share

    def set_gpu_share(self, share: float, now: float) -> None:
        """Use GPU share `share` (0 < share <= 1) from `now` on.

        Brings the engine up to `now` first (like `submit`: outputs produced on the way are
        returned by the next `advance`), then re-plans the remaining work: the step in flight
        at `now` runs its remaining fraction at the new share, later steps entirely.
        Setting the current share again is a no-op.
        """
        if not 0 < share <= 1:  # also rejects NaN
            raise ValueError("gpu_share must be in (0, 1]")
        if share == self._share:
            return
        self._sync(now, start_idle=False)
        p = self._p
        old_prefill_rate, old_bw = self._prefill_rate, self._bw
        self._share = share
        self._bw = p.bandwidth_bytes_per_s * share
        self._prefill_rate = p.prefill_tokens_per_s * share
        if self._phase is _Phase.PREFILL:
            # The step ends after prefill_end > now (else _sync processed it).  Its remaining
            # fraction takes that fraction of the step's length at the new share.
            old_len = self._prefill_len(old_prefill_rate, old_bw)
            new_len = self._prefill_len(self._prefill_rate, self._bw)
            end = now + (self._prefill_end - now) * (new_len / old_len)
            self._prefill_end = max(end, math.nextafter(now, math.inf))
        elif self._phase is _Phase.DECODE:
            # Steps 1..k of the segment are complete; re-anchor a segment whose step 1 is the
            # step in flight (k + 1), placing its virtual start so that the fraction already
            # done is kept: t0 = now - done_fraction * (its length at the new share).
            k = self._steps_by(now)
            b_k = self._boundary_time(k)
            b_next = self._boundary_time(k + 1)
            left = min((b_next - now) / (b_next - b_k), 1.0)
            for run in self._active:
                run.gen_base += k
            self._seg_ctx += self._seg_n * k
            self._seg_steps = 0
            if self._k_finish is not None:
                self._k_finish -= k
            if self._check_at is not None:
                self._check_at -= k
            self._plan_segment()
            self._t0 = now - (1.0 - left) * self._base
            while self._boundary_time(1) <= now:  # float guard: the step must end after now
                self._t0 = math.nextafter(self._t0, math.inf)
        # IDLE: the next prefill uses the new share.  A step abandoned by a cancel that still
        # occupies the GPU (self._clock > now) is not re-timed.

    def metrics(self) -> EngineMetrics:
        prompt = self._prompt_total
        referenced = len(self._cache) - self._unref_blocks
        return EngineMetrics(
            queued=len(self._waiting),
            running=len(self._running),
            cache_hit_rate=self._cached_total / prompt if prompt else 0.0,
            token_usage=(self._reserved + referenced * self._bt) / self._p.kv_pool_tokens,
            prompt_tokens_total=prompt,
            cached_tokens_total=self._cached_total,
            completion_tokens_total=self._completion_total,
            evicted_tokens_total=self._evicted_total,
        )

    def queued_tokens(self) -> int:
        """The prompt tokens of the requests waiting for admission (what SGLang's load
        report adds to the KV tokens in use)."""
        return sum(w.request.prompt_tokens for w in self._waiting.values())

    def generated_tokens(self, request_id: str, now: float) -> int:
        """Tokens a running request has produced by `now` (0 if queued, unknown or finished).

        Pure query (no state change); assumes `advance` was called for events before `now`.
        """
        run = self._running.get(request_id)
        if run is None:
            return 0
        if self._phase is not _Phase.DECODE or not self._stepped(run):
            return run.gen_base
        k = min(self._steps_by(now), self._k_target())
        return min(run.gen_base + k, run.request.output_tokens)

    # ------------------------------------------------------------------ event loop

    def _sync(self, now: float, *, start_idle: bool = True) -> None:
        """Process every step boundary at or before `now`, buffering outputs.

        With `start_idle=False` (submit/cancel) an idle engine due to start exactly at `now`
        is left alone, so requests submitted at the same instant share one prefill step.
        """
        out = self._pending
        while True:
            phase = self._phase
            if phase is _Phase.IDLE:
                wake = self._wake
                if wake is None or wake > now or (wake == now and not start_idle):
                    return
                tb = wake
                self._wake = None
                self._clock = tb
                self._at_boundary(tb, changed=True)
            elif phase is _Phase.PREFILL:
                if self._prefill_end > now:
                    return
                self._end_prefill(out)
            else:
                k = self._k_target()
                tb = self._boundary_time(k)
                if tb > now:
                    return
                self._decode_boundary(k, tb, out)

    def _request_check(self, now: float) -> None:
        """New work may be admissible: consider the queue at the next step boundary."""
        if not self._waiting:
            return
        if self._phase is _Phase.IDLE:
            if self._wake is None:
                self._wake = max(self._clock, now)
        elif self._phase is _Phase.DECODE:
            k_next = self._steps_by(now) + 1
            if self._check_at is None or k_next < self._check_at:
                self._check_at = k_next
        # PREFILL: the queue is considered at the end of the prefill step anyway.

    def _at_boundary(self, tb: float, *, changed: bool) -> None:
        """Scheduler decision at a step boundary: prefill, (re)start decoding, or idle.

        Gens must be materialized (gen_base current) when `changed` or admitting.
        """
        admitted = self._admit(tb) if self._waiting else []
        if admitted:
            self._materialize()
            uncached = sum(r.request.prompt_tokens - r.cached_tokens for r in admitted)
            self._phase = _Phase.PREFILL
            self._prefill_batch = admitted
            self._prefill_uncached = uncached
            self._mixed = (
                [r for r in self._decoding() if r.prefilled] if self._p.mixed_chunk else []
            )
            self._mixed_bytes = self._p.weights_bytes + self._p.kv_bytes_per_token * sum(
                r.request.prompt_tokens + r.gen_base for r in self._mixed
            )
            self._prefill_start = tb
            self._prefill_end = tb + self._prefill_len(self._prefill_rate, self._bw)
            self._check_at = None
            self._dirty = False
        elif changed:
            self._materialize()
            if self._running:
                self._start_decode(tb)
            else:
                self._phase = _Phase.IDLE
                self._clock = tb
                self._wake = None  # empty engine: the queue was empty or admission succeeded

    def _end_prefill(self, out: list[EngineOutput]) -> None:
        tb = self._prefill_end
        self._clock = tb
        if self.prefill_log is not None:
            self.prefill_log.append((self._prefill_start, tb))
        batch, self._prefill_batch = self._prefill_batch, []
        bt = self._bt
        for run in batch:
            req = run.request
            # The computed prompt blocks enter the cache (referenced by this request); their
            # KV moves from the reservation into the cache.
            new_blocks = len(req.prompt_blocks) - run.match_blocks
            self._reserved -= new_blocks * bt
            run.reservation -= new_blocks * bt
            for i in range(run.match_blocks, len(req.prompt_blocks)):
                node = self._ref_or_insert(req.prompt_blocks[i], i + 1, tb)
                if node is None:  # cannot happen: the reservation covered these blocks
                    break
                run.path.append(node)
            for node in run.path:
                node.last_access = tb
            run.prefilled = True
            run.gen_base = 1
            out.append(FirstToken(req.request_id, tb, run.cached_tokens))
            if req.output_tokens <= 1:
                del self._running[req.request_id]
                self._finish(run, tb, out)
        mixed, self._mixed = self._mixed, []
        for run in mixed:  # a token each, decoded in the same step
            if not self._is_running(run):
                continue
            run.gen_base += 1
            if run.gen_base >= run.request.output_tokens:
                del self._running[run.request.request_id]
                self._finish(run, tb, out)
        self._at_boundary(tb, changed=True)

    def _decode_boundary(self, k: int, tb: float, out: list[EngineOutput]) -> None:
        self._seg_steps = k
        self._clock = tb
        if self._check_at is not None and k >= self._check_at:
            self._check_at = None
        finished = [
            r
            for r in self._active
            if r.gen_base + k >= r.request.output_tokens and self._is_running(r)
        ]
        for run in finished:
            del self._running[run.request.request_id]
            self._finish(run, tb, out)
        changed = bool(finished) or self._dirty
        if not changed and not self._waiting:
            return
        self._at_boundary(tb, changed=changed)

    # ------------------------------------------------------------------ decode segment

    def _materialize(self) -> None:
        if self._phase is _Phase.DECODE and self._seg_steps:
            k = self._seg_steps
            for run in self._active:
                run.gen_base += k
        self._seg_steps = 0

    def _start_decode(self, t: float) -> None:
        self._phase = _Phase.DECODE
        self._t0 = t
        self._seg_steps = 0
        self._active = self._decoding()
        self._seg_n = len(self._active)
        self._seg_ctx = sum(r.request.prompt_tokens + r.gen_base for r in self._active)
        self._plan_segment()
        self._k_finish = self._min_remaining()
        self._check_at = None
        self._dirty = False

    def _plan_segment(self) -> None:
        """Step cost of the segment's batch at the current bandwidth."""
        p = self._p
        ctx = self._seg_ctx
        self._base = p.step_overhead_s + (p.weights_bytes + p.kv_bytes_per_token * ctx) / self._bw
        self._inc = p.kv_bytes_per_token * self._seg_n / self._bw

    def _prefill_len(self, rate: float, bw: float) -> float:
        """The prefill step in flight's length at this prefill rate and bandwidth."""
        compute = self._prefill_uncached / rate
        if self._mixed:
            return self._p.step_overhead_s + max(compute, self._mixed_bytes / bw)
        return self._p.step_overhead_s + compute

    def _decoding(self) -> list[_Running]:
        """The running requests a new decode segment steps."""
        running = list(self._running.values())
        cap = self._p.low_priority_decode_cap
        if cap is None or not running:
            return running
        top = max(r.request.priority for r in running)
        low = [r for r in running if r.request.priority < top]
        if len(low) <= cap:
            return running
        held = {id(r) for r in low[cap:]}
        return [r for r in running if id(r) not in held]

    def _is_running(self, run: _Running) -> bool:
        """False for a request of the segment that was cancelled since it began."""
        return self._running.get(run.request.request_id) is run

    def _stepped(self, run: _Running) -> bool:
        """Whether the decode segment steps this running request."""
        return self._p.low_priority_decode_cap is None or any(r is run for r in self._active)

    def _min_remaining(self) -> int | None:
        left = [r.request.output_tokens - r.gen_base for r in self._active if self._is_running(r)]
        return min(left) if left else None

    def _k_target(self) -> int:
        kf, kc = self._k_finish, self._check_at
        if kf is None:
            assert kc is not None
            return kc
        return kf if kc is None else min(kf, kc)

    def _seg_time(self, k: int) -> float:
        return k * self._base + self._inc * (k * (k - 1) // 2)

    def _boundary_time(self, k: int) -> float:
        return self._t0 + self._seg_time(k)

    def _steps_by(self, now: float) -> int:
        """Number of steps of the current segment completed at or before `now`."""
        d = now - self._t0
        if d <= 0:
            k = 0
        else:
            a = self._inc / 2
            b = self._base - a
            root = (-b + math.sqrt(b * b + 4 * a * d)) / (2 * a) if a > 0 else d / self._base
            k = int(root)
            k = max(k - 1, 0)
        while self._boundary_time(k + 1) <= now:
            k += 1
        while k > 0 and self._boundary_time(k) > now:
            k -= 1
        return max(k, self._seg_steps)

    # ------------------------------------------------------------------ admission

    def _admit(self, tb: float) -> list[_Running]:
        p, bt = self._p, self._bt
        admitted: list[_Running] = []
        chunk = 0
        while len(self._running) < p.max_running_requests:
            head = self._peek_waiting()
            if head is None:
                break
            req = head.request
            path = self._match(req.prompt_blocks)
            m = len(path)
            # A prompt matched whole still computes its last token (its logits), as
            # SGLang matches at most all tokens but one.
            cached = min(m * bt, req.prompt_tokens - 1)
            uncached = req.prompt_tokens - cached
            if admitted and chunk + uncached > p.chunked_prefill_tokens:
                break
            need = (len(req.prompt_blocks) - m) * bt + req.max_new_tokens
            unref_in_path = sum(1 for n in path if n.refs == 0)
            free = p.kv_pool_tokens - self._used()
            if need > free + (self._unref_blocks - unref_in_path) * bt:
                break
            for node in path:
                if node.refs == 0:
                    self._unref_blocks -= 1
                node.refs += 1
                node.last_access = tb
            while p.kv_pool_tokens - self._used() < need:
                evicted = self._evict_one()
                assert evicted
            self._reserved += need
            heapq.heappop(self._wheap)
            del self._waiting[req.request_id]
            run = _Running(req, m, cached, need, path)
            self._running[req.request_id] = run
            admitted.append(run)
            chunk += uncached
            self._prompt_total += req.prompt_tokens
            self._cached_total += cached
        return admitted

    def _peek_waiting(self) -> _Waiting | None:
        heap = self._wheap
        while heap:
            _, seq, rid = heap[0]
            w = self._waiting.get(rid)
            if w is not None and w.seq == seq:
                return w
            heapq.heappop(heap)
        return None

    # ------------------------------------------------------------------ KV / cache

    def _used(self) -> int:
        return self._reserved + len(self._cache) * self._bt

    def _match(self, blocks: Iterable[Hashable]) -> list[_Node]:
        path: list[_Node] = []
        cache = self._cache
        for b in blocks:
            node = cache.get(b)
            if node is None:
                break
            path.append(node)
        return path

    def _ref_or_insert(self, key: Hashable, depth: int, t: float) -> _Node | None:
        """Reference block `key`, inserting it (evicting LRU blocks if needed)."""
        node = self._cache.get(key)
        if node is None:
            while self._p.kv_pool_tokens - self._used() < self._bt:
                if not self._evict_one():
                    return None
            node = _Node(key, depth, t)
            self._cache[key] = node
        elif node.refs == 0:
            self._unref_blocks -= 1
        node.refs += 1
        return node

    def _unref(self, path: list[_Node], t: float) -> None:
        for node in path:
            node.last_access = t
            node.refs -= 1
            if node.refs == 0:
                self._unref_blocks += 1
                self._push_evictable(node)
        path.clear()

    def _push_evictable(self, node: _Node) -> None:
        node.version += 1
        self._eseq += 1
        heapq.heappush(self._eheap, (node.last_access, -node.depth, self._eseq, node.version, node))
        if len(self._eheap) > 2 * self._unref_blocks + 1024:
            self._eheap = [e for e in self._eheap if self._valid(e)]
            heapq.heapify(self._eheap)

    @staticmethod
    def _valid(entry: _HeapEntry) -> bool:
        node = entry[4]
        return node.alive and node.refs == 0 and node.version == entry[3]

    def _evict_one(self) -> bool:
        heap = self._eheap
        while heap:
            entry = heapq.heappop(heap)
            if not self._valid(entry):
                continue
            node = entry[4]
            node.alive = False
            del self._cache[node.key]
            self._unref_blocks -= 1
            self._evicted_total += self._bt
            return True
        return False

    def _release(self, run: _Running, t: float) -> None:
        """Free a leaving request's reservation and unreference its cached blocks."""
        self._reserved -= run.reservation
        run.reservation = 0
        self._unref(run.path, t)

    def _finish(self, run: _Running, tb: float, out: list[EngineOutput]) -> None:
        req = run.request
        self._reserved -= run.reservation
        run.reservation = 0
        if run.path and len(run.path) == len(req.prompt_blocks):
            depth = len(req.prompt_blocks)
            for key in req.output_blocks:
                depth += 1
                node = self._ref_or_insert(key, depth, tb)
                if node is None:
                    break
                run.path.append(node)
        self._unref(run.path, tb)
        self._completion_total += req.output_tokens
        out.append(
            Finished(
                req.request_id,
                tb,
                prompt_tokens=req.prompt_tokens,
                cached_tokens=run.cached_tokens,
                completion_tokens=req.output_tokens,
            )
        )

    # ------------------------------------------------------------------ testing aid

    def check_invariants(self) -> None:
        """Raise AssertionError if internal accounting is inconsistent (for tests)."""
        p = self._p
        assert len(self._running) <= p.max_running_requests
        assert self._reserved >= 0
        assert self._used() <= p.kv_pool_tokens, (self._used(), p.kv_pool_tokens)
        refs: dict[int, int] = {}
        for run in self._running.values():
            for node in run.path:
                assert node.alive
                refs[id(node)] = refs.get(id(node), 0) + 1
        assert self._reserved == sum(r.reservation for r in self._running.values())
        unref = 0
        for node in self._cache.values():
            assert node.refs == refs.get(id(node), 0), "refcount mismatch"
            unref += node.refs == 0
        assert unref == self._unref_blocks
