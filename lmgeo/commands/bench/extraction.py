"""Extraction vs a bare forward (throughput), extraction's peak memory as tokens grow 4×, and the vector
encodings it could write (why the stored one was chosen)."""

from __future__ import annotations

import itertools
import math
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from lmgeo.commands.bench.measure import (
    Runner,
    bar,
    current_rss_bytes,
    interleaved,
    peak_rss_bytes,
    profile_top,
    run_fresh,
)
from lmgeo.commands.bench.sizes import ExtractionSize
from lmgeo.commands.bench.synthetic import token_ids


def _extraction_model(size: ExtractionSize) -> Any:
    from lmgeo.models.registry import build_model

    return build_model(size.arch, size.model_size(), size.vocab, size.seq_len, seed=0).eval()


def extract_to_parquet(model: Any, tokens: np.ndarray, batch_size: int, root: Path, half: bool = False) -> int:
    """The extract stage's path for one shard: hooks, Arrow batches, `ShardWriter` (atomic, manifest); float16
    vectors with `half`. Timed repeatedly, give each call a `root` of its own (`fresh_roots`): a shard written
    again first deletes its previous files, which the stage does only when it redoes a shard."""
    from lmgeo.core.store import ManifestKey, ShardWriter
    from lmgeo.study_a.extract import extract_batches

    key = ManifestKey({"tokens": "bench"}, "bench", "bench")
    seq_ids = np.arange(len(tokens), dtype=np.int32)
    rows = 0
    with ShardWriter(root, "bench/seq=0", key) as writer:
        for layer, batch in extract_batches(model, tokens, seq_ids, batch_size, half=half):
            writer.write({"model": "bench", "layer": layer}, batch)
            rows += batch.num_rows
    return rows


def fresh_roots(folder: Path) -> Callable[[], Path]:
    """A new, empty folder under `folder` at each call."""
    calls = itertools.count()
    return lambda: folder / str(next(calls))


def bare_forward(model: Any, tokens: np.ndarray, batch_size: int) -> int:
    """A plain transformers forward asking for `output_hidden_states`, on the same batches. The base
    model (no LM head, no KV cache), as extraction runs it, so the ratio prices hooks and writing only."""
    import torch

    with torch.inference_mode():
        for start in range(0, len(tokens), batch_size):
            ids = torch.as_tensor(tokens[start : start + batch_size], dtype=torch.long)
            out = model.base_model(input_ids=ids, output_hidden_states=True, use_cache=False)
            assert len(out.hidden_states) > 1
    return tokens.size


def forward_flops_per_token(size: ExtractionSize) -> float:
    """Kaplan et al. (2020): `2·N + 2·L·T·d` per token, N the non-embedding parameters (`12·L·d²`): the base
    model's forward, without the LM head, which neither extraction nor the bare forward runs."""
    return 2 * 12 * size.n_layers * size.d_model**2 + 2 * size.n_layers * size.seq_len * size.d_model


