"""Commit the matched-budget sweep's result tables for the report (`lmgeo.results.study_b.record`):
after `lmgeo exp run presets/sweep.yaml` (or its first pass, `presets/sweep_core.yaml`, then with `--preset`),
`python -m scripts.sweep_record` copies its Study B tables and provenance from `reports/` into `docs/sweep/`,
where the default study's report reads them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    from lmgeo.core.contracts import read_result_tables
    from lmgeo.results.study_b.record import write_record

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reports", type=Path, default=Path("reports"), help="the preset run's reports/")
    parser.add_argument("--out", type=Path, default=Path("docs/sweep"))
    parser.add_argument("--preset", default="presets/sweep.yaml", help="the preset the run applied (the record says)")
    args = parser.parse_args(argv)
    tables = read_result_tables(args.reports / "tables")
    provenance = json.loads((args.reports / "provenance.json").read_text())
    write_record(tables, provenance, f"lmgeo exp run {args.preset}", args.out)
    print(f"sweep_record: wrote {args.out} from {args.reports} (revision {provenance['git']['revision'][:7]})")


if __name__ == "__main__":
    main()
