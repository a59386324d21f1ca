"""The ``fedkit`` command line: run, validate, plugins, recipes."""

from __future__ import annotations

import contextlib
import errno
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from fedkit import plugins as plugin_registry
from fedkit import recipes, rundir
from fedkit.checks import check_recipe
from fedkit.data.summary import partition_table, render_partition
from fedkit.errors import FedkitError, PluginError, RecipeError
from fedkit.lock import LOCK, RunLock
from fedkit.plugins import Plugins
from fedkit.recipe import Recipe, load_recipe
from fedkit.report import RichReporter, summary_table

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Federated representation learning and clustered FL, composed from plugins.",
)
console = Console()
errors = Console(stderr=True)


ADVICE = {
    errno.ENOSPC: "free some space or choose another --out",
    errno.EROFS: "the file system is read-only: choose another --out",
    errno.EACCES: "no permission: choose a directory you can write to",
    errno.EPERM: "no permission: choose a directory you can write to",
    errno.ENOTDIR: "a part of this path is a file, not a directory",
    errno.EISDIR: "this path is a directory, a file was expected",
    errno.ENOENT: "it does not exist",
}


def os_message(exc: OSError) -> str:
    """One line for an operating-system error: the path, what happened, what to do."""
    where = exc.filename or "a file"
    advice = ADVICE.get(exc.errno or 0, "check the path and try again")
    return f"{where}: {exc.strerror or exc} — {advice}"


