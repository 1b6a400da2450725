"""The data contracts of SPEC §2–§4, each declared once: what every dataset holds, how it is partitioned,
how ids are written, and the one reader per dataset.

A dataset here is a *shape* (columns, vector columns, hive partitions, row order); where it lives in a
workspace is the glue's knowledge (`lmgeo/driver/layout.py`), so every reader takes the dataset's root folder.
Readers see only the files of complete, verified shards (`lmgeo.core.store`), never a stray file.

Ids:
- a run is `<arch>-<recipe>-s<seed>`; a run of the matched-budget sweep is `<arch>-<recipe>-s<seed>-cap<tau>`
  (its head step matched to `tau` nats, written positionally: `0.4`, never `4e-01`) (`run_id`,
  `parse_run_id`); names are `[a-z0-9_.]`, `-` only separates;
- a model is `<run>@init` / `<run>@final` in tables and `<run>.init` / `<run>.final` in partition paths;
  an external model is its hub id or workspace path (without `./`) in tables and the same with `/` → `--`
  in paths (`path_id`, `table_id`, and `table_id_sql` for the same inverse inside DuckDB).
"""

from __future__ import annotations

import dataclasses
import decimal
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from lmgeo.core.errors import InputError

# ------------------------------------------------------------------------------------------- run ids
_NAME = r"[a-z0-9_.]+"
CAPPED = "-cap"  # the suffix of a matched-budget sweep run (SPEC §3.2)
_RUN = rf"({_NAME})-({_NAME})-s([0-9]+)({CAPPED}([0-9]+(?:\.[0-9]+)?))?"
# groups: arch, recipe, seed, the sweep suffix (empty when absent), the budget in nats (empty when absent)
RUN_ID_PATTERN = rf"^{_RUN}$"
CHECKPOINTS = ("init", "final")


@dataclass(frozen=True)
class RunSpec:
    arch: str
    recipe: str
    seed: int
    matched: bool = False  # a run of the matched-budget sweep (`train.matched_budget`)
    cap: float | None = None  # its head budget in nats (a sweep run), else None

    @property
    def run_id(self) -> str:
        return run_id(self.arch, self.recipe, self.seed, self.matched, self.cap)


def run_id(arch: str, recipe: str, seed: int, matched: bool = False, cap: float | None = None) -> str:
    if (cap is not None) != matched:
        raise ValueError("a run of the matched-budget sweep has a budget (cap), and only such a run")
    suffix = CAPPED + _positional(cap) if cap is not None else ""
    run = f"{arch}-{recipe}-s{seed}{suffix}"
    if not re.match(RUN_ID_PATTERN, run):
        raise ValueError(f"{run!r} is not a valid run id (names are [a-z0-9_.], seeds and caps non-negative)")
    return run


def parse_run_id(run: str) -> RunSpec:
    match = re.match(RUN_ID_PATTERN, run)
    if not match:
        raise ValueError(f"{run!r} is not a run id `<arch>-<recipe>-s<seed>[{CAPPED}<tau>]`")
    return RunSpec(match[1], match[2], int(match[3]), bool(match[4]), float(match[5]) if match[5] else None)


def _positional(value: float) -> str:
    """The shortest decimal that reads back as `value`, without an exponent (whose `-` would split an id)."""
    return format(decimal.Decimal(repr(float(value))), "f")


# ----------------------------------------------------------------------------------------- model ids
_TRAINED_PATH = re.compile(rf"^{_RUN}\.(init|final)$")
_TRAINED_TABLE = re.compile(rf"^{_RUN}@(init|final)$")
_EXTERNAL = re.compile(r"^[A-Za-z0-9_.\-/]+$")


def trained_model_id(run: str, checkpoint: str) -> str:
    """The table id of a trained run's checkpoint: `<run>@<checkpoint>`."""
    if checkpoint not in CHECKPOINTS:
        raise ValueError(f"checkpoint must be one of {CHECKPOINTS}, got {checkpoint!r}")
    return f"{run}@{checkpoint}"


