"""Study A's result tables (SPEC §4.4, §4.5): every fit row with its perturbation (the `anchors` view),
summaries per (model, layer, class, sample) and pooled, the angle histogram, Spearman(rel_err, kl) per layer
and stratified, the claims' tests against their nulls (`lmgeo.results.study_a.claims`); and its part of
the DVC metrics (`lmgeo.results.aggregate`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401 - `pa.compute`
import pyarrow.parquet as pq

from lmgeo.core.contracts import (
    FIT_METRICS,
    FITS,
    PERTURB_METRICS,
    is_vector_type,
    table_id,
    table_id_sql,
    vector_shape,
)
from lmgeo.models.registry import FAMILIES
from lmgeo.results.common import none_if_nan
from lmgeo.results.config import ReportConfig
from lmgeo.results.stats import spearman, spearman_by_layer
from lmgeo.results.study_a.claims import (
    LAYER_FIT,
    MIN_ANCHORS,
    VERSUS,
    Effect,
    Stratum,
    Test,
    claim_tests,
    mean_over_layers,
    one_model_subjects,
    stratum_effect,
    subject_of,
    t_interval,
    well_posed,
)
from lmgeo.study_a.classes import FIT_CLASSES
from lmgeo.study_a.config import AnalysisConfig

Capacities = Mapping[str, Mapping[str, int]]  # model -> local tokenwise class -> its free parameters
# What the `expressivity` table gives per class, each an effect against 0 (so with the claims' interval).
EXPRESSIVITY_PARTS = {
    "rel_err": Test(lambda c, idx: float(np.median(c["rel_err"][idx])), 0.0, ("rel_err",)),
    "spearman": Test(lambda c, idx: spearman(c["rel_err"][idx], c["kl"][idx]), 0.0, ("rel_err", "kl")),
}
ANGLE_BIN_DEG = 10


def create_anchor_view(con: duckdb.DuckDBPyConnection) -> None:
    """Every fit row (all samples) with its perturbation values (real sample only)."""
    finite = ", ".join(f"CASE WHEN isfinite(f.{c}) THEN f.{c} END AS {c}" for c in FIT_METRICS)
    any_nonfinite = " OR ".join(f"NOT isfinite(f.{c})" for c in FIT_METRICS)
    kl = ", ".join(f"CASE WHEN isfinite(p.{c}) THEN p.{c} END AS {c}" for c in PERTURB_METRICS)
    con.execute(f"""
        CREATE TEMP VIEW anchors AS
        SELECT {table_id_sql("f.model")} AS model, f.layer, f.fn, f.sample, f.seq_id, f.pos, f.k, f.locality, {finite},
               coalesce({any_nonfinite}, false) AS has_nonfinite, f.n_nonfinite, f.n_distinct,
               f.subspace_tied, f.converged, {kl}, p.kl_directions
        FROM fits f LEFT JOIN perturb p
          ON f.sample = 'real' AND f.model = p.model AND f.layer = p.layer AND f.fn = p.fn
             AND f.seq_id = p.seq_id AND f.pos = p.pos
    """)


def _model_facts() -> str:
    """SQL columns run, checkpoint, arch and family (the registered family's kind; for an external model,
    the kind of the registered family whose model type its id names, else transformer)."""
    kinds = " ".join(
        f"WHEN split_part(model, '-', 1) = '{f.name}' OR lower(model) LIKE '%{f.model_type}%' THEN '{f.kind}'"
        for f in FAMILIES
        if f.kind != "transformer"
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
    """).to_arrow_table()


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
    """).to_arrow_table()


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
    """).to_arrow_table()


CORRELATIONS_SCHEMA = pa.schema(
    [
        ("model", pa.string()),
        ("fn", pa.string()),
        ("scope", pa.string()),
        ("layer", pa.int32()),
        ("n", pa.int64()),
        ("spearman", pa.float64()),
        ("ci_low", pa.float64()),
        ("ci_high", pa.float64()),
    ]
)


