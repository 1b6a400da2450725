"""Study A's result tables (SPEC §4.4, §4.5): every fit row with its perturbation (the `anchors` view),
summaries per (model, layer, class, sample) and pooled, the angle histogram, Spearman(rel_err, kl) per layer
and stratified, the claims' tests against their nulls (`pipeline.results.study_a.claims`); and its part of
the DVC metrics (`pipeline.results.aggregate`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.core.contracts import (
    FIT_METRICS,
    FITS,
    PERTURB_METRICS,
    is_vector_type,
    table_id,
    table_id_sql,
    vector_shape,
)
from pipeline.models.registry import FAMILIES
from pipeline.results.common import measured, none_if_nan
from pipeline.results.config import ReportConfig
from pipeline.results.stats import spearman_by_layer
from pipeline.results.study_a.claims import (
    ACROSS,
    LAYER_FIT,
    PARTS,
    Capacities,
    ClassValues,
    Stratum,
    claim_tests,
    class_values,
    percentile_interval,
    seed_level_replicates,
    subject_of,
    summarise,
)
from pipeline.study_a.classes import FIT_CLASSES
from pipeline.study_a.config import AnalysisConfig

ANGLE_BIN_DEG = 10
# Each claim's name in the DVC metrics: short, so that `dvc metrics show` fits a 200-column terminal.
# `cos_full_tok_near_1` has none: it is implied by `rel_err` (cos_full_tok ≥ √(1 − rel_err²), SPEC §4.5); nor
# has `expressivity_tradeoff`, one verdict across classes (the `expressivity` table and the report have it): a
# column more and `dvc metrics show` no longer fits 200 columns.
HEADLINE = {
    "angle_res_tok_near_90": "ortho", "proj_res_below_full": "proj_loc", "proj_res_global_below_full": "proj_glob",
    "spearman_rel_err_kl": "rho_kl", "partial_spearman_rel_err_kl": "rho_part", "residual_outweighs_null": "kl_null",
    "local_beats_layer": "local",
}  # fmt: skip


def create_anchor_view(con: duckdb.DuckDBPyConnection) -> None:
    """Every fit row (all samples) with its perturbation values (real sample only)."""
    finite = ", ".join(f"CASE WHEN isfinite(f.{c}) THEN f.{c} END AS {c}" for c in FIT_METRICS)
    any_nonfinite = " OR ".join(f"NOT isfinite(f.{c})" for c in FIT_METRICS)
    kl = ", ".join(f"CASE WHEN isfinite(p.{c}) THEN p.{c} END AS {c}" for c in PERTURB_METRICS)
    con.execute(f"""
        CREATE TEMP VIEW anchors AS
        SELECT {table_id_sql('f.model')} AS model, f.layer, f.fn, f.sample, f.seq_id, f.pos, f.k, f.locality, {finite},
               coalesce({any_nonfinite}, false) AS has_nonfinite, f.n_nonfinite, f.n_distinct,
               f.subspace_tied, f.converged, {kl}
        FROM fits f LEFT JOIN perturb p
          ON f.sample = 'real' AND f.model = p.model AND f.layer = p.layer AND f.fn = p.fn
             AND f.seq_id = p.seq_id AND f.pos = p.pos
    """)  # fmt: skip


def _model_facts() -> str:
    """SQL columns run, checkpoint, arch and family (the registered family's kind; for an external model,
    the kind of the registered family whose model type its id names, else transformer)."""
    kinds = " ".join(
        f"WHEN split_part(model, '-', 1) = '{f.name}' OR lower(model) LIKE '%{f.model_type}%' THEN '{f.kind}'"
        for f in FAMILIES if f.kind != "transformer"
    )
    return f"""
    nullif(regexp_extract(model, '^(.*)@(init|final)$', 1), '') AS run,
    nullif(regexp_extract(model, '^(.*)@(init|final)$', 2), '') AS checkpoint,
    CASE WHEN regexp_matches(model, '@(init|final)$') THEN split_part(model, '-', 1) END AS arch,
    CASE {kinds} ELSE 'transformer' END AS family
