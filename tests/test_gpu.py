"""The library on CUDA against the same calls on the CPU (marker `gpu`; `make gpu-check` runs these first).

Without CUDA every test here skips itself, with the reason. Each compares through the check's own functions
(`scripts.gpucheck.compare`) at tiny sizes, or tests a property the CPU suite cannot: that the kNN's
tie-breaking and the exact diameter hold with CUDA's kernels.
"""

from __future__ import annotations

import pytest
import torch
from conftest import SEQ_LEN, VOCAB, tiny_size, trainable_families

from lmgeo.commands.bench.sizes import identifiable_k
from lmgeo.models.registry import build_model, head_of
from lmgeo.study_a.classes import FIT_CLASSES
from lmgeo.study_a.knn import nearest_neighbours
from lmgeo.study_b import hilbert
from lmgeo.study_b.baseline import baseline
from scripts.gpucheck import compare

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA: run on a CUDA machine with make gpu-check"),
]
CUDA = torch.device("cuda")
STUDY_A = compare.StudyAShape(
    "tiny",
    tiny_size(),
    VOCAB,
    SEQ_LEN,
    n_seq=6,
    batch=3,
    anchors=16,
    patch_anchors=4,
    knn_chunk=32,
    k=identifiable_k(tiny_size().d_model),
)
TRAIN = compare.TrainShape("tiny", tiny_size(), VOCAB, SEQ_LEN, batch=2, steps=3, save_checkpoints=True)


def test_knn_breaks_exact_ties_by_index_as_on_the_cpu():
    # Every row appears three times: each anchor's neighbours are all ties, settled by pool index alone.
    rows = torch.randn(50, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    pool = rows.repeat(3, 1)
    anchors = torch.arange(0, 150, 7)
    cpu = nearest_neighbours(pool, anchors, k=5, chunk=16)
    gpu = nearest_neighbours(pool.to(CUDA), anchors.to(CUDA), k=5, chunk=16)
    assert torch.equal(gpu.cpu(), cpu)


def test_exact_diameter_matches_the_cpu():
    w = torch.randn(3000, 64, generator=torch.Generator().manual_seed(1))
    cpu, gpu = hilbert.diam(w), hilbert.diam(w.to(CUDA))
    assert (gpu.i, gpu.j) in ((cpu.i, cpu.j), (cpu.j, cpu.i))
    assert gpu.value == pytest.approx(cpu.value, rel=1e-12)


@pytest.mark.parametrize("arch", trainable_families())
def test_extraction_and_patching_match_the_cpu(arch):
    for outcome in (compare.compare_extraction(arch, STUDY_A, CUDA), compare.compare_patching(arch, STUDY_A, CUDA)):
        assert outcome.passed, outcome.summary


@pytest.mark.parametrize("fn", FIT_CLASSES.names())
def test_fit_class_matches_the_cpu(fn):
    outcome = compare.compare_fit(fn, "gpt2", STUDY_A, CUDA)
    assert outcome.passed, outcome.summary


@pytest.mark.parametrize("arch", trainable_families())
def test_bf16_training_tracks_the_cpu_and_keeps_the_hilbert_invariant(arch):
    outcome = compare.compare_training(arch, baseline().name, TRAIN, CUDA)
    assert outcome.passed, outcome.summary


def test_gpu_memory_is_back_to_baseline_after_each_shard():
    outcome = compare.memory_between_shards(STUDY_A, TRAIN, CUDA)
    assert outcome.passed, outcome.summary


# ----------------------------------------------------------------- issue #39: the CUDA training step
def test_the_fused_loss_on_bf16_logits_is_transformers_loss_and_keeps_no_float32_copy():
    from transformers.loss.loss_utils import ForCausalLMLoss

    from lmgeo.study_b.loss import fused_next_token_loss

    gen = torch.Generator(device=CUDA).manual_seed(0)
    logits = (3 * torch.randn(4, 128, 2048, device=CUDA, generator=gen)).bfloat16()
    labels = torch.randint(0, 2048, (4, 128), device=CUDA, generator=gen)
    ours, theirs = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t, lambda t: t):
        loss = fused_next_token_loss()(ours, labels)
    reference = ForCausalLMLoss(theirs, labels, vocab_size=2048)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-5)
    loss.backward()
    reference.backward()
    torch.testing.assert_close(ours.grad, theirs.grad)
    assert saved.count(torch.bfloat16) == 1  # the logits; float32 only per row (the log-sum-exp)


