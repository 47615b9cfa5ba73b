"""`luftpause bench <scenario>`: measurements that print a table (or JSON with --json).

- `overhead`: the latency the gateway adds over going straight to an instant engine
  (testkit/overhead.py).
- `temporal`: what Temporal adds per sub-agent turn (testkit/bench_temporal.py).
- `mcp`: one MCP tools/call by protocol generation (testkit/bench_mcp.py).
- `flood`, `light`, `routing`: the simulator's scenarios in real time, luftpause against
  the SGLang router and SMG on the same fake engines (testkit/bench_agents.py).

The policy's own benchmarks run in virtual time under `luftpause sim`.
"""

from __future__ import annotations

import argparse
import importlib

__all__ = ["add_arguments", "run"]

_SCENARIOS = {
    "overhead": ("testkit.overhead", "added latency of the gateway over a direct engine"),
    "temporal": ("testkit.bench_temporal", "Temporal's added cost per sub-agent turn"),
    "mcp": ("testkit.bench_mcp", "MCP tools/call latency by protocol generation"),
    # The simulator's scenarios in real time, luftpause against the real peer routers.
    "flood": ("testkit.bench_agents", "batch flood with interactive runs: luftpause vs routers"),
    "light": ("testkit.bench_agents", "light batch load with interactive runs, every router"),
    "routing": ("testkit.bench_agents", "8 runs in flight, one class: cache hits by router"),
}
_AGENT_SCENARIOS = ("flood", "light", "routing")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="scenario", required=True, metavar="SCENARIO")
    for name, (module, help_text) in _SCENARIOS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name in _AGENT_SCENARIOS:
            importlib.import_module(module).add_arguments(p, name)
        else:
            importlib.import_module(module).add_arguments(p)


def run(args: argparse.Namespace) -> int:
    module, _ = _SCENARIOS[args.scenario]
    return int(importlib.import_module(module).run(args))
