"""Read-only, versioned SQL over the result tables and per-token datasets (lmgeo/query.py)."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import yaml
from test_aggregate import CFG, KEY, sources, write_tiny_study

from lmgeo.core.contracts import vectors_to_arrow
from lmgeo.core.store import ManifestKey, ShardWriter
from lmgeo.driver.layout import Layout
from lmgeo.results.aggregate import aggregate
from lmgeo.results.config import ReportConfig
from lmgeo.results.query import QueryError, check_read_only
from lmgeo.results.query import query_table as query_in
from lmgeo.results.query import run_query as run_in

SOURCES = Layout(Path.cwd()).query_sources()


def query_table(sql, revs, workspace):  # noqa: ANN001, ANN201
    return query_in(sql, revs, workspace, SOURCES)


def run_query(sql, revs, workspace, fmt="table"):  # noqa: ANN001, ANN201
    return run_in(sql, revs, workspace, SOURCES, fmt)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ws = tmp_path_factory.mktemp("ws")
    write_tiny_study(ws / "data")
    aggregate(sources(ws / "data"), ws / "reports", CFG, KEY)
    return ws


def files_under(*roots: Path) -> set[Path]:
    return {p for root in roots for p in root.rglob("*")}


@pytest.mark.slow
def test_result_tables_and_datasets_are_views(workspace: Path) -> None:
    runs = query_table("SELECT run, final_val_loss FROM runs WHERE recipe = 'hilbert' ORDER BY run", None, workspace)
    assert runs.to_pylist()[0] == {"run": "gpt2-hilbert-s0", "final_val_loss": 2.5}
    fits = query_table(
        "SELECT model, count(*) AS n FROM fits WHERE fn = 'lowrank' GROUP BY model ORDER BY model", [], workspace
    )
    assert fits.to_pylist() == [
        {"model": "gpt2-muon-s0@final", "n": 11},
        {"model": "gpt2-muon-s0@init", "n": 11},
        {"model": "org/tiny-mamba", "n": 11},
    ]  # labels as in the tables; the file no manifest lists is not read
    joined = query_table(
        "SELECT count(*) AS n FROM fits JOIN perturb USING (model, layer, fn, seq_id, pos)", None, workspace
    )
    assert joined["n"].to_pylist() == [66]
    columns = query_table("DESCRIBE fits", None, workspace)["column_name"].to_pylist()
    assert "patched" not in columns and {"model", "layer", "fn", "rel_err"} <= set(columns)
    activations = query_table("SELECT count(*) AS n FROM activations", None, workspace)
    assert activations["n"].to_pylist() == [0]  # absent: empty


def test_output_formats(workspace: Path) -> None:
    sql = "SELECT recipe, n_seeds, test_loss_sd FROM recipes WHERE recipe IN ('hilbert', 'adamw') ORDER BY recipe"
    rows = list(csv.DictReader(io.StringIO(run_query(sql, None, workspace, "csv"))))
    assert [r["recipe"] for r in rows] == ["adamw", "hilbert"] and rows[0]["test_loss_sd"] == ""
    records = json.loads(run_query(sql, None, workspace, "json"))
    assert records[0] == {"recipe": "adamw", "n_seeds": 1, "test_loss_sd": None}
    text = run_query(sql, None, workspace, "table").splitlines()
    assert text[0].split() == ["recipe", "n_seeds", "test_loss_sd"]
    assert "NULL" in text[2] and text[-1] == "(2 rows)"


@pytest.mark.parametrize(
    "sql",
    [
        "COPY runs TO '{out}/copy.csv'",
        "COPY (SELECT 1) TO '{out}/copy.parquet' (FORMAT parquet)",
        "ATTACH '{out}/attached.duckdb' AS other",
        "CREATE TABLE t AS SELECT 1",
        "INSERT INTO runs (run) VALUES ('x')",
        "INSTALL httpfs",
        "LOAD httpfs",
        "SET enable_external_access = true",
        "EXPLAIN ANALYZE CREATE TABLE t AS SELECT 1",
        "PRAGMA enable_profiling",
        "SELECT 1; COPY runs TO '{out}/second.csv'",
    ],
)
def test_writes_are_refused_by_the_statement_check(sql: str, workspace: Path, tmp_path: Path) -> None:
    before = files_under(workspace, tmp_path)
    with pytest.raises(QueryError, match="refused|exactly one"):
        run_query(sql.format(out=tmp_path), None, workspace)
    assert files_under(workspace, tmp_path) == before


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT * FROM read_csv('/etc/passwd')",
        "SELECT * FROM read_text('/etc/passwd')",
        "SELECT * FROM read_parquet('{ws}/reports/tables/runs.parquet')",  # even the workspace's own files
        "SELECT * FROM glob('/etc/*')",
    ],
)
def test_file_access_is_disabled_inside_duckdb(sql: str, workspace: Path) -> None:
    with pytest.raises(QueryError, match="[Pp]ermission|disabled"):
        run_query(sql.format(ws=workspace), None, workspace)


def test_read_only_statements_pass_the_check() -> None:
    for sql in (
        "SELECT 1",
        "WITH a AS (SELECT 1) SELECT * FROM a",
        "FROM runs",
        "DESCRIBE runs",
        "SHOW TABLES",
        "SUMMARIZE runs",
        "EXPLAIN SELECT 1",
        "EXPLAIN ANALYZE SELECT 1",
        "PRAGMA table_info('runs')",
    ):
        assert check_read_only(sql)


def test_bad_sql_is_a_query_error(workspace: Path) -> None:
    with pytest.raises(QueryError, match="does not parse"):
        run_query("SELEC 1", None, workspace)
    with pytest.raises(QueryError, match="no_such_table"):
        run_query("SELECT * FROM no_such_table", None, workspace)
    with pytest.raises(QueryError, match="format"):
        run_query("SELECT 1", None, workspace, "xml")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------- revisions
def git(repo: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=repo, check=True, capture_output=True
    )


def write_runs(repo: Path, runs: pa.Table) -> None:
    """A `runs` result table as aggregate writes it: one verified shard of reports/tables."""
    with ShardWriter(repo / "reports" / "tables", "tables", KEY) as writer:
        writer.write({}, runs, name="runs.parquet")


def commit_version(repo: Path, version: int, tables_by_dvc: bool = False) -> None:
    """runs.parquet committed to git beside the report, as `dvc.yaml` declares the result tables (or, with
    `tables_by_dvc`, tracked by DVC, as revisions before that did); the per-token fits tracked by DVC."""
    from dvc.repo import Repo

    write_runs(repo, pa.table({"run": [f"v{version}"], "final_val_loss": [float(version)]}))
    n = version + 1
    with ShardWriter(repo / "data" / "fits", "fits", ManifestKey({}, "p", "c")) as writer:
        writer.write(
            {"model": "gpt2-muon-s0.final", "layer": 0, "fn": "lowrank"},
            pa.table({"seq_id": pa.array(range(n), pa.int32()), "rel_err": [0.5] * n}),
        )
    with Repo(str(repo)) as dvc_repo:
        dvc_repo.add([str(repo / "data" / "fits"), *([str(repo / "reports" / "tables")] if tables_by_dvc else [])])
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", f"version {version}")


def dvc_git_repo(path: Path) -> Path:
    from dvc.repo import Repo

    path.mkdir(parents=True, exist_ok=True)
    git(path, "init", "-q")
    Repo.init(str(path)).close()
    return path


@pytest.fixture(scope="module")
def versioned_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = dvc_git_repo(tmp_path_factory.mktemp("repo"))
    commit_version(repo, 1)
    commit_version(repo, 2)
    write_runs(repo, pa.table({"run": ["dirty"], "final_val_loss": [9.0]}))
    return repo


def test_several_revisions_without_the_rev_column_are_refused(versioned_repo: Path) -> None:
    """Rows of two revisions that do not say which is which cannot be read apart: refused, naming the fix."""
    with pytest.raises(QueryError, match=r"^2 revisions: select the `rev` column so that every row names"):
        query_table("SELECT run FROM runs ORDER BY run", ["HEAD~1", "HEAD"], versioned_repo)
    assert query_table("SELECT run FROM runs", ["HEAD"], versioned_repo).num_rows == 1  # one revision: no need


def test_several_revisions_are_united_with_a_rev_column(versioned_repo: Path) -> None:
    runs = query_table("SELECT rev, run FROM runs ORDER BY run", ["HEAD~1", "HEAD"], versioned_repo)
    assert runs.to_pylist() == [{"rev": "HEAD~1", "run": "v1"}, {"rev": "HEAD", "run": "v2"}]
    fits = query_table(
        "SELECT rev, model, count(*) AS n FROM fits GROUP BY ALL ORDER BY n", ["HEAD~1", "HEAD"], versioned_repo
    )
    assert fits.to_pylist() == [
        {"rev": "HEAD~1", "model": "gpt2-muon-s0@final", "n": 2},
        {"rev": "HEAD", "model": "gpt2-muon-s0@final", "n": 3},
    ]
    single = query_table("SELECT * FROM runs", ["HEAD~1"], versioned_repo)
    assert single.column_names == ["run", "final_val_loss"] and single["run"].to_pylist() == ["v1"]
    assert query_table("SELECT run FROM runs", None, versioned_repo)["run"].to_pylist() == ["dirty"]  # working tree


def test_unknown_revision_is_a_query_error(versioned_repo: Path) -> None:
    with pytest.raises(QueryError, match="no-such-rev"):
        run_query("SELECT * FROM runs", ["no-such-rev"], versioned_repo)


def test_a_dataset_reached_indirectly_at_a_revision_fails_instead_of_reading_nothing(versioned_repo: Path) -> None:
    # A computed name is refused from the SQL's text, before any revision is read.
    with pytest.raises(QueryError, match=r"query_table\(\.\.\.\): give the table name .* as a string literal"):
        query_table("SELECT count(*) FROM query_table('fi' || 'ts')", ["HEAD"], versioned_repo)


def test_a_fresh_clone_compares_two_commits_tables_from_git_without_any_dvc_cache(
    versioned_repo: Path, tmp_path: Path
) -> None:
    """The tables and params come from git's objects: a clone with no DVC cache and no remote answers over
    both commits; the per-token data, in DVC only, is an error naming the commands that bring it."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(versioned_repo), str(clone)], check=True)
    assert not (clone / ".dvc" / "cache").exists()
    runs = query_table("SELECT rev, run FROM runs ORDER BY run", ["HEAD~1", "HEAD"], clone)
    assert runs.to_pylist() == [{"rev": "HEAD~1", "run": "v1"}, {"rev": "HEAD", "run": "v2"}]
    assert query_table("SELECT run FROM runs", None, clone)["run"].to_pylist() == ["v2"]  # the checkout's own
    assert not (clone / ".dvc" / "cache").exists()  # nothing was fetched for that
    with pytest.raises(
        QueryError,
        match=r"data/fits \(DVC outputs\) are in neither the local DVC cache nor the default remote .*`dvc push`.*"
        r"`git checkout HEAD~1 && dvc repro`; the result tables and params are in git",
    ):
        query_table("SELECT * FROM fits", ["HEAD~1"], clone)