"""
_ALL_METRICS = FIT_METRICS + PERTURB_METRICS


def _summaries() -> str:
    return ", ".join(f"avg({c}) AS mean_{c}, median({c}) AS median_{c}" for c in _ALL_METRICS)


def geometry_table(con: duckdb.DuckDBPyConnection) -> pa.Table:
    """Per (model, layer, class, sample): summaries, and what SPEC §4.5 asks to count per layer."""
    return con.sql(f"""
        SELECT model, layer, fn, sample, count(*) AS n, max(n_nonfinite) AS n_nonfinite,
               max(n_distinct) AS n_distinct, max(k) AS k,
               -- the anchors each kind of claim keeps: those whose value at the anchor is identified (rel_err
               -- and the KLs defined), and those whose local operator is (proj_* defined)
               count(rel_err) AS n_value_kept, count(proj_full) AS n_operator_kept,
               count(*) FILTER (WHERE subspace_tied) AS n_subspace_tied,
               count(*) FILTER (WHERE NOT converged) AS n_not_converged,
               count(*) FILTER (WHERE has_nonfinite) AS n_nonfinite_values, {_summaries()},
               -- how local the neighbourhoods are: k-th neighbour distance over the pool's median pair distance
               median(locality) AS median_locality,
               -- over the anchors of median_cos_full_tok (a rel_err ≥ 1 bounds cos by 0), so that the two
               -- medians compare like with like: cos_full_tok ≥ the bound at every anchor, hence for the medians
               median(CASE WHEN cos_full_tok IS NOT NULL THEN sqrt(greatest(0, 1 - rel_err * rel_err)) END)
                   AS median_cos_bound
        FROM anchors GROUP BY model, layer, fn, sample ORDER BY model, layer, fn, sample
    """).to_arrow_table()  # fmt: skip


def geometry_pooled_table(con: duckdb.DuckDBPyConnection) -> pa.Table:
    """Descriptive medians of the real sample over every anchor of every layer (the claims never use them:
    they are tested per layer, `claim_tests`)."""
    over_layers = ", ".join(f"median(median_{c}) AS layer_median_{c}" for c in _ALL_METRICS)
    return con.sql(f"""
        WITH pooled AS (
            SELECT model, fn, count(*) AS n, count(DISTINCT layer) AS n_layers,
                   count(*) FILTER (WHERE has_nonfinite) AS n_nonfinite_values, {_summaries()}
            FROM anchors WHERE sample = 'real' GROUP BY model, fn
        ), per_layer AS (
            SELECT model, fn, sum(n_nonfinite) AS n_nonfinite, {over_layers}
            FROM geometry WHERE sample = 'real' GROUP BY model, fn
        )
        SELECT model, fn, {_model_facts()}, p.n, p.n_layers, l.n_nonfinite,
               p.* EXCLUDE (model, fn, n, n_layers), l.* EXCLUDE (model, fn, n_nonfinite)
        FROM pooled p JOIN per_layer l USING (model, fn)
        ORDER BY model, fn
    """).to_arrow_table()  # fmt: skip


def angles_table(con: duckdb.DuckDBPyConnection) -> pa.Table:
    bins = 180 // ANGLE_BIN_DEG
    return con.sql(f"""
        WITH real AS (SELECT * FROM anchors WHERE sample = 'real'),
        groups AS (SELECT DISTINCT model, fn FROM real WHERE angle_res_tok IS NOT NULL),
        grid AS (SELECT model, fn, b FROM groups, range({bins}) t(b)),
        counts AS (
            SELECT model, fn, least(floor(angle_res_tok / {ANGLE_BIN_DEG}), {bins - 1})::BIGINT AS b, count(*) AS c
            FROM real WHERE angle_res_tok IS NOT NULL GROUP BY ALL
        )
        SELECT g.model, g.fn,
               (g.b * {ANGLE_BIN_DEG})::DOUBLE AS bin_lo, ((g.b + 1) * {ANGLE_BIN_DEG})::DOUBLE AS bin_hi,
               coalesce(c.c, 0) AS count,
               coalesce(c.c, 0) / sum(coalesce(c.c, 0)) OVER (PARTITION BY g.model, g.fn) AS fraction
        FROM grid g LEFT JOIN counts c USING (model, fn, b)
        ORDER BY g.model, g.fn, g.b
    """).to_arrow_table()  # fmt: skip


CORRELATIONS_SCHEMA = pa.schema(
    [("model", pa.string()), ("fn", pa.string()), ("scope", pa.string()), ("layer", pa.int32()),
     ("n", pa.int64()), ("spearman", pa.float64()), ("ci_low", pa.float64()), ("ci_high", pa.float64())]
)  # fmt: skip


def correlations_table(con: duckdb.DuckDBPyConnection, cfg: ReportConfig) -> pa.Table:
    """Spearman(rel_err, kl) per (model, fn, layer), and `stratified` over layers (the mean of the layers'
    rhos, never rows of different layers ranked together; layer null)."""
    pairs = con.sql("""
        SELECT model, fn, layer, rel_err, kl FROM anchors
        WHERE sample = 'real' AND rel_err IS NOT NULL AND kl IS NOT NULL ORDER BY model, fn, layer, seq_id, pos
    """).fetchnumpy()  # fmt: skip
    rows = []
    for model, fn in dict.fromkeys(zip(pairs["model"].tolist(), pairs["fn"].tolist(), strict=True)):
        g = (pairs["model"] == model) & (pairs["fn"] == fn)
        by_layer = spearman_by_layer(pairs["layer"][g], pairs["rel_err"][g], pairs["kl"][g],
                                     n_boot=cfg.bootstrap, ci=cfg.ci, seed=cfg.seed)  # fmt: skip
        stratified = by_layer.pop("stratified", None)
        for layer, c in ([(None, stratified)] if stratified else []) + sorted(by_layer.items()):
            rows.append({
                "model": model, "fn": fn, "scope": "stratified" if layer is None else "layer", "layer": layer, "n": c.n,
                "spearman": none_if_nan(c.rho), "ci_low": none_if_nan(c.low), "ci_high": none_if_nan(c.high),
            })  # fmt: skip
    return pa.Table.from_pylist(rows, schema=CORRELATIONS_SCHEMA)


def capacities(fits: tuple[Path, Sequence[Path]], analysis: AnalysisConfig) -> dict[str, dict[str, int]]:
    """Per model, the free parameters of each local tokenwise class (`FitClass.parameters`) at the model's
    width d, read from the width of the fits' `patched` vectors (a Parquet footer per model, no data)."""
    root, files = fits
    widths: dict[str, int] = {}
    for f in files:
        model = table_id(str(FITS.partition_values(f.relative_to(root))["model"]))
        schema = pq.read_schema(f) if model not in widths else None
        vector = schema.field("patched").type if schema is not None and "patched" in schema.names else None
        if vector is not None and is_vector_type(vector):
            widths[model] = vector_shape(vector)[0]
    return {model: {c.name: c.parameters(d, analysis) for c in FIT_CLASSES if c.local and c.tokenwise}
            for model, d in sorted(widths.items())}  # fmt: skip


