"""Checkpoints: verified, written in O(what changed), the last few kept.

Each checkpoint is a folder ``checkpoints/round-NNNN`` with the pool, the server's tensors
and ``state.json``, then ``state.sha256`` (the hash of ``state.json``), written last: a
folder is complete once that file is there, and it marks the folder as fedkit's. Client
memories are files of their own under ``clients/``, named by client and by the round that
produced them (``<client>.rNNNNNN.safetensors``): a checkpoint writes only those of
clients that trained since the last one. ``state.json`` records the SHA-256 of every file
the checkpoint relies on — its tensors, each client's file, each log's prefix — with the
resolved recipe and the format version. ``checkpoints/latest.json`` then points at the
folder. The newest ``keep`` complete checkpoints are kept; older folders, and client files
no kept checkpoint names, are removed (only files fedkit wrote: marked folders, files
named as fedkit names them).

``read`` verifies before trusting: it takes the newest checkpoint whose every hash
matches, says what was damaged in the newer ones, and stops with a clear error when none
is intact. Round 0 is written right after initialisation.

A run has an id (``checkpoints/run.json``, made with its first checkpoint) that every
checkpoint records: a checkpoint folder of another run copied into ``checkpoints/`` is
not this run's, so it is neither read nor pruned, and a note says so.
"""

from __future__ import annotations

import json
import re
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors.torch import load_file
from torch import Tensor

from fedkit.errors import FedkitError
from fedkit.rundir.atomic import write_bytes, write_json, write_safetensors
from fedkit.rundir.integrity import check_file, sha256_bytes
from fedkit.rundir.store import MEMORIES, SUFFIX, read_memory

FORMAT = 4
POINTER = Path("checkpoints") / "latest.json"
RUN_FILE = Path("checkpoints") / "run.json"
STATE, SEAL = "state.json", "state.sha256"
HELD = "held.safetensors"
FOLDER = re.compile(r"^round-(\d{4,})$")
RUN_ID = re.compile(r"[0-9a-f]{32}")
CLIENT_FILE = re.compile(r"^\d+\.r\d{6}" + re.escape(SUFFIX) + "$")


class CheckpointError(FedkitError):
    """No intact checkpoint to resume from."""


def run_id(root: Path) -> str | None:
    """The run's id, ``None`` for a run from before ids (or when the file is gone)."""
    try:
        value = json.loads((root / RUN_FILE).read_text())["run"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, str) and RUN_ID.fullmatch(value) else None


def _own_id(root: Path) -> str:
    """The run's id; a missing or damaged ``run.json`` is rebuilt from the checkpoint
    ``latest.json`` points at (this run wrote it), a new id only for a new run."""
    found = run_id(root)
    known = {r for p in _sealed(root) if (r := _folder_run(p)) is not None}
    if found is None or (known and found not in known):
        try:
            pointed = root / "checkpoints" / json.loads((root / POINTER).read_text())["folder"]
        except (OSError, ValueError, KeyError, TypeError):
            pointed = None
        found = (_folder_run(pointed) if pointed is not None else None) or uuid.uuid4().hex
        write_json(root / RUN_FILE, {"run": found})
    return found


def _folder_run(folder: Path) -> str | None:
    try:
        value = json.loads((folder / STATE).read_text()).get("run")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def foreign(root: Path) -> list[Path]:
    """Sealed checkpoint folders in ``checkpoints/`` that another run wrote."""
    own = run_id(root)
    if own is None:
        return []
    runs = {p: _folder_run(p) for p in _sealed(root)}
    if own not in runs.values():  # run.json names no checkpoint here: it is what is wrong
        return []
    return [p for p, theirs in runs.items() if theirs is not None and theirs != own]


def _flatten(groups: dict[str, dict[str, Tensor]]) -> dict[str, Tensor]:
    return {f"{g}/{k}": v for g, tensors in groups.items() for k, v in tensors.items()}


def _unflatten(flat: dict[str, Tensor]) -> dict[str, dict[str, Tensor]]:
    groups: dict[str, dict[str, Tensor]] = {}
    for name, value in flat.items():
        group, key = name.split("/", 1)
        groups.setdefault(group, {})[key] = value
    return groups


