"""Tests for testkit.engine.SimEngine (simulated SGLang-like engine in external time)."""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from collections.abc import Hashable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testkit.engine import (
    EngineOutput,
    EngineParams,
    EngineRequest,
    Finished,
    FirstToken,
    SimEngine,
)

REF = EngineParams.reference()
BT = REF.block_tokens


def blocks(conv: Hashable, tokens: int, bt: int = BT) -> tuple[Hashable, ...]:
    """Chained block ids for the first `tokens` tokens of conversation `conv`."""
    return tuple((conv, i) for i in range(math.ceil(tokens / bt)))


def req(
    rid: str,
    prompt: int,
    out: int,
    *,
    conv: Hashable | None = None,
    max_new: int | None = None,
    priority: int = 0,
    bt: int = BT,
    output_blocks: tuple[Hashable, ...] = (),
) -> EngineRequest:
    return EngineRequest(
        request_id=rid,
        prompt_blocks=blocks(rid if conv is None else conv, prompt, bt),
        prompt_tokens=prompt,
        output_tokens=out,
        max_new_tokens=out if max_new is None else max_new,
        priority=priority,
        output_blocks=output_blocks,
    )


def run_all(engine: SimEngine, limit: float = 1e6) -> list[EngineOutput]:
    """Drive the engine event by event until idle."""
    outs: list[EngineOutput] = []
    while (t := engine.next_event_time()) is not None:
        assert t <= limit
        outs.extend(engine.advance(t))
        engine.check_invariants()
    return outs


def by_id(outs: list[EngineOutput]) -> tuple[dict[str, FirstToken], dict[str, Finished]]:
    first = {o.request_id: o for o in outs if isinstance(o, FirstToken)}
    fin = {o.request_id: o for o in outs if isinstance(o, Finished)}
    return first, fin


def prefill_time(p: EngineParams, uncached: int) -> float:
    return p.step_overhead_s + uncached / (p.prefill_tokens_per_s * p.gpu_share)


def decode_step(p: EngineParams, context: int) -> float:
    bw = p.bandwidth_bytes_per_s * p.gpu_share
    return p.step_overhead_s + (p.weights_bytes + p.kv_bytes_per_token * context) / bw


# --------------------------------------------------------------------------- basics


def test_reference_params_and_replace() -> None:
    assert EngineParams() == REF
    assert REF.kv_bytes_per_token == 32 * 1024
    assert REF.kv_pool_tokens == 56_000 and REF.max_running_requests == 48
    assert REF.gpu_share == 0.5
    p = dataclasses.replace(REF, max_running_requests=3)
    assert p.max_running_requests == 3 and p.kv_pool_tokens == REF.kv_pool_tokens
    with pytest.raises(ValueError):
        dataclasses.replace(REF, gpu_share=0.0)


def test_single_request_matches_formula() -> None:
    p = REF
    e = SimEngine(p)
    t_sub = 5.0
    e.submit(req("a", 2000, 256), t_sub)
    assert e.advance(t_sub) == []
    assert e.metrics().running == 1  # admitted immediately (idle engine)
    ttft = t_sub + prefill_time(p, 2000)
    assert e.next_event_time() == pytest.approx(ttft, rel=1e-12)
    expected_finish = ttft + sum(decode_step(p, 2000 + g) for g in range(1, 256))
    outs = run_all(e)
    first, fin = by_id(outs)
    assert first["a"].time == pytest.approx(ttft, rel=1e-12)
    f = fin["a"]
    assert f.time == pytest.approx(expected_finish, rel=1e-12)
    assert (f.prompt_tokens, f.cached_tokens, f.completion_tokens) == (2000, 0, 256)
    assert e.next_event_time() is None
    m = e.metrics()
    assert (m.queued, m.running, m.completion_tokens_total, m.prompt_tokens_total) == (
        0,
        0,
        256,
        2000,
    )
    assert m.token_usage == 0.0  # only unreferenced cache left


def test_generated_tokens_streams_during_decode() -> None:
    p = REF
    e = SimEngine(p)
    e.submit(req("a", 2000, 100), 0.0)
    e.advance(0.0)
    assert e.generated_tokens("a", 0.1) == 0  # still in prefill
    ttft = prefill_time(p, 2000)
    e.advance(ttft)
    assert e.generated_tokens("a", ttft) == 1
    t10 = ttft + sum(decode_step(p, 2000 + g) for g in range(1, 11))  # 10 more steps
    assert e.generated_tokens("a", t10 - 1e-9) == 10
    assert e.generated_tokens("a", t10 + 1e-9) == 11
    assert e.generated_tokens("nope", t10) == 0
    e.advance(t10 + 1e-9)  # mid-segment advance keeps state consistent
    assert e.generated_tokens("a", t10 + 1e-9) == 11
    _, fin = by_id(run_all(e))
    assert fin["a"].time == pytest.approx(
        ttft + sum(decode_step(p, 2000 + g) for g in range(1, 100)), rel=1e-12
    )


