"""The paper-scale rehearsal (`lmgeo rehearse`, `docs/scale.md`): its slice runs on a tiny configuration, and
its extrapolation scales what was measured as it says. The measurements themselves are not tested."""

from __future__ import annotations

from dataclasses import replace

import pytest
from transformers import GPT2Config

from lmgeo.commands.rehearse import rehearsal
from lmgeo.commands.rehearse.rehearsal import GpuCosts, Measured, Slice, Study, extrapolate, render_markdown
from lmgeo.study_a.classes import FIT_CLASSES


@pytest.mark.slow  # extract, fit and perturb on a slice
def test_the_slice_runs_extract_fit_and_perturb_on_a_tiny_configuration(monkeypatch):
    monkeypatch.setitem(
        rehearsal.SEED_CONFIGS, "gpt2", lambda: GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=256)
    )
    measured = rehearsal.rehearse("gpt2", Slice(n_seq=2, seq_len=16))
    assert (measured.width, measured.n_blocks, measured.k, measured.fit_anchors) == (32, 2, 32, 4)
    assert measured.pool == 64  # 32 extracted tokens, topped up to 2d
    local = {fn for fn in FIT_CLASSES.names() if FIT_CLASSES[fn].local}
    assert set(measured.fit_s_per_anchor) == local
    assert set(measured.fit_s_per_layer) == set(FIT_CLASSES.names()) - local
    # one anchor per partition (a class, or a local class's layer-wide fit) unless not identified, with its
    # fit copy, NULL_DIRECTIONS random-direction copies and (with another anchor patched) the other-anchor copy
    per_anchor = 1 + rehearsal.NULL_DIRECTIONS
    assert 0 < measured.perturb_copies <= (len(FIT_CLASSES.names()) + len(local)) * (per_anchor + 1)
    assert measured.perturb_copies >= per_anchor
    assert min(measured.extract_s_per_token, measured.fit_local_s_per_anchor, measured.perturb_s_per_copy) > 0


def _measured(**changes) -> Measured:
    base = Measured(
        "gpt2",
        124_439_808,
        768,
        12,
        50257,
        0.46,
        1.0,
        1.0,
        extract_s_per_token=0.01,
        extract_peak_gib=1.0,
        knn_s_per_anchor=0.0,
        fit_s_per_anchor={"diag_psd": 1.0},
        fit_s_per_layer={"global_linear": 0.0},
        fit_local_s_per_anchor=1.0,
        fit_anchors=4,
        pool=1536,
        k=768,
        perturb_s_per_copy=0.0,
        perturb_copies=9,
    )
    return replace(base, **changes)


STUDY = Study(
    ("distilbert/distilgpt2", "someone/unknown"),
    eval_sequences=8,
    seq_len=64,
    anchors=10,
    k=768,
    samples=3,
    classes=6,
    copies=10,
)


def test_extraction_scales_by_forward_flops_and_tokens():
    """DistilGPT2 is GPT-2 with 6 of its 12 blocks: (2·(82M params)) / (2·(124M params)) per token."""
    (row,) = extrapolate([_measured(fit_local_s_per_anchor=0.0)], STUDY)
    makers = (("d", rehearsal._distilgpt2), ("g", rehearsal._gpt2_small))
    flops = {name: rehearsal._shape(make())["flops"] for name, make in makers}
    assert row["extract core-h"] * 3600 == pytest.approx(8 * 64 * 0.01 * flops["d"] / flops["g"])
    assert row["fit core-h"] == 0 and row["perturb core-h"] == 0


# GPU costs planted equal to `_measured()`'s CPU costs at the same configuration (GPT-2 small, k = d = 768).
GPU = GpuCosts(
    "a GPU",
    "2026-12-04T00:00:00+00:00",
    "abc1234",
    extract_s_per_token=0.01,
    fit_s_per_anchor=1.0,
    fit_k=768,
    fit_width=768,
    fit_s_per_layer=0.0,
    fit_pool=1536,
    knn_s_per_anchor=0.0,
    knn_pool=1536,
    perturb_s_per_copy=0.0,
    perturb_seq_len=64,
    train_tokens_per_s={"muon": 1000.0},
)


def test_local_fits_scale_per_anchor_layer_and_sample():
    """At the rehearsed k and d the per-anchor cost carries over unchanged: layers × samples × anchors; GPU costs
    equal to the CPU's give the same hours."""
    (row,) = extrapolate([_measured()], STUDY, GPU)
    assert row["fit core-h"] * 3600 == pytest.approx(6 * 3 * 10 * 1.0)
    assert row["fit node-h"] == pytest.approx(row["fit core-h"])
    assert row["extract node-h"] == pytest.approx(row["extract core-h"])


def test_without_a_gpu_check_the_gpu_column_says_it_is_not_measured():
    (row,) = extrapolate([_measured()], STUDY)
    assert row["GPU-node h"] is None and row["fit core-h"] > 0
    table = render_markdown([_measured()], Slice(), STUDY, None, "x", {}, 1)
    assert "**The GPU column is not measured.**" in table and "| **not measured** |" in table
    assert "50×" not in table.replace("assumed the fits ran 50× faster", "")  # no assumed speed-up is used


