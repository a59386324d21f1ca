"""TensorBoard: every number of each round's metrics row as a TensorBoard scalar.

An observer: it implements only ``configure`` and ``round_logged``, which the server
calls with the complete row after evaluation, and changes nothing about the run. ``configure``
makes ``logdir`` and writes a probe file there, so a folder this process cannot write
stops the run before round 1 with one ``RecipeError`` naming it. Nested values are
flattened (``bytes/up_model``); per-client values go under ``clients/<name>/<client>``.
List it next to any method (``plugins: [fedavg, {tensorboard: {logdir: tb/qs}}]``) and
run ``tensorboard --logdir tb``. Needs the ``tensorboard`` extra.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from fedkit import PluginOptions, RecipeError, Server, hookimpl


def scalars(row: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of a metrics row, flattened to ``a/b`` tags."""
    out: dict[str, float] = {}
    for key, value in row.items():
        tag = f"{prefix}{key}"
        if isinstance(value, bool):
            out[tag] = float(value)
        elif isinstance(value, (int, float)):
            out[tag] = float(value)
        elif isinstance(value, dict):
            out.update(scalars(value, f"{tag}/"))
    return out


def option_key(server: Server, plugin: str, option: str) -> str:
    """The recipe key of a plugin's option (``plugins.1.options.logdir``), for errors."""
    for index, spec in enumerate(server.recipe.plugins):
        if spec.name == plugin:
            return f"plugins.{index}.options.{option}"
    return f"{plugin}.{option}"


def cause(exc: BaseException) -> str:
    """An exception in one short line: its type and the first sentence of its text."""
    text = (str(exc).strip().splitlines() or [""])[0]
    if len(text) > 160:
        text = text.split(". ")[0][:160]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class TensorBoard:
    """TensorBoard: logs every number of each round's metrics row (an observer)."""

    class Options(PluginOptions):
        logdir: str = "tensorboard"
        per_client: bool = False

    def __init__(self, options: Options) -> None:
        self.options = options
        self.writer: Any = None  # server side only: opened at the first round

    @hookimpl
    def configure(self, server: Server) -> None:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise RecipeError(
                "plugins", "the tensorboard extra installed (pip install 'fedkit-fl[tensorboard]')"
            ) from None
        try:  # TensorBoard's writer fails in a thread of its own: write a probe here
            folder = Path(self.options.logdir)
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as exc:
            raise RecipeError(
                option_key(server, "tensorboard", "logdir"),
                "a folder this process can write",
                self.options.logdir,
                hint=f" ({cause(exc)})",
            ) from None

    @hookimpl
    def round_logged(self, server: Server, metrics: dict[str, Any]) -> None:
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(self.options.logdir)
        row = {k: v for k, v in metrics.items() if k not in ("round", "clients", "clusters")}
        if not self.options.per_client:
            row.pop("per_client", None)
        else:
            row["clients"] = row.pop("per_client", {})
        for tag, value in scalars(row).items():
            self.writer.add_scalar(tag, value, metrics["round"])
        self.writer.flush()
