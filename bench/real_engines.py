"""Interactive turns behind a burst of batch turns, on real llama.cpp servers: sent
to the engines directly (or through a router) against sent through luftpause.

    .venv/bin/python -m bench.real_engines --llama-server PATH --model GGUF \\
        [--slots 3,2] [--router sglang] [--batch 10] [--interactive 2] [--rounds 3]

Starts one llama-server per `--slots` entry (`--parallel N`, one thread each), and,
with `--router sglang`, the SGLang router (round robin) in front of them.  Each round
runs both arms, the order alternating:

- `direct`: the turns go to the router, or (no router) to the engines in turn; a turn
  past an engine's slots waits in its first-come queue;
- `luftpause`: the turns go to `luftpause gateway` (this checkout), whose file names
  the engines (or the router, with the engines as its `load_from`) and gives no
  `slots`: the gateway asks the engines (llama.cpp's `/props`), and holds the turns
  past them in its own order, interactive first.

The workload: `--batch` batch turns sent at once, then, `--interactive-after-s` later
(the engines full), `--interactive` interactive turns; each asks for a fixed number of
tokens (`ignore_eos`).  Reported per arm (medians over rounds): the interactive and
batch turns' seconds, the burst's makespan, the most turns the engines had waiting in
their queues (`llamacpp:requests_deferred`, sampled every 0.1 s) and, for luftpause,
the most it held.  The engines, the router, the gateway and this harness share the
machine's CPUs: compare the arms of one run with each other.  Every process started
here is stopped by its PID when the run ends.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from luftpause._process import spawn, terminate
from luftpause.temporal_dev import free_port
from testkit.bench_agents import llama_server_argv

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smol"
READY_S = 60.0


class _Procs:
    """The processes of a run, each stopped by its PID at the end."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.started: list[subprocess.Popen[bytes]] = []

    def start(
        self, name: str, argv: list[str], ready: str, env: dict[str, str] | None = None
    ) -> None:
        with (self.logs / f"{name}.log").open("wb") as log:  # the child keeps its own copy
            proc = spawn(argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.logs, env=env)
        self.started.append(proc)
        deadline = time.monotonic() + READY_S
        while not _answers(ready):
            if proc.poll() is not None:
                raise SystemExit(f"{name} exited at start; see {self.logs / name}.log")
            if time.monotonic() > deadline:
                raise SystemExit(f"{name} did not answer {ready} in {READY_S:g} s")
            time.sleep(0.1)

    def stop(self, n: int | None = None) -> None:
        """Stop the last `n` started (None: all), newest first."""
        for _ in range(len(self.started) if n is None else n):
            terminate(self.started.pop(), timeout=10)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code < 500
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def _bed(args: argparse.Namespace, logs: Path) -> Iterator[tuple[_Procs, list[str], str | None]]:
    procs = _Procs(logs)
    try:
        engines = []
        for i, slots in enumerate(args.slots):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            argv = llama_server_argv(
                args.llama_server, args.model, MODEL, port, slots, args.context_per_slot, 1
            )
            procs.start(f"engine{i}", argv, url + "/health")
            engines.append(url)
        router = None
        if args.router == "sglang":
            port = free_port()
            router = f"http://127.0.0.1:{port}"
            procs.start(
                "router",
                [
                    sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                    "--port", str(port), "--policy", "round_robin",
                    "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                    "--worker-urls", *engines,
                ],
                router + "/health",
            )  # fmt: skip
        yield procs, engines, router
    finally:
        procs.stop()


def _config(engines: list[str], router: str | None) -> str:
    text = "".join(
        f'[[endpoints]]\nname = "e{i}"\nurl = "{url}"\nkind = "llamacpp"\nmodels = ["{MODEL}"]\n'
        for i, url in enumerate(engines)
    )
    if router is not None:
        behind = ", ".join(f'"e{i}"' for i in range(len(engines)))
        text += (
            f'[[endpoints]]\nname = "router"\nurl = "{router}"\nkind = "router"\n'
            f'models = ["{MODEL}"]\nload_from = [{behind}]\n'
        )
    return text


