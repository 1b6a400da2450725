"""A committed record of Study B's matched-budget sweep (SPEC §3.2), for a default study that does not run
it: the sweep is the preset `presets/sweep.yaml`, its result tables are copied with their provenance into a
folder (`docs/sweep/`, by `python -m scripts.sweep_record`), and the report reads them from there, saying where
they come from. Every table's sha256 is in the record's `provenance.json`, and `read_record` refuses a table
that does not match it, so a stale or edited copy is never read."""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from lmgeo.core.errors import InputError

TABLES = ("recipes", "envelope", "baselines")  # what the report's sweep section reads
PROVENANCE = "provenance.json"


@dataclass(frozen=True)
class SweepRecord:
    """The sweep's tables (rows) and where they come from: the revision, params hash and preset it ran."""

    tables: dict[str, list[dict[str, Any]]]
    provenance: dict[str, Any]

    def describe(self) -> str:
        """Where the numbers come from, in one clause for the report."""
        p = self.provenance
        return (
            f"`{p['command']}` at revision {p['revision'][:7]} (params hash {p['params_hash']}), its tables "
            f"committed in `{p['folder']}`"
        )


def write_record(tables: dict[str, Any], provenance: dict[str, Any], command: str, out: Path) -> None:
    """Copy the sweep's result tables (`name → pyarrow.Table`, read verified by the caller) into `out`, with
    their sha256 and the run's provenance (`reports/provenance.json`), replacing the record there; the
    folder's other files (its README) are kept."""
    if not any(row["matched"] for row in tables["recipes"].to_pylist()):
        raise InputError(
            "the result tables hold no matched-budget sweep: run the preset first, `lmgeo exp run presets/sweep.yaml`"
        )
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    digests = {}
    for name in TABLES:
        path = staging / f"{name}.parquet"
        pq.write_table(tables[name], path)
        digests[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    git = provenance["git"]
    record = {
        "command": command,
        "folder": out.as_posix(),
        "revision": git["revision"],
        "uncommitted_changes": git.get("uncommitted_changes"),
        "params_hash": provenance["params_hash"],
        "seeds": provenance["seeds"],
        "tables": digests,
    }
    (staging / PROVENANCE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    owned = {PROVENANCE, *(f"{name}.parquet" for name in TABLES)}
    for kept in sorted(out.iterdir()) if out.is_dir() else []:
        if kept.name not in owned:
            (shutil.copytree if kept.is_dir() else shutil.copy2)(kept, staging / kept.name)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)


def read_record(folder: Path) -> SweepRecord | None:
    """The record in `folder`, verified; None when there is none."""
    path = folder / PROVENANCE
    if not path.is_file():
        return None
    provenance = json.loads(path.read_text())
    tables = {}
    for name, digest in provenance["tables"].items():
        table_path = folder / f"{name}.parquet"
        if not table_path.is_file() or hashlib.sha256(table_path.read_bytes()).hexdigest() != digest:
            raise InputError(
                f"{table_path}: missing or not the table its provenance records; write the record "
                "again: `python -m scripts.sweep_record`"
            )
        tables[name] = pq.read_table(table_path).to_pylist()
    return SweepRecord(tables, provenance)
