"""`lmgeo`: one command per DVC stage, plus `query`, `findings`, `exp run`, `preset` and the tools' commands
(`analyse`, `bench`, `tune`, `check-model`, `families`, `rehearse`), whose modules live in `tools/`.

This module imports only typer and the params models, so `lmgeo --help` and every subcommand's
`--help` answer without importing torch or ray; each command imports its stage or tool module when it runs.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Optional, cast

import typer

from lmgeo.core.config import ParamsError, load_yaml
from lmgeo.core.errors import InputError, escape
from lmgeo.params import Params, load_params

app = typer.Typer(
    name="lmgeo",
    help="Geometry of updates in language models: DVC stages dispatching Ray tasks.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(show: bool) -> None:
    if show:
        from importlib import metadata

        typer.echo(f"lmgeo {metadata.version('lmgeo')}")
        raise typer.Exit()


@app.callback()
def main_options(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="print the version and exit")
    ] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", help="also show Ray's own start-up notices (token authentication and the like)")
    ] = False,
) -> None:
    """Geometry of updates in language models: DVC stages dispatching Ray tasks."""
    if verbose:
        from lmgeo.driver.runtime import VERBOSE_ENV

        os.environ[VERBOSE_ENV] = "1"  # read where Ray starts (`lmgeo.driver.runtime.show_notices`)


ParamsOpt = Annotated[Path, typer.Option("--params", help="params file to read")]
# `lmgeo query` stops a query after this long unless --timeout says otherwise: a mistyped join must not run
# for hours.
DEFAULT_QUERY_TIMEOUT_S = 600.0
RayAddressOpt = Annotated[
    Optional[str],
    typer.Option("--ray-address", envvar="RAY_ADDRESS", help="join this Ray cluster instead of an embedded one"),
]


def fail(message: str) -> None:
    typer.echo(f"lmgeo: error: {escape(message)}", err=True)
    raise typer.Exit(code=2)


def warnings_to_stderr() -> None:
    """What the library logs as a warning (a shard redone, a dataset read without its finished plan, a table
    left out of a query) reaches the user as `lmgeo: warning: ...` lines."""
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("lmgeo: warning: %(message)s"))
    library = logging.getLogger("lmgeo")
    if not library.handlers:
        library.addHandler(handler)
        library.setLevel(logging.WARNING)
        library.propagate = False


def about(path: Path, err: Exception) -> str:
    """`err`'s message naming `path` once: prefixed unless it already starts with it."""
    text = str(err)
    return text if text.startswith(f"{path}:") else f"{path}: {text}"


def interrupted() -> None:
    """Ctrl-C: one line and the shell's code for SIGINT (128 + 2); nothing half-written is kept, since
    every output is written atomically."""
    typer.echo("lmgeo: interrupted", err=True)
    raise typer.Exit(code=130)


def quiet_logs() -> None:
    """Before Ray starts, so that its local workers inherit it (cluster workers get the same through the
    job's runtime environment, `lmgeo.driver.runtime.WORKER_ENV`): no per-checkpoint "Loading weights" bars from
    every worker, and no ANSI colour codes when the output is a log file, not a terminal."""
    from lmgeo.driver.runtime import WORKER_ENV

    for name, value in WORKER_ENV.items():
        os.environ.setdefault(name, value)
    if not sys.stdout.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # its "[repeated Nx]" notes are coloured regardless


def _load(params_path: Path) -> Params:
    try:
        return load_params(params_path)
    except ParamsError as err:
        fail(str(err))
        raise  # unreachable: fail() exits


def _run_stage(
    stage: str, params_path: Path, ray_address: str | None, module_name: str | None = None, **options: Any
) -> None:
    """Validate params, then hand over to `lmgeo.stages.<stage>.run` (or `module_name`'s `run`: `lmgeo tune`, a tool
    that fans out over Ray as a stage does) in the workspace here; bad input exits with code 2."""
    from lmgeo.driver.layout import Layout

    _run_module(
        module_name or f"lmgeo.stages.{stage}", _load(params_path), ray_address, layout=Layout.here(), **options
    )