def test_a_dataset_dvc_tracks_but_the_checkout_lacks_is_an_error_not_an_empty_view(tmp_path: Path) -> None:
    """In a fresh clone `data/fits` is absent (DVC tracks it, git does not): naming it says how to get it."""
    (tmp_path / "dvc.lock").write_text(
        "schema: '2.0'\nstages:\n  fit:\n    cmd: lmgeo fit\n    outs:\n    - path: data/fits\n      md5: 0.dir\n"
    )
    write_runs(tmp_path, pa.table({"run": ["a"], "final_val_loss": [1.0], "tokens": [256], "fits": [True]}))
    with pytest.raises(QueryError, match=r"^data/fits: not in this checkout .*`dvc pull data/fits`.*`dvc repro`"):
        query_table("SELECT count(*) FROM fits", None, tmp_path)
    with pytest.raises(QueryError, match="data/fits: not in this checkout"):
        query_table("SELECT r.run FROM runs r JOIN fits f ON true", ["workspace"], tmp_path)
    # Tables only, though columns are named like views: DuckDB's parser tells a column from a table.
    rows = query_table("SELECT run, tokens, fits FROM runs", None, tmp_path).to_pylist()
    assert rows == [{"run": "a", "tokens": 256, "fits": True}]
    assert query_table("SELECT count(*) AS n FROM perturb", None, tmp_path)["n"].to_pylist() == [0]  # not tracked


