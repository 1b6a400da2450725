"""What the check runs, at which sizes, in which order, and the loop that runs it within a time budget.

Items run in order of what a GPU run most needs to learn (`items`): the environment, the machine's ceilings, Study
A at the seeds' width (GPT-2 small, d = 768, V = 50,304: agreement with the CPU, then the speeds that carry the GPU
node's bars), the GPU tests, the tiny models of every family, Study B, memory between shards, Mamba on mamba-ssm's
kernels against the CPU's fallback (where the kernel wheels are installed), training's speeds, and last what
compiles (tens of seconds per model), which a short budget cuts first. Each item is isolated: an exception is
recorded with its traceback and the next item runs, so one run reports every failure. Items are started only within
the budget (the rest are recorded as skipped), and the summaries are rewritten after every item.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from lmgeo.commands.bench.sizes import identifiable_k
from lmgeo.models.config import ModelSize
from lmgeo.models.kernels import kernels_chosen
from lmgeo.models.registry import FAMILIES
from lmgeo.study_a.classes import FIT_CLASSES
from lmgeo.study_b.baseline import baseline
from lmgeo.study_b.recipes import RECIPES
from scripts.gpucheck import compare, compat, speed
from scripts.gpucheck.compare import StudyAShape, TrainShape
from scripts.gpucheck.speed import CeilingRun, FitRun, KnnRun, ModelRun, PatchRun
from scripts.gpucheck.summary import Outcome, Result

REPO = Path(__file__).resolve().parents[2]
GPT2_SMALL_WIDTH = ModelSize(d_model=768, n_layers=2, n_heads=12, d_state=16, expand=2)
GPT2_SMALL = ModelSize(d_model=768, n_layers=12, n_heads=12)
GPT2_VOCAB = 50304  # GPT-2's 50,257 rounded up to a multiple of 64
TINY = ModelSize(d_model=32, n_layers=2, n_heads=4, d_state=8, expand=2)


def trainable() -> tuple[str, ...]:
    return tuple(f.name for f in FAMILIES if f.trainable)


@dataclass(frozen=True)
class Sizes:
    """Everything the plan runs, by size. `study_a`/`train` pair each shape with the families it covers."""

    study_a: tuple[tuple[StudyAShape, tuple[str, ...]], ...]
    train: tuple[tuple[TrainShape, tuple[str, ...], tuple[str, ...]], ...]  # shape, families, recipes
    compile_families: tuple[str, ...]  # compiled training (baseline recipe), at the first train shape
    memory: tuple[StudyAShape, TrainShape]
    ceilings: CeilingRun
    extraction: ModelRun
    knn: KnnRun
    fits: FitRun
    patching: PatchRun
    steps: ModelRun
    mamba: ModelRun
    # Mamba on its kernels against the CPU's fallback (None: the stand-in, where both would be the fallback,
    # the same calls as Study A's and B's tiny Mamba items)
    mamba_kernels: tuple[StudyAShape, TrainShape] | None


def full_sizes() -> Sizes:
    """The CUDA run: tiny models of every family, then GPT-2-small width; measurements at GPT-2 small."""
    tiny_a = StudyAShape(
        "tiny",
        TINY,
        128,
        16,
        n_seq=8,
        batch=4,
        anchors=32,
        patch_anchors=8,
        knn_chunk=48,
        k=identifiable_k(TINY.d_model),
    )
    # The seeds' width: k = d + 64 neighbours (every local class identified) among 1,024 tokens.
    real_a = StudyAShape(
        "GPT-2 small width",
        GPT2_SMALL_WIDTH,
        GPT2_VOCAB,
        128,
        n_seq=8,
        batch=4,
        anchors=64,
        patch_anchors=16,
        knn_chunk=256,
        k=GPT2_SMALL_WIDTH.d_model + 64,
    )
    tiny_t = TrainShape("tiny", TINY, 128, 16, batch=4, steps=5, save_checkpoints=True)
    real_t = TrainShape("GPT-2 small width", GPT2_SMALL_WIDTH, GPT2_VOCAB, 64, batch=2, steps=2, save_checkpoints=False)
    return Sizes(
        study_a=((tiny_a, trainable()), (real_a, ("gpt2",))),
        train=((tiny_t, trainable(), RECIPES.names()), (real_t, ("gpt2",), RECIPES.names())),
        compile_families=trainable(),
        memory=(tiny_a, tiny_t),
        ceilings=CeilingRun(disk_bytes=2 << 30, transfer_bytes=1 << 30, repeats=2),
        extraction=ModelRun("gpt2", GPT2_SMALL, GPT2_VOCAB, 256, batch=8, repeats=3),
        knn=KnnRun(pool=65536, d=768, anchors=2048, chunk=4096, repeats=2),
        fits=FitRun(d=768, k=768 + 64, n_seq=32, seq_len=64, anchors=64, repeats=1),
        patching=PatchRun("gpt2", GPT2_SMALL, GPT2_VOCAB, 256, n_seq=16, copies_per_seq=8, batch=32, repeats=2),
        steps=ModelRun("gpt2", GPT2_SMALL, GPT2_VOCAB, 1024, batch=8, repeats=5),
        mamba=ModelRun(
            "mamba", ModelSize(d_model=768, n_layers=4, d_state=16, expand=2), GPT2_VOCAB, 256, batch=4, repeats=3
        ),
        mamba_kernels=(real_a, real_t),
    )


def standin_sizes() -> Sizes:
    """The CPU stand-in of the test suite: the same plan at sizes a 2-core machine runs in about a minute."""
    tiny_a = StudyAShape(
        "tiny",
        TINY,
        128,
        16,
        n_seq=6,
        batch=3,
        anchors=12,
        patch_anchors=4,
        knn_chunk=32,
        k=identifiable_k(TINY.d_model),
    )
    tiny_t = TrainShape("tiny", TINY, 128, 16, batch=2, steps=2, save_checkpoints=True)
    small = ModelSize(d_model=32, n_layers=1, n_heads=4, d_state=8, expand=2)
    return Sizes(
        study_a=((tiny_a, trainable()),),
        train=((tiny_t, ("gpt2",), RECIPES.names()), (tiny_t, trainable()[1:], (baseline().name,))),
        compile_families=(),
        memory=(tiny_a, tiny_t),
        ceilings=CeilingRun(disk_bytes=64 << 20, transfer_bytes=0, repeats=1),
        extraction=ModelRun("gpt2", small, 256, 16, batch=2, repeats=1),
        knn=KnnRun(pool=512, d=16, anchors=32, chunk=128, repeats=1),
        fits=FitRun(d=16, k=16 + 64, n_seq=8, seq_len=16, anchors=8, repeats=1),
        patching=PatchRun("gpt2", small, 256, 16, n_seq=2, copies_per_seq=2, batch=4, repeats=1),
        steps=ModelRun("gpt2", small, 256, 16, batch=2, repeats=1),
        mamba=ModelRun("mamba", small, 256, 16, batch=2, repeats=1),
        mamba_kernels=None,
    )


@dataclass(frozen=True)
class Item:
    section: str
    name: str
    run: Callable[[], Outcome]
    cuda_only: str | None = None  # why it cannot run on the CPU stand-in
    unavailable: str | None = None  # why it cannot run on this machine at all


def items(sizes: Sizes, device: torch.device) -> list[Item]:
    """Every item, most valuable first (a budget cuts from the end): the environment; the machine's ceilings;
    Study A at the seeds' width (GPT-2 small, d = 768), its agreement with the CPU and then its speeds, which
    carry the GPU node's bars and `docs/scale.md`'s GPU column; the GPU tests; the tiny models of every family;
    Study B; memory between shards; training's speeds; last what compiles."""
    measured, compiling = f"measurements on {device.type}", "train_run compiles on CUDA only (train.compile)"
    widest, *others = sorted(sizes.study_a, key=lambda pair: -pair[0].size.d_model)
    plan = [
        Item("environment", "every library module imports", compat.import_every_module),
        Item("environment", "private torch API of Muon", compat.private_torch_api),
        Item(measured, "disk and host↔device ceilings", lambda: speed.ceilings(sizes.ceilings, device)),
        *study_a_items(*widest, device),
        Item(measured, "fits, device vs cpu", lambda: speed.fits_speed(sizes.fits, device)),
        Item(
            measured,
            "extraction vs bare forward",
            lambda: speed.extraction_speed(sizes.extraction, sizes.ceilings, device),
        ),
        Item(measured, "patching", lambda: speed.patching_speed(sizes.patching, device)),
        Item(measured, "kNN, device vs cpu", lambda: speed.knn_speed(sizes.knn, device)),
        Item("environment", "GPU tests (pytest -m gpu)", gpu_tests),
    ]
    for shape, families in others:
        plan += study_a_items(shape, families, device)
    for shape, families, recipes in sizes.train:
        section = f"Study B on {device.type} vs cpu — {shape.label}"
        plan += [
            Item(section, f"train {a} {r}", lambda a=a, r=r, s=shape: compare.compare_training(a, r, s, device))
            for a in families
            for r in recipes
        ]
    if sizes.mamba_kernels is not None:
        plan += mamba_kernel_items(sizes.mamba_kernels, device)
    study_a, train = sizes.memory
    plan.append(
        Item(
            "GPU memory between shards",
            "extract, fit, perturb, train shards",
            lambda: compare.memory_between_shards(study_a, train, device),
            cuda_only="CUDA's allocator counts the memory; the CPU has no counterpart",
        )
    )
    plan += [
        Item(measured, "bf16 matmul peak", lambda: speed.matmul_peak(device), cuda_only="the peak is the GPU's"),
        Item(measured, "training step per recipe", lambda: speed.training_steps(sizes.steps, device)),
        Item(measured, "Mamba's kernel path", lambda: speed.mamba_kernel_path(device)),
        Item(measured, "Mamba training step, kernels vs fallback", lambda: speed.mamba_step(sizes.mamba, device)),
        # Compiling costs tens of seconds a model: last, where a short budget cuts it first.
        Item(
            measured,
            "training step per recipe, torch.compile",
            lambda: speed.training_steps(sizes.steps, device, compile=True),
            cuda_only=compiling,
        ),
    ]
    name, shape = baseline().name, sizes.train[0][0]
    plan += [
        Item(
            f"Study B on {device.type} vs cpu — {shape.label}, torch.compile",
            f"train {a} {name}",
            lambda a=a: compare.compare_training(a, name, shape, device, compile=True),
            cuda_only=compiling,
        )
        for a in sizes.compile_families
    ]
    return plan


