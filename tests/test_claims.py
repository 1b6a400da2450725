"""Study A's claims against their nulls, on data with a known answer (SPEC §4.5).

A planted layer: `y = T*(x) + c`, `T*` tokenwise (diagonal) and `c` a cross-token term (a mix of the other
tokens of the sequence) in directions the tokenwise map does not use. Its fits, on the real pairs and on the
null samples, go through the real fit code and into the result tables through `aggregate`, like a study's.
The functional claim gets a toy readout whose KL is known: it reads the residual along the planted
cross-token directions, so the real residual moves the output more than a random one of the same norm; on a
readout that sees only the residual's norm, no null can be told apart.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from pipeline.core.contracts import vectors_to_arrow
from pipeline.core.store import ManifestKey, ShardWriter
from pipeline.results.aggregate import build_tables, load_sources
from pipeline.results.config import ReportConfig
from pipeline.results.study_a import claims
from pipeline.results.study_a.claims import (
    CONTRADICTED,
    INCONCLUSIVE,
    NOT_SUPPORTED,
    SUPPORTED,
    Stratum,
    claim_tests,
    seed_level_replicates,
    summarise,
    verdict,
)
from pipeline.study_a.config import AnalysisConfig
from pipeline.study_a.fits import choose_anchors, fit_layer
from pipeline.study_a.nulls import derangement, null_patches

KEY = ManifestKey(inputs={}, params_hash="test", code_version="test")
CFG = ReportConfig(bootstrap=300, ci=0.95, seed=0)
D, TOKENWISE_DIMS = 8, 4  # the tokenwise map scales the first 4 coordinates; the cross-token term is on the last
N_SEQ, SEQ_LEN = 150, 20
FIT = AnalysisConfig(k=40, anchors=300, rank=2, p=2, ridge=1e-6, classes=["diag_psd", "lowrank", "global_linear"],
                     nulls=["shuffled", "gaussian"])  # fmt: skip


def planted_layer(rng: np.random.Generator, shuffled: bool) -> tuple[np.ndarray, ...]:
    n = N_SEQ * SEQ_LEN
    seq = np.repeat(np.arange(N_SEQ), SEQ_LEN)
    x = rng.normal(size=(n, D))
    gain = np.zeros(D)
    gain[:TOKENWISE_DIMS] = rng.uniform(2.0, 3.0, TOKENWISE_DIMS)
    context = np.array([x[seq == s].mean(axis=0) for s in range(N_SEQ)])[seq]
    cross = np.zeros((n, D))
    cross[:, -1] = 2.0 * context[:, -1] * np.sqrt(SEQ_LEN) * rng.uniform(0.2, 2.0, n)
    y = x + x * gain + cross
    if shuffled:
        y = y[rng.permutation(n)]
    return x.astype(np.float32), y.astype(np.float32), seq


def readout_kl(residuals: np.ndarray, by_direction: bool) -> np.ndarray:
    """The toy model's KL for a removed residual: its square along the cross-token direction (plus a little
    of its norm), or its norm alone."""
    if by_direction:
        return residuals[:, -1] ** 2 + 1e-3 * (residuals**2).sum(axis=1)
    return (residuals**2).sum(axis=1)


def local_layer(rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """A planted locality: a diagonal map whose gains vary along the manifold (with the first coordinate),
    which a diagonal map fitted per neighbourhood follows and one fitted for the whole layer cannot."""
    n = N_SEQ * SEQ_LEN
    x = rng.normal(size=(n, D))
    y = x + x * (1.0 + 2.0 * np.tanh(3.0 * x[:, :1])) + 0.05 * rng.normal(size=(n, D))
    return x.astype(np.float32), y.astype(np.float32), np.repeat(np.arange(N_SEQ), SEQ_LEN)


def layer_wide_rel_err(x: np.ndarray, y: np.ndarray, anchors: np.ndarray) -> np.ndarray:
    """`diag_psd` fitted once on the layer's pairs (least squares per coordinate, clipped at 0), at the anchors."""
    x, y = x.astype(np.float64), y.astype(np.float64)
    gain = np.maximum((x * y).sum(axis=0) / (x * x).sum(axis=0), 0.0)
    return np.linalg.norm(y[anchors] - gain * x[anchors], axis=1) / np.linalg.norm(y[anchors] - x[anchors], axis=1)


