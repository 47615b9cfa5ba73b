"""`luftpause bench flood|light|routing` — luftpause against the real peer routers, in
real time, on the same fake engines.

The workload is the simulator's scenario of the same name (`luftpause sim`, same knobs
and flags), played by the load generator (testkit/load.py): closed-loop own-loop agents,
interactive and batch, sending every turn through the arm's proxy to N fake engines
(`luftpause fake-engine`, the simulated SGLang-like engine in real time).  Arms run one
after another, each on fresh engines (empty caches, same seed), so no arm inherits
another's state; each arm's proxy and engines are their own processes, stopped by PID
when the arm ends.

Arms (each a real router, as its users run it):
- `luftpause`: `luftpause gateway` with the engines as SGLang endpoints.
- `cache_aware`, `round_robin`: the SGLang router (`sglang-router`).
- `smg_priority`: SMG (Shepherd Model Gateway) with its priority scheduler;
  interactive turns are sent as `x-smg-priority: interactive`, batch as `bulk`.
The reference arms run one class with no other load, through each of
`--reference-arms` (default: cache_aware and luftpause, as the simulator); the better
result of each class is `interactive-alone` / `batch-alone`, and P and W are computed
against them as in `luftpause sim`.

Not the simulator's figures: each fake engine keeps half a GPU (the reference bed's
share) where the simulator gives a lone busy replica all of it, and the fake engine
answers a tool call in 20 tokens and a text in 40..256 where every simulated turn
decodes 256.  The harness, the proxies and the engines share this machine's CPUs:
compare arms with each other, in the same run.

Real engines instead of fake ones: `--llama-server PATH --llama-model GGUF` starts one
llama.cpp server per engine (`--slots`: each one's `--parallel`, `--engine-threads`
threads each), endpoints of kind `llamacpp` for luftpause, which reads their slots from
`/props` (the arm starts its load once the gateway knows them).  A small model on a
CPU makes no tool calls of its own, so the agents decide them and the model writes each
as JSON text (`scripted_tools` in testkit/load.py: the same calls, lengths and pauses in
every arm; luftpause recovers the calls and sees the runs paused).  Only in real time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from luftpause._process import cpu_seconds

__all__ = ["ARMS", "add_arguments", "llama_server_argv", "run"]

ARMS = ("luftpause", "cache_aware", "round_robin", "smg_priority")
DEFAULT_ARMS = ("luftpause", "cache_aware", "round_robin", "smg_priority")
READY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class _Router:
    argv: list[str]  # {port}, {prom} and the worker urls are filled in
    ready_path: str
    ends_runs: bool = False
    needs: str = ""  # the Python module it runs (`python -m`), for the error when missing
    # After it answers `ready_path`: (proxy url, worker urls) -> None, e.g. registering
    # the workers; raises when the router does not take them.
    setup: Callable[[str, list[str]], None] | None = None


def _routers(exe_dir: Path) -> dict[str, _Router]:
    py = sys.executable
    sglang = [py, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", "{port}"]
    prom = ["--prometheus-host", "127.0.0.1", "--prometheus-port", "{prom}"]
    return {
        "luftpause": _Router(
            [str(exe_dir / "luftpause"), "gateway", "--config", "{config}", "--port", "{port}"],
            "/health",
            ends_runs=True,
        ),
        "cache_aware": _Router(
            [*sglang, "--policy", "cache_aware", *prom, "--worker-urls", "{workers}"],
            "/health",
            needs="sglang_router",
        ),
        "round_robin": _Router(
            [*sglang, "--policy", "round_robin", *prom, "--worker-urls", "{workers}"],
            "/health",
            needs="sglang_router",
        ),
        "smg_priority": _Router(
            [
                # `python -m smg`: sglang-router installs a `smg` script of its own too.
                py,
                "-m",
                "smg",
                "launch",
                "--host",
                "127.0.0.1",
                "--port",
                "{port}",
                *prom,
                "--policy",
                "cache_aware",
                "--priority-scheduler-enabled",
                # Without a tenant set-up every client is the tenant `ip:127.0.0.1`, whose
                # highest class defaults to `default`: interactive would be clamped to it.
                "--priority-scheduler-default-max-class",
                "system",
                "--priority-scheduler-config",
                "{smg_classes}",
            ],
            "/health",
            needs="smg",
            setup=_smg_workers,
        ),
    }


# SMG's priority classes.  Its defaults reserve 32 slots for `system` and 128 for
# `interactive`, more than two engines hold (2 x 48); SMG then falls back to plain
# admission without a word.  These keep its per-slot shares and queues, with no floors.
# Preemption is off: in 1.13 a preempted non-streamed request is dropped without an
# answer (the client sees the connection close), which would count as lost work.
SMG_CLASSES = """\
classes:
  system:      {reserved_floor: 0, reserved_per_slot: 0.0,  queue_size: 64,   queue_timeout_secs: 30,  starvation_threshold_secs: 5,   can_preempt: false}
  interactive: {reserved_floor: 0, reserved_per_slot: 0.25, queue_size: 256,  queue_timeout_secs: 30,  starvation_threshold_secs: 5,   can_preempt: false}
  default:     {reserved_floor: 0, reserved_per_slot: 0.10, queue_size: 512,  queue_timeout_secs: 60,  starvation_threshold_secs: 30,  can_preempt: false}
  bulk:        {reserved_floor: 0, reserved_per_slot: 0.0,  queue_size: 1024, queue_timeout_secs: 300, starvation_threshold_secs: 120, can_preempt: false}
