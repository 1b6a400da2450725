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

from pipeline.core.store import ManifestKey, ShardWriter
from pipeline.results.aggregate import build_tables, load_sources
from pipeline.results.config import ReportConfig
from pipeline.results.study_a.claims import INCONCLUSIVE, NOT_SUPPORTED, SUPPORTED, summarise, verdict
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


def write_study(root: Path, model: str, shuffled: bool, by_direction: bool, seed: int) -> None:
    for layer in (0, 1):  # two independent planted layers: a stratified statistic over layers
        rng = np.random.default_rng([seed, layer])
        x, y, seq = planted_layer(rng, shuffled)
        pos = np.tile(np.arange(SEQ_LEN), N_SEQ)
        anchors = choose_anchors(len(x), FIT.anchors, seed)
        tables, _ = fit_layer(x, y, seq, pos, seq, anchors, FIT.classes, FIT, samples=("real", *FIT.nulls))
        for fn, table in tables.items():
            where = {"model": model, "layer": layer, "fn": fn}
            with ShardWriter(root / "fits", f"{model}/{layer}/{fn}", KEY) as writer:
                writer.write(where, table)
            real = table.filter(pa.compute.equal(table["sample"], "real"))
            clean = y[anchors]
            patches = null_patches(real["patched"], clean, np.random.default_rng([seed, layer]))
            kl = {name: np.full(len(real), np.nan) for name in ("kl", "kl_random", "kl_other")}
            for name, vectors in (("kl", patches.real), ("kl_random", patches.random), ("kl_other", patches.other)):
                kl[name][patches.valid] = readout_kl(clean[patches.valid] - vectors, by_direction)
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
    return verdicts(root)


@pytest.mark.parametrize("fn", ["diag_psd", "lowrank"])
@pytest.mark.parametrize("claim", ["cos_full_tok_near_1", "proj_res_below_full", "proj_res_global_below_full"])
def test_planted_geometry_is_supported_and_shuffled_pairs_are_not(planted, fn, claim):
    """Against shuffled pairs; the Gaussian null keeps the pool's second moments, which hold all of this
    planted layer's (linear) structure, so only the shuffled pairs are sure to tell it apart."""
    assert planted[("planted", fn, claim, "shuffled")] == SUPPORTED
    for null in ("shuffled", "gaussian"):
        assert planted[("shuffled", fn, claim, null)] == NOT_SUPPORTED


@pytest.mark.parametrize("fn", ["diag_psd", "lowrank"])
def test_the_residual_angle_of_an_independent_cross_token_term_is_what_the_nulls_give(planted, fn):
    """A planted cross-token term independent of the token is at ~90° to the tokenwise part, and so is the
    residual of shuffled pairs: the angle claim cannot be told from the null even where the structure is real."""
    for model in ("planted", "shuffled"):
        assert planted[(model, fn, "angle_res_tok_large", "shuffled")] != SUPPORTED


@pytest.mark.parametrize("fn", ["diag_psd", "lowrank"])
@pytest.mark.parametrize("claim", ["spearman_rel_err_kl", "residual_outweighs_null"])
def test_a_readout_of_the_residuals_direction_is_supported_and_one_of_its_norm_is_not(planted, fn, claim):
    """Against a random direction. Another anchor's residual is itself a planted cross-token residual, read
    out alike, so that null rightly cannot separate them; on a norm-only readout neither null can."""
    assert planted[("planted", fn, claim, "random")] == SUPPORTED
    assert planted[("planted", "diag_psd", "residual_outweighs_null", "other")] == NOT_SUPPORTED
    for null in ("random", "other"):
        assert planted[("shuffled", fn, claim, null)] == NOT_SUPPORTED


def test_locality_against_a_global_map_out_of_sample(planted):
    """The planted map is linear: one global affine map (left out at each anchor) does as well as the local
    fits, so locality is not supported; it is a claim the data can refuse."""
    assert planted[("planted", "diag_psd", "local_beats_global", "zero")] != SUPPORTED


def test_verdict_rule():
    assert verdict(0.2, 0.01, 0.4, 0.1) == SUPPORTED
    assert verdict(0.02, 0.01, 0.04, 0.1) == NOT_SUPPORTED  # beyond chance, but smaller than the margin
    assert verdict(0.0, -0.05, 0.05, 0.1) == NOT_SUPPORTED
    assert verdict(0.1, -0.05, 0.3, 0.1) == "inconclusive"
    assert verdict(0.05, 0.01, 0.3, 0.1) == "inconclusive"
    assert verdict(0.1, float("nan"), 0.3, 0.1) == "inconclusive"


def test_the_headline_of_a_claim_is_its_weakest_test():
    """A class passes only against every null; the subject's verdict agrees over classes or says `mixed`;
    the test shown is the one with the weakest verdict, then the lowest interval."""

    def row(fn: str, null: str, v: str, low: float, scope: str = "stratified") -> dict:
        return {"subject": "neox@final", "claim": "angle_res_tok_large", "fn": fn, "null": null, "scope": scope,
                "verdict": v, "ci_low": low, "effect": low + 1}  # fmt: skip

    tests = [row("lowrank", "shuffled", SUPPORTED, 3.0), row("lowrank", "gaussian", SUPPORTED, 2.0),
             row("orthogonal", "shuffled", SUPPORTED, 1.0), row("orthogonal", "gaussian", INCONCLUSIVE, 4.0),
             row("lowrank", "shuffled", NOT_SUPPORTED, -9.0, scope="layer")]  # fmt: skip
    (s,) = summarise(tests)
    assert s.verdicts == {"lowrank": SUPPORTED, "orthogonal": INCONCLUSIVE}
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


def test_null_patches_have_the_residuals_norm():
    rng = np.random.default_rng(5)
    clean = rng.normal(size=(6, 4))
    patched = clean - rng.normal(size=(6, 4))
    column = pa.FixedSizeListArray.from_arrays(
        pa.array(patched.astype(np.float32).ravel()), 4, mask=pa.array([False] * 5 + [True])
    )
    patches = null_patches(column, clean, rng)
    assert patches.valid.tolist() == [True] * 5 + [False]
    size = np.linalg.norm(clean[:5] - patches.real, axis=1)
    for vectors in (patches.random, patches.other):
        np.testing.assert_allclose(np.linalg.norm(clean[:5] - vectors, axis=1), size, rtol=1e-5)
        assert not np.allclose(vectors, patches.real)
