"""The simulator: determinism, the scenarios' headline comparisons, and the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from itertools import pairwise
from typing import Any

import pytest

from luftpause import native
from scheduler import ServiceClass
from testkit.sim import SCENARIOS, simulate, simulate_fanout, variant
from testkit.sim._report import bench_core, compare


def test_simulation_is_deterministic_for_a_seed() -> None:
    sc = replace(SCENARIOS["flood"], minutes=0.5)
    a = simulate(sc, "luftpause").as_json()
    b = simulate(sc, "luftpause").as_json()
    a.pop("wall_s"), b.pop("wall_s")
    assert a == b
    c = simulate(replace(sc, seed=2), "luftpause").as_json()
    c.pop("wall_s")
    assert c != a


@pytest.fixture(scope="module")
def flood() -> dict:  # type: ignore[type-arg]
    return compare(SCENARIOS["flood"], ["luftpause", "cache_aware", "round_robin"])


def test_flood_luftpause_protects_interactive_runs_without_losing_batch(flood: dict) -> None:  # type: ignore[type-arg]
    lp, ca = flood["arms"]["luftpause"], flood["arms"]["cache_aware"]
    print(json.dumps({k: flood["arms"][k] for k in ("luftpause", "cache_aware")}, indent=1))
    # counts over the same window: exact, where the per-minute figures are rounded
    assert lp["interactive_runs"] >= 2 * ca["interactive_runs"]
    assert lp["batch_runs"] >= 0.9 * ca["batch_runs"]
    assert lp["runs_that_moved"] == 0  # strict affinity
    assert lp["cached_prompt_token_share"] > 2 * ca["cached_prompt_token_share"]


def test_flood_reports_p_and_w_against_the_reference_arms(flood: dict) -> None:  # type: ignore[type-arg]
    ref = flood["reference"]
    assert ref["interactive-alone"]["batch_runs_per_min"] == 0
    assert ref["batch-alone"]["interactive_runs_per_min"] == 0
    for arm in flood["arms"].values():
        ia = ref["interactive-alone"]["interactive_runs_per_min"]
        ba = ref["batch-alone"]["batch_runs_per_min"]
        assert arm["P"] == pytest.approx(arm["interactive_runs_per_min"] / ia, abs=1e-3)
        total = arm["interactive_runs_per_min"] + arm["batch_runs_per_min"]
        assert arm["W"] == pytest.approx(total / ba, abs=1e-3)
    assert "approximation" in flood["note"]


def test_light_load_makes_the_policy_irrelevant() -> None:
    report = compare(
        SCENARIOS["light"], ["luftpause", "direct", "round_robin", "cache_aware", "program"]
    )
    for key in ("interactive_runs_per_min", "batch_runs_per_min"):
        values = [arm[key] for arm in report["arms"].values()]
        print(key, values)
        assert min(values) >= 0.9 * max(values)


def test_fanout_finishes_in_about_the_time_of_the_slowest_run() -> None:
    sc = SCENARIOS["fanout"]
    together = simulate_fanout(sc, "luftpause", together=True)
    alone = simulate_fanout(sc, "luftpause", together=False)
    slowest = max(alone.interactive_durations)
    print(f"fanned out {together.makespan_s:.1f} s, one at a time {alone.makespan_s:.1f} s")
    assert together.interactive_runs == alone.interactive_runs == 16
    assert together.makespan_s >= slowest
    assert together.makespan_s < alone.makespan_s / 3


def test_bench_core_keeps_the_held_count() -> None:
    result = bench_core(held=2000, decisions=2000, replicas=2)
    assert result["held_turns"] == 2000
    assert 2000 <= result["decisions"] <= 2002  # whole cycles of finish, start, arrival
    assert result["decisions_per_s"] > 0
    assert result["core"] == native.core_build()  # which core the number is of


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    return subprocess.run(
        [sys.executable, "-m", "luftpause", *args], capture_output=True, text=True, env=env,
        timeout=300,
    )  # fmt: skip


def test_cli_sim_prints_json_with_every_arm() -> None:
    out = _cli("sim", "flood", "--json", "--minutes", "0.5", "--arms", "luftpause,cache_aware")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert set(report["arms"]) == {"luftpause", "cache_aware"}
    assert report["scenario"]["minutes"] == 0.5
    for arm in report["arms"].values():
        for key in (
            "interactive_runs_per_min",
            "interactive_p50_s",
            "interactive_p90_s",
            "batch_runs_per_min",
            "cached_prompt_token_share",
            "P",
            "W",
            "ratios",
        ):
            assert key in arm  # fmt: skip


def test_cli_sim_table_and_flags() -> None:
    out = _cli("sim", "light", "--minutes", "0.5", "--batch", "4", "--arms", "luftpause")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].split()[:3] == ["arm", "int/min", "int"]
    assert out.stdout.splitlines()[0].split()[-3:] == ["P", "W", "B"]
    assert "luftpause" in out.stdout and "approximation" in out.stdout
    # W counts interactive runs as batch work: where batch runs stop, the table says so
    # (helper-111: W 1.67 with no batch run ended).
    argv = ("sim", "flood", "--max-running", "1", "--minutes", "1", "--arms", "luftpause")
    out = _cli(*argv)
    assert out.returncode == 0, out.stderr
    assert "note: luftpause: W " in out.stdout and "batch work is not kept whole" in out.stdout
    # the engine flags reach the engines: mixed prefill steps decode too, so runs end sooner
    p50 = {}
    for flags in ((), ("--engine-mixed-chunk",)):
        argv = ("sim", "light", "--minutes", "0.5", "--batch", "4", "--arms", "luftpause")
        out = _cli(*argv, "--json", *flags)
        assert out.returncode == 0, out.stderr
        p50[flags] = json.loads(out.stdout)["arms"]["luftpause"]["interactive_p50_s"]
    assert p50[("--engine-mixed-chunk",)] < p50[()]


def test_cli_rejects_bad_flags_clearly() -> None:
    out = _cli("sim", "flood", "--policy", "kv_fill")
    assert out.returncode != 0 and "expected NAME=VALUE" in out.stderr
    out = _cli("sim", "flood", "--policy", "strict_affinity=maybe")
    assert out.returncode != 0 and "expected true or false" in out.stderr
    out = _cli("sim", "flood", "--arms", "luftpause,nginx")
    assert out.returncode != 0 and "unknown" in out.stderr
    out = _cli("sim", "flood", "--policy", "batch_kv_fill=most")
    assert out.returncode != 0 and "expected a number (or none), got 'most'" in out.stderr
    assert "Traceback" not in out.stderr
    for flag, message in (
        ("--engines", "engines must be >= 1, got 0"),
        ("--replicas-per-gpu", "replicas_per_gpu must be >= 1, got 0"),
        ("--kv-tokens", "kv_pool_tokens must hold at least one block"),
    ):
        out = _cli("sim", "flood", flag, "0")
        assert out.returncode != 0 and f"luftpause sim: {message}" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
    # Found by helper-64: values that gave a traceback, ran forever or a meaningless table.
    for argv, message in (
        (("flood", "--engine-decode-cap", "-1"), "low_priority_decode_cap must be >= 0"),
        (("light", "--tool-s", "nan"), "tool_s must be finite and >= 0, got nan"),
        (("light", "--minutes", "inf"), "minutes 0 to 10000, got 256, inf"),
        (("light", "--policy", "kv_fill=-1"), "--policy kv_fill: Input should be greater than 0"),
        (("light", "--policy", "max_held_per_caller=0"), "--policy max_held_per_caller:"),
        (("bench-core", "--held", "0"), "--held and --decisions must be >= 1, got 0"),
        # Found by helper-111: a traceback minutes into a run, or at its end.
        (
            ("flood", "--kv-tokens", "3000", "--arms", "direct"),
            "a run's last turn needs 4,224 KV tokens",
        ),
        (("flood", "--context-chars", "0"), "context_chars must be >= 1"),
        (("fanout", "--runs", "0"), "fanout needs runs >= 1, got 0"),
        (
            ("fanout", "--minutes", "0.05", "--runs", "2"),
            "not every one of the 2 runs ended within 0.05 minutes",
        ),
    ):
        out = _cli("sim", *argv)
        assert out.returncode != 0 and message in out.stderr, (argv, out.stderr)
        assert "Traceback" not in out.stderr


def test_packing_a_shared_gpu_trades_batch_runs_for_interactive_ones() -> None:
    """Rule 13 on the flood: the interactive runs' replica gets the GPU to itself
    (bench/RESULTS.md has the 3-minute, 3-seed figures); on replicas that do not share
    a GPU the switch changes nothing."""
    sc = replace(SCENARIOS["flood"], minutes=2.0)
    pack = replace(sc.policy, pack_shared_devices=True)
    plain = simulate(sc, "luftpause")
    packed = simulate(replace(sc, policy=pack), "luftpause")
    print(plain.interactive_runs, plain.batch_runs, packed.interactive_runs, packed.batch_runs)
    assert packed.interactive_runs >= 1.3 * plain.interactive_runs
    assert packed.batch_runs < plain.batch_runs
    own = replace(sc, replicas_per_gpu=1)
    a = simulate(own, "luftpause").as_json()
    b = simulate(replace(own, policy=pack), "luftpause").as_json()
    a.pop("wall_s"), b.pop("wall_s")
    assert a == b


def test_engines_with_few_slots_known_to_luftpause_give_interactive_runs_more() -> None:
    """Engines that run 8 requests at once: told their slots (as SGLang reports them),
    luftpause holds the turns past them, interactive first, and leaves slots for paused
    interactive runs; learning only from the engines' queues, turns wait there in
    arrival order first (bench/RESULTS.md has the 3-minute, 3-seed figures: a trade,
    interactive +13 %, batch -6 %)."""
    sc = replace(SCENARIOS["flood"], minutes=1.5)
    sc = replace(sc, engine=replace(sc.engine, max_running_requests=8))
    known = simulate(sc, "luftpause")
    unknown = simulate(replace(sc, slots_known=False), "luftpause")
    print(known.as_json(), unknown.as_json())
    assert known.interactive_runs > unknown.interactive_runs
    assert known.batch_runs < unknown.batch_runs
    args = ("sim", "light", "--minutes", "0.2", "--batch", "2", "--arms", "luftpause", "--json")
    assert json.loads(_cli(*args).stdout)["scenario"]["slots_known"] is True
    assert json.loads(_cli(*args, "--slots-unknown").stdout)["scenario"]["slots_known"] is False


def test_cli_policy_switches_an_optional_knob_off_and_on() -> None:
    args = ("sim", "light", "--minutes", "0.2", "--batch", "2", "--arms", "luftpause", "--json")
    off = json.loads(_cli(*args, "--policy", "batch_kv_fill=none").stdout)
    lanes = json.loads(_cli(*args, "--policy", "lane_batch_kv_fill=0.3").stdout)
    assert off["scenario"]["policy"]["batch_kv_fill"] is None
    assert lanes["scenario"]["policy"]["lane_batch_kv_fill"] == 0.3


def test_engines_that_preempt_batch_decode_give_interactive_runs_the_steps() -> None:
    """`--engine-decode-cap 0`: engines step only interactive turns while any decodes.
    Interactive runs gain, and batch pays far more than it gives (bench/RESULTS.md:
    engine preemption lies on the same P/W frontier as the router's batch_kv_fill)."""
    sc = replace(SCENARIOS["flood"], minutes=1.5)
    plain = simulate(sc, "luftpause")
    preempt = replace(sc, engine=replace(sc.engine, low_priority_decode_cap=0))
    held_back = simulate(preempt, "luftpause")
    print(plain.as_json(), held_back.as_json())
    assert held_back.interactive_runs > plain.interactive_runs
    assert held_back.batch_runs < 0.5 * plain.batch_runs


def test_timeline_keeps_each_turns_stages_and_the_engines_prefill_steps() -> None:
    sc = replace(SCENARIOS["flood"], minutes=0.5)
    plain = simulate(sc, "luftpause")
    res = simulate(sc, "luftpause", timeline=True)
    assert not plain.turns and not plain.prefill_steps
    assert res.interactive_runs == plain.interactive_runs  # watching changes nothing
    assert res.batch_runs == plain.batch_runs
    done = [t for t in res.turns.values() if t.finished is not None]
    assert len(done) >= res.interactive_runs + res.batch_runs
    for t in done:
        assert t.sent is not None and t.first_token is not None and t.engine is not None
        assert t.arrived <= t.sent <= t.first_token <= t.finished
    assert {t.service_class for t in done} == set(ServiceClass)
    for steps in res.prefill_steps:
        assert steps, "each engine prefilled"
        assert all(a < b <= c for (a, b), (c, _) in pairwise(steps))
    # every turn's first token ends a prefill step of its engine
    ends = [{b for _, b in steps} for steps in res.prefill_steps]
    assert all(t.first_token in ends[t.engine] for t in done if t.engine is not None)


def test_a_variant_changes_policy_fields_and_engine_fields() -> None:
    sc = SCENARIOS["flood"]
    v = variant(sc, {"kv_fill": 0.9, "engine.low_priority_decode_cap": 8})
    assert v.policy == replace(sc.policy, kv_fill=0.9)
    assert v.engine == replace(sc.engine, low_priority_decode_cap=8)
    assert replace(v, policy=sc.policy, engine=sc.engine) == sc
    with pytest.raises(TypeError):
        variant(sc, {"engine.kv_fill": 0.9})  # a Policy field is not an engine's


def test_the_interactive_reference_runs_the_mixed_arms_own_interactive_agents() -> None:
    # Agents are seeded by their index: alone, the four interactive agents took the
    # first batch agents' indices (and runs), so P compared different runs (helper-104).
    from testkit.sim import SCENARIOS, simulate
    from testkit.sim._run import TurnTimes

    sc = replace(SCENARIOS["flood"], minutes=0.5)
    mixed = simulate(sc, "luftpause", timeline=True)
    alone = simulate(sc, "luftpause", batch=False, timeline=True)

    def agents(turns: dict[str, TurnTimes], cls: ServiceClass) -> set[str]:
        return {t.split("-")[0] for t, times in turns.items() if times.service_class is cls}

    interactive = agents(mixed.turns, ServiceClass.INTERACTIVE)
    assert interactive == {f"a{sc.batch + i}" for i in range(sc.interactive)}
    assert agents(alone.turns, ServiceClass.INTERACTIVE) == interactive
    assert not agents(alone.turns, ServiceClass.BATCH)


def test_the_luftpause_arm_sees_the_prompt_as_estimated() -> None:
    # The gateway estimates a turn's prompt from its bytes; --prompt-estimate says how
    # far off, and the core is told that number (helper-111: it was always exact).
    from scheduler import Policy
    from testkit.sim._arms import Luftpause, Turn

    sent: list[tuple[str, int]] = []
    arm = Luftpause(
        1, lambda t, e: sent.append((t.turn_id, e)), model="m", kv_tokens=None,
        policy=Policy(), prompt_estimate=1.5,
    )  # fmt: skip
    arm.arrive(Turn("t1", "r1", ServiceClass.BATCH, "c", ((0, 0),), 1000, 16), 0.0)
    assert sent == [("t1", 0)]
    assert arm.state.turns["t1"].prompt_tokens == 1500
    with pytest.raises(ValueError, match=r"prompt_estimate must be 0\.1 to 10, got 0"):
        replace(SCENARIOS["flood"], prompt_estimate=0)


def test_runs_that_share_a_prefix_share_its_cache_and_luftpause_counts_it_once() -> None:
    # --shared-prefix-chars: every run's prompt begins with the same prefix (a harness's
    # system prompt and tools), whose whole blocks the engines cache once.  Counted in
    # each run's working set, KV admission held the flood's batch at 0.47 of
    # batch-alone with a 4k-token prefix; learned from first turns' cached tokens
    # (Policy.learn_shared_prefix) it is counted once (bench/RESULTS.md).
    sc = replace(SCENARIOS["flood"], minutes=2.0, shared_prefix_chars=16_000)
    learned = simulate(sc, "luftpause")
    counted = simulate(
        replace(sc, policy=replace(sc.policy, learn_shared_prefix=False)), "luftpause"
    )
    alone = simulate(replace(SCENARIOS["flood"], minutes=2.0), "luftpause")
    assert learned.cached_share > alone.cached_share + 0.2  # the prefix is found cached
    assert learned.batch_runs >= 1.4 * counted.batch_runs
    # Without a prefix the switch changes nothing: no first turn finds anything cached.
    plain = replace(SCENARIOS["flood"], minutes=1.0)
    a = simulate(plain, "luftpause").as_json()
    b = simulate(
        replace(plain, policy=replace(plain.policy, learn_shared_prefix=False)), "luftpause"
    ).as_json()
    a.pop("wall_s"), b.pop("wall_s")
    assert a == b
    with pytest.raises(ValueError, match="shared_prefix_chars must be >= 0"):
        replace(SCENARIOS["flood"], shared_prefix_chars=-1)


def test_interactive_runs_may_begin_with_another_harness_prefix() -> None:
    # --interactive-prefix-chars: the interactive runs come from another harness (Claude
    # Code's 15k tokens beside an own-loop agent's few hundred): their prefix is their
    # own blocks, cached beside the batch runs' and not shared with them.
    plain = replace(SCENARIOS["flood"], minutes=1.0)
    own = replace(plain, interactive_prefix_chars=16_000)
    a = simulate(replace(plain, interactive=0), "luftpause").as_json()
    b = simulate(replace(own, interactive=0), "luftpause").as_json()
    a.pop("wall_s"), b.pop("wall_s")
    assert a == b  # the batch runs' prompts are as they were
    alone = replace(plain, batch=0)
    assert simulate(replace(alone, interactive_prefix_chars=16_000), "luftpause").cached_share > (
        simulate(alone, "luftpause").cached_share + 0.1
    )
    # The same length as the batch runs' prefix, but not the same text: both are cached.
    same = replace(plain, shared_prefix_chars=16_000)
    other = replace(same, interactive_prefix_chars=16_000)
    assert simulate(other, "cache_aware").cached_share != simulate(same, "cache_aware").cached_share
    assert own.first_prompt_tokens(ServiceClass.INTERACTIVE) == (16_000 + 8000) // 4
    assert own.first_prompt_tokens(ServiceClass.BATCH) == 8000 // 4
    with pytest.raises(ValueError, match="interactive_prefix_chars must be >= 0"):
        replace(plain, interactive_prefix_chars=-1)
    # bench/shared_prefix_sweep.py's bound: the core told the interactive turns are of
    # a model of their own learns and counts their prefix apart.
    from scheduler import Policy
    from testkit.sim._arms import Luftpause, Turn

    arm = Luftpause(2, lambda *a: None, model="m", interactive_model="m-i", kv_tokens=50_000,
                    policy=Policy())  # fmt: skip
    for cls in ServiceClass:
        turn = Turn(turn_id=cls.value, run_id=cls.value, service_class=cls, caller="c",
                    prompt_blocks=((1, 0),), prompt_tokens=16, max_tokens=8)  # fmt: skip
        arm.arrive(turn, 0.0)
    assert arm.state.turns["interactive"].model == "m-i" and arm.state.turns["batch"].model == "m"


def _program_arm(capacity: int | None) -> tuple[Any, list[tuple[str, int]]]:
    from testkit.sim._arms import ProgramScheduling

    sent: list[tuple[str, int]] = []
    arm = ProgramScheduling(
        2, lambda turn, e: sent.append((turn.turn_id, e)), token_capacity=capacity
    )
    return arm, sent


def _turn(tid: str, run: str, prompt: int) -> Any:
    from testkit.sim._arms import Turn

    return Turn(tid, run, ServiceClass.BATCH, "c", (), prompt, 256)


def _same_engine_runs(arm: Any, n: int) -> list[str]:
    """n run ids the arm's hash ring binds to engine 0."""
    return [r for r in (f"run{i}" for i in range(1000)) if arm._bind(r) == 0][:n]


def test_the_program_arm_binds_runs_and_admits_them_within_the_rank_capacity() -> None:
    # vllm-router's program scheduling as the arm approximates it (its docstring).
    arm, sent = _program_arm(1000)
    assert {arm._bind(f"run{i}") for i in range(50)} == {0, 1}  # spread by hash
    a, b, c = _same_engine_runs(arm, 3)
    arm.arrive(_turn("a1", a, 800), 0.0)  # 800 + 100 of 1000: admitted
    arm.arrive(_turn("b1", b, 300), 0.1)  # 900 + 400 over 1000: waits in the router
    assert sent == [("a1", 0)]
    arm.arrive(_turn("a2", a, 850), 0.2)  # an active program's request goes at once
    assert sent[-1] == ("a2", 0) and arm.used[0] == 950
    arm.finished(_turn("a1", a, 800), 0, 1.0, tool_calls=True, prompt=800, output=10)
    assert sent[-1] == ("a2", 0)  # a2 still runs: a stays active, b waits
    # a's last request ends: with no 100 intervals seen, no TTL, so a is paused at
    # once (its tokens given back) and b is admitted.
    arm.finished(_turn("a2", a, 850), 0, 2.0, tool_calls=True, prompt=850, output=10)
    assert sent[-1] == ("b1", 0) and arm.used[0] == 400 and not arm.programs[a].active
    # A request waiting in the engine (its last metrics) holds every admission there.
    arm.probe(3.0, 0, 2, 5)
    arm.probe(3.0, 1, 0, 0)
    arm.arrive(_turn("c1", c, 10), 3.5)
    arm.arrive(_turn("a3", a, 900), 3.6)
    assert sent[-1] == ("b1", 0)
    arm.probe(4.0, 0, 0, 5)  # no queue there any more: the most recently finished first
    arm.probe(4.0, 1, 0, 0)
    assert sent[-1] == ("c1", 0)  # a (900 + 100) does not fit beside b; c does
    arm.finished(_turn("b1", b, 300), 0, 5.0, tool_calls=False, prompt=300, output=10)
    assert sent[-1] == ("c1", 0)  # a still does not fit beside c (110)
    arm.finished(_turn("c1", c, 10), 0, 6.0, tool_calls=False, prompt=10, output=10)
    assert sent[-1] == ("a3", 0)


def test_the_program_arm_keeps_no_class_apart() -> None:
    # No interactive class: in the flood it lands with the routers, far from luftpause.
    report = compare(SCENARIOS["flood"], ["luftpause", "program"])
    lp, prog = report["arms"]["luftpause"], report["arms"]["program"]
    print(json.dumps(prog, indent=1))
    assert lp["interactive_runs"] > 1.5 * prog["interactive_runs"]
    assert prog["batch_runs"] > lp["batch_runs"]
    assert prog["runs_that_moved"] == 0  # bound for good


def test_the_program_arm_fits_its_acting_ttl_to_the_intervals_seen() -> None:
    # helper-138: an interval equal to the TTL tried was counted a miss, so the TTL
    # was 0 or the cap where a short one paid.  A cache miss costs about 2 s here.
    from testkit.sim._arms import _Program

    arm, _ = _program_arm(None)
    p = _Program("r", 0, context=10_000)
    assert arm._ttl(p) == 0.0  # no 100 intervals seen yet
    arm.intervals.extend([0.5] * 50 + [100.0] * 50)
    assert arm._ttl(p) == 0.5
    arm.intervals.extend([0.3] * 70 + [5.0] * 30)
    assert arm._ttl(p) == 0.3
    arm.intervals.extend([3.0] * 100)  # every call longer than a miss costs: none
    assert arm._ttl(p) == 0.0
