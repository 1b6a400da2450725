"""`lmgeo bench`: the benchmarks of SPEC §7, written to `<out>/bench.json` and `<out>/bench.md`.

The measurements live in the other modules of `lmgeo.commands.bench`; this one picks the sizes (`--quick`: a
smoke run of a few seconds per section), runs each section in a fresh process, and runs the Ray fan-out benchmark,
which starts its own embedded Ray once per worker count (`ray.init(num_cpus=N)`), so it refuses to
run inside a process that already holds a Ray connection.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from lmgeo.commands.bench.extraction import extraction_section
from lmgeo.commands.bench.fits import fits_vs_reference, knn_section
from lmgeo.commands.bench.gpu import gpu_benchmarks
from lmgeo.commands.bench.measure import bar, run_fresh, run_here
from lmgeo.commands.bench.recipes import muon_kernels, recipe_step_times
from lmgeo.commands.bench.render import render_markdown, to_jsonable
from lmgeo.commands.bench.sizes import FULL, QUICK, BenchSizes, FanoutSize, identifiable_k
from lmgeo.commands.bench.study_a import knn_vs_faiss, suffix_vs_full
from lmgeo.commands.bench.synthetic import activation_batch, synthetic_states, token_ids
from lmgeo.core.config import TaskResources
from lmgeo.core.provenance import machine, versions
from lmgeo.core.store import ManifestKey, ShardWriter, verified_files
from lmgeo.driver.layout import Layout
from lmgeo.params import Params

FANOUT_MODEL = "bench"
ACTIVATION_SHARD, ACTIVATION_KEY = f"{FANOUT_MODEL}/seq=0", ManifestKey({"tokens": "bench"}, "bench", "bench")
FANOUT_WORKERS = (1, 2)


# Every section, in the order they run and are reported; `lmgeo bench --only NAME` runs a subset.
SECTIONS = ("extraction", "fits", "knn_memory", "knn_vs_faiss", "patching", "recipes", "fanout", "gpu")


def run(params: Params, *, quick: bool, out_dir: Path, only: list[str] | None = None) -> None:
    """Every section (or those in `only`, names from `SECTIONS`), and the report written to `out_dir`."""
    sizes = QUICK if quick else FULL
    started = time.time()
    report: dict[str, Any] = {
        "command": shlex.join(["lmgeo", *sys.argv[1:]]),
        "quick": quick,
        "started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "versions": versions(),
    }
    threads = {stage: params.ray.resources_for(stage).threads for stage in ("extract", "fit", "perturb", "train")}
    runner = run_here if quick else run_fresh  # peak-memory measurements always get fresh processes
    sections = {
        "extraction": lambda: extraction_section(
            sizes.extraction, params.analysis.batch_size, threads["extract"], runner
        ),
        # Always a fresh process: the reference's BLAS threads are set when NumPy loads (`fits_vs_reference`).
        "fits": lambda: [
            run_fresh(fits_vs_reference, threads["fit"], scale=s, cfg=params.analysis) for s in sizes.fits
        ],
        "knn_memory": lambda: knn_section(sizes.knn, params.analysis.k, threads["fit"]),
        # One thread: the bar compares with FAISS on one thread (SPEC §7), as a fit task runs.
        "knn_vs_faiss": lambda: runner(knn_vs_faiss, 1, sizes=sizes.knn_vs_faiss, k=params.analysis.k),
        "patching": lambda: runner(suffix_vs_full, threads["perturb"], size=sizes.patching),
        "recipes": lambda: (
            runner(recipe_step_times, threads["train"], size=sizes.recipes, train=params.train)
            | {"muon_kernels": muon_kernels(sizes.recipes, params.train, threads["train"])}
        ),
        "fanout": lambda: fanout(params, sizes.fanout),
        "gpu": lambda: gpu(params, sizes, threads["extract"]),
    }
    assert tuple(sections) == SECTIONS, "SECTIONS lists every section, in order"
    for name in [name for name in SECTIONS if only is None or name in only]:
        measure = sections[name]
        section_start = time.time()
        print(f"bench: {name} …", flush=True)
        report[name] = measure()
        print(f"bench: {name} done in {time.time() - section_start:.0f} s", flush=True)
    report["load_average_at_end"] = list(os.getloadavg())
    report["wall_s"] = time.time() - started
    write_report(collect_bars(report), out_dir)


def collect_bars(report: dict[str, Any]) -> dict[str, Any]:
    """Move every section's `bars` and `profile` to the top-level `ratios` table and `profiles`."""
    report["ratios"], report["profiles"] = [], {}
    parts = [
        section
        for name in SECTIONS
        if name in report and name != "gpu"
        for section in (report[name] if isinstance(report[name], list) else [report[name]])
    ]
    for section in parts:
        report["ratios"] += section.pop("bars")
        report["profiles"] |= section.pop("profile", {})
    return report


def write_report(report: dict[str, Any], out_dir: Path) -> None:
    plain = to_jsonable(report)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(plain, indent=1, allow_nan=False) + "\n")
    (out_dir / "bench.md").write_text(render_markdown(plain))
    failed = sum(not b["passed"] for b in plain["ratios"])
    print(f"bench: {len(plain['ratios']) - failed}/{len(plain['ratios'])} bars met; wrote {out_dir / 'bench.md'}")


