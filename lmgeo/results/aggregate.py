"""Aggregation of training logs and per-token fits into small result tables (SPEC §2, §3.3, §4.4).

``aggregate(sources, out_dir, cfg)`` reads ``Sources``: the verified files of the steps, fits and perturb
datasets (``lmgeo.core.contracts``), the records of the finished runs and the n-gram baselines, and writes:

- ``out_dir/tables/<name>.parquet`` for every name in ``RESULT_TABLES`` (always all of them; a study that was not
  run gives empty tables with the documented columns):
  ``runs``, ``curves``, ``recipes`` (with a row per budget of the matched-budget sweep), ``envelope`` (each
  recipe at its best budget of the sweep), ``baselines`` (the unigram and Kneser–Ney bigram on the models' val
  and test windows, ``lmgeo.study_b.ngram``), ``geometry`` (per model, layer, class and sample: real or null),
  ``geometry_pooled`` (descriptive, real sample), ``angles``, ``correlations`` (per layer, and stratified over
  layers), ``claims`` (Study B), ``claim_tests`` (Study A's claims against their nulls,
  ``lmgeo.results.study_a.claims``), ``expressivity`` (per subject and local class, in order of capacity:
  rel_err and Spearman(rel_err, kl), what the expressivity trade-off ranks). Models are labelled
  ``<run>@init`` / ``<run>@final`` or by their hub id (``/``).
- ``out_dir/metrics.json`` (DVC metrics): the headline, ``lmgeo.results.headline``.

Non-finite values in fits are excluded from every statistic and counted (``n_nonfinite_values``). Study A's tables
are built in ``lmgeo.results.study_a.tables``, Study B's in ``lmgeo.results.study_b.tables``; this module
reads the sources and writes the outputs.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa

from lmgeo.core.contracts import FITS, PERTURB, STEPS, RunRecord, scan
from lmgeo.core.store import ManifestKey, ShardWriter, atomic_write, verified_files, write_plan
from lmgeo.results.config import ReportConfig
from lmgeo.results.headline import metrics
from lmgeo.results.study_a import tables as study_a
from lmgeo.results.study_b import tables as study_b
from lmgeo.study_a.config import AnalysisConfig
from lmgeo.study_b.ngram import NgramLoss

# ------------------------------------------------------------------------------------ reading data
Files = tuple[Path, Sequence[Path]]  # a dataset's root and its verified files


@dataclass(frozen=True)
class Sources:
    """What aggregation reads: the verified files of each per-token dataset, the finished runs, and the
    n-gram baselines of the models' evaluation windows (none where the tokens are not given)."""

    steps: Files
    fits: Files
    perturb: Files
    runs: Sequence[RunRecord]
    baselines: Sequence[NgramLoss] = ()


def load_sources(
    steps: Path,
    fits: Path,
    perturb: Path,
    models: Path,
    expected: Mapping[str, Mapping[str, ManifestKey]] | None = None,
    windows: EvaluationWindows | None = None,
) -> Sources:
    """The verified files under each dataset folder (none where a stage has not run) and the records of
    the finished runs (`run.json` of each final checkpoint, as its manifest lists it).

    `expected` (dataset → shard → key, from the writing stages' current plans: `train` for the steps and
    the models, `fit`, `perturb`) makes every read take exactly the planned shards, and refuse a missing,
    stale or mixed one; without it a dataset is read as written (one params hash, one code version).
    `windows` (the tokens and the models' evaluation windows) gives the n-gram baselines."""
    planned = dict(expected or {})

    def files(root: Path, name: str, stage: str) -> Files:
        if name not in planned and not root.is_dir():
            return root, []
        return root, verified_files(root, planned.get(name), rebuild=f"`lmgeo {stage}`")

    _, checkpoints = files(models, "models", "train")
    records = [RunRecord.from_json(json.loads(p.read_text())) for p in checkpoints if p.match("*/final/run.json")]
    return Sources(
        files(steps, "steps", "train"),
        files(fits, "fits", "fit"),
        files(perturb, "perturb", "perturb"),
        sorted(records, key=lambda r: r.run),
        windows.baselines() if windows else (),
    )


