"""`lmgeo aggregate`: DuckDB over data/ into reports/tables, reports/metrics.json and reports/plots."""

from __future__ import annotations

from pipeline.params import Params
from stages.layout import Layout


def run(params: Params, ray_address: str | None = None) -> None:
    from pipeline.results.aggregate import aggregate, load_sources

    layout = Layout.here()
    sources = load_sources(layout.train, layout.fits, layout.perturb, layout.models)
    aggregate(sources, layout.reports, params.report)
    print(f"aggregate: wrote {layout.tables}, metrics.json and plots/", flush=True)
