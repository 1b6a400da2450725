"""`lmgeo aggregate`: DuckDB over data/ into reports/tables and reports/metrics.json, and the series of DVC's data
plots into reports/plots/*.csv."""

from __future__ import annotations

from lmgeo.core.fingerprint import CodeSpec
from lmgeo.driver.layout import Layout
from lmgeo.params import Params


def code_spec(layout: Layout) -> CodeSpec:
    """The tables' code: the stage's, and every registered member's (the tables describe each of them)."""
    from lmgeo.core.fingerprint import all_members
    from lmgeo.driver.sharded import stage_code

    return stage_code("aggregate", layout, all_members([layout.root]))


def run(params: Params, ray_address: str | None = None) -> None:
    from lmgeo.core.config import digest
    from lmgeo.core.store import ManifestKey, dataset_digest, file_sha256, lineage_of
    from lmgeo.driver.sharded import planned_keys, versioned
    from lmgeo.results.aggregate import EvaluationWindows, aggregate, load_sources

    layout = Layout.here()
    trained = planned_keys("train", params, layout)
    expected = {
        "steps": trained,
        "models": trained,
        "fits": planned_keys("fit", params, layout),
        "perturb": planned_keys("perturb", params, layout),
    }
    train = params.train
    windows = EvaluationWindows(
        layout.tokens,
        params.prepare.seq_len,
        train.eval_batches * train.batch_size,
        train.test_batches * train.batch_size,
    )
    sources = load_sources(layout.train, layout.fits, layout.perturb, layout.models, expected, windows)
    read = {"steps": layout.train, "models": layout.models, "fits": layout.fits, "perturb": layout.perturb}
    inputs = {name: dataset_digest(root) for name, root in read.items()} | {
        "tokens": file_sha256(layout.tokens / "meta.json")
    }
    decided_by = {"report": params.report, "windows": [windows.seq_len, windows.val_windows, windows.test_windows]}
    key = ManifestKey(inputs, digest(decided_by), versioned(code_spec(layout), layout)[1])
    aggregate(sources, layout.reports, params.report, key, params.analysis, lineage_of(list(read.values())))
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