def write_study(root: Path, model: str, shuffled: bool, by_direction: bool, seed: int, local: bool = False) -> None:
    for layer in (0, 1):  # two independent planted layers: a stratified statistic over layers
        rng = np.random.default_rng([seed, layer])
        x, y, seq = local_layer(rng) if local else planted_layer(rng, shuffled)
        pos = np.tile(np.arange(SEQ_LEN), N_SEQ)
        anchors = choose_anchors(len(x), FIT.anchors, seed)
        tables, _ = fit_layer(x, y, seq, pos, seq, anchors, FIT.classes, FIT, samples=("real", *FIT.nulls))
        real_diag = tables["diag_psd"].filter(pa.compute.equal(tables["diag_psd"]["sample"], "real"))
        rel_err = pa.array(layer_wide_rel_err(x, y, anchors))  # the fits' rows: anchor order
        tables["diag_psd.layer"] = real_diag.set_column(real_diag.schema.get_field_index("rel_err"), "rel_err", rel_err)
        for fn, table in tables.items():
            where = {"model": model, "layer": layer, "fn": fn}
            with ShardWriter(root / "fits", f"{model}/{layer}/{fn}", KEY) as writer:
                writer.write(where, table)
            real = table.filter(pa.compute.equal(table["sample"], "real"))
            clean = y[anchors]
            patches = null_patches(real["patched"], clean, np.random.default_rng([seed, layer]), 8)
            kl = {name: np.full(len(real), np.nan) for name in ("kl", "kl_random", "kl_other")}
            for name, vectors in (("kl", patches.real), ("kl_other", patches.other)):
                kl[name][patches.valid] = readout_kl(clean[patches.valid] - vectors, by_direction)
            removed = clean[patches.valid][:, None] - patches.random  # (anchors, directions, d)
            kl["kl_random"][patches.valid] = np.mean([readout_kl(r, by_direction) for r in removed], axis=1)
            with ShardWriter(root / "perturb", f"{model}/{layer}/{fn}", KEY) as writer:
                writer.write(where, pa.table({"seq_id": real["seq_id"], "pos": real["pos"], "kl_seq": kl["kl"], **kl}))


def verdicts(root: Path) -> dict[tuple[str, str, str, str], str]:
    sources = load_sources(root / "train", root / "fits", root / "perturb", root / "models")
    tests = build_tables(sources, CFG)["claim_tests"].to_pylist()
    return {(t["subject"], t["fn"], t["claim"], t["null"]): t["verdict"] for t in tests if t["scope"] == "stratified"}


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str, str, str], str]:
    root = tmp_path_factory.mktemp("planted")
    write_study(root, "planted", shuffled=False, by_direction=True, seed=1)
    write_study(root, "shuffled", shuffled=True, by_direction=False, seed=2)
    write_study(root, "local", shuffled=False, by_direction=True, seed=3, local=True)
    return verdicts(root)


@pytest.mark.parametrize("fn", ["diag_psd", "lowrank"])
@pytest.mark.parametrize("claim", ["cos_full_tok_near_1", "proj_res_below_full", "proj_res_global_below_full"])
def test_planted_geometry_is_supported_and_shuffled_pairs_are_not(planted, fn, claim):
    """Against shuffled pairs; the Gaussian null keeps the pool's second moments, which hold all of this
    planted layer's (linear) structure, so only the shuffled pairs are sure to tell it apart."""
    assert planted[("planted", fn, claim, "shuffled")] == SUPPORTED
    for null in ("shuffled", "gaussian"):
        assert planted[("shuffled", fn, claim, null)] not in (SUPPORTED, NOT_SUPPORTED)


