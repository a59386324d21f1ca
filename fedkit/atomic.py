"""Atomic file writes: write a temporary file beside the target, fsync, then rename."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from safetensors.torch import save as save_tensors
from torch import Tensor


def write_bytes(path: str | Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that readers see the old or the new file, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text(path: str | Path, text: str) -> None:
    write_bytes(path, text.encode())


def write_json(path: str | Path, value: Any) -> None:
    write_text(path, json.dumps(value, indent=2, sort_keys=True) + "\n")


def write_jsonl(path: str | Path, rows: list[dict[str, Any]]) -> None:
    write_text(path, "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))


def write_safetensors(
    path: str | Path, tensors: dict[str, Tensor], metadata: dict[str, str] | None = None
) -> None:
    """Save tensors (copied contiguous, on the CPU) as a safetensors file, atomically."""
    flat = {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}
    write_bytes(path, save_tensors(flat, metadata=metadata))
