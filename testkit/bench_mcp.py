"""`luftpause bench mcp` — the latency of one MCP `tools/call` by protocol generation.

The official client calls `lookup` on the fake MCP server (answering at once) over
loopback, in each client mode, the modes interleaved call by call so noise falls on all
of them.  This is what every sub-agent tool call pays on top of the tool itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from typing import Any

__all__ = ["MODES", "add_arguments", "run"]

MODES = ("legacy", "2026-07-28")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--calls", type=int, default=50, help="measured calls per mode (50)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _measure(calls: int) -> dict[str, Any]:
    import contextlib

    from mcp import Client

    from testkit.fake_mcp import FakeMcpSettings, FakeMcpState, create_app
    from testkit.loopback import serve

    async with contextlib.AsyncExitStack() as stack:
        url = await stack.enter_async_context(
            serve(create_app(FakeMcpSettings(time_scale=1e6), FakeMcpState()))
        )
        clients = {m: await stack.enter_async_context(Client(f"{url}/mcp", mode=m)) for m in MODES}
        took: dict[str, list[float]] = {m: [] for m in MODES}
        for i in range(calls + 3):
            for mode, client in clients.items():
                t0 = time.perf_counter()
                await client.call_tool("lookup", {"query": f"{mode}-{i}"})
                if i >= 3:  # warm-up
                    took[mode].append((time.perf_counter() - t0) * 1000)
        versions = {m: c.protocol_version for m, c in clients.items()}
    return {
        "scenario": "mcp",
        "calls": calls,
        "modes": {
            m: {
                "protocol": versions[m],
                "p50_ms": round(_pct(v, 0.5), 2),
                "p99_ms": round(_pct(v, 0.99), 2),
            }
            for m, v in took.items()
        },
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }


def run(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING)
    for noisy in ("httpx", "httpx2", "mcp"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if not 1 <= args.calls <= 100_000:
        print("luftpause bench mcp: --calls 1..100000", file=sys.stderr)
        return 2
    result = asyncio.run(_measure(args.calls))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"MCP tools/call latency, {result['calls']} calls per mode, loopback")
        print(f"{'mode':<12} {'protocol':<12} {'p50 ms':>8} {'p99 ms':>8}")
        for mode, r in result["modes"].items():
            print(f"{mode:<12} {r['protocol']:<12} {r['p50_ms']:>8} {r['p99_ms']:>8}")
    return 0