"""  # noqa: E501


def _smg_workers(proxy: str, workers: list[str]) -> None:
    """Register each engine with its running-request limit (SMG's capacity: without the
    label it assumes 64 per worker, more than the engine runs, and never holds a turn),
    then wait until SMG reports itself ready."""
    import urllib.request

    from luftpause.up import wait_http

    for url in workers:
        limit = _running_limit(url)
        body = {"url": url, "labels": {"max_running_requests": str(limit)}}
        req = urllib.request.Request(
            f"{proxy}/workers",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            if r.status >= 300:
                raise RuntimeError(f"smg did not take worker {url}: {r.status}")
    wait_http(f"{proxy}/readiness", "smg with its workers", None, timeout=READY_TIMEOUT_S)


def _running_limit(url: str) -> int:
    """The requests engine `url` runs at once, parsed as luftpause's prober parses it:
    SGLang's `/server_info`, else llama.cpp's `/props`."""
    import urllib.error
    import urllib.request

    from gateway.prober import parse_llamacpp_slots, parse_sglang_slots

    try:
        with urllib.request.urlopen(f"{url}/server_info", timeout=5) as r:
            limit = parse_sglang_slots(json.load(r))
    except urllib.error.HTTPError:
        with urllib.request.urlopen(f"{url}/props", timeout=5) as r:
            limit = parse_llamacpp_slots(json.load(r))
    if limit is None:
        raise RuntimeError(f"engine {url} says nothing of how many requests it runs at once")
    return limit


def add_arguments(parser: argparse.ArgumentParser, scenario: str) -> None:
    from testkit.sim import SCENARIOS

    sc = SCENARIOS[scenario]
    a = parser.add_argument
    a("--arms", default=",".join(DEFAULT_ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    a("--batch", type=int, default=sc.batch, help=f"batch agents (default {sc.batch})")
    a("--interactive", type=int, default=sc.interactive, help="interactive agents")
    a("--context-chars", type=int, default=sc.context_chars, help="task context, characters")
    a("--tool-s", type=float, default=sc.tool_s, help="mean tool call seconds")
    a("--tool-result-chars", type=int, default=sc.tool_result_chars)
    a("--max-tool-calls", type=int, default=sc.max_tool_calls, help="0..N calls a run")
    a("--reply-tokens", type=int, default=sc.reply_tokens, help="max_tokens of each turn")
    a("--minutes", type=float, default=sc.minutes, help="virtual minutes per arm")
    a(
        "--engines",
        type=int,
        default=sc.engines,
        help="engines: fake ones (one GPU each), or llama-servers",
    )
    a("--seed", type=int, default=sc.seed)
    a(
        "--time-scale",
        type=float,
        default=1.0,
        help="virtual seconds per wall second for engines and tools (default 1: real time)",
    )
    a(
        "--no-reference",
        action="store_true",
        help="skip the interactive-alone and batch-alone arms (no P and W)",
    )
    a(
        "--reference-arms",
        default="cache_aware,luftpause",
        help="the arms the one-class reference runs go through; the better counts",
    )
    a(
        "--policy",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="the luftpause arm's [policy] key, e.g. batch_kv_fill=off (repeatable); "
        "the reference runs keep the default policy",
    )
    real = parser.add_argument_group("real engines (llama.cpp) instead of fake ones")
    real.add_argument("--llama-server", metavar="PATH", help="the llama-server binary")
    real.add_argument("--llama-model", metavar="GGUF", help="the model file it serves")
    real.add_argument(
        "--slots",
        default="4",
        help="each engine's --parallel, comma-separated, or one for all (default 4)",
    )
    real.add_argument("--context-per-slot", type=int, default=4096, help="tokens (4096)")
    real.add_argument("--engine-threads", type=int, default=1, help="threads each (1)")
    a("--json", action="store_true", help="print JSON instead of a table")


@dataclass
class _Arm:
    name: str
    load: Any  # testkit.load.Load
    router: str
    policy: list[str]  # the luftpause gateway's [policy] pairs (--policy)


def _fill(argv: list[str], values: dict[str, str], workers: list[str]) -> list[str]:
    out: list[str] = []
    for part in argv:
        if part == "{workers}":
            out.extend(workers)
        else:
            out.append(part.format(**values))
    return out


@dataclass
class _Bed:
    url: str
    proxy: Any  # luftpause.up.Child
    engines: list[Any]
    slots: dict[str, int] | None = None  # what the gateway learnt of real engines' slots

    def check_alive(self) -> None:
        """Raise, naming the process and how it ended, if a part of the bed is gone."""
        for c in [self.proxy, *self.engines]:
            if not c.alive():
                code = c.proc.returncode
                how = f"by signal {-code}" if code < 0 else f"with status {code}"
                raise RuntimeError(
                    f"the {c.name} process exited {how} during the load; see {c.log}"
                )

    def cpu(self) -> dict[str, float | None]:
        """CPU seconds so far of the proxy and of the engines together: the harness, the
        proxy and the engines share this machine's CPUs, so a proxy that needs more of
        them leaves less to the engines."""
        proxy = cpu_seconds(self.proxy.proc.pid)
        engines = [cpu_seconds(c.proc.pid) for c in self.engines]
        return {
            "proxy": proxy,
            "engines": None if None in engines else sum(e for e in engines if e is not None),
        }


def _spent(before: float | None, after: float | None) -> float | None:
    # Clock ticks are 10 ms: a Rust router's share of a short, light run can be a few.
    return None if before is None or after is None else round(after - before, 2)


def _held_seconds(url: str) -> dict[str, Any]:
    """luftpause's own count of turns it held and for how long, by class (/metrics);
    what went wrong instead, if the scrape failed (the arm's load still counts)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError as exc:
        return {"error": f"/metrics: {exc}"}
    out: dict[str, Any] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "luftpause_held_seconds":
            continue
        for s in family.samples:
            if s.name.endswith(("_sum", "_count")):
                kind = "seconds" if s.name.endswith("_sum") else "turns"
                out.setdefault(s.labels["class"], {})[kind] = round(s.value, 2)
    return out


def _slots(args: argparse.Namespace) -> list[int]:
    """`--slots` for each of the `--engines` llama-servers; ValueError when it does
    not fit."""
    slots = [int(x) for x in str(args.slots).split(",")]
    if len(slots) == 1:
        slots *= args.engines
    if len(slots) != args.engines or min(slots) < 1:
        raise ValueError(f"--slots wants one count >= 1, or one per engine ({args.engines})")
    return slots


def _served_model(args: argparse.Namespace) -> str:
    """The model name the engines serve and the agents ask for."""
    return Path(args.llama_model).stem if args.llama_server else "llama-3.2-1b"


def _engine_argv(args: argparse.Namespace, i: int, port: int) -> tuple[list[str], str]:
    """Engine `i`'s command line on `port`, and the endpoint kind luftpause knows it by."""
    if not args.llama_server:
        exe = str(Path(sys.executable).parent / "luftpause")
        argv = [exe, "fake-engine", "--port", str(port), "--seed", str(args.seed),
                "--max-tool-calls", str(args.max_tool_calls),
                "--time-scale", str(args.time_scale)]  # fmt: skip
        return argv, "sglang"
    argv = llama_server_argv(
        args.llama_server, args.llama_model, _served_model(args), port, _slots(args)[i],
        args.context_per_slot, args.engine_threads,
    )  # fmt: skip
    return argv, "llamacpp"


def llama_server_argv(
    exe: str, model: str, alias: str, port: int, slots: int, context_per_slot: int, threads: int
) -> list[str]:
    """A llama.cpp server on loopback `port` serving `model` as `alias`, with `slots`
    requests at once (`--parallel`; its context is split evenly between them), and the
    metrics luftpause probes."""
    return [exe, "-m", model, "--alias", alias, "--host", "127.0.0.1", "--port", str(port),
            "--parallel", str(slots), "-c", str(slots * context_per_slot),
            "-t", str(threads), "--metrics"]  # fmt: skip


def _wait_slots(url: str, expected: dict[str, int], timeout: float = 30.0) -> dict[str, int]:
    """Wait until the gateway at `url` knows each replica's slots (it asks llama.cpp's
    `/props` at its probes); else the arm would not measure what it says."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(f"{url}/status", timeout=5) as r:
            known = {x["name"]: x["slots"] for x in json.load(r)["replicas"]}
        if known == expected:
            return known
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateway's slots are {known}, not the engines' {expected}")
        time.sleep(0.2)


@contextlib.contextmanager
def _arm_bed(
    args: argparse.Namespace,
    router: _Router,
    log_dir: Path,
    policy: list[str],
    luftpause: bool = False,
) -> Iterator[_Bed]:
    """Fresh engines and the arm's proxy (`luftpause`: the gateway); yields them;
    stops them all."""
    from luftpause.temporal_dev import free_port
    from luftpause.up import Child, wait_http

    children: list[Child] = []

    def start(name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        c = Child(name, argv, log_dir / f"{name}.log", env=env or {})
        c.start()
        children.append(c)
        return c

    try:
        workers = []
        for i in range(args.engines):
            port = free_port()
            argv, kind = _engine_argv(args, i, port)
            c = start(f"engine{i}", argv)
            url = f"http://127.0.0.1:{port}"
            # llama-server answers 503 while it loads the model
            wait_http(f"{url}/health", f"engine {i}", c, timeout=READY_TIMEOUT_S)
            workers.append(url)
        config = log_dir / "luftpause.toml"
        config.write_text(
            "".join(
                f'[[endpoints]]\nname = "e{i}"\nurl = "{u}"\nkind = "{kind}"\n'
                f'models = ["{_served_model(args)}"]\n\n'
                for i, u in enumerate(workers)
            )
            + _policy_toml(policy),
            encoding="utf-8",
        )
        port = free_port()
        argv = _router_argv(router, port, workers, log_dir, config)
        c = start("proxy", argv, env={"LUFTPAUSE_TOKEN": ""})
        proxy = f"http://127.0.0.1:{port}"
        wait_http(f"{proxy}{router.ready_path}", "the proxy", c, timeout=READY_TIMEOUT_S)
        if router.setup is not None:
            router.setup(proxy, workers)
        if not c.alive():  # what answered on its port was something else
            raise RuntimeError(f"the proxy exited during startup; see {c.log}")
        slots = None
        if luftpause and args.llama_server:
            slots = _wait_slots(proxy, {f"e{i}": n for i, n in enumerate(_slots(args))})
        yield _Bed(proxy, c, children[: args.engines], slots)
    finally:
        for c in reversed(children):
            c.stop()


# The peer routers' arms (the SGLang router's two policies, SMG's priority scheduler).
PEERS = tuple(a for a in ARMS if a != "luftpause")


def _router_argv(
    router: _Router, port: int, workers: list[str], workdir: Path, config: Path | None = None
) -> list[str]:
    """The router's command line, serving on `port` in front of `workers` (luftpause:
    with `config`); SMG's classes file is written to `workdir`."""
    from luftpause.temporal_dev import free_port

    classes = workdir / "smg-classes.yaml"
    classes.write_text(SMG_CLASSES, encoding="utf-8")
    values = {
        "port": str(port),
        "prom": str(free_port()),
        "config": str(config),
        "smg_classes": str(classes),
    }
    return _fill(router.argv, values, workers)


