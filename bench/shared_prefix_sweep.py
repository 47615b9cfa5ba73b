"""The flood when every run's prompt begins with the same prefix.

    .venv/bin/python bench/shared_prefix_sweep.py [--seeds 1,2,3] \\
        [--prefixes 0,4000,16000,60000] [--interactive-prefix CHARS] [--json]

Agent harnesses begin every run with the same system prompt and tool schemas (Claude
Code's is about 15k tokens); an engine's prefix cache holds that once.  For each prefix
length (in characters, 4 a token; `Scenario.shared_prefix_chars`) the luftpause arm
runs with the core learning each model's shared prefix from runs' first turns
(`learn_shared_prefix`, the default) and without; cache_aware and the two reference
arms run on the same seeds.  Printed: the mean over seeds of luftpause's interactive
and batch runs as ratios of cache_aware's (the issue's bar: >= 2x and >= 0.9x), and its
P, W and B (batch runs / batch-alone's).

`--interactive-prefix CHARS`: the interactive runs come from another harness, with a
prefix of their own (`Scenario.interactive_prefix_chars`); `--prefixes` is then the
batch runs'.  The core learns one prefix per model, and a third arm, `per_class`, shows
what one per harness would buy: its core is told each class's turns are of a model of
their own, served by every replica (an upper bound: the gateway knows no harness).
"""

from __future__ import annotations

import argparse
import functools
import json
from dataclasses import replace
from unittest import mock

from testkit.sim import SCENARIOS, simulate
from testkit.sim import _run as run_module
from testkit.sim._arms import Luftpause
from testkit.sim._run import ArmResult, Scenario

ARMS = ("learned", "not_learned")
PER_CLASS = "per_class"


def _arms(interactive_prefix: int | None) -> tuple[str, ...]:
    """The luftpause arms measured: per_class too when the classes' prefixes differ."""
    return ARMS if interactive_prefix is None else (*ARMS, PER_CLASS)


def _simulate_per_class(sc: Scenario) -> ArmResult:
    """The luftpause arm, its core told the interactive turns are of a model of their
    own that every replica serves."""
    own = functools.partial(Luftpause, interactive_model=f"{run_module.MODEL}-interactive")
    with mock.patch.object(run_module, "Luftpause", own):
        return simulate(sc, "luftpause")


def sweep(
    seeds: list[int], prefixes: list[int], interactive_prefix: int | None = None
) -> dict[str, dict[str, float]]:
    flood = SCENARIOS["flood"]
    rows: dict[str, dict[str, float]] = {}
    arms = _arms(interactive_prefix)
    for chars in prefixes:
        row: dict[str, float] = {}
        n = len(seeds)
        for s in seeds:
            sc = replace(
                flood,
                seed=s,
                shared_prefix_chars=chars,
                interactive_prefix_chars=interactive_prefix,
            )
            ca = simulate(sc, "cache_aware")
            alone_i = simulate(sc, "cache_aware", batch=False).interactive_runs
            alone_b = simulate(sc, "cache_aware", interactive=False).batch_runs
            for key in arms:
                policy = replace(flood.policy, learn_shared_prefix=key != "not_learned")
                if key == PER_CLASS:
                    arm = _simulate_per_class(replace(sc, policy=policy))
                else:
                    arm = simulate(replace(sc, policy=policy), "luftpause")
                for name, value in (
                    ("interactive_x_ca", arm.interactive_runs / ca.interactive_runs),
                    ("batch_x_ca", arm.batch_runs / ca.batch_runs),
                    ("P", arm.interactive_runs / alone_i),
                    ("W", (arm.interactive_runs + arm.batch_runs) / alone_b),
                    ("B", arm.batch_runs / alone_b),
                ):
                    row[f"{key}_{name}"] = row.get(f"{key}_{name}", 0.0) + value / n
        rows[str(chars)] = {k: round(v, 3) for k, v in row.items()}
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--prefixes", default="0,4000,16000,60000")
    p.add_argument("--interactive-prefix", type=int, metavar="CHARS")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
        prefixes = [int(c) for c in args.prefixes.split(",")]
    except ValueError:
        p.error("--seeds and --prefixes are integers, comma-separated")
    rows = sweep(seeds, prefixes, args.interactive_prefix)
    if args.json:
        print(json.dumps({"seeds": seeds, "rows": rows}, indent=2))
        return 0
    arms = _arms(args.interactive_prefix)
    head = f"{'prefix chars':>12}"
    for key in arms:
        head += f" | {key:>11} int×CA batch×CA    P    W    B"
    print(head)
    for chars, r in rows.items():
        line = f"{chars:>12}"
        for key in arms:
            line += (
                f" | {'':>11} {r[f'{key}_interactive_x_ca']:>6.2f} {r[f'{key}_batch_x_ca']:>8.3f}"
                f" {r[f'{key}_P']:>4.2f} {r[f'{key}_W']:>4.2f} {r[f'{key}_B']:>4.2f}"
            )
        print(line)
    print(
        f"(mean over seeds {args.seeds}; references: cache_aware's interactive runs alone "
        "and batch runs alone)"
    )
    if args.interactive_prefix is not None:
        print(
            f"(prefix chars: the batch runs'; the interactive runs': {args.interactive_prefix}, "
            "another harness's)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