@contextlib.contextmanager
def friendly_errors() -> Iterator[None]:
    """Bad input or a refusing machine → one message and exit code 2; a plugin's
    exception → named, exit code 1."""
    try:
        yield
    except FedkitError as exc:
        errors.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    except OSError as exc:
        errors.print(f"[bold red]error:[/] {os_message(exc)}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    except PluginError as exc:
        errors.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        cause = exc.__cause__
        if cause is not None:
            import traceback

            errors.print("".join(traceback.format_exception(cause)), highlight=False, markup=False)
        raise typer.Exit(1) from None


@contextlib.contextmanager
def naming_file(path: Path) -> Iterator[None]:
    """Attach the recipe file to recipe errors raised by code that does not know it."""
    try:
        yield
    except RecipeError as exc:
        raise exc.in_file(str(path)) from None


def load_checked(path: Path, overrides: list[str]) -> tuple[Recipe, Plugins]:
    """Load, validate and check a recipe file; every error names the file."""
    with naming_file(path):
        recipe = load_recipe(path, overrides)
        return recipe, check_recipe(recipe)


def engine_settings(executor: str | None, workers: int | None) -> list[str]:
    """``--executor``/``--workers`` as the recipe keys they set."""
    found = [f"engine.executor={executor}"] if executor is not None else []
    return found + ([f"engine.workers={workers}"] if workers is not None else [])


SetOption = Annotated[
    list[str] | None, typer.Option("--set", "-s", help="Override a recipe key: a.b=value.")
]


@app.command()
def run(
    recipe: Annotated[str | None, typer.Argument(help="Recipe file or shipped name.")] = None,
    set_: SetOption = None,
    out: Annotated[Path | None, typer.Option(help="Run directory.")] = None,
    resume: Annotated[Path | None, typer.Option(help="Continue the run in DIR.")] = None,
    executor: Annotated[
        str | None, typer.Option(help="sequential, isolated or ray (engine.executor).")
    ] = None,
    workers: Annotated[int | None, typer.Option(help="Ray actors (engine.workers).")] = None,
) -> None:
    """Run a recipe (or resume a run) and write its run directory."""
    engine = engine_settings(executor, workers)
    with friendly_errors():
        if resume is not None:
            if recipe is not None or out is not None or engine:
                raise FedkitError(
                    "--resume takes the run directory, and --set only for federation.rounds "
                    "or evaluation.* (no recipe, no --out, no --executor)"
                )
            out = resume
        else:
            if recipe is None:
                raise FedkitError("give a recipe (file or shipped name) or --resume DIR")
            path = recipes.resolve(recipe)
            parsed, _ = load_checked(path, [*(set_ or []), *engine])
            out = out or rundir.default_out(path.stem)
        fresh = not out.exists()
        with RunLock(out), interrupted(out), tidy(out, fresh):
            if resume is not None:
                the_run, done = rundir.resume(resume, set_ or [])
                for note in the_run.notes:
                    errors.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
                console.print(f"resuming {resume} after round {done}")
            else:
                with naming_file(path):
                    the_run, done = rundir.start(parsed, out), 0
                data = the_run.server.data
                console.print(render_partition(partition_table(data), data.train.classes))
            warn_about(the_run)
            rounds = the_run.recipe.federation.rounds
            with RichReporter(console, rounds, done) as reporter:
                summary = rundir.execute(the_run, out, done, reporter)
        console.print(summary_table(summary, str(out)))


def warn_about(the_run: Any) -> None:
    """Warnings a user should see before the rounds start."""
    for name in the_run.plugins.uploads_data_derived():
        errors.print(
            f"[yellow]warning:[/] plugin {name!r} uploads data-derived tensors "
            "(features or statistics of client data); the ledger counts them"
        )
    empty = [c.id for c in the_run.server.roster if c.num_samples == 0]
    if empty:
        shown = ", ".join(map(str, empty[:10])) + (", …" if len(empty) > 10 else "")
        errors.print(
            f"[yellow]warning:[/] {len(empty)} of {len(the_run.server.roster)} clients hold "
            f"no training data and are never sampled (clients {shown})",
            soft_wrap=True,
        )


@contextlib.contextmanager
def tidy(out: Path, fresh: bool) -> Iterator[None]:
    """A run that fails before it starts leaves nothing behind in a directory it created."""
    try:
        yield
    except BaseException:
        if fresh and out.is_dir() and not (out / rundir.RECIPE).exists():
            (out / LOCK).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                out.rmdir()
        raise


@contextlib.contextmanager
def interrupted(out: Path) -> Iterator[None]:
    """Ctrl-C: say how to continue, exit 130 (the run directory keeps its last checkpoint)."""
    try:
        yield
    except KeyboardInterrupt:
        errors.print(
            f"interrupted; {out} keeps its last checkpoint — continue with: "
            f"fedkit run --resume {out}",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(130) from None


@app.command()
def validate(
    recipe: Annotated[str, typer.Argument(help="Recipe file or shipped name.")],
    set_: SetOption = None,
) -> None:
    """Check a recipe without running it."""
    with friendly_errors():
        path = recipes.resolve(recipe)
        parsed, active = load_checked(path, set_ or [])
        console.print(
            f"{path}: ok — plugins {', '.join(active.names)}, "
            f"{parsed.federation.rounds} rounds, {parsed.data.num_clients} clients"
        )


@app.command("eval")
def eval_(
    run_dir: Annotated[Path, typer.Argument(help="A run directory with a checkpoint.")],
    protocol: Annotated[str, typer.Option(help="knn, linear or semi.")] = "linear",
    dataset: Annotated[str | None, typer.Option(help="Evaluate on another data set.")] = None,
    root: Annotated[str | None, typer.Option(help="That data set's directory.")] = None,
    client: Annotated[int | None, typer.Option(help="A client's own encoder.")] = None,
    set_: SetOption = None,
) -> None:
    """Evaluate a saved run's encoder (knn, linear or semi), also on another data set."""
    import json

    from fedkit.evaluation.offline import evaluate_run

    with friendly_errors():
        note = rundir.describe_state(run_dir)
        if note is not None:
            errors.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
        metrics = evaluate_run(
            run_dir, protocol, dataset=dataset, root=root, overrides=set_ or [], client=client
        )
    print(json.dumps(metrics))


@app.command("plugins")
def list_plugins() -> None:
    """List installed plugins: package, hooks, and whether they upload data-derived tensors."""
    table = Table(title="fedkit plugins")
    for column in ("plugin", "package", "server hooks", "client hooks", "data-derived", "summary"):
        table.add_column(column, overflow="fold")
    for name, ep in plugin_registry.discover().items():
        info = plugin_registry.describe(ep)
        sides = info.hooks_by_side()
        table.add_row(
            name,
            f"{info.package} {info.version}",
            ", ".join(sides["server"]),
            ", ".join(sides["client"]),
            "yes" if info.uploads_data_derived else "no",
            info.summary,
        )
    console.print(table)


@app.command("recipes")
def list_recipes() -> None:
    """List shipped recipes with their one-line descriptions."""
    table = Table(title="shipped recipes")
    table.add_column("recipe")
    table.add_column("description")
    for name, path in recipes.shipped().items():
        table.add_row(name, recipes.describe(path))
    console.print(table)


def main() -> None:
    """Console-script entry point."""
    sys.exit(app())