def peer_missing(name: str) -> str | None:
    """Why peer router `name` cannot start here, or None."""
    return _missing(_routers(Path(sys.executable).parent)[name])


def peer_router(
    name: str, port: int, workers: list[str], workdir: Path
) -> tuple[list[str], Callable[[str, list[str]], None] | None]:
    """How `luftpause bench overhead` starts peer router `name` (see `peer_missing`)
    on `port` in front of `workers`, as the flood's arms do: its argv, and what to do
    once it answers `/health` (SMG: register the workers), or None."""
    router = _routers(Path(sys.executable).parent)[name]
    return _router_argv(router, port, workers, workdir), router.setup


def _missing(router: _Router) -> str | None:
    """Why the arm's router cannot start here, or None."""
    import importlib.util

    if not router.needs:
        return None
    if importlib.util.find_spec(router.needs) is not None:
        return None
    return f"{router.needs} is not installed (pip install -e '.[dev]' installs the peer routers)"


def _policy_toml(pairs: list[str]) -> str:
    """`--policy` pairs as the gateway config's [policy] table (the gateway checks them)."""
    if not pairs:
        return ""
    lines = ["[policy]"]
    for pair in pairs:
        name, value = pair.split("=", 1)
        try:
            float(value)
            text = value
        except ValueError:
            text = value.lower() if value.lower() in ("true", "false") else json.dumps(value)
        lines.append(f"{name.strip()} = {text}")
    return "\n".join(lines) + "\n"


