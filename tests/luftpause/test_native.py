"""The scheduler's core compiled with mypyc (luftpause/native.py): built by `make test`,
deciding exactly as the interpreted core does, and never run stale."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from bench.core_compare import compare, prepare
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
    import scheduler._types

    for module in (scheduler._core, scheduler._persistent):
        where = module.__file__ or ""
        assert where.startswith(str(ROOT / "build/native/scheduler/")), where
        assert where.endswith(".so"), where
    assert scheduler._types.__file__ == str(ROOT / "scheduler/_types.py")


# (seed, events, runs, callers): small pools of runs and callers meet each other's
# turns often; many make held-turn orders and timers of several chunks each.
TRACES = [(0, 3_000, 25, 5), (1, 3_000, 25, 5), (2, 3_000, 25, 5), (3, 6_000, 2_000, 400)]


@pytest.mark.parametrize("trace", TRACES, ids=[str(t[0]) for t in TRACES])
def test_compiled_and_interpreted_cores_decide_alike(
    tmp_path: Path, trace: tuple[int, int, int, int]
) -> None:
    """The same seeded trace (every kind of event, contract violations, pool and policy
    changes, clock jumps past every timer) in this process, compiled, and in another,
    interpreted from a copy of the sources and with another hash seed."""
    _require_compiled()
    prepare(".:py", tmp_path)  # this checkout's scheduler/*.py, as bench.core_compare does
    code = (
        "import scheduler._core, testkit.trace as t; "
        "assert scheduler._core.__file__.endswith('.py'), scheduler._core.__file__; "
        f"print(t.digest{trace})"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "PYTHONHASHSEED": str(100 + trace[0])}
    interpreted = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert interpreted.returncode == 0, interpreted.stderr
    assert interpreted.stdout.strip() == digest(*trace)


def test_an_extension_older_than_a_source_of_the_core_is_stale(tmp_path: Path) -> None:
    """What keeps the suite (conftest) and the gateway from running old code."""
    src, out = tmp_path / "scheduler", tmp_path / "build/native/scheduler"
    src.mkdir()
    out.mkdir(parents=True)
    suffix = native._SUFFIX
    for name in ("_core", "_persistent", "_mypyc__mypyc"):
        (out / f"{name}{suffix}").write_bytes(b"")
        os.utime(out / f"{name}{suffix}", (2_000, 2_000))
    for name in ("_core", "_persistent", "_types", "__init__"):
        (src / f"{name}.py").write_text("")
        os.utime(src / f"{name}.py", (1_000, 1_000))
    assert native.stale(tmp_path) == []
    os.utime(src / "__init__.py", (3_000, 3_000))  # not compiled, nor compiled against
    assert native.stale(tmp_path) == []
    os.utime(src / "_types.py", (3_000, 3_000))  # the compiled core is built against it
    assert native.stale(tmp_path) == ["scheduler/_types.py"]
    os.utime(src / "_persistent.py", (3_000, 3_000))
    assert native.stale(tmp_path) == ["scheduler/_persistent.py", "scheduler/_types.py"]
    (src / "_core.py").unlink()  # an extension whose source is gone
    assert native.stale(tmp_path) == [
        "scheduler/_core.py",
        "scheduler/_persistent.py",
        "scheduler/_types.py",
    ]


def test_the_build_leaves_the_core_compiled_and_current() -> None:
    """`make core` ran before the suite (the conftest stops on a stale build)."""
    _require_compiled()
    assert native.stale() == []
    built = native.extensions()
    assert {p.name.split(".")[0] for p in built} == {"_core", "_persistent", "_mypyc__mypyc"}
    # Out of the package: a checkout of an older revision does not look there.
    assert {p.parent for p in built} == {ROOT / "build/native/scheduler"}


def test_bench_core_compare_runs_each_arm_on_its_own_core() -> None:
    """bench/core_compare.py builds each arm apart from the checkout's own build."""
    _require_compiled()

    before = {p.name: p.stat().st_mtime for p in native.extensions()}
    report = compare(["HEAD:py", ".:mypyc"], rounds=1, decisions=600)
    arms = report["arms"]
    assert arms["HEAD:py"]["core"] == "interpreted"
    assert arms[".:mypyc"]["core"] == "compiled"
    assert all(len(a["decisions_per_s"]) == 1 for a in arms.values())
    assert arms["HEAD:py"]["vs_first"] == 1.0
    assert {p.name: p.stat().st_mtime for p in native.extensions()} == before


def test_a_wheel_built_with_mypy_carries_the_compiled_core(tmp_path: Path) -> None:
    """deploy/Dockerfile's build stage: `pip wheel --no-build-isolation` where mypy is
    installed compiles the core into the wheel (setup.py), beside its sources."""
    _require_compiled()  # the compiler is there
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src)
    junk = shutil.ignore_patterns("__pycache__", "*.so", "build")
    # The distribution's packages, as pyproject finds them (and the Dockerfile copies).
    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for package in found["packages"]["find"]["include"]:
        shutil.copytree(ROOT / package.rstrip("*"), src / package.rstrip("*"), ignore=junk)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    wheels = tmp_path / "wheels"
    built = subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(wheels), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = wheels.glob("luftpause-*.whl")
    with zipfile.ZipFile(wheel) as z:
        compiled = sorted(n for n in z.namelist() if n.endswith(".so"))
    assert [n.split(".")[0] for n in compiled] == [
        "scheduler/_core",
        "scheduler/_mypyc__mypyc",
        "scheduler/_persistent",
    ]
    site = tmp_path / "site"
    installed = subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    code = (
        "import scheduler._core as c; from luftpause.native import core_build; "
        "print(core_build()); print(c.__file__)"
    )
    ran = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,  # not the checkout
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
    )
    assert ran.returncode == 0, ran.stderr
    build, where = ran.stdout.split()
    assert build == "compiled" and where.startswith(str(site / "scheduler")), ran.stdout
