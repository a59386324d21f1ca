"""The ``fedkit`` command line: run, sweep, validate, plugins, recipes."""

from __future__ import annotations

import contextlib
import errno
import json
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fedkit.cli import deploy
from fedkit.config import shipped
from fedkit.errors import FedkitError, PluginError, RecipeError
from fedkit.rundir.lock import LOCK, RunLock
from fedkit.rundir.logs import RECIPE, append_evaluation

if TYPE_CHECKING:
    from fedkit.config.schema import Recipe
    from fedkit.plugin.manager import Plugins

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Federated representation learning and clustered FL, composed from plugins.",
)
UNWRAPPED = 10_000
"""Columns of a console that is not a terminal (rich's default is 80)."""


def unwrapped_unless_terminal(console: Console) -> Console:
    """A console writing to a file, a pipe or a scheduler's log keeps each line whole
    (one line per round, tables not shredded); a terminal keeps its own width."""
    if not console.is_terminal:
        console.width = UNWRAPPED
    return console


console = unwrapped_unless_terminal(Console())
errors = unwrapped_unless_terminal(Console(stderr=True))
SHOWN_CLIENTS = 100
"""Clients the partition table printed before round 1 lists (the file has them all)."""
app.add_typer(deploy.app, name="deploy")


ADVICE = {
    errno.ENOSPC: "free some space or choose another --out",
    errno.EROFS: "the file system is read-only: choose another --out",
    errno.ECONNREFUSED: "nothing answers at that address: check it, and that the server runs",
    errno.ETIMEDOUT: "no answer from that address in time: check it and the network",
    errno.EACCES: "no permission: choose a directory you can write to",
    errno.EPERM: "no permission: choose a directory you can write to",
    errno.ENOTDIR: "a part of this path is a file, not a directory",
    errno.EISDIR: "this path is a directory, a file was expected",
    errno.ENOENT: "it does not exist",
}
RESUME_ADVICE = {
    errno.ENOSPC: "free some space, then resume again (the last checkpoint is intact)",
    errno.EROFS: "the file system is read-only: copy the run directory somewhere writable "
    "and resume the copy",
    errno.EACCES: "no permission to write there: resume as a user who may, or resume a copy",
    errno.EPERM: "no permission to write there: resume as a user who may, or resume a copy",
}


def os_message(exc: OSError, resuming: bool = False) -> str:
    """One line for an operating-system error: the path (when there is one), what
    happened, what to do (resuming: what to do with the run directory)."""
    code = exc.errno or 0
    advice = (RESUME_ADVICE if resuming else {}).get(code) or ADVICE.get(code)
    if exc.filename:
        return f"{exc.filename}: {exc.strerror or exc} — {advice or 'check the path and try again'}"
    what = exc.strerror or str(exc) or type(exc).__name__
    if isinstance(exc, ConnectionError | TimeoutError) and advice is None:
        advice = "check the address, and that the server runs"
    return f"{what} — {advice}" if advice else what


