"""The load generator's second mode: sub-agents over MCP, fanned out (DESIGN.md "The
test kit").

A client, as an orchestrating agent would, spawns `fanout` sub-agents over the gateway's
MCP door (`spawn`, one call after another, as a harness makes them), waits for them
(`await` with mode `any`, so that each run's end is seen when it comes), reads what they
cost (`status`) and starts the next round, until `rounds` rounds or `minutes` have
passed.  Through the official MCP client, on whichever protocol generation the door and
the client agree on.  A round still going when the time is up has its runs cancelled
(they would skew what runs next on the gateway) and is reported apart.

Per round: the wall time from the first spawn to the last end, against the slowest
run of the round (each run timed from its spawn to the `await` that saw it end);
wall / slowest near 1 means the fan-out cost about nothing over its slowest run.  Per
run: its state and usage.  Runs that do not complete are counted by state, never
hidden; a round still going when the time is up is reported as unfinished.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from luftpause.headers import CALLER_HEADER
from testkit.sim import percentile
from workflows import AWAIT_MAX_S, TERMINAL_STATES

__all__ = ["Fanout", "FanoutResult", "RoundRecord", "run_fanout"]


@dataclass(frozen=True, kw_only=True)
class Fanout:
    """What the orchestrating client does."""

    fanout: int = 16
    rounds: int | None = None  # stop after this many rounds (None: the time)
    minutes: float = 3.0
    # `{i}` is the run's number; the same text every round, so rounds are alike.
    task: str = "Look up topic {i} in the knowledge base and answer in one sentence."
    model: str | None = None  # None: the gateway's first model
    tools: list[str] | None = None  # None: every upstream tool
    service_class: str = "batch"
    max_tool_calls: int | None = None
    caller: str = "fanout"


@dataclass(frozen=True)
class RoundRecord:
    wall_s: float
    slowest_s: float
    states: dict[str, int]
    turns: int
    tool_calls: int
    prompt_tokens: int
    completion_tokens: int


@dataclass
class FanoutResult:
    fanout: int
    rounds: list[RoundRecord] = field(default_factory=list)
    unfinished_round: bool = False
    # The states of the cut round's runs as they were cancelled (AwaitingApproval: a
    # tool that asks, which nothing here approves).
    cut_states: dict[str, int] = field(default_factory=dict)
    errors: int = 0
    first_errors: list[str] = field(default_factory=list)
    # What stopped the whole thing (the door unreachable, refused, not MCP...): None
    # when it ran to its end.
    fatal: str | None = None

    @property
    def failed(self) -> bool:
        """A run that did not complete, or the door failing, or no round ending at all
        (nothing measured).  The round that `minutes` cut off after others is not a
        failure (it is reported, and its runs cancelled), as the own-loop agents' runs
        still going at the window's end are not."""
        return bool(self.errors or self.fatal or (self.unfinished_round and not self.rounds))

    def as_json(self) -> dict[str, Any]:
        def r2(x: float | None) -> float | None:
            return None if x is None else round(x, 2)

        walls = [r.wall_s for r in self.rounds]
        ratios = [r.wall_s / r.slowest_s for r in self.rounds if r.slowest_s > 0]
        states: Counter[str] = Counter()
        for r in self.rounds:
            states.update(r.states)
        return {
            "fanout": self.fanout,
            "rounds": len(self.rounds),
            "runs_by_state": dict(sorted(states.items())),
            "round_wall_p50_s": r2(percentile(walls, 0.5)),
            "round_wall_p90_s": r2(percentile(walls, 0.9)),
            "wall_over_slowest_p50": r2(percentile(ratios, 0.5)),
            "turns": sum(r.turns for r in self.rounds),
            "tool_calls": sum(r.tool_calls for r in self.rounds),
            "prompt_tokens": sum(r.prompt_tokens for r in self.rounds),
            "completion_tokens": sum(r.completion_tokens for r in self.rounds),
            "unfinished_round": self.unfinished_round,
            "cut_runs_by_state": dict(sorted(self.cut_states.items())),
            "errors": self.errors,
            "first_errors": self.first_errors,
            "fatal": self.fatal,
        }

    def error(self, text: str) -> None:
        self.errors += 1
        if len(self.first_errors) < 5:
            self.first_errors.append(text[:300])


class _ToolError(Exception):
    pass


async def _call(c: Client, tool: str, args: dict[str, Any]) -> Any:
    r = await c.call_tool(tool, args)
    if r.is_error:
        text = " ".join(getattr(part, "text", "") for part in r.content)
        raise _ToolError(f"{tool}: {text}")
    return r.structured_content