def test_losses_come_back_from_the_device_in_order_without_a_wait_per_step():
    from lmgeo.study_b.train import LossReadback

    readback, values = LossReadback(max_unread=3), torch.arange(1.0, 11.0, device=CUDA)
    arrived = []
    for step in range(1, 11):
        readback.push(step, values[step - 1] * 2)
        arrived += readback.arrived()
        assert len(readback._in_flight) <= 3
    arrived += readback.arrived(wait=True)
    assert arrived == [(step, 2.0 * step) for step in range(1, 11)]


def test_the_batched_muon_step_on_cuda_is_torch_muons():
    from lmgeo.study_b.muon import Muon

    gen = torch.Generator().manual_seed(7)
    start = [torch.randn(shape, generator=gen) for shape in [(96, 32), (96, 32), (32, 96), (64, 64)]]
    ours = [torch.nn.Parameter(w.clone().to(CUDA)) for w in start]
    theirs = [torch.nn.Parameter(w.clone().to(CUDA)) for w in start]
    settings = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True}
    mine, torchs = Muon(ours, **settings), torch.optim.Muon(theirs, **settings)
    for _ in range(3):
        for p, q in zip(ours, theirs, strict=True):
            p.grad = torch.randn(p.shape, generator=gen).to(CUDA)
            q.grad = p.grad.clone()
        mine.step()
        torchs.step()
    for p, q, w in zip(ours, theirs, start, strict=True):
        moved = float((q.detach().cpu() - w).norm())
        assert float((p.detach() - q.detach()).norm()) < 2e-2 * moved


def test_on_cuda_the_radius_stays_on_the_device_and_adamw_is_fused():
    from lmgeo.study_b.config import TrainConfig
    from lmgeo.study_b.optim import build_optimizers
    from lmgeo.study_b.train import HeadInputs

    model = build_model("neox", tiny_size(), VOCAB, SEQ_LEN, seed=0).to(CUDA)
    inputs = HeadInputs(head_of(model))
    ids = torch.randint(0, VOCAB, (2, SEQ_LEN), device=CUDA)
    model(input_ids=ids, labels=ids).loss.backward()
    radius = inputs.radius(1.0)
    assert isinstance(radius, torch.Tensor) and radius.is_cuda
    optimizer = build_optimizers(model, head_of(model).weight, "hilbert", TrainConfig(model=tiny_size()))
    assert optimizer.optimizers["adamw"].defaults["fused"]
    optimizer.step(radius=radius)
    assert isinstance(optimizer.head_lr(), torch.Tensor)


def test_mamba_trains_on_its_kernels_as_on_the_fallback():
    from lmgeo.models.kernels import kernels_chosen, use_mamba_kernels

    if not kernels_chosen():
        pytest.skip("mamba-ssm's kernels are not installed (scripts/gpucheck/build_mamba_wheels.sh)")
    model = build_model("mamba", tiny_size(), VOCAB, SEQ_LEN, seed=0).to(CUDA)
    ids = torch.randint(0, VOCAB, (2, SEQ_LEN), device=CUDA, generator=torch.Generator(device=CUDA).manual_seed(0))
    losses, grads = [], []
    for enabled in (True, False):
        with use_mamba_kernels(enabled), torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]).clone())
        model.zero_grad()
    assert losses[0] == pytest.approx(losses[1], rel=1e-2)  # the check's bf16 loss tolerance
    assert float((grads[0] - grads[1]).norm() / grads[1].norm()) < 5e-2
