"""A stable identity for this member on this host, for exactly-once's ``transactional.id`` (``Service``)."""

from __future__ import annotations

import fcntl
import re
import socket
import tempfile
from pathlib import Path
from typing import IO


class MemberSlot:
    """A stable identity for this member on this host: the lowest slot number no live process of the same
    group holds, kept by an exclusive lock on a file until the process exits (or ``close``).

    A restarted member gets its slot back (the kernel released its predecessor's lock), so
    ``transactional_id`` names the same producer across restarts: the new instance fences its own zombie at
    ``init_transactions`` and aborts its open transaction at once, instead of read_committed readers waiting
    out ``transaction.timeout.ms``. Several members on one host get different slots.
    """

    def __init__(self, group_id: str, directory: Path | None = None) -> None:
        self._directory = Path(directory or tempfile.gettempdir())
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", group_id)
        self._file: IO[bytes] | None = None
        self.slot = 0
        while True:
            handle = open(self._directory / f"kinference-{safe}.slot{self.slot}.lock", "ab")  # noqa: SIM115
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                handle.close()
                self.slot += 1
                continue
            self._file = handle
            return

    def transactional_id(self, group_id: str) -> str:
        return f"kinference-{group_id}-{socket.gethostname()}-{self.slot}"

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