async def _deferred(client: httpx.AsyncClient, engines: list[str]) -> int:
    total = 0
    for url in engines:
        text = (await client.get(url + "/metrics")).text
        for line in text.splitlines():
            if line.startswith("llamacpp:requests_deferred"):
                total += int(float(line.split()[-1]))
    return total


async def _burst(
    args: argparse.Namespace, targets: list[str], engines: list[str], gateway: str | None
) -> dict[str, Any]:
    """The workload once: batch turns, then interactive turns; seconds per turn and the
    queues seen meanwhile."""
    async with httpx.AsyncClient(timeout=600) as client:

        async def turn(i: int, cls: str, tokens: int) -> float:
            body = {
                "model": MODEL,
                "max_tokens": tokens,
                "ignore_eos": True,
                "temperature": 0,
                "messages": [{"role": "user", "content": f"Turn {cls} {i}: tell a story."}],
            }
            t0 = time.monotonic()
            r = await client.post(
                targets[i % len(targets)] + "/v1/chat/completions",
                json=body,
                headers={"x-luftpause-class": cls, "x-luftpause-caller": cls},
            )
            if r.status_code != 200:
                raise RuntimeError(f"{cls} turn {i}: {r.status_code} {r.text[:200]}")
            return time.monotonic() - t0

        peak = {"deferred": 0, "held": 0}
        done = asyncio.Event()

        async def sample() -> None:
            while not done.is_set():
                peak["deferred"] = max(peak["deferred"], await _deferred(client, engines))
                if gateway is not None:
                    held = (await client.get(gateway + "/status")).json()["held"]["total"]
                    peak["held"] = max(peak["held"], held)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), 0.1)

        sampler = asyncio.create_task(sample())
        t0 = time.monotonic()
        batch = [
            asyncio.create_task(turn(i, "batch", args.batch_tokens)) for i in range(args.batch)
        ]
        await asyncio.sleep(args.interactive_after_s)  # the workload's offset, not a wait for state
        interactive = [
            asyncio.create_task(turn(i, "interactive", args.interactive_tokens))
            for i in range(args.interactive)
        ]
        i_s = await asyncio.gather(*interactive)
        b_s = await asyncio.gather(*batch)
        makespan = time.monotonic() - t0
        done.set()
        await sampler
    return {
        "interactive_s": statistics.median(i_s),
        "interactive_max_s": max(i_s),
        "batch_s": statistics.median(b_s),
        "makespan_s": makespan,
        "peak_engine_deferred": peak["deferred"],
        "peak_held": peak["held"] if gateway is not None else None,
    }


def _arm(
    args: argparse.Namespace, arm: str, bed: tuple[_Procs, list[str], str | None], logs: Path
) -> dict[str, Any]:
    procs, engines, router = bed
    if arm == "direct":
        return asyncio.run(_burst(args, [router] if router else engines, engines, None))
    config = logs / "luftpause.toml"
    config.write_text(_config(engines, router))
    port = free_port()
    gateway = f"http://127.0.0.1:{port}"
    exe = str(Path(sys.executable).parent / "luftpause")
    # Its own file and no token: the caller's environment must not point it elsewhere.
    env = {k: v for k, v in os.environ.items() if k not in ("LUFTPAUSE_CONFIG", "LUFTPAUSE_TOKEN")}
    argv = [exe, "gateway", "--config", str(config), "--port", str(port)]
    procs.start("gateway", argv, gateway + "/health", env=env)
    try:
        expected = (
            {"router": sum(args.slots)}
            if router
            else {f"e{i}": n for i, n in enumerate(args.slots)}
        )
        slots = _slots_known(gateway, expected)
        result = asyncio.run(_burst(args, [gateway], engines, gateway))
        return {**result, "slots": slots}
    finally:
        procs.stop(1)


