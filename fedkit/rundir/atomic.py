"""Atomic file writes: write a temporary file beside the target, fsync, then rename.

Every writer returns the SHA-256 of what it wrote, so a checkpoint can record the hash of
each file it relies on. Temporary files are named ``.<target>.<random>.tmp``;
``remove_temporary`` deletes the ones a killed process left behind. Files get the mode an
ordinary write would give them (0666 less the umask), not the 0600 of a temporary file, so
colleagues the umask lets read a run directory can report, evaluate and resume it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

TEMPORARY = re.compile(r"^\..+\.[A-Za-z0-9_]+\.tmp$")


def _umask() -> int:
    """The process's umask (read once, at import: setting it back and forth is not
    thread-safe)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


UMASK = _umask()
FILE_MODE = 0o666 & ~UMASK
"""The mode of every file fedkit writes: what ``open(path, "w")`` would give."""
DIR_MODE = 0o777 & ~UMASK


def write_bytes(path: str | Path, data: bytes) -> str:
    """Replace ``path`` with ``data`` so that readers see the old or the new file, never
    half; returns the SHA-256 of ``data``."""
    return _replace(path, [data])


def write_chunks(path: str | Path, chunks: Iterable[str]) -> str:
    """``write_text`` of the text the chunks make, streamed to the temporary file (a
    large file is never one string in memory); returns its SHA-256."""
    return _replace(path, (chunk.encode() for chunk in chunks))


def _replace(path: str | Path, pieces: Iterable[bytes]) -> str:
    """Write ``pieces`` to a temporary file beside ``path``, sync it, and move it over
    ``path``; the SHA-256 of what was written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    digest = hashlib.sha256()
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as handle:
            for piece in pieces:
                digest.update(piece)
                handle.write(piece)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        if exc.filename is None:  # a failed write names no file: name the one written
            raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return digest.hexdigest()


def write_text(path: str | Path, text: str) -> str:
    return write_bytes(path, text.encode())


def write_json(path: str | Path, value: Any) -> str:
    return write_text(path, json.dumps(value, indent=2, sort_keys=True) + "\n")


def write_safetensors(
    path: str | Path, tensors: dict[str, Tensor], metadata: dict[str, str] | None = None
) -> str:
    """Save tensors (copied contiguous, on the CPU) as a safetensors file, atomically."""
    from safetensors.torch import save as save_tensors

    flat = {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}
    return write_bytes(path, save_tensors(flat, metadata=metadata))


def remove_temporary(folder: Path) -> list[Path]:
    """Delete the temporary files interrupted atomic writes left in ``folder`` (not below)."""
    removed = []
    for path in Path(folder).glob(".*.tmp"):
        if path.is_file() and TEMPORARY.match(path.name):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed
