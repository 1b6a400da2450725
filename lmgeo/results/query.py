"""Read-only SQL over the result tables and per-token datasets, at the working tree or any revision (SPEC §6).

Views, named as the files or datasets they come from (``sources`` says where each lives in the workspace):
- one per result table ``<tables>/<name>.parquet`` (``runs``, ``curves``, ``recipes``, ``geometry``, ...);
- ``steps``, ``fits``, ``perturb`` and ``activations`` (scalar columns only; vectors are not exposed) over
  the hive-partitioned datasets, with ``model`` as in the tables (``<run>@final``, hub ids with ``/``), and
  ``activation_vectors`` and ``fit_vectors`` with the stored vectors too, decoded to ``FLOAT[]``
  (``lmgeo.core.contracts.vectors_as_lists``; a dataset in an older vector format is named, with the command
  that rewrites it, when the SQL names its view).
  Only files that shard manifests list are read, each checked against its size and sha256, and a dataset
  that mixes the shards of two runs of its stage is refused (``lmgeo.core.store.verified_files``).

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
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import duckdb
import pyarrow as pa
import pyarrow.dataset as ds

from lmgeo.core.committed import committed
from lmgeo.core.contracts import (
    ACTIVATIONS,
    CHECKPOINTS,
    FITS,
    PERTURB,
    RESULT_TABLES,
    RUN_ID_PATTERN,
    STEPS,
    VECTOR_DTYPES,
    Dataset,
    read_result_tables,
    scan,
    stored_vector_dtype,
    table_id_sql,
    vectors_as_lists,
)
from lmgeo.core.errors import InputError, escape
from lmgeo.core.store import Committed, CorruptShardError, StaleShardError, check_one_run, files_so_far, read_record

Format = Literal["table", "csv", "json"]
MAX_REV_CHARS = 255
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
MODEL_PARTS = {
    "arch": f"NULLIF(regexp_extract(model, '{_MODEL_ID}', 1), '')",
    "seed": f"TRY_CAST(regexp_extract(model, '{_MODEL_ID}', 3) AS INTEGER)",
    "checkpoint": f"NULLIF(regexp_extract(model, '{_MODEL_ID}', {_CHECKPOINT_GROUP}), '')",
}
_VECTOR_DECODER = "lmgeo_vector_"  # + the element type: the SQL function that decodes a stored vector
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_EXPLAIN_PREFIX = re.compile(r"^\s*explain\s+(analy[sz]e\s+)?(\([^)]*\)\s*)?", re.IGNORECASE)
# Table functions that read a table by its name, or run SQL, given as an argument.
_BY_NAME = {"query_table", "query"}
_READ_ONLY_PRAGMA = re.compile(r"^\s*pragma\s+(table_info|show_tables|show_tables_expanded|show)\b", re.IGNORECASE)
_LOCKDOWN = (
    "SET autoinstall_known_extensions = false",
    "SET autoload_known_extensions = false",
    "SET python_enable_replacements = false",  # no scanning of the caller's Python variables by name
    "SET enable_external_access = false",  # no file, URL, ATTACH, INSTALL or LOAD from here on
    "SET lock_configuration = true",  # and the statements above cannot be undone
)


# Notes on what a query read (a dataset whose stage stopped half-way, a table left out): `lmgeo query` prints
# them on stderr as `lmgeo: warning:` lines.
log = logging.getLogger(__name__)


class QueryError(InputError):
    """A query that cannot run: not read-only, bad SQL, an unknown revision or unreadable data."""


@dataclass(frozen=True)
class Limits:
    """What one query may take: DuckDB's memory and temp-disk limits (DuckDB size strings, e.g. `4GB`; None:
    `default_limits`'s) and a wall-clock time-out in seconds (None: none)."""

    memory: str | None = None
    temp_disk: str | None = None
    timeout_s: float | None = None


def run_query(
    sql: str,
    revs: Sequence[str] | None,
    workspace: Path,
    sources: dict[str, str],
    fmt: Format = "table",
    limits: Limits = Limits(),
) -> str:
    """Run one read-only statement and render the result as ``fmt`` (table | csv | json)."""
    return format_result(query_table(sql, revs, workspace, sources, limits), fmt)


