"""The server's checks of every reply, before the ledger books it or any hook sees it.

A reply comes from a client the server does not control (a node on another machine,
another version of a plugin, a bug), so the server compares it with what the client was
sent and may send. A training reply (``ClientResult``) is accepted only when:

* every uploaded key is a shared (not private) key of the template with exactly the
  template's shape and dtype (a floating key may also come in a narrower floating dtype,
  as a compressing ``process_upload`` sends it: float16 or bfloat16 for a float32 key,
  which the mean turns back into the template's dtype), or matches a pattern a plugin
  declared auxiliary
  (``auxiliary_keys``), or is a data-derived key while some active plugin declares
  ``uploads_data_derived``; a private key is never accepted;
* its auxiliary and data-derived tensors are at most ``EXTRA_FACTOR`` times the whole
  template's bytes together, in at most ``EXTRA_FACTOR`` times as many keys as the
  template has, each key named in at most ``KEY_LENGTH`` characters;
* every floating value is finite;
* its cluster is an index of the pool, its weight a finite non-negative number, and the
  clusters it says it fetched distinct indices of the pool;
* its reported values are typed as ``fedkit.plugin.reported`` requires.

An evaluation reply (``EvalResult``) is accepted when its scores are typed likewise. A
failed reply keeps only the valid clusters it says it fetched (the ledger books those),
and its kind and error text cut to ``KIND_LENGTH`` and ``ERROR_LENGTH`` characters. A
refused reply becomes a failed one of kind ``refused`` whose error names the key and what
was expected: it is recorded in the row's ``failures`` and ``failures.jsonl`` like any
failed client, and the round goes on while ``federation.min_clients`` answered. What the
client computed and keeps is its own (the server cannot reach it); the server only
discards the reply. The expectations are computed once per run (``Expected.of``), so a
reply costs a dictionary look-up per key and one finiteness check of the upload.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from fedkit.core.messages import ClientResult, EvalResult
from fedkit.core.worker import non_finite
from fedkit.plugin.manager import Plugins
from fedkit.plugin.reported import describe
from fedkit.plugin.reported import refusal as metrics_refusal
from fedkit.plugin.server import Server

REFUSED = "refused"
"""The failure kind of a reply the server refused."""
EXTRA_FACTOR = 8
"""Auxiliary and data-derived tensors of one reply: at most this many times the whole
template's bytes, in at most this many times as many keys as the template has."""
KEY_LENGTH = 512
"""The longest name of an auxiliary or data-derived key (characters)."""
KIND_LENGTH, ERROR_LENGTH = 32, 2000
"""A failed reply's kind and error text are cut to these lengths (characters): they are
text a client chose, written to the metrics row and ``failures.jsonl``."""


@dataclass(frozen=True)
class Expected:
    """What the server accepts in a reply, found once per run."""

    shared: dict[str, tuple[torch.Size, torch.dtype, int]]
    """Shape, dtype and (for a floating key; else 0) bits of every shared key of the
    template."""
    private: frozenset[str]
    data_derived: bool
    """Whether some active plugin declares data-derived uploads."""
    extra_bytes: int
    extra_keys: int

    @classmethod
    def of(cls, server: Server, plugins: Plugins) -> Expected:
        state = server.template.state_dict()
        shared = {
            k: (v.shape, v.dtype, torch.finfo(v.dtype).bits if v.is_floating_point() else 0)
            for k, v in state.items()
            if k not in server.private
        }
        size = sum(v.nbytes for v in state.values())
        return cls(
            shared,
            frozenset(server.private),
            bool(plugins.uploads_data_derived()),
            EXTRA_FACTOR * size,
            EXTRA_FACTOR * max(len(state), 1),
        )


def _name(key: Any) -> str:
    """A key as a message shows it (cut to ``KEY_LENGTH`` characters)."""
    return repr(str(key)[:KEY_LENGTH])


