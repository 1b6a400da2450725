"""The library on CUDA against the same calls on the CPU (marker `gpu`; `make gpu-check` runs these first).

Without CUDA every test here skips itself, with the reason. Each compares through the check's own functions
(`tools.gpucheck.compare`) at tiny sizes, or tests a property the CPU suite cannot: that the kNN's
tie-breaking and the exact diameter hold with CUDA's kernels.
"""

from __future__ import annotations

import pytest
import torch
from conftest import SEQ_LEN, VOCAB, tiny_size, trainable_families

from pipeline.study_a.classes import FIT_CLASSES
from pipeline.study_a.knn import nearest_neighbours
from pipeline.study_b import hilbert
from pipeline.study_b.baseline import baseline
from tools.bench.sizes import identifiable_k
from tools.gpucheck import compare

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA: run on a CUDA machine with make gpu-check"),
]
CUDA = torch.device("cuda")
STUDY_A = compare.StudyAShape("tiny", tiny_size(), VOCAB, SEQ_LEN, n_seq=6, batch=3, anchors=16, patch_anchors=4,
                              knn_chunk=32, k=identifiable_k(tiny_size().d_model))
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
