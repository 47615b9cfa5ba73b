"""Where an interactive turn's time goes in the simulated flood, against the same runs
alone: held by luftpause, waiting for and computing its prefill, and decoding, split into
the engine's prefill steps for other requests (no request decodes in them) and its own
decode steps (whose length grows with every request's KV in the batch).

Run: .venv/bin/python bench/interactive_time.py [--seeds 1,2,3] [--minutes 3]
     [--skip-s 40] [--json]
Turns that arrive in the first `--skip-s` virtual seconds are left out: at t=0 every
agent starts at once, and the batch runs fill both replicas before the interactive runs
arrive (a start-up effect the rates include, the per-turn figures do not).

It also counts the batch turns luftpause held, and how many of them began a run.  Those
have no attained service yet, so least-attained-service order among the held turns
(Autellix's) is arrival order for them.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from statistics import mean

from scheduler import ServiceClass
from testkit.sim import SCENARIOS, ArmResult, simulate, variant

# Scheduler Policy fields by name, the engines' EngineParams fields as `engine.<field>`
# (bench/ablation.py's variants).
PACKED: dict[str, object] = {"pack_shared_devices": True, "kv_fill": 0.9, "batch_kv_fill": 0.75}
VARIANTS: dict[str, dict[str, object]] = {
    "luftpause (default)": {},
    "batch_kv_fill=0.6": {"batch_kv_fill": 0.6},
    "packed GPU, kv_fill=0.9, batch_kv_fill=0.75": PACKED,
    "the same, engine decode cap 8": {**PACKED, "engine.low_priority_decode_cap": 8},
}


def turn_figures(
    res: ArmResult, *, skip_s: float, until: float, reply_tokens: int
) -> dict[str, float]:
    """Mean seconds per finished interactive turn that arrived after `skip_s`."""
    held, to_first, decode, stall = [], [], [], []
    for t in res.turns.values():
        if t.service_class is not ServiceClass.INTERACTIVE or t.arrived < skip_s:
            continue
        if t.finished is None or t.first_token is None or t.sent is None or t.engine is None:
            continue
        held.append(t.sent - t.arrived)
        to_first.append(t.first_token - t.sent)
        decode.append(t.finished - t.first_token)
        a, b = t.first_token, t.finished
        stall.append(sum(max(0.0, min(b, e) - max(a, s)) for s, e in res.prefill_steps[t.engine]))
    if not held:
        raise SystemExit(
            f"no interactive turn arrived after {skip_s:g} s and finished: lower --skip-s "
            "or raise --minutes"
        )
    steps = mean(d - s for d, s in zip(decode, stall, strict=True))
    return {
        "interactive_in_engine": round(_covered(res, skip_s, until), 3),
        "turns": len(held),
        "held_s": round(mean(held), 3),
        "to_first_token_s": round(mean(to_first), 3),
        "decode_s": round(mean(decode), 3),
        "prefill_stall_s": round(mean(stall), 3),
        "decode_step_ms": round(steps / (reply_tokens - 1) * 1000, 2),
    }


def _covered(res: ArmResult, skip_s: float, until: float) -> float:
    """The share of the time from `skip_s` to `until` in which some interactive turn is
    in an engine (sent, not finished): time in which any batch work slows one down."""
    spans = sorted(
        (max(t.sent, skip_s), until if t.finished is None else min(t.finished, until))
        for t in res.turns.values()
        if t.service_class is ServiceClass.INTERACTIVE and t.sent is not None
    )
    covered, start, end = 0.0, skip_s, skip_s
    for a, b in spans:
        if b <= a:
            continue
        if a > end:
            covered += end - start
            start = a
        end = max(end, b)
    covered += end - start
    return covered / (until - skip_s) if until > skip_s else 0.0


def held_batch(res: ArmResult) -> dict[str, float]:
    """Batch turns held (sent later than they arrived): how many, how many of them were
    their run's first turn, and the seconds held by each kind."""
    out = {"held": 0.0, "first": 0.0, "held_s": 0.0, "first_s": 0.0}
    for turn_id, t in res.turns.items():
        if t.service_class is not ServiceClass.BATCH or t.sent is None or t.sent <= t.arrived:
            continue
        out["held"] += 1
        out["held_s"] += t.sent - t.arrived
        if turn_id.endswith("-t1"):  # the simulator's ids: <run>-t<turn number>
            out["first"] += 1
            out["first_s"] += t.sent - t.arrived
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--skip-s", type=float, default=40.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    base = replace(SCENARIOS["flood"], minutes=args.minutes)
    rows: dict[str, dict[str, float]] = {}
    held = dict.fromkeys(("held", "first", "held_s", "first_s"), 0.0)
    for name, change in VARIANTS.items():
        sc = variant(base, change)
        for batch in (True, False):
            per_seed = []
            for s in seeds:
                res = simulate(replace(sc, seed=s), "luftpause", batch=batch, timeline=True)
                figures = turn_figures(
                    res, skip_s=args.skip_s, until=sc.minutes * 60, reply_tokens=sc.reply_tokens
                )
                figures["interactive_per_min"] = res.interactive_per_min
                figures["batch_per_min"] = res.batch_per_min
                per_seed.append(figures)
                for key, value in held_batch(res).items():
                    held[key] += value
            rows[name if batch else f"{name}, alone"] = {
                k: round(mean(f[k] for f in per_seed), 3) for k in per_seed[0]
            }
    if args.json:
        print(json.dumps({"seeds": seeds, "minutes": args.minutes, "skip_s": args.skip_s,
                          "variants": rows, "held_batch_turns": held}, indent=2))  # fmt: skip
        return
    print(f"{'variant':<46}{'int/min':>8}{'batch/min':>10}{'held':>7}{'to 1st':>7}"
          f"{'decode':>7}{'stall':>7}{'step ms':>8}{'in eng':>8}")  # fmt: skip
    for name, r in rows.items():
        label = "  alone" if name.endswith(", alone") else name
        print(
            f"{label:<46}{r['interactive_per_min']:>8.2f}{r['batch_per_min']:>10.2f}"
            f"{r['held_s']:>7.3f}{r['to_first_token_s']:>7.3f}{r['decode_s']:>7.3f}"
            f"{r['prefill_stall_s']:>7.3f}{r['decode_step_ms']:>8.2f}"
            f"{r['interactive_in_engine']:>8.1%}"
        )
    print(f"seconds per interactive turn (mean; turns arriving after {args.skip_s:g} s of "
          f"{args.minutes:g} virtual minutes, seeds {seeds}); stall: the engine's prefill "
          "steps during its decode; step ms: its decode time without them, per token; "
          "in eng: share of the time some interactive turn is in an engine")  # fmt: skip
    if held["held"]:
        print(f"batch turns luftpause held, all variants and seeds: {held['held']:,.0f}, of which "
              f"{held['first']:,.0f} began their run ({held['first_s'] / held['held_s']:.1%} of "
              "the time held)")  # fmt: skip


if __name__ == "__main__":
    main()