def test_prefill_log_records_each_completed_prefill_step() -> None:
    e = SimEngine(REF)
    assert e.prefill_log is None  # off unless asked for
    e.prefill_log = []
    e.submit(req("a", 2000, 20), 0.0)
    e.advance(0.0)
    e.submit(req("b", 800, 5), 0.05)  # waits for the step boundary after 0.05
    first, _ = by_id(run_all(e))
    t_a = prefill_time(REF, 2000)
    assert e.prefill_log[0] == (0.0, pytest.approx(t_a, rel=1e-12))
    start_b, end_b = e.prefill_log[1]
    assert 0.05 < start_b < first["b"].time == end_b
    assert end_b - start_b == pytest.approx(prefill_time(REF, 800), rel=1e-9)
    assert len(e.prefill_log) == 2


def test_a_request_admitted_mid_decode_has_no_tokens_during_its_prefill() -> None:
    e = SimEngine(REF)
    e.submit(req("a", 2000, 200), 0.0)
    e.advance(0.0)
    e.submit(req("b", 3000, 20), 0.5)  # a has decoded for a while
    e.advance(0.5)
    start = e.next_event_time()
    assert start is not None
    e.advance(start)  # b's prefill starts at this step boundary
    assert e.generated_tokens("a", start) > 1
    assert e.generated_tokens("b", start + 0.01) == 0
    e.advance(start + prefill_time(REF, 3000))
    assert e.generated_tokens("b", start + prefill_time(REF, 3000)) == 1


def test_single_output_token_finishes_at_prefill_end() -> None:
    e = SimEngine(REF)
    e.submit(req("a", 160, 1), 0.0)
    outs = run_all(e)
    assert [type(o) for o in outs] == [FirstToken, Finished]
    assert outs[0].time == outs[1].time == pytest.approx(prefill_time(REF, 160))


def test_submit_validation() -> None:
    e = SimEngine(REF)
    e.submit(req("a", 100, 10), 0.0)
    with pytest.raises(ValueError, match="duplicate"):
        e.submit(req("a", 100, 10), 0.0)
    with pytest.raises(ValueError, match="never fit"):
        e.submit(req("big", REF.kv_pool_tokens - 100, 200), 0.0)
    with pytest.raises(ValueError):
        e.submit(dataclasses.replace(req("x", 100, 10), prompt_tokens=200), 0.0)
    with pytest.raises(ValueError):
        e.submit(req("y", 100, 20, max_new=10), 0.0)
    assert e.metrics().queued + e.metrics().running == 1


# --------------------------------------------------------------------------- prefix cache


def test_identical_prompt_hits_cache_and_prefills_faster() -> None:
    p = REF
    e = SimEngine(p)
    e.submit(req("a", 2000, 50, conv="c"), 0.0)
    _, fin = by_id(run_all(e))
    t1 = fin["a"].time + 1.0
    e.submit(req("b", 2000, 50, conv="c"), t1)
    first, fin = by_id(run_all(e))
    # All but the last token, which is computed for its logits (SGLang matches at most
    # len - 1 tokens): the hit rate never reads 100 %, and one token is prefilled.
    assert fin["b"].cached_tokens == 1999
    assert first["b"].time - t1 == pytest.approx(prefill_time(p, 1))
    # a partial match: first 100 blocks shared, rest new
    pb = blocks("c", 1600) + blocks("other", 400)
    e.submit(
        EngineRequest(
            request_id="c",
            prompt_blocks=pb,
            prompt_tokens=2000,
            output_tokens=5,
            max_new_tokens=5,
        ),
        100.0,
    )
    first, fin = by_id(run_all(e))
    assert fin["c"].cached_tokens == 1600
    assert first["c"].time - 100.0 == pytest.approx(prefill_time(p, 400))
    m = e.metrics()
    assert m.cached_tokens_total == 3599 and m.prompt_tokens_total == 6000
    assert m.cache_hit_rate == pytest.approx(3599 / 6000)


def test_running_requests_share_their_prefix() -> None:
    """Prompt blocks are cached at the end of prefill, so a concurrent request reuses them."""
    e = SimEngine(REF)
    e.submit(req("a", 2000, 200, conv="sys"), 0.0)
    e.advance(1.0)  # a's prefill done, decoding
    e.submit(req("b", 2400, 10, conv="sys"), 1.0)
    _, fin = by_id(run_all(e))
    assert fin["b"].cached_tokens == 2000


def test_output_blocks_cached_for_next_turn() -> None:
    e = SimEngine(REF)
    chain = blocks("conv", 2000 + 256 + 144)
    e.submit(
        EngineRequest(
            request_id="t0",
            prompt_blocks=chain[:125],
            prompt_tokens=2000,
            output_tokens=256,
            max_new_tokens=256,
            output_blocks=chain[125:141],
        ),
        0.0,
    )
    run_all(e)
    e.submit(
        EngineRequest(
            request_id="t1",
            prompt_blocks=chain,
            prompt_tokens=2400,
            output_tokens=10,
            max_new_tokens=256,
        ),
        30.0,
    )
    _, fin = by_id(run_all(e))
    assert fin["t1"].cached_tokens == 2256