def correlations_table(con: duckdb.DuckDBPyConnection, cfg: ReportConfig) -> pa.Table:
    """Spearman(rel_err, kl) per (model, fn, layer), and `stratified` over layers (the mean of the layers'
    rhos, never rows of different layers ranked together; layer null)."""
    pairs = con.sql("""
        SELECT model, fn, layer, rel_err, kl FROM anchors
        WHERE sample = 'real' AND rel_err IS NOT NULL AND kl IS NOT NULL ORDER BY model, fn, layer, seq_id, pos
    """).fetchnumpy()
    rows = []
    for model, fn in dict.fromkeys(zip(pairs["model"].tolist(), pairs["fn"].tolist(), strict=True)):
        g = (pairs["model"] == model) & (pairs["fn"] == fn)
        by_layer = spearman_by_layer(
            pairs["layer"][g], pairs["rel_err"][g], pairs["kl"][g], n_boot=cfg.bootstrap, ci=cfg.ci, seed=cfg.seed
        )
        stratified = by_layer.pop("stratified", None)
        for layer, c in ([(None, stratified)] if stratified else []) + sorted(by_layer.items()):
            rows.append(
                {
                    "model": model,
                    "fn": fn,
                    "scope": "stratified" if layer is None else "layer",
                    "layer": layer,
                    "n": c.n,
                    "spearman": none_if_nan(c.rho),
                    "ci_low": none_if_nan(c.low),
                    "ci_high": none_if_nan(c.high),
                }
            )
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
    return {
        model: {c.name: c.parameters(d, analysis) for c in FIT_CLASSES if c.local and c.tokenwise}
        for model, d in sorted(widths.items())
    }


def claim_tables(con: duckdb.DuckDBPyConnection, cfg: ReportConfig, capacity: Capacities) -> dict[str, pa.Table]:
    """Every claim against its nulls, per stratum and stratified (`claims.claim_tests`); each local tokenwise
    class's rel_err and Spearman(rel_err, kl) on the anchors all of them keep, in order of `capacity`
    (`expressivity`); and the raw values of the paper's statistics (`paper_values`)."""
    strata = _strata(con)
    return {
        "claim_tests": claim_tests(strata, ci=cfg.ci),
        "expressivity": expressivity_table(strata, capacity, cfg.ci),
        "paper_values": paper_values_table(strata),
    }


EXPRESSIVITY_SCHEMA = pa.schema(
    [
        ("subject", pa.string()),
        ("fn", pa.string()),
        ("parameters", pa.int64()),
        ("n_models", pa.int64()),
        ("n_layers", pa.int64()),
        ("n", pa.int64()),
    ]
    + [(f"{part}{end}", pa.float64()) for part in EXPRESSIVITY_PARTS for end in ("", "_low", "_high")]
)


def expressivity_table(strata: list[Stratum], capacity: Capacities, ci: float) -> pa.Table:
    """Per subject and local tokenwise class, in order of capacity (its `parameters`, null without the analysis
    section): its median rel_err and Spearman(rel_err, kl) on the anchors every such class keeps at the layer,
    the mean over layers (never pooled) and seeds, with the claims' t-interval (over seeds, or a one-model
    subject's anchor blocks)."""
    effects: dict[tuple[str, str], dict[str, dict[str, list[Effect]]]] = {}  # (subject, fn) -> part -> model -> layers
    alone = one_model_subjects(strata)
    for s in _common_anchors(strata):
        for part, test in EXPRESSIVITY_PARTS.items():
            if (effect := stratum_effect(s, test, s.subject in alone)) is not None:
                effects.setdefault((s.subject, s.fn), {}).setdefault(part, {}).setdefault(s.model, []).append(effect)
    rows = []
    for (subject, fn), parts in effects.items():
        models = sorted(parts["rel_err"]) if "rel_err" in parts else []
        row: dict[str, object] = {
            "subject": subject,
            "fn": fn,
            "n_models": len(models),
            "parameters": next((capacity[m][fn] for m in models if fn in capacity.get(m, {})), None),
            "n_layers": max((len(layers) for layers in parts.get("rel_err", {}).values()), default=0),
            "n": sum(e.n for layers in parts.get("rel_err", {}).values() for e in layers),
        }
        for part in EXPRESSIVITY_PARTS:
            interval = (
                t_interval([mean_over_layers(layers) for layers in parts[part].values()], 0.0, ci)
                if part in parts
                else None
            )
            row |= {
                part: none_if_nan(interval.centre) if interval else None,
                f"{part}_low": none_if_nan(interval.low) if interval else None,
                f"{part}_high": none_if_nan(interval.high) if interval else None,
            }
        rows.append(row)
    rows.sort(key=lambda r: (str(r["subject"]), r["parameters"] if r["parameters"] is not None else -1, str(r["fn"])))
    return pa.Table.from_pylist(rows, schema=EXPRESSIVITY_SCHEMA)


