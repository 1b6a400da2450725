"""`lmgeo aggregate`: DuckDB over data/ into reports/tables and reports/metrics.json, and the series of DVC's data
plots into reports/plots/*.csv."""

from __future__ import annotations

from typing import Any

from lmgeo.core.fingerprint import CodeSpec
from lmgeo.driver.layout import Layout
from lmgeo.params import Params


def code_spec(layout: Layout) -> CodeSpec:
    """The tables' code: the stage's, and every registered member's (the tables describe each of them)."""
    from lmgeo.core.fingerprint import all_members
    from lmgeo.driver.sharded import stage_code

    return stage_code("aggregate", layout, all_members([layout.root]))


def run(params: Params, layout: Layout, ray_address: str | None = None, *, trained: bool = True) -> None:
    """The tables, metrics.json and the plots' series of the study in `layout`; `trained=False` (`lmgeo analyse`,
    where nothing is trained): the tables and metrics.json from the fits and KLs alone, with no training logs,
    checkpoints or n-gram baselines to expect, and no plots."""
    from lmgeo.core.config import digest
    from lmgeo.core.store import ManifestKey, dataset_digest, file_sha256, lineage_of
    from lmgeo.driver.sharded import planned_keys, versioned
    from lmgeo.results.aggregate import EvaluationWindows, aggregate, load_sources

    expected: dict[str, dict[str, ManifestKey]] = {}
    read = {"fits": layout.fits, "perturb": layout.perturb}
    inputs: dict[str, str] = {}
    decided_by: Any = params.report
    windows = None
    if trained:
        runs = planned_keys("train", params, layout)
        expected = {"steps": runs, "models": runs}
        read = {"steps": layout.train, "models": layout.models} | read
        inputs = {"tokens": file_sha256(layout.tokens / "meta.json")}
        train = params.train
        windows = EvaluationWindows(
            layout.tokens,
            params.prepare.seq_len,
            train.eval_batches * train.batch_size,
            train.test_batches * train.batch_size,
        )
        decided_by = {"report": params.report, "windows": [windows.seq_len, windows.val_windows, windows.test_windows]}
    expected |= {"fits": planned_keys("fit", params, layout), "perturb": planned_keys("perturb", params, layout)}
    sources = load_sources(layout.train, layout.fits, layout.perturb, layout.models, expected, windows)
    inputs = {name: dataset_digest(root) for name, root in read.items()} | inputs
    key = ManifestKey(inputs, digest(decided_by), versioned(code_spec(layout), layout)[1])
    aggregate(sources, layout.reports, params.report, key, params.analysis, lineage_of(list(read.values())))
    if trained:
        write_plots(layout)
        print(f"aggregate: wrote {layout.tables}, metrics.json and {layout.plots}", flush=True)


def write_plots(layout: Layout) -> None:
    """`reports/plots/<series>.csv`, from the tables just written (`lmgeo.results.plots`): a header, then a
    row per point (a missing value empty, floats as Python writes them: the same bytes for the same tables)."""
    import csv
    import io

    from lmgeo.core.contracts import read_result_tables
    from lmgeo.core.store import atomic_write
    from lmgeo.results.plots import plot_series

    for name, table in plot_series(read_result_tables(layout.tables)).items():
        text = io.StringIO()
        writer = csv.writer(text, lineterminator="\n")
        writer.writerow(table.column_names)
        writer.writerows([["" if v is None else v for v in row.values()] for row in table.to_pylist()])
        atomic_write(layout.plots / f"{name}.csv", text.getvalue())
