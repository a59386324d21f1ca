"""Content hashes: what a checkpoint records of every file it relies on, and checks on
load, so damaged data is found and never used (git's object hashes are the model)."""

from __future__ import annotations

import hashlib
from pathlib import Path

CHUNK = 1 << 20


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path, length: int | None = None) -> str:
    """The SHA-256 of a file (of its first ``length`` bytes when given)."""
    digest = hashlib.sha256()
    remaining = length
    with Path(path).open("rb") as handle:
        while remaining is None or remaining > 0:
            block = handle.read(CHUNK if remaining is None else min(CHUNK, remaining))
            if not block:
                break
            digest.update(block)
            if remaining is not None:
                remaining -= len(block)
    return digest.hexdigest()


def check_file(path: Path, expected: str, length: int | None = None) -> str | None:
    """``None`` when ``path`` (or its first ``length`` bytes) hashes to ``expected``,
    else what is wrong with it, in a few words."""
    if not path.is_file():
        return f"{path.name} is missing"
    if length is not None and path.stat().st_size < length:
        return f"{path.name} is shorter than recorded ({path.stat().st_size} < {length} bytes)"
    if sha256_file(path, length) != expected:
        return f"{path.name} does not match its recorded hash"
    return None
