"""`lmgeo report`: reports/report.md and reports/figures/*.png from reports/tables."""

from pipeline.core.config import Params
from stages.layout import Layout


def run(params: Params, ray_address: str | None = None) -> None:
    from pipeline.results.report import collect_provenance, render_report

    layout = Layout.here()
    provenance = collect_provenance(layout.root, params)
    render_report(layout.reports / "tables", layout.reports / "report.md", layout.reports / "figures", provenance)
    print(f"report: wrote {layout.reports / 'report.md'}", flush=True)
