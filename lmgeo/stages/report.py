"""`lmgeo report`: reports/report.md, reports/report.html and reports/figures/*.png from reports/tables."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from lmgeo.driver.layout import KNOB_RECORDS, LOCALITY_SWEEP, PROVENANCE, SWEEP_RECORD, TUNING_RECORD, Layout
from lmgeo.params import RESULT_SECTIONS, Params

# Small files whose content identifies the inputs (dvc.lock's own checksum would be the one of the lock before
# this report: its report stage still records the previous report's outputs).
CHECKSUMMED = ("params.yaml", "data/tokens/meta.json")
# The report summary's "In short" (its line, then its list), which `lmgeo findings` copies into README's findings
# block.
IN_SHORT = re.compile(r"^\*\*In short\.\*\* (.+(?:\n- .+)*)$", re.MULTILINE)


def collect_provenance(layout: Layout, params: Params) -> dict[str, Any]:
    """What the report's Setup section states: git revision, params hash, seeds, package versions,
    hardware and data checksums."""
    from lmgeo.core import provenance

    lock = layout.root / "dvc.lock"
    checksums: dict[str, Any] = provenance.checksums(layout.root, CHECKSUMMED)
    if read := provenance.checksums(layout.root, report_inputs(layout)):
        checksums["report inputs (as read)"] = read
    # The lock's hashes of what is under reports/ are those of a previous run (this report's own outputs, and the
    # tables as the last `dvc repro` left them): the files as read stand for them.
    reports = layout.reports.relative_to(layout.root).as_posix() + "/"
    outputs = provenance.locked_outputs(lock.read_text()) if lock.is_file() else {}
    if upstream := {path: md5 for path, md5 in outputs.items() if not path.startswith(reports)}:
        checksums["stage outputs (dvc.lock)"] = upstream
    from lmgeo.driver.deps import result_inputs

    return {
        "git": provenance.git_state(layout.root, result_inputs(layout.root)),
        "kernels": kernels(),
        "params_hash": params.section_hash(*RESULT_SECTIONS),
        "seeds": {
            "prepare": params.prepare.seed,
            "train": list(params.train.seeds),
            "analysis": params.analysis.seed,
            "report (bootstrap)": params.report.seed,
        },
        "packages": provenance.versions(),
        "hardware": provenance.machine(),
        "data_checksums": checksums,
    }


def report_inputs(layout: Layout) -> list[str]:
    """Workspace-relative paths of the files the report is built from, as they are now: the result tables (with
    their manifest) and the committed records it cites."""
    from lmgeo.core.paths import writable

    found = [path for path in sorted(writable(layout.tables).rglob("*")) if path.is_file()]
    found += [layout.root / name for name in (TUNING_RECORD, *KNOB_RECORDS, LOCALITY_SWEEP)]
    found += sorted(path for path in (layout.root / SWEEP_RECORD).glob("*") if path.is_file() and path.suffix != ".md")
    return [path.relative_to(layout.root).as_posix() for path in found]


def median_step_times(layout: Layout) -> dict[str, float]:
    """run → median seconds per step, from the train stage's telemetry (`telemetry/train/<run>.json`)."""
    import statistics

    from lmgeo.driver.telemetry import read_telemetry

    found = read_telemetry(layout).items()
    return {run: statistics.median(times.step_time_s) for run, times in found if times.step_time_s}


def kernels() -> dict[str, str]:
    """The kernels this process runs, as the libraries report them, and the pins every task ran under
    (SPEC §1: results are identical where these agree, and on one CPU vendor)."""
    import faiss
    import torch

    from lmgeo.core.determinism import pinned_environment
    from lmgeo.core.provenance import cpu_model

    pins = {name: os.environ.get(name, "unset") for name in pinned_environment(1) if "THREADS" not in name}
    return {
        "cpu": cpu_model(),
        "torch": torch.backends.cpu.get_cpu_capability(),
        "faiss": faiss.SIMDConfig.get_level_name(),
        "pins": ", ".join(f"{name}={value}" for name, value in pins.items()),
    }


