"""Child processes by their PID: starting one that does not outlive its parent,
stopping one (SIGTERM, then SIGKILL if it does not exit in time) and reading the CPU
time it used; and, for a server process once it has started, freezing its heap.

Every process luftpause (or a test) starts is stopped through here, never by name.
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "cpu_seconds",
    "freeze_heap",
    "hold_hangups",
    "kill",
    "spawn",
    "take_held_hangups",
    "terminate",
]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
        return prctl
    except (OSError, AttributeError):  # pragma: no cover - a libc without prctl
        return None


# Looked up once, here: the child calls it between fork and exec, where it should do
# as little as it can.
_PRCTL = _prctl()


def _dies_with(parent: int) -> Callable[[], None]:
    def preexec() -> None:
        assert _PRCTL is not None
        if _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:  # pragma: no cover
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
        if os.getppid() != parent:
            # The parent died before the line above: nobody will stop this child.
            raise ChildProcessError("parent exited before the child started")

    return preexec


def spawn(argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """`subprocess.Popen` for a child luftpause stops itself: in a session of its own
    (Ctrl-C and a closed terminal reach only the parent, which stops its children in
    order), and, on Linux, sent SIGTERM by the kernel when its parent dies without
    stopping it (SIGKILL, the OOM killer), so no Temporal dev server or engine is left
    holding its ports.

    The kernel sends that signal when the *thread* that started the child ends, so it
    is asked for only from the main thread; a child started from another thread is
    stopped by its parent alone."""
    preexec = None
    if _PRCTL is not None and threading.current_thread() is threading.main_thread():
        preexec = _dies_with(os.getpid())
    return subprocess.Popen(argv, start_new_session=True, preexec_fn=preexec, **kwargs)


def terminate(proc: subprocess.Popen[bytes], timeout: float) -> int:
    """SIGTERM, wait up to `timeout`, then SIGKILL; the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill(proc)
    return proc.wait()


def kill(proc: subprocess.Popen[bytes]) -> int:
    """SIGKILL (a crash); the exit status."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    return proc.wait()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds (all threads) the process has used so far; None where
    /proc is not there to say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def freeze_heap() -> str:
    """Collect, then move every object the process holds out of the cyclic garbage
    collector's reach (`gc.freeze`); for a server once it has started.  A full
    collection stops the event loop while it walks every object it can reach: ~130k
    to ~150k of them are the imports, which live as long as the process.  Afterwards
    it walks only what came since.  Returns a line for the log that says what it did.
    Not for a process that builds servers again and again, as tests do: the garbage
    of each would stay."""
    started = time.perf_counter()
    gc.collect()
    before = time.perf_counter() - started
    gc.freeze()
    started = time.perf_counter()
    gc.collect()
    after = time.perf_counter() - started
    return (
        f"froze {gc.get_freeze_count():,} objects of the startup heap: a full garbage "
        f"collection took {before * 1000:.0f} ms before, {after * 1000:.1f} ms after"
    )


_held_hangups = 0


def _hold(signum: int, frame: object) -> None:
    global _held_hangups
    _held_hangups += 1


def hold_hangups() -> None:
    """A SIGHUP from now on is held, not the end of the process (its default action):
    a daemon that reloads on SIGHUP is sent one whenever its operator (systemd's
    ExecReload, a config reloader) likes, also while it starts or stops.  The server
    carries out what `take_held_hangups` counts once it can.  Main thread, POSIX only."""
    if hasattr(signal, "SIGHUP") and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGHUP, _hold)


def take_held_hangups() -> int:
    """The SIGHUPs held since the last call (see `hold_hangups`)."""
    global _held_hangups
    held, _held_hangups = _held_hangups, 0
    return held
