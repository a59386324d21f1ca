"""What every client keeps between rounds (``ClientMemory``), by client id.

Executors talk to the ``StateStore`` protocol only. Two stores:

* ``MemoryStore`` keeps every memory in a dict (small runs);
* ``DiskStore`` writes each memory to its own safetensors file under a folder as soon as
  it is put, and keeps only the most recently used ones in memory (``cache`` of them), so
  memory stays flat however many clients there are.

A memory holds only what must persist: the model keys a client keeps (private keys and
the keys plugins declare in ``kept_keys``), its tensors and its JSON values. Each store
remembers which clients changed since the last checkpoint (``changed``), so a checkpoint
writes those alone (``fedkit.rundir.checkpoint``); files are named ``<client>.r<round>`` by the
round that produced them, and a checkpoint's manifest says which file each client is at.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Iterator
from copy import deepcopy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from safetensors.torch import load as load_tensors
from safetensors.torch import load_file, safe_open
from safetensors.torch import save as save_tensors
from torch import Tensor

from fedkit.rundir.atomic import write_safetensors

SUFFIX = ".safetensors"
MEMORIES = "clients"
"""The folder of a run directory that holds client memories."""


@dataclass
class ClientMemory:
    """What a client keeps between rounds (in the client's store, checkpointed).

    ``model`` is its model state after its last round, its kept keys only (``None`` before
    its first); ``tensors`` and ``state`` are what plugins keep through ``ctx.tensors``
    and ``ctx.state``.
    """

    model: dict[str, Tensor] | None = None
    tensors: dict[str, Tensor] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    participations: int = 0
    cluster: int | None = None

    def copy(self) -> ClientMemory:
        """A copy whose JSON values and tensor dict can change without touching this one
        (the tensors themselves are shared: hooks replace them, they do not write in place)."""
        state, tensors = deepcopy(self.state), dict(self.tensors)
        return ClientMemory(self.model, tensors, state, self.participations, self.cluster)

    def meta(self) -> dict[str, Any]:
        """The JSON part (checkpoint sidecar)."""
        return {"state": self.state, "participations": self.participations, "cluster": self.cluster}


def memory_file(client: int, version: int) -> str:
    """The file name of a client's memory as it was after round ``version``."""
    return f"{client}.r{version:06d}{SUFFIX}"


def _flat(memory: ClientMemory) -> tuple[dict[str, Tensor], dict[str, str]]:
    tensors = {f"model/{k}": v for k, v in (memory.model or {}).items()}
    tensors.update({f"tensors/{k}": v for k, v in memory.tensors.items()})
    meta = {**memory.meta(), "has_model": memory.model is not None}
    return tensors, {"memory": json.dumps(meta)}


def write_memory(path: Path, memory: ClientMemory) -> str:
    """One client's memory as one safetensors file (JSON values in its metadata); returns
    the file's SHA-256."""
    return write_safetensors(path, *_flat(memory))


def memory_bytes(memory: ClientMemory) -> bytes:
    """The bytes ``write_memory`` writes, for a client that keeps its memory elsewhere
    (a Flower node's state)."""
    tensors, metadata = _flat(memory)
    flat = {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}
    return save_tensors(flat, metadata=metadata)


def memory_of_bytes(raw: bytes) -> ClientMemory:
    """What ``memory_bytes`` made."""
    meta = json.loads(safe_metadata(raw)["memory"])
    return _memory(load_tensors(raw), meta)


def read_memory(path: Path) -> ClientMemory:
    """What ``write_memory`` wrote."""
    with safe_open(str(path), framework="pt") as handle:
        meta = json.loads(handle.metadata()["memory"])
    return _memory(load_file(path), meta)


def safe_metadata(raw: bytes) -> dict[str, str]:
    """A safetensors blob's metadata (its JSON header's ``__metadata__``)."""
    size = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + size]).get("__metadata__", {})


def _memory(flat: dict[str, Tensor], meta: dict[str, Any]) -> ClientMemory:
    model = {k[6:]: v for k, v in flat.items() if k.startswith("model/")}
    tensors = {k[8:]: v for k, v in flat.items() if k.startswith("tensors/")}
    return ClientMemory(
        model=model if meta["has_model"] else None,
        tensors=tensors,
        state=meta["state"],
        participations=meta["participations"],
        cluster=meta["cluster"],
    )


class StateStore(Protocol):
    def get(self, client: int) -> ClientMemory | None: ...
    def put(self, client: int, memory: ClientMemory, version: int) -> None: ...
    def ids(self) -> list[int]: ...
    def items(self) -> Iterator[tuple[int, ClientMemory]]: ...
    def changed(self) -> dict[int, int]: ...
    def persist(self, folder: Path) -> dict[int, dict[str, str]]: ...
    def adopt(self, folder: Path, files: dict[int, dict[str, str]]) -> None: ...
    def close(self) -> None: ...