@pytest.mark.parametrize("fn", ["diag_psd", "lowrank"])
def test_a_planted_orthogonal_residual_is_supported_and_shuffled_pairs_are_not(planted, fn):
    """The planted cross-token term lies on a coordinate the tokenwise map leaves alone: the residual is at
    90° to Δ_tok, while shuffled pairs leave a residual at a spread of angles. The claim is |90° − angle|
    against the null's, so a residual at 90° passes, and one that is as spread as the null's cannot."""
    assert planted[("planted", fn, "angle_res_tok_near_90", "shuffled")] == SUPPORTED
    for null in ("shuffled", "gaussian"):
        assert planted[("shuffled", fn, "angle_res_tok_near_90", null)] != SUPPORTED


@pytest.mark.parametrize("fn", ["diag_psd", "lowrank"])
@pytest.mark.parametrize("claim", ["spearman_rel_err_kl", "residual_outweighs_null"])
def test_a_readout_of_the_residuals_direction_is_supported_and_one_of_its_norm_is_not(planted, fn, claim):
    """Against a random direction, the real residual moves the output more. Its rank correlation with
    rel_err is no higher than the null's: the residual is planted along the read direction, so its KL is its
    squared norm, and the null's (the mean over 8 directions) is a fixed share of the same squared norm.
    Another anchor's residual is itself a planted cross-token residual, read out alike, so that null rightly
    cannot separate them; on a norm-only readout neither null can."""
    expected = SUPPORTED if claim == "residual_outweighs_null" else (NOT_SUPPORTED, INCONCLUSIVE, CONTRADICTED)
    assert planted[("planted", fn, claim, "random")] in expected
    assert planted[("planted", "diag_psd", "residual_outweighs_null", "other")] != SUPPORTED
    for null in ("random", "other"):
        assert planted[("shuffled", fn, claim, null)] != SUPPORTED


def test_locality_is_each_class_against_itself_fitted_for_the_layer(planted):
    """A diagonal map whose gains vary along the manifold: the local diagonal fits beat the same class fitted
    once for the layer. The planted linear layer has one diagonal map everywhere: locality is not supported."""
    assert planted[("local", "diag_psd", "local_beats_layer", "zero")] == SUPPORTED
    assert planted[("planted", "diag_psd", "local_beats_layer", "zero")] != SUPPORTED


def test_verdict_rule():
    alpha, no, yes = 0.025, 0.5, 0.001
    assert verdict(0.2, 0.4, 0.1, yes, no, alpha) == SUPPORTED
    assert verdict(0.02, 0.04, 0.1, yes, no, alpha) == NOT_SUPPORTED  # beyond chance, but smaller than the margin
    assert verdict(-0.2, -0.1, 0.1, no, yes, alpha) == CONTRADICTED  # on the wrong side of 0
    assert verdict(0.0, 0.05, 0.1, no, no, alpha) == INCONCLUSIVE  # around 0: neither side beyond chance
    assert verdict(0.1, 0.3, 0.1, no, no, alpha) == INCONCLUSIVE
    assert verdict(0.05, 0.3, 0.1, yes, no, alpha) == INCONCLUSIVE  # above 0, the margin still inside
    assert verdict(0.2, 0.4, 0.1, 0.03, no, alpha) == INCONCLUSIVE  # not beyond chance after adjustment
    assert verdict(0.1, float("nan"), 0.1, yes, no, alpha) == INCONCLUSIVE


