"""The core is sans-I/O: it imports nothing that reads clocks, randomness, sockets or
files, and nothing of the shells around it."""

from __future__ import annotations

import ast
from pathlib import Path

import scheduler

FORBIDDEN = {
    "asyncio", "time", "datetime", "random", "secrets", "socket", "os", "io", "pathlib",
    "threading", "subprocess", "logging", "httpx", "fastapi", "starlette", "uvicorn",
    "temporalio", "mcp", "gateway", "worker", "workflows", "activities", "testkit",
}  # fmt: skip


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_scheduler_core_imports_no_io_clock_or_randomness() -> None:
    root = Path(scheduler.__file__).parent
    core = [p for p in root.glob("*.py")]
    assert {p.name for p in core} >= {"_core.py", "_types.py", "_persistent.py"}
    for path in core:
        bad = _imports(path) & FORBIDDEN
        assert not bad, f"{path.name} imports {sorted(bad)}"
