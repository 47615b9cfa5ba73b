"""The load generator: closed-loop own-loop agents through an OpenAI-compatible proxy.

Each agent runs one run after another until the window ends.  A run is the loop a
harness runs: send the conversation with a tool offered; when the model answers with
tool calls, run them (here: wait 0.5..1.5 x `tool_s`, as the simulator does) and append
a result of `tool_result_chars`; stop when it answers with text.  The first user
message is the run's task: `context_chars` of text that starts with the run's id, so
runs share no prefix and the same run id gets the same task (the fake engine decides a
run's number of tool calls from it), so every arm of a benchmark sees the same work:
agent `b3` (batch agent 3) runs the same runs, tasks and tool waits in every arm and in
the one-class reference runs.

Every request carries the headers each proxy reads (none of them minds the others'):
luftpause's run, class and caller, and SMG's `x-smg-priority` (interactive / bulk).
Requests are not streamed: one answer per turn keeps the client's own CPU out of the
measurement.

`scripted_tools`, for a real model that makes no tool calls of its own (a small one on
a CPU, served without a tool-call parser): the agent decides the calls and the model
writes them.  A run makes k = 0..`max_tool_calls` calls, drawn from its id (so every
arm sees the same k).  Each turn before the last offers the tool and asks, through
`response_format` (a JSON schema, which llama.cpp, vLLM and SGLang turn into a
grammar), for a call written as text, `{"name": "lookup", "arguments": {...}}` (about
25 tokens; `tool_call_tokens` is its ceiling), the way such models answer; the last asks
for `reply_tokens` of prose (`ignore_eos`).  Temperature 0 throughout.  The call and each
result go back as plain assistant and user messages, so the engine sees what a tool loop
gives it: a conversation that grows by the call and the result, turn after turn, with
pauses between.  luftpause recovers the call from the text (activities/_recover.py), so
it sees the run paused on a tool as it would with a model that calls tools; the routers
see one answer like another.

Time: `time_scale` virtual seconds pass per wall second (the fake engines run that much
faster; tool waits and the window shrink by it); every figure is in virtual time.  Only
at time scale 1 do the figures compare proxies: their own clocks (probe periods, queue
timeouts, KV retention) and their CPU time do not scale.  Only runs that end inside the
window count; the runs still going at its end are reported apart.
"""

from __future__ import annotations

import asyncio
import random
import time
from asyncio import FIRST_COMPLETED
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from luftpause.headers import CALLER_HEADER, CLASS_HEADER, RUN_HEADER
from testkit.sim import percentile

__all__ = [
    "CALL_FORMAT",
    "LOOKUP_TOOL",
    "Load",
    "LoadResult",
    "RunRecord",
    "load_from_args",
    "run_load",
]

ServiceClass = Literal["interactive", "batch"]