async def _round(c: Client, plan: Fanout, deadline: float, result: FanoutResult) -> bool:
    """One round; False when the time ran out before its runs ended."""
    started = time.monotonic()
    spawned: dict[str, float] = {}
    for i in range(plan.fanout):
        args: dict[str, Any] = {
            "task": plan.task.format(i=i),
            "serviceClass": plan.service_class,
        }
        if plan.model is not None:
            args["model"] = plan.model
        if plan.tools is not None:
            args["tools"] = plan.tools
        if plan.max_tool_calls is not None:
            args["maxToolCalls"] = plan.max_tool_calls
        try:
            handle = (await _call(c, "spawn", args))["handle"]
        except _ToolError as exc:
            result.error(str(exc))
            continue
        spawned[handle] = time.monotonic()
    if not spawned:
        raise _ToolError("no run of the round could be spawned")
    ended: dict[str, float] = {}
    pending = list(spawned)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            try:
                cut = (await _call(c, "status", {"handles": pending}))["runs"]
                result.cut_states = dict(Counter(r["state"] for r in cut))
            except _ToolError as exc:
                result.error(str(exc))
            for handle in pending:  # not left running for whatever comes next
                try:
                    await _call(c, "cancel", {"handle": handle})
                except _ToolError as exc:
                    result.error(str(exc))
            return False
        answer = await _call(
            c,
            "await",
            {"handles": pending, "mode": "any", "timeout": max(1, min(AWAIT_MAX_S, int(left)))},
        )
        now = time.monotonic()
        for run in answer["runs"]:
            if run["state"] in TERMINAL_STATES:
                ended[run["handle"]] = now
        pending = [h for h in pending if h not in ended]
    wall = time.monotonic() - started
    runs = (await _call(c, "status", {"handles": list(spawned)}))["runs"]
    usage = [r.get("usage") or {} for r in runs]
    result.rounds.append(
        RoundRecord(
            wall_s=wall,
            slowest_s=max((ended[h] - spawned[h] for h in spawned), default=0.0),
            states=dict(Counter(r["state"] for r in runs)),
            turns=sum(u.get("turns", 0) for u in usage),
            tool_calls=sum(u.get("toolCalls", 0) for u in usage),
            prompt_tokens=sum(u.get("promptTokens", 0) for u in usage),
            completion_tokens=sum(u.get("completionTokens", 0) for u in usage),
        )
    )
    for r in runs:
        if r["state"] != "Completed":
            result.error(f"run {r['handle']}: {r['state']}: {r.get('error')}")
    return True


async def run_fanout(
    plan: Fanout,
    url: str,
    *,
    token: str | None = None,
    progress: Any = None,
) -> FanoutResult:
    """Fan sub-agents out through the MCP door at `url` (the gateway's `/mcp`)."""
    headers = {CALLER_HEADER: plan.caller}
    if token:
        headers["authorization"] = f"Bearer {token}"
    result = FanoutResult(fanout=plan.fanout)
    deadline = time.monotonic() + plan.minutes * 60
    refused: list[str] = []  # the door's 401/403s: the SDK's error says only "an error"

    async def answered(response: httpx2.Response) -> None:
        if response.status_code in (401, 403):
            await response.aread()
            try:  # the gateway says why (helper-130: a 403 for the caller header)
                why = str(response.json()["error"]["message"])
            except (ValueError, KeyError, TypeError):
                why = response.reason_phrase
            refused.append(f"{response.status_code} {why}"[:300])

    http = httpx2.AsyncClient(
        headers=headers,
        timeout=httpx2.Timeout(30.0, read=None),
        event_hooks={"response": [answered]},
    )
    try:
        async with http, Client(streamable_http_client(url, http_client=http)) as c:
            while plan.rounds is None or len(result.rounds) < plan.rounds:
                if time.monotonic() >= deadline:
                    break
                try:
                    if not await _round(c, plan, deadline, result):
                        result.unfinished_round = True
                        break
                except _ToolError as exc:
                    result.error(str(exc))
                    break
                if progress is not None:
                    last = result.rounds[-1]
                    progress(
                        f"  round {len(result.rounds)}: {last.wall_s:.1f} s, slowest run "
                        f"{last.slowest_s:.1f} s, {dict(sorted(last.states.items()))}"
                    )
    except Exception as exc:  # the door unreachable or refusing: one line, not a trace
        why = _first(exc)
        if refused:  # (helper-127: "Server returned an error response", for a token)
            why = refused[-1]
            if not token:
                why += " (the gateway's token: --token or $LUFTPAUSE_TOKEN)"
        result.fatal = f"MCP door {url}: {why}"
    return result


def _first(exc: BaseException) -> str:
    """The first leaf of an exception group (the MCP client's task groups raise them)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"[:300]
