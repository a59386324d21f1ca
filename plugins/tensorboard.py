"""TensorBoard: every number of each round's metrics row as a TensorBoard scalar.

An observer: it implements only ``round_logged``, which the server calls with the
complete row after evaluation, and changes nothing about the run. Nested values are
flattened (``bytes/up_model``); per-client values go under ``clients/<name>/<client>``.
List it next to any method (``plugins: [fedavg, {tensorboard: {logdir: tb/qs}}]``) and
run ``tensorboard --logdir tb``. Needs the ``tensorboard`` extra.
"""

from __future__ import annotations

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