def query_table(
    sql: str, revs: Sequence[str] | None, workspace: Path, sources: dict[str, str], limits: Limits = Limits()
) -> pa.Table:
    """Run one read-only statement over the working tree (no ``revs``) or over the given revisions.
    ``sources`` maps ``tables``, ``params``, ``tokenizer`` and each dataset name to its workspace-relative
    path; the revision ``workspace`` is the working tree. A statement still running after
    ``limits.timeout_s`` is interrupted."""
    statement = check_read_only(sql)
    for rev in revs or ():
        check_revision(rev)
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
            snapshots = [_snapshot(workspace, None, sources, sql, anchored=True)]
        ctrl_c.check()
        con = _locked_connection(
            snapshots, with_rev=revs is not None and len(revs) > 1, temp=Path(tmp) / "duckdb", limits=limits
        )
        ctrl_c.check()
        try:
            no_results = not any(s.has_results for s in snapshots)
            result = _run_interruptibly(con, statement, limits, ctrl_c, no_results)
        finally:
            # After an interrupt DuckDB can still count the stopped call as running and refuse to close;
            # the in-memory database goes with the process either way.
            with contextlib.suppress(duckdb.Error):
                con.close()
    if revs and len(revs) > 1 and "rev" not in result.column_names:
        # Rows of several revisions side by side are only readable when each says which one it comes from.
        raise QueryError(
            f"{len(revs)} revisions: select the `rev` column so that every row names its revision "
            "(e.g. SELECT rev, ... ; GROUP BY rev for aggregates)"
        )
    return result


def default_limits(temp: Path) -> tuple[str, str]:
    """DuckDB's memory and temp-disk limits when none is given: a quarter of this machine's memory and of
    the free space where the query's temp folder is, so that one mistyped join fails with an error naming
    the limit instead of taking the machine's memory and then its disk."""
    import psutil

    memory = psutil.virtual_memory().total // 4
    disk = shutil.disk_usage(temp if temp.exists() else temp.parent).free // 4
    return f"{max(memory // 2**20, 64)}MiB", f"{max(disk // 2**20, 64)}MiB"


def check_revision(rev: str) -> None:
    """A `--rev` that can name a revision: at most 255 characters, no leading `-` (never an option), no
    whitespace or control character (git's own rule for ref names)."""
    if not rev or len(rev) > MAX_REV_CHARS:
        raise QueryError(
            f"--rev {rev[:40]!r}{'…' if len(rev) > 40 else ''}: a revision is 1 to {MAX_REV_CHARS} "
            "characters (a commit, branch, tag, DVC experiment, or `workspace`)"
        )
    if rev.startswith("-") or any(c.isspace() or not c.isprintable() for c in rev):
        raise QueryError(
            f"--rev {rev!r}: not a revision name (no leading '-', whitespace or control "
            "characters); give a commit, branch, tag, DVC experiment, or `workspace`"
        )


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
    con: duckdb.DuckDBPyConnection, statement: str, limits: Limits, ctrl_c: _CtrlC, no_results: bool
) -> pa.Table:
    """Run the statement in a thread, so the main thread can stop it (DuckDB does not see Python's signals
    while it computes in another thread) by `con.interrupt()`: at the deadline, or on Ctrl-C."""
    outcome: dict[str, Any] = {}

    def execute() -> None:
        try:
            result = con.sql(statement)
            outcome["table"] = _exact(result).to_arrow_table() if result is not None else pa.table({})
        except (duckdb.Error, pa.ArrowException) as err:
            outcome["error"] = err
        finally:
            outcome["done"] = True

    def stop() -> None:
        # Repeated: an interrupt that lands before DuckDB starts executing is reset by the query's start.
        while "done" not in outcome:
            con.interrupt()
            time.sleep(0.05)

    timeout_s = limits.timeout_s
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    threading.Thread(target=execute, daemon=True).start()
    while "done" not in outcome:
        time.sleep(0.05)
        if ctrl_c.pressed:
            stop()
            raise KeyboardInterrupt
        if deadline is not None and time.monotonic() > deadline and "done" not in outcome:
            stop()
            raise QueryError(
                f"the query ran longer than --timeout {timeout_s:g} s and was stopped (raise --timeout to let it run)"
            )
    if "error" in outcome:
        raise _failure(outcome["error"], no_results)
    return outcome["table"]


