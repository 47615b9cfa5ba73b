"""The installed `luftpause` works from any directory: every package it runs is part of
the distribution, not just importable because the tests run from the checkout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize("command", ["sim", "fake-engine", "gateway", "up"])
def test_every_subcommand_imports_outside_the_checkout(tmp_path: Path, command: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-m", "luftpause", command, "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "usage: luftpause" in out.stdout


def test_gateway_modules_are_in_the_distribution(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = "import gateway.app, gateway.prober, scheduler, testkit.fake_engine, luftpause.config"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