def test_lru_eviction_trims_oldest_conversation_from_tail() -> None:
    p = dataclasses.replace(REF, kv_pool_tokens=4000)
    e = SimEngine(p)
    e.submit(req("x", 992, 10, conv="X", max_new=100), 0.0)  # 62 blocks
    run_all(e)
    e.submit(req("y", 992, 10, conv="Y", max_new=100), 10.0)  # 62 blocks, used later
    run_all(e)
    assert e.metrics().evicted_tokens_total == 0
    # Z needs 2400 + 100 = 2500 tokens; 4000 - 1984 = 2016 free -> evict 31 blocks.
    e.submit(req("z", 2400, 10, max_new=100), 20.0)
    e.advance(20.0)
    assert e.metrics().evicted_tokens_total == 31 * 16
    run_all(e)
    # X kept its head (31 blocks), so the 31 evicted blocks were X's tail and Y was untouched.
    e.submit(req("x2", 992, 10, conv="X", max_new=100), 30.0)
    _, fin = by_id(run_all(e))
    assert fin["x2"].cached_tokens == 31 * 16
    assert e.metrics().evicted_tokens_total == 62 * 16  # second admission evicted Y's tail
    e.submit(req("y2", 992, 10, conv="Y", max_new=100), 40.0)
    _, fin = by_id(run_all(e))
    assert fin["y2"].cached_tokens == 31 * 16


# --------------------------------------------------------------------------- batching


def test_batch_decode_tradeoff_4_vs_24() -> None:
    p = REF
    rates: dict[int, tuple[float, float]] = {}
    for n in (4, 24):
        e = SimEngine(p)
        for i in range(n):
            e.submit(req(f"r{i}", 2000, 300), 0.0)
        peak = 0
        outs: list[EngineOutput] = []
        while (t := e.next_event_time()) is not None:
            outs.extend(e.advance(t))
            peak = max(peak, e.metrics().running)
        first, fin = by_id(outs)
        assert peak == n and len(fin) == n
        # prefill steps run back to back first, then the whole batch decodes in lock step
        start = max(o.time for o in first.values())
        end = max(o.time for o in fin.values())
        assert min(o.time for o in fin.values()) == end
        expected = sum(decode_step(p, n * (2000 + g)) for g in range(1, 300))
        assert end - start == pytest.approx(expected, rel=1e-9)
        per_request = 299 / (end - start)
        rates[n] = (per_request, n * per_request)
    assert rates[24][0] < rates[4][0]  # per-request token rate lower
    assert rates[24][1] > 3 * rates[4][1]  # aggregate much higher


def test_running_never_exceeds_max_running() -> None:
    p = dataclasses.replace(REF, max_running_requests=3)
    e = SimEngine(p)
    for i in range(10):
        e.submit(req(f"r{i}", 100 + 16 * i, 20 + i), 0.01 * i)
        e.advance(0.01 * i)
    peak = 0
    while (t := e.next_event_time()) is not None:
        e.advance(t)
        e.check_invariants()
        m = e.metrics()
        assert m.running <= 3
        peak = max(peak, m.running)
        if m.running < 3:
            assert m.queued == 0 or peak == 3
    assert peak == 3
    assert e.metrics().completion_tokens_total == sum(20 + i for i in range(10))


def test_chunked_prefill_limits_one_step() -> None:
    p = REF
    e = SimEngine(p)
    for i in range(5):
        e.submit(req(f"r{i}", 2000, 5), 0.0)
    e.submit(req("huge", 10_000, 5), 0.0)
    first, _ = by_id(run_all(e))
    t1 = prefill_time(p, 8000)  # 4 x 2000 fit in 8192
    assert [first[f"r{i}"].time for i in range(4)] == [pytest.approx(t1)] * 4
    t2 = t1 + prefill_time(p, 2000)  # r4 alone: adding 'huge' would exceed the chunk
    assert first["r4"].time == pytest.approx(t2)
    assert first["huge"].time == pytest.approx(t2 + prefill_time(p, 10_000))


def test_request_submitted_mid_decode_waits_for_step_boundary() -> None:
    p = REF
    e = SimEngine(p)
    e.submit(req("a", 2000, 100), 0.0)
    ttft = prefill_time(p, 2000)
    e.advance(ttft)
    b1 = ttft + decode_step(p, 2001)
    b2 = b1 + decode_step(p, 2002)
    t_sub = (b1 + b2) / 2
    e.submit(req("b", 500, 5), t_sub)
    assert e.next_event_time() == pytest.approx(b2)
    first, _ = by_id(run_all(e))
    assert first["b"].time == pytest.approx(b2 + prefill_time(p, 500))


# --------------------------------------------------------------------------- KV pressure