@contextlib.contextmanager
def friendly_errors(resuming: bool = False) -> Iterator[None]:
    """Bad input or a refusing machine → one message and exit code 2; a plugin's
    exception → named, exit code 1."""
    try:
        yield
    except FedkitError as exc:
        errors.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    except OSError as exc:
        message = os_message(exc, resuming)
        errors.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
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
    """Load, validate and check a recipe file; every error names the file. The keys and
    values are validated before torch loads (the plugins' checks need it), so a misspelt
    ``--set`` key is answered at once."""
    from fedkit.config.schema import load_recipe

    with naming_file(path):
        recipe = load_recipe(path, overrides)
        from fedkit.core.preflight import check

        return recipe, check(recipe)


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
        str | None, typer.Option(help="sequential, isolated, ray or flower (engine.executor).")
    ] = None,
    workers: Annotated[int | None, typer.Option(help="Ray actors (engine.workers).")] = None,
    report: Annotated[
        bool,
        typer.Option(
            "--report/--no-report",
            envvar="FEDKIT_REPORT",
            help="Write report.html at the end (FEDKIT_REPORT=0 makes --no-report the default).",
        ),
    ] = True,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Print only problems and the run directory.")
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the summary as JSON on stdout (implies -q).")
    ] = False,
    log_format: Annotated[
        str,
        typer.Option(
            help="rich (progress, a line per round) or jsonl (a JSON object per line: "
            "start, each round, end)."
        ),
    ] = "rich",
) -> None:
    """Run a recipe (or resume a run) and write its run directory."""
    if log_format not in ("rich", "jsonl"):
        errors.print(
            f"[bold red]error:[/] --log-format: expected rich or jsonl, found {log_format!r}"
        )
        raise typer.Exit(2)
    jsonl = log_format == "jsonl"
    quiet = quiet or as_json or jsonl
    engine = engine_settings(None, workers)  # --executor goes to the engine as a value
    with friendly_errors(resuming=resume is not None):
        if resume is None:
            if recipe is None:
                raise FedkitError("give a recipe (file or shipped name) or --resume DIR")
            path = shipped.resolve(recipe)
            parsed, plugins = load_checked(path, [*(set_ or []), *engine])
        from fedkit.cli.progress import JsonlReporter, RichReporter, summary_table
        from fedkit.core import runs
        from fedkit.data.summary import partition_table, render_partition

        if resume is not None:
            if recipe is not None or out is not None or engine or executor:
                raise FedkitError(
                    "--resume takes the run directory, and --set only for federation.rounds "
                    "or evaluation.* (no recipe, no --out, no --executor)"
                )
            out = resume
            if complete(resume, set_ or [], quiet):
                return
        else:
            out = out or runs.default_out(path.stem)
        fresh = not out.exists()
        with RunLock(out), interrupted(out) as rearm, tidy(out, fresh):
            if resume is not None:
                the_run, done = runs.resume(resume, set_ or [])
                for note in the_run.notes:
                    errors.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
                if not quiet:
                    console.print(f"resuming {resume} after round {done}")
            else:
                with naming_file(path):
                    the_run, done = runs.start(parsed, out, plugins, executor), 0
                data = the_run.data
                if not quiet:
                    rows = partition_table(data, limit=SHOWN_CLIENTS)
                    console.print(render_partition(rows, data.train.classes))
                    if data.num_clients > SHOWN_CLIENTS:
                        console.print(
                            f"… and {data.num_clients - SHOWN_CLIENTS:,} more clients "
                            f"(all of them in {out / 'partition.json'})"
                        )
            rearm()  # after Ray started, if it did
            warn_about(the_run)
            rounds = the_run.recipe.federation.rounds
            if jsonl:
                lines = JsonlReporter()
                lines.emit("start", run_dir=str(out), rounds=rounds, after=done)
                summary = runs.execute(the_run, out, done, lines)
            elif quiet:
                summary = runs.execute(the_run, out, done)
            else:
                with RichReporter(console, rounds, done) as reporter:
                    summary = runs.execute(the_run, out, done, reporter)
            page = write_report_if_possible(out) if report else None
        if jsonl:
            JsonlReporter().emit("end", **summary, run_dir=str(out), report=page)
        elif as_json:
            print(json.dumps({**summary, "run_dir": str(out), "report": page}, sort_keys=True))
        elif not quiet:
            console.print(summary_table(summary, str(out)))
            if page is not None:
                console.print(f"report: {page}")
        else:
            console.print(str(out), highlight=False, soft_wrap=True)


def complete(out: Path, overrides: list[str], quiet: bool) -> bool:
    """Whether ``--resume`` names a run that already did every round it is asked for
    (then it says so, and nothing is rebuilt, no Ray started)."""
    from fedkit.rundir import checkpoint

    try:
        rounds = yaml.safe_load((out / RECIPE).read_text())["federation"]["rounds"]
    except (OSError, yaml.YAMLError, KeyError, TypeError, UnicodeDecodeError):
        return False  # resume explains what is wrong
    if overrides:
        return False  # extending, or changes resume checks and reports
    if checkpoint.latest_round(out) != rounds or not (out / "summary.json").is_file():
        return False
    if quiet:
        console.print(str(out), highlight=False, soft_wrap=True)
    else:
        console.print(
            f"{out} is complete: all {rounds} rounds are done (extend it with --resume "
            f"{out} --set federation.rounds=N)",
            highlight=False,
            soft_wrap=True,
        )
    return True


def write_report_if_possible(out: Path) -> str | None:
    """The run's report page (needs matplotlib: a note, not an error, without it)."""
    from fedkit.cli.report import pyplot, write_report

    try:
        pyplot()
    except FedkitError as exc:
        errors.print(f"[yellow]note:[/] no report: {exc}", highlight=False, soft_wrap=True)
        return None
    return str(write_report(out))


