"""Checkpoints: safetensors for tensors, a JSON sidecar for everything else, written in
O(what changed).

Each checkpoint is a fresh folder ``checkpoints/round-NNNN`` with the pool, the server's
tensors and ``state.json``. Client memories are files of their own under ``clients/``,
named by client and by the round that produced them (``<client>.rNNNNNN.safetensors``):
a checkpoint writes only those of clients that trained since the last one, and its
``state.json`` names the file each client is at. Once a checkpoint folder is complete,
``checkpoints/latest.json`` is replaced atomically to point at it; then older folders and
client files no checkpoint names are removed. A run killed at any moment leaves a
complete checkpoint behind. Round 0 is written right after initialisation, so work done
once (``server.once``) survives a kill during the first round.
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
from fedkit.errors import FedkitError
from fedkit.seeding import rng_states, set_rng_states
from fedkit.state_store import SUFFIX, read_memory

if TYPE_CHECKING:
    from fedkit.engine import Run

FORMAT = 3
POINTER = Path("checkpoints") / "latest.json"
CLIENTS = "clients"


def _flatten(groups: dict[str, dict[str, Tensor]]) -> dict[str, Tensor]:
    return {f"{g}/{k}": v for g, tensors in groups.items() for k, v in tensors.items()}


def _unflatten(flat: dict[str, Tensor]) -> dict[str, dict[str, Tensor]]:
    groups: dict[str, dict[str, Tensor]] = {}
    for name, value in flat.items():
        group, key = name.split("/", 1)
        groups.setdefault(group, {})[key] = value
    return groups


def save(run: Run, root: Path, round: int, logs: dict[str, int]) -> Path:
    """Write the state after ``round`` (client memories that changed, pool, server) and
    point ``latest.json`` at it; ``logs`` are the lengths of the run's append-only logs."""
    folder = root / "checkpoints" / f"round-{round:04d}"
    server = run.server
    manifest = run.executor.store.persist(root / CLIENTS)
    write_safetensors(
        folder / "pool.safetensors", _flatten({str(i): s for i, s in enumerate(server.pool)})
    )
    write_safetensors(folder / "server.safetensors", server.tensors)
    sidecar = {
        "format": FORMAT,
        "round": round,
        "server_state": server.state,
        "roster": {str(c.id): c.meta() for c in server.roster if c.participations},
        "clients": {str(cid): name for cid, name in sorted(manifest.items())},
        "ledger": server.ledger.flushed,
        "logs": logs,
        "rng": rng_states(),
    }
    write_json(folder / "state.json", sidecar)
    write_json(root / POINTER, {"round": round, "folder": folder.name})
    for old in (root / "checkpoints").glob("round-*"):
        if old.name != folder.name:
            shutil.rmtree(old, ignore_errors=True)
    collect(root, sidecar["clients"])
    return folder


def collect(root: Path, manifest: dict[str, str]) -> None:
    """Remove client files the newest checkpoint does not name (older versions, and ones
    written after it by a run that was then killed)."""
    keep = set(manifest.values())
    for path in (root / CLIENTS).glob(f"*{SUFFIX}"):
        if path.name not in keep:
            path.unlink(missing_ok=True)


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

    root: Path
    round: int
    pool: dict[str, dict[str, Tensor]]
    server_tensors: dict[str, Tensor]
    server_state: dict[str, Any]
    sidecar: dict[str, Any]

    def restore(self, run: Run) -> None:
        """Pool, what the server knows of clients, client memories, ledger, RNG states."""
        server = run.server
        server.pool = [self.pool.get(str(i), {}) for i in range(len(server.pool))]
        for cid, meta in self.sidecar["roster"].items():
            info = server.roster[int(cid)]
            info.participations, info.cluster = meta["participations"], meta["cluster"]
            info.last_round = meta["last_round"]
        manifest = {int(cid): name for cid, name in self.sidecar["clients"].items()}
        run.executor.store.adopt(self.root / CLIENTS, manifest)
        server.ledger.rows.clear()
        server.ledger.flushed = dict(self.sidecar["ledger"])
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
            f"{folder}: checkpoint format {sidecar.get('format')} was written by another "
            f"fedkit version; this one reads format {FORMAT} (start the run again)"
        )
    return Snapshot(
        root=root,
        round=sidecar["round"],
        pool=_unflatten(load_file(folder / "pool.safetensors")),
        server_tensors=load_file(folder / "server.safetensors"),
        server_state=sidecar["server_state"],
        sidecar=sidecar,
    )


def personal_state(root: Path, client: int) -> dict[str, Tensor]:
    """A client's personal model state in a run's newest checkpoint: its cluster's state
    with the keys the client kept (as personalised evaluation sees it)."""
    folder = latest_folder(root)
    if folder is None:
        raise FedkitError(f"{root}: no checkpoint yet (checkpoints/latest.json is missing)")
    sidecar = json.loads((folder / "state.json").read_text())
    name = sidecar["clients"].get(str(client))
    if name is None:
        raise FedkitError(f"{root}: client {client} has not trained in this run yet")
    cluster = sidecar["roster"].get(str(client), {}).get("cluster") or 0
    pool = _unflatten(load_file(folder / "pool.safetensors")).get(str(cluster), {})
    return {**pool, **(read_memory(root / CLIENTS / name).model or {})}


def saved_part(root: Path, part: str, group: str = "0", file: str = "pool") -> dict[str, Tensor]:
    """One model part's state (keys without the ``part.`` prefix) from a run's newest
    checkpoint: cluster ``group`` of the pool, the model client ``group`` kept with
    ``file="clients"``, or a kept result ``group`` (``server.once``) with ``file="server"``."""
    folder = latest_folder(root)
    if folder is None:
        raise FedkitError(f"{root}: no checkpoint yet (checkpoints/latest.json is missing)")
    if file == "clients":
        name = json.loads((folder / "state.json").read_text())["clients"].get(group)
        tensors = read_memory(root / CLIENTS / name).model or {} if name else {}
        prefix = f"{part}."
    else:
        tensors = load_file(folder / f"{file}.safetensors")
        prefix = f"{group}/{part}." if part else f"{group}/"
    state = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    if not state:
        raise FedkitError(f"{folder}: no {part or group} in {file} entry {group}")
    return state
