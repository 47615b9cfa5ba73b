"""Ablation of the admission policy on the simulated flood: what each mechanism buys.

Run: .venv/bin/python bench/ablation.py [--seeds 1,2] [--json]
Each variant switches one mechanism off (or changes one constant) from the default
Policy; P and W are against the same reference arms (the best of cache_aware and the
default luftpause policy, each alone) for every variant.  A change named `engine.<field>`
changes the simulated engines' EngineParams instead (the same for the variant's
reference run alone).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from statistics import mean

from testkit.sim import SCENARIOS, simulate, variant

VARIANTS: dict[str, dict[str, object]] = {
    "luftpause (default)": {},
    "- KV room kept for interactive (batch_kv_fill=None)": {"batch_kv_fill": None},
    "- program-level KV admission": {"kv_admission": False},
    "- slot reserve for paused interactive": {"reserve_for_paused_interactive": False},
    "- cap from engine queue": {"cap_from_engine_queue": False},
    "cap on one queued probe (cap_after_queued_probes=1)": {"cap_after_queued_probes": 1},
    "- strict affinity": {"strict_affinity": False},
    "seed rules only (cap, affinity, reserve)": {"kv_admission": False},
    "seed rules, cap on one queued probe": {"kv_admission": False, "cap_after_queued_probes": 1},
    "seed rules without the cap": {"kv_admission": False, "cap_from_engine_queue": False},
    "batch_kv_fill=0.6": {"batch_kv_fill": 0.6},
    "batch_kv_fill=0.75": {"batch_kv_fill": 0.75},
    "kv_retention_s=10": {"kv_retention_s": 10.0},
    "+ interactive lanes (lane_batch_kv_fill=0.3)": {
        "lane_batch_kv_fill": 0.3,
        "batch_kv_fill": None,
    },
    "+ shared-GPU packing (pack_shared_devices)": {"pack_shared_devices": True},
}

# --frontier: the P/W trade-off along the knobs that move it.
FRONTIER: dict[str, dict[str, object]] = {
    **{f"batch_kv_fill={f}": {"batch_kv_fill": f} for f in (0.75, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2)},
    **{
        f"lanes, lane_batch_kv_fill={f}": {"lane_batch_kv_fill": f, "batch_kv_fill": None}
        for f in (0.6, 0.5, 0.4, 0.3, 0.2, 0.1)
    },
    **{
        f"packed GPU, kv_fill=0.9, batch_kv_fill={f}": {
            "pack_shared_devices": True,
            "kv_fill": 0.9,
            "batch_kv_fill": f,
        }
        for f in (0.9, 0.85, 0.8, 0.75, 0.7, 0.6)
    },
    # Not a router mechanism: engines that preempt batch decode while interactive turns
    # decode (EngineParams.low_priority_decode_cap; SGLang has no such mode).
    **{f"engine decode cap {c}": {"engine.low_priority_decode_cap": c} for c in (0, 2, 4, 8, 16)},
    **{
        f"packed GPU, kv_fill=0.9, batch_kv_fill=0.75, engine decode cap {c}": {
            "pack_shared_devices": True,
            "kv_fill": 0.9,
            "batch_kv_fill": 0.75,
            "engine.low_priority_decode_cap": c,
        }
        for c in (4, 8, 16)
    },
}


def _mean_or_none(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(mean(known), 1) if known else None


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--frontier",
        action="store_true",
        help="sweep batch_kv_fill and interactive lanes instead of the ablation variants",
    )
    ap.add_argument("--minutes", type=float, default=3.0, help="virtual minutes per run (flood: 3)")
    ap.add_argument("--only", help="run only the variants whose name contains this")
    args = ap.parse_args()
    variants = FRONTIER if args.frontier else VARIANTS
    if args.only:
        variants = {k: v for k, v in variants.items() if args.only in k}
    seeds = [int(s) for s in args.seeds.split(",")]
    base = replace(SCENARIOS["flood"], minutes=args.minutes)
    ref_i = mean(
        max(simulate(replace(base, seed=s), a, batch=False).interactive_per_min
            for a in ("cache_aware", "luftpause"))
        for s in seeds
    )  # fmt: skip
    ref_b = mean(
        max(simulate(replace(base, seed=s), a, interactive=False).batch_per_min
            for a in ("cache_aware", "luftpause"))
        for s in seeds
    )  # fmt: skip
    ca = [simulate(replace(base, seed=s), "cache_aware") for s in seeds]
    ca_i = mean(r.interactive_per_min for r in ca)
    ca_b = mean(r.batch_per_min for r in ca)
    rows = {}
    for name, change in variants.items():
        sc = variant(base, change)
        res = [simulate(replace(sc, seed=s), "luftpause") for s in seeds]
        i = mean(r.interactive_per_min for r in res)
        b = mean(r.batch_per_min for r in res)
        # The same interactive runs alone under this variant: a policy can also make the
        # reference faster (lanes pack interactive runs onto one replica of the GPU).
        own_i = mean(
            simulate(replace(sc, seed=s), "luftpause", batch=False).interactive_per_min
            for s in seeds
        )
        rows[name] = {
            "interactive_per_min": round(i, 2),
            # The mean of the seeds' medians; a seed with no interactive run ended in
            # the window has none (not 0 s).
            "interactive_p50_s": _mean_or_none([r.percentile(0.5) for r in res]),
            "batch_per_min": round(b, 2),
            "cached_share": round(mean(r.cached_share for r in res), 3),
            "P": round(i / ref_i, 3),
            "W": round((i + b) / ref_b, 3),
            "interactive_alone_this_policy": round(own_i, 2),
            "P_vs_this_policy_alone": round(i / max(own_i, ref_i), 3),
            "interactive_vs_cache_aware": round(i / ca_i, 2),
            "batch_vs_cache_aware": round(b / ca_b, 2),
        }
    out = {
        "seeds": seeds,
        "minutes": args.minutes,
        "reference": {"interactive_alone": round(ref_i, 2), "batch_alone": round(ref_b, 2)},
        "cache_aware": {"interactive_per_min": round(ca_i, 2), "batch_per_min": round(ca_b, 2)},
        "variants": rows,
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{'variant':<52}{'int/min':>8}{'p50 s':>7}{'batch/min':>10}{'cached':>8}"
          f"{'P':>7}{'W':>7}{'int×CA':>8}{'batch×CA':>9}{'alone':>7}{'P*':>6}")  # fmt: skip
    for name, r in rows.items():
        print(
            f"{name:<52}{r['interactive_per_min']:>8.2f}{_cell(r['interactive_p50_s']):>7}"
            f"{r['batch_per_min']:>10.2f}{r['cached_share']:>8.1%}{r['P']:>7.2f}{r['W']:>7.2f}"
            f"{r['interactive_vs_cache_aware']:>8.2f}{r['batch_vs_cache_aware']:>9.2f}"
            f"{r['interactive_alone_this_policy']:>7.2f}{r['P_vs_this_policy_alone']:>6.2f}"
        )
    print("alone: the interactive runs alone under the variant's own policy; P*: P against "
          "the better of that and the reference")  # fmt: skip
    print(f"reference alone: interactive {ref_i:.2f}/min, batch {ref_b:.2f}/min; "
          f"cache_aware: interactive {ca_i:.2f}, batch {ca_b:.2f} (seeds {seeds}, "
          f"{args.minutes:g} virtual minutes)")  # fmt: skip


if __name__ == "__main__":
    main()