def _upload_refusal(upload: Any, expected: Expected, server: Server) -> str | None:
    """Why an upload may not be accepted, or ``None``."""
    if not isinstance(upload, dict):
        return f"upload: expected a mapping of keys to tensors, found {describe(upload)}"
    shared, category = expected.shared, server.ledger.category
    extra_bytes = extra_keys = 0
    for key, value in upload.items():
        if not isinstance(value, Tensor):
            return (
                f"upload key {str(key)[:KEY_LENGTH]!r}: expected a tensor, found {describe(value)}"
            )
        known = shared.get(key)
        if known is not None:
            shape, dtype, bits = known
            if value.shape != shape or (value.dtype != dtype and not _narrower(value, bits)):
                allowed = " (or a narrower floating dtype)" if bits else ""
                return (
                    f"upload key {key!r}: expected the template's {tuple(shape)} {dtype}"
                    f"{allowed}, found {tuple(value.shape)} {value.dtype}"
                )
            continue
        if key in expected.private:
            return f"upload key {key!r}: a private key, which never leaves its client"
        if not isinstance(key, str) or len(key) > KEY_LENGTH:
            return f"upload key {_name(key)}: expected a name of at most {KEY_LENGTH} characters"
        if category(key) == "data" and not expected.data_derived:
            return (
                f"upload key {key!r}: neither a model key nor a declared auxiliary one, and no "
                "active plugin declares uploads_data_derived"
            )
        extra_bytes += value.nbytes
        extra_keys += 1
        if extra_bytes > expected.extra_bytes or extra_keys > expected.extra_keys:
            return (
                f"upload key {key!r}: auxiliary and data-derived tensors of {extra_bytes} bytes "
                f"in {extra_keys} keys so far, expected at most {expected.extra_bytes} bytes in "
                f"{expected.extra_keys} keys ({EXTRA_FACTOR}x the template)"
            )
    bad = non_finite(upload)
    if bad is not None:
        return f"upload key {bad!r}: expected finite values, found a NaN or an infinity"
    return None


def _narrower(value: Tensor, bits: int) -> bool:
    """Whether ``value`` is floating and no wider than a floating key of ``bits``."""
    return bits > 0 and value.is_floating_point() and torch.finfo(value.dtype).bits <= bits


def _index(value: Any, size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < size


def refusal(result: ClientResult, expected: Expected, server: Server) -> str | None:
    """Why a training reply may not be accepted, or ``None`` (see the module docstring)."""
    clusters = len(server.pool)
    if not _index(result.cluster, clusters):
        return f"cluster: expected an index of the pool of {clusters}, found {result.cluster!r}"
    weight = result.weight
    number = isinstance(weight, (int, float)) and not isinstance(weight, bool)
    if not number or not math.isfinite(weight) or weight < 0:
        return f"weight: expected a finite non-negative number, found {weight!r}"
    fetched = result.fetched
    if (
        not isinstance(fetched, list)
        or not all(_index(c, clusters) for c in fetched)
        or len(set(fetched)) != len(fetched)
    ):
        return f"fetched: expected distinct indices of the pool of {clusters}, found {fetched!r}"
    return metrics_refusal(result.metrics) or _upload_refusal(result.upload, expected, server)


def checked(result: ClientResult, expected: Expected, server: Server) -> ClientResult:
    """The reply as accepted, or a failed one of kind ``refused`` (keeping the clusters it
    fetched when they are valid, so the ledger books what was sent to it, and the bytes
    secure aggregation's messages moved, ``secagg``, which the server itself counted)."""
    clusters = len(server.pool)
    fetched = result.fetched if isinstance(result.fetched, list) else []
    valid = list(dict.fromkeys(c for c in fetched if _index(c, clusters)))
    if result.failure is not None:  # what a failed client says is text, kept short
        failed = ClientResult.failed(
            result.client, str(result.failure)[:KIND_LENGTH], str(result.error)[:ERROR_LENGTH],
            valid,
        )  # fmt: skip
        return replace(failed, retried=str(result.retried)[:ERROR_LENGTH], secagg=result.secagg)
    reason = refusal(result, expected, server)
    if reason is None:
        return result
    refused = ClientResult.failed(result.client, REFUSED, reason, valid)
    return replace(refused, retried=result.retried, secagg=result.secagg)


def checked_scores(result: EvalResult) -> EvalResult:
    """An evaluation reply as accepted, or a failed one of kind ``refused``."""
    if result.failure is not None:
        kind, error = str(result.failure)[:KIND_LENGTH], str(result.error)[:ERROR_LENGTH]
        return EvalResult(result.client, {}, kind, error, str(result.retried)[:ERROR_LENGTH])
    reason = metrics_refusal(result.metrics)
    if reason is None:
        return result
    return EvalResult(result.client, {}, REFUSED, reason, result.retried)
