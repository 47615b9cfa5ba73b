"""System tools some tests need (hey, node/npm, docker-compose): one rule for all.

`.ci/run` installs them and exports `CI=true`, so in CI a missing tool fails the test.
On a developer's machine without the tool the test is skipped, saying what to install.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

__all__ = ["in_ci", "missing_tool"]


def in_ci() -> bool:
    """Running under CI (`.ci/run` sets CI=true; most CI systems set CI too)."""
    return os.environ.get("CI", "").lower() not in ("", "0", "false")


def missing_tool(message: str) -> NoReturn:
    """A system tool is absent: fail in CI, where nothing may be skipped; skip elsewhere."""
    if in_ci():
        pytest.fail(f"{message} (CI must run this test: .ci/run installs the tool)")
    pytest.skip(message)