def warn_about(the_run: Any) -> None:
    """Warnings a user should see before the rounds start."""
    from fedkit.training import precision

    server = the_run.server
    for warning in precision.warnings(the_run.recipe, server.device, server.template):
        errors.print(f"[yellow]warning:[/] {warning}", highlight=False, soft_wrap=True)
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
        if fresh and out.is_dir() and not (out / RECIPE).exists():
            (out / LOCK).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                out.rmdir()
        raise


class Terminated(KeyboardInterrupt):
    """SIGTERM (what Slurm, Kubernetes and ``kill`` send first), raised in the main thread
    so that it unwinds like Ctrl-C: executors close, Ray shuts down, checkpoints stay."""


TERMINATED = threading.Event()
"""Set by the SIGTERM handler: code that catches the interrupt and raises a plain
``KeyboardInterrupt`` (Ray's ``ray.get``) does not hide that it was SIGTERM."""


def _terminate(signum: int, frame: Any) -> None:
    TERMINATED.set()
    raise Terminated()


@contextlib.contextmanager
def interrupted(out: Path) -> Iterator[Callable[[], None]]:
    """Ctrl-C or SIGTERM: say how to continue and exit 130 or 143 (the run directory keeps
    its last checkpoint). Yields ``rearm``, to call once the run is prepared: starting Ray
    installs Ray's own SIGTERM handler, which would abort with a native stack dump."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None

    def rearm() -> None:
        if main:
            signal.signal(signal.SIGTERM, _terminate)

    rearm()
    try:
        yield rearm
    except KeyboardInterrupt as exc:
        term = isinstance(exc, Terminated) or TERMINATED.is_set()
        what = "terminated (SIGTERM)" if term else "interrupted"
        errors.print(
            f"{what}; {out} keeps its last checkpoint — continue with: fedkit run --resume {out}",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(143 if term else 130) from None
    finally:
        if main and previous is not None:
            signal.signal(signal.SIGTERM, previous)


@app.command()
def sweep(
    recipe: Annotated[str, typer.Argument(help="Recipe file or shipped name.")],
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", "-s", help="KEY=VALUE, or KEY=V1,V2,... for an axis of the grid."),
    ] = None,
    out: Annotated[Path, typer.Option(help="Sweep directory (one run directory per cell).")] = ...,
    parallel: Annotated[
        int, typer.Option(help="Cells run at once (cores split between them).")
    ] = 1,
    executor: Annotated[
        str | None, typer.Option(help="sequential, isolated, ray or flower (engine.executor).")
    ] = None,
    workers: Annotated[int | None, typer.Option(help="Ray actors (engine.workers).")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print only the table.")] = False,
) -> None:
    """Run the cartesian product of the listed values (resumable), then a table of final
    and best metrics, mean ± std over seeds (DIR/table.md, .csv, .json). Values are
    compared as the recipe reads them: two spellings of one value (seed=1,01) or two
    values that would share a run folder (run a, run/a) are refused before anything runs."""
    from fedkit.cli.sweep import sweep as run_sweep

    engine = engine_settings(executor, workers)
    with friendly_errors():
        path = shipped.resolve(recipe)

        def rounds_of(overrides: list[str]) -> int:
            from fedkit.config.schema import load_recipe

            with naming_file(path):
                return load_recipe(path, overrides).federation.rounds

        def say(line: str) -> None:
            if not quiet:
                console.print(line, highlight=False, soft_wrap=True)

        table, failed = run_sweep(
            str(path), path, set_ or [], out, parallel, engine, rounds_of, say
        )
        if table.row_count:
            console.print(table)
            console.print(f"sweep: {out} (table.md, table.csv, table.json)", highlight=False)
    if failed:
        names = ", ".join(job.cell.name for job, _ in failed)
        errors.print(
            f"[bold red]error:[/] {len(failed)} cells failed: {names} (logs in {out / 'logs'}; "
            "run the same command again to retry them)",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(1)


@app.command()
def validate(
    recipe: Annotated[str, typer.Argument(help="Recipe file or shipped name.")],
    set_: SetOption = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run/--no-dry-run",
            help=(
                "Also run one round on a few embedded images (finds key-claim conflicts); "
                "plugins that pre-train on the server do so for their configured epochs."
            ),
        ),
    ] = True,
) -> None:
    """Check a recipe without running it (by default with a one-round dry run)."""
    from fedkit.core.runs import dry_round

    with friendly_errors():
        path = shipped.resolve(recipe)
        parsed, active = load_checked(path, set_ or [])
        if dry_run:
            with naming_file(path):
                dry_round(parsed.model_dump(mode="json"))
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
    """Evaluate a saved run's encoder (knn, linear or semi), also on another data set;
    each result is also kept in RUN_DIR/evaluations.jsonl (report and compare show it)."""
    from fedkit.cli.offline_eval import evaluate_run
    from fedkit.core import runs

    with friendly_errors():
        note = runs.describe_state(run_dir)
        if note is not None:
            errors.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
        metrics = evaluate_run(
            run_dir, protocol, dataset=dataset, root=root, overrides=set_ or [], client=client
        )
        for skipped in metrics.get("skipped", []):
            errors.print(
                f"[yellow]warning:[/] {skipped}; scored the checkpoint of round "
                f"{metrics['round']} instead",
                highlight=False,
                soft_wrap=True,
            )
        when = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        append_evaluation(run_dir, {**metrics, "overrides": set_ or [], "when": when})
    print(json.dumps(metrics))


def plugin_rows(
    entry_points: dict[str, Any], check: bool
) -> tuple[list[list[str]], list[str], bool]:
    """The listing's rows (importing every plugin), the authoring findings with
    ``check`` (a registry hook that raises is one), and whether a plugin is broken."""
    from fedkit.plugin import registry
    from fedkit.plugin.authoring import Finding, check_entry_points, check_plugin

    loaded, findings = check_entry_points(entry_points)
    with warnings.catch_warnings():  # said as a finding and in the plugin's row instead
        warnings.simplefilter("ignore", registry.RegistryWarning)
        registered = registry.collect(loaded, registry.packages_of(entry_points))
    failed = {f.plugin: f.hook for f in reversed(registered.failures)}  # first per plugin
    findings += [
        Finding(f.plugin, f"{f}; recipes that name what it registers cannot run")
        for f in registered.failures
    ]
    provides: dict[str, list[str]] = {}
    for kind in registered.kinds().values():
        for entry in kind.entries.values():
            provides.setdefault(entry.plugin, []).append(f"{kind.kind} {entry.name}")
    rows = []
    for name, ep in entry_points.items():
        if name not in loaded:
            dist = ep.dist
            package = f"{dist.name} {dist.version}" if dist else "?"
            rows.append([name, package, "", "", "", "", "[red]broken: cannot be imported[/]"])
            continue
        info = registry.describe(ep)
        sides = info.hooks_by_side()
        rows.append(
            [
                name,
                f"{info.package} {info.version}",
                ", ".join(sides["server"] + [f"{h} (simulation)" for h in sides["simulation"]]),
                ", ".join(sides["client"]),
                ", ".join(provides.get(name, [])),
                "yes" if info.uploads_data_derived else "no",
                f"[red]broken: {failed[name]} raised[/]" if name in failed else info.summary,
            ]
        )
        findings += check_plugin(name, loaded[name]) if check else []
    return rows, findings, len(loaded) < len(entry_points) or bool(failed)


@app.command("plugins")
def list_plugins(
    check: Annotated[
        bool, typer.Option("--check", help="Report authoring mistakes; exit 2 if any.")
    ] = False,
) -> None:
    """List installed plugins: package, hooks, what they register (data sets,
    partitioners, executors, stores), and whether they upload data-derived tensors.
    While no installed plugin changed, the listing comes from a cache, without importing
    the plugins (or torch); --check always imports and checks them."""
    from fedkit.cli import plugin_cache
    from fedkit.plugin.entrypoints import discover

    table = Table(title="fedkit plugins")
    columns = ("plugin", "package", "server hooks", "client hooks", "registers", "data-derived")
    for column in (*columns, "summary"):
        table.add_column(column, overflow="fold")
    with friendly_errors():
        entry_points = discover()
        rows = None if check else plugin_cache.load(entry_points)
        findings: list[str] = []
        if rows is None:
            rows, findings, broken = plugin_rows(entry_points, check)
            if not broken:
                plugin_cache.save(entry_points, rows)
    for row in rows:
        table.add_row(*row)
    console.print(table)
    for finding in findings if check else []:
        errors.print(f"[bold red]error:[/] {finding}", highlight=False, soft_wrap=True)
    if check and findings:
        raise typer.Exit(2)


@app.command("report")
def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory.")],
) -> None:
    """Plot a run (PNG files) and write one self-contained HTML page: RUN_DIR/report.html."""
    from fedkit.cli.report import write_report

    with friendly_errors():
        page = write_report(run_dir)
    console.print(f"report: {page}")


@app.command("compare")
def compare(
    run_dirs: Annotated[list[Path], typer.Argument(help="Two or more run directories.")],
    out: Annotated[Path, typer.Option(help="Where to write compare.html and its plots.")] = Path(
        "compare"
    ),
    as_markdown: Annotated[
        bool, typer.Option("--markdown", help="Print the table as Markdown (for a README).")
    ] = False,
    group_by: Annotated[
        str | None,
        typer.Option(help="A recipe key: one row per value, mean ± std over its runs (seeds)."),
    ] = None,
    x: Annotated[
        str,
        typer.Option(
            "--x",
            help="Line runs up by round or virtual_time (the virtual clock's seconds, "
            "systems:): curves against it and the time to reach each accuracy target.",
        ),
    ] = "round",
    target: Annotated[
        list[float] | None,
        typer.Option(
            help="An accuracy target (repeat for several); by default, with --x "
            "virtual_time, the best accuracy every run reaches and 95% and 90% of it."
        ),
    ] = None,
) -> None:
    """Compare runs: final and best metrics, bytes, wall time, the recipe keys that
    differ, curves; also as HTML. --group-by aggregates seeds and orders the groups;
    --x virtual_time lines runs up by virtual seconds (sync against async)."""
    from fedkit.cli.compare import compare_runs, markdown

    with friendly_errors():
        tables, ordered, page = compare_runs(run_dirs, out, group_by, x, target)
    for table in tables:
        if as_markdown:
            print(markdown(table) + "\n")
        else:
            console.print(table)
    for line in ordered:
        (errors if as_markdown else console).print(line, highlight=False, soft_wrap=True)
    (errors if as_markdown else console).print(f"page: {page}")  # stdout stays Markdown


@app.command("new-plugin")
def new_plugin(
    name: Annotated[str, typer.Argument(help="The plugin's name (lowercase, e.g. myprox).")],
    directory: Annotated[Path, typer.Option("--dir", help="Where to create it.")] = Path("."),
) -> None:
    """Create an installable plugin package (entry point, Options, recipe, README, test)."""
    from fedkit.cli.newplugin import create

    with friendly_errors():
        root = create(name, directory)
    python = sys.executable  # this environment's, where fedkit is installed
    console.print(
        f"created {root}: {python} -m pip install -e {root} && {python} -m pytest {root}",
        highlight=False,
        soft_wrap=True,
    )


@app.command("recipes")
def list_recipes(
    filter_: Annotated[
        str | None,
        typer.Argument(
            metavar="[FILTER]", help="Show recipes whose name, scale or description has it."
        ),
    ] = None,
) -> None:
    """List shipped recipes, one line each: name, scale (CPU or GPU), description."""
    found = {name: shipped.describe(path) for name, path in shipped.shipped().items()}
    rows = [(name, shipped.scale(text), text) for name, text in found.items()]
    if filter_:
        needle = filter_.lower()
        rows = [row for row in rows if any(needle in part.lower() for part in row)]
    if not rows:
        errors.print(f"no shipped recipe matches {filter_!r} (fedkit recipes lists them all)")
        raise typer.Exit(1)
    width = max(len(name) for name, _, _ in rows)
    for name, size, text in rows:
        console.print(
            f"{name:<{width}}  {size}  {text}", overflow="ellipsis", no_wrap=True, highlight=False
        )


def one_line_warnings() -> None:
    """Show fedkit's warnings about installed packages (a registry hook that raised) as
    one line on stderr, as the CLI's other warnings are, not as Python's two."""
    from fedkit.plugin.entrypoints import RegistryWarning

    python = warnings.showwarning

    def show(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> None:
        if issubclass(category, RegistryWarning):
            errors.print(
                f"[yellow]warning:[/] {escape(str(message))}", highlight=False, soft_wrap=True
            )
        else:
            python(message, category, *args, **kwargs)

    warnings.showwarning = show


def main() -> None:
    """Console-script entry point."""
    one_line_warnings()
    sys.exit(app())