# DuckDB types whose values reach Arrow and Python exactly; any other column (a 128-bit integer, a BIT string,
# an interval, a time or date Python cannot hold, ...) is rendered by DuckDB itself as text.
_EXACT_TYPES = {
    "boolean",
    "tinyint",
    "smallint",
    "integer",
    "bigint",
    "utinyint",
    "usmallint",
    "uinteger",
    "ubigint",
    "float",
    "double",
    "decimal",
    "varchar",
    "blob",
    "uuid",
}


def _exact(result: duckdb.DuckDBPyRelation) -> duckdb.DuckDBPyRelation:
    """The result with every column whose type Arrow or Python would render wrongly cast to DuckDB's text."""
    if all(map(_is_exact, result.types)):
        return result
    columns = [f"#{i}" if _is_exact(kind) else f"CAST(#{i} AS VARCHAR)" for i, kind in enumerate(result.types, start=1)]
    return result.project(
        ", ".join(f"{column} AS {_sql_identifier(name)}" for column, name in zip(columns, result.columns, strict=True))
    )


def _is_exact(kind: Any) -> bool:
    if kind.id in ("list", "array", "struct", "map"):
        return all(_is_exact(child) for _, child in kind.children if not isinstance(child, int))
    return kind.id in _EXACT_TYPES