def _slots_known(gateway: str, expected: dict[str, int]) -> dict[str, int | None]:
    """The slots the gateway learnt from the engines (it asks at its probes, within a
    few seconds), once they are the engines' `--parallel` (or, for the router, their
    sum); else the run stops: it would not measure what it says."""
    deadline = time.monotonic() + 30
    while True:
        replicas = httpx.get(gateway + "/status").raise_for_status().json()["replicas"]
        slots = {r["name"]: r["slots"] for r in replicas}
        if slots == expected:
            return slots
        if time.monotonic() > deadline:
            raise SystemExit(f"the gateway's slots are {slots}, not the engines' {expected}")
        time.sleep(0.2)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    arms = ["direct", "luftpause"]
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="real-engines-"))
    logs.mkdir(parents=True, exist_ok=True)
    try:
        with _bed(args, logs) as bed:
            # One unmeasured burst through each arm first: else the first arm alone
            # meets cold engines and an empty prompt cache (every later round's prompts
            # are the same).
            for arm in arms:
                print(f"warm-up {arm}: {_arm(args, arm, bed, logs)}", file=sys.stderr)
            for r in range(args.rounds):
                for arm in arms if r % 2 == 0 else arms[::-1]:
                    runs[arm].append(_arm(args, arm, bed, logs))
                    print(f"round {r + 1} {arm}: {runs[arm][-1]}", file=sys.stderr)
    except BaseException:
        print(f"bench.real_engines: the processes' logs are in {logs}", file=sys.stderr)
        raise
    if not args.logs:
        shutil.rmtree(logs, ignore_errors=True)
    keys = ["interactive_s", "interactive_max_s", "batch_s", "makespan_s", "peak_engine_deferred"]
    out: dict[str, Any] = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "engines": {"slots": args.slots, "router": args.router, "model": Path(args.model).name},
        "workload": {
            k: getattr(args, k)
            for k in (
                "batch",
                "batch_tokens",
                "interactive",
                "interactive_tokens",
                "interactive_after_s",
            )
        },
        "rounds": args.rounds,
        "arms": {},
    }
    for arm in arms:
        med = {k: round(statistics.median(x[k] for x in runs[arm]), 2) for k in keys}
        if arm == "luftpause":
            med["peak_held"] = statistics.median(x["peak_held"] for x in runs[arm])
            med["slots"] = runs[arm][-1]["slots"]
        out["arms"][arm] = {**med, "runs": runs[arm]}
    d, lp = out["arms"]["direct"], out["arms"]["luftpause"]
    out["interactive_speedup"] = round(d["interactive_s"] / lp["interactive_s"], 2)
    out["makespan_ratio"] = round(lp["makespan_s"] / d["makespan_s"], 2)
    return out


def table(r: dict[str, Any]) -> str:
    e, w = r["engines"], r["workload"]
    lines = [
        f"llama-server x{len(e['slots'])} (slots {e['slots']}, {e['model']}), router: "
        f"{e['router']}; {w['batch']} batch turns of {w['batch_tokens']} tokens, then "
        f"{w['interactive']} interactive of {w['interactive_tokens']}; {r['rounds']} rounds; "
        f"{r['machine']}",
        f"{'arm':<10} {'int p50 s':>10} {'int max s':>10} {'batch p50 s':>12} {'makespan s':>11} "
        f"{'engine queue':>13} {'held':>5}",
    ]
    for arm, a in r["arms"].items():
        held = a.get("peak_held")
        lines.append(
            f"{arm:<10} {a['interactive_s']:>10.2f} {a['interactive_max_s']:>10.2f} "
            f"{a['batch_s']:>12.2f} {a['makespan_s']:>11.2f} {a['peak_engine_deferred']:>13} "
            f"{'-' if held is None else held:>5}"
        )
    lines.append(
        f"interactive turns {r['interactive_speedup']}x faster through luftpause; "
        f"makespan {r['makespan_ratio']}x"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.real_engines", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--llama-server", required=True, help="path of the llama-server binary")
    p.add_argument("--model", required=True, help="a GGUF file (e.g. SmolLM2-135M-Instruct)")
    p.add_argument("--slots", default="3,2", type=lambda s: [int(x) for x in s.split(",")],
                   help="each engine's --parallel, comma-separated (default 3,2)")  # fmt: skip
    p.add_argument("--router", choices=["none", "sglang"], default="none")
    p.add_argument("--context-per-slot", type=int, default=1024)
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--batch-tokens", type=int, default=64)
    p.add_argument("--interactive", type=int, default=2)
    p.add_argument("--interactive-tokens", type=int, default=16)
    p.add_argument("--interactive-after-s", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--logs", help="keep the processes' logs in this directory")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.router == "none":
        args.router = None
    report = measure(args)
    print(json.dumps(report, indent=2) if args.json else table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