def _strata(offsets: np.ndarray, rng: np.random.Generator, fn: str = "diag_psd", centre: float = 0.2) -> list[Stratum]:
    """One model per seed, its anchors' proj_full − proj_res around `centre` + the seed's offset; the null
    samples' around 0."""
    strata = []
    for i, offset in enumerate(offsets):
        for layer in (0, 1):
            n = 60
            columns = {"proj_full": 0.5 + centre + offset + 0.05 * rng.normal(size=n), "proj_res": np.full(n, 0.5)}
            for null in ("shuffled", "gaussian"):
                columns |= {f"{null}.proj_full": 0.5 + 0.05 * rng.normal(size=n), f"{null}.proj_res": np.full(n, 0.5)}
            strata.append(Stratum(f"gpt2-muon-s{i}@final", "gpt2@final", layer, fn, columns))
    return strata


def _interval(strata: list[Stratum]) -> dict[str, object]:
    tests = claim_tests(strata, {}, n_boot=400, ci=0.95, seed=0).to_pylist()
    (row,) = [t for t in tests if t["claim"] == "proj_res_below_full" and t["null"] == "shuffled"
              and t["scope"] == "stratified"]  # fmt: skip
    return row


def test_seed_level_variation_widens_the_interval():
    """The same anchor noise, with and without a per-seed offset of SD 0.1: the two-stage bootstrap's
    interval widens with the seeds' spread (an anchors-only bootstrap would not see it), and covers the
    seeds' mean."""
    rng = np.random.default_rng(0)
    offsets = rng.normal(0, 0.1, 5)
    same = _interval(_strata(np.zeros(5), np.random.default_rng(1)))
    spread = _interval(_strata(offsets, np.random.default_rng(1)))
    assert same["n_models"] == spread["n_models"] == 5
    width = lambda r: r["ci_high"] - r["ci_low"]  # noqa: E731
    assert width(spread) > 3 * width(same)
    assert spread["ci_low"] < 0.2 + offsets.mean() < spread["ci_high"]


def test_the_seed_level_bootstrap_draws_seeds_then_anchors():
    """Two models whose anchor replicates are constant (no anchor noise): the replicates are means of drawn
    models, so only 0, ½ and 1 occur, in the binomial shares ¼, ½, ¼."""
    boot = seed_level_replicates([np.zeros(4000), np.ones(4000)], np.random.default_rng(0))
    values, counts = np.unique(boot, return_counts=True)
    assert values.tolist() == [0.0, 0.5, 1.0]
    np.testing.assert_allclose(counts / counts.sum(), [0.25, 0.5, 0.25], atol=0.03)


def test_holm_adjusts_over_the_classes_and_nulls_of_a_summary_cell(monkeypatch):
    """Two classes × two nulls of one subject and claim: the stored p-values are Holm's adjustment (by hand
    here) of the raw bootstrap p-values (the same run with the adjustment switched off); the baseline
    `global_linear` is outside the family."""
    rng = np.random.default_rng(2)
    strata = [s for fn in ("diag_psd", "lowrank", "global_linear") for s in _strata(np.zeros(2), rng, fn, 0.01)]

    def cell() -> list[dict]:
        tests = claim_tests(strata, {}, n_boot=200, ci=0.95, seed=0).to_pylist()
        return [t for t in tests if t["claim"] == "proj_res_below_full" and t["scope"] == "stratified"]

    adjusted = cell()
    monkeypatch.setattr(claims, "holm", lambda p: list(p))
    raw = cell()
    assert [t["fn"] for t in raw] == [t["fn"] for t in adjusted] and len(raw) == 6
    family = [i for i, t in enumerate(raw) if t["fn"] != "global_linear"]
    p = np.array([raw[i]["p_above"] for i in family])
    assert len(set(p)) > 2  # distinct p-values: the step-down order matters
    order = np.argsort(p, kind="stable")
    by_hand = np.empty(len(p))
    by_hand[order] = np.maximum.accumulate([min(1.0, (len(p) - k) * p[i]) for k, i in enumerate(order)])
    np.testing.assert_allclose([adjusted[i]["p_above"] for i in family], by_hand)
    baseline = [i for i, t in enumerate(raw) if t["fn"] == "global_linear"]
    assert [adjusted[i]["p_above"] for i in baseline] == [raw[i]["p_above"] for i in baseline]


