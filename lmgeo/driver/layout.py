"""Where each dataset lives inside the workspace (the folder holding dvc.yaml): the one place, with
`dvc.yaml`, that knows the `data/` and `reports/` paths of SPEC §2.

Only the driver uses a `Layout`: Ray tasks never touch the workspace (their inputs and outputs travel through
Ray's object store, SPEC §1).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

WORKSPACE_FILES = ("dvc.yaml", "params.yaml")

# Committed records the report reads and states.
# The head step-size sweep behind the recipes' defaults (`lmgeo tune`); Study B's protocol states it.
TUNING_RECORD = "docs/tuning.json"
# Knobs tuned alone at the study's protocol since TUNING_RECORD was written (`lmgeo tune --recipe … --out …`):
# the report states them beside (or instead of) TUNING_RECORD's.
KNOB_RECORDS = ("docs/tuning-adamw-hidden/tuning.json", "docs/tuning-hilbert-equi/tuning.json")
# Study A's claims at other neighbourhood sizes (`presets/locality.yaml` says how it is made); the report cites it.
LOCALITY_SWEEP = "docs/locality/claim_tests.csv"
# The matched-budget sweep's committed tables (`presets/sweep.yaml`, `python -m scripts.sweep_record`): the report
# cites them when the study itself does not run the sweep.
SWEEP_RECORD = "docs/sweep"
# The committed records above as the paths whose change makes committed results stale (`lmgeo.driver.deps`);
# each is a dep of the report stage in dvc.yaml.
RECORDS = (TUNING_RECORD, *KNOB_RECORDS, str(Path(LOCALITY_SWEEP).parent), f"{SWEEP_RECORD}/provenance.json")
# The report's provenance, in reports/, as data: `tests/test_committed_results.py` checks the committed one
# against HEAD, and `lmgeo query`'s params view states the params hash it records.
PROVENANCE = "provenance.json"


@dataclass(frozen=True)
class Layout:
    root: Path

    @classmethod
    def here(cls) -> Layout:
        return cls(Path.cwd().resolve())

    @classmethod
    def enclosing(cls) -> Layout:
        """The workspace this folder is in: the nearest folder up from here holding `dvc.yaml` or
        `params.yaml` (here when there is none), so that a command a user types in `docs/` reads the study."""
        here = Path.cwd().resolve()
        found = (folder for folder in (here, *here.parents) if any((folder / f).is_file() for f in WORKSPACE_FILES))
        return cls(next(found, here))

    @property
    def tokens(self) -> Path:
        return self.root / "data" / "tokens"

    @property
    def tokenizer(self) -> Path:
        return self.root / "data" / "tokenizer"

    @property
    def external(self) -> Path:
        return self.root / "data" / "external.json"

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
    def telemetry(self) -> Path:
        """Wall-clock times of the stages' tasks: outside `data/`, since they differ on every run."""
        return self.root / "telemetry"

    @property
    def reports(self) -> Path:
        return self.root / "reports"

    @property
    def tables(self) -> Path:
        return self.reports / "tables"

    @property
    def plots(self) -> Path:
        """The series of DVC's data plots (`dvc.yaml`'s top-level `plots`)."""
        return self.reports / "plots"

    def checkpoint(self, run_id: str, checkpoint: str) -> Path:
        return self.models / run_id / checkpoint

    def query_sources(self) -> dict[str, str]:
        """Workspace-relative paths `lmgeo query` reads: the params, the report's provenance, the result tables,
        the prepared tokenizer (the `tokens` table) and each sharded dataset (by its contract's name)."""
        relative = {
            "params": self.root / "params.yaml",
            "provenance": self.reports / PROVENANCE,
            "tables": self.tables,
            "tokenizer": self.tokenizer,
            "steps": self.train,
            "activations": self.activations,
            "fits": self.fits,
            "perturb": self.perturb,
        }
        return {name: path.relative_to(self.root).as_posix() for name, path in relative.items()}