def claim_tables(con: duckdb.DuckDBPyConnection, cfg: ReportConfig, capacity: Capacities) -> dict[str, pa.Table]:
    """Every claim of the seed against its nulls, per stratum and stratified (`claims.claim_tests`), and the
    classes' values the expressivity trade-off orders by `capacity` (`expressivity`)."""
    strata = _strata(con)
    return {
        "claim_tests": claim_tests(strata, capacity, n_boot=cfg.bootstrap, ci=cfg.ci, seed=cfg.seed),
        "expressivity": expressivity_table(class_values(strata, capacity, cfg.bootstrap, cfg.seed), cfg),
    }


EXPRESSIVITY_SCHEMA = pa.schema(
    [("subject", pa.string()), ("fn", pa.string()), ("parameters", pa.int64()), ("n_models", pa.int64()),
     ("n_layers", pa.int64()), ("n", pa.int64())]
    + [(f"{part}{end}", pa.float64()) for part in PARTS for end in ("", "_low", "_high")]
)  # fmt: skip


def expressivity_table(cells: list[ClassValues], cfg: ReportConfig) -> pa.Table:
    """Per subject and local tokenwise class, in order of capacity: its median rel_err and Spearman(rel_err,
    kl) on the anchors every class keeps, the mean over layers (never pooled) and seeds, with the two-stage
    (seeds, then anchors) bootstrap's interval."""
    rows = []
    for subject in sorted({c.subject for c in cells}):
        mine = [c for c in cells if c.subject == subject]
        capacity = mine[0].capacity
        for fn in sorted({fn for c in mine for fn in c.capacity}, key=lambda fn: (capacity.get(fn, 0), fn)):
            at = [c for c in mine if fn in c.capacity]
            models = sorted({c.model for c in at})
            row: dict[str, object] = {"subject": subject, "fn": fn, "parameters": capacity.get(fn),
                                      "n_models": len(models), "n_layers": len({c.layer for c in at}),
                                      "n": sum(c.n for c in at)}  # fmt: skip
            for part in PARTS:
                by_model = [[c for c in at if c.model == m] for m in models]  # a model's value: its layers' mean
                point = np.mean([np.mean([c.point[part][fn] for c in cs]) for cs in by_model])
                boot = seed_level_replicates([np.mean([c.boot[part][fn] for c in cs], axis=0) for cs in by_model],
                                             np.random.default_rng([cfg.seed, cfg.bootstrap, len(models)]))
                low, high = percentile_interval(boot, cfg.ci)
                row |= {part: none_if_nan(float(point)), f"{part}_low": none_if_nan(float(low)),
                        f"{part}_high": none_if_nan(float(high))}  # fmt: skip
            rows.append(row)
    return pa.Table.from_pylist(rows, schema=EXPRESSIVITY_SCHEMA)