def extraction_throughput(size: ExtractionSize, batch_size: int, threads: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    model = _extraction_model(size)
    tokens = token_ids(size.n_seq, size.seq_len, size.vocab, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        cases: dict[str, Callable[..., Any]] = {
            "extract_path": lambda roots=fresh_roots(Path(tmp)): extract_to_parquet(model, tokens, batch_size, roots()),
            "bare_forward": lambda: bare_forward(model, tokens, batch_size),
        }
        timings = interleaved(cases, size.repeats)
        ratio = 1 / timings.ratio("extract_path", "bare_forward")  # throughput ratio
        verdict = bar(
            "extraction: extract path / bare HF forward (tokens/s)",
            ratio,
            ">=",
            EXTRACTION_BAR,
            note=f"{math.ceil(len(tokens) / batch_size)} forward(s) of ≤ {batch_size} sequences per shard",
        )
        profile = [] if verdict.passed else profile_top(cases["extract_path"])
    n_tokens = tokens.size
    return {
        "model": {**asdict(size), "params": sum(p.numel() for p in model.parameters())},
        "batch_size": batch_size,
        "tokens_per_repeat": n_tokens,
        "tokens_per_s": {case: n_tokens / timings.median(case) for case in cases},
        "timings": timings.summary(),
        "bars": [verdict],
        "profile": {verdict.name: profile} if profile else {},
    }


# The extract path must keep up with a bare forward: its writes, hashes and fsyncs overlap the next batch's forward.
EXTRACTION_BAR = 1.0


def extraction_peak_rss(size: ExtractionSize, n_seq: int, batch_size: int, threads: int) -> dict[str, int]:
    """Peak RSS of a fresh process that builds the model and extracts `n_seq` sequences to Parquet."""
    import torch

    torch.set_num_threads(threads)
    model = _extraction_model(size)
    tokens = token_ids(n_seq, size.seq_len, size.vocab, seed=2)
    after_setup = current_rss_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        extract_to_parquet(model, tokens, batch_size, Path(tmp))
    return {"tokens": int(tokens.size), "rss_after_setup_bytes": after_setup, "peak_rss_bytes": peak_rss_bytes()}


RSS_REPEATS = 2


def extraction_section(
    size: ExtractionSize, batch_size: int, threads: int, runner: Runner = run_fresh
) -> dict[str, Any]:
    section = runner(extraction_throughput, threads, size=size, batch_size=batch_size)
    # Each size's peak is the highest of `RSS_REPEATS` fresh processes: the allocator's layout makes one
    # process's peak vary by ~15% at these sizes (measured: 641–727 MiB for the same 2 batches).
    runs = [
        max(
            (
                run_fresh(extraction_peak_rss, threads, size=size, n_seq=n * batch_size, batch_size=batch_size)
                for _ in range(RSS_REPEATS)
            ),
            key=lambda run: run["peak_rss_bytes"],
        )
        for n in size.rss_batches
    ]
    growth = runs[1]["peak_rss_bytes"] / runs[0]["peak_rss_bytes"]
    section["peak_rss"] = runs
    section["vector_encodings"] = runner(
        vector_encodings, threads, rows=size.encoding_rows, d=size.d_model, repeats=size.repeats
    )
    section["bars"].append(
        bar(
            "extraction: peak RSS, 4× the tokens",
            growth,
            "<=",
            1.15,
            note=f"{runs[0]['tokens']} → {runs[1]['tokens']} tokens, whole process, nothing subtracted",
        )
    )
    return section


def vector_encodings(rows: int, d: int, repeats: int, threads: int) -> dict[str, Any]:
    """Write and read speed of three encodings of the same `rows` float32 vectors of width `d`, with the
    activations' id columns, to files in the page cache (no fsync: the disk is the same for all three), as GB/s
    of vector bytes: Parquet with a `fixed_size_list<float32>` column (vector format 1: a repetition and a
    definition level per float), Parquet with `lmgeo.vector` (fixed-size binary, format 2, what is stored) and
    Arrow IPC (no Parquet; DuckDB could read it too, but every dataset would leave Parquet). Interleaved; a
    read decodes to an `(rows, d)` float32 array. Why format 2: docs/benchmarks.md."""
    import pyarrow as pa
    import pyarrow.ipc as ipc
    import pyarrow.parquet as pq

    from lmgeo.core.contracts import arrow_to_vectors, vectors_to_arrow
    from lmgeo.core.store import _encoding

    del threads  # one writer thread, as one partition file is written
    x = np.random.default_rng(5).standard_normal((rows, d)).astype(np.float32)
    ids = [pa.array(np.arange(rows, dtype=np.int32))] * 3
    names = ["seq_id", "pos", "token_id", "h"]
    columns = {
        "parquet fixed_size_list (format 1)": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), d),
        "parquet lmgeo.vector (format 2)": vectors_to_arrow(x),
        "arrow ipc": vectors_to_arrow(x),
    }

    def parquet_write(path: Path, column: Any) -> None:
        table = pa.Table.from_arrays([*ids, column], names=names)
        with pq.ParquetWriter(path, table.schema, **_encoding(table.schema)) as writer:
            writer.write_table(table)

    def parquet_read(path: Path) -> np.ndarray:
        column = pq.read_table(path)["h"]
        if pa.types.is_fixed_size_list(column.type):  # format 1's decoding, as it was
            return column.combine_chunks().flatten().to_numpy().reshape(-1, d)
        return arrow_to_vectors(column)

    def ipc_write(path: Path, column: Any) -> None:
        table = pa.Table.from_arrays([*ids, column], names=names)
        with ipc.new_file(str(path), table.schema) as writer:
            writer.write_table(table)

    def ipc_read(path: Path) -> np.ndarray:
        with pa.OSFile(str(path)) as source:
            return arrow_to_vectors(ipc.open_file(source).read_all()["h"])

    ways = {name: (ipc_write, ipc_read) if name == "arrow ipc" else (parquet_write, parquet_read) for name in columns}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {name: Path(tmp) / f"{i}.bin" for i, name in enumerate(columns)}
        cases: dict[str, Callable[..., Any]] = {
            f"write {n}": (lambda n=n: ways[n][0](paths[n], columns[n])) for n in columns
        }
        cases |= {f"read {n}": (lambda n=n: ways[n][1](paths[n])) for n in columns}
        timings = interleaved(cases, repeats)
        same = all(np.array_equal(timings.results[f"read {n}"][-1], x) for n in columns)
        sizes = {n: paths[n].stat().st_size for n in columns}
    return {
        "rows": rows,
        "d": d,
        "vector_bytes": x.nbytes,
        "same_vectors": same,
        "encodings": {
            n: {
                "write_gb_s": x.nbytes / timings.median(f"write {n}") / 1e9,
                "read_gb_s": x.nbytes / timings.median(f"read {n}") / 1e9,
                "file_bytes": sizes[n],
            }
            for n in columns
        },
    }
