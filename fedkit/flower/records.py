"""fedkit's messages as Flower records: tensors in ``ArrayRecord``s, everything else as
one JSON value in a ``ConfigRecord``.

A job carries one array record per cluster state sent (``offer.<c>``) and one for the
``downlink`` tensors (``down``); a result carries its upload split by the ledger's
categories (``up.model``, ``up.aux``, ``up.data``), so a Flower mod that acts on the model
part (secure aggregation, differential privacy) finds it alone. A record holds one flat
array per dtype, its layout (key, dtype, shape) beside it. Nothing in a message is code:
the client's setup crosses once per node and run as the recipe, key lists and the
template's tensors (``fedkit.core.setup_data``), and a node rebuilds the model with the
plugins installed on it. No message is unpickled, evaluated or names a module to import.
"""

from __future__ import annotations

import fnmatch
import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from torch import Tensor

from fedkit.core.messages import ClientJob, ClientResult, EvalJob, EvalResult, PartialOffers
from fedkit.core.setup_data import dtype_named

META = "fedkit"
"""The name of the JSON record in every fedkit message."""

LAYOUT = "fedkit.layout"
"""The record saying, for each array record of a message, where each key lies in it."""

UPLOAD = ("model", "aux", "data")


def put_state(content: RecordDict, name: str, state: Mapping[str, Tensor]) -> None:
    """``state`` as the array record ``name``: one flat array per dtype (Flower moves
    every array as an object of its own, so a model travels as one or two objects, not
    one per tensor), and where each key lies in them in the message's one layout record.
    bfloat16 travels as float32 (Flower's arrays have no bfloat16). An empty state adds
    nothing (every record is one more object to move)."""
    if not state:
        return
    groups: dict[str, list[Tensor]] = {}
    layout = []
    for key, value in state.items():
        value = value.detach().cpu()
        dtype = str(value.dtype).removeprefix("torch.")
        wire = value.float() if value.dtype == torch.bfloat16 else value
        groups.setdefault(str(wire.dtype).removeprefix("torch."), []).append(wire.reshape(-1))
        layout.append([key, dtype, list(value.shape)])
    content[name] = ArrayRecord({d: torch.cat(parts) for d, parts in groups.items()})
    if LAYOUT not in content:
        content[LAYOUT] = ConfigRecord()
    content[LAYOUT][name] = json.dumps(layout)


def get_state(content: RecordDict, name: str) -> dict[str, Tensor]:
    """What ``put_state`` put (empty when there is no such record)."""
    if name not in content:
        return {}
    return state_of(content[name], content[LAYOUT][name])


def state_of(record: ArrayRecord, layout: str) -> dict[str, Tensor]:
    """The tensors an array record holds, as its ``layout`` (JSON) places them."""
    flat = record.to_torch_state_dict()
    offsets = dict.fromkeys(flat, 0)
    state = {}
    for key, dtype, shape in json.loads(layout):
        wire = "float32" if dtype == "bfloat16" else dtype
        size = math.prod(shape)
        start = offsets[wire]
        value = flat[wire][start : start + size].reshape(shape).clone()
        offsets[wire] = start + size
        state[key] = value.to(dtype_named(dtype)) if dtype != wire else value
    return state


def state_keys(content: RecordDict) -> set[str]:
    """Every tensor key a message carries, in any of its records."""
    if LAYOUT not in content:
        return set()
    return {entry[0] for text in content[LAYOUT].values() for entry in json.loads(text)}


def put_meta(content: RecordDict, value: dict[str, Any]) -> None:
    content[META] = ConfigRecord({"json": json.dumps(value)})


def get_meta(content: RecordDict) -> dict[str, Any]:
    return json.loads(content[META]["json"])


def message(meta: dict[str, Any], **states: Mapping[str, Tensor]) -> RecordDict:
    """A message's content: its JSON value and its tensors."""
    content = RecordDict()
    put_meta(content, meta)
    for name, state in states.items():
        put_state(content, name, state)
    return content


def wire_bytes(content: RecordDict) -> int:
    """The bytes a message's tensors and JSON take (what travels, before framing)."""
    total = 0
    for record in content.values():
        if isinstance(record, ArrayRecord):
            total += sum(len(array.data) for array in record.values())
        elif isinstance(record, ConfigRecord):
            total += sum(len(v) for v in record.values() if isinstance(v, (str, bytes)))
    return total