class MemoryStore:
    """Client memories kept in a dict (tensors on the CPU)."""

    def __init__(self) -> None:
        self._memories: dict[int, ClientMemory] = {}
        self._changed: dict[int, int] = {}
        self._files: dict[int, dict[str, str]] = {}

    def get(self, client: int) -> ClientMemory | None:
        return self._memories.get(client)

    def put(self, client: int, memory: ClientMemory, version: int = 0) -> None:
        self._memories[client] = memory
        self._changed[client] = version

    def ids(self) -> list[int]:
        return sorted(self._memories)

    def items(self) -> Iterator[tuple[int, ClientMemory]]:
        return iter(sorted(self._memories.items()))

    def changed(self) -> dict[int, int]:
        """Clients put since the last ``persist``, with the round their memory is from."""
        return dict(self._changed)

    def persist(self, folder: Path) -> dict[int, dict[str, str]]:
        """Write the changed memories to ``folder``; every client's file and its hash."""
        for cid, version in sorted(self._changed.items()):
            name = memory_file(cid, version)
            digest = write_memory(Path(folder) / name, self._memories[cid])
            self._files[cid] = {"file": name, "sha256": digest}
        self._changed.clear()
        return dict(self._files)

    def adopt(self, folder: Path, files: dict[int, dict[str, str]]) -> None:
        """Load the memories a checkpoint's manifest names."""
        self._memories = {cid: read_memory(Path(folder) / e["file"]) for cid, e in files.items()}
        self._files = dict(files)
        self._changed.clear()

    def close(self) -> None:
        """Nothing to release."""


class DiskStore:
    """Client memories in ``folder`` (one file per client and round), the ``cache`` most
    recently used ones also in memory. Writes happen at ``put``: nothing is lost to
    memory pressure, and a checkpoint only records which file each client is at."""

    def __init__(self, folder: Path, cache: int = 64, temporary: bool = False) -> None:
        self.folder, self.capacity, self.temporary = Path(folder), max(cache, 1), temporary
        self.folder.mkdir(parents=True, exist_ok=True)
        self._files: dict[int, dict[str, str]] = {}
        self._cache: OrderedDict[int, ClientMemory] = OrderedDict()
        self._changed: dict[int, int] = {}

    def _remember(self, client: int, memory: ClientMemory) -> None:
        self._cache[client] = memory
        self._cache.move_to_end(client)
        while len(self._cache) > self.capacity:
            self._cache.popitem(last=False)

    def get(self, client: int) -> ClientMemory | None:
        if client in self._cache:
            self._cache.move_to_end(client)
            return self._cache[client]
        entry = self._files.get(client)
        if entry is None:
            return None
        memory = read_memory(self.folder / entry["file"])
        self._remember(client, memory)
        return memory

    def put(self, client: int, memory: ClientMemory, version: int = 0) -> None:
        name = memory_file(client, version)
        self._files[client] = {"file": name, "sha256": write_memory(self.folder / name, memory)}
        self._changed[client] = version
        self._remember(client, memory)

    def ids(self) -> list[int]:
        return sorted(self._files)

    def items(self) -> Iterator[tuple[int, ClientMemory]]:
        for cid in self.ids():
            memory = self.get(cid)
            assert memory is not None
            yield cid, memory

    def changed(self) -> dict[int, int]:
        return dict(self._changed)

    def persist(self, folder: Path) -> dict[int, dict[str, str]]:
        """Every memory is already on disk: each client's file and its hash."""
        if Path(folder) != self.folder:
            raise ValueError(f"a disk store in {self.folder} cannot persist to {folder}")
        self._changed.clear()
        return dict(self._files)

    def adopt(self, folder: Path, files: dict[int, dict[str, str]]) -> None:
        """Take over a checkpoint's manifest (files in ``folder``, read when needed)."""
        if Path(folder) != self.folder:
            raise ValueError(f"a disk store in {self.folder} cannot adopt files in {folder}")
        self._files = dict(files)
        self._cache.clear()
        self._changed.clear()

    def close(self) -> None:
        """Remove the folder when it was a temporary one (a run without a directory)."""
        if self.temporary:
            shutil.rmtree(self.folder, ignore_errors=True)


def kept_bytes(template: Any, kept: frozenset[str]) -> int:
    """Bytes one client keeps of the model (its kept keys' values)."""
    state = template.state_dict()
    return sum(state[k].numel() * state[k].element_size() for k in kept)


def memory_store(folder: Path | None, cache: int) -> MemoryStore:
    """The ``memory`` store: every client's memory in a dict."""
    return MemoryStore()


def disk_store(folder: Path | None, cache: int) -> DiskStore:
    """The ``disk`` store: files under ``folder`` (a temporary folder without a run
    directory), ``cache`` memories also in memory."""
    if folder is not None:
        return DiskStore(folder, cache)
    return DiskStore(Path(tempfile.mkdtemp(prefix="fedkit-clients-")), cache, temporary=True)
