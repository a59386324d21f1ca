"""Checkpoints: safetensors for tensors, a JSON sidecar for everything else.

Each checkpoint is a fresh folder ``checkpoints/round-NNNN``; once all its files are
written, ``checkpoints/latest.json`` is replaced atomically to point at it and older
folders are removed. A run killed at any moment leaves a complete checkpoint behind.
Round 0 is written right after initialisation, so work done once (``server.once``)
survives a kill during the first round.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors.torch import load_file
from torch import Tensor

from fedkit.atomic import write_json, write_safetensors
from fedkit.client import ClientMemory
from fedkit.errors import FedkitError
from fedkit.ledger import Ledger
from fedkit.seeding import rng_states, set_rng_states

if TYPE_CHECKING:
    from fedkit.engine import Run

FORMAT = 2
POINTER = Path("checkpoints") / "latest.json"


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
    memories = dict(run.executor.store.items())
    write_safetensors(
        folder / "pool.safetensors", _flatten({str(i): s for i, s in enumerate(server.pool)})
    )
    write_safetensors(folder / "server.safetensors", server.tensors)
    clients: dict[str, dict[str, Tensor]] = {}
    for cid, memory in memories.items():
        clients[f"{cid}/model"] = memory.model or {}
        clients[f"{cid}/tensors"] = memory.tensors
    write_safetensors(folder / "clients.safetensors", _flatten(clients))
    sidecar = {
        "format": FORMAT,
        "round": round,
        "server_state": server.state,
        "roster": {str(c.id): c.meta() for c in server.roster},
        "clients": {str(cid): m.meta() for cid, m in memories.items()},
        "ledger": server.ledger.to_rows(),
        "rng": rng_states(),
    }
    write_json(folder / "state.json", sidecar)
    write_json(root / POINTER, {"round": round, "folder": folder.name})
    for old in (root / "checkpoints").glob("round-*"):
        if old.name != folder.name:
            shutil.rmtree(old, ignore_errors=True)
    return folder


def latest_folder(root: Path) -> Path | None:
    """The newest complete checkpoint folder, ``None`` when there is none."""
    pointer = root / POINTER
    if not pointer.exists():
        return None
    return root / "checkpoints" / json.loads(pointer.read_text())["folder"]


def latest_round(root: Path) -> int | None:
    """The round of the newest complete checkpoint, ``None`` when there is none."""
    pointer = root / POINTER
    return json.loads(pointer.read_text())["round"] if pointer.exists() else None


@dataclass
class Snapshot:
    """A checkpoint read back: restored into a run in two steps (see ``engine.prepare``)."""

    round: int
    pool: dict[str, dict[str, Tensor]]
    server_tensors: dict[str, Tensor]
    server_state: dict[str, Any]
    sidecar: dict[str, Any]
    clients: dict[str, dict[str, Tensor]]

    def restore(self, run: Run) -> None:
        """Pool, what the server knows of clients, client memories, ledger, RNG states."""
        server = run.server
        server.pool = [self.pool.get(str(i), {}) for i in range(len(server.pool))]
        for info in server.roster:
            meta = self.sidecar["roster"][str(info.id)]
            info.participations, info.cluster = meta["participations"], meta["cluster"]
            info.last_round = meta["last_round"]
        for cid, meta in self.sidecar["clients"].items():
            model = self.clients.get(f"{cid}/model")
            memory = ClientMemory(
                model=model or None,
                tensors=self.clients.get(f"{cid}/tensors", {}),
                state=meta["state"],
                participations=meta["participations"],
                cluster=meta["cluster"],
            )
            run.executor.store.put(int(cid), memory)
        ledger = Ledger(self.sidecar["ledger"])
        ledger.model_keys, ledger.aux_patterns = (
            server.ledger.model_keys,
            server.ledger.aux_patterns,
        )
        server.ledger = ledger
        set_rng_states(self.sidecar["rng"])
        server.round = self.round


def read(root: Path) -> Snapshot | None:
    """The newest checkpoint of a run directory, ``None`` when it has none."""
    folder = latest_folder(root)
    if folder is None:
        return None
    sidecar: dict[str, Any] = json.loads((folder / "state.json").read_text())
    if sidecar.get("format") != FORMAT:
        raise FedkitError(
            f"{folder}: checkpoint format {sidecar.get('format')} was written by an older "
            f"fedkit; this version reads format {FORMAT} (start the run again)"
        )
    return Snapshot(
        round=sidecar["round"],
        pool=_unflatten(load_file(folder / "pool.safetensors")),
        server_tensors=load_file(folder / "server.safetensors"),
        server_state=sidecar["server_state"],
        sidecar=sidecar,
        clients=_unflatten_clients(load_file(folder / "clients.safetensors")),
    )


def _unflatten_clients(flat: dict[str, Tensor]) -> dict[str, dict[str, Tensor]]:
    """``<client>/<model|tensors>/<key>`` → ``{"<client>/<model|tensors>": {key: t}}``."""
    groups: dict[str, dict[str, Tensor]] = {}
    for name, value in flat.items():
        cid, kind, key = name.split("/", 2)
        groups.setdefault(f"{cid}/{kind}", {})[key] = value
    return groups


def saved_part(root: Path, part: str, group: str = "0", file: str = "pool") -> dict[str, Tensor]:
    """One model part's state (keys without the ``part.`` prefix) from a run's newest
    checkpoint: cluster ``group`` of the pool, client ``group``'s model with
    ``file="clients"``, or a kept result ``group`` (``server.once``) with ``file="server"``."""
    folder = latest_folder(root)
    if folder is None:
        raise FedkitError(f"{root}: no checkpoint yet (checkpoints/latest.json is missing)")
    if file == "clients":
        group = f"{group}/model"
    prefix = f"{group}/{part}." if part else f"{group}/"
    tensors = load_file(folder / f"{file}.safetensors")
    state = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    if not state:
        raise FedkitError(f"{folder}: no {part or group} of {file} entry {group}")
    return state
