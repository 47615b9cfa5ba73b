"""`bench.prompt_estimate` against the fake engine (the real numbers need a real
tokenizer: bench/RESULTS.md): every body is sent, counted and compared."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from luftpause.temporal_dev import free_port
from luftpause.up import Child, wait_http

ROOT = Path(__file__).resolve().parents[2]
EXE = str(Path(sys.executable).with_name("luftpause"))


def test_the_bench_compares_the_gateways_estimate_with_the_engines_count(tmp_path: Path) -> None:
    port = free_port()
    engine = Child("engine", [EXE, "fake-engine", "--port", str(port)], tmp_path / "e.log")
    try:
        engine.start()
        wait_http(f"http://127.0.0.1:{port}/health", "fake engine", engine)
        out = subprocess.run(
            [sys.executable, "-m", "bench.prompt_estimate", "--url", f"http://127.0.0.1:{port}",
             "--model-name", "llama-3.2-1b", "--json"],
            capture_output=True, text=True, timeout=120, cwd=ROOT,
        )  # fmt: skip
    finally:
        engine.stop()
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    rows = report["bodies"]
    assert list(rows) == ["prose-2k", "prose-8k", "code-8k", "chat-20", "agent"]
    for row in rows.values():
        assert row["estimate"] == row["bytes"] // 4  # text only: a quarter of the bytes
        assert row["engine"] > 0 and row["ratio"] == round(row["estimate"] / row["engine"], 3)
    assert rows["prose-8k"]["bytes"] > 4 * rows["prose-2k"]["bytes"] * 0.9
