"""The persistent containers against plain Python models of them."""

from __future__ import annotations

from math import isqrt

import pytest
from hypothesis import given
from hypothesis import strategies as st

from luftpause import native
from scheduler import RunPhase, RunState, ServiceClass
from scheduler._persistent import PSortedSet, empty
from tests.system import missing_tool

keys = st.tuples(st.integers(0, 30), st.integers(0, 500), st.text("abc", max_size=2))


@given(st.lists(st.tuples(st.booleans(), keys), max_size=400))
def test_sorted_set_matches_a_sorted_list(ops: list[tuple[bool, tuple[int, int, str]]]) -> None:
    s: PSortedSet[tuple[int, int, str]] = empty()
    model: set[tuple[int, int, str]] = set()
    versions = []
    for add, key in ops:
        if add and key not in model:
            s = s.add(key)
            model.add(key)
        elif not add and key in model:
            s = s.remove(key)
            model.discard(key)
        versions.append((s, sorted(model)))
        assert list(s) == sorted(model)
        assert len(s) == len(model)
        assert bool(s) == bool(model)
        if model:
            assert s.min() == min(model)
        assert (key in s) == (key in model)
    # every earlier version is intact (persistence)
    for version, expected in versions:
        assert list(version) == expected


def test_sorted_set_errors() -> None:
    s: PSortedSet[tuple[int]] = empty()
    with pytest.raises(ValueError):
        s.min()
    with pytest.raises(KeyError):
        s.remove((1,))
    s = s.add((1,))
    with pytest.raises(KeyError):
        s.remove((2,))


def test_sorted_set_splits_and_stays_ordered_at_scale() -> None:
    s: PSortedSet[tuple[int]] = empty()
    for i in range(0, 5000, 2):
        s = s.add((i,))
    for i in range(4999, 0, -2):
        s = s.add((i,))
    assert list(s) == [(i,) for i in range(5000)]
    for i in range(0, 5000, 3):
        s = s.remove((i,))
    assert list(s) == [(i,) for i in range(5000) if i % 3]
    assert s.min() == (1,)


def test_chunks_grow_with_the_set_so_an_update_copies_about_sqrt_n() -> None:
    # A timer takes its entries at the end and loses them anywhere: with chunks of a
    # fixed 32 keys, each update copied a tuple of n/32 chunk references.
    s: PSortedSet[tuple[float, str]] = empty()
    n = 40_000
    for i in range(n):
        s = s.add((float(i), f"run{i}"))
    chunks = s._chunks
    assert sum(len(c) for c in chunks) == n
    assert len(chunks) < 4 * isqrt(n), len(chunks)  # n / 32 would be 1,250
    assert max(len(c) for c in chunks) <= 2 * isqrt(n)
    for i in range(0, n, 2):
        s = s.remove((float(i), f"run{i}"))
    assert list(s) == [(float(i), f"run{i}") for i in range(1, n, 2)]
    assert s.min() == (1.0, "run1")


def _run(**changes: object) -> RunState:
    run = RunState(
        "r", ServiceClass.BATCH, "c", "m", RunPhase.PAUSED, "a", 0, 2_000, 256, 1.0, True,
        2_256, False,
    )  # fmt: skip
    return run._replace(**changes)


def test_a_record_is_a_value_as_a_named_tuple_was() -> None:
    run = _run()
    assert run == _run() and hash(run) == hash(_run())
    assert run != _run(retrying=True) and run != _run()._values()
    assert repr(run).startswith("RunState(run_id='r', service_class=<ServiceClass.BATCH")
    assert repr(run).endswith(
        "retrying=False, home_outcome='', first_cached=-1, side=None, turn='')"
    )
    changed = run._replace(phase=RunPhase.IDLE, in_flight=2)
    assert (changed.phase, changed.in_flight, changed.context_tokens) == (RunPhase.IDLE, 2, 2_000)
    assert (run.phase, run.in_flight) == (RunPhase.PAUSED, 0)  # the original is unchanged
    with pytest.raises(TypeError, match=r"no fields \['phse'\]"):
        run._replace(phse=RunPhase.IDLE)
    # _FIELDS lists the fields in the order of __init__ (what equality and repr read).
    assert RunState(*run._values()) == run


def test_a_compiled_record_cannot_be_changed_in_place() -> None:
    """Interpreted, mypy's Final rejects an assignment; compiled, the attribute itself."""
    if native.core_build() != "compiled":
        missing_tool("the core runs interpreted (`make core` compiles it)")
    run = _run()
    with pytest.raises(AttributeError, match="not writable"):
        run.in_flight = 3  # type: ignore[misc]
    assert run.in_flight == 0
