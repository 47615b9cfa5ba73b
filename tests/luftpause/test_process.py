"""Children that do not outlive their parent: `luftpause._process.spawn` asks the kernel
to stop a child whose parent died without stopping it (SIGKILL, the OOM killer)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from luftpause._process import spawn

# The child reads its own parent-death signal (prctl PR_GET_PDEATHSIG) and prints it.
READ_PDEATHSIG = """
import ctypes, signal
libc = ctypes.CDLL(None, use_errno=True)
sig = ctypes.c_int()
assert libc.prctl(2, ctypes.byref(sig), 0, 0, 0) == 0
print(sig.value, flush=True)
"""


def wait_gone(pids: Iterable[int], timeout: float) -> set[int]:
    """Wait until these processes (not children of this one) exit; those still alive."""
    fds = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            continue  # gone (and reaped) already
    try:
        left = dict(fds)
        deadline = time.monotonic() + timeout
        while left:
            ready, _, _ = select.select(list(left), [], [], max(deadline - time.monotonic(), 0))
            if not ready:
                break
            for fd in ready:
                del left[fd]
        return set(left.values())
    finally:
        for fd in fds:
            os.close(fd)


def leave_nothing(proc: subprocess.Popen[str], orphan: int | None) -> None:
    """After a test: the process it started, and the orphan it watched (killed only if
    the test failed), are gone; their pipes closed."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    if orphan is not None and wait_gone([orphan], 0):
        os.kill(orphan, signal.SIGKILL)
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            stream.close()


def run_child(argv: list[str]) -> str:
    proc = spawn(argv, stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    return out.decode().strip()


def test_a_child_started_from_the_main_thread_is_stopped_when_its_parent_dies() -> None:
    assert run_child([sys.executable, "-c", READ_PDEATHSIG]) == str(int(signal.SIGTERM))


def test_a_child_started_from_another_thread_is_not_tied_to_that_thread() -> None:
    # The kernel sends the signal when the starting *thread* ends: a child started by a
    # short-lived thread would be killed with it, so none is asked for there.
    got: list[str] = []
    t = threading.Thread(
        target=lambda: got.append(run_child([sys.executable, "-c", READ_PDEATHSIG]))
    )
    t.start()
    t.join(60)
    assert got == ["0"]


def test_a_child_has_a_session_of_its_own() -> None:
    # Ctrl-C in a terminal reaches the parent only, which stops its children in order.
    out = run_child([sys.executable, "-c", "import os; print(os.getsid(0) == os.getpid())"])
    assert out == "True"


# A parent that starts a Temporal dev server the way `luftpause up` and the tests do,
# says the server's PID, and waits to be killed.
PARENT = """
import sys, time
from luftpause.temporal_dev import DevServer
server = DevServer()
server.start()
print(server.process.pid, flush=True)
sys.stdin.read()
"""


def test_a_dev_server_does_not_outlive_a_killed_parent() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    server = None
    try:
        assert parent.stdout is not None
        server = int(parent.stdout.readline())
        assert wait_gone([server], 0) == {server}  # it is running
        parent.kill()  # SIGKILL: the parent gets no chance to stop it
        parent.wait()
        assert wait_gone([server], 30) == set()
    finally:
        leave_nothing(parent, server)


# A test session whose fixture started a process the plain way (as many tests start a
# gateway) and tears it down; it says the process's PID and blocks.
SESSION = """
import subprocess, sys
import pytest

@pytest.fixture
def child():
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,  # else an orphan keeps the session's output open
    )
    yield proc
    proc.terminate()
    proc.wait()
    print("TORN DOWN", flush=True)

def test_blocks(child):
    # Said here, not in the fixture: a signal between the fixture's print and its
    # yield would end the setup, which has no teardown to run.
    print("CHILD", child.pid, flush=True)
    sys.stdin.read()
"""


def test_sigterm_to_a_test_session_stops_what_its_fixtures_started(tmp_path: Path) -> None:
    (tmp_path / "test_session.py").write_text(SESSION)
    conftest = Path(__file__).resolve().parents[1] / "conftest.py"
    session = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-s", "-q", "-p", "no:cacheprovider", "-p",
         "tests.conftest", str(tmp_path / "test_session.py")],
        cwd=conftest.parents[1],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    child = None
    try:
        assert session.stdout is not None
        for line in session.stdout:
            if line.startswith("CHILD "):
                child = int(line.split()[1])
                break
        assert child is not None, "the session never started its child"
        session.send_signal(signal.SIGTERM)
        rest = session.stdout.read()
        session.wait(60)
        assert "TORN DOWN" in rest, rest
        assert wait_gone([child], 10) == set()
    finally:
        leave_nothing(session, child)
