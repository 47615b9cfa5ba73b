"""Child processes by their PID: stopping one (SIGTERM, then SIGKILL if it does not exit
in time) and reading the CPU time it used.

Every process luftpause (or a test) starts is stopped through here, never by name.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

__all__ = ["cpu_seconds", "kill", "terminate"]


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