def _run_module(module_name: str, params: Params, ray_address: str | None, **options: Any) -> None:
    quiet_logs()
    warnings_to_stderr()
    module = importlib.import_module(module_name)
    from lmgeo.core.execution import ShardFailed

    try:
        module.run(params, ray_address=ray_address, **options)
    except InputError as err:
        fail(str(err))
    except KeyboardInterrupt:
        interrupted()
    except ShardFailed as err:
        if not isinstance(err.cause, InputError):  # a bug or a crash: keep the traceback
            raise
        fail(f"shard {err.key!r}: {err.cause}")
    except OSError as err:
        from lmgeo.core.store import is_disk_full

        if not is_disk_full(err):
            raise
        fail(f"{err.filename or 'a write'}: no space left on the device; free some space and re-run ({err})")


def _stage_command(stage: str, summary: str) -> None:
    def command(
        params: ParamsOpt = Path("params.yaml"),
        ray_address: RayAddressOpt = None,
    ) -> None:
        # Before the stage imports torch or NumPy: the kernels they load decide the last bits of its results
        # (the tools keep the machine's own: the bench measures it).
        from lmgeo.core.determinism import pin_this_process

        pin_this_process(threads=1)
        _run_stage(stage, params, ray_address)

    command.__doc__ = summary
    app.command(name=stage)(command)


_stage_command("prepare", "Read the corpus, train or load the tokenizer, write train/val token ids.")
_stage_command("train", "Train the grid of runs (arch x recipe x seed), one Ray task per run.")
_stage_command("external", "Record what the external models are now (digests of their files), for DVC.")
_stage_command("extract", "Capture block inputs/outputs of every analysed model into data/activations.")
_stage_command("fit", "Fit tokenwise maps on nearest-neighbour pairs, per (model, layer, class).")
_stage_command("perturb", "Patch each fitted anchor and measure the KL of the next-token distribution.")
_stage_command("aggregate", "Summarise data/ with DuckDB into reports/tables and metrics.")
_stage_command("report", "Render reports/report.md, report.html and the figures from reports/tables.")


@app.command()
def query(
    sql: Annotated[str, typer.Argument(help="a read-only SQL statement")],
    rev: Annotated[
        Optional[list[str]], typer.Option("--rev", help="git revision, DVC experiment or `workspace` (repeatable)")
    ] = None,
    fmt: Annotated[str, typer.Option("--format", help="table | csv | json")] = "table",
    timeout: Annotated[
        float, typer.Option("--timeout", help="stop the query after this many seconds")
    ] = DEFAULT_QUERY_TIMEOUT_S,
    memory_limit: Annotated[
        Optional[str], typer.Option("--memory-limit", help="DuckDB's memory limit, e.g. 8GB (default: 1/4 of RAM)")
    ] = None,
    temp_limit: Annotated[
        Optional[str],
        typer.Option("--temp-limit", help="DuckDB's temp-disk limit, e.g. 20GB (default: 1/4 of the free space)"),
    ] = None,
) -> None:
    """Run read-only SQL over the result tables, at the working tree or at given revisions."""
    if fmt not in ("table", "csv", "json"):
        fail(f"--format must be one of table, csv, json (got {escape(fmt)!r})")
    if not 0 < timeout < float("inf"):
        fail(f"--timeout must be a positive number of seconds (got {timeout})")
    warnings_to_stderr()
    from lmgeo.driver.layout import Layout
    from lmgeo.results.query import Format, Limits, QueryError, run_query

    layout = Layout.enclosing()
    try:
        limits = Limits(memory_limit, temp_limit, timeout)
        typer.echo(run_query(sql, rev or [], layout.root, layout.query_sources(), cast(Format, fmt), limits))
    except QueryError as err:
        fail(str(err))
    except KeyboardInterrupt:
        interrupted()


