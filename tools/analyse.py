"""`lmgeo analyse MODEL_DIR [--out DIR]`: Study A on one local Hugging Face model folder, without training.

`DIR` becomes a workspace of its own (default: `analyse-<folder name>` here): a `params.yaml` that is the
given params with `analysis.external_models` the model and `analysis.runs` null (nothing trained), then the
stages Study A needs run in it, in order (`prepare` for the eval text, `extract`, `fit`, `perturb`), the
result tables written as `lmgeo aggregate` writes them, and a report of Study A's parts alone
(`report.md`, `report.html`, `figures/`). `lmgeo query` works in `DIR` as in any workspace. The model is
refused before any stage runs when it cannot be analysed: not a model folder, a structure that fails
verification, no usable tokenizer, or a width `analysis.k` cannot identify.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import time
from pathlib import Path

import yaml

from pipeline.core.errors import InputError
from pipeline.params import Params, apply_overrides
from stages.layout import Layout

STAGES = ("prepare", "extract", "fit", "perturb")
# Marks a folder this command made its workspace: a re-run may resume there, and nothing else is written over.
MADE_BY_ANALYSE = ".lmgeo-analyse"


def run(params: Params, ray_address: str | None = None, *, model_dir: Path, out: Path | None = None) -> Path:
    """Run Study A on `model_dir` in the workspace `out` (module docstring); returns the report's path."""
    model = model_dir.resolve()
    out = out or Path(f"analyse-{model.name}")
    if not model.is_dir():
        raise InputError(f"{model_dir}: not a folder; give a model folder saved with `save_pretrained`")
    claim_workspace(out)
    study = one_model_study(params, Path(os.path.relpath(model, out.resolve())))
    with contextlib.chdir(out):
        layout = Layout.here()
        check(study, layout)
        (layout.root / "params.yaml").write_text(yaml.safe_dump(study.model_dump(mode="json"), sort_keys=False))
        started = time.monotonic()
        for number, stage in enumerate(STAGES, start=1):
            print(f"analyse: [{number}/{len(STAGES) + 1}] {stage}", flush=True)
            importlib.import_module(f"stages.{stage}").run(study, ray_address=ray_address)
        print(f"analyse: [{len(STAGES) + 1}/{len(STAGES) + 1}] tables and report", flush=True)
        write_tables(study, layout)
        report = write_report(layout, model)
        print(f"analyse: wrote {out / report.name} in {time.monotonic() - started:.0f} s", flush=True)
    return out / report.name


def claim_workspace(out: Path) -> None:
    """`out` as this command's workspace: a new or empty folder (marked as made here), or one this command made
    before (a re-run resumes there); never a study's workspace, nor a folder holding anything else, whose
    `params.yaml`, data and reports the analysis would replace."""
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out}: not a folder; give a new or empty folder")
    if any((out / name).exists() for name in ("dvc.yaml", ".dvc", ".git")):
        raise InputError(
            f"--out {out}: a study's workspace, whose params.yaml, data and reports `lmgeo analyse` would replace; "
            "give a new or empty folder (the default is analyse-<model folder name>)"
        )
    if out.is_dir() and any(out.iterdir()) and not (out / MADE_BY_ANALYSE).is_file():
        raise InputError(
            f"--out {out}: a folder that is not empty and that `lmgeo analyse` did not make; give a new or empty "
            "folder (the default is analyse-<model folder name>)"
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / MADE_BY_ANALYSE).touch()


def one_model_study(params: Params, model: Path) -> Params:
    """`params` with the model (relative to the workspace, so that no result holds a machine's absolute path)
    as the only one analysed, and no trained run; the folder named on the command line may lie outside the
    workspace (naming it is the consent `security.allow_outside_paths` asks for)."""
    return apply_overrides(params, {
        "analysis.runs": "null",
        "analysis.external_models": json.dumps([{"id": str(model)}]),
        "security.allow_outside_paths": "true",
    })  # fmt: skip


def check(params: Params, layout: Layout) -> None:
    """Everything that would stop the analysis later, before the first stage: the model's structure and its
    tokenizer (`stages.opening.check_external_model`), and its width against `analysis.k` (which the fit
    stage would only find after the extraction)."""
    from pipeline.models.structure import text_config
    from stages.analysis_set import external_model
    from stages.fit import check_identifiable
    from stages.opening import check_external_model

    (ref,) = params.analysis.external_models
    net = check_external_model(params, layout, external_model(params, layout, ref.id, None))
    width = getattr(text_config(net), "hidden_size", None)
    if isinstance(width, int):
        check_identifiable(params.analysis, ref.id, width)


def write_tables(params: Params, layout: Layout) -> None:
    """The result tables of `lmgeo aggregate`, from the fits and KLs alone (no training logs to expect)."""
    from pipeline.core.config import digest
    from pipeline.core.store import ManifestKey, dataset_digest, lineage_of
    from pipeline.results.aggregate import aggregate, load_sources
    from stages import aggregate as aggregate_stage
    from stages.sharded import planned_keys, versioned

    expected = {name: planned_keys(name, params, layout) for name in ("fit", "perturb")}
    sources = load_sources(layout.train, layout.fits, layout.perturb, layout.models,
                           {"fits": expected["fit"], "perturb": expected["perturb"]})  # fmt: skip
    inputs = {name: dataset_digest(root) for name, root in (("fits", layout.fits), ("perturb", layout.perturb))}
    code = versioned(aggregate_stage.code_spec(layout), layout)[1]
    aggregate(sources, layout.reports, params.report, ManifestKey(inputs, digest(params.report), code),
              params.analysis, lineage_of([layout.fits, layout.perturb]))


def write_report(layout: Layout, model: Path) -> Path:
    """`report.md` (and `report.html`, `figures/`) in the workspace: Study A's summary and section of the
    study's report, for this one model."""
    from pipeline.core.contracts import RESULT_TABLES, read_result_tables
    from pipeline.core.store import atomic_write
    from pipeline.results.common import Figures
    from pipeline.results.html import to_html
    from pipeline.results.study_a import report as study_a
    from pipeline.results.study_a.claims import summarise

    found = read_result_tables(layout.tables)
    tables = {name: found[name].to_pylist() if name in found else [] for name in RESULT_TABLES}
    figures_dir = layout.root / "figures"
    figures_dir.mkdir(exist_ok=True)
    claims = summarise(tables["claim_tests"])
    figures = Figures(figures_dir, Path("figures"))
    text = "\n".join([
        f"# lmgeo analyse: {model.name}\n",
        f"Study A on `{model}` with the analysis settings of `params.yaml` (beside this report), no training.\n",
        study_a.claims_summary(claims, bool(tables["geometry"]), tables["claim_tests"], figures,
                               tables["paper_values"]),
        study_a.section(tables, claims, figures),
    ])  # fmt: skip
    out = layout.root / "report.md"
    atomic_write(out, text)
    atomic_write(out.with_suffix(".html"), to_html(text, layout.root, title=f"lmgeo analyse: {model.name}"))
    return out
