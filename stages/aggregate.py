"""`lmgeo aggregate`: DuckDB over data/ into reports/tables, reports/metrics.json and reports/plots."""

from pipeline.core.config import Params
from stages.layout import Layout


def run(params: Params, ray_address: str | None = None) -> None:
    from pipeline.results.aggregate import aggregate

    layout = Layout.here()
    aggregate(layout.root / "data", layout.reports, params.report)
    print(f"aggregate: wrote {layout.reports / 'tables'}, metrics.json and plots/", flush=True)
