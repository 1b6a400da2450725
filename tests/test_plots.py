"""The series of DVC's data plots (`lmgeo/results/plots.py`): the loss curves and the budget sweep, checked
against the result tables by an independent computation (DuckDB), and byte-identical CSVs on a rerun."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest
from test_aggregate import CFG, KEY, sources, write_study_a, write_study_b

from lmgeo.core.contracts import read_result_tables
from lmgeo.driver.layout import Layout
from lmgeo.results.aggregate import aggregate
from lmgeo.results.plots import SERIES, plot_series
from lmgeo.stages.aggregate import write_plots


@pytest.fixture(scope="module")
def tables(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("plots")
    write_study_b(root / "data", matched=True)
    write_study_a(root / "data")
    aggregate(sources(root / "data"), root / "reports", CFG, KEY)
    return read_result_tables(root / "reports" / "tables")


@pytest.mark.slow
def test_the_val_loss_series_is_the_mean_over_seeds_of_the_comparisons_curves(tables) -> None:
    series = plot_series(tables)
    assert set(series) == set(SERIES)
    con = duckdb.connect()
    con.register("curves", tables["curves"])
    con.register("runs", tables["runs"])
    expected = con.sql(
        "SELECT r.arch, r.recipe, c.step, avg(c.val_loss) AS val_loss FROM curves c JOIN runs r USING (run) "
        "WHERE NOT r.matched AND c.val_loss IS NOT NULL GROUP BY ALL ORDER BY 1, 2, 3"
    ).fetchall()
    got = [tuple(row.values()) for row in series["val_loss"].to_pylist()]
    assert len(got) == len(expected) > 4
    for g, e in zip(got, expected, strict=True):
        assert g[:3] == e[:3] and g[3] == pytest.approx(e[3], rel=1e-12)
    assert {row[1] for row in got} >= {"muon", "hilbert"}


def test_the_budget_series_is_the_sweeps_rows_of_the_recipes_table(tables) -> None:
    budget = plot_series(tables)["loss_vs_budget"].to_pylist()
    swept = [r for r in tables["recipes"].to_pylist() if r["matched"] and r["head_budget_tau"] is not None]
    assert len(budget) == len(swept) > 0
    assert {(r["recipe"], r["head_budget_tau"], r["test_loss_mean"]) for r in budget} == {
        (r["recipe"], r["head_budget_tau"], r["test_loss_mean"]) for r in swept
    }
    assert budget == sorted(budget, key=lambda r: (r["arch"], r["recipe"], r["head_budget_tau"]))


def test_the_csvs_are_written_the_same_bytes_twice_and_without_study_b_are_empty(tables, tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    write_plots_from(tables, layout)
    first = {p.name: p.read_bytes() for p in layout.plots.glob("*.csv")}
    write_plots_from(tables, layout)
    assert first == {p.name: p.read_bytes() for p in layout.plots.glob("*.csv")}
    assert sorted(first) == sorted(f"{name}.csv" for name in SERIES)
    assert first["val_loss.csv"].splitlines()[0] == b"arch,recipe,step,val_loss"
    assert all(t.num_rows == 0 for t in plot_series({}).values())


def write_plots_from(tables: dict, layout: Layout) -> None:
    """`write_plots` reads the tables from `layout.tables`: write them there as aggregate would."""
    from lmgeo.core.store import ShardWriter

    with ShardWriter(layout.tables, "tables", KEY) as writer:
        for name, table in tables.items():
            writer.write({}, table, name=f"{name}.parquet")
    write_plots(layout)
