"""The flood's bar against how far the core's prompt estimate is off.

    .venv/bin/python bench/prompt_estimate_sweep.py [--seeds 1,2,3] \\
        [--estimates 0.8,1.0,1.15,1.3] [--json]

The gateway estimates a turn's prompt as a quarter of its bytes; on a real tokenizer
that is 5-15 % off, either way (bench/prompt_estimate.py).  For each factor F the
luftpause arm's core is told F x each prompt (`Scenario.prompt_estimate`), with the
core learning each model's scale from the engines' counts (`learn_prompt_scale`, the
default) and without; cache_aware, which reads no estimate, runs on the same seeds.
Printed: the mean over seeds of luftpause's interactive and batch runs as ratios of
cache_aware's (the issue's bar: >= 2x and >= 0.9x).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from testkit.sim import SCENARIOS, simulate


def sweep(seeds: list[int], estimates: list[float]) -> dict[str, dict[str, float]]:
    flood = SCENARIOS["flood"]
    base = {s: simulate(replace(flood, seed=s), "cache_aware") for s in seeds}
    rows: dict[str, dict[str, float]] = {}
    for f in estimates:
        row: dict[str, float] = {}
        for learned in (True, False):
            ri = rb = 0.0
            for s in seeds:
                policy = replace(flood.policy, learn_prompt_scale=learned)
                sc = replace(flood, seed=s, prompt_estimate=f, policy=policy)
                arm = simulate(sc, "luftpause")
                ri += arm.interactive_runs / base[s].interactive_runs / len(seeds)
                rb += arm.batch_runs / base[s].batch_runs / len(seeds)
            key = "learned" if learned else "not_learned"
            row[f"{key}_interactive_x_ca"] = round(ri, 3)
            row[f"{key}_batch_x_ca"] = round(rb, 3)
        rows[str(f)] = row
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--estimates", default="0.8,1.0,1.15,1.3")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
        estimates = [float(f) for f in args.estimates.split(",")]
    except ValueError:
        p.error("--seeds are integers and --estimates numbers, comma-separated")
    rows = sweep(seeds, estimates)
    if args.json:
        print(json.dumps({"seeds": seeds, "rows": rows}, indent=2))
        return 0
    print(
        f"{'F':>6}{'learned int×CA':>16}{'batch×CA':>10}{'not learned int×CA':>20}{'batch×CA':>10}"
    )
    for f, r in rows.items():
        print(
            f"{f:>6}{r['learned_interactive_x_ca']:>16.2f}{r['learned_batch_x_ca']:>10.3f}"
            f"{r['not_learned_interactive_x_ca']:>20.2f}{r['not_learned_batch_x_ca']:>10.3f}"
        )
    print(f"(mean over seeds {args.seeds}; cache_aware is given exact prompts)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