LOOKUP_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a term up in the knowledge base.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}},
            "required": ["query"],
        },
    },
}
# scripted_tools: a call of LOOKUP_TOOL as a model without a tool-call parser writes it.
CALL_FORMAT: dict[str, Any] = {
    "type": "json_schema",
    "json_schema": {
        "name": "lookup_call",
        "schema": {
            "type": "object",
            "properties": {
                "name": {"const": "lookup"},
                "arguments": {
                    "type": "object",
                    "properties": {"query": {"type": "string", "enum": ["status", "owner"]}},
                    "required": ["query"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        },
    },
}
SMG_PRIORITY = {"interactive": "interactive", "batch": "bulk"}
# A failed turn is retried after this long (virtual seconds), at most this many times a
# run; the errors are counted and reported, never hidden.
RETRY_AFTER_S = 1.0
MAX_ERRORS_PER_RUN = 5
# A turn with no answer after this long (virtual; the gateway's own turn timeout is
# 10 min) is an error.
TURN_TIMEOUT_S = 900.0

_FILLER = (
    "the quick brown fox jumps over the lazy dog while agents wait for their tools "
    "and engines keep the prefix of every conversation warm in their cache"
)
_WORDS = tuple(_FILLER.split())


@dataclass(frozen=True, kw_only=True)
class Load:
    """What the agents do (the simulator's scenario knobs, same names and meanings)."""

    batch: int = 48
    interactive: int = 4
    context_chars: int = 8000
    tool_s: float = 2.0
    tool_result_chars: int = 1600
    reply_tokens: int = 256
    minutes: float = 3.0
    runs: int | None = None  # stop once this many runs have ended (None: the window)
    seed: int = 1
    model: str = "llama-3.2-1b"
    time_scale: float = 1.0
    scripted_tools: bool = False
    max_tool_calls: int = 3  # scripted_tools: 0..N calls a run
    tool_call_tokens: int = 64  # scripted_tools: the ceiling of a turn that writes a call
    # The caller every request names (x-luftpause-caller); None: as the simulator's.
    # A caller's own token ([[callers]]) refuses another name (403).
    caller: str | None = None


def load_from_args(args: Any, **more: Any) -> Load:
    """The agents' knobs from a command's flags of the same names (`luftpause load`,
    `luftpause bench flood`), and `more`."""
    return Load(
        batch=args.batch,
        interactive=args.interactive,
        context_chars=args.context_chars,
        tool_s=args.tool_s,
        tool_result_chars=args.tool_result_chars,
        reply_tokens=args.reply_tokens,
        minutes=args.minutes,
        seed=args.seed,
        **more,
    )


@dataclass(frozen=True)
class RunRecord:
    run_id: str
    service_class: ServiceClass
    seconds: float  # virtual
    turns: int
    ended: float  # virtual seconds into the window


@dataclass
class LoadResult:
    minutes: float
    runs: list[RunRecord] = field(default_factory=list)
    turns: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    errors: int = 0
    first_errors: list[str] = field(default_factory=list)
    # Runs still going when the window closed, by class, and the oldest one's age: a
    # proxy that holds a run for ever shows here, not only as a lower rate.
    unfinished: dict[str, int] = field(default_factory=dict)
    oldest_unfinished_s: float = 0.0

    @property
    def failed(self) -> bool:
        return self.errors > 0

    def count(self, cls: ServiceClass) -> int:
        return sum(1 for r in self.runs if r.service_class == cls)

    def per_min(self, cls: ServiceClass) -> float:
        return self.count(cls) / self.minutes

    def percentile(self, q: float) -> float | None:
        return percentile((r.seconds for r in self.runs if r.service_class == "interactive"), q)

    @property
    def cached_share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_json(self) -> dict[str, Any]:
        def r2(x: float | None) -> float | None:
            return None if x is None else round(x, 2)

        return {
            "window_minutes": round(self.minutes, 3),  # shorter when --runs ended it
            "interactive_runs": self.count("interactive"),
            "batch_runs": self.count("batch"),
            "interactive_runs_per_min": round(self.per_min("interactive"), 2),
            "interactive_p50_s": r2(self.percentile(0.5)),
            "interactive_p90_s": r2(self.percentile(0.9)),
            "batch_runs_per_min": round(self.per_min("batch"), 2),
            "turns": self.turns,
            "cached_prompt_token_share": round(self.cached_share, 3),
            "errors": self.errors,
            "first_errors": self.first_errors,
            "unfinished_runs": self.unfinished,
            "oldest_unfinished_s": round(self.oldest_unfinished_s, 1),
        }


def task_text(run_id: str, chars: int) -> str:
    """A run's task: its id, then filler words to `chars` characters."""
    out = [f"Task of run {run_id}: research and summarise."]
    n = len(out[0])
    rng = random.Random(run_id)
    while n < chars:
        w = _WORDS[rng.randrange(len(_WORDS))]
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


class _Ctx:
    def __init__(
        self,
        load: Load,
        http: httpx.AsyncClient,
        url: str,
        ends_runs: bool,
        progress: Callable[[str], None] | None,
    ) -> None:
        self.load = load
        self.http = http
        self.url = url.rstrip("/")
        self.ends_runs = ends_runs
        self.progress = progress
        self.result = LoadResult(minutes=load.minutes)
        self.t0 = 0.0
        self.deadline = 0.0
        self.running: dict[str, tuple[ServiceClass, float]] = {}  # run id -> class, start
        self.enough = asyncio.Event()  # `load.runs` runs have ended

    def now(self) -> float:
        """Virtual seconds since the window opened."""
        return (time.monotonic() - self.t0) * self.load.time_scale

    def error(self, text: str) -> None:
        self.result.errors += 1
        if len(self.result.first_errors) < 5:
            self.result.first_errors.append(text[:300])


def _answer(r: httpx.Response) -> tuple[dict[str, Any], dict[str, Any]]:
    """The completion and its first choice's message; raises on anything else."""
    data = r.json()
    message = data["choices"][0]["message"]
    if not isinstance(message, dict):
        raise TypeError("message is not an object")
    return data, message


async def _agent(ctx: _Ctx, cls: ServiceClass, index: int) -> None:
    """Agent `index` of its class: `b3` is the same agent (runs, tasks, tool waits) in
    every arm and in the one-class reference runs."""
    load = ctx.load
    name = f"{cls[0]}{index}"
    rng = random.Random(f"{load.seed}/{name}")
    # As the simulator: the batch agents are one job (one caller), each interactive
    # agent is its own user.
    caller = load.caller or ("batch-job" if cls == "batch" else f"user-{index}")
    run_no = 0
    while True:
        run_no += 1
        run_id = f"{name}-r{run_no}"
        headers = {
            RUN_HEADER: run_id,
            CLASS_HEADER: cls,
            CALLER_HEADER: caller,
            "x-smg-priority": SMG_PRIORITY[cls],
        }
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": task_text(run_id, load.context_chars)}
        ]
        # scripted_tools: the calls this run makes (its own draw: the same in every arm)
        calls_left = random.Random(f"{load.seed}/{run_id}").randrange(load.max_tool_calls + 1)
        started = ctx.now()
        ctx.running[run_id] = (cls, started)
        turns = errors = 0
        while True:
            body: dict[str, Any] = {
                "model": load.model,
                "messages": messages,
                "tools": [LOOKUP_TOOL],
                "max_tokens": load.reply_tokens,
            }
            if load.scripted_tools:
                body["temperature"] = 0
                if calls_left:
                    body["max_tokens"] = load.tool_call_tokens
                    body["response_format"] = CALL_FORMAT
                else:
                    body["ignore_eos"] = True
            try:
                r = await ctx.http.post(
                    f"{ctx.url}/v1/chat/completions",
                    json=body,
                    headers=headers,
                    timeout=httpx.Timeout(TURN_TIMEOUT_S / load.time_scale, connect=5),
                )
            except httpx.HTTPError as exc:
                failed: str | None = f"{type(exc).__name__}: {exc}"
            else:
                failed = None if r.status_code == 200 else f"{r.status_code} {r.text}"
            if failed is None:
                try:
                    data, message = _answer(r)
                except (ValueError, LookupError, TypeError, AttributeError) as exc:
                    failed = f"200 without a chat completion ({exc!r}): {r.text[:200]}"
            if failed is not None:
                ctx.error(f"run {run_id} turn {turns + 1}: {failed}")
                errors += 1
                if errors > MAX_ERRORS_PER_RUN:
                    break  # give the run up; the next one starts
                await asyncio.sleep(RETRY_AFTER_S / load.time_scale)
                continue
            turns += 1
            ctx.result.turns += 1
            usage = data.get("usage") or {}
            ctx.result.prompt_tokens += int(usage.get("prompt_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            ctx.result.cached_tokens += int(details.get("cached_tokens") or 0)
            if load.scripted_tools:
                messages.append({"role": "assistant", "content": message.get("content") or ""})
                if not calls_left:
                    break
                calls_left -= 1
                await asyncio.sleep(load.tool_s * rng.uniform(0.5, 1.5) / load.time_scale)
                result = task_text(f"{run_id}-call{turns}", load.tool_result_chars)
                messages.append({"role": "user", "content": f"Result of lookup: {result}"})
                continue
            messages.append(
                {k: v for k, v in message.items() if k in ("role", "content", "tool_calls")}
            )
            calls = message.get("tool_calls") or []
            if not calls:
                break
            for call in calls:
                await asyncio.sleep(load.tool_s * rng.uniform(0.5, 1.5) / load.time_scale)
                call_id = str(call.get("id") if isinstance(call, dict) else call)
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": call_id,
                        "content": task_text(f"{run_id}-{call_id}", load.tool_result_chars),
                    }
                )
        ended = ctx.now()  # before the run's end is reported: that is not the run's time
        del ctx.running[run_id]
        if errors <= MAX_ERRORS_PER_RUN and ended <= ctx.deadline and not ctx.enough.is_set():
            ctx.result.runs.append(RunRecord(run_id, cls, ended - started, turns, ended))
            if load.runs is not None and len(ctx.result.runs) >= load.runs:
                ctx.enough.set()
        if ctx.ends_runs:
            # The gateway forgets the run at once rather than after its idle expiry.
            try:
                r = await ctx.http.delete(f"{ctx.url}/v1/runs/{run_id}", headers=headers)
                if r.status_code >= 300:
                    ctx.error(f"run {run_id} end: {r.status_code} {r.text}")
            except httpx.HTTPError as exc:
                ctx.error(f"run {run_id} end: {exc}")


async def _report(ctx: _Ctx, every_s: float = 10.0) -> None:
    assert ctx.progress is not None
    while True:
        await asyncio.sleep(every_s)
        r = ctx.result
        ctx.progress(
            f"  {ctx.now():6.0f}/{ctx.deadline:.0f} s: {r.count('interactive')} interactive, "
            f"{r.count('batch')} batch runs, {r.turns} turns, {r.errors} errors"
        )


async def run_load(
    load: Load,
    url: str,
    *,
    ends_runs: bool = False,
    progress: Callable[[str], None] | None = None,
    token: str | None = None,
) -> LoadResult:
    """Run the agents against the proxy at `url` for `load.minutes` (virtual), or until
    `load.runs` runs have ended; stop them (in-flight requests are dropped) and return
    what ended inside the window (whose length is then the time it took).  `token`: a
    bearer token for every request."""
    agents = load.batch + load.interactive
    limits = httpx.Limits(max_connections=agents * 2, max_keepalive_connections=agents * 2)
    timeout = httpx.Timeout(None, connect=5)
    auth = {"authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(
        limits=limits, timeout=timeout, trust_env=False, headers=auth
    ) as http:
        ctx = _Ctx(load, http, url, ends_runs, progress)
        ctx.t0 = time.monotonic()
        ctx.deadline = load.minutes * 60
        counts: tuple[tuple[ServiceClass, int], ...] = (
            ("interactive", load.interactive),
            ("batch", load.batch),
        )
        tasks: list[asyncio.Task[Any]] = [
            asyncio.create_task(_agent(ctx, cls, i)) for cls, n in counts for i in range(n)
        ]
        if progress is not None:
            tasks.append(asyncio.create_task(_report(ctx)))
        tasks.append(asyncio.create_task(ctx.enough.wait()))
        try:
            # An agent only ends by raising (a bug): say it at once, not at the end.
            done, _ = await asyncio.wait(
                tasks, timeout=ctx.deadline / load.time_scale, return_when=FIRST_COMPLETED
            )
            for t in done:
                t.result()
            end = ctx.now()
            if ctx.enough.is_set():
                ctx.result.minutes = end / 60
            for cls, started in ctx.running.values():
                ctx.result.unfinished[cls] = ctx.result.unfinished.get(cls, 0) + 1
                ctx.result.oldest_unfinished_s = max(ctx.result.oldest_unfinished_s, end - started)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return ctx.result