def _strata(con: duckdb.DuckDBPyConnection) -> list[Stratum]:
    """Per (model, layer, class): the real anchors' columns, each null sample's values at the same anchors
    (`<sample>.<column>`), the null patches' KLs, and the rel_err of the class fitted once for the layer
    (`layer.rel_err`, from the `<class>.layer` rows); and per (model, layer) an `ACROSS` stratum: every local
    tokenwise class's `<class>.rel_err` and `<class>.kl` at the same anchors."""
    columns = ("rel_err", "rel_err_state", "cos_full_tok", "angle_res_tok", "proj_full", "proj_res",
               "proj_full_global", "proj_res_global", "kl", "kl_random", "kl_other")  # fmt: skip
    table = con.sql(f"""
        SELECT model, layer, fn, sample, seq_id, pos, {", ".join(columns)} FROM anchors
        ORDER BY model, layer, fn, sample, seq_id, pos
    """).fetchnumpy()  # fmt: skip
    groups: dict[tuple[str, int, str, str], dict[str, np.ndarray]] = {}
    key_columns = [table[name].tolist() for name in ("model", "layer", "fn", "sample")]
    keys = list(zip(*key_columns, strict=True))
    anchor = table["seq_id"].astype(np.int64) * 2**32 + table["pos"]
    for key, (start, stop) in _runs(keys).items():
        groups[key] = {"anchor": anchor[start:stop], **{c: _floats(table[c][start:stop]) for c in columns}}
    strata = []
    across: dict[tuple[str, int], dict[str, np.ndarray]] = {}
    for (model, layer, fn, sample), real in groups.items():
        if sample != "real":
            continue
        cols = {c: real[c] for c in columns}
        for other, values in ((s, groups.get((model, layer, fn, s))) for s in ("shuffled", "gaussian")):
            if values is not None:
                cols |= {f"{other}.{c}": _aligned(real["anchor"], values["anchor"], values[c]) for c in columns}
        layer_wide = groups.get((model, layer, fn + LAYER_FIT, "real"))
        if layer_wide is not None:
            cols["layer.rel_err"] = _aligned(real["anchor"], layer_wide["anchor"], layer_wide["rel_err"])
        strata.append(Stratum(model, subject_of(model), int(layer), fn, cols))
        if fn in FIT_CLASSES and FIT_CLASSES[fn].local and FIT_CLASSES[fn].tokenwise:
            at = across.setdefault((model, int(layer)), {"anchor": real["anchor"]})
            at |= {f"{fn}.{c}": _aligned(at["anchor"], real["anchor"], real[c]) for c in ("rel_err", "kl")}
    strata += [Stratum(model, subject_of(model), layer, ACROSS, {c: v for c, v in cols.items() if c != "anchor"})
               for (model, layer), cols in across.items()]  # fmt: skip
    return strata


def _runs(keys: list[tuple[Any, ...]]) -> dict[tuple[Any, ...], tuple[int, int]]:
    """Start and stop of each run of equal keys in a sorted list."""
    bounds: dict[tuple[Any, ...], tuple[int, int]] = {}
    for i, key in enumerate(keys):
        start = bounds.get(key, (i, i))[0]
        bounds[key] = (start, i + 1)
    return bounds


def _floats(values: Any) -> np.ndarray:
    return np.ma.filled(np.ma.asarray(values, dtype=float), np.nan)


def _aligned(anchors: np.ndarray, other: np.ndarray, values: np.ndarray) -> np.ndarray:
    """`values` (keyed by the sorted `other` anchors) at `anchors`; NaN where an anchor is missing."""
    where = np.searchsorted(other, anchors).clip(0, max(len(other) - 1, 0))
    found = len(other) > 0 and other[where] == anchors
    return np.where(found, values[where] if len(other) else np.nan, np.nan)


def metrics(tables: dict[str, pa.Table]) -> dict[str, float]:
    """Study A's part of the DVC metrics (`pipeline.results.aggregate`): per claim of `HEADLINE`, under its
    short name, the verdict score (+1 supported … −1 contradicted, over the classes) averaged over the
    subjects, trained architectures (`@final`) and external models, to 2 decimals (more would only widen
    the column)."""
    scores: dict[str, list[float]] = {}
    for s in summarise(tables["claim_tests"].to_pylist()):
        if not s.subject.endswith("@init") and s.claim in HEADLINE:
            scores.setdefault(HEADLINE[s.claim], []).append(s.score)
    return measured({name: float(np.mean(values)) for name, values in scores.items()}, decimals=2)
