"""The scheduler's core compiled with mypyc (luftpause/native.py): built by `make test`,
deciding exactly as the interpreted core does, and never run stale."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from luftpause import native
from testkit.trace import digest
from tests.system import missing_tool

ROOT = Path(__file__).resolve().parents[2]


def _require_compiled() -> None:
    build = native.core_build()
    if build != "compiled":
        missing_tool(f"the scheduler's core runs {build} (`make core` compiles it; needs gcc)")


def test_make_test_runs_the_compiled_core() -> None:
    _require_compiled()
    import scheduler._core
    import scheduler._persistent

    for module in (scheduler._core, scheduler._persistent):
        assert module.__file__ is not None and module.__file__.endswith(".so"), module.__file__


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_compiled_and_interpreted_cores_decide_alike(tmp_path: Path, seed: int) -> None:
    """The same seeded trace (every kind of event, contract violations, pool and policy
    changes, clock jumps past every timer) in this process, compiled, and in another,
    interpreted from a copy of the sources and with another hash seed."""
    _require_compiled()
    copy = tmp_path / "scheduler"
    copy.mkdir()
    for source in (ROOT / "scheduler").glob("*.py"):
        shutil.copy(source, copy)
    code = (
        "import scheduler._core, testkit.trace as t; "
        "assert scheduler._core.__file__.endswith('.py'), scheduler._core.__file__; "
        f"print(t.digest({seed}, 3000))"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "PYTHONHASHSEED": str(100 + seed)}
    interpreted = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert interpreted.returncode == 0, interpreted.stderr
    assert interpreted.stdout.strip() == digest(seed, 3000)


def test_an_extension_older_than_its_source_is_stale(tmp_path: Path) -> None:
    """What keeps the suite (conftest) and the servers from running old code."""
    pkg = tmp_path / "scheduler"
    pkg.mkdir()
    suffix = native._SUFFIX
    for name in ("_core", "_persistent", "_mypyc__mypyc"):
        (pkg / f"{name}{suffix}").write_bytes(b"")
    (pkg / "_core.py").write_text("")
    (pkg / "_persistent.py").write_text("")
    os.utime(pkg / "_core.py", (1_000, 1_000))
    os.utime(pkg / f"_core{suffix}", (2_000, 2_000))
    os.utime(pkg / "_persistent.py", (3_000, 3_000))  # changed after its build
    os.utime(pkg / f"_persistent{suffix}", (2_000, 2_000))
    assert native.stale(tmp_path) == ["scheduler/_persistent.py"]
    (pkg / "_core.py").unlink()  # an extension whose source is gone
    assert native.stale(tmp_path) == ["scheduler/_core.py", "scheduler/_persistent.py"]


def test_the_build_leaves_the_core_compiled_and_current() -> None:
    """`make core` ran before the suite (the conftest stops on a stale build)."""
    _require_compiled()
    assert native.stale() == []
    assert {p.name.split(".")[0] for p in native.extensions()} == {
        "_core",
        "_persistent",
        "_mypyc__mypyc",
    }


def test_bench_core_compare_runs_each_arm_on_its_own_core() -> None:
    """bench/core_compare.py builds each arm apart from the checkout's own build."""
    _require_compiled()
    from bench.core_compare import compare

    before = {p.name: p.stat().st_mtime for p in native.extensions()}
    report = compare(["HEAD:py", ".:mypyc"], rounds=1, decisions=600)
    arms = report["arms"]
    assert arms["HEAD:py"]["core"] == "interpreted"
    assert arms[".:mypyc"]["core"] == "compiled"
    assert all(len(a["decisions_per_s"]) == 1 for a in arms.values())
    assert arms["HEAD:py"]["vs_first"] == 1.0
    assert {p.name: p.stat().st_mtime for p in native.extensions()} == before