def test_the_headline_of_a_claim_is_its_weakest_test():
    """A class passes only against every null; the subject's verdict agrees over classes or says `mixed`;
    the test shown is the one with the weakest verdict, then the lowest interval; `global_linear` is a
    baseline, outside the count."""

    def row(fn: str, null: str, v: str, low: float, scope: str = "stratified", layers: int = 4) -> dict:
        return {"subject": "neox@final", "claim": "angle_res_tok_near_90", "fn": fn, "null": null, "scope": scope,
                "verdict": v, "ci_low": low, "effect": low + 1, "n_layers": layers}  # fmt: skip

    tests = [row("lowrank", "shuffled", SUPPORTED, 3.0), row("lowrank", "gaussian", SUPPORTED, 2.0),
             row("orthogonal", "shuffled", SUPPORTED, 1.0), row("orthogonal", "gaussian", INCONCLUSIVE, 4.0, layers=1),
             row("lowrank", "shuffled", NOT_SUPPORTED, -9.0, scope="layer"),
             row("global_linear", "shuffled", CONTRADICTED, -9.0)]  # fmt: skip
    (s,) = summarise(tests)
    assert s.verdicts == {"lowrank": SUPPORTED, "orthogonal": INCONCLUSIVE}
    assert s.layers == {"lowrank": 4, "orthogonal": 1}  # what each class's verdict rests on: its fewest layers
    assert s.verdict == "mixed: 1 supported, 1 inconclusive" and s.score == 0.5
    assert (s.weakest["fn"], s.weakest["null"]) == ("orthogonal", "gaussian")
    (s,) = summarise(tests[:3])
    assert s.verdict == SUPPORTED and s.score == 1.0
    assert (s.weakest["fn"], s.weakest["null"]) == ("orthogonal", "shuffled")


def test_derangement_moves_every_anchor():
    rng = np.random.default_rng(0)
    for n in (2, 3, 17):
        partner = derangement(n, rng)
        assert sorted(partner) == list(range(n)) and (partner != np.arange(n)).all()


def test_null_patches_have_the_residuals_norm_and_the_stated_count_of_directions():
    rng = np.random.default_rng(5)
    clean = rng.normal(size=(6, 4))
    patched = clean - rng.normal(size=(6, 4))
    column = vectors_to_arrow(patched, null=np.array([False] * 5 + [True]))
    patches = null_patches(column, clean, rng, directions=9)
    assert patches.valid.tolist() == [True] * 5 + [False]
    assert patches.random.shape == (5, 9, 4) and patches.other.shape == (5, 4)
    size = np.linalg.norm(clean[:5] - patches.real, axis=1)
    np.testing.assert_allclose(np.linalg.norm(clean[:5, None] - patches.random, axis=2), size[:, None].repeat(9, 1),
                               rtol=1e-5)  # fmt: skip
    np.testing.assert_allclose(np.linalg.norm(clean[:5] - patches.other, axis=1), size, rtol=1e-5)
    directions = (clean[:5, None] - patches.random) / size[:, None, None]
    assert len(np.unique(directions.round(4).reshape(-1, 4), axis=0)) == 45  # every direction its own
    assert not np.allclose(patches.other, patches.real)


def test_the_other_anchor_null_needs_two_anchors():
    rng = np.random.default_rng(6)
    clean = rng.normal(size=(3, 4))
    column = vectors_to_arrow(clean - 1, null=np.array([False, True, True]))
    patches = null_patches(column, clean, rng, directions=8)
    assert patches.valid.sum() == 1 and patches.other is None and patches.random.shape == (1, 8, 4)