def _sql_identifier(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _failure(err: Exception, no_results: bool) -> QueryError:
    """A table the SQL names is missing because nothing has run yet (a fresh clone): say how to make the
    results, rather than DuckDB's "did you mean duckdb_constraints?"."""
    if no_results and "does not exist" in str(err):
        return QueryError("no results yet: run `dvc repro`")
    # DuckDB's advice for memory (`SET memory_limit`) does not apply: the configuration is locked
    text = _first_line(err) if isinstance(err, duckdb.OutOfMemoryException) else str(err)
    return QueryError(f"query failed: {escape(text)}{_hint(err)}")


def _hint(err: Exception) -> str:
    """A per-token dataset is a view only when the SQL names it literally (it is verified, or at a revision
    fetched, then); say so when the missing table is one of them. A query past its memory or temp-disk
    limit: say which option raises it."""
    missing = [name for name in DATASETS if f"Table with name {name} does not exist" in str(err)]
    if missing:
        return f" (name {missing[0]!r} literally in the SQL so that it is read)"
    if isinstance(err, duckdb.OutOfMemoryException):
        which = "--temp-limit" if "temp" in str(err).lower() else "--memory-limit"
        return f" (the query's limits stopped it: narrow the query, or raise {which})"
    return ""


# --------------------------------------------------------------------------------- read-only check
def check_read_only(sql: str) -> str:
    """The single statement of ``sql`` when it can only read; ``QueryError`` otherwise."""
    try:
        sql.encode()
    except UnicodeEncodeError as err:  # argv bytes the locale could not decode reach Python as surrogates
        undecoded = err.object[err.start : err.end].encode(errors="surrogateescape")
        raise QueryError(f"the SQL is not UTF-8 text ({undecoded!r} at character {err.start})") from None
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as err:
        raise QueryError(f"SQL does not parse: {escape(str(err))}") from None
    if len(statements) != 1:
        raise QueryError(f"expected exactly one SQL statement, got {len(statements)}")
    statement = statements[0]
    if not _reads_only(statement):
        raise QueryError(
            f"{statement.type.name} statements are refused: lmgeo query is read-only "
            "(SELECT, WITH, DESCRIBE, SHOW, SUMMARIZE, EXPLAIN, PRAGMA table_info/show_tables)"
        )
    _check_names_literal(statement.query)
    return statement.query


def _check_names_literal(sql: str) -> None:
    """A table function that reads tables by a name or SQL it is given (`query_table`, `query`) must be given
    string literals: the views a query reads, and the runs their data must share, are found in its text, so a
    computed name (`query_table('geo' || 'metry')`) would read a table that check never saw."""
    tree = _parse_tree(_EXPLAIN_PREFIX.sub("", sql, count=1))
    pending: list[Any] = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            function = node.get("function") if node.get("type") == "TABLE_FUNCTION" else None
            if isinstance(function, dict) and function.get("function_name", "").lower() in _BY_NAME:
                if not all(_literal(a.get("expression")) for a in function.get("arguments", [])):
                    raise QueryError(
                        f"{function['function_name']}(...): give the table name (or SQL) as a string literal, "
                        "e.g. query_table('geometry'), or name the table directly (FROM geometry); a computed "
                        "one is refused, since the data a query reads is checked from its text"
                    )
            pending.extend(node.values())
        elif isinstance(node, list):
            pending.extend(node)


def _literal(expression: Any) -> bool:
    """A string constant, or a list of them (`query_table(['a', 'b'])`)."""
    if not isinstance(expression, dict):
        return False
    if expression.get("class") == "CONSTANT":
        return expression.get("literal", {}).get("kind") == "STRING"
    return expression.get("function_name") == "list_value" and all(
        _literal(a.get("expression")) for a in expression.get("arguments", [])
    )


def _reads_only(statement: duckdb.Statement) -> bool:
    kind = statement.type
    if kind == duckdb.StatementType.SELECT:
        return True
    if kind == duckdb.StatementType.PRAGMA:
        return bool(_READ_ONLY_PRAGMA.match(statement.query))
    if kind == duckdb.StatementType.EXPLAIN:
        # EXPLAIN ANALYZE executes its statement, so what is explained must itself be read-only.
        try:
            inner = duckdb.extract_statements(_EXPLAIN_PREFIX.sub("", statement.query, count=1))
        except duckdb.Error:
            return False
        return len(inner) == 1 and _reads_only(inner[0])
    return False


# ------------------------------------------------------------------------------------------- data
@dataclass
class _Snapshot:
    rev: str | None
    tables: dict[str, pa.Table]
    datasets: dict[str, ds.Dataset]
    has_results: bool  # result tables or a dataset folder: something a stage wrote
    decoded: dict[str, list[str]]  # vector view -> its columns' decoding (`column` → FLOAT[]), as SQL


def _revision(sql: str, workspace: Path, rev: str, dest: Path, sources: dict[str, str]) -> _Snapshot:
    """The data of ``rev``: the working tree itself for ``workspace``; else, under ``dest``, the tables and the
    params as git has them at ``rev``, and what the SQL names of the datasets and the tokenizer (``tokens``)
    copied by DVC (with the tables, at a revision that tracked them with DVC)."""
    if rev == WORKSPACE:
        _check_checked_out(sql, workspace, sources)
        return _snapshot(workspace, rev, sources, sql, anchored=True)
    outputs = _named_outputs(sql)
    recorded = [sources[w] for w in ("tables", "params", "provenance") if w in sources]
    in_git = _git_copy(workspace, rev, dest, recorded)
    from_dvc = [sources[w] for w in outputs] + ([] if sources["tables"] in in_git else [sources["tables"]])
    if from_dvc:
        _checkout(workspace, rev, dest, from_dvc)
    kept = ("tables", "params", "provenance", *outputs)
    return _snapshot(dest, rev, {w: sources[w] for w in kept if w in sources}, sql, anchored=False)


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
    tree = _parse_tree(sql)
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


def _parse_tree(sql: str) -> dict[str, Any]:
    """DuckDB's parse tree of ``sql`` as JSON (with ``error`` set where DuckDB cannot serialise it)."""
    with duckdb.connect(":memory:") as con:
        row = con.execute("SELECT json_serialize_sql(?)", [sql]).fetchone()
        assert row is not None  # a SELECT of one value: one row
        tree: dict[str, Any] = json.loads(row[0])
    return tree


def _git_copy(workspace: Path, rev: str, dest: Path, paths: Sequence[str]) -> set[str]:
    """Copy the ``paths`` (workspace-relative) that git holds at ``rev`` under ``dest``, from git's objects (no
    checkout, no DVC); returns those it held."""
    from dvc.scm import SCM, SCMError, resolve_rev  # DVC's git, which resolves experiment names too

    try:
        scm = SCM(str(workspace))
    except SCMError as err:
        raise QueryError(f"revision {rev!r}: {workspace} is not in a git repository ({err})") from None
    try:
        try:
            fs = scm.get_fs(resolve_rev(scm, rev))
        except SCMError:
            raise
        except Exception as err:  # noqa: BLE001 - scmrepo's backends fail on a non-commit with their own types
            raise _not_a_commit(rev, err) from None
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
        raise QueryError(f"revision {rev!r}: {escape(str(err))}") from None
    finally:
        scm.close()


def _not_a_commit(rev: str, err: Exception) -> QueryError:
    return QueryError(
        f"revision {rev!r} does not name a commit ({type(err).__name__}: {escape(_first_line(err))}); give a "
        "commit, branch, tag, DVC experiment, or `workspace`"
    )


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
        fs.isdir(".")  # resolves the revision: a tree or a blob is no commit
    except DvcException as err:
        raise QueryError(f"revision {rev!r}: {escape(_first_line(err))}") from None
    except Exception as err:  # noqa: BLE001 - scmrepo's backends fail on a non-commit with their own types
        raise _not_a_commit(rev, err) from None
    try:
        for path in outputs:
            if fs.isdir(path):
                fs.get(path, str(dest / path), recursive=True)
            elif fs.isfile(path):
                (dest / path).parent.mkdir(parents=True, exist_ok=True)
                fs.get(path, str(dest / path))
    except DvcException as err:
        if "unknown Git revision" in str(err) or "revision" in type(err).__name__.lower():
            raise QueryError(f"revision {rev!r}: {escape(str(err))}") from None
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
    first_line = escape(_first_line(err))
    return _NotCached(
        f"revision {rev!r}: {', '.join(outputs)} (DVC outputs) are in neither the local DVC cache nor the default "
        f"remote ({type(err).__name__}: {first_line}); push them from where they were computed (`dvc push`) to a "
        f'remote this clone uses (README: "Sharing results"), or rebuild them with `git checkout {rev} && dvc '
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
            f'`dvc pull {paths}` fetches them from a DVC remote (README: "Sharing results"), `dvc repro` '
            "recomputes them"
        )


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _mentions(sql: str, name: str) -> bool:
    return re.search(rf"\b{re.escape(name)}\b", sql, re.IGNORECASE) is not None


def _snapshot(root: Path, rev: str | None, sources: dict[str, str], sql: str, anchored: bool) -> _Snapshot:
    """The tables (read into memory; they are small) and lazy, verified datasets found under ``root``: every
    result table, and the datasets the SQL names (a dataset is verified, every file hashed, only for a query
    that reads it). A table or dataset that cannot be read fails the query that names it and is left out,
    with a warning, of any other. The datasets and tables the SQL names must come from one run of the
    pipeline (``lmgeo.core.store.check_one_run``). ``anchored``: ``root`` is a workspace whose shards are
    also checked against what its dvc.lock records (``lmgeo.core.committed``)."""
    where = f"revision {rev!r}" if rev else str(root)

    def cause(err: BaseException) -> str:
        # At a revision `root` is a temporary copy, gone once the query ends: the paths the cause names
        # (the file refused, its manifest) are shown relative to it, as they are in the workspace at `rev`.
        return escape(str(err).replace(f"{root}{os.sep}", "") if rev else str(err))

    def unusable(names: Sequence[str], what: str, err: BaseException) -> None:
        if any(_mentions(sql, name) for name in names):
            raise QueryError(f"{where}: cannot read {what}: {cause(err)}") from None
        log.warning("%s: %s left out of this query, which does not name it: %s", where, what, cause(err))

    def anchor(folder: Path) -> Committed | None:
        return committed(root, folder) if anchored else None

    tables, used = {}, []
    folder = root / sources["tables"]
    bad: dict[Path, Exception] = {}
    try:
        found = read_result_tables(folder, anchor(folder), bad) if folder.is_dir() else {}
    except (CorruptShardError, StaleShardError, OSError) as err:
        unusable(RESULT_TABLES, sources["tables"], err)
        found = {}
    for path, problem in bad.items():
        unusable([path.stem], path.relative_to(root).as_posix(), problem)
    tables = {name: table for name, table in found.items() if _IDENTIFIER.match(name) and name not in DATASETS}
    if any(_mentions(sql, name) for name in tables):
        used.append(folder)
    vocabulary = root / sources.get("tokenizer", "") / "tokenizer.json"
    if "tokenizer" in sources and vocabulary.is_file():
        try:
            tables["tokens"] = _tokens_table(vocabulary)
        except Exception as err:  # noqa: BLE001 - tokenizers raises its own exception types for a bad file
            unusable(["tokens"], vocabulary.relative_to(root).as_posix(), err)
    if (root / sources["params"]).is_file():
        try:
            provenance = root / sources["provenance"] if "provenance" in sources else None
            tables["params"] = _params_table(root / sources["params"], provenance)
            if _mentions(sql, "params"):
                _note_other_params(where, tables["params"], sources["params"])
        except InputError as err:
            unusable(["params"], sources["params"], err)
    datasets, decoded, partial = {}, {}, []
    for name, (dataset, vectors) in DATASETS.items():
        if dataset.name not in sources or not _mentions(sql, name):
            continue
        folder = root / sources[dataset.name]
        rebuild = f"`lmgeo {dataset.written_by}`"
        try:
            files, missing = (
                files_so_far(folder, rebuild=rebuild, committed=anchor(folder)) if folder.is_dir() else ([], [])
            )
            datasets[name] = scan(folder, dataset, files, vectors=vectors)
        except (CorruptShardError, StaleShardError, OSError, pa.ArrowException) as err:
            raise QueryError(f"{where}: cannot read {sources[dataset.name]}: {cause(err)}") from None
        if vectors:
            try:
                decoded[name] = [
                    f"{_VECTOR_DECODER}{stored_vector_dtype(files, dataset, c) or 'float32'}({c}) AS {c}"
                    for c in dataset.vectors
                ]
            except InputError as err:
                raise QueryError(f"{where}: cannot read the vectors of {sources[dataset.name]}: {cause(err)}") from None
        if missing and not vectors:  # once per dataset, not again for its vectors' view
            log.warning(_partial_note(where, sources[dataset.name], missing, rebuild))
        if missing:
            partial.append(sources[dataset.name])
        used.append(folder)
    joined = [folder for folder in dict.fromkeys(used) if folder.is_dir()]
    if partial and len(joined) > 1:  # a stage stopped half-way: its shards and the others' come from two runs
        raise QueryError(
            f"{where}: {partial[0]} is partial (its stage stopped or is running), so it is joined with "
            "no other dataset or table; run `dvc repro` to finish it, or query it alone"
        )
    try:
        check_one_run(joined)
    except StaleShardError as err:
        raise QueryError(f"{where}: {cause(err)}") from None
    written = bool(found) or any((root / sources[d.name]).is_dir() for d, _ in DATASETS.values() if d.name in sources)
    return _Snapshot(rev, tables, datasets, written, decoded)


def _partial_note(where: str, folder: str, missing: list[str], rebuild: str) -> str:
    shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
    return (
        f"{where}: {folder} is partial: its stage stopped (or is running) with {len(missing)} planned shard"
        f"{'s' if len(missing) != 1 else ''} still to write ({shown}); read what is complete, `dvc repro` (or "
        f"{rebuild}) finishes it"
    )


def _params_table(path: Path, provenance: Path | None) -> pa.Table:
    """`params.yaml` as rows (key, value): dotted keys, values as JSON text (`json_extract` reads them). Every row
    also has `params_hash`, the hash of these params' result sections (NULL where this code cannot load them),
    and `computed_with`, the one the report's provenance records (NULL without it): where the two differ, the
    result tables beside these params were computed with others."""
    from lmgeo.core.config import ParamsError, flatten_overrides, load_yaml

    raw = load_yaml(path) or {}
    if not isinstance(raw, dict):  # flatten_overrides would call it "a preset"
        raise ParamsError(f"{path}: expected a mapping of sections at the top level")
    flat = flatten_overrides(raw)
    rows = len(flat)
    return pa.table(
        {
            "key": list(flat),
            "value": list(flat.values()),
            "params_hash": pa.array([_params_hash(path)] * rows, pa.string()),
            "computed_with": pa.array([_recorded_params_hash(provenance)] * rows, pa.string()),
        }
    )


def _params_hash(path: Path) -> str | None:
    """The hash of the result sections of the params at `path`, as the report records it; None for params this
    code cannot load (those of an old revision)."""
    from lmgeo.params import RESULT_SECTIONS, load_params

    try:
        return load_params(path).section_hash(*RESULT_SECTIONS)
    except InputError:
        return None


def _recorded_params_hash(provenance: Path | None) -> str | None:
    """The params hash the report's provenance records; None without a readable one."""
    try:
        recorded = json.loads(read_record(provenance)) if provenance is not None and provenance.is_file() else {}
    except (OSError, ValueError):
        return None
    found = recorded.get("params_hash") if isinstance(recorded, dict) else None
    return found if isinstance(found, str) else None


def _note_other_params(where: str, params: pa.Table, path: str) -> None:
    """Warn where the params view joins params with tables computed with other params."""
    current, recorded = (params[c][0].as_py() if params.num_rows else None for c in ("params_hash", "computed_with"))
    if current is not None and recorded is not None and current != recorded:
        log.warning(
            "%s: %s has params hash %s, but the result tables were computed with %s (its `computed_with` column): "
            "`dvc repro` recomputes them with these params",
            where,
            path,
            current,
            recorded,
        )


def _tokens_table(path: Path) -> pa.Table:
    """The prepared tokenizer's vocabulary: `token_id`, `token` (the text it decodes to) and `piece` (its entry
    in the vocabulary, e.g. `Ġthe` for a byte-level BPE's " the")."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    ids = range(tokenizer.get_vocab_size(with_added_tokens=True))
    return pa.table(
        {
            "token_id": pa.array(ids, pa.int32()),
            "token": [tokenizer.decode([i], skip_special_tokens=False) for i in ids],
            "piece": [tokenizer.id_to_token(i) for i in ids],
        }
    )


def _locked_connection(
    snapshots: list[_Snapshot], with_rev: bool, temp: Path, limits: Limits
) -> duckdb.DuckDBPyConnection:
    """Result tables are copied into DuckDB's memory; per-token datasets stay lazy Arrow scans behind views
    (their registered sources `_<name>_<i>` remain visible to SHOW TABLES). The memory and temp-disk limits
    are set before the configuration is locked."""
    memory, disk = default_limits(temp)
    config: dict[str, str | bool | int | float | list[str]] = {
        "temp_directory": str(temp),
        "memory_limit": limits.memory or memory,
        "max_temp_directory_size": limits.temp_disk or disk,
    }
    try:
        con = duckdb.connect(":memory:", config=config)
    except duckdb.Error as err:
        raise QueryError(f"--memory-limit / --temp-limit: {err}") from None
    for dtype in VECTOR_DTYPES:  # the decoders of the vector views: pure functions of the bytes they are given
        con.create_function(  # type: ignore[call-overload]  # duckdb's overloads miss type="arrow" with a list
            f"{_VECTOR_DECODER}{dtype}",
            _decoder(dtype),
            [duckdb.sqltypes.BLOB],
            duckdb.list_type(duckdb.sqltypes.FLOAT),
            type="arrow",
        )
    for name in sorted({n for s in snapshots for n in s.tables}):
        sources: list[tuple[int, str | None, Any, list[str]]] = [
            (i, s.rev, s.tables[name], []) for i, s in enumerate(snapshots) if name in s.tables
        ]
        con.execute(f'CREATE TABLE "{name}" AS {_union(con, name, sources, with_rev)}')
        for i, *_ in sources:
            con.unregister(f"_{name}_{i}")
    for name in DATASETS:
        sources = [
            (i, s.rev, s.datasets[name], s.decoded.get(name, [])) for i, s in enumerate(snapshots) if name in s.datasets
        ]
        if sources:
            con.execute(f'CREATE VIEW "{name}" AS {_union(con, name, sources, with_rev)}')
    for setting in _LOCKDOWN:
        con.execute(setting)
    return con


def _decoder(dtype: str) -> Callable[[pa.Array], pa.ListArray]:
    """`vectors_as_lists` for one element type, as a function of one argument (DuckDB counts them)."""
    return lambda blobs: vectors_as_lists(blobs, dtype)


def _union(
    con: duckdb.DuckDBPyConnection, name: str, sources: list[tuple[int, str | None, Any, list[str]]], with_rev: bool
) -> str:
    """SELECT over the revisions' sources of ``name`` (registered here), united by column name, each with its
    columns replaced as given (the vectors decoded) and ``model`` relabelled as in the tables."""
    parts = []
    for i, rev, source, replaced in sources:
        con.register(f"_{name}_{i}", source)
        relabel = name in DATASETS and "model" in source.schema.names
        replaced = [*replaced, f"{table_id_sql('model')} AS model"] if relabel else replaced
        columns = f"* REPLACE ({', '.join(replaced)})" if replaced else "*"
        label = f"{_sql_string(rev or '')} AS rev, " if with_rev else ""
        parts.append(f"SELECT {label}{columns} FROM _{name}_{i}")
    union = " UNION ALL BY NAME ".join(parts)
    names = set().union(*(source.schema.names for _, _, source, _ in sources))
    parts_of_model = [f"{sql} AS {column}" for column, sql in MODEL_PARTS.items() if column not in names]
    if "model" not in names or not parts_of_model:
        return union
    return f"SELECT *, {', '.join(parts_of_model)} FROM ({union})"


def _sql_string(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


# ----------------------------------------------------------------------------------------- output
def format_result(table: pa.Table, fmt: Format) -> str:
    """The result as text. Columns are read one by one (a result may repeat a column name), and every
    control character of a name or a value is written as an escape (JSON escapes them itself), so that no
    value of a table can act on the terminal that shows it."""
    header = [escape(name, lines=fmt == "csv") for name in table.column_names]
    columns = [column.to_pylist() for column in table.columns]
    rows = [list(row) for row in zip(*columns, strict=True)] if columns else []
    if fmt == "json":
        records = [{name: _json_value(v) for name, v in zip(table.column_names, row, strict=True)} for row in rows]
        return json.dumps(records, indent=1, default=str)
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(header)
        writer.writerows([["" if v is None else _text(v, lines=True) for v in row] for row in rows])
        return out.getvalue().rstrip("\n")
    if fmt == "table":
        return _text_table(header, [[_cell(v) for v in row] for row in rows])
    raise QueryError(f"unknown format {fmt!r}: use table, csv or json")


def _json_value(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _text(v: Any, lines: bool) -> str:
    return escape(v if isinstance(v, str) else str(v), lines=lines)


def _cell(v: Any) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, float):
        return f"{v:.6g}"
    return _text(v, lines=False)


def _text_table(header: list[str], body: list[list[str]]) -> str:
    widths = [max([len(h)] + [len(r[i]) for r in body]) for i, h in enumerate(header)]
    line = "  ".join("-" * w for w in widths)
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)), line]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in body]
    lines.append(f"({len(body)} row{'s' if len(body) != 1 else ''})")
    return "\n".join(lines)