@app.command()
def analyse(
    model: Annotated[str, typer.Argument(help="a local model folder (save_pretrained) or a hub id (org/name)")],
    out: Annotated[Optional[Path], typer.Option("--out", help="the folder to write (default: analyse-<name>)")] = None,
    k: Annotated[Optional[int], typer.Option("--k", help="neighbours per anchor (analysis.k)")] = None,
    anchors: Annotated[Optional[int], typer.Option("--anchors", help="anchors per layer (analysis.anchors)")] = None,
    classes: Annotated[
        Optional[list[str]], typer.Option("--classes", help="fit classes, e.g. lowrank,identity (analysis.classes)")
    ] = None,
    layers: Annotated[
        Optional[list[str]], typer.Option("--layers", help="transitions l -> l+1 to analyse, e.g. 0,3 (default: all)")
    ] = None,
    baseline: Annotated[
        bool, typer.Option("--baseline/--no-baseline", help="analyse a random-weight copy beside it")
    ] = True,
    revision: Annotated[Optional[str], typer.Option(help="hub revision (branch, tag or commit)")] = None,
    params: Annotated[
        Optional[Path],
        typer.Option("--params", help="take the settings from this params file (default: the default study's)"),
    ] = None,
    ray_address: RayAddressOpt = None,
) -> None:
    """Study A on one causal LM (any verified family), from any folder, no training: extract, fit, perturb, for
    the model and a random-weight copy of its architecture, and a report of its own in --out."""
    from lmgeo.commands import analyse as tool

    try:  # the checks that need no torch: a bad path or folder is refused at once
        source = tool.locate_model(model, revision)
        out_dir = tool.output_folder(out, source)
        settings = tool.overrides(k, anchors, classes, layers)
        raw = tool.base_params(params)
        key = tool.request_key(raw, settings, source, baseline)
    except (InputError, ParamsError) as err:
        fail(str(err))
    if report := tool.up_to_date(out_dir, key):
        typer.echo(f"analyse: nothing to do: {report} is the analysis of these settings, model files and code")
        return
    from lmgeo.core.determinism import pin_this_process
    from lmgeo.params import apply_overrides, parse_params

    pin_this_process(threads=1)  # as a stage: the same kernels, so the same numbers as `dvc repro`
    quiet_logs()  # before validation imports transformers, which reads its progress-bar settings then
    try:
        study = apply_overrides(parse_params(raw, str(params or "the default study")), settings)
    except ParamsError as err:
        fail(str(err))
    _run_module("lmgeo.commands.analyse", study, ray_address, source=source, out=out_dir, baseline=baseline, key=key)


@app.command()
def bench(
    quick: Annotated[bool, typer.Option("--quick", help="a smoke run: tiny sizes, checks only that it runs")] = False,
    out_dir: Annotated[Path, typer.Option("--out", help="where bench.json and bench.md go")] = Path("reports"),
    only: Annotated[
        Optional[list[str]], typer.Option("--only", help="this section only (repeatable), e.g. extraction, recipes")
    ] = None,
    params: ParamsOpt = Path("params.yaml"),
) -> None:
    """Benchmarks: ratios measured side by side in one run (SPEC §7)."""
    from lmgeo.commands.bench.command import SECTIONS
    from lmgeo.commands.bench.command import run as run_bench

    unknown = sorted(set(only or ()) - set(SECTIONS))
    if unknown:
        fail(f"--only {', '.join(unknown)}: no such bench section; choose from {', '.join(SECTIONS)}")
    run_bench(_load(params), quick=quick, out_dir=out_dir, only=only)


