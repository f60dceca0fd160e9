"""Child processes a test starts itself (a broker, a fake S3): wait until they answer, and stop them by PID."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable


def until_answering(process: subprocess.Popen, probe: Callable[[], object], timeout_s: float = 30,
                    pause_s: float = 0.1) -> None:
    """Call ``probe`` until it returns without raising; its last error once ``timeout_s`` passed or the process
    exited."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            probe()
            return
        except Exception:
            if time.monotonic() > deadline or process.poll() is not None:
                raise
            time.sleep(pause_s)


def stop(process: subprocess.Popen, signum: int = signal.SIGINT, timeout_s: float = 10) -> None:
    """``signum``, then SIGKILL if it has not exited within ``timeout_s``."""
    process.send_signal(signum)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
