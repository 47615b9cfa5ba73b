"""`luftpause` — one entry point, a subcommand per process or tool.

Subcommands import what they need lazily, so `luftpause sim` never loads the gateway
or Temporal, and this module imports nothing heavy at import time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from luftpause._args import port, positive, seconds


def _sim_parser(sub: Any) -> None:
    p = sub.add_parser(
        "sim",
        help="simulate agent workloads through the scheduler core in virtual time",
        description=(
            "Drive closed-loop agent runs through the real scheduler core and simulated "
            "engines in virtual time, and compare it with other admission policies. "
            "Scenarios: flood, light, routing, fanout; bench-core measures the core."
        ),
    )
    p.add_argument("scenario", choices=["flood", "light", "routing", "fanout", "bench-core"])
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--arms", help="comma-separated arms (default: all)")
    p.add_argument("--engines", type=int, help="number of simulated engines")
    p.add_argument(
        "--replicas-per-gpu",
        type=int,
        help="engines that time-slice one GPU (default 2, as the reference bed; the "
        "luftpause arm is told which share one, for policy pack_shared_devices)",
    )
    p.add_argument("--batch", type=int, help="batch agents (closed loop)")
    p.add_argument("--interactive", type=int, help="interactive agents (closed loop)")
    p.add_argument("--runs", type=int, help="fanout: runs started together")
    p.add_argument("--context-chars", type=int, help="context of a run's first turn")
    p.add_argument(
        "--shared-prefix-chars",
        type=int,
        help="a prefix every run's prompt begins with, before its context (a harness's "
        "system prompt and tool schemas); default 0",
    )
    p.add_argument(
        "--interactive-prefix-chars",
        type=int,
        help="the interactive runs' own prefix, as from another harness than the batch "
        "runs'; default: --shared-prefix-chars",
    )
    p.add_argument("--max-tool-calls", type=int, help="each run makes 0..N tool calls")
    p.add_argument("--tool-s", type=float, help="mean tool call duration, seconds")
    p.add_argument("--tool-result-chars", type=int, help="context each tool result adds")
    p.add_argument("--reply-tokens", type=int, help="tokens generated per turn")
    p.add_argument("--minutes", type=float, help="virtual minutes to simulate")
    p.add_argument("--seed", type=int, help="seed of the workload")
    p.add_argument(
        "--engine-priority",
        action="store_true",
        help="engines schedule by priority and interactive turns are sent high",
    )
    p.add_argument(
        "--engine-decode-cap",
        type=int,
        metavar="N",
        help="engines preempt batch decode (not an SGLang feature): while an interactive "
        "turn decodes, at most N batch turns decode in its steps; interactive turns are "
        "sent high",
    )
    p.add_argument(
        "--engine-mixed-chunk",
        action="store_true",
        help="engines decode the running requests in prefill steps too (SGLang's "
        "--enable-mixed-chunk)",
    )
    p.add_argument("--kv-tokens", type=int, help="KV pool per engine, tokens")
    p.add_argument("--max-running", type=int, help="engine running-request limit")
    p.add_argument(
        "--prompt-estimate",
        type=float,
        help="the luftpause arm's estimate of a turn's prompt tokens, as a multiple of "
        "the engine's count (default 1: exact; the gateway estimates from the request's "
        "bytes, JSON and tool schemas included)",
    )
    p.add_argument(
        "--slots-unknown",
        action="store_true",
        help="the luftpause arm is not told the engines' running-request limit (as on "
        "vLLM): only their queues cap it",
    )
    p.add_argument(
        "--policy",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a scheduler Policy field, e.g. kv_admission=false (repeatable)",
    )
    p.add_argument("--held", type=int, default=10_000, help="bench-core: held turns")
    p.add_argument("--decisions", type=int, default=100_000, help="bench-core: decisions")


def _policy(overrides: Sequence[str]) -> Any:
    from dataclasses import fields, replace

    from scheduler import Policy

    policy = Policy()
    types = {f.name: f.type for f in fields(Policy)}
    changes: dict[str, Any] = {}
    for item in overrides:
        name, sep, raw = item.partition("=")
        if not sep or name not in types:
            raise SystemExit(f"--policy {item!r}: expected NAME=VALUE, NAME one of {sorted(types)}")
        kind = str(types[name])
        if kind == "bool":
            if raw.lower() not in ("true", "false", "1", "0", "on", "off"):
                raise SystemExit(f"--policy {name}: expected true or false, got {raw!r}")
            changes[name] = raw.lower() in ("true", "1", "on")
            continue
        if kind.endswith("| None") and raw.lower() in ("none", "off"):
            changes[name] = None
            continue
        number = int if kind.startswith("int") else float
        try:
            changes[name] = number(raw)
        except ValueError:
            optional = " (or none)" if kind.endswith("| None") else ""
            raise SystemExit(f"--policy {name}: expected a number{optional}, got {raw!r}") from None
    # The ranges a configuration file's [policy] is held to (a share is 0 to 1, ...).
    from pydantic import ValidationError

    from luftpause.config import PolicyConfig

    try:
        PolicyConfig.model_validate(changes)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise SystemExit(f"--policy {where}: {error['msg']}, got {error['input']!r}") from None
    return replace(policy, **changes)


def _sim(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from testkit.sim import ARMS, SCENARIOS
    from testkit.sim._report import (
        bench_core,
        compare,
        compare_fanout,
        fanout_table,
        scenario_with,
        table,
    )

    if args.scenario == "bench-core":
        if args.held < 1 or args.decisions < 1:
            raise SystemExit(
                f"luftpause sim bench-core: --held and --decisions must be >= 1, got "
                f"{args.held} and {args.decisions}"
            )
        result = bench_core(held=args.held, decisions=args.decisions)
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            print(
                f"{result['decisions_per_s']:,} decisions/s with {result['held_turns']:,} "
                f"held turns ({result['decisions']:,} decisions in {result['seconds']} s, "
                f"{result['replicas']} replicas, {result['callers']:,} callers, "
                f"{result['core']} core)"
            )
        return 0
    sc = SCENARIOS[args.scenario]
    try:  # a knob out of range is a ValueError naming it
        engine = sc.engine
        if args.kv_tokens is not None:
            engine = replace(engine, kv_pool_tokens=args.kv_tokens)
        if args.max_running is not None:
            engine = replace(engine, max_running_requests=args.max_running)
        if args.engine_decode_cap is not None:
            engine = replace(engine, low_priority_decode_cap=args.engine_decode_cap)
        if args.engine_mixed_chunk:
            engine = replace(engine, mixed_chunk=True)
        sc = scenario_with(
            sc,
            engines=args.engines,
            replicas_per_gpu=args.replicas_per_gpu,
            batch=args.batch,
            interactive=args.interactive,
            runs=args.runs,
            context_chars=args.context_chars,
            shared_prefix_chars=args.shared_prefix_chars,
            interactive_prefix_chars=args.interactive_prefix_chars,
            max_tool_calls=args.max_tool_calls,
            tool_s=args.tool_s,
            tool_result_chars=args.tool_result_chars,
            reply_tokens=args.reply_tokens,
            minutes=args.minutes,
            seed=args.seed,
            engine_priority=True if args.engine_priority else None,
            slots_known=False if args.slots_unknown else None,
            prompt_estimate=args.prompt_estimate,
            engine=engine,
            policy=_policy(args.policy),
        )
    except ValueError as e:
        raise SystemExit(f"luftpause sim: {e}") from None
    arms = args.arms.split(",") if args.arms else list(ARMS)
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"--arms: unknown {unknown}; known: {', '.join(ARMS)}")
    if args.scenario == "fanout":
        try:
            report = compare_fanout(sc, arms if args.arms else ("luftpause", "cache_aware"))
        except ValueError as e:  # runs that did not end in the time given
            raise SystemExit(f"luftpause sim: {e}") from None
        print(json.dumps(report, indent=2) if args.json else fanout_table(report))
        return 0
    report = compare(sc, arms)
    print(json.dumps(report, indent=2) if args.json else table(report))
    return 0


def _fake_engine_parser(sub: Any) -> None:
    p = sub.add_parser(
        "fake-engine",
        help="serve an OpenAI-compatible fake engine (simulated in real time) for tests",
        description=(
            "An OpenAI-compatible fake inference server: a simulated SGLang-like engine "
            "runs behind it in real time; /metrics and the peer routers' probe endpoints "
            "speak the chosen engine's dialect."
        ),
    )
    p.add_argument("--flavor", choices=["sglang", "vllm", "llamacpp"], default="sglang")
    p.add_argument("--port", type=port, required=True, help="port to listen on")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: %(default)s)"
    )
    p.add_argument(
        "--model",
        action="append",
        default=[],
        help="a served model name (repeatable; default llama-3.2-1b)",
    )
    p.add_argument(
        "--time-scale",
        type=positive,
        default=1.0,
        help="virtual seconds per wall second (20: a 5 s generation takes 0.25 s)",
    )
    p.add_argument("--instant", action="store_true", help="answer at once, no simulation")
    p.add_argument("--seed", type=int, default=0, help="seed of the replies")
    p.add_argument("--labels", help="comma-separated label set of /classify")
    p.add_argument("--kv-tokens", type=int, help="KV pool of the simulated engine, tokens")
    p.add_argument(
        "--max-tool-calls",
        type=int,
        help="with tools, each run makes 0..N tool calls (default 3), chosen by its task",
    )
    p.add_argument("--max-running", type=int, help="running-request limit of the engine")
    p.add_argument(
        "--priority-scheduling",
        action="store_true",
        help="the engine schedules its queue by the request's priority field",
    )
    p.add_argument(
        "--dp-size",
        type=int,
        default=1,
        help="data-parallel ranks, each a simulated engine with its own KV cache; a "
        "request goes to the rank its X-Data-Parallel-Rank names, else round robin",
    )
    p.add_argument(
        "--cache-report",
        choices=["always", "hits", "never"],
        default="always",
        help="when answers state the prompt's cached tokens (usage.prompt_tokens_details): "
        "always, as llama.cpp; hits, only when some were found, as SGLang with "
        "--enable-cache-report and vLLM with --enable-prompt-tokens-details; never, as "
        "both without those flags (default: %(default)s)",
    )


def _fake_engine(args: argparse.Namespace) -> int:
    import logging
    from dataclasses import replace

    from testkit.engine import EngineParams
    from testkit.fake_engine import FakeEngineSettings, serve

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    params = EngineParams.reference()
    try:
        if args.kv_tokens is not None:
            params = replace(params, kv_pool_tokens=args.kv_tokens)
        if args.max_running is not None:
            params = replace(params, max_running_requests=args.max_running)
    except ValueError as exc:
        raise SystemExit(f"luftpause fake-engine: {exc}") from None
    if args.priority_scheduling:
        params = replace(params, priority_scheduling=True)
    extra: dict[str, Any] = {}
    if args.model:
        extra["models"] = tuple(args.model)
    if args.max_tool_calls is not None:
        extra["max_tool_calls"] = args.max_tool_calls
    if args.labels:
        extra["labels"] = tuple(lab.strip() for lab in args.labels.split(",") if lab.strip())
    try:
        settings = FakeEngineSettings(
            flavor=args.flavor,
            time_scale=args.time_scale,
            instant=args.instant,
            seed=args.seed,
            engine=params,
            dp_size=args.dp_size,
            cache_report=args.cache_report,
            **extra,
        )
    except ValueError as exc:
        raise SystemExit(f"luftpause fake-engine: {exc}") from None
    serve(settings, host=args.host, port=args.port)
    return 0


def _gateway_parser(sub: Any) -> None:
    p = sub.add_parser(
        "gateway",
        help="serve the gateway: the OpenAI-compatible proxy that admits turns, and /mcp",
        description=(
            "Serve the luftpause gateway (one process per pool of engines): "
            "/v1/chat/completions, /v1/responses and /v1/messages (Anthropic) admitted by "
            "the scheduler and proxied to the engines of the configuration file; "
            "/v1/messages/count_tokens (a token count, passed to an engine, not admitted); "
            "the MCP door /mcp (sub-agents as tools, run by `luftpause worker` on "
            "Temporal); /v1/decide (classify an input); /v1/runs and /v1/runs/{run id} "
            "(GET, DELETE); /v1/models and /v1/models/{model}; the status page / "
            "and its JSON /status; /metrics (Prometheus); POST /reload; /health. Its "
            "`token` (or LUFTPAUSE_TOKEN, which overrides it), when set, is the bearer "
            "token /v1/*, /mcp, /status, / and /reload require."
        ),
    )
    p.add_argument(
        "--config",
        default=os.environ.get("LUFTPAUSE_CONFIG") or "luftpause.toml",  # set empty: unset
        help="path of luftpause.toml (default: $LUFTPAUSE_CONFIG or ./luftpause.toml)",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: %(default)s; 0.0.0.0 for every interface)",
    )
    p.add_argument(
        "--port", type=port, default=8080, help="port to listen on (default: %(default)s)"
    )
    p.add_argument(
        "--shutdown-grace-s",
        type=seconds,
        default=30.0,
        help="on SIGTERM, how long turns in flight may go on before they are cut "
        "(default 30; keep your orchestrator's grace period above it)",
    )


def _gateway(args: argparse.Namespace) -> int:
    from luftpause._process import hold_hangups

    # First: a SIGHUP (a reload) while the gateway starts would end it (helper-157).
    hold_hangups()
    import logging

    import uvicorn

    from gateway._server import BoundedHead
    from gateway.app import KEEPALIVE_S, GatewaySettings, create_app
    from luftpause import telemetry
    from luftpause.config import ConfigError, default_file_hint, load_config

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per probe
    try:
        config = load_config(args.config, os.environ)
    except ConfigError as exc:
        raise SystemExit(f"luftpause gateway: {exc}{default_file_hint(args.config)}") from None
    settings = GatewaySettings(
        config=config,
        token=config.token,
        host=args.host,
        config_path=args.config,
        freeze_heap=True,
    )
    try:
        app = create_app(settings)
    except ConfigError as exc:  # callers' tokens, read from the environment
        raise SystemExit(f"luftpause gateway: {args.config}: {exc}") from None
    try:
        telemetry.setup("luftpause-gateway")
    except telemetry.TracingError as exc:
        raise SystemExit(f"luftpause gateway: {exc}") from None

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            # Before uvicorn waits out the grace for the requests it runs: the turns
            # held for a slot are answered 503 now, not cut at its end (a text 500).
            app.state.drain()
            await super().shutdown(sockets)

    # One process: the scheduler's state lives in it (DESIGN.md "Processes and ports").
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        http=BoundedHead,  # a request head is bounded (gateway/_server.py)
        workers=1,
        ws="none",
        access_log=False,
        log_level="info",
        # A reply streams for seconds to minutes: 5 s (what this was) cut most of the
        # turns in flight at every deploy.  New connections are refused meanwhile.
        timeout_graceful_shutdown=max(0, round(args.shutdown_grace_s)),
        timeout_keep_alive=KEEPALIVE_S,
    )
    server = Server(config)
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if not server.started:  # as uvicorn.run: the port taken, the lifespan failed
        raise SystemExit(3)
    return 0


# Subcommands owned by other packages: each module has `add_arguments(parser)` and
# `run(args) -> int`, imported only when its subcommand runs.
_DELEGATED = {
    "fake-mcp": (
        "testkit.fake_mcp",
        # (Its tools are named by `luftpause fake-mcp --help`, read from the server.)
        "serve the fake MCP tool server for tests",
    ),
    "bench": (
        "testkit.bench",
        "measure: `bench overhead` (gateway), `bench temporal`, `bench mcp`, "
        "`bench flood|light|routing` (vs the real routers)",
    ),
    "load": (
        "testkit.load_cli",
        "drive a running gateway with agents: own-loop agents through the proxy, or "
        "rounds of sub-agents over MCP (--subagents K)",
    ),
    "worker": ("worker.main", "run a Temporal worker for sub-agent runs"),
    "up": (
        "luftpause.up",
        "run it all on this machine: Temporal dev server, gateway, worker, fake engines and tools",
    ),
}


def _delegated_parser(sub: Any, name: str, wanted: bool) -> None:
    import importlib

    module, help_text = _DELEGATED[name]
    p = sub.add_parser(name, help=help_text, description=help_text)
    # The module is imported only when its subcommand is the one asked for.
    p.set_defaults(_module=module)
    if wanted:
        importlib.import_module(module).add_arguments(p)


# The commands whose standard output is their result (a table or JSON).
_REPORTS = ("sim", "bench", "load")


# What `luftpause --help` says first (the module's docstring is for who reads the code).
DESCRIPTION = (
    "luftpause admits agents' LLM turns to a pool of inference engines, knowing which "
    "turns are one run: an OpenAI-compatible proxy, and an MCP server whose tools run "
    "sub-agents. Start with `luftpause up` (everything on this machine, with fake "
    "engines and tools); see README.md."
)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="luftpause", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    _sim_parser(sub)
    _fake_engine_parser(sub)
    _gateway_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    for name in _DELEGATED:
        _delegated_parser(sub, name, wanted=name in argv[:1])
    args = parser.parse_args(argv)
    code = 0
    try:
        if args.command == "sim":
            code = _sim(args)
        elif args.command == "fake-engine":
            code = _fake_engine(args)
        elif args.command == "gateway":
            code = _gateway(args)
        elif args.command in _DELEGATED:
            import importlib

            code = importlib.import_module(args._module).run(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # `luftpause sim flood | head`: the reader left; end quietly, as Unix tools do.
        # (Not by SIGPIPE's default action: that would also kill a server writing to a
        # client that reset its connection, where Python's EPIPE error is what we want.)
        # Only the commands whose output is a report; elsewhere it is a bug to show.
        if args.command not in _REPORTS:
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 128 + signal.SIGPIPE
    except SystemExit as exc:
        # A command that ends itself (`raise SystemExit("luftpause worker: ...")`) also
        # leaves past the interpreter's teardown, where temporalio can abort
        # (sdk-python#300: "Fatal Python error", status 134 instead of 1).
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr, flush=True)
            code = 1
        else:
            code = exc.code or 0
        sys.stdout.flush()
    except KeyboardInterrupt:
        # Ctrl-C in a report (`sim`, `bench`, `load`): what it started has been stopped
        # on the way out (their `finally` blocks); no traceback, the shell's status.
        # `up` sets its own handlers once its modules are imported: one reaching here
        # came during that second, when nothing was started yet (helper-127).
        if args.command not in (*_REPORTS, "up"):
            raise
        print(f"luftpause {args.command}: interrupted", file=sys.stderr, flush=True)
        code = 128 + signal.SIGINT
    # temporalio can abort at interpreter exit (sdk-python#300): leave without teardown.
    os._exit(code)