def mamba_kernel_items(shapes: tuple[StudyAShape, TrainShape], device: torch.device) -> list[Item]:
    """Mamba's extraction, patching and training on the device against the same calls on the CPU, which
    runs transformers' fallback (`lmgeo.models.kernels`): mamba-ssm's kernels against the fallback, where
    CUDA has them; skipped, saying so, where it does not."""
    study_a, train = shapes
    missing = None
    if device.type == "cuda" and not kernels_chosen():
        missing = "mamba-ssm's kernels are not installed here (scripts/gpucheck/build_mamba_wheels.sh builds them)"
    section = f"Mamba on mamba-ssm's kernels, {device.type} vs the cpu's fallback — {study_a.label}"
    recipe = baseline().name
    return [
        Item(
            section,
            "extraction mamba",
            lambda: compare.compare_extraction("mamba", study_a, device),
            unavailable=missing,
        ),
        Item(
            section, "patching mamba", lambda: compare.compare_patching("mamba", study_a, device), unavailable=missing
        ),
        Item(
            section,
            f"train mamba {recipe}",
            lambda: compare.compare_training("mamba", recipe, train, device),
            unavailable=missing,
        ),
    ]


def study_a_items(shape: StudyAShape, families: tuple[str, ...], device: torch.device) -> list[Item]:
    """Study A's library path on the device against the CPU at one shape: extraction of every family, then on
    the first family's activations the kNN, every fit class and the patching of every family."""
    section, first = f"Study A on {device.type} vs cpu — {shape.label}", families[0]
    return [
        *(Item(section, f"extraction {a}", lambda a=a: compare.compare_extraction(a, shape, device)) for a in families),
        Item(section, f"kNN ({first} activations)", lambda: compare.compare_knn(first, shape, device)),
        *(
            Item(section, f"fit {fn} ({first})", lambda fn=fn: compare.compare_fit(fn, first, shape, device))
            for fn in FIT_CLASSES.names()
        ),
        *(Item(section, f"patching {a}", lambda a=a: compare.compare_patching(a, shape, device)) for a in families),
    ]