def _small_pool(*, priority_scheduling: bool = False) -> EngineParams:
    return dataclasses.replace(REF, kv_pool_tokens=5000, priority_scheduling=priority_scheduling)


def test_kv_full_requests_wait_fcfs_no_skipping() -> None:
    e = SimEngine(_small_pool())
    e.submit(req("a", 2000, 100, max_new=256), 0.0)  # 2256
    e.submit(req("b", 2000, 200, max_new=256), 0.0)  # 2256 -> 488 left
    e.advance(0.0)
    e.submit(req("c", 2000, 10, max_new=256), 0.5)  # does not fit
    e.submit(req("d", 100, 10, max_new=16), 0.6)  # would fit (128), but c is ahead
    e.advance(0.6)
    t = e.next_event_time()
    assert t is not None
    e.advance(t + 0.5)
    m = e.metrics()
    assert m.queued == 2 and m.running == 2
    assert m.token_usage == pytest.approx(2 * 2256 / 5000)
    assert e.queued_tokens() == 2000 + 100  # c's and d's prompts
    first, fin = by_id(run_all(e))
    assert first["c"].time > fin["a"].time
    assert first["d"].time >= first["c"].time  # no skipping ahead


def test_priority_scheduling_orders_queue() -> None:
    e = SimEngine(_small_pool(priority_scheduling=True))
    e.submit(req("a", 2000, 100, max_new=256), 0.0)
    e.submit(req("b", 2000, 200, max_new=256), 0.0)
    e.advance(0.0)
    e.submit(req("c", 2000, 10, max_new=256), 0.5)
    e.submit(req("d", 100, 10, max_new=16, priority=5), 0.6)  # jumps the queue and fits
    first, fin = by_id(run_all(e))
    assert first["d"].time < fin["a"].time < first["c"].time
    # only one fits at a time: admission order follows priority, FCFS within equal priority
    e2 = SimEngine(dataclasses.replace(REF, kv_pool_tokens=2300, priority_scheduling=True))
    e2.submit(req("x", 2000, 50, max_new=256), 0.0)
    e2.advance(0.0)
    for i, prio in enumerate([0, 2, 1, 2, 0]):
        e2.submit(req(f"q{i}", 2000, 5, max_new=256, priority=prio), 0.1 + i * 0.01)
    outs = run_all(e2)
    order = [o.request_id for o in outs if isinstance(o, FirstToken)]
    assert order == ["x", "q1", "q3", "q2", "q0", "q4"]
    # without priority scheduling: plain FCFS
    e3 = SimEngine(dataclasses.replace(REF, kv_pool_tokens=2300))
    e3.submit(req("x", 2000, 50, max_new=256), 0.0)
    for i, prio in enumerate([0, 2, 1, 2, 0]):
        e3.submit(req(f"q{i}", 2000, 5, max_new=256, priority=prio), 0.1 + i * 0.01)
    order = [o.request_id for o in run_all(e3) if isinstance(o, FirstToken)]
    assert order == ["x", "q0", "q1", "q2", "q3", "q4"]


def test_low_priority_decode_cap_holds_batch_decode_back() -> None:
    """With the cap, lower-priority requests beyond it decode only in steps without a
    higher-priority request; their KV stays and they finish later.  Without it, every
    running request decodes in every step (the high one's steps read all their KV)."""
    cap0 = dataclasses.replace(REF, low_priority_decode_cap=0)
    cap1 = dataclasses.replace(REF, low_priority_decode_cap=1)
    ends: dict[int | None, dict[str, float]] = {}
    for p in (REF, cap0, cap1):
        e = SimEngine(p)
        e.submit(req("l1", 1000, 200), 0.0)
        e.submit(req("l2", 3000, 200), 0.0)
        e.advance(0.0)
        t_h = prefill_time(p, 4000) + 0.05  # mid-decode
        e.submit(req("h", 500, 50, priority=1), t_h)
        outs = e.advance(t_h)
        start = e.next_event_time()  # the next step boundary, where h's prefill begins
        assert start is not None
        outs += e.advance(start)
        h_first = start + prefill_time(p, 500)
        outs += e.advance(h_first)
        l1_done = e.generated_tokens("l1", h_first)
        l2_done = e.generated_tokens("l2", h_first)
        mid = h_first + 0.1  # h decodes 49 tokens in about 0.35 s
        outs += e.advance(mid)
        if p.low_priority_decode_cap is not None:
            # l2, held back, makes no progress while h decodes; l1 only under cap 1
            assert e.generated_tokens("l2", mid) == l2_done
            l1_steps = e.generated_tokens("l1", mid) - l1_done
            assert (l1_steps > 0) == (p.low_priority_decode_cap == 1)
        else:
            assert e.generated_tokens("l2", mid) > l2_done
        outs += run_all(e)
        first, fin = by_id(outs)
        assert first["h"].time == pytest.approx(h_first, rel=1e-12)
        ends[p.low_priority_decode_cap] = {r: fin[r].time for r in ("h", "l1", "l2")}
        if p.low_priority_decode_cap is None:
            continue
        # h decodes with at most `cap` of the low requests: l1, the first admitted
        with_l1 = p.low_priority_decode_cap == 1
        steps = sum(
            decode_step(p, 500 + g + (1000 + l1_done + g - 1 if with_l1 else 0))
            for g in range(1, 50)
        )
        assert fin["h"].time == pytest.approx(h_first + steps, rel=1e-9)
    assert ends[0]["h"] < ends[1]["h"] < ends[None]["h"]
    assert ends[None]["l2"] < ends[1]["l2"]
    assert ends[None]["l1"] < ends[0]["l1"] and ends[1]["l1"] == pytest.approx(
        ends[None]["l1"], abs=0.2
    )


