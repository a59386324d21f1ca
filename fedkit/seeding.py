"""Seeds derived from (run seed, round, client), so any client's round is reproducible alone."""

from __future__ import annotations

import contextlib
import hashlib
import random
from collections.abc import Iterator

import numpy as np
import torch


def derive(seed: int, *parts: int | str) -> int:
    """A 63-bit seed from the run seed and a path of parts (stable across processes)."""
    text = ":".join(str(p) for p in (seed, *parts))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def seed_everything(seed: int) -> torch.Generator:
    """Seed python, numpy and torch; return a fresh CPU generator with the same seed.

    Seeds the CPU generator (and CUDA's, where present) directly: ``torch.manual_seed``
    also queues seeds for every other backend (0.29 ms against 0.02 ms a call, paid per
    client)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    return torch.Generator().manual_seed(seed)


def rng_states() -> dict:
    """The global RNG states, JSON-serialisable (for checkpoint sidecars)."""
    py = random.getstate()
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
        "torch": torch.get_rng_state().tolist(),
    }


def set_rng_states(states: dict) -> None:
    """Restore what ``rng_states`` saved."""
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(states["torch"], dtype=torch.uint8))


@contextlib.contextmanager
def isolated_rng() -> Iterator[None]:
    """Run a block without disturbing the global python, numpy and torch RNGs: whatever
    it draws, the streams continue afterwards as if it had not run."""
    saved = rng_states()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            set_rng_states(saved)