def external_table_id(ref: str) -> str:
    """An external model's table id: the id as given, without a leading `./` or trailing `/`."""
    return ref.removeprefix("./").rstrip("/")


def check_external_id(ref: str) -> None:
    """Refuse ids that cannot round-trip through a partition path (`path_id` ↔ `table_id`)."""
    table = external_table_id(ref)
    problem = None
    if not _EXTERNAL.match(table):
        problem = "only letters, digits, '_', '.', '-' and '/' can be used (give a path inside the workspace)"
    elif "--" in table or table in (".", ".."):
        problem = "'--' is reserved: partition paths write '/' as '--'"
    elif _TRAINED_TABLE.match(table):
        problem = "it has the form of a trained run's checkpoint id"
    if problem:
        raise ValueError(f"external model id {ref!r} cannot be used: {problem}")


def path_id(table_id: str) -> str:
    """A model's partition-path id from its table id."""
    if _TRAINED_TABLE.match(table_id):
        return table_id.replace("@", ".")
    return table_id.replace("/", "--")


def table_id(path: str) -> str:
    """The inverse of `path_id`."""
    if _TRAINED_PATH.match(path):
        return path[: path.rindex(".")] + "@" + path[path.rindex(".") + 1 :]
    return path.replace("--", "/")


def table_id_sql(column: str) -> str:
    """`table_id` as a DuckDB expression over a column of path ids."""
    trained = _TRAINED_PATH.pattern
    return (
        f"CASE WHEN regexp_matches({column}, '{trained}') "
        f"THEN regexp_replace({column}, '\\.(init|final)$', '@\\1') "
        f"ELSE replace({column}, '--', '/') END"
    )


# ------------------------------------------------------------------------------------------- vectors
# How a vector column is stored (SPEC §1): each row's d values as one fixed-size binary value of d·itemsize
# bytes (little-endian float32, or float16 for `analysis.vector_dtype: float16`), typed by Arrow's canonical
# `arrow.opaque` extension with the vendor `lmgeo.vector` and the element type as its type name: self-describing
# in every file and column, and implemented in Arrow's C++ (a Python extension type needs the GIL wherever a
# C++ thread reads a file's schema, which deadlocked DuckDB's multi-threaded scans). Not a Parquet list: a list
# column carries a repetition and a definition level per float, which made writing 2.5–4× and reading 3–4×
# slower (`lmgeo bench --only extraction`, docs/benchmarks.md). `vectors_to_arrow` is the one encoder;
# `arrow_to_vectors` (NumPy) and `vectors_as_lists` (the DuckDB views of `lmgeo query`) the decoders.
VECTOR_FORMAT = 2  # 1: `fixed_size_list<float32>[d]` (until this format; refused with how to rewrite the data)
VECTOR_DTYPES: dict[str, np.dtype] = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2")}
VECTOR_VENDOR = "lmgeo.vector"


class OldVectorFormat(InputError):
    """Vectors written in an earlier storage format than `VECTOR_FORMAT`."""


def vector_type(d: int, half: bool = False) -> pa.DataType:
    """The type of a stored vector column of dimension `d` (float16 with `half`)."""
    dtype = "float16" if half else "float32"
    if d < 1:
        raise ValueError(f"vector dimension must be >= 1, got {d}")
    return pa.opaque(pa.binary(d * VECTOR_DTYPES[dtype].itemsize), type_name=dtype, vendor_name=VECTOR_VENDOR)


def is_vector_type(kind: pa.DataType) -> bool:
    return isinstance(kind, pa.OpaqueType) and kind.vendor_name == VECTOR_VENDOR


def vector_shape(kind: pa.DataType) -> tuple[int, str]:
    """(d, element type) of a stored vector column's type."""
    item = VECTOR_DTYPES[kind.type_name]
    return kind.storage_type.byte_width // item.itemsize, kind.type_name