def test_tables_a_revision_tracked_with_dvc_come_from_the_dvc_cache(tmp_path: Path) -> None:
    """Revisions from before the tables were committed to git hold them as a DVC output: read through DVC."""
    repo = dvc_git_repo(tmp_path / "repo")
    commit_version(repo, 1, tables_by_dvc=True)
    assert (repo / "reports" / "tables.dvc").is_file()
    assert query_table("SELECT run FROM runs", ["HEAD"], repo)["run"].to_pylist() == ["v1"]


def test_a_study_stopped_half_way_is_queried_with_its_missing_shards_named(tmp_path: Path, caplog) -> None:
    """A stage records its plan before the fan-out: the shards of a plan in progress hold different keys (each
    run's own params), and a query reads the complete ones and names the others, instead of refusing a
    dataset "written with N different params hashes"."""
    from lmgeo.core.store import write_plan

    keys = {f"gpt2-muon-s{seed}": ManifestKey({}, f"params-of-s{seed}", "c") for seed in range(4)}
    write_plan(tmp_path / "data" / "train", keys, complete=False)
    for run in ("gpt2-muon-s0", "gpt2-muon-s2"):
        with ShardWriter(tmp_path / "data" / "train", run, keys[run]) as writer:
            writer.write(
                {"run": run},
                pa.table({"step": pa.array([0, 1], pa.int64()), "train_loss": [4.0, 3.5]}),
                name="steps.parquet",
            )
    with caplog.at_level("WARNING", logger="lmgeo.results.query"):
        rows = query_table("SELECT run, count(*) AS n FROM steps GROUP BY run ORDER BY run", None, tmp_path)
    assert rows.to_pylist() == [{"run": "gpt2-muon-s0", "n": 2}, {"run": "gpt2-muon-s2", "n": 2}]
    (note,) = [r.getMessage() for r in caplog.records]
    assert "data/train is partial" in note and "2 planned shards still to write (gpt2-muon-s1, gpt2-muon-s3)" in note
    from lmgeo.core.store import manifest_path

    done = {run: keys[run] for run in ("gpt2-muon-s0", "gpt2-muon-s2")}
    write_plan(tmp_path / "data" / "train", done)  # the stage says it finished: a missing shard is an error again
    manifest_path(tmp_path / "data" / "train", "gpt2-muon-s2").unlink()
    with pytest.raises(QueryError, match=r"shard 'gpt2-muon-s2' is missing .* run `lmgeo train` first"):
        query_table("SELECT count(*) FROM steps", None, tmp_path)


