"""User-facing errors: each names where the problem is and what was expected.

The CLI turns any ``FedkitError`` into a one-paragraph message and exit code 2, with no
traceback. Bugs (and exceptions raised inside plugins) are not ``FedkitError``s.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """Return ' (did you mean "x"?)' for the closest choice, or '' when none is close."""
    match = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f' (did you mean "{match[0]}"?)' if match else ""


def unknown_hint(word: str, choices: Iterable[str], what: str = "key") -> str:
    """' (unknown key; did you mean "x"?)', or ' (unknown key)' when nothing is close."""
    suggestion = did_you_mean(word, choices)
    return f" (unknown {what}; {suggestion[2:]}" if suggestion else f" (unknown {what})"


class FedkitError(Exception):
    """Bad input from the user: a recipe, an option, a path. Exit code 2, no traceback."""


class RecipeError(FedkitError):
    """A recipe value is wrong: names the file, the key path, what was expected and found."""

    def __init__(
        self,
        key: str,
        expected: str,
        found: object = None,
        *,
        file: str | None = None,
        hint: str = "",
    ) -> None:
        self.file, self.key, self.expected, self.found, self.hint = file, key, expected, found, hint
        super().__init__(self._render())

    def _render(self) -> str:
        where = f"{self.file}: " if self.file else ""
        found = "" if self.found is None else f", found {self.found!r}"
        return f"{where}{self.key}: expected {self.expected}{found}{self.hint}"

    def in_file(self, file: str) -> RecipeError:
        """Attach the recipe file name (errors raised deep inside do not know it)."""
        self.file = self.file or file
        self.args = (self._render(),)
        return self


class PluginError(Exception):
    """An exception raised inside a plugin hook, re-raised naming the plugin and the hook."""

    def __init__(self, plugin: str, hook: str, cause: BaseException) -> None:
        self.plugin, self.hook = plugin, hook
        super().__init__(
            f"plugin {plugin!r} failed in hook {hook!r}: {type(cause).__name__}: {cause}"
        )


MIGRATION = "docs/decisions/0012-fedkit-1-architecture.md"

V2_HABITS: dict[str, tuple[str, str]] = {
    "import": ("M1-M12", "fedkit 0.3 moved its modules: import from fedkit"),
    "configure(recipe)": ("M14", "take (server) and read server.recipe"),
    "private_keys(recipe)": ("M15", "take (server, model) and read server.recipe"),
    "kept_keys(recipe)": ("M15", "take (server, model) and read server.recipe"),
    "auxiliary_keys(recipe)": ("M16", "take (server) and read server.recipe"),
    "round_end(metrics)": ("M17", "take (server) and report with server.log(name=value)"),
    "evaluate returned": ("M18", "report with server.log(name=value) and return None"),
    "local_train returned": ("M19", "report with ctx.log(name=value) and return True"),
    "after_local_train returned": ("M20", "report with ctx.log(name=value) and return None"),
    "claimed None": ("M21", "claim fedkit.DROP to remove a key, or leave the key out"),
    "Server.data": (
        "M22-M24",
        "a server holds no client data: use server.num_classes, server.classes, "
        "server.own_data, and score clients' data on the clients (evaluate_client)",
    ),
    "Objective.loss": (
        "M30",
        "an objective's loss returns (loss, outputs): take the loss with fedkit.split_loss",
    ),
    "make_optimizer(federation, round)": (
        "M31",
        "call make_optimizer(params, federation.optimizer, ctx.lr): jobs carry the round's rate",
    ),
}
"""What contract v2 plugins did that v3 removed or changed: the migration table's row
(decision 0012) and what to write instead, for the errors a v2 plugin gets."""


class ContractChanged(FedkitError):
    """A plugin does something contract v2 allowed and v3 removed or changed (one line)."""

    @classmethod
    def of(cls, plugin: str, where: str, habit: str) -> ContractChanged:
        """The error for ``plugin`` at ``where`` (a hook, an attribute) doing ``habit``."""
        return cls(f"plugin {plugin!r}, {where}: {since_v3(habit)}")


def since_v3(habit: str) -> str:
    """What contract v3 wants instead of a v2 ``habit``, citing the migration table's row."""
    row, instead = V2_HABITS[habit]
    return f"the plugin contract changed: {instead} (migration table row {row}, {MIGRATION})"


class ClaimConflict(FedkitError):
    """Two active plugins claimed the same key in one key-level hook."""

    def __init__(self, hook: str, key: str, first: str, second: str) -> None:
        super().__init__(
            f"plugins {first!r} and {second!r} both claim key {key!r} in hook {hook!r}; "
            "a key can be handled by one plugin only: remove one of them from the recipe "
            "or change its options"
        )


class ClaimMismatch(FedkitError):
    """A plugin claimed a key with a tensor of another shape or dtype than the key has."""

    def __init__(self, hook: str, key: str, plugin: str, value: object, expected: object) -> None:
        got = f"{tuple(value.shape)} {value.dtype}"  # type: ignore[attr-defined]
        want = f"{tuple(expected.shape)} {expected.dtype}"  # type: ignore[attr-defined]
        super().__init__(
            f"plugin {plugin!r} returned key {key!r} from hook {hook!r} as {got}, "
            f"but the key is {want}"
        )


class RoundFailed(FedkitError):
    """A round could not complete (too few clients answered, a non-finite global model);
    the run stops with its last checkpoint intact. ``failures``: the round's failed
    clients (client, kind, error), which ``stops.jsonl`` keeps."""

    def __init__(self, message: str, failures: list[dict] | None = None) -> None:
        super().__init__(message)
        self.failures = failures or []


class MissingOffer(Exception):
    """A client fetched a cluster its job did not carry: a transport that sends cluster
    states on demand (``fedkit.flower``) answers it by sending that one and running the
    job again (jobs are deterministic: same seed, same memory)."""

    def __init__(self, cluster: int) -> None:
        super().__init__(f"cluster {cluster} was not sent with this job")
        self.cluster = cluster