def _common_anchors(strata: list[Stratum]) -> list[Stratum]:
    """The local tokenwise classes' strata with their rel_err and kl kept only at the anchors every such class
    of the (model, layer) keeps (NaN elsewhere)."""
    local = [s for s in strata if s.fn in FIT_CLASSES and FIT_CLASSES[s.fn].local and FIT_CLASSES[s.fn].tokenwise]
    keep: dict[tuple[str, int], np.ndarray] = {}
    for s in local:
        complete = np.isfinite(s.columns["rel_err"]) & np.isfinite(s.columns["kl"])
        keep[(s.model, s.layer)] = keep.get((s.model, s.layer), complete) & complete
    return [
        Stratum(
            s.model,
            s.subject,
            s.layer,
            s.fn,
            {c: np.where(keep[(s.model, s.layer)], s.columns[c], np.nan) for c in ("rel_err", "kl")},
        )
        for s in local
    ]


PAPER_VALUES_SCHEMA = pa.schema(
    [
        ("subject", pa.string()),
        ("fn", pa.string()),
        ("statistic", pa.string()),
        ("value", pa.float64()),
        ("n_models", pa.int64()),
        ("n_layers", pa.int64()),
    ]
)
# The paper's statistics as it states them (SPEC §4.4, the report's side-by-side table), per (model, layer, class):
# raw values, no null. A subject's value is the mean over its models of the mean over their layers, except
# `spearman_max` (the largest over its models and layers) and `spearman_over_0.7` (the share of its (model, layer)
# pairs above 0.7).
RAW: dict[str, tuple[tuple[str, ...], Callable[[dict[str, np.ndarray]], float]]] = {
    "cos_full_tok": (("cos_full_tok",), lambda c: float(np.median(c["cos_full_tok"]))),
    "angle_over_60": (("angle_res_tok",), lambda c: float(np.mean(c["angle_res_tok"] > 60))),
    "proj_full": (("proj_full",), lambda c: float(np.median(c["proj_full"]))),
    "proj_res": (("proj_res",), lambda c: float(np.median(c["proj_res"]))),
    "rel_err": (("rel_err",), lambda c: float(np.median(c["rel_err"]))),
    "spearman": (("rel_err", "kl"), lambda c: spearman(c["rel_err"], c["kl"])),
    "outweighs_random": (("kl", "kl_directions"), lambda c: float(np.mean(c["kl_directions"] < c["kl"][:, None]))),
}


