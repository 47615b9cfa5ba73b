"""bench-core for several versions of the scheduler's core, alternated in one sitting.

    .venv/bin/python -m bench.core_compare [--rounds 5] [--decisions 100000] ARM ...

An ARM is SOURCE:MODE.  SOURCE is `.` (this checkout's working tree) or a git revision;
MODE is `mypyc` (compiled, as `make` builds it; the default) or `py` (interpreted).  E.g.
`c62d8ff:py .:py .:mypyc`.  Each arm's `scheduler/` is copied (or `git archive`d) into a
temporary directory and, for `mypyc`, compiled there (luftpause/native.py), so the
checkout's own build is never touched.  Each round runs every arm once, each run a fresh
process (`bench_core` from this checkout's testkit), the order rotating from round to
round; the machine is noisy, so compare arms by the ratio of their medians, never with
a number from another sitting.  Prints a table, or one JSON object with `--json`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from luftpause import native

ROOT = native.ROOT
_RUN = (
    "import json, scheduler._core as c; from testkit.sim._report import bench_core; "
    "r = bench_core(decisions={decisions}); r['file'] = c.__file__; print(json.dumps(r))"
)


def _source(source: str, into: Path) -> None:
    """`scheduler/*.py` of the working tree or of a revision, into `into/scheduler`."""
    target = into / "scheduler"
    target.mkdir(parents=True)
    if source == ".":
        for path in (ROOT / "scheduler").glob("*.py"):
            shutil.copy(path, target)
        return
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", source, "scheduler"],
        capture_output=True,
        check=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")


def prepare(arm: str, into: Path) -> Path:
    source, _, mode = arm.partition(":")
    mode = mode or "mypyc"
    if mode not in ("mypyc", "py"):
        raise SystemExit(f"bench.core_compare: {arm!r}: the mode is mypyc or py")
    _source(source, into)
    if mode == "mypyc":
        with contextlib.redirect_stdout(sys.stderr):  # mypyc's notes; stdout is the report
            # In place: a revision from before build/native was looked in finds it there.
            native.build(into, inplace=True)
    return into


def run(directory: Path, decisions: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(directory), str(ROOT)])}
    out = subprocess.run(
        [sys.executable, "-c", _RUN.format(decisions=decisions)],
        cwd=directory,  # not the checkout: its scheduler/ would come first
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    result: dict[str, Any] = json.loads(out)
    if not result.pop("file").startswith(str(directory)):
        raise RuntimeError(f"{directory}: the run imported another scheduler")
    return result


def compare(arms: list[str], rounds: int, decisions: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="core-compare-") as tmp:
        dirs = {arm: prepare(arm, Path(tmp) / f"arm{i}") for i, arm in enumerate(arms)}
        runs: dict[str, list[int]] = {arm: [] for arm in arms}
        cores: dict[str, str] = {}
        for r in range(rounds):
            order = arms[r % len(arms) :] + arms[: r % len(arms)]
            for arm in order:
                result = run(dirs[arm], decisions)
                runs[arm].append(result["decisions_per_s"])
                cores[arm] = result["core"]
    first = statistics.median(runs[arms[0]])
    return {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}",
        "decisions": decisions,
        "rounds": rounds,
        "arms": {
            arm: {
                "core": cores[arm],
                "decisions_per_s": runs[arm],
                "median": statistics.median(runs[arm]),
                "vs_first": round(statistics.median(runs[arm]) / first, 3),
            }
            for arm in arms
        },
    }


def table(report: dict[str, Any]) -> str:
    lines = [
        f"bench_core(decisions={report['decisions']}), {report['rounds']} rounds, alternated; "
        f"{report['machine']}",
        f"{'arm':<24} {'core':<12} {'median/s':>10} {'vs first':>9}  runs",
    ]
    for arm, a in report["arms"].items():
        runs = " / ".join(f"{v:,}" for v in a["decisions_per_s"])
        lines.append(
            f"{arm:<24} {a['core']:<12} {a['median']:>10,.0f} {a['vs_first']:>8.3f}x  {runs}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.core_compare", description=__doc__)
    p.add_argument("arms", nargs="+", metavar="ARM", help="SOURCE[:MODE], e.g. c62d8ff:py")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--decisions", type=int, default=100_000)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    report = compare(args.arms, args.rounds, args.decisions)
    print(json.dumps(report, indent=2) if args.json else table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