def test_a_corrupt_file_at_a_revision_is_named_as_in_the_workspace_not_in_the_temporary_copy(tmp_path: Path) -> None:
    """The revision's files are read from a temporary copy that is gone when the message is read: the
    refused file and its manifest are named by their workspace paths."""
    from lmgeo.core.store import manifest_path, shard_slug

    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    with ShardWriter(repo / "data" / "fits", "fits", ManifestKey({}, "p", "c")) as writer:
        writer.write({"model": "m", "layer": 0, "fn": "lowrank"}, pa.table({"seq_id": pa.array([0], pa.int32())}))
    victim = f"data/fits/model=m/layer=0/fn=lowrank/part-{shard_slug('fits')}.parquet"
    with open(repo / victim, "r+b") as f:
        f.truncate(10)
    (repo / "params.yaml").write_text("- not a mapping\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "corrupt")
    with pytest.raises(QueryError) as err:
        query_table("SELECT count(*) FROM params", ["HEAD"], repo)
    assert str(err.value) == (
        "revision 'HEAD': cannot read params.yaml: params.yaml: expected a mapping of sections at the top level"
    )
    with pytest.raises(QueryError) as err:  # the unreadable params fail only a query that reads them
        query_table("SELECT count(*) FROM fits", ["HEAD"], repo)
    message = str(err.value)
    assert message.startswith(f"revision 'HEAD': cannot read data/fits: {victim}: corrupt shard: 10 bytes"), message
    manifest = manifest_path(Path("data/fits"), "fits").as_posix()
    assert "re-run the stage that writes data/fits" in message and f"(here {manifest})" in message
    assert "lmgeo-query-" not in message


def test_params_and_stored_vectors_are_queryable(workspace: Path) -> None:
    (workspace / "params.yaml").write_text("analysis:\n  k: 8\n  classes: [lowrank, identity]\n")
    rows = query_table("SELECT key, json_extract(value, '$') AS v FROM params ORDER BY key", None, workspace)
    assert rows.to_pylist() == [
        {"key": "analysis.classes", "v": '["lowrank","identity"]'},
        {"key": "analysis.k", "v": "8"},
    ]
    vectors = query_table(
        "SELECT model, len(patched) AS d, list_cosine_similarity(patched, patched) AS cos FROM fit_vectors "
        "WHERE fn = 'lowrank' LIMIT 1",
        None,
        workspace,
    )
    assert vectors.to_pylist() == [{"model": "gpt2-muon-s0@final", "d": 3, "cos": pytest.approx(1.0)}]
    assert "patched" not in query_table("DESCRIBE fits", None, workspace)["column_name"].to_pylist()


@pytest.mark.parametrize("half", [False, True])
def test_the_vector_views_decode_the_stored_bytes_and_keep_null_rows(tmp_path: Path, half: bool) -> None:
    vectors = np.random.default_rng(3).standard_normal((4, 5)).astype(np.float32)
    stored = vectors.astype(np.float16).astype(np.float32) if half else vectors
    with ShardWriter(tmp_path / "data" / "activations", "m/seq=0", KEY) as writer:
        writer.write(
            {"model": "m", "layer": 0},
            pa.table(
                {
                    "seq_id": pa.array([0, 0, 1, 1], pa.int32()),
                    "pos": pa.array([0, 1, 0, 1], pa.int32()),
                    "token_id": pa.array([5, 6, 7, 8], pa.int32()),
                    "h": vectors_to_arrow(vectors, half=half, null=np.array([False, False, True, False])),
                }
            ),
        )
    rows = query_table("SELECT seq_id, pos, h FROM activation_vectors ORDER BY seq_id, pos", None, tmp_path)
    assert rows["h"].to_pylist() == [*stored[:2].tolist(), None, stored[3].tolist()]
    assert query_table("SELECT count(*) AS n FROM activations", None, tmp_path)["n"].to_pylist() == [4]


def test_vectors_in_the_old_format_are_named_with_the_command_that_rewrites_them(tmp_path: Path) -> None:
    old = pa.FixedSizeListArray.from_arrays(pa.array(np.ones(6, np.float32)), 3)
    with ShardWriter(tmp_path / "data" / "activations", "m/seq=0", KEY) as writer:
        writer.write(
            {"model": "m", "layer": 0},
            pa.table({"seq_id": pa.array([0, 1], pa.int32()), "pos": pa.array([0, 0], pa.int32()), "h": old}),
        )
    with pytest.raises(QueryError, match=r"vectors stored as fixed_size_list.*`lmgeo extract`") as refused:
        query_table("SELECT h FROM activation_vectors", None, tmp_path)
    assert "\n" not in str(refused.value)
    assert query_table("SELECT count(*) AS n FROM activations", None, tmp_path)["n"].to_pylist() == [2]  # scalars


def test_ctrl_c_while_duckdb_runs_in_the_main_thread_stops_the_query(tmp_path: Path, monkeypatch) -> None:
    """DuckDB turns a Ctrl-C that lands in one of its calls on the main thread (the views' set-up) into its
    own "Query interrupted" error, or loses it when the call finishes: Ctrl-C must still end the query as
    an interrupt, before the user's statement runs. Here the set-up holds a statement of a few seconds and
    SIGINT lands inside it; the user's statement would run for hours (the timeout fails a regression)."""
    import os
    import signal
    import threading
    import time

    from lmgeo.results import query

    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        pytest.skip(
            "SIGINT is ignored in this process, as it is for a suite started with `&` in a shell without job "
            "control or under nohup: no Ctrl-C can reach it; run the suite in the foreground to test Ctrl-C"
        )
    monkeypatch.setattr(query, "_LOCKDOWN", ("SELECT count(*) FROM range(100000) a, range(100000) b", *query._LOCKDOWN))
    ctrl_c = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    started = time.monotonic()
    ctrl_c.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            query_in(
                "SELECT count(*) FROM range(100000000) a, range(100000000) b",
                None,
                tmp_path,
                {"tables": "tables", "params": "params.yaml"},
                query.Limits(timeout_s=60),
            )
    finally:
        ctrl_c.cancel()
    assert time.monotonic() - started < 30
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Python's own handler is back


# ------------------------------------------------------------------------------ what a user asks
def test_the_readmes_best_recipe_query_ranks_as_the_report_does(workspace: Path, tmp_path: Path) -> None:
    """The README's "which recipe is best" line gives, per architecture, the order of the report's comparison
    (the `recipes` table's mean test loss of the default runs), on two architectures whose order is
    reversed, where a ranking over both would mix them."""
    import shlex

    import pyarrow.compute as pc
    from test_e2e import readme_commands

    from lmgeo.results.study_b.tables import recipes_table

    runs = query_table("SELECT * FROM runs", None, workspace)
    other = runs
    for name, column in {
        "arch": pa.array(["neox"] * runs.num_rows, runs.schema.field("arch").type),
        "run": pc.replace_substring(runs["run"], "gpt2-", "neox-"),
        "final_test_loss": pc.subtract(10.0, runs["final_test_loss"]),
    }.items():
        other = other.set_column(runs.schema.get_field_index(name), runs.schema.field(name), column)
    both = pa.concat_tables([runs, other])
    with ShardWriter(tmp_path / "reports" / "tables", "tables", KEY) as writer:
        writer.write({}, both, name="runs.parquet")
        writer.write({}, recipes_table(both, CFG), name="recipes.parquet")
    line = next(c for c in readme_commands("lmgeo query") if "avg(final_test_loss)" in c)
    answer = query_table(shlex.split(line)[2], None, tmp_path).to_pylist()
    report = query_table("SELECT arch, recipe, test_loss_mean FROM recipes WHERE NOT matched", None, tmp_path)
    ranking: dict[str, list[str]] = {}
    unmeasured_last = lambda r: (r["test_loss_mean"] is None, r["test_loss_mean"] or 0.0, r["recipe"])  # noqa: E731
    for row in sorted(report.to_pylist(), key=unmeasured_last):
        ranking.setdefault(row["arch"], []).append(row["recipe"])
    assert len(ranking) == 2 and len(ranking["gpt2"]) > 2 and ranking["gpt2"] != ranking["neox"], ranking
    by_arch: dict[str, list[str]] = {}
    for row in answer:
        by_arch.setdefault(row["arch"], []).append(row["recipe"])
    assert by_arch == ranking
    measured = [r["test_loss"] for r in answer if r["test_loss"] is not None]
    assert len(set(measured)) == len(measured)  # no ties: the order of equals would decide


def test_model_ids_are_split_into_arch_seed_and_checkpoint(workspace: Path) -> None:
    rows = query_table(
        "SELECT DISTINCT model, arch, seed, checkpoint FROM fits ORDER BY model", None, workspace
    ).to_pylist()
    assert rows == [
        {"model": "gpt2-muon-s0@final", "arch": "gpt2", "seed": 0, "checkpoint": "final"},
        {"model": "gpt2-muon-s0@init", "arch": "gpt2", "seed": 0, "checkpoint": "init"},
        {"model": "org/tiny-mamba", "arch": None, "seed": None, "checkpoint": None},  # external: not a run
    ]
    geometry = query_table("SELECT DISTINCT model, arch, checkpoint FROM geometry WHERE arch = 'gpt2'", None, workspace)
    assert geometry.num_rows > 0 and set(geometry["checkpoint"].to_pylist()) <= {"init", "final"}


def test_the_tokens_table_maps_ids_to_the_prepared_tokenizers_strings(workspace: Path, tmp_path: Path) -> None:
    import shutil

    from tokenizers import Tokenizer, models

    ws = tmp_path / "ws"
    shutil.copytree(workspace / "reports", ws / "reports")
    (ws / "data" / "tokenizer").mkdir(parents=True)
    vocabulary = {"<unk>": 0, "the": 1, "king": 2, "queen": 3}
    Tokenizer(models.WordLevel(vocabulary, unk_token="<unk>")).save(str(ws / "data" / "tokenizer" / "tokenizer.json"))
    rows = query_table("SELECT token_id, token FROM tokens ORDER BY token_id", None, ws).to_pylist()
    assert rows == [{"token_id": i, "token": text} for text, i in vocabulary.items()]


def test_a_workspace_without_results_says_how_to_make_them(tmp_path: Path) -> None:
    (tmp_path / "params.yaml").write_text("analysis: {k: 8}\n")
    with pytest.raises(QueryError, match=r"^no results yet: run `dvc repro`$"):
        query_table("SELECT * FROM runs", None, tmp_path)
    assert query_table("SELECT key FROM params", None, tmp_path)["key"].to_pylist() == ["analysis.k"]


def test_the_revision_workspace_is_the_working_tree(versioned_repo: Path) -> None:
    runs = query_table("SELECT rev, run FROM runs ORDER BY run", ["HEAD", "workspace"], versioned_repo)
    assert runs.to_pylist() == [{"rev": "workspace", "run": "dirty"}, {"rev": "HEAD", "run": "v2"}]


def test_a_command_typed_in_a_subfolder_finds_the_workspace(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    (tmp_path / "docs" / "deep").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "docs" / "deep")
    assert Layout.enclosing().root == tmp_path.resolve()


@pytest.mark.slow  # git clone and DVC's push and pull
def test_the_committed_default_remote_brings_an_old_revisions_data_to_a_fresh_clone(tmp_path: Path) -> None:
    """With the repository's `.dvc/config`, the per-token data pushed from one checkout is queried at
    `--rev HEAD~1` in a fresh clone beside it, with no `dvc remote add`."""
    import shutil

    from dvc.repo import Repo
    from study_helpers import REPO

    origin = dvc_git_repo(tmp_path / "origin")
    shutil.copy(REPO / ".dvc" / "config", origin / ".dvc" / "config")
    commit_version(origin, 1)
    commit_version(origin, 2)
    with Repo(str(origin)) as repo:
        repo.push(all_commits=True)
    assert (tmp_path / "lmgeo-remote").is_dir()  # beside the checkout, as the README says
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(origin), str(clone)], check=True)
    fits = query_table("SELECT rev, count(*) AS n FROM fits GROUP BY rev ORDER BY n", ["HEAD~1", "HEAD"], clone)
    assert fits.to_pylist() == [{"rev": "HEAD~1", "n": 2}, {"rev": "HEAD", "n": 3}]