def tuning_record(layout: Layout) -> dict[str, Any] | None:
    path = layout.root / TUNING_RECORD
    return json.loads(path.read_text()) if path.is_file() else None


def knob_records(layout: Layout) -> list[tuple[str, dict[str, Any]]]:
    return [
        (str(Path(name).parent), json.loads((layout.root / name).read_text()))
        for name in KNOB_RECORDS
        if (layout.root / name).is_file()
    ]


def run(params: Params, layout: Layout, ray_address: str | None = None) -> None:
    from lmgeo.core.errors import InputError
    from lmgeo.core.store import MANIFEST_DIR, atomic_write
    from lmgeo.results.report import render_report

    if not (layout.tables / MANIFEST_DIR).is_dir():  # refuse before touching the committed report
        raise InputError(f"no result tables in {layout.tables}: run `lmgeo aggregate` (or `dvc repro aggregate`) first")
    provenance = collect_provenance(layout, params)
    from lmgeo.results.study_a.report import read_locality_sweep
    from lmgeo.results.study_b.record import read_record

    rendered = render_report(
        layout.tables,
        layout.reports / "report.md",
        layout.reports / "figures",
        provenance,
        tuning_record(layout),
        median_step_times(layout),
        read_record(layout.root / SWEEP_RECORD),
        read_locality_sweep(layout.root / LOCALITY_SWEEP),
        knob_records(layout),
        params,
    )
    atomic_write(layout.reports / PROVENANCE, json.dumps(provenance, indent=1, sort_keys=True) + "\n")
    print(
        f"report: wrote {layout.reports / 'report.md'} ({rendered.lines} lines), report.html, {PROVENANCE} and "
        f"{len(rendered.figures)} figures",
        flush=True,
    )


def findings(layout: Layout) -> str:
    """What the study in `reports/` finds: its report summary's "In short" (`IN_SHORT`)."""
    from lmgeo.core.errors import InputError

    report = layout.reports / "report.md"
    found = IN_SHORT.search(report.read_text()) if report.is_file() else None
    if found is None:
        raise InputError(f"{report}: no report with a summary; run `dvc repro` first")
    return found[1]


def write_findings(layout: Layout, readme: Path) -> bool:
    """Put `findings` into `readme`'s findings block, from a report of the default study only (an experiment's
    report describes other params: the README's block states what the default study finds); whether the
    block changed."""
    from lmgeo.core.errors import InputError
    from lmgeo.core.store import atomic_write
    from lmgeo.params import default_study
    from lmgeo.results.report import FINDINGS_END, FINDINGS_START, findings_block, with_findings

    recorded = layout.reports / PROVENANCE
    params_hash = json.loads(recorded.read_text()).get("params_hash") if recorded.is_file() else None
    expected = default_study().section_hash(*RESULT_SECTIONS)
    if params_hash != expected:
        raise InputError(
            f"{recorded}: the report in {layout.reports} was computed with params hash {params_hash}, not the "
            f"default study's ({expected}); README's findings state what the default study finds: restore "
            "params.yaml (`git checkout params.yaml`) and `dvc repro` first"
        )
    if readme.is_symlink():  # a write would replace the link by a file, and the file it leads to keeps the old block
        raise InputError(
            f"{readme}: a symlink (to {readme.resolve()}), not the README file; replace the link with the file itself "
            f"and re-run `lmgeo findings --write {readme}`"
        )
    text = readme.read_text() if readme.is_file() else ""
    if findings_block(text) is None:
        raise InputError(
            f"{readme}: not exactly one findings block (a line `{FINDINGS_START}`, then a line `{FINDINGS_END}`, "
            f"each marker alone on its line); fix it by hand and re-run `lmgeo findings --write {readme}`"
        )
    updated = with_findings(text, findings(layout))
    if updated != text:
        atomic_write(readme, updated)
    return updated != text
