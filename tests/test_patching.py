"""Patching one token's block output and the KL it causes, against direct forwards (SPEC §4.3)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import SEQ_LEN, VOCAB, tiny_size
from scipy.special import log_softmax
from transformers import DynamicCache

from lmgeo.core.contracts import vectors_to_arrow
from lmgeo.models.hooks import block_output
from lmgeo.models.registry import blocks_of, build_model, head_of
from lmgeo.study_a import patching
from lmgeo.study_a.extract import capture_states
from lmgeo.study_a.patching import patch_kl_anchors, suffix_path

TINY = tiny_size()
N_SEQ = 3


@pytest.fixture(scope="module")
def model(arch):
    """A random model whose head is scaled up: at init the next-token distributions are nearly uniform,
    which would leave every KL near rounding level; a trained model's are peaked like these."""
    model = build_model(arch, TINY, VOCAB, SEQ_LEN, seed=2).eval()
    with torch.no_grad():
        head_of(model).weight.mul_(30.0)
    return model


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(1).integers(0, VOCAB, size=(N_SEQ, SEQ_LEN), dtype=np.int32)


@pytest.fixture(scope="module")
def states(model, tokens):
    """h_0 … h_L as numpy, (n_seq, seq_len, d) each."""
    return [h.numpy() for h in capture_states(model, torch.as_tensor(tokens, dtype=torch.long))]


def _anchors(rng, n):
    return rng.integers(0, N_SEQ, n), rng.integers(0, SEQ_LEN, n)


def _direct_kl(model, sequence, layer, pos, vector):
    """Two plain forwards, one with a single hand-written patch; KL in float64 with SciPy."""

    def patch(_m, _a, output):
        hidden = block_output(output).clone()
        hidden[0, pos] = torch.as_tensor(vector)
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    ids = torch.as_tensor(sequence[None], dtype=torch.long)
    with torch.no_grad():
        clean = model(input_ids=ids, use_cache=False).logits[0].double().numpy()
        handle = blocks_of(model)[layer].register_forward_hook(patch)
        try:
            patched = model(input_ids=ids, use_cache=False).logits[0].double().numpy()
        finally:
            handle.remove()
    lp, lq = log_softmax(clean, axis=-1), log_softmax(patched, axis=-1)
    per_position = (np.exp(lp) * (lp - lq)).sum(-1)
    return per_position[pos], per_position[pos:].mean()


