"""The `prepare` section of params: corpus source and checksum, tokenizer, sequence length, splits."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from lmgeo.core.config import Fraction, PositiveInt, Section, Seed, Sha256


class CorpusConfig(Section):
    source: Literal["shakespeare", "files", "parquet"] = "shakespeare"
    # `files`: glob patterns of text files; `parquet`: a directory of Parquet files (or a saved
    # HF-datasets directory) with a text column.
    paths: list[str] = []
    text_column: str = "text"
    # sha256 of the corpus text as read (after normalisation); null = do not check.
    sha256: Sha256 | None = None
    max_chars: PositiveInt | None = None

    @model_validator(mode="after")
    def _paths_match_source(self) -> CorpusConfig:
        if self.source in ("files", "parquet") and not self.paths:
            raise ValueError(f"corpus.paths must name at least one path when source is {self.source!r}")
        return self


class TokenizerConfig(Section):
    kind: Literal["bpe", "gpt2", "local"] = "bpe"
    vocab_size: Annotated[int, Field(ge=256, le=262144)] = 4096  # used by `bpe` only
    path: str | None = None  # used by `local` only

    @model_validator(mode="after")
    def _path_for_local(self) -> TokenizerConfig:
        if self.kind == "local" and not self.path:
            raise ValueError("tokenizer.path is required when kind is 'local'")
        return self


class PrepareConfig(Section):
    corpus: CorpusConfig = CorpusConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    seq_len: Annotated[int, Field(ge=8, le=65536)] = 128
    val_fraction: Fraction = 0.1  # tuning and early decisions
    test_fraction: Fraction = 0.1  # held out: Study B's final comparison, never tuned on
    seed: Seed = 0

    @model_validator(mode="after")
    def _room_for_train(self) -> PrepareConfig:
        if self.val_fraction + self.test_fraction >= 1:
            raise ValueError("val_fraction + test_fraction must leave a train split (sum below 1)")
        return self

    def held_out(self) -> dict[str, float]:
        """The held-out splits and their fractions of the corpus, val first (adding test keeps val)."""
        return {"val": self.val_fraction, "test": self.test_fraction}