@dataclass(frozen=True)
class EvaluationWindows:
    """The prepared tokens and how the models are evaluated on them (`train`'s windows): the n-gram
    baselines are read on exactly those windows."""

    tokens_dir: Path
    seq_len: int
    val_windows: int  # eval_batches × batch_size
    test_windows: int  # test_batches × batch_size

    def baselines(self) -> list[NgramLoss]:
        import torch

        from lmgeo.study_b.ngram import baselines
        from lmgeo.study_b.train import Windows
        from lmgeo.text.corpus import load_meta, load_tokens

        def windows(split: str, count: int) -> np.ndarray:
            return Windows(load_tokens(self.tokens_dir, split), self.seq_len, torch.device("cpu")).fixed(count).numpy()

        return baselines(
            load_tokens(self.tokens_dir, "train"),
            windows("val", self.val_windows),
            windows("test", self.test_windows),
            load_meta(self.tokens_dir)["vocab_size"],
        )


def _register_sources(con: duckdb.DuckDBPyConnection, sources: Sources) -> None:
    for name, dataset, (root, files) in (
        ("steps_raw", STEPS, sources.steps),
        ("fits", FITS, sources.fits),
        ("perturb", PERTURB, sources.perturb),
    ):
        con.register(name, scan(root, dataset, files))
    records = [dataclasses.asdict(r) for r in sources.runs]
    con.register("run_json", pa.Table.from_pylist(records, schema=RunRecord.arrow_schema()))
    # A diverging run logs NaN/Inf on its last steps: those values are missing, never summarised or drawn.
    finite = ", ".join(
        f"CASE WHEN isfinite({f.name}) THEN {f.name} END AS {f.name}"
        for f in STEPS.scalar_schema
        if f.type == pa.float64()
    )
    con.execute(f"CREATE TEMP VIEW steps AS SELECT * REPLACE ({finite}) FROM steps_raw")


# ------------------------------------------------------------------------------------------ outputs
def build_tables(sources: Sources, cfg: ReportConfig, analysis: AnalysisConfig | None = None) -> dict[str, pa.Table]:
    """Every result table from ``sources`` (see the module docstring); ``analysis``, the fits' section of
    params, gives the classes' capacities (None: unknown, the expressivity trade-off is not tested)."""
    # One thread: float sums then run in a fixed order, so equal inputs give byte-identical tables.
    con = duckdb.connect(":memory:", config={"threads": 1})
    _register_sources(con, sources)
    runs = study_b.runs_table(con)
    recipes = study_b.recipes_table(runs, cfg)
    envelope = study_b.envelope_table(runs, recipes, cfg)
    study_a.create_anchor_view(con)
    geometry = study_a.geometry_table(con)
    con.register("geometry", geometry)
    pooled = study_a.geometry_pooled_table(con)
    return {
        "runs": runs,
        "curves": study_b.curves_table(con),
        "recipes": recipes,
        "envelope": envelope,
        "baselines": study_b.baselines_table(sources.baselines),
        "geometry": geometry,
        "geometry_pooled": pooled,
        "angles": study_a.angles_table(con),
        "correlations": study_a.correlations_table(con, cfg),
        "claims": study_b.claims_table(runs, recipes, cfg),
        **study_a.claim_tables(con, cfg, study_a.capacities(sources.fits, analysis) if analysis else {}),
    }


def aggregate(
    sources: Sources,
    out_dir: Path,
    cfg: ReportConfig,
    key: ManifestKey,
    analysis: AnalysisConfig | None = None,
    lineage: Mapping[str, str] | None = None,
) -> None:
    """Write ``out_dir/tables/*.parquet`` and ``out_dir/metrics.json`` (module docstring).

    The tables are one shard of the store under ``key``, so their readers (the report, ``lmgeo query``)
    verify every file against the manifest, as for any dataset; its finished plan records the ``lineage``
    of the datasets they were computed from (``lmgeo.core.store.lineage_of``)."""
    tables = build_tables(sources, cfg, analysis)
    with ShardWriter(out_dir / "tables", "tables", key) as writer:
        for name, table in tables.items():
            writer.write({}, table, name=f"{name}.parquet")
    write_plan(out_dir / "tables", {"tables": key}, lineage)
    rows = {name: tables[name].to_pylist() for name in ("recipes", "envelope", "claim_tests")}
    atomic_write(out_dir / "metrics.json", json.dumps(metrics(rows), indent=2) + "\n")
