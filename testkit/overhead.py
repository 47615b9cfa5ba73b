"""`luftpause bench overhead` — the latency the gateway adds over going straight to an
engine that answers at once.

It starts `luftpause fake-engine --instant` and `luftpause gateway` as subprocesses on
free loopback ports and drives both with hey (Go, one binary; the direct arm's rate,
printed beside the gateway's, shows it is not the bottleneck).  Arms: direct vs gateway
x concurrency levels x {plain, stream}.  The requests of every arm are split into
rounds, and each round runs every arm of a cell back to back in a rotating order, so
the shared machine's noise falls on all arms alike.  Percentiles come from hey's
per-request CSV, not its summary.  Every process started here is stopped by its PID
(SIGTERM, then SIGKILL after a timeout), also on Ctrl-C, SIGTERM or an error.

`--baseline DIR` adds a third arm: a gateway run from another checkout (for instance
`git worktree add /tmp/wt HEAD`), so before and after a change are measured in one run.
`--peers cache_aware,smg_priority` adds the peer routers in front of the same engine,
started as `luftpause bench flood` starts them (the SGLang router's policies, SMG's
priority scheduler): what each adds is measured in the same rounds as the gateway.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import http.client
import io
import json
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from luftpause import native
from luftpause._process import cpu_seconds, spawn
from testkit.bench_agents import PEERS, peer_missing, peer_router

__all__ = ["GOAL_C1_P50_MS", "GOAL_C20_P99_MS", "Arm", "add_arguments", "percentile", "run"]

MODEL = "llama-3.2-1b"
ROOT = native.ROOT  # the checkout this runs from
# The goal: added p50 one at a time, added p99 at 20 concurrent.
GOAL_C1_P50_MS = 1.0
GOAL_C20_P99_MS = 5.0
# Bounds: startup of both servers, one hey run, hey's per-request timeout, a stop.
START_TIMEOUT_S = 60.0
HEY_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 20
STOP_TIMEOUT_S = 10.0
MAX_REQUESTS = 1_000_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `luftpause bench overhead`."""
    parser.add_argument(
        "--requests", type=int, default=2000, help="measured requests per arm (default 2000)"
    )
    parser.add_argument(
        "--concurrency",
        default="1,20",
        help="comma-separated concurrency levels (default 1,20)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="split each arm's requests into this many alternating rounds (default 4)",
    )
    parser.add_argument(
        "--warmup", type=int, default=200, help="unmeasured requests per arm first (default 200)"
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="reply tokens (default 16)")
    parser.add_argument(
        "--baseline",
        metavar="DIR",
        help="also measure a gateway run from this checkout (e.g. a git worktree of HEAD)",
    )
    parser.add_argument(
        "--peers",
        default="",
        help="also measure these routers in front of the same engine, comma-separated, of "
        "cache_aware, round_robin (the SGLang router), smg_priority (SMG)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


# --------------------------------------------------------------------------- statistics


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of values sorted ascending."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


@dataclass
class Arm:
    """One path x body x concurrency, accumulated over its rounds."""

    path: str
    stream: bool
    concurrency: int
    latencies_s: list[float] = field(default_factory=list)
    status: dict[str, int] = field(default_factory=dict)
    sent: int = 0
    busy_s: float = 0.0
    server_cpu_s: float = 0.0

    def add(self, sent: int, csv_text: str, server_cpu_s: float) -> None:
        """Add one hey run: `sent` requests, hey's `-o csv` output, and the CPU time the
        server process (engine or gateway) used meanwhile."""
        self.sent += sent
        self.server_cpu_s += server_cpu_s
        end = 0.0
        for row in csv.DictReader(io.StringIO(csv_text)):
            latency = float(row["response-time"])
            code = row["status-code"]
            if code == "200":  # a burst of fast errors would flatter the latency
                self.latencies_s.append(latency)
            self.status[code] = self.status.get(code, 0) + 1
            end = max(end, float(row["offset"]) + latency)
        self.busy_s += end

    def report(self) -> dict[str, Any]:
        lat = sorted(self.latencies_s)
        ok = self.status.get("200", 0)
        return {
            "path": self.path,
            "stream": self.stream,
            "concurrency": self.concurrency,
            "requests": self.sent,
            "ok": ok,
            # Transport errors leave no CSV row; any status but 200 is an error too.
            "errors": self.sent - ok,
            "status": dict(sorted(self.status.items())),
            "p50_ms": round(percentile(lat, 50) * 1000, 3),
            "p99_ms": round(percentile(lat, 99) * 1000, 3),
            # Latencies and the rate are the 200s'.  The slowest: a stall of the process
            # (a full garbage collection) shows here.
            "max_ms": round(lat[-1] * 1000, 3) if lat else math.nan,
            "mean_ms": round(sum(lat) / len(lat) * 1000, 3) if lat else math.nan,
            "req_per_s": round(len(lat) / self.busy_s, 1) if self.busy_s else 0.0,
            # CPU of the process answering hey (the engine direct, else the gateway).
            "server_cpu_ms_per_req": round(self.server_cpu_s / self.sent * 1000, 3),
        }


# --------------------------------------------------------------------------- processes


class _Stopped(Exception):
    """SIGTERM arrived: unwind so every child is stopped."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class _Child:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""


class _Children:
    """The processes this run started; `stop_all` ends each by its PID."""

    def __init__(self, workdir: Path) -> None:
        self._workdir = workdir
        self.started: list[_Child] = []

    def start(self, name: str, argv: list[str], *, cwd: Path, env: dict[str, str]) -> _Child:
        log = self._workdir / f"{name}.log"
        with log.open("wb") as out:
            proc = spawn(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        child = _Child(name, proc, log)
        self.started.append(child)
        return child

    def stop_all(self) -> None:
        for child in self.started:
            if child.proc.poll() is None:
                child.proc.terminate()
        for child in self.started:
            try:
                child.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (0 where /proc is missing)."""
    return cpu_seconds(pid) or 0.0


def _healthy(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def _wait_healthy(children: Sequence[tuple[_Child, int]]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    pending = list(children)
    while pending:
        for child, port in list(pending):
            if child.proc.poll() is not None:
                raise RuntimeError(f"{child.name} exited at start:\n{child.tail()}")
            if _healthy(port):
                pending.remove((child, port))
        if pending and time.monotonic() > deadline:
            names = ", ".join(c.name for c, _ in pending)
            raise RuntimeError(f"not healthy within {START_TIMEOUT_S:.0f} s: {names}")
        if pending:
            time.sleep(0.05)


# --------------------------------------------------------------------------- hey


def _hey(hey: str, url: str, body: Path, *, requests: int, concurrency: int) -> str:
    argv = [hey, "-n", str(requests), "-c", str(concurrency), "-m", "POST"]
    argv += ["-T", "application/json", "-D", str(body), "-t", str(REQUEST_TIMEOUT_S)]
    argv += ["-o", "csv", url + "/v1/chat/completions"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=HEY_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"hey failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return done.stdout


def _per_round(requests: int, rounds: int, concurrency: int) -> int:
    """Requests per hey run: a multiple of the concurrency (hey drops the remainder)."""
    n = math.ceil(requests / rounds)
    return max(concurrency, math.ceil(n / concurrency) * concurrency)


# --------------------------------------------------------------------------- the run


def _parse_levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--concurrency: expected integers, got {text!r}") from None
    if not levels or any(c < 1 or c > 1000 for c in levels):
        raise SystemExit("--concurrency: levels between 1 and 1000")
    return levels


def _machine() -> dict[str, Any]:
    cpu = platform.processor() or ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"nproc": os.cpu_count(), "cpu": cpu, "python": platform.python_version()}


def _added(arms: list[dict[str, Any]]) -> list[dict[str, Any]]:
    direct = {(a["stream"], a["concurrency"]): a for a in arms if a["path"] == "direct"}
    out = []
    for a in arms:
        base = direct.get((a["stream"], a["concurrency"]))
        if a["path"] == "direct" or base is None:
            continue
        out.append(
            {
                "path": a["path"],
                "stream": a["stream"],
                "concurrency": a["concurrency"],
                "added_p50_ms": round(a["p50_ms"] - base["p50_ms"], 3),
                "added_p99_ms": round(a["p99_ms"] - base["p99_ms"], 3),
                "rate_vs_direct": round(a["req_per_s"] / base["req_per_s"], 3)
                if base["req_per_s"]
                else None,
            }
        )
    return out


def _goal(added: list[dict[str, Any]]) -> dict[str, Any]:
    gw = [a for a in added if a["path"] == "gateway"]
    c1 = [a["added_p50_ms"] for a in gw if a["concurrency"] == 1]
    c20 = [a["added_p99_ms"] for a in gw if a["concurrency"] == 20]
    met = None
    if c1 and c20:
        met = max(c1) <= GOAL_C1_P50_MS and max(c20) <= GOAL_C20_P99_MS
    return {
        "c1_added_p50_ms_max": GOAL_C1_P50_MS,
        "c20_added_p99_ms_max": GOAL_C20_P99_MS,
        "c1_added_p50_ms": max(c1) if c1 else None,
        "c20_added_p99_ms": max(c20) if c20 else None,
        "met": met,
    }


def _table(result: dict[str, Any]) -> str:
    head = f"{'path':<12} {'body':<6} {'c':>3} {'requests':>8} {'errors':>6}"
    head += f" {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'req/s':>8} {'cpu ms/req':>10}"
    lines = [head, "-" * len(head)]
    for a in result["arms"]:
        body = "stream" if a["stream"] else "plain"
        lines.append(
            f"{a['path']:<12} {body:<6} {a['concurrency']:>3} {a['requests']:>8} "
            f"{a['errors']:>6} {a['p50_ms']:>8.2f} {a['p99_ms']:>8.2f} {a['max_ms']:>8.2f}"
            f" {a['req_per_s']:>8,.0f}"
            f" {a['server_cpu_ms_per_req']:>10.3f}"
        )
    lines.append("")
    lines.append("added over direct (path − direct):")
    for d in result["added"]:
        body = "stream" if d["stream"] else "plain"
        rate = d["rate_vs_direct"]
        lines.append(
            f"  {d['path']:<12} {body:<6} c={d['concurrency']:<3} "
            f"p50 {d['added_p50_ms']:+8.2f} ms  p99 {d['added_p99_ms']:+8.2f} ms  "
            f"rate {rate if rate is not None else '-'}x direct"
        )
    g = result["goal"]
    verdict = {True: "met", False: "NOT met", None: "not measured (needs c=1 and c=20)"}
    lines.append("")
    lines.append(
        f"goal: ≤ {g['c1_added_p50_ms_max']:g} ms added p50 at c=1, "
        f"≤ {g['c20_added_p99_ms_max']:g} ms added p99 at c=20: {verdict[g['met']]}"
    )
    return "\n".join(lines)


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    def stop(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut cleanup
        raise _Stopped

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace) -> int:
    """Measure, print a table or JSON; 0 when every request was answered 200."""
    peers = _parse_peers(args.peers)
    hey = shutil.which("hey")
    if hey is None:
        print(
            "luftpause bench: hey not found on PATH; install it: apt-get install hey",
            file=sys.stderr,
        )
        return 2
    levels = _parse_levels(args.concurrency)
    if not (1 <= args.requests <= MAX_REQUESTS and 1 <= args.rounds <= 100):
        raise SystemExit(f"--requests 1..{MAX_REQUESTS}, --rounds 1..100")
    if not 0 <= args.warmup <= MAX_REQUESTS or args.max_tokens < 1:
        raise SystemExit(f"--warmup 0..{MAX_REQUESTS}, --max-tokens ≥ 1")
    baseline = Path(args.baseline).resolve() if args.baseline else None
    if baseline is not None and not (baseline / "gateway" / "app.py").is_file():
        raise SystemExit(f"--baseline {baseline}: not a luftpause checkout (no gateway/app.py)")

    with tempfile.TemporaryDirectory(prefix="luftpause-bench-") as tmp, _sigterm_unwinds():
        workdir = Path(tmp)
        children = _Children(workdir)
        try:
            result = _measure(args, hey, levels, baseline, peers, workdir, children)
        except (KeyboardInterrupt, _Stopped):
            print("luftpause bench: interrupted; stopping what it started", file=sys.stderr)
            return 130
        finally:
            children.stop_all()
        result["pids"] = {c.name: c.proc.pid for c in children.started}
        result["exit_codes"] = {c.name: c.proc.returncode for c in children.started}
    print(json.dumps(result, indent=2) if args.json else _table(result))
    return 0 if all(a["errors"] == 0 for a in result["arms"]) else 1


def _parse_peers(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    for name in names:
        if name not in PEERS:
            expected = ", ".join(PEERS)
            raise SystemExit(f"--peers: unknown router {name!r}; expected some of {expected}")
    if len(set(names)) != len(names):
        raise SystemExit(f"--peers: a router named twice in {text!r}")
    for name in names:
        missing = peer_missing(name)
        if missing:
            raise SystemExit(f"--peers: {name}: {missing}")
    return names


def _measure(
    args: argparse.Namespace,
    hey: str,
    levels: list[int],
    baseline: Path | None,
    peers: list[str],
    workdir: Path,
    children: _Children,
) -> dict[str, Any]:
    python = [sys.executable, "-m", "luftpause"]
    env = {k: v for k, v in os.environ.items() if k not in ("LUFTPAUSE_TOKEN", "PYTHONPATH")}
    # This checkout's code, not whichever checkout the environment's install maps.
    ours = {**env, "PYTHONPATH": str(ROOT)}
    engine_port = _free_port()
    engine = children.start(
        "engine",
        [*python, "fake-engine", "--flavor", "sglang", "--instant", "--port", str(engine_port)],
        cwd=workdir,
        env=ours,
    )
    config = workdir / "luftpause.toml"
    config.write_text(
        "[[endpoints]]\n"
        'name = "fake"\n'
        f'url = "http://127.0.0.1:{engine_port}"\n'
        'kind = "sglang"\n'
        f'models = ["{MODEL}"]\n'
    )
    gateways: dict[str, tuple[Path, dict[str, str]]] = {"gateway": (workdir, ours)}
    if baseline is not None:
        # `python -m` puts the working directory first on sys.path: the old code wins.
        gateways["baseline"] = (baseline, {**env, "PYTHONPATH": str(baseline)})
    ports = {"direct": engine_port}
    pids = {"direct": engine.proc.pid}
    started = [(engine, engine_port)]
    for name, (cwd, genv) in gateways.items():
        port = _free_port()
        argv = [*python, "gateway", "--config", str(config), "--port", str(port)]
        child = children.start(name, argv, cwd=cwd, env=genv)
        started.append((child, port))
        ports[name], pids[name] = port, child.proc.pid
    setups = []
    for name in peers:
        port = _free_port()
        workers = [f"http://127.0.0.1:{engine_port}"]
        argv, setup = peer_router(name, port, workers, workdir)
        child = children.start(name, argv, cwd=workdir, env=env)
        started.append((child, port))
        ports[name], pids[name] = port, child.proc.pid
        if setup is not None:
            setups.append((setup, f"http://127.0.0.1:{port}", workers))
    _wait_healthy(started)
    for setup, proxy, workers in setups:
        setup(proxy, workers)

    bodies = {}
    for stream in (False, True):
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": args.max_tokens,
            "stream": stream,
        }
        bodies[stream] = workdir / f"body-{'stream' if stream else 'plain'}.json"
        bodies[stream].write_text(json.dumps(body))
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    paths = list(urls)

    cells = [(stream, c) for stream in (False, True) for c in levels]
    arms = {(p, s, c): Arm(p, s, c) for s, c in cells for p in paths}
    if args.warmup:
        for stream, c in cells:
            for p in paths:
                n = max(c, args.warmup // c * c)
                _hey(hey, urls[p], bodies[stream], requests=n, concurrency=c)
    started_at = time.time()
    for r in range(args.rounds):
        for stream, c in cells:
            n = _per_round(args.requests, args.rounds, c)
            for i in range(len(paths)):
                p = paths[(i + r) % len(paths)]  # rotate who goes first
                cpu = _cpu_s(pids[p])
                out = _hey(hey, urls[p], bodies[stream], requests=n, concurrency=c)
                arms[(p, stream, c)].add(n, out, _cpu_s(pids[p]) - cpu)
    reports = [arms[(p, s, c)].report() for s, c in cells for p in paths]
    added = _added(reports)
    return {
        "scenario": "overhead",
        "command": " ".join(["luftpause", *sys.argv[1:]]),
        "machine": _machine(),
        "hey": hey,
        "date": time.strftime("%Y-%m-%d", time.localtime(started_at)),
        "seconds": round(time.time() - started_at, 1),
        "requests_per_arm": arms[(paths[0], *cells[0])].sent,
        "rounds": args.rounds,
        "warmup_per_arm": args.warmup,
        "max_tokens": args.max_tokens,
        "baseline": str(baseline) if baseline is not None else None,
        "peers": peers,
        "arms": reports,
        "added": added,
        "goal": _goal(added),
    }