def test_a_stage_records_a_new_plan_as_in_progress_and_keeps_the_record_of_the_plan_it_redoes(tmp_path: Path) -> None:
    """Before its fan-out a stage records a plan it has not completed (a query then names what is missing), but a
    rerun of the completed plan that redoes a shard found corrupt leaves the record as it was (a failed rerun
    changes nothing)."""
    from lmgeo.core.store import PLAN_FILE, write_plan
    from lmgeo.driver.sharded import _record_in_progress

    old = {"a": ManifestKey({}, "p1", "c")}
    new = {"a": ManifestKey({}, "p2", "c"), "b": ManifestKey({}, "p2", "c")}
    with ShardWriter(tmp_path, "a", old["a"]) as writer:
        writer.write({"run": "a"}, pa.table({"step": pa.array([0], pa.int64())}), name="steps.parquet")
    write_plan(tmp_path, old)
    record = (tmp_path / PLAN_FILE).read_bytes()
    _record_in_progress(tmp_path, old)
    assert (tmp_path / PLAN_FILE).read_bytes() == record
    _record_in_progress(tmp_path, new)
    written = json.loads((tmp_path / PLAN_FILE).read_text())
    assert written["in_progress"] is True and sorted(written["shards"]) == ["a", "b"]


# ------------------------------------------------------------------------------- a fresh clone
PER_TOKEN = re.compile(r"\b(fits|perturb|steps|activations|activation_vectors|fit_vectors|tokens)\b")