def paper_values_table(strata: list[Stratum]) -> pa.Table:
    """The raw values of the paper's statistics per subject and tokenwise class (`RAW`), on the same strata as
    the claims (well-posed layers, each statistic on the anchors where its columns are defined)."""
    values: dict[tuple[str, str, str], dict[str, list[float]]] = {}
    for s in strata:
        if s.fn not in FIT_CLASSES or not FIT_CLASSES[s.fn].tokenwise:
            continue
        for name, (columns, statistic) in RAW.items():
            if not all(c in s.columns and s.columns[c].size for c in columns):  # an empty column: nothing to compute on
                continue
            complete = np.all(
                [np.isfinite(s.columns[c]).reshape(len(s.columns[c]), -1).all(axis=1) for c in columns], axis=0
            )
            if complete.sum() >= MIN_ANCHORS:
                value = statistic({c: s.columns[c][complete] for c in columns})
                values.setdefault((s.subject, s.fn, name), {}).setdefault(s.model, []).append(value)
    rows = []
    for (subject, fn, name), per_model in sorted(values.items()):
        layers = [v for vs in per_model.values() for v in vs]
        summary = {
            "spearman": [
                ("spearman", float(np.mean([np.mean(v) for v in per_model.values()]))),
                ("spearman_max", float(np.max(layers))),
                ("spearman_over_0.7", float(np.mean(np.array(layers) > 0.7))),
            ]
        }
        for label, value in summary.get(name, [(name, float(np.mean([np.mean(v) for v in per_model.values()])))]):
            rows.append(
                {
                    "subject": subject,
                    "fn": fn,
                    "statistic": label,
                    "value": none_if_nan(value),
                    "n_models": len(per_model),
                    "n_layers": max(len(v) for v in per_model.values()),
                }
            )
    return pa.Table.from_pylist(rows, schema=PAPER_VALUES_SCHEMA)


_STRATUM_COLUMNS = (
    "rel_err",
    "rel_err_state",
    "cos_full_tok",
    "angle_res_tok",
    "proj_full",
    "proj_res",
    "proj_full_global",
    "proj_res_global",
    "kl",
    "kl_random",
    "kl_other",
)


def _strata(con: duckdb.DuckDBPyConnection) -> list[Stratum]:
    """Per (model, layer, class) of a well-posed layer (`claims.well_posed`, the one rule: a layer that is not is
    left out here, so out of every claim): the real anchors' columns, each null sample's values at the same
    anchors (`<sample>.<column>`), the null patches' KLs (`kl_directions` (anchors, directions)), and the rel_err
    of the class fitted once for the layer (`layer.rel_err`, from the `<class>.layer` rows); and per (model,
    layer) and trade-off pair of a local class that is not linear with one that is (`<mlp> vs <linear>`), the
    linear class's rel_err and kl with the other's (`nonlinear.*`) at the same anchors."""
    table = con.sql(f"""
        SELECT model, layer, fn, sample, seq_id, pos, n_distinct, k, {", ".join(_STRATUM_COLUMNS)}, kl_directions
        FROM anchors ORDER BY model, layer, fn, sample, seq_id, pos
    """).to_arrow_table()
    keys = list(zip(*(table[name].to_pylist() for name in ("model", "layer", "fn", "sample")), strict=True))
    anchor = table["seq_id"].to_numpy().astype(np.int64) * 2**32 + table["pos"].to_numpy()
    floats = {c: _floats(table[c]) for c in _STRATUM_COLUMNS}
    directions = _directions(table["kl_directions"])
    groups: dict[tuple[str, int, str, str], dict[str, np.ndarray]] = {}
    for key, (start, stop) in _runs(keys).items():
        groups[key] = {
            "anchor": anchor[start:stop],
            "kl_directions": directions[start:stop],
            **{c: v[start:stop] for c, v in floats.items()},
        }
    posed = _well_posed_layers(table)
    strata = []
    for (model, layer, fn, sample), real in groups.items():
        if sample != "real" or not posed.get((model, layer), False):
            continue
        cols = {c: v for c, v in real.items() if c != "anchor"}
        for other, values in ((s, groups.get((model, layer, fn, s))) for s in ("shuffled", "gaussian")):
            if values is not None:
                cols |= {
                    f"{other}.{c}": _aligned(real["anchor"], values["anchor"], values[c]) for c in _STRATUM_COLUMNS
                }
        layer_wide = groups.get((model, layer, fn + LAYER_FIT, "real"))
        if layer_wide is not None:
            cols["layer.rel_err"] = _aligned(real["anchor"], layer_wide["anchor"], layer_wide["rel_err"])
        strata.append(Stratum(model, subject_of(model), int(layer), fn, cols))
    return strata + _tradeoff_pairs(groups, posed)


