"""`luftpause bench temporal` end to end, tiny: its JSON has both arms and sane numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

EXE = str(Path(sys.executable).parent / "luftpause")


def test_bench_temporal_reports_both_arms() -> None:
    out = subprocess.run(
        [EXE, "bench", "temporal", "--runs", "3", "--warmup", "1", "--tool-calls", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["scenario"] == "temporal"
    assert (report["runs"], report["turns_per_run"], report["tool_calls_per_run"]) == (3, 2, 1)
    for arm in ("direct_run_ms", "workflow_run_ms"):
        assert 0 < report[arm]["p50"] <= report[arm]["p90"]
    added = report["added_ms_per_turn"]
    assert added["p50"] <= added["p90"]
    assert report["goal_met"] == (added["p50"] <= report["goal_ms_per_turn"])


def test_bench_rejects_bad_bounds() -> None:
    out = subprocess.run(
        [EXE, "bench", "temporal", "--runs", "0"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "--runs 1..10000" in out.stderr


def test_bench_mcp_reports_both_protocol_generations() -> None:
    out = subprocess.run(
        [EXE, "bench", "mcp", "--calls", "3", "--json"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["calls"] == 3
    assert {m: r["protocol"] for m, r in report["modes"].items()} == {
        "legacy": "2025-11-25",
        "2026-07-28": "2026-07-28",
    }
    assert all(0 < r["p50_ms"] <= r["p99_ms"] for r in report["modes"].values())
