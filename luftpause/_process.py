"""Stopping a child process by its PID: SIGTERM, then SIGKILL if it does not exit in time.

Every process luftpause (or a test) starts is stopped through here, never by name.
"""

from __future__ import annotations

import os
import signal
import subprocess

__all__ = ["kill", "terminate"]


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
