"""`luftpause load`: drive a running gateway (yours, or `luftpause up`'s) with agents.

Two modes, the load generator's (DESIGN.md "The test kit"):

- own-loop agents through the proxy (testkit/load.py): `--batch` + `--interactive`
  closed-loop agents, each run a conversation with a tool offered, its tool results
  simulated by waiting `--tool-s`; bounded by `--minutes` or `--runs`.  Against any
  OpenAI-compatible router too (it reads luftpause's headers or ignores them).  With
  `--scripted-tools` the agents decide the tool calls and the model writes them as JSON
  text, for a real model that makes none of its own (testkit/load.py says how).
- sub-agents over MCP (testkit/fanout.py, `--subagents K`): rounds of K runs spawned
  through the gateway's MCP door and awaited; bounded by `--minutes` or `--rounds`.

Progress goes to standard error, the result (a table, or JSON with `--json`) to
standard output.  Exit status 1 when any turn or run failed, 2 when it could not start
(bad flags, the gateway or its door unreachable or refusing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from typing import Any

import httpx

from testkit.fanout import Fanout, FanoutResult, run_fanout
from testkit.load import LoadResult, load_from_args, run_load

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url", default="http://127.0.0.1:8080", help="the gateway (default: luftpause up's)"
    )
    p.add_argument(
        "--token",
        default=os.environ.get("LUFTPAUSE_TOKEN"),
        help="bearer token (default: $LUFTPAUSE_TOKEN)",
    )
    p.add_argument("--model", help="default: the first model GET /v1/models lists")
    p.add_argument(
        "--caller",
        help="the caller every request names (x-luftpause-caller); with a caller's own "
        "token ([[callers]]), its name (default: batch-job and user-N for agents, fanout "
        "for sub-agents)",
    )
    p.add_argument("--minutes", type=float, default=3.0, help="how long (default 3)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    own = p.add_argument_group("own-loop agents through the proxy")
    own.add_argument("--batch", type=int, default=48, help="batch agents (default 48)")
    own.add_argument("--interactive", type=int, default=4, help="interactive agents (default 4)")
    own.add_argument("--runs", type=int, help="stop once this many runs have ended")
    own.add_argument(
        "--context-chars", type=int, default=8000, help="characters of a run's task (8000)"
    )
    own.add_argument("--tool-s", type=float, default=2.0, help="mean seconds a tool call waits (2)")
    own.add_argument(
        "--tool-result-chars", type=int, default=1600, help="characters of a tool result (1600)"
    )
    own.add_argument("--reply-tokens", type=int, default=256, help="max_tokens per turn (256)")
    own.add_argument("--seed", type=int, default=1, help="the agents' tool waits (1)")
    own.add_argument("--end-runs", action="store_true", help="DELETE /v1/runs/{id} after each run")
    own.add_argument(
        "--scripted-tools",
        action="store_true",
        help="for a model that makes no tool calls of its own (a small one on a CPU): the "
        "agents decide the calls, the model writes each as JSON text (response_format), "
        "the last turn is --reply-tokens of prose (ignore_eos), each result goes back as "
        "a user message",
    )
    own.add_argument(
        "--max-tool-calls",
        type=int,
        default=None,
        help="--scripted-tools: 0..N calls a run (3); --subagents: each sub-agent's "
        "maxToolCalls (the server's default)",
    )
    own.add_argument(
        "--tool-call-tokens",
        type=int,
        default=64,
        help="--scripted-tools: the ceiling of a turn that writes a call (64)",
    )
    sub = p.add_argument_group("sub-agents over MCP")
    sub.add_argument("--subagents", type=int, metavar="K", help="rounds of K spawned runs")
    sub.add_argument("--rounds", type=int, help="stop after this many rounds")
    sub.add_argument("--task", default=Fanout.task, help="a run's task; {i} is its number")
    sub.add_argument("--tools", help="comma-separated tool names (default: all)")
    sub.add_argument(
        "--class",
        dest="service_class",
        default="batch",
        choices=["batch", "interactive"],
        help="the runs' service class (batch)",
    )


def _bad(args: argparse.Namespace) -> str | None:
    if not 0 < args.minutes < math.inf:  # NaN too
        return f"--minutes must be a finite number > 0, got {args.minutes}"
    if args.max_tool_calls is not None and args.max_tool_calls < 0:
        return f"--max-tool-calls must be at least 0, got {args.max_tool_calls}"
    caller = args.caller
    if caller is not None and not (
        0 < len(caller) <= 128 and caller.isascii() and caller.isprintable()
    ):
        return f"--caller: expected 1 to 128 printable ASCII characters, got {caller!r}"
    if args.subagents is not None:
        if args.subagents < 1:
            return "--subagents must be at least 1"
        if args.runs is not None or args.end_runs or args.scripted_tools:
            return (
                "--runs, --end-runs and --scripted-tools are for own-loop agents, "
                "not with --subagents"
            )
        if args.rounds is not None and args.rounds < 1:
            return "--rounds must be at least 1"
        return None
    if args.batch < 0 or args.interactive < 0 or args.batch + args.interactive == 0:
        return "needs at least one agent (--batch, --interactive)"
    if args.runs is not None and args.runs < 1:
        return "--runs must be at least 1"

    if args.tool_call_tokens < 1 or args.reply_tokens < 1:
        return "--tool-call-tokens and --reply-tokens must be at least 1"
    return None


def _first_model(url: str, token: str | None) -> str:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    r = httpx.get(f"{url.rstrip('/')}/v1/models", headers=headers, timeout=10, trust_env=False)
    r.raise_for_status()
    models = [m["id"] for m in r.json()["data"]]
    if not models:
        raise ValueError("GET /v1/models lists no model")
    return str(models[0])


def _load_table(r: LoadResult) -> str:
    j = r.as_json()
    rows = [
        ("window", f"{r.minutes:.2f} min"),
        ("interactive runs", f"{j['interactive_runs']} ({j['interactive_runs_per_min']}/min)"),
        ("interactive run p50 / p90", f"{j['interactive_p50_s']} / {j['interactive_p90_s']} s"),
        ("batch runs", f"{j['batch_runs']} ({j['batch_runs_per_min']}/min)"),
        ("turns", str(j["turns"])),
        ("prompt tokens from cache", f"{100 * j['cached_prompt_token_share']:.1f} %"),
        ("runs unfinished at the end", str(sum(r.unfinished.values()))),
        ("errors", str(j["errors"])),
    ]
    return _rows(rows, j["first_errors"])


def _fanout_table(r: FanoutResult) -> str:
    j = r.as_json()
    rows = [
        ("rounds of", f"{j['rounds']} x {j['fanout']} runs"),
        ("runs by state", ", ".join(f"{k} {v}" for k, v in j["runs_by_state"].items()) or "-"),
        ("round wall p50 / p90", f"{j['round_wall_p50_s']} / {j['round_wall_p90_s']} s"),
        ("wall / slowest run, p50", str(j["wall_over_slowest_p50"])),
        ("turns, tool calls", f"{j['turns']}, {j['tool_calls']}"),
        ("prompt / completion tokens", f"{j['prompt_tokens']} / {j['completion_tokens']}"),
        ("a round cut off at the end", _cut(j)),
        ("errors", str(j["errors"])),
        *([("stopped by", str(j["fatal"]))] if j["fatal"] else []),
    ]
    if j["unfinished_round"] and not j["rounds"]:
        rows.append(("result", "no round ended within --minutes: nothing measured"))
    return _rows(rows, j["first_errors"])


def _cut(j: dict[str, Any]) -> str:
    if not j["unfinished_round"]:
        return "no"
    states = j["cut_runs_by_state"]
    said = "yes: runs cancelled"
    if states:
        said += " (they were " + ", ".join(f"{k} {v}" for k, v in states.items()) + ")"
    if states.get("AwaitingApproval"):
        # helper-135: `delete_record` asks, and nothing here approves it.
        said += "; a run awaiting approval waits for ever here: --tools without the tools that ask"
    return said


def _rows(rows: list[tuple[str, str]], errors: list[str]) -> str:
    width = max(len(k) for k, _ in rows)
    out = [f"{k:<{width}}  {v}" for k, v in rows]
    out += [f"  {e}" for e in errors]
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    bad = _bad(args)
    if bad is not None:
        print(f"luftpause load: {bad}", file=sys.stderr)
        return 2

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    result: Any
    if args.subagents is not None:
        plan = Fanout(
            fanout=args.subagents,
            rounds=args.rounds,
            minutes=args.minutes,
            task=args.task,
            model=args.model,
            tools=[t.strip() for t in args.tools.split(",") if t.strip()] if args.tools else None,
            service_class=args.service_class,
            max_tool_calls=args.max_tool_calls,
            caller=args.caller or "fanout",
        )
        progress(f"{plan.fanout} sub-agents a round through {args.url}/mcp")
        result = asyncio.run(
            run_fanout(plan, f"{args.url.rstrip('/')}/mcp", token=args.token, progress=progress)
        )
        if result.fatal is not None and not result.rounds:
            print(f"luftpause load: {result.fatal}", file=sys.stderr)
            return 2
        table = _fanout_table(result)
    else:
        try:
            model = args.model or _first_model(args.url, args.token)
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            print(f"luftpause load: cannot learn the model from {args.url}: {exc}", file=sys.stderr)
            return 2
        load = load_from_args(
            args,
            runs=args.runs,
            model=model,
            scripted_tools=args.scripted_tools,
            max_tool_calls=3 if args.max_tool_calls is None else args.max_tool_calls,
            tool_call_tokens=args.tool_call_tokens,
            caller=args.caller,
        )
        progress(
            f"{load.batch} batch + {load.interactive} interactive agents on {model} through "
            f"{args.url}"
        )
        if load.runs is not None and load.runs < 2 * (load.batch + load.interactive):
            progress(
                f"  note: --runs {load.runs} is under twice the agents: the first runs to "
                "end are the shortest ones, so the figures lean low"
            )
        result = asyncio.run(
            run_load(load, args.url, ends_runs=args.end_runs, progress=progress, token=args.token)
        )
        table = _load_table(result)
    print(json.dumps(result.as_json(), indent=2) if args.json else table)
    return 1 if result.failed else 0