@pytest.mark.slow
@pytest.mark.parametrize("layer", range(TINY.n_layers))
def test_patching_the_true_output_changes_nothing(model, tokens, states, layer):
    rows, positions = np.repeat(np.arange(N_SEQ), SEQ_LEN), np.tile(np.arange(SEQ_LEN), N_SEQ)
    vectors = states[layer + 1][rows, positions]
    kl, kl_seq = patch_kl_anchors(model, tokens, rows, positions, layer, vectors, batch_size=7)
    assert np.all(kl < 1e-6) and np.all(kl_seq < 1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("layer", range(TINY.n_layers))
def test_patch_kl_matches_direct_forwards(model, tokens, states, layer):
    rng = np.random.default_rng(layer)
    rows, positions = _anchors(rng, 6)
    vectors = states[layer + 1][rows, positions] + rng.normal(0, 1.0, (6, TINY.d_model)).astype(np.float32)
    kl, kl_seq = patch_kl_anchors(model, tokens, rows, positions, layer, vectors, batch_size=4)
    assert np.all(kl > 1e-4)
    for i in range(6):
        expected_kl, expected_seq = _direct_kl(model, tokens[rows[i]], layer, positions[i], vectors[i])
        np.testing.assert_allclose(kl[i], expected_kl, rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(kl_seq[i], expected_seq, rtol=1e-4, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["suffix", "recompute", "full"])
def test_a_copy_that_stops_at_its_anchor_has_the_direct_kl(model, tokens, states, mode):
    """A null copy needs only its `kl`: the model is causal, so its forward may stop at its anchor. Mixed in
    one call with copies that run to the end, each gets the direct forwards' KL; only those have a kl_seq."""
    layer, rng = 1, np.random.default_rng(21)
    rows, positions = _anchors(rng, 10)
    vectors = states[layer + 1][rows, positions] + rng.normal(0, 1.0, (10, TINY.d_model)).astype(np.float32)
    to_end = np.arange(10) % 3 == 0
    kl, kl_seq = patch_kl_anchors(
        model, tokens, rows, positions, layer, vectors, batch_size=4, mode=mode, to_end=to_end
    )
    assert np.isnan(kl_seq[~to_end]).all() and np.isfinite(kl_seq[to_end]).all()
    for i in range(10):
        expected_kl, expected_seq = _direct_kl(model, tokens[rows[i]], layer, positions[i], vectors[i])
        np.testing.assert_allclose(kl[i], expected_kl, rtol=1e-4, atol=1e-7)
        if to_end[i]:
            np.testing.assert_allclose(kl_seq[i], expected_seq, rtol=1e-4, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["suffix", "recompute"])
@pytest.mark.parametrize("layer", range(TINY.n_layers))
def test_suffix_patching_equals_the_full_forward(arch, model, tokens, states, layer, mode):
    """A patched copy that recomputes only blocks l+1.. gives the full forward's KLs: on the positions from
    the anchor on from the cached keys and values (the default, where the cache can be cut: not the
    recurrent state of Mamba), or on every position."""
    rng = np.random.default_rng(10 + layer)
    rows, positions = _anchors(rng, 8)
    vectors = states[layer + 1][rows, positions] + rng.normal(0, 1.0, (8, TINY.d_model)).astype(np.float32)
    suffix = patch_kl_anchors(model, tokens, rows, positions, layer, vectors, batch_size=3, mode=mode)
    full = patch_kl_anchors(model, tokens, rows, positions, layer, vectors, batch_size=3, mode="full")
    assert np.all(full[0] > 1e-4)
    for got, want in zip(suffix, full, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-8)
    if mode == "suffix":
        # Mamba's state cannot be cut at the anchor; its copies that stop there take one recurrent step instead
        assert suffix_path(model, layer)[0] == ("stepped" if arch == "mamba" else "cached")


def test_a_cache_that_does_not_reproduce_the_full_forward_is_not_used(tokens):
    """A family whose forward does not attend to the cached positions (here: the cache is dropped) fails
    the probe, and its copies recompute the prefix: the KLs are still the full forward's."""
    model = build_model("neox", TINY, VOCAB, SEQ_LEN, seed=2).eval()
    with torch.no_grad():
        head_of(model).weight.mul_(30.0)
    forward = model.forward

    def without_the_cache(*args, **kwargs):
        if kwargs.get("cache") is not None:
            kwargs["cache"] = DynamicCache()
        return forward(*args, **kwargs)

    model.forward = without_the_cache
    rows, positions = np.array([0, 1, 1]), np.array([5, 9, 14])
    vectors = np.random.default_rng(4).normal(0, 1.0, (3, TINY.d_model)).astype(np.float32)
    suffix = patch_kl_anchors(model, tokens, rows, positions, 0, vectors, batch_size=3)
    path, why = suffix_path(model, 0)
    assert path == "recompute" and "differ" in why
    full = patch_kl_anchors(model, tokens, rows, positions, 0, vectors, batch_size=3, mode="full")
    for got, want in zip(suffix, full, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-8)


@pytest.mark.slow
@pytest.mark.parametrize("forward_cost, shapes", [(0, [(3, SEQ_LEN), (3, 2)]), (10**6, [(6, SEQ_LEN)])])
def test_a_batch_splits_where_a_forward_costs_less_than_the_positions_it_skips(
    arch, model, tokens, states, monkeypatch, forward_cost, shapes
):
    """Each group of a batch runs from its own earliest anchor; the recurrent state (Mamba) runs every
    position of the batch in one forward."""
    monkeypatch.setattr(patching, "FORWARD_COST", forward_cost)
    rows, positions = np.zeros(6, dtype=int), np.array([SEQ_LEN - 2, 0] * 3)
    patch_kl_anchors(model, tokens, rows, positions, 0, states[1][rows, positions], batch_size=6)  # the probe ran
    seen = []
    handle = model.get_input_embeddings().register_forward_hook(lambda m, a, o: seen.append(tuple(o.shape[:2])))
    try:
        patch_kl_anchors(model, tokens, rows, positions, 0, states[1][rows, positions], batch_size=6)
    finally:
        handle.remove()
    assert seen[1:] == ([(6, SEQ_LEN)] if arch == "mamba" else shapes)  # after the clean pass


@pytest.mark.slow
def test_batched_equals_one_at_a_time(model, tokens, states):
    rng = np.random.default_rng(5)
    rows, positions = _anchors(rng, 9)  # unsorted, several per sequence, mixed in batches
    vectors = states[1][rows, positions] + rng.normal(0, 1.0, (9, TINY.d_model)).astype(np.float32)
    one = patch_kl_anchors(model, tokens, rows, positions, 0, vectors, batch_size=1)
    many = patch_kl_anchors(model, tokens, rows, positions, 0, vectors, batch_size=4)
    assert np.all(one[0] > 1e-4)
    np.testing.assert_allclose(one[0], many[0], rtol=1e-4, atol=1e-8)
    np.testing.assert_allclose(one[1], many[1], rtol=1e-4, atol=1e-8)


def test_a_patch_reaches_later_positions_only_through_later_blocks(model, tokens, states):
    """Below the last block, later tokens see the patch (attention or recurrence); at the last block they cannot."""
    pos, rows, positions = 3, np.array([0]), np.array([3])
    tail = SEQ_LEN - pos
    # a random direction: a constant shift would be removed by the LayerNorms' centring
    shift = np.random.default_rng(3).normal(0, 1.0, (1, TINY.d_model)).astype(np.float32)
    first = patch_kl_anchors(model, tokens, rows, positions, 0, states[1][rows, positions] + shift, batch_size=1)
    assert first[1][0] * tail - first[0][0] > 1e-4
    last_layer = TINY.n_layers - 1
    vector = states[last_layer + 1][rows, positions] + shift
    last = patch_kl_anchors(model, tokens, rows, positions, last_layer, vector, batch_size=1)
    assert last[0][0] > 1e-4
    np.testing.assert_allclose(last[1][0] * tail, last[0][0], rtol=1e-5)


def test_rejects_an_out_of_range_layer_or_anchor(model, tokens):
    vectors = np.zeros((1, TINY.d_model), dtype=np.float32)
    with pytest.raises(ValueError, match="layer"):
        patch_kl_anchors(model, tokens, np.array([0]), np.array([0]), TINY.n_layers, vectors, batch_size=1)
    with pytest.raises(ValueError, match="out of range"):
        patch_kl_anchors(model, tokens, np.array([0]), np.array([SEQ_LEN]), 0, vectors, batch_size=1)


def test_each_clean_sequence_runs_once(model, tokens, states):
    """Rows through the embedding = one per patched copy + one per distinct sequence (the clean pass)."""
    rows, positions = np.array([2, 0, 2, 2, 0, 2, 0]), np.array([5, 1, 0, 9, 14, 3, 7])  # none at the last
    patch_kl_anchors(model, tokens, rows, positions, 0, states[1][rows, positions], batch_size=3)  # the probe ran
    seen = []
    handle = model.get_input_embeddings().register_forward_hook(lambda m, a, o: seen.append(o.shape[0]))
    try:
        patch_kl_anchors(model, tokens, rows, positions, 0, states[1][rows, positions], batch_size=3)
    finally:
        handle.remove()
    assert sum(seen) == len(rows) + 2


@pytest.mark.slow
def test_perturb_layer_averages_the_stated_count_of_random_directions(arch, model, tokens, states):
    """`kl_directions` holds the KL of each of `n_random` seeded random directions, `kl_random` their mean (both
    recomputed here one direction at a time with the full forward), `kl_other` needs two patched anchors, and
    an anchor without a patch has null KLs."""
    import pyarrow as pa

    from lmgeo.study_a.nulls import null_patches
    from lmgeo.study_a.perturb import perturb_layer

    layer, d = 1, TINY.d_model
    seq = np.repeat(np.arange(N_SEQ, dtype=np.int32), SEQ_LEN)
    pos = np.tile(np.arange(SEQ_LEN, dtype=np.int32), N_SEQ)
    h_next = states[layer + 1].reshape(-1, d)
    anchors = np.array([3, 20, 41])
    rng = np.random.default_rng(4)
    patched = (h_next[anchors] + rng.normal(0, 1.0, (3, d))).astype(np.float32)
    fits = {
        "diag_psd": pa.table(
            {"sample": ["real"] * 3, "seq_id": seq[anchors], "pos": pos[anchors], "patched": vectors_to_arrow(patched)}
        ),
        "lowrank": pa.table(
            {
                "sample": ["real"] * 2,
                "seq_id": seq[anchors[:2]],
                "pos": pos[anchors[:2]],
                "patched": vectors_to_arrow(patched[:2], null=np.array([False, True])),
            }
        ),
    }
    tokens_rows = pa.table({"seq_id": seq, "token_id": tokens.ravel().astype(np.int32)})
    outputs = pa.table({"seq_id": seq, "pos": pos, "h": vectors_to_arrow(h_next)})
    tables = perturb_layer(model, tokens_rows, outputs, fits, layer, seed=7, batch_size=5, directions=8)
    full = tables["diag_psd"].to_pydict()
    assert full["n_random"] == [8, 8, 8] and all(v is not None for v in full["kl_other"])
    expected = null_patches(fits["diag_psd"]["patched"], h_next[anchors], np.random.default_rng([7, layer, 0]), 8)
    rows, positions = np.repeat(seq[anchors], 8), np.repeat(pos[anchors], 8)
    one_by_one, _ = patch_kl_anchors(
        model, tokens, rows, positions, layer, expected.random.reshape(-1, d), batch_size=1, mode="full"
    )
    np.testing.assert_allclose(np.array(full["kl_directions"]), one_by_one.reshape(3, 8), rtol=1e-4, atol=1e-8)
    np.testing.assert_allclose(full["kl_random"], one_by_one.reshape(3, 8).mean(axis=1), rtol=1e-4, atol=1e-8)
    single = tables["lowrank"].to_pydict()  # one patched anchor: no other anchor to borrow a residual from
    assert single["n_random"] == [8, None] and single["kl_other"] == [None, None]
    assert single["kl"][0] is not None and single["kl"][1] is None and single["kl_random"][1] is None
    assert len(single["kl_directions"][0]) == 8 and single["kl_directions"][1] is None


@pytest.mark.parametrize("arch", ["mamba"], scope="module")  # the stepped path is the recurrent families'
def test_a_recurrent_copy_that_stops_at_its_anchor_takes_one_step(arch, model, tokens, states):
    """Mamba: the clean sequences run once, a token at a time up to the last anchor (each step all of them),
    then each copy that stops at its anchor is one token from the clean state before it, with the direct
    forwards' KL."""
    rows, positions = np.array([2, 0, 2, 0, 2]), np.array([5, 0, 9, 3, 5])
    vectors = states[1][rows, positions] + np.random.default_rng(3).normal(0, 1.0, (5, TINY.d_model)).astype(np.float32)
    to_end = np.zeros(5, dtype=bool)
    patch_kl_anchors(model, tokens, rows, positions, 0, vectors, batch_size=5, to_end=to_end)  # the probe ran
    seen = []
    handle = model.get_input_embeddings().register_forward_hook(lambda m, a, o: seen.append(tuple(o.shape[:2])))
    try:
        kl, _ = patch_kl_anchors(model, tokens, rows, positions, 0, vectors, batch_size=5, to_end=to_end)
    finally:
        handle.remove()
    assert suffix_path(model, 0)[0] == "stepped"
    assert seen == [(2, 1)] * 10 + [(1, 1), (4, 1)]  # 2 sequences for positions 0..9; position 0; the rest
    for i in range(5):
        np.testing.assert_allclose(
            kl[i], _direct_kl(model, tokens[rows[i]], 0, positions[i], vectors[i])[0], rtol=1e-4, atol=1e-7
        )
