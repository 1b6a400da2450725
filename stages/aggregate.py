"""`lmgeo aggregate`: DuckDB over data/ into reports/tables and reports/metrics.json, and the series of DVC's data
plots into reports/plots/*.csv."""

from __future__ import annotations

from pipeline.core.fingerprint import CodeSpec
from pipeline.params import Params
from stages.layout import Layout


def code_spec(layout: Layout) -> CodeSpec:
    """The tables' code: the stage's, and every registered member's (the tables describe each of them)."""
    from pipeline.core.fingerprint import all_members
    from stages.sharded import stage_code

    return stage_code("aggregate", layout, all_members([layout.root]))


def run(params: Params, ray_address: str | None = None) -> None:
    from pipeline.core.config import digest
    from pipeline.core.store import ManifestKey, dataset_digest
    from pipeline.results.aggregate import aggregate, load_sources
    from stages.sharded import planned_keys, versioned

    layout = Layout.here()
    trained = planned_keys("train", params, layout)
    expected = {"steps": trained, "models": trained, "fits": planned_keys("fit", params, layout),
                "perturb": planned_keys("perturb", params, layout)}  # fmt: skip
    sources = load_sources(layout.train, layout.fits, layout.perturb, layout.models, expected)
    read = {"steps": layout.train, "models": layout.models, "fits": layout.fits, "perturb": layout.perturb}
    key = ManifestKey({name: dataset_digest(root) for name, root in read.items()}, digest(params.report),
                      versioned(code_spec(layout), layout)[1])  # fmt: skip
    aggregate(sources, layout.reports, params.report, key, params.analysis)
    write_plots(layout)
    print(f"aggregate: wrote {layout.tables}, metrics.json and {layout.plots}", flush=True)


def write_plots(layout: Layout) -> None:
    """`reports/plots/<series>.csv`, from the tables just written (`pipeline.results.plots`): a header, then a
    row per point (a missing value empty, floats as Python writes them: the same bytes for the same tables)."""
    import csv
    import io

    from pipeline.core.contracts import read_result_tables
    from pipeline.core.store import atomic_write
    from pipeline.results.plots import plot_series

    for name, table in plot_series(read_result_tables(layout.tables)).items():
        text = io.StringIO()
        writer = csv.writer(text, lineterminator="\n")
        writer.writerow(table.column_names)
        writer.writerows([["" if v is None else v for v in row.values()] for row in table.to_pylist()])
        atomic_write(layout.plots / f"{name}.csv", text.getvalue())