def _names(text: str) -> list[str]:
    return [a.strip() for a in text.split(",") if a.strip()]


def _references(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The better one-class run of each class, named after the arm it went through."""
    out: dict[str, dict[str, Any]] = {}
    for cls, figure in (
        ("interactive-alone", "interactive_runs_per_min"),
        ("batch-alone", "batch_runs_per_min"),
    ):
        runs = {
            n.split("/", 1)[1]: r
            for n, r in results.items()
            if n.startswith(cls + "/") and "failed" not in r
        }
        if runs:
            arm = max(runs, key=lambda a: runs[a][figure])
            out[cls] = {**runs[arm], "arm": arm, "each": {a: r[figure] for a, r in runs.items()}}
    return out


def _measure(args: argparse.Namespace, progress: Callable[[str], None]) -> dict[str, Any]:
    from testkit.load import load_from_args, run_load
    from testkit.sim import ratio

    base = load_from_args(
        args,
        time_scale=args.time_scale,
        max_tool_calls=args.max_tool_calls,
        scripted_tools=bool(args.llama_server),
        model=_served_model(args),
    )
    routers = _routers(Path(sys.executable).parent)
    names = _names(args.arms)
    # --policy is the measured arm's; the references stay the default policy's, as in
    # the simulator's ablation (a variant's own references would flatter its P and W).
    plan = [_Arm(n, base, n, args.policy) for n in names]
    # P and W need both classes; with one class the arms are their own reference.
    if not args.no_reference and args.batch and args.interactive:
        for ref in _names(args.reference_arms):
            plan.append(_Arm(f"interactive-alone/{ref}", replace(base, batch=0), ref, []))
            plan.append(_Arm(f"batch-alone/{ref}", replace(base, interactive=0), ref, []))
    for arm in plan:
        missing = _missing(routers[arm.router])
        if missing:
            raise SystemExit(f"luftpause bench: arm {arm.name}: {missing}")
    results: dict[str, dict[str, Any]] = {}
    # Logs stay when an arm failed or saw errors (the path is printed), else go.
    tmp = Path(tempfile.mkdtemp(prefix="luftpause-bench-"))
    try:
        for arm in plan:
            router = routers[arm.router]
            log_dir = tmp / arm.name.replace("/", "-")
            log_dir.mkdir()
            progress(f"arm {arm.name} ({arm.router}): {arm.load.minutes:g} virtual min")
            t0 = time.monotonic()
            try:
                with _arm_bed(args, router, log_dir, arm.policy, arm.router == "luftpause") as bed:
                    load = run_load(
                        arm.load, bed.url, ends_runs=router.ends_runs, progress=progress
                    )
                    before, harness = bed.cpu(), time.process_time()
                    r = asyncio.run(load)
                    harness = time.process_time() - harness
                    bed.check_alive()
                    after = bed.cpu()
                    held = _held_seconds(bed.url) if arm.router == "luftpause" else None
            except Exception as exc:  # one arm's failure loses neither the others nor its logs
                results[arm.name] = {"failed": f"{type(exc).__name__}: {exc}", "logs": str(log_dir)}
                progress(f"  FAILED: {exc} (logs: {log_dir})")
                continue
            row = r.as_json()
            row["router"] = arm.router
            row["wall_s"] = round(time.monotonic() - t0, 1)
            # CPU seconds during the load: what each part needed of the two vCPUs.
            row["cpu_s"] = {k: _spent(before[k], after[k]) for k in after} | {
                "load": round(harness, 1)
            }
            if held is not None:
                row["held"] = held
            if bed.slots is not None:
                row["slots"] = bed.slots
            if row["errors"]:
                row["logs"] = str(log_dir)
            results[arm.name] = row
            progress(
                f"  done: {row['interactive_runs_per_min']} interactive/min, "
                f"{row['batch_runs_per_min']} batch/min, {row['errors']} errors"
            )
    except BaseException:  # a SIGTERM or ^C: its logs stay, and it says where
        progress(f"stopped; logs kept in {tmp}")
        raise
    if any("logs" in r for r in results.values()):
        progress(f"logs kept in {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    out: dict[str, Any] = {
        "scenario": args.scenario,
        "load": {k: v for k, v in vars(base).items()},
        "engines": args.engines,
        "luftpause_policy": args.policy,
        "arms": {n: results[n] for n in names},
        "reference": _references(results),
        "failed": {n: r["failed"] for n, r in results.items() if "failed" in r},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "note": "real routers and real HTTP on loopback; the engines are simulated in real "
        "time (half a GPU each, no GPU here); compare arms within one run",
    }
    if args.llama_server:
        out["llama_server"] = {
            "model": Path(args.llama_model).name,
            "slots": _slots(args),
            "threads_each": args.engine_threads,
            "context_per_slot": args.context_per_slot,
            "version": _llama_version(args.llama_server),
        }
        out["note"] = (
            "real routers and real HTTP on loopback; the engines are llama.cpp servers on "
            "this machine's CPUs, which the harness and the proxies share; the agents decide "
            "the tool calls, the model writes them as JSON; compare arms within one run"
        )
    if args.time_scale != 1:
        out["note"] += (
            f"; at time scale {args.time_scale:g} the proxies' own clocks (probe periods, "
            "queue timeouts, KV retention) and CPU time do not scale: this run checks the "
            "bench, it does not compare the proxies"
        )
    ia = out["reference"].get("interactive-alone", {}).get("interactive_runs_per_min")
    ba = out["reference"].get("batch-alone", {}).get("batch_runs_per_min")
    measured = {n: r for n, r in out["arms"].items() if "failed" not in r}
    for name, row in measured.items():
        i, b = row["interactive_runs_per_min"], row["batch_runs_per_min"]
        if ia is not None and ba is not None:
            row["P"] = ratio(i, ia)
            row["W"] = ratio(i + b, ba)
        row["ratios"] = {
            other: {
                "interactive": ratio(i, o["interactive_runs_per_min"]),
                "batch": ratio(b, o["batch_runs_per_min"]),
            }
            for other, o in measured.items()
            if other != name
        }
    return out


def _llama_version(exe: str) -> str:
    """What `llama-server --version` says of itself (its first line), or why not."""
    import subprocess

    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
    except OSError as exc:
        return f"unknown ({exc})"
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.startswith("version")]
    return lines[0] if lines else "unknown"


def _table(r: dict[str, Any]) -> str:
    load = r["load"]
    llama = r.get("llama_server")
    engines = (
        f"{r['engines']} llama-servers (slots {llama['slots']}, {llama['model']})"
        if llama
        else f"{r['engines']} engines"
    )
    lines = [
        f"luftpause bench {r['scenario']}: {load['batch']} batch + {load['interactive']} "
        f"interactive agents, {engines}, {load['context_chars']}-char contexts, "
        f"{load['minutes']:g} virtual min per arm (time scale {load['time_scale']:g})",
        f"{'arm':<30} {'int/min':>8} {'int p50 s':>10} {'int p90 s':>10} {'batch/min':>10} "
        f"{'cached':>7} {'P':>6} {'W':>6} {'errors':>7} {'CPU s: proxy':>12} {'engines':>8}",
    ]
    rows = list(r["arms"].items()) + [
        (f"{name} ({a['arm']})", a) for name, a in r["reference"].items()
    ]

    def f(x: Any) -> str:
        return "-" if x is None else f"{x:g}"

    for name, a in rows:
        if "failed" in a:
            lines.append(f"{name:<30} FAILED: {a['failed']} (logs: {a['logs']})")
            continue
        lines.append(
            f"{name:<30} {f(a['interactive_runs_per_min']):>8} {f(a['interactive_p50_s']):>10} "
            f"{f(a['interactive_p90_s']):>10} {f(a['batch_runs_per_min']):>10} "
            f"{a['cached_prompt_token_share']:>7.3f} {f(a.get('P')):>6} {f(a.get('W')):>6} "
            f"{a['errors']:>7} {f(a['cpu_s']['proxy']):>12} {f(a['cpu_s']['engines']):>8}"
        )
    lines.append(r["note"])
    return "\n".join(lines)


def _llama_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the real-engine flags, or None."""
    if not args.llama_model:
        return "--llama-server needs --llama-model GGUF"
    for flag, path in (("--llama-server", args.llama_server), ("--llama-model", args.llama_model)):
        if not Path(path).is_file():
            return f"{flag} {path}: no such file"
    if args.time_scale != 1:
        return "a real engine runs only in real time: --time-scale must be 1"
    if args.context_per_slot < 256 or args.engine_threads < 1:
        return "--context-per-slot must be >= 256 and --engine-threads >= 1"
    try:
        _slots(args)
    except ValueError as exc:
        return str(exc)
    return None


def run(args: argparse.Namespace) -> int:
    unknown = [a for a in _names(args.arms) + _names(args.reference_arms) if a not in ARMS]
    if unknown or not _names(args.arms):
        bad = ", ".join(unknown) or "(none)"
        print(f"luftpause bench: unknown arm {bad}; arms are {', '.join(ARMS)}", file=sys.stderr)
        return 2
    if not 0 < args.minutes < math.inf or args.engines < 1 or not 0 < args.time_scale < math.inf:
        print("luftpause bench: --minutes, --engines and --time-scale must be > 0", file=sys.stderr)
        return 2
    if args.batch < 0 or args.interactive < 0 or args.batch + args.interactive == 0:
        print("luftpause bench: needs at least one agent", file=sys.stderr)
        return 2
    if args.llama_server:
        problem = _llama_problem(args)
        if problem:
            print(f"luftpause bench: {problem}", file=sys.stderr)
            return 2
    bad_policy = [p for p in args.policy if "=" not in p or not p.split("=", 1)[0].strip()]
    if bad_policy:
        print(f"luftpause bench: --policy wants NAME=VALUE, got {bad_policy[0]!r}", file=sys.stderr)
        return 2
    for flag in ("arms", "reference_arms"):
        names = _names(getattr(args, flag))
        if len(set(names)) != len(names):
            print(
                f"luftpause bench: --{flag.replace('_', '-')} names an arm twice", file=sys.stderr
            )
            return 2

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds: every arm's processes are stopped by PID

    signal.signal(signal.SIGTERM, stop)
    result = _measure(args, progress)
    print(json.dumps(result, indent=2) if args.json else _table(result))
    return 1 if result["failed"] else 0