def test_mixed_chunk_decodes_the_running_requests_in_prefill_steps() -> None:
    """SGLang's --enable-mixed-chunk: a prefill step also gives each running request a
    token, and lasts the longer of its compute and those requests' memory reads."""
    seen: dict[bool, tuple[float, float, int, int]] = {}
    for mixed in (False, True):
        p = dataclasses.replace(REF, mixed_chunk=mixed)
        e = SimEngine(p)
        e.submit(req("a", 6000, 100), 0.0)
        e.advance(0.0)
        e.submit(req("b", 3000, 5), 0.5)  # compute-bound: 0.2 s of prefill at half a GPU
        e.advance(0.5)
        start = e.next_event_time()
        assert start is not None
        e.advance(start)
        before = e.generated_tokens("a", start)
        end = start + prefill_time(p, 3000)  # compute is longer than a decode step here
        first, _ = by_id(e.advance(end))
        assert first["b"].time == pytest.approx(end, rel=1e-12)
        assert e.generated_tokens("a", end) == before + mixed
        # memory-bound: a 16-token prefill beside a's 6000+ tokens of KV
        e.submit(req("c", 16, 2), end + 0.001)
        e.advance(end + 0.001)
        c_start = e.next_event_time()
        assert c_start is not None
        e.advance(c_start)
        a_ctx = 6000 + e.generated_tokens("a", c_start)
        b_ctx = 3000 + e.generated_tokens("b", c_start)
        reads = p.weights_bytes + p.kv_bytes_per_token * (a_ctx + b_ctx)
        memory = p.step_overhead_s + reads / (p.bandwidth_bytes_per_s * p.gpu_share)
        step = max(memory, prefill_time(p, 16)) if mixed else prefill_time(p, 16)
        first, _ = by_id(e.advance(c_start + step))
        assert first["c"].time == pytest.approx(c_start + step, rel=1e-12)
        _, fin = by_id(run_all(e))
        seen[mixed] = (fin["a"].time, fin["b"].time, before, len(fin))
    # the tokens decoded in prefill steps are decode steps saved
    assert seen[True][0] < seen[False][0]
    assert seen[True][1] < seen[False][1]


def test_cancel_frees_space_for_queued_request() -> None:
    p = dataclasses.replace(REF, kv_pool_tokens=2600)
    e = SimEngine(p)
    e.submit(req("a", 2000, 500, max_new=500), 0.0)
    e.submit(req("b", 1000, 5, max_new=100), 0.0)
    e.advance(1.0)
    assert e.metrics().queued == 1 and e.metrics().running == 1
    assert not e.cancel("zzz", 1.0)
    assert e.cancel("a", 1.0)
    assert not e.cancel("a", 1.0)
    assert e.metrics().running == 0
    t = e.next_event_time()
    assert t is not None and 1.0 < t < 1.1  # at the boundary of the step in flight
    first, fin = by_id(run_all(e))
    assert "a" not in fin and first["b"].time < 1.5
    # a's prompt blocks stayed cached after the cancel; admitting b (1008 + 100 tokens into
    # 600 free) evicted 32 blocks from a's tail
    assert e.metrics().evicted_tokens_total == 32 * 16
    e.submit(req("a2", 2000, 5, conv="a"), 10.0)
    _, fin = by_id(run_all(e))
    assert fin["a2"].cached_tokens == 2000 - 32 * 16
    # cancel of a queued request
    e.submit(req("c", 2000, 500, max_new=500), 20.0)
    e.submit(req("d", 2000, 5, max_new=500), 20.0)
    assert e.cancel("d", 20.5)
    outs = run_all(e)
    assert {o.request_id for o in outs} == {"c"}
    assert e.next_event_time() is None


def test_cancel_only_request_goes_idle() -> None:
    e = SimEngine(REF)
    e.submit(req("a", 2000, 500), 0.0)
    e.advance(1.0)
    assert e.cancel("a", 1.0)
    assert e.next_event_time() is None
    assert e.advance(5.0) == []
    e.submit(req("b", 100, 2), 5.0)
    first, _ = by_id(run_all(e))
    assert first["b"].time == pytest.approx(5.0 + prefill_time(REF, 100))


# --------------------------------------------------------------------------- GPU share

