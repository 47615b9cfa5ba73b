"""Child processes a test starts and waits for: stopped by their PID however the wait
ends (its timeout, a failure, the test cancelled), never left running."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess

__all__ = ["communicate", "communicate_sync"]


async def communicate(proc: asyncio.subprocess.Process, timeout: float) -> tuple[bytes, bytes]:
    """`proc.communicate()` within `timeout` seconds; on any way out but its end, the
    process is killed (SIGKILL to its PID) and reaped before the error goes on."""
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except BaseException:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        await proc.wait()
        raise
    return out or b"", err or b""


def communicate_sync(proc: subprocess.Popen[bytes], timeout: float) -> tuple[bytes, bytes]:
    """As `communicate`, for a process started with `subprocess.Popen`."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return out or b"", err or b""
