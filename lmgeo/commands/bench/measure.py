"""Measuring side by side: interleaved timings, bars, profiles, peak memory, fresh processes."""

from __future__ import annotations

import contextlib
import cProfile
import io
import math
import multiprocessing
import os
import pstats
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

PROFILE_LINES = 14


_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


@dataclass(frozen=True)
class Bar:
    """One row of the ratio table: `value op threshold` must hold (and `extra_ok`, e.g. null patterns)."""

    name: str
    value: float
    op: Literal[">=", "<="]
    threshold: float
    passed: bool
    unit: str = "×"
    note: str = ""


def bar(
    name: str,
    value: float,
    op: Literal[">=", "<="],
    threshold: float,
    unit: str = "×",
    note: str = "",
    extra_ok: bool = True,
) -> Bar:
    holds = value >= threshold if op == ">=" else value <= threshold
    return Bar(name, value, op, threshold, bool(holds and extra_ok and math.isfinite(value)), unit, note)


@dataclass
class Timings:
    """Wall seconds and return values of each case, one entry per repetition."""

    times: dict[str, list[float]]
    results: dict[str, list[Any]] = field(default_factory=dict)

    def median(self, case: str) -> float:
        return statistics.median(self.times[case])

    def ratio(self, num: str, den: str) -> float:
        """Median over repetitions of `num_i / den_i`: a ratio of adjacent runs, robust to load swings."""
        return statistics.median(a / b for a, b in zip(self.times[num], self.times[den], strict=True))

    def summary(self) -> dict[str, dict[str, float]]:
        return {c: {"median_s": self.median(c), "min_s": min(t), "repeats": len(t)} for c, t in self.times.items()}


def interleaved(cases: Mapping[str, Callable[..., Any]], repeats: int, warmup: int = 1) -> Timings:
    """Run every case `warmup` times untimed, then `repeats` rounds timing each call, the order
    reversed every other round (`A B`, `B A`, `A B` …) so that neither side always runs first."""
    for _ in range(warmup):
        for run in cases.values():
            run()
    timings = Timings({name: [] for name in cases}, {name: [] for name in cases})
    names = list(cases)
    for round_ in range(repeats):
        for name in names if round_ % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            value = cases[name]()
            timings.times[name].append(time.perf_counter() - start)
            timings.results[name].append(value)
    return timings


def profile_top(run: Callable[[], Any], lines: int = PROFILE_LINES) -> list[str]:
    """cProfile of one call: the header and the top `lines` entries by own time."""
    profiler = cProfile.Profile()
    profiler.runcall(run)
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).strip_dirs().sort_stats("tottime").print_stats(lines)
    text = out.getvalue().splitlines()
    start = next(i for i, line in enumerate(text) if line.lstrip().startswith("ncalls"))
    return [line.rstrip() for line in text[start : start + lines + 1] if line.strip()]


def peak_rss_bytes() -> int:
    """This process image's peak resident set: `VmHWM` on Linux. Not `ru_maxrss`: across the exec
    that spawns a child it keeps the parent's peak (a child of a 500 MB parent reports 500 MB)."""
    status = Path("/proc/self/status")
    if status.exists():
        return _proc_status_kib(status.read_text(), "VmHWM") * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def reset_peak_rss() -> bool:
    """Reset the peak to the current resident set (Linux ≥ 4.0, `clear_refs` 5); False where unsupported."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _proc_status_kib(text: str, field_name: str) -> int:
    line = next(line for line in text.splitlines() if line.startswith(f"{field_name}:"))
    return int(line.split()[1])


def current_rss_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


@contextlib.contextmanager
def _child_env(variables: dict[str, str]) -> Iterator[None]:
    """Environment for a child about to be spawned (read when it starts and imports numpy/torch)."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


Runner = Callable[..., Any]  # (fn, threads, **kwargs) -> fn(threads=threads, **kwargs), somewhere


def run_fresh(fn: Callable[..., Any], threads: int, env: dict[str, str] | None = None, **kwargs: Any) -> Any:
    """`fn(threads=threads, **kwargs)` in a freshly spawned process with `threads` BLAS/OpenMP threads."""
    variables = {name: str(threads) for name in _THREAD_VARS} | (env or {})
    with _child_env(variables), ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, threads=threads, **kwargs).result()


def run_pinned(fn: Callable[..., Any], **kwargs: Any) -> Any:
    """`fn(threads=1, **kwargs)` in a fresh process under the kernels every stage pins
    (`lmgeo.core.determinism`): for tools whose numbers are committed or quoted, so that they reproduce on
    another machine as the stages' do (`fn` sets torch up with `pin_torch(threads)`, as a stage's task does)."""
    from lmgeo.core.determinism import pinned_environment

    return run_fresh(fn, 1, env=pinned_environment(1), **kwargs)


def run_here(fn: Callable[..., Any], threads: int, **kwargs: Any) -> Any:
    """`fn(threads=threads, **kwargs)` in this process: for smoke runs, where a child's start-up
    (importing torch) would cost more than the measurement. Peak memory always needs `run_fresh`."""
    return fn(threads=threads, **kwargs)