FULL = dataclasses.replace(REF, gpu_share=1.0)


def test_busy_tracks_running_and_waiting() -> None:
    e = SimEngine(REF)
    assert not e.busy
    e.submit(req("a", 200, 5), 1.0)
    assert e.busy  # waiting, not yet admitted
    e.advance(1.0)
    assert e.busy and e.metrics().running == 1
    e.submit(req("b", 200, 50), 1.0)
    e.advance(1.0)
    assert e.cancel("b", 1.0)
    run_all(e)
    assert not e.busy
    e.submit(req("c", 200, 50), 10.0)
    assert e.busy
    assert e.cancel("c", 10.0)
    assert not e.busy


def test_set_gpu_share_validation() -> None:
    e = SimEngine(REF)
    assert e.gpu_share == 0.5
    for bad in (0.0, -0.5, 1.5, math.nan):
        with pytest.raises(ValueError):
            e.set_gpu_share(bad, 0.0)
    assert e.gpu_share == 0.5
    e.set_gpu_share(1.0, 0.0)
    assert e.gpu_share == 1.0
    assert REF.gpu_share == 0.5  # params keep the initial share


def test_lone_request_at_full_share_matches_formula() -> None:
    """A replica alone on the GPU gets the whole bandwidth and compute."""
    e = SimEngine(REF)
    e.set_gpu_share(1.0, 0.0)
    t_sub = 2.0
    e.submit(req("a", 2000, 256), t_sub)
    outs = run_all(e)
    first, fin = by_id(outs)
    ttft = t_sub + prefill_time(FULL, 2000)
    assert first["a"].time == pytest.approx(ttft, rel=1e-12)
    expected = ttft + sum(decode_step(FULL, 2000 + g) for g in range(1, 256))
    assert fin["a"].time == pytest.approx(expected, rel=1e-12)
    # nearly twice as fast as at half share (the per-step overhead does not scale)
    half = prefill_time(REF, 2000) + sum(decode_step(REF, 2000 + g) for g in range(1, 256))
    assert 1.8 < half / (expected - t_sub) < 2.0
    # bit-identical to an engine constructed with gpu_share=1.0
    e_full = SimEngine(FULL)
    e_full.submit(req("a", 2000, 256), t_sub)
    assert run_all(e_full) == outs


def test_share_change_mid_decode_retimes_remaining_steps() -> None:
    e = SimEngine(REF)
    e.submit(req("a", 2000, 100), 0.0)
    ttft = prefill_time(REF, 2000)
    b10 = ttft + sum(decode_step(REF, 2000 + g) for g in range(1, 11))
    # 30% into step 11 (context 2011), the other replica goes idle
    t_c = b10 + 0.3 * decode_step(REF, 2011)
    assert by_id(e.advance(t_c))[0]["a"].time == pytest.approx(ttft, rel=1e-12)
    e.set_gpu_share(1.0, t_c)
    assert e.generated_tokens("a", t_c) == 11
    b11 = t_c + 0.7 * decode_step(FULL, 2011)  # the remaining 70% at full share
    assert e.generated_tokens("a", b11 - 1e-9) == 11
    assert e.generated_tokens("a", b11 + 1e-9) == 12
    expected = b11 + sum(decode_step(FULL, 2000 + g) for g in range(12, 100))
    assert e.next_event_time() == pytest.approx(expected, rel=1e-12)
    # and back to half share 40% into step 50 (context 2050)
    b49 = b11 + sum(decode_step(FULL, 2000 + g) for g in range(12, 50))
    t_d = b49 + 0.4 * decode_step(FULL, 2050)
    assert e.advance(t_d) == []
    e.set_gpu_share(0.5, t_d)
    assert e.generated_tokens("a", t_d) == 50
    b50 = t_d + 0.6 * decode_step(REF, 2050)
    expected = b50 + sum(decode_step(REF, 2000 + g) for g in range(51, 100))
    _, fin = by_id(run_all(e))
    assert fin["a"].time == pytest.approx(expected, rel=1e-12)


def test_share_change_at_step_boundary_and_in_batch() -> None:
    """At a boundary the whole next step runs at the new share; a batch keeps its context."""
    e = SimEngine(REF)
    for i in range(3):
        e.submit(req(f"r{i}", 1000, 40 + 10 * i), 0.0)
    ttft = prefill_time(REF, 3000)
    e.advance(ttft)
    e.set_gpu_share(1.0, ttft)
    _, fin = by_id(run_all(e))
    # 3 running until r0 has 40 tokens, then 2 until r1 has 50, then r2 alone
    t = ttft + sum(decode_step(FULL, 3 * (1000 + g)) for g in range(1, 40))
    assert fin["r0"].time == pytest.approx(t, rel=1e-12)
    t += sum(decode_step(FULL, 2 * (1000 + g)) for g in range(40, 50))
    assert fin["r1"].time == pytest.approx(t, rel=1e-12)
    t += sum(decode_step(FULL, 1000 + g) for g in range(50, 60))
    assert fin["r2"].time == pytest.approx(t, rel=1e-12)