@app.command()
def tune(
    arch: Annotated[Optional[str], typer.Option(help="architecture to tune on (default: the study's first)")] = None,
    steps: Annotated[
        Optional[int], typer.Option(help="steps per trial (default: train.steps, the study's horizon)")
    ] = None,
    seed: Annotated[
        Optional[list[int]], typer.Option(help="seed (repeatable; default: 1000 1001, not the study's)")
    ] = None,
    recipe: Annotated[Optional[list[str]], typer.Option(help="recipe (repeatable; default: all registered)")] = None,
    out: Annotated[Path, typer.Option(help="where the protocol and results go")] = Path("docs/tuning.md"),
    params: ParamsOpt = Path("params.yaml"),
    ray_address: RayAddressOpt = None,
) -> None:
    """Sweep each recipe's head step size with equal budgets, select on val, check transfer to the study's
    other archs, and write the protocol and results (docs/tuning.md)."""
    _run_stage(
        "tune",
        params,
        ray_address,
        module_name="lmgeo.commands.tune.command",
        arch=arch,
        steps=steps,
        seeds=seed,
        recipes=recipe,
        out=out,
    )


@app.command(name="check-model")
def check_model(
    ref: Annotated[str, typer.Argument(help="a local save_pretrained folder or a hub id")],
    revision: Annotated[Optional[str], typer.Option(help="hub revision (branch, tag or commit)")] = None,
    params: ParamsOpt = Path("params.yaml"),
) -> None:
    """Load a causal LM as Study A would (under params' security section) and verify its structure."""
    from lmgeo.commands.verify.command import check_model as run_check

    loaded = _load(params)
    try:
        typer.echo(run_check(loaded, ref, revision))
    except InputError as err:
        fail(str(err))


@app.command()
def families(
    write: Annotated[
        Optional[Path], typer.Option("--write", help="write the table here, e.g. docs/families.md")
    ] = None,
    only: Annotated[Optional[list[str]], typer.Option("--only", help="this model type only (repeatable)")] = None,
) -> None:
    """Verify a tiny random-weight model of every causal-LM family transformers ships; print the table."""
    from lmgeo.commands.verify.command import write_coverage

    typer.echo(write_coverage(write, only))


@app.command()
def rehearse(
    write: Annotated[
        Optional[Path],
        typer.Option("--write", help="write the report here, e.g. docs/scale.md (and .json beside it)"),
    ] = None,
    only: Annotated[
        Optional[list[str]],
        typer.Option("--only", help="this seed model only: pythia-1.4b, mamba-370m, gpt2 (repeatable)"),
    ] = None,
    device: Annotated[str, typer.Option(help="cpu, or cuda on a GPU node")] = "cpu",
    threads: Annotated[int, typer.Option(min=1, help="torch threads")] = 1,
    preset: Annotated[Path, typer.Option(help="the study whose cost is extrapolated")] = Path("presets/seed.yaml"),
    render: Annotated[
        Optional[Path],
        typer.Option(
            "--render",
            help="measure nothing: the report again from a rehearsal's JSON (docs/scale.json), "
            "e.g. after a GPU check was committed (reports/gpu.json)",
        ),
    ] = None,
    params: ParamsOpt = Path("params.yaml"),
) -> None:
    """Run the seed's model configurations (random weights) through extract, fit and perturb on a slice;
    print the per-unit costs, peak memory and the extrapolated cost of the preset's study (its GPU column from
    the GPU check's reports/gpu.json)."""
    from lmgeo.commands.rehearse.command import rehearse as run_rehearsal

    loaded = _load(params)
    if render is not None and not render.is_file():
        fail(f"--render {render}: no such rehearsal JSON; `lmgeo rehearse --write docs/scale.md` writes one")
    try:
        typer.echo(run_rehearsal(loaded, preset, write, only, device, threads, render))
    except ParamsError as err:
        fail(about(preset, err))


# Trusting a model's code or reading outside the workspace is the user's decision, never a preset's alone.
AllowSecurityOpt = Annotated[
    bool,
    typer.Option("--allow-security-changes", help="apply a preset that changes a `security` setting (printed)"),
]