def job_content(
    job: ClientJob, sent: list[int], settled: Any, prune: int | None = None
) -> RecordDict:
    """A train message: the job, the cluster states in ``sent``, ``settled`` (which
    staged memory of this client the server accepted) and ``prune`` (the round before
    which no kept checkpoint names a file of this client; ``None``: keep every file)."""
    meta = {
        "round": job.round,
        "client": job.client,
        "seed": job.seed,
        "lr": job.lr,
        "fault": job.fault,
        "attempt": job.attempt,
        "pool": len(job.offers),
        "sent": sent,
        "settled": settled,
        "prune": prune,
    }
    content = message(meta, down=job.extra)
    for cluster in sent:
        put_state(content, f"offer.{cluster}", job.offers[cluster])
    return content


def job_of(content: RecordDict) -> ClientJob:
    meta = get_meta(content)
    offers = PartialOffers(
        meta["pool"], {c: get_state(content, f"offer.{c}") for c in meta["sent"]}
    )
    job = ClientJob(meta["round"], meta["client"], meta["seed"], checked_lr(meta), offers)
    job.extra, job.fault, job.attempt = get_state(content, "down"), meta["fault"], meta["attempt"]
    return job


def result_content(
    result: ClientResult,
    category: Callable[[str], str],
    need: int | None = None,
    memory: dict[str, str] | None = None,
) -> RecordDict:
    """A train reply: the result, its upload split by ledger category, and ``memory``,
    the file name and hash of the new memory the node wrote; or, with ``need``, the one
    cluster state the client asked for that the job did not carry."""
    meta = {
        "client": result.client,
        "cluster": result.cluster,
        "weight": result.weight,
        "fetched": result.fetched,
        "metrics": result.metrics,
        "failure": result.failure,
        "error": result.error,
        "order": list(result.upload),
        "need": need,
        "memory": memory,
    }
    parts: dict[str, dict[str, Tensor]] = {f"up.{c}": {} for c in UPLOAD}
    for key, value in result.upload.items():
        parts[f"up.{category(key)}"][key] = value
    return message(meta, **{k: v for k, v in parts.items() if v})


def result_of(content: RecordDict) -> tuple[ClientResult, int | None]:
    meta = get_meta(content)
    parts: dict[str, Tensor] = {}
    for name in UPLOAD:
        parts.update(get_state(content, f"up.{name}"))
    upload = {k: parts[k] for k in meta["order"]}
    result = ClientResult(
        meta["client"], meta["cluster"], meta["weight"], upload, meta["fetched"],
        meta["metrics"], meta["failure"], meta["error"],
    )  # fmt: skip
    return result, meta["need"]


def eval_content(job: EvalJob, settled: Any, prune: int | None = None) -> RecordDict:
    """An evaluate message: the job, with ``settled`` and ``prune`` as ``job_content``'s."""
    meta = {
        "round": job.round,
        "client": job.client,
        "cluster": job.cluster,
        "lr": job.lr,
        "scores": list(job.scores),
        "settled": settled,
        "prune": prune,
    }
    return message(meta, state=job.state)


def eval_of(content: RecordDict) -> EvalJob:
    meta = get_meta(content)
    return EvalJob(
        meta["round"], meta["client"], meta["cluster"], checked_lr(meta),
        get_state(content, "state"), tuple(meta["scores"]),
    )  # fmt: skip


def checked_lr(meta: dict[str, Any]) -> float:
    """A job's learning rate, checked on arrival: a finite number, not negative."""
    lr = meta["lr"]
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 <= lr < math.inf:
        raise ValueError(f"a job's learning rate must be a finite number >= 0, found {lr!r}")
    return float(lr)


def eval_result_content(result: EvalResult) -> RecordDict:
    return message(
        {"client": result.client, "metrics": result.metrics, "failure": result.failure,
         "error": result.error}
    )  # fmt: skip


def eval_result_of(content: RecordDict) -> EvalResult:
    meta = get_meta(content)
    return EvalResult(meta["client"], meta["metrics"], meta["failure"], meta["error"])


def categories(model_keys: frozenset[str], auxiliary: tuple[str, ...]) -> Callable[[str], str]:
    """The ledger's category of a key (``model``, ``aux``, ``data``), on the client."""

    def category(key: str) -> str:
        if key in model_keys:
            return "model"
        if any(fnmatch.fnmatchcase(key, p) for p in auxiliary):
            return "aux"
        return "data"

    return category
