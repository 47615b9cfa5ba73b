"""How long the gateway's event loop stands still for the garbage collector under load,
with its startup heap frozen (`luftpause gateway` as shipped) and without.

    .venv/bin/python -m bench.gc_pauses [--requests 20000] [--concurrency 20] [--rounds 3]

Starts `luftpause fake-engine --instant` and two gateways of this checkout on free
loopback ports: `frozen` as shipped, and `unfrozen` with `gc.freeze` made a no-op (the
only difference).  Each round drives every arm with hey in turn (the order rotates), after
500 unmeasured requests per gateway.  The pauses come from each gateway's own
`luftpause_gc_pause_seconds` (scraped before and after each hey run); latencies from hey's
CSV.  Prints a table, or one JSON object with `--json`.  Every process is stopped by PID.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from testkit.overhead import (
    MODEL,
    ROOT,
    Arm,
    _Children,
    _free_port,
    _hey,
    _machine,
    _per_round,
    _sigterm_unwinds,
    _Stopped,
    _wait_healthy,
)

ARMS = ("frozen", "unfrozen")
_BUCKETS = ("0.01", "0.05", "0.1")  # pauses longer than these are counted


def _serve(argv: list[str]) -> int:
    """The gateway process of an arm: `unfrozen` keeps every object in the collector's
    reach."""
    import gc

    from luftpause.cli import main

    arm, *rest = argv
    if arm == "unfrozen":
        gc.freeze = lambda: None
    sys.argv = ["luftpause", *rest]
    return main()


def _gc(port: int) -> dict[str, float]:
    """The gateway's full-collection pauses so far: count, seconds, and how many were
    longer than each of _BUCKETS."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("generation") != "2" or not s.name.startswith("luftpause_gc_"):
                continue
            if s.name.endswith("_count"):
                out["count"] = s.value
            elif s.name.endswith("_sum"):
                out["seconds"] = s.value
            elif s.name.endswith("_bucket") and s.labels["le"] in _BUCKETS:
                out[f"le_{s.labels['le']}"] = s.value
        if family.name == "luftpause_gc_frozen_objects":
            out["frozen_objects"] = family.samples[0].value
    for le in _BUCKETS:
        out[f"over_{le}"] = out.get("count", 0.0) - out.pop(f"le_{le}", 0.0)
    return out


def _measure(args: argparse.Namespace, hey: str, workdir: Path, children: _Children) -> Any:
    env = {k: v for k, v in os.environ.items() if k not in ("LUFTPAUSE_TOKEN", "PYTHONPATH")}
    root = ROOT  # this checkout's code (python -m runs it from the working directory)
    engine_port = _free_port()
    engine = children.start(
        "engine",
        [sys.executable, "-m", "luftpause", "fake-engine", "--instant"]
        + ["--port", str(engine_port)],
        cwd=root,
        env=env,
    )
    config = workdir / "luftpause.toml"
    config.write_text(
        f'[[endpoints]]\nname = "fake"\nurl = "http://127.0.0.1:{engine_port}"\n'
        f'kind = "sglang"\nmodels = ["{MODEL}"]\n'
    )
    ports = {arm: _free_port() for arm in ARMS}
    started = [(engine, engine_port)]
    for arm, port in ports.items():
        argv = [sys.executable, "-m", "bench.gc_pauses", "--serve", arm, "gateway"]
        argv += ["--config", str(config), "--port", str(port)]
        started.append((children.start(arm, argv, cwd=root, env=env), port))
    _wait_healthy(started)
    body = workdir / "body.json"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
    body.write_text(json.dumps(chat))
    url = {arm: f"http://127.0.0.1:{port}" for arm, port in ports.items()}
    for arm in ARMS:
        _hey(hey, url[arm], body, requests=500, concurrency=args.concurrency)
    requests = _per_round(args.requests, 1, args.concurrency)  # hey drops a remainder
    lat = {arm: Arm(arm, False, args.concurrency) for arm in ARMS}
    gc_total: dict[str, dict[str, float]] = {arm: {} for arm in ARMS}
    frozen: dict[str, float] = {}
    for i in range(args.rounds):
        for arm in ARMS[i % 2 :] + ARMS[: i % 2]:
            before = _gc(ports[arm])
            csv_text = _hey(hey, url[arm], body, requests=requests, concurrency=args.concurrency)
            after = _gc(ports[arm])
            lat[arm].add(requests, csv_text, 0.0)
            for k, v in after.items():
                if k == "frozen_objects":
                    frozen[arm] = v
                else:
                    gc_total[arm][k] = gc_total[arm].get(k, 0.0) + v - before.get(k, 0.0)
    arms = []
    for arm in ARMS:
        r, g = lat[arm].report(), gc_total[arm]
        count = g.get("count", 0.0)
        arms.append(
            {
                "arm": arm,
                "frozen_objects": frozen.get(arm, 0.0),
                "requests": r["requests"],
                "errors": r["errors"],
                "full_collections": int(count),
                "full_gc_ms": round(g.get("seconds", 0.0) * 1000, 1),
                "mean_full_pause_ms": round(g["seconds"] / count * 1000, 1) if count else None,
                **{
                    f"pauses_over_{int(float(le) * 1000)}ms": int(g[f"over_{le}"])
                    for le in _BUCKETS
                },
                "p50_ms": r["p50_ms"],
                "p99_ms": r["p99_ms"],
                "max_ms": r["max_ms"],
                "req_per_s": r["req_per_s"],
            }
        )
    return {
        "machine": _machine(),
        "requests_per_round": requests,
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "arms": arms,
    }


def _table(result: dict[str, Any]) -> str:
    head = f"{'arm':<9} {'frozen':>8} {'full GCs':>8} {'mean ms':>8} {'>50 ms':>7}"
    head += f" {'>100 ms':>8} {'GC ms':>7} {'p99 ms':>7} {'max ms':>7} {'req/s':>7}"
    lines = [head, "-" * len(head)]
    for a in result["arms"]:
        mean = a["mean_full_pause_ms"]
        lines.append(
            f"{a['arm']:<9} {a['frozen_objects']:>8,.0f} {a['full_collections']:>8} "
            f"{mean if mean is not None else '-':>8} {a['pauses_over_50ms']:>7} "
            f"{a['pauses_over_100ms']:>8} {a['full_gc_ms']:>7} {a['p99_ms']:>7} "
            f"{a['max_ms']:>7} {a['req_per_s']:>7,.0f}"
        )
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        return _serve(sys.argv[2:])
    parser = argparse.ArgumentParser(prog="python -m bench.gc_pauses", description=__doc__)
    parser.add_argument("--requests", type=int, default=20_000, help="per arm and round")
    parser.add_argument("--concurrency", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    hey = shutil.which("hey")
    if hey is None:
        print("hey not found on PATH; install it: apt-get install hey", file=sys.stderr)
        return 2
    # A SIGTERM unwinds too, so hey (which subprocess.run kills on the way out) and the
    # servers are stopped and the directory removed.
    with tempfile.TemporaryDirectory(prefix="luftpause-gc-") as tmp, _sigterm_unwinds():
        children = _Children(Path(tmp))
        try:
            result = _measure(args, hey, Path(tmp), children)
        except (KeyboardInterrupt, _Stopped):
            print("bench.gc_pauses: interrupted; stopping what it started", file=sys.stderr)
            return 130
        finally:
            children.stop_all()
    print(json.dumps(result, indent=2) if args.json else _table(result))
    return 0 if all(a["errors"] == 0 for a in result["arms"]) else 1


if __name__ == "__main__":
    sys.exit(main())
