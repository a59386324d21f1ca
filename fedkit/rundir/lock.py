"""One writer per run directory: an advisory lock file holding the owner's pid.

``fedkit run`` (fresh or ``--resume``) holds ``run.lock`` in the run directory for as
long as it runs, with ``fcntl.flock``, and removes it when it ends; the kernel releases
the lock of a killed process too, so a file left by a kill -9 never blocks a resume. A
second writer — another ``fedkit run --out`` on the same directory, or a ``--resume`` of
a live run — is refused with the owner's pid.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from types import TracebackType

from fedkit.errors import FedkitError

LOCK = "run.lock"


class RunLock:
    """``with RunLock(out):`` — exclusive ownership of a run directory."""

    def __init__(self, out: Path) -> None:
        self.path = Path(out) / LOCK
        self.handle: int | None = None

    def __enter__(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(handle, 64, 0).decode(errors="replace").strip() or "?"
            os.close(handle)
            raise FedkitError(
                f"{self.path.parent} is in use by another fedkit process (pid {owner}); "
                "wait for it to finish, or stop it, before writing to this run"
            ) from None
        os.ftruncate(handle, 0)
        os.pwrite(handle, f"{os.getpid()}\n".encode(), 0)
        self.handle = handle
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self.handle is not None:
            self.path.unlink(missing_ok=True)  # while still held: no one else owns it now
            fcntl.flock(self.handle, fcntl.LOCK_UN)
            os.close(self.handle)
            self.handle = None
