"""Checkpoints: safetensors for tensors, a JSON sidecar for everything else.

Each checkpoint is a fresh folder ``checkpoints/round-NNNN``; once all its files are
written, ``checkpoints/latest.json`` is replaced atomically to point at it and older
folders are removed. A run killed at any moment leaves a complete checkpoint behind.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors.torch import load_file
from torch import Tensor

from fedkit.atomic import write_json, write_safetensors
from fedkit.errors import FedkitError
from fedkit.ledger import Ledger
from fedkit.seeding import rng_states, set_rng_states

if TYPE_CHECKING:
    from fedkit.engine import Run

FORMAT = 1


def _flatten(groups: dict[str, dict[str, Tensor]]) -> dict[str, Tensor]:
    return {f"{g}/{k}": v for g, tensors in groups.items() for k, v in tensors.items()}


def _unflatten(flat: dict[str, Tensor]) -> dict[str, dict[str, Tensor]]:
    groups: dict[str, dict[str, Tensor]] = {}
    for name, value in flat.items():
        group, key = name.split("/", 1)
        groups.setdefault(group, {})[key] = value
    return groups


def save(run: Run, root: Path, round: int) -> Path:
    """Write the state after ``round`` and point ``latest.json`` at it."""
    folder = root / "checkpoints" / f"round-{round:04d}"
    server = run.server
    write_safetensors(
        folder / "pool.safetensors", _flatten({str(i): s for i, s in enumerate(server.pool)})
    )
    write_safetensors(folder / "server.safetensors", server.tensors)
    write_safetensors(
        folder / "clients.safetensors", _flatten({str(c): s for c, s in run.store.items()})
    )
    sidecar = {
        "format": FORMAT,
        "round": round,
        "server_state": server.state,
        "clients": {str(c.id): c.meta() for c in run.clients},
        "ledger": server.ledger.to_rows(),
        "rng": rng_states(),
    }
    write_json(folder / "state.json", sidecar)
    write_json(root / "checkpoints" / "latest.json", {"round": round, "folder": folder.name})
    for old in (root / "checkpoints").glob("round-*"):
        if old.name != folder.name:
            shutil.rmtree(old, ignore_errors=True)
    return folder


def latest_round(root: Path) -> int:
    """The round of the newest complete checkpoint, 0 when there is none."""
    pointer = root / "checkpoints" / "latest.json"
    return json.loads(pointer.read_text())["round"] if pointer.exists() else 0


def load(run: Run, root: Path) -> int:
    """Restore a run from its newest checkpoint; returns the round it had finished."""
    pointer = json.loads((root / "checkpoints" / "latest.json").read_text())
    folder = root / "checkpoints" / pointer["folder"]
    sidecar: dict[str, Any] = json.loads((folder / "state.json").read_text())
    server = run.server
    pool = _unflatten(load_file(folder / "pool.safetensors"))
    server.pool = [pool.get(str(i), {}) for i in range(len(server.pool))]
    server.tensors = load_file(folder / "server.safetensors")
    server.state = sidecar["server_state"]
    server.ledger = Ledger(sidecar["ledger"])
    for cid, state in _unflatten(load_file(folder / "clients.safetensors")).items():
        run.store.put(int(cid), state)
    for client in run.clients:
        client.restore(sidecar["clients"][str(client.id)])
    set_rng_states(sidecar["rng"])
    server.round = sidecar["round"]
    return sidecar["round"]


def saved_part(root: Path, part: str, group: str = "0", file: str = "pool") -> dict[str, Tensor]:
    """One model part's state (keys without the ``part.`` prefix) from a run's newest
    checkpoint: cluster ``group`` of the pool, or client ``group`` with ``file="clients"``."""
    pointer = root / "checkpoints" / "latest.json"
    if not pointer.is_file():
        raise FedkitError(f"{root}: no checkpoint yet (checkpoints/latest.json is missing)")
    folder = root / "checkpoints" / json.loads(pointer.read_text())["folder"]
    prefix = f"{group}/{part}."
    tensors = load_file(folder / f"{file}.safetensors")
    state = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    if not state:
        raise FedkitError(f"{folder}: no {part} of {file} entry {group} in {file}.safetensors")
    return state