def vectors_to_arrow(x: np.ndarray, half: bool = False, null: np.ndarray | None = None) -> pa.ExtensionArray:
    """An `(n, d)` array as a column of `vector_type(d, half)`; rows where `null` is true are null. Zero-copy
    for a C-contiguous float32 array (the column keeps a reference to it)."""
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[1] < 1:
        raise ValueError(f"expected an (n, d) array with d >= 1, got shape {x.shape}")
    kind = vector_type(x.shape[1], half)
    values = np.ascontiguousarray(x, dtype=VECTOR_DTYPES[kind.type_name])
    validity = None if null is None or not np.any(null) else pa.array(~np.asarray(null, dtype=bool)).buffers()[1]
    storage = pa.Array.from_buffers(kind.storage_type, len(x), [validity, pa.py_buffer(values)])
    return pa.ExtensionArray.from_storage(kind, storage)


def arrow_to_vectors(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A vector column as an `(n, d)` float32 array.

    Takes a stored column (`vector_type`) and the plain `list<float>` that DuckDB returns for one (the
    vector views of `lmgeo query`), as long as every row has the same length. A single float32 chunk is
    returned without copying, as a read-only view of the Arrow buffer. Null rows are refused."""
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    parts = [_chunk_to_vectors(chunk) for chunk in chunks if len(chunk)]
    if len(parts) == 1:
        return parts[0]
    if not parts:
        _check_vector_type(col.type)
        return np.empty((0, vector_shape(col.type)[0] if is_vector_type(col.type) else 0), dtype=np.float32)
    if len({p.shape[1] for p in parts}) > 1:
        raise ValueError(f"vector column mixes lengths {sorted({p.shape[1] for p in parts})}")
    return np.concatenate(parts)


def _check_vector_type(kind: pa.DataType, rewrite: str = "") -> None:
    """Refuse a column that is not a vector column, naming the command that rewrites one in an old format."""
    if is_vector_type(kind) or pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return
    if pa.types.is_fixed_size_list(kind):
        raise OldVectorFormat(
            f"vectors stored as {kind}, lmgeo's storage before vector format {VECTOR_FORMAT}: rewrite them with "
            + (
                rewrite
                or "the stage that wrote them (`lmgeo extract` for activations, `lmgeo fit` for fits; "
                "`dvc repro` redoes both)"
            )
        )
    raise TypeError(f"expected a vector column (`{VECTOR_VENDOR}`, or a list from DuckDB), got {kind}")


def _chunk_to_vectors(chunk: pa.Array) -> np.ndarray:
    _check_vector_type(chunk.type)
    if chunk.null_count:
        raise ValueError(f"vector column has {chunk.null_count} null rows")
    if is_vector_type(chunk.type):
        (d, dtype), storage = vector_shape(chunk.type), chunk.storage
        data = np.frombuffer(
            storage.buffers()[1],
            VECTOR_DTYPES[dtype],
            count=len(chunk) * d,
            offset=storage.offset * chunk.type.storage_type.byte_width,
        )
        return data.reshape(-1, d).astype(np.float32, copy=False)
    lengths = np.unique(chunk.value_lengths().to_numpy())
    if len(lengths) != 1:
        raise ValueError(f"vector column has rows of different lengths {lengths.tolist()}")
    values = chunk.flatten()  # honours the chunk's offset when it is a slice
    return values.to_numpy(zero_copy_only=False).astype(np.float32, copy=False).reshape(-1, int(lengths[0]))


def vectors_as_lists(blobs: pa.Array | pa.ChunkedArray, dtype: str) -> pa.ListArray:
    """Stored vectors of element type `dtype` as DuckDB hands them to a function (`BLOB`: Arrow `binary`,
    the raw bytes) → `list<float32>`, null rows kept: the decoding behind `lmgeo query`'s vector views."""
    blobs = blobs.combine_chunks() if isinstance(blobs, pa.ChunkedArray) else blobs
    item = VECTOR_DTYPES[dtype]
    wide = pa.types.is_large_binary(blobs.type)
    offsets = np.frombuffer(
        blobs.buffers()[1],
        np.int64 if wide else np.int32,
        count=len(blobs) + 1,
        offset=blobs.offset * (8 if wide else 4),
    )
    raw = np.frombuffer(blobs.buffers()[2] or b"", np.uint8)[offsets[0] : offsets[-1]]
    values = raw.view(item).astype(np.float32, copy=False)
    starts = ((offsets - offsets[0]) // item.itemsize).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(starts), pa.array(values), mask=blobs.is_null())


def stored_vector_dtype(files: Sequence[Path], dataset: Dataset, column: str) -> str | None:
    """The element type of the stored vector `column` in every one of `files` (read from their Parquet
    footers), None without files; `OldVectorFormat` for a file in an earlier format, and an error for a
    dataset that mixes element types."""
    found: dict[str, Path] = {}
    for path in files:
        schema = pq.read_schema(path)
        if column not in schema.names:  # a file without the column reads it as null
            continue
        kind = schema.field(column).type
        check_stored_vectors(path, dataset, kind)
        found.setdefault(vector_shape(kind)[1], path)
    if len(found) > 1:
        raise InputError(
            f"{dataset.name}: vectors of {column!r} are stored as {', '.join(sorted(found))} in one "
            f"dataset ({', '.join(map(str, found.values()))}); re-run `lmgeo {dataset.written_by}`"
        )
    return next(iter(found), None)


def check_stored_vectors(path: Path, dataset: Dataset, kind: pa.DataType) -> None:
    """A vector column read from `path` must be stored as `lmgeo.vector` (the current format)."""
    if not is_vector_type(kind):
        try:
            _check_vector_type(kind, f"`lmgeo {dataset.written_by}` (or `dvc repro`)")
        except OldVectorFormat as err:
            raise OldVectorFormat(f"{path}: {err}") from None
        raise InputError(
            f"{path}: a vector column of {dataset.name} is stored as {kind}, not `{VECTOR_VENDOR}`; "
            f"re-run `lmgeo {dataset.written_by}`"
        )


# ------------------------------------------------------------------------------------------ datasets
VECTOR = pa.binary()  # placeholder type of a vector column in a declaration: `vector_type(d)` in a file


@dataclass(frozen=True)
class Dataset:
    """A hive-partitioned Parquet dataset: columns in file order (vector columns typed `VECTOR`),
    partition columns with their types, and the order rows are read in."""

    name: str
    fields: tuple[pa.Field, ...]
    partitions: tuple[pa.Field, ...]
    written_by: str  # the stage (`lmgeo <stage>`) that writes it, named in every error about it
    order: tuple[str, ...] = ()

    @property
    def vectors(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields if f.type == VECTOR)

    @property
    def scalar_schema(self) -> pa.Schema:
        """The columns SQL sees: every scalar column, never a vector."""
        return pa.schema([f for f in self.fields if f.type != VECTOR])

    @property
    def partition_schema(self) -> pa.Schema:
        return pa.schema(self.partitions)

    @property
    def declared_schema(self) -> pa.Schema:
        """The declaration as one schema (columns, vectors with their placeholder type, partitions, read
        order): what a shard's code version holds of this contract."""
        return pa.schema(self.fields + self.partitions, metadata={"order": ",".join(self.order)})

    def file_schema(self, d: int | None = None, half: bool = False) -> pa.Schema:
        """The schema a shard file is written with; vectors of dimension `d` (float16 with `half`)."""
        if self.vectors and d is None:
            raise ValueError(f"{self.name}: the vector dimension d is needed for its file schema")
        return pa.schema(
            [pa.field(f.name, vector_type(d, half)) if f.type == VECTOR and d is not None else f for f in self.fields]
        )

    def partition_values(self, relative: Path) -> dict[str, Any]:
        """`{"model": "m", "layer": 3}` from a file path `model=m/layer=3/part-….parquet`, typed."""
        values: dict[str, Any] = {}
        for part in relative.parts[:-1]:
            key, _, value = part.partition("=")
            values[key] = int(value) if pa.types.is_integer(self.partition_schema.field(key).type) else value
        return values


def _fields(*names: str, kind: pa.DataType) -> tuple[pa.Field, ...]:
    return tuple(pa.field(name, kind) for name in names)


IDS = _fields("seq_id", "pos", "token_id", kind=pa.int32())
MODEL_LAYER = (pa.field("model", pa.string()), pa.field("layer", pa.int32()))

STEPS = Dataset(
    "steps",
    fields=_fields("step", "tokens", kind=pa.int64())
    + _fields("lr", "train_loss", "val_loss", "head_diam", kind=pa.float64())
    + (pa.field("head_diam_sampled", pa.bool_()),)
    + _fields(
        "head_update_rms",
        "head_update_spectral",
        "hilbert_realized",
        "hilbert_bound",
        "equi_ratio",
        "equi_ratio_random",
        "equi_ratio_bound",
        "head_alignment",
        "head_alignment_hilbert",
        "hilbert_realized_train",
        "head_step_scale",
        kind=pa.float64(),
    ),
    partitions=(pa.field("run", pa.string()),),
    written_by="train",
    order=("step",),
)
ACTIVATIONS = Dataset("activations", IDS + (pa.field("h", VECTOR),), MODEL_LAYER, "extract", order=("seq_id", "pos"))
FIT_METRICS = (
    "rel_err",
    "rel_err_state",
    "cos_full_tok",
    "cos_full_res",
    "angle_res_tok",
    "proj_full",
    "proj_res",
    "proj_full_global",
    "proj_res_global",
    "norm_full",
    "norm_res",
)
# Per-anchor facts about the fit itself (SPEC §4.5): the numerical rank of the neighbours' inputs (null for
# a layer-wide fit), whether the map's value at the anchor is determined by the data (else the value metrics,
# `patched` and the KLs are null) and whether the map itself is (else `proj_full`, `proj_res` and
# `subspace_tied`, `subspace_dim` are null), whether an iterative fit met its convergence criterion (null for a
# closed form), whether the dominant subspace's cut went past p to keep a tie of singular values whole, and the
# dimension it kept (`lmgeo.study_a.geometry.dominant`).
FIT_FLAGS = (
    pa.field("input_rank", pa.int32()),
    pa.field("value_identified", pa.bool_()),
    pa.field("operator_identified", pa.bool_()),
    pa.field("converged", pa.bool_()),
    pa.field("subspace_tied", pa.bool_()),
    pa.field("subspace_dim", pa.int32()),
)
# The metrics that need only the map's value at the anchor (the rest, `proj_full` and `proj_res`, need the map).
VALUE_METRICS = tuple(name for name in FIT_METRICS if name not in ("proj_full", "proj_res"))
FITS = Dataset(
    "fits",
    # `locality`: the anchor's k-th neighbour distance over the pool's median pair distance (null layer-wide).
    fields=(pa.field("sample", pa.string()),)
    + IDS
    + (pa.field("k", pa.int32()), pa.field("locality", pa.float64()))
    + _fields(*FIT_METRICS, kind=pa.float64())
    + FIT_FLAGS
    + (pa.field("patched", VECTOR), pa.field("n_nonfinite", pa.int32()), pa.field("n_distinct", pa.int32())),
    partitions=MODEL_LAYER + (pa.field("fn", pa.string()),),
    written_by="fit",
    order=("sample", "seq_id", "pos"),
)
# `kl`, `kl_seq`: the real patch T(h_l); `kl_random`, `kl_other`: the null patches h_{l+1} − r̃ with r̃ a
# random direction (the mean KL over `n_random` of them), or another anchor's residual (null where the layer
# has fewer than two patched anchors), rescaled to ‖r‖ (SPEC §4.5); `kl_directions`: the KL of each of the
# `n_random` random directions, in draw order (the claims compare the real patch with one direction at a time).
# Rows of the `real` sample only.
PERTURB_METRICS = ("kl", "kl_seq", "kl_random", "kl_other")
PERTURB = Dataset(
    "perturb",
    fields=_fields("seq_id", "pos", kind=pa.int32())
    + _fields(*PERTURB_METRICS, kind=pa.float64())
    + (pa.field("n_random", pa.int32()), pa.field("kl_directions", pa.list_(pa.float64()))),
    partitions=FITS.partitions,
    written_by="perturb",
    order=("seq_id", "pos"),
)
TOKENS_SCHEMA = pa.schema([pa.field("token_id", pa.int32())])  # `<split>.parquet`, one row per token
SPLITS = ("train", "val", "test")

# Result tables (`reports/tables/<name>.parquet`), written by `lmgeo.results.aggregate`.
RESULT_TABLES = (
    "runs",
    "curves",
    "recipes",
    "envelope",
    "baselines",
    "geometry",
    "geometry_pooled",
    "angles",
    "correlations",
    "claims",
    "claim_tests",
    "expressivity",
    "paper_values",
)
SHARDED = (STEPS, ACTIVATIONS, FITS, PERTURB)


# --------------------------------------------------------------------------------------- run record
@dataclass
class RunRecord:
    """A finished run, as `run.json` of its final checkpoint states it (and the `runs` table reads it)."""

    run: str
    arch: str
    recipe: str
    seed: int
    steps: int
    steps_done: int
    tokens: int
    final_train_loss: float | None
    final_val_loss: float | None
    final_test_loss: float | None  # None for runs that never see the test split (tuning)
    head_step: str  # the head step size it ran with, `tau=<nats>` or `head_lr=<η>`
    head_budget_tau: float | None  # the matched-budget cap of the run's head steps (nats), None: none
    diverged: bool
    diverged_at_step: int | None
    n_params: int
    params_hash: str

    @classmethod
    def arrow_schema(cls) -> pa.Schema:
        kinds = {str: pa.string(), int: pa.int64(), float: pa.float64(), bool: pa.bool_()}
        hints = typing.get_type_hints(cls)
        return pa.schema([pa.field(f.name, kinds[_base_type(hints[f.name])]) for f in dataclasses.fields(cls)])

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> RunRecord:
        values: dict[str, Any] = {f.name: record.get(f.name) for f in dataclasses.fields(cls)}
        return cls(**values)


def _base_type(hint: Any) -> type:
    """`float | None` → float."""
    if isinstance(hint, types.UnionType):
        return next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return hint


# ------------------------------------------------------------------------------------------ readers
def select(root: Path, dataset: Dataset, files: Sequence[Path], where: dict[str, Any]) -> list[Path]:
    """The files (of `root`, already verified) whose partition values equal every entry of `where`."""
    return [
        f for f in files if all(dataset.partition_values(f.relative_to(root)).get(k) == v for k, v in where.items())
    ]


def read(
    root: Path, dataset: Dataset, files: Sequence[Path], where: dict[str, Any], columns: Sequence[str] | None = None
) -> pa.Table:
    """The rows of `dataset` in the partition `where`, from the verified `files` of `root`, in the
    dataset's row order. Vector columns come back as written (`arrow_to_vectors` decodes them)."""
    chosen = select(root, dataset, files, where)
    if not chosen:
        raise InputError(f"{root}: no data for {where}; run `lmgeo {dataset.written_by}` first")
    parts = [pq.read_table(f, columns=list(columns) if columns else None) for f in chosen]
    for path, part in zip(chosen, parts, strict=True):
        for name in set(dataset.vectors) & set(part.column_names):
            check_stored_vectors(path, dataset, part.schema.field(name).type)
    table = pa.concat_tables(parts)
    order = [(c, "ascending") for c in dataset.order if c in table.column_names]
    return table.sort_by(order) if order else table


def read_result_tables(
    folder: Path, committed: Any = None, bad: dict[Path, Exception] | None = None
) -> dict[str, pa.Table]:
    """The result tables under `folder` (`RESULT_TABLES`, and any other the manifest lists), verified (and
    checked against what `committed` records, when given). With `bad`, a table that fails its check is left
    out and recorded there, so that it fails only the readers that need it."""
    from lmgeo.core.store import verified_files  # the store imports nothing of this module's readers

    files = verified_files(folder, rebuild="`lmgeo aggregate`", committed=committed, bad=bad)
    tables = {}
    for path in files:
        try:
            tables[path.stem] = read_bounded_table(path)
        except (OSError, pa.ArrowException, InputError) as err:
            if bad is None:
                raise InputError(f"{path}: unreadable result table ({err}); run `lmgeo aggregate`") from None
            bad[path] = err
    return tables


# The most a result table may take once decoded. The real tables take kilobytes to a few megabytes (a row
# per run, layer or claim); one past this is a dictionary or decompression bomb (a few KB of Parquet that
# decode to gigabytes, committed, so it arrives with a pull), refused before it is decoded.
MAX_TABLE_BYTES = 256 * 2**20


def read_bounded_table(path: Path) -> pa.Table:
    """The Parquet table at `path`; `InputError` where it would take more than `MAX_TABLE_BYTES` decoded."""
    parquet = pq.ParquetFile(path)
    meta = parquet.metadata
    chunks = [meta.row_group(i).column(j) for i in range(meta.num_row_groups) for j in range(meta.num_columns)]
    # Pages as stored, and a floor for the decoded values (8 bytes a cell: a value or an offset), which
    # counts cells that a page encodes in a few bytes (nulls, runs of one value).
    _check_size(path, sum(c.total_uncompressed_size for c in chunks), "its pages")
    _check_size(path, 8 * meta.num_rows * meta.num_columns, f"its {meta.num_rows} rows")
    text = [f.name for f in parquet.schema_arrow if _is_text(f.type)]
    # Text is read as indices into its dictionary, so that repeating one long entry decodes nothing.
    table = pq.read_table(path, read_dictionary=text)
    for name in text:
        column = table[name]
        entries = sum(pc.sum(pc.take(pc.binary_length(c.dictionary), c.indices)).as_py() or 0 for c in column.chunks)
        _check_size(path, entries, f"the text of column {name!r}")
        table = table.set_column(table.schema.get_field_index(name), name, column.cast(column.type.value_type))
    return table


def _is_text(kind: pa.DataType) -> bool:
    kind = kind.value_type if pa.types.is_dictionary(kind) else kind
    return pa.types.is_string(kind) or pa.types.is_binary(kind)


def _check_size(path: Path, size: int, what: str) -> None:
    if size > MAX_TABLE_BYTES:
        raise InputError(
            f"{path}: {what} take {size} bytes decoded, more than a result table may ({MAX_TABLE_BYTES}): "
            "not a table `lmgeo aggregate` wrote; run `lmgeo aggregate` (or `dvc checkout`) to rewrite it"
        )


def scan(
    root: Path, dataset: Dataset, files: Sequence[Path], filesystem: Any = None, vectors: bool = False
) -> ds.Dataset:
    """A lazy Arrow dataset over the verified `files` of `root` with the dataset's scalar columns (and its
    vector columns as their stored bytes, `binary`, with `vectors`: `vectors_as_lists` decodes them) and its
    typed partition columns, for DuckDB. Other
    columns are never read, missing columns read as null, narrower types (float32) are cast up. No files
    gives an empty dataset with the same columns, so every query runs unchanged on a study not run."""
    columns = [f for f in dataset.fields if vectors or f.type != VECTOR]
    full = pa.schema(columns + list(dataset.partition_schema))
    if not files:
        return ds.dataset(full.empty_table())
    partitioning = ds.partitioning(dataset.partition_schema, flavor="hive")
    return ds.dataset(
        [str(f) for f in files],
        schema=full,
        format="parquet",
        partitioning=partitioning,
        partition_base_dir=str(root),
        filesystem=filesystem,
    )
