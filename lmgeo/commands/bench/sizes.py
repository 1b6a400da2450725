"""The sizes each benchmark runs at: FULL for `lmgeo bench`, QUICK for the smoke run in the tests."""

from __future__ import annotations

from dataclasses import dataclass

from lmgeo.models.config import ModelSize
from lmgeo.study_a.classes import FIT_CLASSES


def fit_bench_classes() -> tuple[str, ...]:
    """The local classes fitted in closed form: their per-anchor reference is exact and fast enough to
    time (an iterative class's reference re-runs its optimiser anchor by anchor)."""
    return tuple(c.name for c in FIT_CLASSES if c.local and not c.iterative)


def identifiable_k(d: int) -> int:
    """Neighbours enough for every local class to be identifiable at width `d` (k > d, SPEC §4.2): a
    benchmark of degenerate anchors would compare nulls."""
    return d + d // 2


@dataclass(frozen=True)
class ExtractionSize:
    arch: str
    d_model: int
    n_layers: int
    n_heads: int
    vocab: int
    seq_len: int
    n_seq: int  # sequences per timed repetition: one extract shard of a few forwards (the writes overlap them)
    # Batches of sequences for peak memory, 4× apart: whole batches, so that the two runs differ in the
    # number of batches only (a run of one partial batch would compare batch sizes, not token counts), and
    # at least two, so that both runs include the allocator's reuse of the first batch's freed memory
    # (glibc raises its mmap threshold after the first frees: the second batch's tensors come from the heap).
    rss_batches: tuple[int, int]
    repeats: int
    encoding_rows: int  # vectors written and read per repetition by the encodings' comparison

    def model_size(self) -> ModelSize:
        return ModelSize(d_model=self.d_model, n_layers=self.n_layers, n_heads=self.n_heads)


@dataclass(frozen=True)
class FitScale:
    label: str
    d: int
    n_seq: int
    seq_len: int
    anchors: int
    repeats: int
    # Which figure carries the bar (both are reported): the local classes' float64 FLOP/s over torch.matmul's
    # (≥ 0.3, where both sides are matrix-product bound), else the speed-up over the reference (≥ 20×).
    rate_bar: bool = False


@dataclass(frozen=True)
class KnnSize:
    d: int
    chunk: int
    anchors: int
    pools: tuple[int, int]  # 4× apart


@dataclass(frozen=True)
class KnnVsFaissSize:
    pool: int
    d: int
    anchors: int
    repeats: int


@dataclass(frozen=True)
class PatchingSize:
    arch: str
    d_model: int
    n_layers: int
    vocab: int
    seq_len: int
    n_seq: int
    anchors_per_seq: int  # each with 3 patched copies (a real patch and two nulls)
    batch: int
    repeats: int


@dataclass(frozen=True)
class RecipeSize:
    arch: str
    d_model: int
    n_layers: int
    n_heads: int
    vocab: int
    seq_len: int
    batch: int
    repeats: int
    flops_vocab: int = 50304  # the analytic FLOP estimate is at GPT-2 scale whatever was timed
    flops_width: int = 768
    head_vocab: int = 50304  # head steps alone are timed at this scale (GPT-2's head)
    head_width: int = 768
    head_repeats: int = 3


@dataclass(frozen=True)
class FanoutSize:
    d: int
    n_layers: int
    n_seq: int
    seq_len: int
    anchors: int
    classes: tuple[str, ...]
    repeats: int  # repetitions of each worker count, interleaved 1 2 1 2 …


@dataclass(frozen=True)
class BenchSizes:
    extraction: ExtractionSize
    fits: tuple[FitScale, ...]
    knn: KnnSize
    recipes: RecipeSize
    fanout: FanoutSize
    knn_vs_faiss: tuple[KnnVsFaissSize, ...]
    patching: PatchingSize
    gpu_knn: KnnSize  # CUDA only: a hub-model width and a pool of 2^16–2^18 tokens


FULL = BenchSizes(
    # A mid-size GPT-2: the writer's cost per token grows like (L+1)·d, the forward's like L·(12d² + 2Td),
    # so the ratio improves with width; d = 256 is a conservative stand-in for the hub models.
    extraction=ExtractionSize("gpt2", 256, 4, 4, 8192, 128, 64, (2, 8), 9, encoding_rows=16384),
    fits=(
        # The hub models the study is built for (GPT-2 small, Pythia-160m) have d = 768.
        FitScale("d=768 (GPT-2 small width)", 768, 64, 64, 32, 2, rate_bar=True),
        # The default study's own models: d = 64, 32 eval sequences of 64 tokens, 128 anchors.
        FitScale("d=64 (default study)", 64, 32, 64, 128, 5),
    ),
    knn=KnnSize(d=64, chunk=1024, anchors=1024, pools=(8192, 32768)),
    recipes=RecipeSize("neox", 128, 2, 4, 8192, 64, 8, 10),
    fanout=FanoutSize(d=128, n_layers=6, n_seq=32, seq_len=64, anchors=128, classes=fit_bench_classes(), repeats=3),
    # The two sizes the any-family issue measured FAISS at: the default study's pool, and a hub-model one.
    knn_vs_faiss=(KnnVsFaissSize(2048, 64, 128, 9), KnnVsFaissSize(65536, 256, 1024, 3)),
    # The default study's models: 4 blocks of width 64, V = 2048, 64-token sequences.
    patching=PatchingSize("neox", 64, 4, 2048, 64, 8, 4, 32, 3),
    gpu_knn=KnnSize(d=768, chunk=4096, anchors=4096, pools=(65536, 262144)),
)


QUICK = BenchSizes(
    extraction=ExtractionSize("gpt2", 32, 2, 2, 256, 16, 4, (2, 8), 2, encoding_rows=256),
    fits=(FitScale("d=16 (smoke)", 16, 8, 16, 4, 1),),
    knn=KnnSize(d=8, chunk=64, anchors=64, pools=(256, 1024)),
    recipes=RecipeSize(
        "neox",
        32,
        1,
        2,
        512,
        16,
        2,
        2,
        flops_vocab=50304,
        flops_width=768,
        head_vocab=1024,
        head_width=64,
        head_repeats=1,
    ),
    fanout=FanoutSize(d=16, n_layers=2, n_seq=8, seq_len=16, anchors=8, classes=fit_bench_classes()[:1], repeats=1),
    knn_vs_faiss=(KnnVsFaissSize(512, 16, 32, 1),),
    patching=PatchingSize("neox", 16, 2, 64, 16, 2, 2, 8, 1),
    gpu_knn=KnnSize(d=64, chunk=256, anchors=256, pools=(1024, 4096)),
)