def test_share_change_after_cancel_in_same_step() -> None:
    """The step in flight keeps the batch it was launched with (incl. a cancelled request)."""
    e = SimEngine(REF)
    e.submit(req("a", 1000, 100), 0.0)
    e.submit(req("b", 1000, 100), 0.0)
    ttft = prefill_time(REF, 2000)
    b5 = ttft + sum(decode_step(REF, 2 * (1000 + g)) for g in range(1, 6))
    t_c = b5 + 0.5 * decode_step(REF, 2 * 1006)
    e.advance(t_c)
    assert e.cancel("b", t_c)
    e.set_gpu_share(1.0, t_c)
    b6 = t_c + 0.5 * decode_step(FULL, 2 * 1006)
    expected = b6 + sum(decode_step(FULL, 1000 + g) for g in range(7, 100))
    _, fin = by_id(run_all(e))
    assert set(fin) == {"a"}
    assert fin["a"].time == pytest.approx(expected, rel=1e-12)


def test_share_change_mid_prefill_retimes_remainder() -> None:
    e = SimEngine(REF)
    e.submit(req("a", 6000, 2), 0.0)
    e.advance(0.0)
    t_c = 0.25 * prefill_time(REF, 6000)
    e.set_gpu_share(1.0, t_c)
    ttft = t_c + 0.75 * prefill_time(FULL, 6000)
    assert e.next_event_time() == pytest.approx(ttft, rel=1e-12)
    first, fin = by_id(run_all(e))
    assert first["a"].time == pytest.approx(ttft, rel=1e-12)
    assert fin["a"].time == pytest.approx(ttft + decode_step(FULL, 6001), rel=1e-12)
    # a share change while idle applies to the next prefill
    e.set_gpu_share(0.25, 50.0)
    e.submit(req("b", 3000, 1), 60.0)
    first, _ = by_id(run_all(e))
    quarter = dataclasses.replace(REF, gpu_share=0.25)
    assert first["b"].time == pytest.approx(60.0 + prefill_time(quarter, 3000), rel=1e-12)


def test_set_same_share_is_a_no_op() -> None:
    script = [(0.0, req("a", 2000, 80)), (0.3, req("b", 3000, 60)), (0.7, req("c", 500, 30))]
    # mid-prefill, mid-decode, at submit times, after the end
    probes = [0.05, 0.2, 0.3, 0.31, 0.5, 0.7, 0.95, 1.4, 2.2, 50.0]

    def play(share: float, same_calls: bool) -> list[EngineOutput]:
        e = SimEngine(REF)
        e.set_gpu_share(share, 0.0)
        outs: list[EngineOutput] = []
        events = sorted([(t, 0, r) for t, r in script] + [(t, 1, None) for t in probes])
        for t, _, r in events:
            if r is not None:
                e.submit(r, t)
            elif same_calls:
                before = e.next_event_time()
                e.set_gpu_share(share, t)
                assert e.next_event_time() == before
            outs.extend(e.advance(t))
        outs.extend(run_all(e))
        return outs

    for share in (0.5, 1.0, 0.3):
        assert play(share, True) == play(share, False)


# --------------------------------------------------------------------------- time slicing

_op = st.tuples(
    st.floats(min_value=0.001, max_value=0.8),  # gap before this op
    st.integers(min_value=1, max_value=160),  # prompt blocks
    st.integers(min_value=1, max_value=120),  # output tokens
    st.integers(min_value=0, max_value=3),  # conversation (shared prefixes)
    st.integers(min_value=0, max_value=2),  # priority
    st.integers(min_value=0, max_value=6),  # 0: cancel an earlier request, else submit
)


_share_op = st.tuples(
    st.floats(min_value=0.0, max_value=12.0),  # time of the change
    st.sampled_from([0.5, 1.0, 0.25, 0.7]),
)