def commit_aggregated_study(repo: Path, cfg: ReportConfig, message: str) -> None:
    """The tiny study's data and tables as a pipeline leaves them: the tables committed (`cache: false`, as
    dvc.yaml declares them), the per-token datasets DVC outputs that `dvc.lock` records and git ignores."""
    from dvc.repo import Repo

    shutil.rmtree(repo / "data", ignore_errors=True)
    write_tiny_study(repo / "data")
    aggregate(sources(repo / "data"), repo / "reports", cfg, KEY)
    params = yaml.safe_load((Path(__file__).parents[1] / "params.yaml").read_text())
    (repo / "params.yaml").write_text(yaml.safe_dump({**params, "report": cfg.model_dump(mode="json")}))
    stage = {
        "cmd": "lmgeo aggregate",
        "params": ["report"],
        "outs": ["data/train", "data/fits", "data/perturb", {"reports/tables": {"cache": False}}],
    }
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"aggregate": stage}}))
    with contextlib.chdir(repo), Repo(str(repo)) as dvc_repo:
        dvc_repo.commit(force=True)  # dvc.lock: what `dvc repro` would record
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", message)


@pytest.mark.slow
def test_the_readmes_query_lines_answer_in_a_fresh_clone_without_dvc_repro(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The `lmgeo query` lines of the README and docs/query.md as written, run by `lmgeo` in a fresh `git clone`
    (no `dvc repro`, no DVC cache or remote) of a repository whose two commits hold committed tables: the lines
    over the tables, the params and two revisions answer; those naming per-token data say how to get it."""
    from test_e2e import readme_commands
    from typer.testing import CliRunner

    from lmgeo.cli import app

    origin = dvc_git_repo(tmp_path / "origin")
    commit_aggregated_study(origin, CFG, "a study")
    commit_aggregated_study(origin, CFG.model_copy(update={"seed": CFG.seed + 1}), "the study again, another seed")
    assert (
        "reports/tables/runs.parquet"
        in subprocess.run(["git", "ls-files"], cwd=origin, capture_output=True, text=True, check=True).stdout
    )
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(origin), str(clone)], check=True)
    assert not (clone / "data" / "fits").exists() and not (clone / ".dvc" / "cache").exists()
    monkeypatch.chdir(clone)
    lines = readme_commands("lmgeo query", "docs/query.md")
    over_tables = [line for line in lines if not PER_TOKEN.search(line)]
    assert len(over_tables) >= 5 and any("--rev HEAD~1 --rev HEAD" in line for line in over_tables), lines
    for line in lines:
        done = CliRunner().invoke(app, shlex.split(line)[1:])
        if line in over_tables:
            assert done.exit_code == 0 and done.stdout.strip(), (line, done.output)
            rows = len(done.stdout.splitlines()) - 1 if "--format csv" in line else "(0 rows)" not in done.stdout
            assert rows or "claim_tests" in line, (line, done.output)  # the tiny study has no stratified tests
        else:
            assert done.exit_code == 2 and "not in this checkout" in done.output, (line, done.output)
            assert "`dvc pull data/" in done.output, done.output
    both = CliRunner().invoke(
        app,
        ["query", "SELECT DISTINCT rev FROM runs ORDER BY rev", "--rev", "HEAD~1", "--rev", "HEAD", "--format", "csv"],
    )
    assert both.stdout.split() == ["rev", "HEAD", "HEAD~1"], both.output


def test_a_partial_dataset_is_queried_alone_and_joined_with_nothing(tmp_path: Path) -> None:
    """A stage stopped half-way leaves shards of a new run beside another dataset's of the old one: the partial
    dataset answers alone (with its note), and a query joining it with another is refused, naming it."""
    from lmgeo.core.store import write_plan

    keys = {f"gpt2-muon-s{seed}": ManifestKey({}, "p", "c") for seed in range(2)}
    write_plan(tmp_path / "data" / "train", keys, complete=False)
    with ShardWriter(tmp_path / "data" / "train", "gpt2-muon-s0", keys["gpt2-muon-s0"]) as writer:
        writer.write(
            {"run": "gpt2-muon-s0"},
            pa.table({"step": pa.array([0], pa.int64()), "train_loss": [4.0]}),
            name="steps.parquet",
        )
    assert query_table("SELECT count(*) AS n FROM steps", None, tmp_path).to_pylist() == [{"n": 1}]
    from test_attacks import write_fits

    write_fits(tmp_path / "data" / "fits", "m/layer=0", 0, 0.5)
    with pytest.raises(QueryError, match=r"data/train is partial .* joined with no other dataset or table"):
        query_table("SELECT count(*) FROM steps, fits", None, tmp_path)


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT * FROM query_table('geo' || 'metry')",
        "SELECT * FROM runs, query_table(lower('GEOMETRY'))",
        "SELECT (SELECT count(*) FROM query('SELECT * FROM ' || 'steps'))",
        "EXPLAIN ANALYZE SELECT * FROM query_table(['runs', 'geo' || 'metry'])",
    ],
)
def test_a_computed_table_name_is_refused_in_one_line(
    sql: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`query_table` / `query` read tables by a name they are given; the views a query reads (and the one-run
    check over them) are found in its text, so a name computed in SQL is refused before anything is read."""
    from typer.testing import CliRunner

    from lmgeo import cli

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli.app, ["query", sql])
    assert result.exit_code == 2
    name = "query" if "query(" in sql else "query_table"
    assert result.stderr == (
        f"lmgeo: error: {name}(...): give the table name (or SQL) as a string literal, e.g. "
        "query_table('geometry'), or name the table directly (FROM geometry); a computed one is refused, since "
        "the data a query reads is checked from its text\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_literal_table_names_pass_the_check(workspace: Path) -> None:
    for sql in ("SELECT * FROM query_table('runs')", "FROM query_table(['runs', 'runs'])", "FROM query('FROM runs')"):
        assert check_read_only(sql) == sql
    assert query_table("SELECT count(*) AS n FROM query_table('runs')", None, workspace)["n"].to_pylist()[0] > 0
