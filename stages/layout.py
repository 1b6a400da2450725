"""Where each stage reads and writes inside the workspace (the folder holding dvc.yaml).

These paths are the data contract of SPEC §2; `dvc.yaml` names the same ones. Ray tasks get the
absolute `Layout`, so they never depend on a worker's current directory (on a cluster, the workspace
must be a path that every node sees).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Layout:
    root: Path

    @classmethod
    def here(cls) -> Layout:
        return cls(Path.cwd().resolve())

    @property
    def tokens(self) -> Path:
        return self.root / "data" / "tokens"

    @property
    def tokenizer(self) -> Path:
        return self.root / "data" / "tokenizer"

    @property
    def models(self) -> Path:
        return self.root / "data" / "models"

    @property
    def train(self) -> Path:
        return self.root / "data" / "train"

    @property
    def activations(self) -> Path:
        return self.root / "data" / "activations"

    @property
    def fits(self) -> Path:
        return self.root / "data" / "fits"

    @property
    def perturb(self) -> Path:
        return self.root / "data" / "perturb"

    @property
    def reports(self) -> Path:
        return self.root / "reports"

    def run_dir(self, run_id: str) -> Path:
        return self.models / run_id

    def steps_file(self, run_id: str) -> Path:
        return self.train / f"run={run_id}" / "steps.parquet"