@settings(max_examples=80, deadline=None)
@given(
    ops=st.lists(_op, min_size=1, max_size=14),
    probes=st.lists(st.floats(min_value=0.0, max_value=40.0), max_size=30),
    prio=st.booleans(),
    small=st.booleans(),
    shares=st.lists(_share_op, max_size=12),
    decode_cap=st.sampled_from([None, 0, 1]),
    mixed=st.booleans(),
)
def test_time_slicing_is_consistent(
    ops: list[tuple[float, int, int, int, int, int]],
    probes: list[float],
    prio: bool,
    small: bool,
    shares: list[tuple[float, float]],
    decode_cap: int | None,
    mixed: bool,
) -> None:
    p = dataclasses.replace(
        REF,
        priority_scheduling=prio,
        low_priority_decode_cap=decode_cap,
        mixed_chunk=mixed,
        kv_pool_tokens=4000 if small else REF.kv_pool_tokens,
        max_running_requests=4 if small else 48,
        chunked_prefill_tokens=3000,
    )
    script: list[tuple[float, EngineRequest | str | float]] = []
    t = 0.0
    for i, (gap, nblocks, out, conv, priority, kind) in enumerate(ops):
        t += gap
        if kind == 0 and i > 0:
            script.append((t, f"r{(i * 7) % i}"))
        else:
            script.append(
                (t, req(f"r{i}", nblocks * 16 - 3, out, conv=conv, max_new=128, priority=priority))
            )
    # GPU share changes (float actions) interleaved at random times; stable sort keeps the
    # order of simultaneous actions
    script.extend(shares)
    script.sort(key=lambda s: s[0])

    def play(extra: list[float]) -> list[EngineOutput]:
        e = SimEngine(p)
        outs: list[EngineOutput] = []
        pending = sorted(extra)
        for when, action in script:
            while pending and pending[0] < when:
                outs.extend(e.advance(heapq.heappop(pending)))
                e.check_invariants()
            if isinstance(action, str):
                e.cancel(action, when)
            elif isinstance(action, float):
                e.set_gpu_share(action, when)
            else:
                e.submit(action, when)
            e.check_invariants()
            outs.extend(e.advance(when))  # the drivers' protocol: advance after each call
        for x in pending:
            outs.extend(e.advance(x))
        outs.extend(run_all(e))
        return outs

    baseline = play([])
    sliced = play(probes + [s[0] for s in script])  # also advance right at every op time
    assert sliced == baseline
    times = [o.time for o in sliced]
    assert times == sorted(times)
    firsts = [o.request_id for o in baseline if isinstance(o, FirstToken)]
    assert len(firsts) == len(set(firsts))


# --------------------------------------------------------------------------- workload


def run_agents(
    n_agents: int, duration: float, params: EngineParams
) -> tuple[SimEngine, int, int, float]:
    """Closed-loop agents: prompt 2000 tokens + 400 per turn, 256-token replies, 2 s pause.

    The reply's blocks continue the conversation chain, so the next turn's prompt (previous
    prompt + reply + 144 new tokens) hits the cache when it was not evicted.
    """
    e = SimEngine(params)
    turn = [0] * n_agents
    wakeups: list[tuple[float, int]] = [(0.05 * a, a) for a in range(n_agents)]
    heapq.heapify(wakeups)
    owner: dict[str, int] = {}
    finished_turns = 0
    tokens = 0
    now = 0.0
    while True:
        te = e.next_event_time()
        ta = wakeups[0][0] if wakeups else None
        if te is None and ta is None:
            break
        if ta is not None and (te is None or ta < te):
            now, a = heapq.heappop(wakeups)
            if now > duration:
                continue
            prompt = 2000 + 400 * turn[a]
            chain = blocks(("agent", a), prompt + 256)
            rid = f"a{a}t{turn[a]}"
            owner[rid] = a
            e.submit(
                EngineRequest(
                    request_id=rid,
                    prompt_blocks=chain[: prompt // 16],
                    prompt_tokens=prompt,
                    output_tokens=256,
                    max_new_tokens=256,
                    output_blocks=chain[prompt // 16 :],
                ),
                now,
            )
            outs = e.advance(now)
        else:
            assert te is not None
            now = te
            outs = e.advance(now)
        for o in outs:
            if isinstance(o, Finished):
                a = owner.pop(o.request_id)
                turn[a] += 1
                finished_turns += 1
                tokens += o.completion_tokens
                heapq.heappush(wakeups, (o.time + 2.0, a))
    return e, finished_turns, tokens, now


def test_agent_workload_is_fast_and_plausible() -> None:
    start = time.perf_counter()
    e, turns, tokens, end = run_agents(26, 180.0, REF)
    wall = time.perf_counter() - start
    m = e.metrics()
    print(
        f"\n26 agents x 180 s virtual: wall {wall:.3f}s, {turns} turns, {tokens} tokens, "
        f"{tokens / end:.0f} tok/s aggregate over {end:.1f}s, cache hit {m.cache_hit_rate:.2f}, "
        f"evicted {m.evicted_tokens_total} tokens"
    )
    assert wall < 10.0
    assert m.queued == 0 and m.running == 0
    assert turns > 26 * 3
    assert 100 < tokens / end < 2000  # a 1B model on half a laptop GPU
    # 26 growing conversations (2000 -> ~10k tokens) far exceed a 56k-token pool: LRU
    # thrashing, most prompts are prefilled again
    assert 0.0 < m.cache_hit_rate < 0.5
    assert m.evicted_tokens_total > 0


def test_few_agents_keep_their_prefix_cache() -> None:
    e, turns, tokens, end = run_agents(4, 180.0, REF)
    m = e.metrics()
    print(f"\n4 agents: {turns} turns, {tokens / end:.0f} tok/s, hit {m.cache_hit_rate:.2f}")
    assert m.evicted_tokens_total == 0
    assert m.cache_hit_rate > 0.9
    assert tokens / end < 4 * 1 / decode_step(REF, 2000)  # bounded by single-stream speed