def _tradeoff_pairs(
    groups: dict[tuple[str, int, str, str], dict[str, np.ndarray]], posed: dict[tuple[str, int], bool]
) -> list[Stratum]:
    """Per (model, layer), a stratum for each local tokenwise class that is not linear against each that is."""
    local = [c for c in FIT_CLASSES if c.local and c.tokenwise]
    pairs = []
    for (model, layer, fn, sample), real in groups.items():
        if sample != "real" or not posed.get((model, layer), False) or fn not in FIT_CLASSES:
            continue
        if FIT_CLASSES[fn] in local and not FIT_CLASSES[fn].linear:
            for linear in (c.name for c in local if c.linear):
                if (other := groups.get((model, layer, linear, "real"))) is not None:
                    cols = {
                        "rel_err": other["rel_err"],
                        "kl": other["kl"],
                        **{
                            f"nonlinear.{c}": _aligned(other["anchor"], real["anchor"], real[c])
                            for c in ("rel_err", "kl")
                        },
                    }
                    pairs.append(Stratum(model, subject_of(model), int(layer), f"{fn}{VERSUS}{linear}", cols))
    return pairs


def _well_posed_layers(table: pa.Table) -> dict[tuple[str, int], bool]:
    """Per (model, layer): whether its real pool is well posed (`claims.well_posed`)."""
    real = table.filter(pa.compute.equal(table["sample"], "real"))
    facts: dict[tuple[str, int], tuple[int, int]] = {}
    for model, layer, distinct, k in zip(
        *(real[c].to_pylist() for c in ("model", "layer", "n_distinct", "k")), strict=True
    ):
        seen = facts.get((model, layer), (0, 0))
        facts[(model, layer)] = (max(seen[0], distinct or 0), max(seen[1], k or 0))
    return {key: well_posed(distinct, k) for key, (distinct, k) in facts.items()}


def _directions(column: pa.ChunkedArray) -> np.ndarray:
    """The per-direction KLs (rows, directions), NaN on rows without them."""
    values = column.combine_chunks()
    valid = values.is_valid().to_numpy(zero_copy_only=False)
    lengths = pa.compute.list_value_length(values).to_numpy(zero_copy_only=False)
    width = int(lengths[valid].max()) if valid.any() else 0
    if valid.any() and (lengths[valid] != width).any():
        raise ValueError("kl_directions: rows of one table with different counts of directions")
    out = np.full((len(values), width), np.nan)
    out[valid] = _floats(values.flatten()).reshape(-1, width) if width else out[valid]
    return out


def _runs(keys: list[tuple[Any, ...]]) -> dict[tuple[Any, ...], tuple[int, int]]:
    """Start and stop of each run of equal keys in a sorted list."""
    bounds: dict[tuple[Any, ...], tuple[int, int]] = {}
    for i, key in enumerate(keys):
        start = bounds.get(key, (i, i))[0]
        bounds[key] = (start, i + 1)
    return bounds


def _floats(values: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """An Arrow column as float64, null → NaN."""
    return values.to_numpy(zero_copy_only=False).astype(np.float64)


def _aligned(anchors: np.ndarray, other: np.ndarray, values: np.ndarray) -> np.ndarray:
    """`values` (keyed by the sorted `other` anchors) at `anchors`; NaN where an anchor is missing."""
    where = np.searchsorted(other, anchors).clip(0, max(len(other) - 1, 0))
    found = len(other) > 0 and other[where] == anchors
    return np.where(found, values[where] if len(other) else np.nan, np.nan)
