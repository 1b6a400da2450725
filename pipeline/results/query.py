"""Read-only SQL over the result tables and per-token datasets, at the working tree or any revision (SPEC §6).

Views, named as the files or datasets they come from (``sources`` says where each lives in the workspace):
- one per result table ``<tables>/<name>.parquet`` (``runs``, ``curves``, ``recipes``, ``geometry``, ...);
- ``steps``, ``fits``, ``perturb`` and ``activations`` (scalar columns only; vectors are not exposed) over
  the hive-partitioned datasets, with ``model`` as in the tables (``<run>@final``, hub ids with ``/``).
  Only files that shard manifests list are read, each checked against its size and sha256, and a dataset
  that mixes the shards of two runs of its stage is refused (``pipeline.core.store.verified_files``).

The result tables and the params are committed to git, so a fresh clone queries them with no DVC cache or
remote. With revisions (git revisions or DVC experiment names), each revision's tables and params are read
from git's objects, and the per-token datasets the SQL names literally (DVC outputs) are copied by DVC's own
filesystem (``dvc.api.DVCFileSystem``), from the DVC cache or else the default remote, into a temporary folder
(tables a revision tracked with DVC, before they were committed, come that way too); a dataset the SQL does
not name is not a view at that revision (so reaching it indirectly fails instead of reading nothing). With
several revisions every view is the union (by column name) of the revisions' data, with a leading ``rev``
column. A per-token dataset DVC tracks but the working tree lacks (a fresh clone) is an error saying how to
get it, not an empty view; one whose stage stopped half-way is read as far as it got, the missing shards
named in a note (logged to ``lmgeo.query``).

Read-only twice over: the statement must parse as one SELECT / WITH / DESCRIBE / SHOW / SUMMARIZE /
EXPLAIN (of such a statement) / PRAGMA table_info|show_tables, and DuckDB itself runs in memory with the
data registered as Arrow objects, then ``enable_external_access = false`` and ``lock_configuration = true``:
it can neither read nor write any file, attach a database or load an extension.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import math
import os
import re
import signal
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import duckdb
import pyarrow as pa
import pyarrow.dataset as ds

from pipeline.core.contracts import (
    ACTIVATIONS,
    CHECKPOINTS,
    FITS,
    PERTURB,
    RUN_ID_PATTERN,
    STEPS,
    Dataset,
    read_result_tables,
    scan,
    table_id_sql,
)
from pipeline.core.errors import InputError
from pipeline.core.store import CorruptShardError, StaleShardError, files_so_far

Format = Literal["table", "csv", "json"]
# Views over the per-token datasets: name -> (dataset, with its vector columns). `sources[dataset.name]` is
# the dataset's workspace-relative folder. Vectors come as `FLOAT[]` in their own views, so that a plain
# `SELECT *` over `fits` or `activations` never reads them.
DATASETS: dict[str, tuple[Dataset, bool]] = {
    **{d.name: (d, False) for d in (STEPS, FITS, PERTURB, ACTIVATIONS)},
    "activation_vectors": (ACTIVATIONS, True),
    "fit_vectors": (FITS, True),
}
# The revision name DVC gives the working tree (`dvc exp show`, `dvc metrics diff`): read in place.
WORKSPACE = "workspace"
# A trained model's table id, `<run>@<checkpoint>`: the run id's groups 1 (arch) and 3 (seed) and the checkpoint
# (the group after the run id's) become columns of every table and view with a `model` column; NULL for an
# external model.
_MODEL_ID = f"{RUN_ID_PATTERN.removesuffix('$')}@({'|'.join(CHECKPOINTS)})$"
_CHECKPOINT_GROUP = re.compile(RUN_ID_PATTERN).groups + 1
MODEL_PARTS = {"arch": f"NULLIF(regexp_extract(model, '{_MODEL_ID}', 1), '')",
               "seed": f"TRY_CAST(regexp_extract(model, '{_MODEL_ID}', 3) AS INTEGER)",
               "checkpoint": f"NULLIF(regexp_extract(model, '{_MODEL_ID}', {_CHECKPOINT_GROUP}), '')"}  # fmt: skip
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_EXPLAIN_PREFIX = re.compile(r"^\s*explain\s+(analy[sz]e\s+)?(\([^)]*\)\s*)?", re.IGNORECASE)
_READ_ONLY_PRAGMA = re.compile(r"^\s*pragma\s+(table_info|show_tables|show_tables_expanded|show)\b", re.IGNORECASE)
_LOCKDOWN = (
    "SET autoinstall_known_extensions = false",
    "SET autoload_known_extensions = false",
    "SET python_enable_replacements = false",  # no scanning of the caller's Python variables by name
    "SET enable_external_access = false",  # no file, URL, ATTACH, INSTALL or LOAD from here on
    "SET lock_configuration = true",  # and the statements above cannot be undone
)


# Notes on what a query read (a dataset whose stage stopped half-way): `lmgeo query` prints them on stderr.
log = logging.getLogger("lmgeo.query")


class QueryError(InputError):
    """A query that cannot run: not read-only, bad SQL, an unknown revision or unreadable data."""


def run_query(
    sql: str, revs: Sequence[str] | None, workspace: Path, sources: dict[str, str], fmt: Format = "table",
    timeout_s: float | None = None,
) -> str:
    """Run one read-only statement and render the result as ``fmt`` (table | csv | json)."""
    return format_result(query_table(sql, revs, workspace, sources, timeout_s), fmt)


def query_table(
    sql: str, revs: Sequence[str] | None, workspace: Path, sources: dict[str, str], timeout_s: float | None = None
) -> pa.Table:
    """Run one read-only statement over the working tree (no ``revs``) or over the given revisions.
    ``sources`` maps ``tables``, ``params``, ``tokenizer`` and each dataset name to its workspace-relative
    path; the revision ``workspace`` is the working tree. A statement still running after ``timeout_s`` is
    interrupted."""
    statement = check_read_only(sql)
    # Outside the workspace, private, emptied afterwards: DuckDB may read its own temp folder even with
    # external access off, so it must never be one a workspace (or a symlink in it) controls.
    with tempfile.TemporaryDirectory(prefix="lmgeo-query-") as tmp, _ctrl_c_deferred() as ctrl_c:
        if revs:
            snapshots = []
            for i, rev in enumerate(revs):
                snapshots.append(_revision(sql, workspace, rev, Path(tmp) / str(i), sources))
                ctrl_c.check()
        else:
            _check_checked_out(sql, workspace, sources)
            snapshots = [_snapshot(workspace, None, sources)]
        ctrl_c.check()
        con = _locked_connection(snapshots, with_rev=bool(revs) and len(revs) > 1, temp=Path(tmp) / "duckdb")
        ctrl_c.check()
        try:
            no_results = not any(s.has_results for s in snapshots)
            return _run_interruptibly(con, statement, timeout_s, ctrl_c, no_results)
        finally:
            # After an interrupt DuckDB can still count the stopped call as running and refuse to close;
            # the in-memory database goes with the process either way.
            with contextlib.suppress(duckdb.Error):
                con.close()


class _CtrlC:
    """Ctrl-C recorded, not raised: DuckDB, run in the main thread, turns a `KeyboardInterrupt` raised by
    Python's handler into its own "Query interrupted" error (a traceback, not exit 130), and a statement
    it lets finish loses the interrupt altogether; so the handler only sets `pressed`, and the query
    checks it between steps and while it waits."""

    def __init__(self) -> None:
        self.pressed = False

    def press(self, signum: int, frame: Any) -> None:
        self.pressed = True

    def check(self) -> None:
        if self.pressed:
            raise KeyboardInterrupt


@contextlib.contextmanager
def _ctrl_c_deferred() -> Iterator[_CtrlC]:
    """SIGINT handled by a `_CtrlC` for the duration (only the main thread can set a handler; elsewhere
    Python's own stays, and no Ctrl-C reaches the thread anyway)."""
    ctrl_c = _CtrlC()
    if threading.current_thread() is not threading.main_thread():
        yield ctrl_c
        return
    previous = signal.signal(signal.SIGINT, ctrl_c.press)
    try:
        yield ctrl_c
    finally:
        signal.signal(signal.SIGINT, previous)
    ctrl_c.check()


def _run_interruptibly(
    con: duckdb.DuckDBPyConnection, statement: str, timeout_s: float | None, ctrl_c: _CtrlC, no_results: bool
) -> pa.Table:
    """Run the statement in a thread, so the main thread can stop it (DuckDB does not see Python's signals
    while it computes in another thread) by `con.interrupt()`: at the deadline, or on Ctrl-C."""
    outcome: dict[str, Any] = {}

    def execute() -> None:
        try:
            result = con.sql(statement)
            outcome["table"] = result.to_arrow_table() if result is not None else pa.table({})
        except duckdb.Error as err:
            outcome["error"] = err
        finally:
            outcome["done"] = True

    def stop() -> None:
        # Repeated: an interrupt that lands before DuckDB starts executing is reset by the query's start.
        while "done" not in outcome:
            con.interrupt()
            time.sleep(0.05)

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    threading.Thread(target=execute, daemon=True).start()
    while "done" not in outcome:
        time.sleep(0.05)
        if ctrl_c.pressed:
            stop()
            raise KeyboardInterrupt
        if deadline is not None and time.monotonic() > deadline and "done" not in outcome:
            stop()
            raise QueryError(f"the query ran longer than --timeout {timeout_s:g} s and was stopped")
    if "error" in outcome:
        raise _failure(outcome["error"], no_results)
    return outcome["table"]


def _failure(err: duckdb.Error, no_results: bool) -> QueryError:
    """A table the SQL names is missing because nothing has run yet (a fresh clone): say how to make the
    results, rather than DuckDB's "did you mean duckdb_constraints?"."""
    if no_results and "does not exist" in str(err):
        return QueryError("no results yet: run `dvc repro`")
    return QueryError(f"query failed: {err}{_hint(err)}")


def _hint(err: duckdb.Error) -> str:
    """A per-token dataset is a view at a revision only when the SQL names it literally (it is copied
    then); say so when the missing table is one of them."""
    missing = [name for name in DATASETS if f"Table with name {name} does not exist" in str(err)]
    return f" (at a revision, name {missing[0]!r} literally in the SQL so that it is fetched)" if missing else ""


# --------------------------------------------------------------------------------- read-only check
def check_read_only(sql: str) -> str:
    """The single statement of ``sql`` when it can only read; ``QueryError`` otherwise."""
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as err:
        raise QueryError(f"SQL does not parse: {err}") from None
    if len(statements) != 1:
        raise QueryError(f"expected exactly one SQL statement, got {len(statements)}")
    statement = statements[0]
    if not _reads_only(statement):
        raise QueryError(
            f"{statement.type.name} statements are refused: lmgeo query is read-only "
            "(SELECT, WITH, DESCRIBE, SHOW, SUMMARIZE, EXPLAIN, PRAGMA table_info/show_tables)"
        )
    return statement.query


def _reads_only(statement: duckdb.Statement) -> bool:
    kind = statement.type
    if kind == duckdb.StatementType.SELECT:
        return True
    if kind == duckdb.StatementType.PRAGMA:
        return bool(_READ_ONLY_PRAGMA.match(statement.query))
    if kind == duckdb.StatementType.EXPLAIN:
        # EXPLAIN ANALYZE executes its statement, so what is explained must itself be read-only.
        inner = duckdb.extract_statements(_EXPLAIN_PREFIX.sub("", statement.query, count=1))
        return len(inner) == 1 and _reads_only(inner[0])
    return False


# ------------------------------------------------------------------------------------------- data
@dataclass
class _Snapshot:
    rev: str | None
    tables: dict[str, pa.Table]
    datasets: dict[str, ds.Dataset]
    has_results: bool  # result tables or a dataset folder: something a stage wrote


def _revision(sql: str, workspace: Path, rev: str, dest: Path, sources: dict[str, str]) -> _Snapshot:
    """The data of ``rev``: the working tree itself for ``workspace``; else, under ``dest``, the tables and the
    params as git has them at ``rev``, and what the SQL names of the datasets and the tokenizer (``tokens``)
    copied by DVC (with the tables, at a revision that tracked them with DVC)."""
    if rev == WORKSPACE:
        _check_checked_out(sql, workspace, sources)
        return _snapshot(workspace, rev, sources)
    outputs = _named_outputs(sql)
    in_git = _git_copy(workspace, rev, dest, [sources["tables"], sources["params"]])
    from_dvc = [sources[w] for w in outputs] + ([] if sources["tables"] in in_git else [sources["tables"]])
    if from_dvc:
        _checkout(workspace, rev, dest, from_dvc)
    return _snapshot(dest, rev, {w: sources[w] for w in ("tables", "params", *outputs)})


def _named_outputs(sql: str, *, surely: bool = False) -> list[str]:
    """The DVC outputs (by source name) the SQL reads: its per-token datasets and, for ``tokens``, the tokenizer.
    Tables as DuckDB's parser finds them (a column named like a view, `runs.tokens` or `recipes.steps`, is
    none); for a statement it cannot serialise (EXPLAIN, PRAGMA), every view whose name appears, or none when
    `surely` (an error must not rest on a guess)."""
    tables = _tables_read(sql)
    if tables is None and surely:
        return []
    reads = (lambda view: _mentions(sql, view)) if tables is None else (lambda view: view in tables)
    named = sorted({DATASETS[v][0].name for v in DATASETS if reads(v)})
    return [*named, *(["tokenizer"] if reads("tokens") else [])]


def _tables_read(sql: str) -> set[str] | None:
    """The names of the tables and views ``sql`` reads, lower case (DuckDB's parse tree); None when DuckDB cannot
    serialise the statement."""
    with duckdb.connect(":memory:") as con:
        tree = json.loads(con.execute("SELECT json_serialize_sql(?)", [sql]).fetchone()[0])
    if tree.get("error"):
        return None
    found: set[str] = set()
    pending: list[Any] = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            if node.get("type") == "BASE_TABLE" and isinstance(node.get("table_name"), str):
                found.add(node["table_name"].lower())
            pending.extend(node.values())
        elif isinstance(node, list):
            pending.extend(node)
    return found


def _git_copy(workspace: Path, rev: str, dest: Path, paths: Sequence[str]) -> set[str]:
    """Copy the ``paths`` (workspace-relative) that git holds at ``rev`` under ``dest``, from git's objects (no
    checkout, no DVC); returns those it held."""
    from dvc.scm import SCM, SCMError, resolve_rev  # DVC's git, which resolves experiment names too

    try:
        scm = SCM(str(workspace))
    except SCMError as err:
        raise QueryError(f"revision {rev!r}: {workspace} is not in a git repository ({err})") from None
    try:
        fs = scm.get_fs(resolve_rev(scm, rev))
        prefix = workspace.resolve().relative_to(Path(scm.root_dir).resolve())
        held = set()
        for path in paths:
            inside = (prefix / path).as_posix()
            if fs.isdir(inside):
                fs.get(inside, str(dest / path), recursive=True)
            elif fs.isfile(inside):
                (dest / path).parent.mkdir(parents=True, exist_ok=True)
                fs.get(inside, str(dest / path))
            else:
                continue
            held.add(path)
        return held
    except SCMError as err:
        raise QueryError(f"revision {rev!r}: {err}") from None
    finally:
        scm.close()


def _checkout(workspace: Path, rev: str, dest: Path, outputs: Sequence[str]) -> Path:
    """Copy the DVC ``outputs`` as they are at ``rev`` under ``dest`` via DVC: from the local cache, or else
    fetched into it from the default remote first (as `dvc fetch` would)."""
    try:
        return _copy(workspace, rev, dest, outputs)
    except _NotCached as missing:
        if not _fetch(workspace, rev, outputs):
            raise missing from None
        return _copy(workspace, rev, dest, outputs)


class _NotCached(QueryError):
    """A revision's results are in neither the local DVC cache nor (yet) fetched from the remote."""


def _copy(workspace: Path, rev: str, dest: Path, outputs: Sequence[str]) -> Path:
    from dvc.api import DVCFileSystem
    from dvc.exceptions import DvcException
    from dvc_data.index.index import DataIndexError

    try:
        fs = DVCFileSystem(str(workspace), rev=rev)
        for path in outputs:
            if fs.isdir(path):
                fs.get(path, str(dest / path), recursive=True)
            elif fs.isfile(path):
                (dest / path).parent.mkdir(parents=True, exist_ok=True)
                fs.get(path, str(dest / path))
    except DvcException as err:
        if "unknown Git revision" in str(err) or "revision" in type(err).__name__.lower():
            raise QueryError(f"revision {rev!r}: {err}") from None
        raise _not_local(rev, outputs, err) from None
    except (DataIndexError, OSError) as err:  # DVC's data index, for outputs its cache lacks
        raise _not_local(rev, outputs, err) from None
    return dest


def _fetch(workspace: Path, rev: str, outputs: Sequence[str]) -> bool:
    """Whether DVC fetched ``outputs`` as ``rev`` tracks them from the default remote into the cache (none
    configured, unreachable, or without them: no)."""
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    try:
        with Repo(str(workspace)) as repo:
            return repo.fetch(targets=list(outputs), revs=[rev], workspace=False) > 0  # relative to the repo
    except (DvcException, OSError):
        return False


def _not_local(rev: str, outputs: Sequence[str], err: BaseException) -> QueryError:
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return _NotCached(
        f"revision {rev!r}: {', '.join(outputs)} (DVC outputs) are in neither the local DVC cache nor the default "
        f"remote ({type(err).__name__}: {first_line}); push them from where they were computed (`dvc push`) to a "
        f"remote this clone uses (README: \"Sharing results\"), or rebuild them with `git checkout {rev} && dvc "
        "repro`; the result tables and params are in git and need neither"
    )


def _check_checked_out(sql: str, workspace: Path, sources: dict[str, str]) -> None:
    """A DVC output the SQL names that `dvc.lock` records but the working tree lacks (a fresh clone: git holds
    the result tables, not the per-token data) is an error naming the commands that bring it, not an empty
    view."""
    lock = workspace / "dvc.lock"
    wanted = [sources[name] for name in _named_outputs(sql, surely=True) if name in sources]
    absent = [path for path in wanted if not (workspace / path).exists()]
    if not absent or not lock.is_file():
        return
    import yaml

    try:
        stages = yaml.safe_load(lock.read_text())["stages"]
        tracked = {out["path"] for stage in stages.values() for out in stage.get("outs", [])}
    except (yaml.YAMLError, KeyError, TypeError, AttributeError):
        return  # an unreadable lock: nothing to say beyond the empty view
    missing = [path for path in absent if path in tracked]
    if missing:
        paths = " ".join(missing)
        raise QueryError(
            f"{paths}: not in this checkout (DVC outputs; git holds the result tables and params only): "
            f"`dvc pull {paths}` fetches them from a DVC remote (README: \"Sharing results\"), `dvc repro` "
            "recomputes them"
        )


def _mentions(sql: str, name: str) -> bool:
    return re.search(rf"\b{re.escape(name)}\b", sql, re.IGNORECASE) is not None


def _snapshot(root: Path, rev: str | None, sources: dict[str, str]) -> _Snapshot:
    """The tables (read into memory; they are small) and lazy, verified datasets found under ``root``."""
    where = f"revision {rev!r}" if rev else str(root)

    def cause(err: BaseException) -> str:
        # At a revision `root` is a temporary copy, gone once the query ends: the paths the cause names
        # (the file refused, its manifest) are shown relative to it, as they are in the workspace at `rev`.
        return str(err).replace(f"{root}{os.sep}", "") if rev else str(err)

    folder = root / sources["tables"]
    try:
        found = read_result_tables(folder) if folder.is_dir() else {}
    except (CorruptShardError, StaleShardError, OSError, pa.ArrowException) as err:
        raise QueryError(f"{where}: cannot read {sources['tables']}: {cause(err)}") from None
    tables = {name: table for name, table in found.items() if _IDENTIFIER.match(name) and name not in DATASETS}
    vocabulary = root / sources.get("tokenizer", "") / "tokenizer.json"
    if "tokenizer" in sources and vocabulary.is_file():
        tables["tokens"] = _tokens_table(vocabulary)
    if (root / sources["params"]).is_file():
        try:
            tables["params"] = _params_table(root / sources["params"])
        except InputError as err:
            raise QueryError(f"{where}: cannot read {sources['params']}: {cause(err)}") from None
    datasets = {}
    for name, (dataset, vectors) in DATASETS.items():
        if dataset.name not in sources:
            continue
        folder = root / sources[dataset.name]
        rebuild = f"`lmgeo {dataset.written_by}`"
        try:
            files, missing = files_so_far(folder, rebuild=rebuild) if folder.is_dir() else ([], [])
            datasets[name] = scan(folder, dataset, files, vectors=vectors)
        except (CorruptShardError, StaleShardError, OSError, pa.ArrowException) as err:
            raise QueryError(f"{where}: cannot read {sources[dataset.name]}: {cause(err)}") from None
        if missing and not vectors:  # once per dataset, not again for its vectors' view
            log.warning(_partial_note(where, sources[dataset.name], missing, rebuild))
    written = bool(found) or any((root / sources[d.name]).is_dir() for d, _ in DATASETS.values() if d.name in sources)
    return _Snapshot(rev, tables, datasets, written)


def _partial_note(where: str, folder: str, missing: list[str], rebuild: str) -> str:
    shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
    return (
        f"{where}: {folder} is partial: its stage stopped (or is running) with {len(missing)} planned shard"
        f"{'s' if len(missing) != 1 else ''} still to write ({shown}); read what is complete, `dvc repro` (or "
        f"{rebuild}) finishes it"
    )


def _params_table(path: Path) -> pa.Table:
    """`params.yaml` as rows (key, value): dotted keys, values as JSON text (`json_extract` reads them)."""
    from pipeline.core.config import ParamsError, flatten_overrides, load_yaml

    raw = load_yaml(path) or {}
    if not isinstance(raw, dict):  # flatten_overrides would call it "a preset"
        raise ParamsError(f"{path}: expected a mapping of sections at the top level")
    flat = flatten_overrides(raw)
    return pa.table({"key": list(flat), "value": list(flat.values())})


def _tokens_table(path: Path) -> pa.Table:
    """The prepared tokenizer's vocabulary: `token_id`, `token` (the text it decodes to) and `piece` (its entry
    in the vocabulary, e.g. `Ġthe` for a byte-level BPE's " the")."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    ids = range(tokenizer.get_vocab_size(with_added_tokens=True))
    return pa.table({
        "token_id": pa.array(ids, pa.int32()),
        "token": [tokenizer.decode([i], skip_special_tokens=False) for i in ids],
        "piece": [tokenizer.id_to_token(i) for i in ids],
    })  # fmt: skip


def _locked_connection(snapshots: list[_Snapshot], with_rev: bool, temp: Path) -> duckdb.DuckDBPyConnection:
    """Result tables are copied into DuckDB's memory; per-token datasets stay lazy Arrow scans behind views
    (their registered sources `_<name>_<i>` remain visible to SHOW TABLES)."""
    con = duckdb.connect(":memory:", config={"temp_directory": str(temp)})
    for name in sorted({n for s in snapshots for n in s.tables}):
        sources = [(i, s.rev, s.tables[name]) for i, s in enumerate(snapshots) if name in s.tables]
        con.execute(f'CREATE TABLE "{name}" AS {_union(con, name, sources, with_rev)}')
        for i, _, _ in sources:
            con.unregister(f"_{name}_{i}")
    for name in DATASETS:
        sources = [(i, s.rev, s.datasets[name]) for i, s in enumerate(snapshots) if name in s.datasets]
        if sources:
            con.execute(f'CREATE VIEW "{name}" AS {_union(con, name, sources, with_rev)}')
    for setting in _LOCKDOWN:
        con.execute(setting)
    return con


def _union(
    con: duckdb.DuckDBPyConnection, name: str, sources: list[tuple[int, str | None, Any]], with_rev: bool
) -> str:
    """SELECT over the revisions' sources of ``name`` (registered here), united by column name."""
    parts = []
    for i, rev, source in sources:
        con.register(f"_{name}_{i}", source)
        relabel = name in DATASETS and "model" in source.schema.names
        columns = f"* REPLACE ({table_id_sql('model')} AS model)" if relabel else "*"
        label = f"{_sql_string(rev or '')} AS rev, " if with_rev else ""
        parts.append(f"SELECT {label}{columns} FROM _{name}_{i}")
    union = " UNION ALL BY NAME ".join(parts)
    names = set().union(*(source.schema.names for _, _, source in sources))
    parts_of_model = [f"{sql} AS {column}" for column, sql in MODEL_PARTS.items() if column not in names]
    if "model" not in names or not parts_of_model:
        return union
    return f"SELECT *, {', '.join(parts_of_model)} FROM ({union})"


def _sql_string(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


# ----------------------------------------------------------------------------------------- output
def format_result(table: pa.Table, fmt: Format) -> str:
    if fmt == "json":
        rows = [{k: _json_value(v) for k, v in row.items()} for row in table.to_pylist()]
        return json.dumps(rows, indent=1, default=str)
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(table.column_names)
        writer.writerows([["" if v is None else v for v in row.values()] for row in table.to_pylist()])
        return out.getvalue().rstrip("\n")
    if fmt == "table":
        return _text_table(table)
    raise QueryError(f"unknown format {fmt!r}: use table, csv or json")


def _json_value(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _cell(v: Any) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def _text_table(table: pa.Table) -> str:
    header = table.column_names
    body = [[_cell(v) for v in row.values()] for row in table.to_pylist()]
    widths = [max([len(h)] + [len(r[i]) for r in body]) for i, h in enumerate(header)]
    line = "  ".join("-" * w for w in widths)
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)), line]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in body]
    lines.append(f"({len(body)} row{'s' if len(body) != 1 else ''})")
    return "\n".join(lines)
