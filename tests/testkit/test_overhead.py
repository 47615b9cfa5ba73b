"""`luftpause bench overhead` end to end: a tiny run through hey, its JSON report, and no
process of it left behind; plus its percentile and hey-CSV arithmetic."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from testkit.overhead import Arm, percentile
from tests.system import in_ci

ROOT = Path(__file__).resolve().parents[2]
# Bounds: the whole tiny run, and how long stopped children may take to be reaped.
RUN_TIMEOUT_S = 300
GONE_POLLS, GONE_POLL_S = 100, 0.02

# In CI the test runs even without hey, and fails on the bench's "install hey" error.
needs_hey = pytest.mark.skipif(
    shutil.which("hey") is None and not in_ci(),
    reason="hey is not installed (apt-get install hey; .ci/run installs it in CI)",
)


def _bench(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str, int]:
    """Run `luftpause bench ...` in a process group of its own; (code, out, err, pgid)."""
    cmd = [sys.executable, "-m", "luftpause", "bench", *args]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return proc.returncode, out, err, proc.pid


def _gone(alive: Any) -> bool:
    """True once `alive()` raises ProcessLookupError (bounded wait for reaping)."""
    for _ in range(GONE_POLLS):
        try:
            alive()
        except ProcessLookupError:
            return True
        time.sleep(GONE_POLL_S)
    return False


@needs_hey
def test_bench_overhead_reports_every_arm_and_leaves_no_process() -> None:
    code, out, err, pgid = _bench(
        "overhead", "--requests", "40", "--rounds", "2", "--warmup", "20", "--json"
    )
    assert code == 0, err
    report = json.loads(out)
    assert report["scenario"] == "overhead"

    arms = {(a["path"], a["stream"], a["concurrency"]): a for a in report["arms"]}
    want = {(p, s, c) for p in ("direct", "gateway") for s in (False, True) for c in (1, 20)}
    assert set(arms) == want
    for key, arm in arms.items():
        assert arm["requests"] == 40, key  # 2 rounds of 20, a multiple of c=20
        assert arm["ok"] == 40 and arm["errors"] == 0 and arm["status"] == {"200": 40}, key
        assert 0 < arm["p50_ms"] <= arm["p99_ms"] <= arm["max_ms"] < 20_000, key
        assert arm["mean_ms"] > 0 and arm["req_per_s"] > 0, key
        assert arm["server_cpu_ms_per_req"] >= 0, key

    added = {(d["path"], d["stream"], d["concurrency"]): d for d in report["added"]}
    assert set(added) == {k for k in want if k[0] == "gateway"}
    for (_, stream, c), d in added.items():
        gw, direct = arms[("gateway", stream, c)], arms[("direct", stream, c)]
        assert d["added_p50_ms"] == pytest.approx(gw["p50_ms"] - direct["p50_ms"], abs=1e-3)
        assert d["added_p99_ms"] == pytest.approx(gw["p99_ms"] - direct["p99_ms"], abs=1e-3)
    assert isinstance(report["goal"]["met"], bool)

    # Every process it started was stopped, by the PIDs it reports, and nothing of its
    # process group survives it.
    assert set(report["pids"]) == {"engine", "gateway"}
    for name, pid in report["pids"].items():
        assert _gone(lambda pid=pid: os.kill(pid, 0)), f"{name} (pid {pid}) still runs"
    assert _gone(lambda: os.killpg(pgid, 0)), "a process of the bench's group survived"


@needs_hey
def test_bench_overhead_measures_the_peer_routers_in_the_same_rounds() -> None:
    code, out, err, pgid = _bench(
        "overhead", "--requests", "20", "--rounds", "2", "--warmup", "0", "--concurrency", "1",
        "--peers", "cache_aware,smg_priority", "--json",
    )  # fmt: skip
    assert code == 0, err
    report = json.loads(out)
    assert report["peers"] == ["cache_aware", "smg_priority"]
    arms = {(a["path"], a["stream"]): a for a in report["arms"]}
    paths = ("direct", "gateway", "cache_aware", "smg_priority")
    assert set(arms) == {(p, s) for p in paths for s in (False, True)}
    for key, arm in arms.items():  # every router answered every request in front of it
        assert arm["ok"] == arm["requests"] == 20 and arm["errors"] == 0, key
        assert arm["server_cpu_ms_per_req"] >= 0, key
    added = {(d["path"], d["stream"]): d for d in report["added"]}
    assert set(added) == {(p, s) for p in paths[1:] for s in (False, True)}
    for (path, stream), d in added.items():
        there, direct = arms[(path, stream)], arms[("direct", stream)]
        assert d["added_p50_ms"] == pytest.approx(there["p50_ms"] - direct["p50_ms"], abs=1e-3)
    assert set(report["pids"]) == {"engine", *paths[1:]}
    for name, pid in report["pids"].items():
        assert _gone(lambda pid=pid: os.kill(pid, 0)), f"{name} (pid {pid}) still runs"
    assert _gone(lambda: os.killpg(pgid, 0)), "a process of the bench's group survived"


@pytest.mark.parametrize(
    ("peers", "says"),
    [("nginx", "unknown router 'nginx'"), ("cache_aware,cache_aware", "named twice")],
)
def test_bench_overhead_refuses_an_unknown_or_repeated_peer(peers: str, says: str) -> None:
    code, _, err, _ = _bench("overhead", "--peers", peers)
    assert code != 0 and says in err


def test_bench_without_hey_says_how_to_install_it(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": str(tmp_path)}  # an empty directory: no hey on PATH
    code, out, err, _ = _bench("overhead", "--requests", "1", env=env)
    assert code == 2 and not out
    assert "apt-get install hey" in err


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    assert percentile([7.0], 99) == 7.0


def test_arm_counts_missing_rows_and_other_statuses_as_errors() -> None:
    header = "response-time,DNS+dialup,DNS,Request-write,Response-delay,Response-read,"
    header += "status-code,offset\n"
    rows = [
        "0.0020,0,0,0,0,0,200,0.0000",
        "0.0040,0,0,0,0,0,200,0.0020",
        "0.0001,0,0,0,0,0,502,0.0060",
        "0.0001,0,0,0,0,0,502,0.0061",
        "0.0001,0,0,0,0,0,503,0.0062",
    ]
    arm = Arm("gateway", False, 1)
    arm.add(6, header + "\n".join(rows) + "\n", server_cpu_s=0.006)  # one request failed
    report = arm.report()
    assert (report["requests"], report["ok"], report["errors"]) == (6, 2, 4)
    assert report["status"] == {"200": 2, "502": 2, "503": 1}
    # Latency and rate are the answered requests': fast errors do not flatter them.
    assert (report["p50_ms"], report["p99_ms"], report["max_ms"]) == (2.0, 4.0, 4.0)
    assert report["req_per_s"] == pytest.approx(2 / 0.0063, rel=1e-3)
    assert report["server_cpu_ms_per_req"] == 1.0