def save(
    root: Path,
    round: int,
    *,
    pool: list[dict[str, Tensor]],
    server_tensors: dict[str, Tensor],
    clients: dict[int, dict[str, str]],
    state: dict[str, Any],
    logs: dict[str, dict[str, Any]],
    keep: int,
    held: dict[str, Tensor] | None = None,
) -> Path:
    """Write the state after ``round`` and point ``latest.json`` at it: the pool, the
    server's tensors, ``clients`` (each client's memory file and hash, as the client side
    persisted them), the server side's JSON ``state`` (recipe, server state, roster,
    ledger totals, RNG states) and ``logs`` (the length and prefix hash of each log).
    ``held``: tensors the simulation holds between rounds (asynchronous jobs in flight),
    written to ``held.safetensors`` when there are any."""
    folder = root / "checkpoints" / f"round-{round:04d}"
    flat = _flatten({str(i): s for i, s in enumerate(pool)})
    files = {
        "pool.safetensors": write_safetensors(folder / "pool.safetensors", flat),
        "server.safetensors": write_safetensors(folder / "server.safetensors", server_tensors),
    }
    if held:
        files[HELD] = write_safetensors(folder / HELD, held)
    sidecar = {
        "format": FORMAT,
        "run": _own_id(root),
        "round": round,
        **state,
        "clients": {str(cid): entry for cid, entry in sorted(clients.items())},
        "files": files,
        "logs": logs,
    }
    digest = write_json(folder / STATE, sidecar)
    write_bytes(folder / SEAL, (digest + "\n").encode())
    write_json(root / POINTER, {"round": round, "folder": folder.name})
    prune(root, keep)
    return folder


def _sealed(root: Path) -> list[Path]:
    """Checkpoint folders fedkit wrote (sealed), newest first, whichever run's."""
    found = []
    for path in (root / "checkpoints").glob("round-*"):
        match = FOLDER.match(path.name)
        if match and path.is_dir() and (path / SEAL).is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found, reverse=True)]


def folders(root: Path) -> list[Path]:
    """This run's checkpoint folders (sealed), newest first."""
    others = set(foreign(root))
    return [path for path in _sealed(root) if path not in others]


def prune(root: Path, keep: int) -> None:
    """Keep the newest ``keep`` checkpoints and the client files they name."""
    kept, named = folders(root)[:keep], set()
    for path in folders(root)[keep:]:
        shutil.rmtree(path, ignore_errors=True)
    for path in kept:
        try:
            sidecar = json.loads((path / STATE).read_text())
            named.update(entry["file"] for entry in sidecar["clients"].values())
        except (OSError, ValueError, KeyError, TypeError):
            return  # a damaged kept checkpoint: remove nothing it might name
    for path in (root / MEMORIES).glob(f"*{SUFFIX}"):
        if CLIENT_FILE.match(path.name) and path.name not in named:
            path.unlink(missing_ok=True)


def problems(root: Path, folder: Path) -> tuple[list[str], dict[str, Any] | None]:
    """What is wrong with one checkpoint (nothing: it is intact), and its sidecar."""
    seal = folder / SEAL
    try:
        recorded = seal.read_text().strip()
        raw = (folder / STATE).read_bytes()
    except OSError as exc:
        return [f"{exc.filename}: {exc.strerror}"], None
    if sha256_bytes(raw) != recorded:
        return [f"{STATE} does not match its recorded hash"], None
    try:
        sidecar = json.loads(raw)
    except ValueError:
        return [f"{STATE} is not valid JSON"], None
    if sidecar.get("format") != FORMAT:
        return [f"format {sidecar.get('format')}, this fedkit reads format {FORMAT}"], sidecar
    found = [p for name, h in sidecar["files"].items() if (p := check_file(folder / name, h))]
    for cid, entry in sidecar["clients"].items():
        if entry.get("on_node"):
            continue  # kept by the client's own node, which checks the hash on resume
        problem = check_file(root / MEMORIES / entry["file"], entry["sha256"])
        if problem is not None:
            found.append(f"client {cid}'s memory: {problem}")
    return found, sidecar