# ------------------------------------------------------------------------------------------ fan-out
def fanout(params: Params, size: FanoutSize) -> dict[str, Any]:
    """The fit stage's (layer, class) tasks with 1 and 2 Ray workers, interleaved 1 2 1 2 …"""
    import ray

    if ray.is_initialized():
        raise RuntimeError("lmgeo bench starts its own Ray for each worker count; run it in a fresh process")
    bench_params = _fanout_params(params, size)
    load_before = list(os.getloadavg())
    seconds: dict[str, list[float]] = {str(n): [] for n in FANOUT_WORKERS}
    outputs = []
    with tempfile.TemporaryDirectory(prefix="lmgeo-bench-") as tmp:
        activations = _write_activations(Path(tmp) / "activations", size)
        for rep in range(size.repeats):
            for n_workers in FANOUT_WORKERS:
                layout = _run_layout(Path(tmp) / f"run-{n_workers}-{rep}", activations)
                elapsed = _timed_fit_stage(layout, bench_params, size, n_workers, params.ray.max_in_flight)
                seconds[str(n_workers)].append(elapsed)
                outputs.append(_read_fits(layout))
    same = all(_same_tables(outputs[0], other) for other in outputs[1:])
    speedup = float(np.median(np.array(seconds["1"]) / np.array(seconds["2"])))
    return {
        "size": size,
        "seconds": seconds,
        "same_outputs": same,
        "speedup": speedup,
        "load_average": {"before": load_before, "after": list(os.getloadavg())},
        "cores": os.cpu_count(),
        "bars": [
            bar(
                "fan-out: fit stage, 2 Ray workers vs 1 (speed-up)",
                speedup,
                ">=",
                1.6,
                note="outputs identical" if same else "OUTPUTS DIFFER between runs",
                extra_ok=same,
            )
        ],
    }


def _fanout_params(params: Params, size: FanoutSize) -> Params:
    """The study's analysis params on the benchmark's activations; one CPU (and thread) per fit task."""
    analysis = params.analysis.model_copy(
        update={"anchors": size.anchors, "classes": list(size.classes), "pool_size": None, "k": identifiable_k(size.d)}
    )
    ray_cfg = params.ray.model_copy(update={"tasks": {**params.ray.tasks, "fit": TaskResources(num_cpus=1)}})
    return params.model_copy(update={"analysis": analysis, "ray": ray_cfg})


def _write_activations(root: Path, size: FanoutSize) -> Path:
    states = synthetic_states(size.n_seq, size.seq_len, size.d, size.n_layers, seed=6)
    tokens = token_ids(size.n_seq, size.seq_len, vocab=1000, seed=6)
    with ShardWriter(root, ACTIVATION_SHARD, ACTIVATION_KEY) as writer:
        for layer, batch in enumerate(activation_batch(states, size.seq_len, tokens)):
            writer.write({"model": FANOUT_MODEL, "layer": layer}, batch)
    return root


def _run_layout(root: Path, activations: Path) -> Layout:
    """A workspace of its own for one run, sharing the activations (each run writes its own fits)."""
    layout = Layout(root.resolve())
    layout.activations.parent.mkdir(parents=True)
    layout.activations.symlink_to(activations.resolve(), target_is_directory=True)
    return layout


def _timed_fit_stage(layout: Layout, params: Params, size: FanoutSize, n_workers: int, max_in_flight: int) -> float:
    import ray

    from lmgeo.core.execution import run_shards
    from lmgeo.stages.fit import fit_shard

    key = ManifestKey({"activations": "bench"}, "bench", "bench")
    shards = [
        fit_shard(layout, params, FANOUT_MODEL, layer, key, name, {ACTIVATION_SHARD: ACTIVATION_KEY})
        for layer in range(size.n_layers)
        for name in [f"{FANOUT_MODEL}/layer={layer}"]
    ]
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no network on the target machines
    ray.init(address="local", num_cpus=n_workers, num_gpus=0, include_dashboard=False, logging_level=logging.WARNING)
    try:
        warm = ray.remote(num_cpus=1)(warm_worker)
        ray.get([warm.remote(1.0) for _ in range(n_workers)])  # one per worker: imports are not timed
        start = time.perf_counter()
        run_shards(
            shards,
            TaskResources(num_cpus=1),
            max_in_flight=max_in_flight,
            max_retries=0,
            label=f"bench fan-out, {n_workers} worker(s)",
        )
        return time.perf_counter() - start
    finally:
        ray.shutdown()


def warm_worker(seconds: float) -> int:
    """A Ray task that makes its worker import what the fit tasks import, then holds it for `seconds`
    so that each of the N workers gets one; returns the worker's pid."""
    import torch  # noqa: F401 - the imports are the point

    import lmgeo.stages.fit  # noqa: F401
    import lmgeo.study_a.fits  # noqa: F401

    time.sleep(seconds)
    return os.getpid()


def _read_fits(layout: Layout) -> dict[str, Any]:
    import pyarrow.parquet as pq

    return {
        path.relative_to(layout.fits).parent.as_posix(): pq.read_table(path) for path in verified_files(layout.fits)
    }


def _same_tables(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(a[key].equals(b[key]) for key in a)


# ---------------------------------------------------------------------------------------------- GPU
def gpu(params: Params, sizes: BenchSizes, threads: int) -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"available": False, "reason": "No CUDA device on this machine: the GPU benchmarks did not run."}
    try:
        result = run_fresh(
            gpu_benchmarks, threads, sizes=sizes, cfg=params.analysis, batch_size=params.analysis.batch_size
        )
    except Exception as err:  # noqa: BLE001 - reported in bench.md, next to the CPU results that did run
        return {"available": True, "error": f"{type(err).__name__}: {err}"}
    return {"available": True, **result}