# ------------------------------------------------------------------------- the expressivity trade-off
def _across(order: list[float], spread: list[float], rng: np.random.Generator, seeds: int = 3) -> list[Stratum]:
    """Per seed and layer, an `ACROSS` stratum of classes c0..c{C−1} (capacities 10, 20, …): class i's
    rel_err around `order[i]`, and its kl that rel_err plus noise of SD `spread[i]` (the more noise, the
    weaker Spearman(rel_err, kl))."""
    strata = []
    for seed in range(seeds):
        for layer in (0, 1):
            n, base = 80, rng.uniform(0, 0.2, 80)  # anchors: their difficulty, shared by the classes
            columns = {}
            for i, (centre, sd) in enumerate(zip(order, spread, strict=True)):
                rel_err = centre + base + 0.01 * rng.normal(size=n)
                columns |= {f"c{i}.rel_err": rel_err, f"c{i}.kl": rel_err + sd * rng.normal(size=n)}
            strata.append(Stratum(f"gpt2-muon-s{seed}@final", "gpt2@final", layer, claims.ACROSS, columns))
    return strata


def _tradeoff(strata: list[Stratum], classes: int) -> dict[str, dict]:
    capacity = {f"c{i}": 10 * (i + 1) for i in range(classes)}
    capacities = {s.model: capacity for s in strata}
    tests = claim_tests(strata, capacities, n_boot=300, ci=0.95, seed=0).to_pylist()
    return {t["null"]: t for t in tests if t["claim"] == "expressivity_tradeoff" and t["scope"] == "stratified"}


def test_a_planted_tradeoff_is_supported_and_classes_unordered_by_capacity_are_not():
    """Planted: rel_err falls and the kl's noise grows with capacity, so both parts fall with it →
    supported. The same classes in reverse → contradicted. Classes alike → neither. Three classes perfectly
    ordered: one order in 6 arises by chance under a permuted capacity order, so never supported."""
    rng = np.random.default_rng(0)
    falling, noisier = [0.9, 0.7, 0.5, 0.3, 0.1], [0.01, 0.05, 0.1, 0.2, 0.4]
    planted = _tradeoff(_across(falling, noisier, rng), 5)
    assert {part: t["verdict"] for part, t in planted.items()} == {"rel_err": SUPPORTED, "spearman": SUPPORTED}
    assert all(t["statistic"] > 0.9 and t["n_models"] == 3 and t["n_layers"] == 2
               for t in planted.values())  # fmt: skip
    reverse = _tradeoff(_across(falling[::-1], noisier[::-1], rng), 5)
    assert {t["verdict"] for t in reverse.values()} == {CONTRADICTED}
    alike = _tradeoff(_across([0.5] * 5, [0.1] * 5, rng), 5)
    assert all(t["verdict"] in (INCONCLUSIVE, NOT_SUPPORTED) for t in alike.values())
    three = _tradeoff(_across(falling[:3], noisier[:3], rng), 3)
    assert all(t["statistic"] == pytest.approx(1.0) and t["verdict"] != SUPPORTED for t in three.values())
    (summary,) = summarise([t for t in planted.values()])
    assert summary.verdict == SUPPORTED


def test_the_permutation_null_counts_the_orders_at_least_as_falling():
    """Four classes whose values fall with capacity but for one swapped pair: −ρ = 0.8, reached or beaten by
    the identity and the three orders one adjacent swap from a perfect fall (4 of 24); every order but the
    perfect fall reaches at most it (23 of 24)."""
    cell = claims.ClassValues("m", "m", 0, {f"c{i}": i for i in range(4)},
                              {"rel_err": {"c0": 4.0, "c1": 2.0, "c2": 3.0, "c3": 1.0}}, {}, 10)  # fmt: skip
    assert float(claims.falls_with_capacity(cell.capacity, cell.point["rel_err"])) == pytest.approx(0.8)
    above, below = claims.permutation_p([cell], "rel_err")
    assert (above, below) == (pytest.approx(4 / 24), pytest.approx(23 / 24))