def _preset_overrides(path: Path, params_path: Path, allow_security: bool) -> list[str]:
    """A preset as DVC `-S` options, after checking that the merged params validate."""
    from lmgeo.core.config import flatten_overrides, preset_overrides
    from lmgeo.params import apply_overrides, security_changes

    try:
        overrides = preset_overrides(load_yaml(path))
        current = _load(params_path)
        changes = security_changes(current, apply_overrides(current, overrides))  # the merged params must validate
        present = flatten_overrides(load_yaml(params_path) or {})
    except ParamsError as err:
        fail(about(path, err))
    _consent_to_security(path, changes, allow_security)
    # DVC (Hydra) overrides a key params.yaml has (a value or a whole section) with `key=value` and adds one
    # it lacks with `+key=value`.
    sections = {key.rsplit(".", n)[0] for key in present for n in range(1, key.count(".") + 1)}
    known = present.keys() | sections
    return [arg for key, value in overrides.items() for arg in ("-S", f"{'' if key in known else '+'}{key}={value}")]


def _consent_to_security(path: Path, changes: list[str], allowed: bool) -> None:
    """Refuse a preset's security changes unless allowed; print the ones allowed (stderr: stdout is `-S` options)."""
    if changes and not allowed:
        fail(f"{path}: changes {'; '.join(changes)}: pass --allow-security-changes to apply it")
    for change in changes:
        typer.echo(f"lmgeo: warning: {escape(str(path))} changes {change}", err=True)


@app.command()
def preset(
    path: Annotated[Path, typer.Argument(help="a preset file of params overrides, e.g. presets/gpu.yaml")],
    params: ParamsOpt = Path("params.yaml"),
    allow_security_changes: AllowSecurityOpt = False,
) -> None:
    """Print a preset as DVC `-S` options (`lmgeo exp run PRESET` runs it)."""
    typer.echo(" ".join(_preset_overrides(path, params, allow_security_changes)))


exp_app = typer.Typer(help="DVC experiments of lmgeo's presets.", no_args_is_help=True)
app.add_typer(exp_app, name="exp")


@exp_app.command(name="run", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def exp_run(
    ctx: typer.Context,
    preset_path: Annotated[Path, typer.Argument(metavar="PRESET", help="a preset file, e.g. presets/gpu.yaml")],
    params: ParamsOpt = Path("params.yaml"),
    allow_security_changes: AllowSecurityOpt = False,
) -> None:
    """`dvc exp run` with the preset's overrides (`-S`), after checking the preset: a missing or invalid one is
    an error, never a bare `dvc exp run` of the default study. DVC's own options follow the preset, e.g.
    `lmgeo exp run presets/gpu.yaml --queue`, `--temp` (the working tree and its report left as they are),
    `-n NAME`."""
    overrides = _preset_overrides(preset_path, params, allow_security_changes)
    command = [sys.executable, "-m", "dvc", "exp", "run", *ctx.args, *overrides]
    sys.stdout.flush()
    os.execv(sys.executable, command)  # DVC's own exit code and Ctrl-C, as if typed


@app.command(name="findings")
def findings_command(
    write: Annotated[
        Optional[Path], typer.Option("--write", help="put them into this file's findings block: README.md")
    ] = None,
) -> None:
    """Print what the study in reports/ finds (the report summary's first paragraph); `--write README.md`
    puts it into README's findings block, from a report of the default study only."""
    from lmgeo.driver.layout import Layout
    from lmgeo.stages.report import findings, write_findings

    layout = Layout.enclosing()
    try:
        if write is None:
            typer.echo(findings(layout))
        else:
            changed = write_findings(layout, write)
            typer.echo(f"findings: {'rewrote' if changed else 'unchanged:'} the findings block of {write}")
    except InputError as err:
        fail(str(err))


def main() -> None:  # pragma: no cover - console entry point alias
    app(prog_name="lmgeo")


if __name__ == "__main__":  # pragma: no cover
    main()