@dataclass
class Snapshot:
    """A verified checkpoint: restored into a run in two steps (see ``engine.prepare``).
    ``notes`` say which newer checkpoints were damaged and skipped."""

    root: Path
    folder: Path
    round: int
    pool: dict[str, dict[str, Tensor]]
    server_tensors: dict[str, Tensor]
    server_state: dict[str, Any]
    sidecar: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)
    """The newer checkpoints skipped because they are damaged (also in ``notes``)."""
    held: dict[str, Tensor] = field(default_factory=dict)
    """What the simulation held between rounds (``save``'s ``held``)."""


def read(root: Path) -> Snapshot | None:
    """The newest intact checkpoint of a run directory (``None`` when it has none yet);
    damaged newer ones are skipped and named in ``notes``."""
    notes = [
        f"{path.relative_to(root)} was written by another run: it is not read, and this "
        "run never removes it (its own checkpoint of that round would replace it)"
        for path in foreign(root)
    ]
    damaged: list[str] = []
    candidates = folders(root)
    for folder in candidates:
        found, sidecar = problems(root, folder)
        if found or sidecar is None:
            damaged.append(f"{folder.relative_to(root)} is damaged: " + "; ".join(found))
            notes.append(damaged[-1])
            continue
        if damaged:
            notes.append(f"resuming from {folder.relative_to(root)} instead")
        return Snapshot(
            root=root,
            folder=folder,
            round=sidecar["round"],
            pool=_unflatten(load_file(folder / "pool.safetensors")),
            server_tensors=load_file(folder / "server.safetensors"),
            server_state=sidecar["server_state"],
            sidecar=sidecar,
            notes=notes,
            damaged=damaged,
            held=load_file(folder / HELD) if HELD in sidecar["files"] else {},
        )
    if candidates:
        raise CheckpointError(f"{root}: no intact checkpoint to resume from — " + " | ".join(notes))
    return None


def latest_folder(root: Path) -> Path | None:
    """The newest complete checkpoint folder, ``None`` when there is none."""
    found = folders(root)
    return found[0] if found else None


def latest_round(root: Path) -> int | None:
    """The round of the newest complete checkpoint, ``None`` when there is none."""
    folder = latest_folder(root)
    return int(FOLDER.match(folder.name).group(1)) if folder is not None else None


def _sidecar(root: Path, snapshot: Snapshot | None = None) -> tuple[Path, dict[str, Any]]:
    snapshot = snapshot if snapshot is not None else read(root)
    if snapshot is None:
        raise FedkitError(f"{root}: no checkpoint yet")
    return snapshot.folder, snapshot.sidecar


def personal_state(root: Path, client: int, snapshot: Snapshot | None = None) -> dict[str, Tensor]:
    """A client's personal model state in a run's newest intact checkpoint (or in
    ``snapshot``): its cluster's state with the keys the client kept (as personalised
    evaluation sees it)."""
    folder, sidecar = _sidecar(root, snapshot)
    entry = sidecar["clients"].get(str(client))
    if entry is None:
        raise FedkitError(f"{root}: client {client} has not trained in this run yet")
    if entry.get("on_node"):
        raise FedkitError(
            f"{root}: client {client}'s memory is kept on its own node (a Flower "
            "deployment), not in this run directory"
        )
    cluster = sidecar["roster"].get(str(client), {}).get("cluster") or 0
    pool = _unflatten(load_file(folder / "pool.safetensors")).get(str(cluster), {})
    return {**pool, **(read_memory(root / MEMORIES / entry["file"]).model or {})}


def saved_part(
    root: Path,
    part: str,
    group: str = "0",
    file: str = "pool",
    snapshot: Snapshot | None = None,
) -> dict[str, Tensor]:
    """One model part's state (keys without the ``part.`` prefix) from a run's newest
    intact checkpoint (or from ``snapshot``): cluster ``group`` of the pool, or a kept
    result ``group`` (``server.once``) with ``file="server"``."""
    folder, _ = _sidecar(root, snapshot)
    tensors = load_file(folder / f"{file}.safetensors")
    prefix = f"{group}/{part}." if part else f"{group}/"
    state = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    if not state:
        raise FedkitError(f"{folder}: no {part or group} in {file} entry {group}")
    return state