def gpu_tests() -> Outcome:
    """`pytest -m gpu` in a child process (on the CPU every test skips itself, with its reason)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-m",
                "gpu",
                "-q",
                "-p",
                "no:cacheprovider",
                f"--junitxml={report}",
                "tests/test_gpu.py",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if not report.exists():
            return Outcome(
                f"pytest ended with code {done.returncode} and no report",
                {"output": done.stdout[-4000:] + done.stderr[-2000:]},
                False,
            )
        cases = ElementTree.parse(report).getroot().iter("testcase")
        outcomes = {f"{c.get('classname')}::{c.get('name')}": case_outcome(c) for c in cases}
    tally = {k: sum(v[0] == k for v in outcomes.values()) for k in ("passed", "failed", "error", "skipped")}
    problems = {name: why for name, (kind, why) in outcomes.items() if kind in ("failed", "error")}
    skipped = {why for kind, why in outcomes.values() if kind == "skipped"}
    summary = ", ".join(f"{n} {k}" for k, n in tally.items() if n) or "no tests collected"
    if skipped:
        summary += f" ({'; '.join(sorted(skipped))})"
    if problems:
        summary += "; " + "; ".join(f"{n}: {why}" for n, why in problems.items())
    return Outcome(
        summary,
        {"tally": tally, "problems": problems, "exit_code": done.returncode},
        done.returncode == 0 and not problems,
    )


def case_outcome(case: ElementTree.Element) -> tuple[str, str]:
    """(passed | failed | error | skipped, the first line of pytest's message) of one JUnit test case."""
    for kind in ("failure", "error", "skipped"):
        child = case.find(kind)
        if child is not None:
            first_line = next(iter((child.get("message") or "").splitlines()), "")
            return {"failure": "failed"}.get(kind, kind), first_line[:300]
    return "passed", ""


def run(
    plan: list[Item], device: torch.device, budget_s: float, report: Callable[[list[Result]], None]
) -> list[Result]:
    """Every item in order, each isolated; `report` is called with the results after each one."""
    started = time.perf_counter()
    results: list[Result] = []
    for item in plan:
        item_start = time.perf_counter()
        if item.cuda_only and device.type != "cuda":
            result = Result(item.section, item.name, "skipped", 0.0, f"CUDA only: {item.cuda_only}")
        elif item.unavailable:
            result = Result(item.section, item.name, "skipped", 0.0, item.unavailable)
        elif item_start - started > budget_s:
            result = Result(item.section, item.name, "skipped", 0.0, f"the check's {budget_s:.0f} s budget was spent")
        else:
            print(f"gpu-check: {item.section} / {item.name} …", flush=True)
            result = _run_one(item)
            _release(device)
        results.append(result)
        print(f"gpu-check:   {result.status}: {result.summary}", flush=True)
        report(results)
    return results


def _run_one(item: Item) -> Result:
    start = time.perf_counter()
    try:
        outcome = item.run()
    except Exception as error:  # an item's failure is its result; the next item still runs
        message = "".join(traceback.format_exception_only(error)).strip()
        detail = {"traceback": "".join(traceback.format_exception(error))[-6000:]}
        return Result(item.section, item.name, "error", time.perf_counter() - start, message, detail)
    status = "measured" if outcome.passed is None else ("pass" if outcome.passed else "FAIL")
    return Result(item.section, item.name, status, time.perf_counter() - start, outcome.summary, outcome.detail)


def _release(device: torch.device) -> None:
    """Between items: free what the item left, so the next item's memory figures start clean."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
