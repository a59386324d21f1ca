"""The ``fedkit`` command line: run, validate, plugins, recipes."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from fedkit import plugins as plugin_registry
from fedkit import recipes, rundir
from fedkit.checks import check_recipe
from fedkit.data.summary import partition_table, render_partition
from fedkit.errors import FedkitError, PluginError, RecipeError
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


@contextlib.contextmanager
def friendly_errors() -> Iterator[None]:
    """Bad input → message and exit code 2; a plugin's exception → named, exit code 1."""
    try:
        yield
    except FedkitError as exc:
        errors.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
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
    set_ = [*(set_ or []), *engine_settings(executor, workers)]
    with friendly_errors():
        if resume is not None:
            if recipe is not None or set_:
                raise FedkitError(
                    "--resume takes the run directory only (no recipe, no --set, no --executor)"
                )
            the_run, done = rundir.resume(resume)
            out = resume
            console.print(f"resuming {resume} after round {done}")
        else:
            if recipe is None:
                raise FedkitError("give a recipe (file or shipped name) or --resume DIR")
            path = recipes.resolve(recipe)
            parsed, _ = load_checked(path, set_ or [])
            out = out or rundir.default_out(path.stem)
            with naming_file(path):
                the_run, done = rundir.start(parsed, out), 0
            data = the_run.server.data
            console.print(render_partition(partition_table(data), data.train.classes))
        for name in the_run.plugins.uploads_data_derived():
            errors.print(
                f"[yellow]warning:[/] plugin {name!r} uploads data-derived tensors "
                "(features or statistics of client data); the ledger counts them"
            )
        rounds = the_run.recipe.federation.rounds
        with RichReporter(console, rounds, done) as reporter:
            summary = rundir.execute(the_run, out, done, reporter)
        console.print(summary_table(summary, str(out)))


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