def test_the_gpu_costs_come_from_a_cuda_checks_measurements_only():
    fits = {
        "run": {"d": 768, "k": 832, "n_seq": 32, "seq_len": 64, "anchors": 64},
        "tables": {
            "fit_layer per class": {
                "rows": [
                    ["diag_psd", 0.5, 9.0, 18.0, "yes"],
                    ["mlp", 30.0, 60.0, 2.0, "no"],
                    ["global_linear", 0.1, 1.0, 10.0, "no"],
                ]
            }
        },
    }
    results = [
        {
            "section": "measurements on cuda",
            "name": "extraction vs bare forward",
            "status": "pass",
            "detail": {"tokens_per_s": {"extract_path": 50_000.0}},
        },
        {"section": "measurements on cuda", "name": "fits, device vs cpu", "status": "FAIL", "detail": fits},
        {
            "section": "measurements on cuda",
            "name": "patching",
            "status": "measured",
            "detail": {"seconds": 2.0, "copies": 100, "run": {"seq_len": 256}},
        },
        {
            "section": "measurements on cuda",
            "name": "kNN, device vs cpu",
            "status": "measured",
            "detail": {"timings": {"device": {"median_s": 0.5}}, "run": {"anchors": 2048, "pool": 65536}},
        },
    ]
    document = {
        "mode": "CUDA",
        "device": "NVIDIA H200",
        "started_utc": "2026-12-05T10:00:00+00:00",
        "commit": "abc1234",
        "results": results,
    }
    costs = GpuCosts.from_check(document)
    assert costs.extract_s_per_token == pytest.approx(2e-5) and costs.perturb_s_per_copy == pytest.approx(0.02)
    assert costs.fit_s_per_anchor == pytest.approx(0.5e-3)  # the closed-form local classes only: not mlp
    assert costs.fit_s_per_layer == pytest.approx(0.1e-3 * 64) and costs.fit_pool == 2048 and costs.fit_k == 832
    assert costs.knn_s_per_anchor == pytest.approx(0.5 / 2048) and costs.knn_pool == 65536
    assert GpuCosts.from_check(document | {"mode": "CPU stand-in (no GPU figures)"}) is None
    assert GpuCosts.from_check(document | {"results": results[:2]}) is None  # an item that did not run
    table = render_markdown([_measured()], Slice(), STUDY, costs, "x", {}, 1)
    assert "NVIDIA H200, 2026-12-05T10:00:00+00:00, at commit `abc1234`" in table


def test_a_mamba_has_no_gpu_hours_the_check_did_not_measure():
    mamba = _measured(model="mamba-370m")
    study = replace(STUDY, models=("state-spaces/mamba-130m-hf",))
    (row,) = extrapolate([mamba], study, GPU)
    assert row["GPU-node h"] is None and row["fit core-h"] > 0
    assert "not measured (Mamba)" in render_markdown([mamba], Slice(), study, GPU, "x", {}, 1)


def test_the_report_states_the_command_the_slice_and_the_total():
    table = render_markdown([_measured()], Slice(), STUDY, GPU, "lmgeo rehearse --write x.md", {"cpu": "a CPU"}, 1)
    assert "Generated by `lmgeo rehearse --write x.md`" in table and "shared with other jobs and noisy" in table
    assert "| distilbert/distilgpt2 | gpt2 |" in table and "someone/unknown" not in table and "| **total** |" in table


def test_stage_shares_sum_to_one_and_the_report_names_the_dominant_stage():
    """Planted rows where perturb is most of the core-hours and fit most of the node-hours."""
    row = {
        "extract core-h": 1.0,
        "fit core-h": 3.0,
        "perturb core-h": 6.0,
        "extract node-h": 0.1,
        "fit node-h": 0.6,
        "perturb node-h": 0.3,
    }
    shares = rehearsal.stage_shares([row, row])
    assert shares["core-h"] == pytest.approx({"extract": 0.1, "fit": 0.3, "perturb": 0.6})
    assert shares["node-h"] == pytest.approx({"extract": 0.1, "fit": 0.6, "perturb": 0.3})
    lines = rehearsal._shares_lines([row])
    assert "| core-hours here | 10% | 30% | **60%** | **perturb** |" in lines
    assert "| one GPU node, hours (measured rows) | 10% | **60%** | 30% | **fit** |" in lines
    unmeasured = row | {"extract node-h": None}
    assert "node-h" not in rehearsal.stage_shares([unmeasured])


def test_the_node_hours_are_the_sum_of_the_stages():
    (row,) = extrapolate([_measured()], STUDY, GPU)
    assert row["GPU-node h"] == pytest.approx(sum(row[f"{s} node-h"] for s in rehearsal.STAGES))
    assert "Where the time goes" in render_markdown([_measured()], Slice(), STUDY, GPU, "x", {}, 1)


def test_the_json_holds_what_the_report_is_written_again_from():
    header = {"command": "lmgeo rehearse --write x.md", "machine": {"cpu": "a CPU"}, "threads": 1}
    document = rehearsal.as_json([_measured()], Slice(n_seq=3), header)
    results, size = rehearsal.from_json(document)
    assert results == [_measured()] and size == Slice(n_seq=3) and document["command"] == header["command"]
