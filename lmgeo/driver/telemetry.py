"""The training runs' wall-clock times, `telemetry/train/<run>.json` (SPEC §1): written by `train`, read back
by the next training here (its runs are dispatched longest first) and by the report (its step-time column).
Times are telemetry, never results: they decide when a run starts, not what it computes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import NamedTuple

from lmgeo.driver.layout import Layout


class RunTimes(NamedTuple):
    wall_time_s: float
    step_time_s: list[float]


def read_telemetry(layout: Layout) -> dict[str, RunTimes]:
    """run → the wall-clock times its last training here measured (`telemetry/train/<run>.json`); a file that
    does not hold them is left out (times are no result: they order the dispatch and fill the report's
    step-time column)."""
    found = {}
    for path in sorted((layout.telemetry / "train").glob("*.json")):
        try:
            raw = json.loads(path.read_text())
            times = RunTimes(float(raw["wall_time_s"]), [float(t) for t in raw["step_time_s"]])
        except (OSError, ValueError, TypeError, KeyError):
            continue
        if all(math.isfinite(t) and t >= 0 for t in (times.wall_time_s, *times.step_time_s)):
            found[path.stem] = times
    return found


def write_telemetry(layout: Layout, planned: set[str], measured: dict[str, RunTimes]) -> None:
    """Each run's wall-clock times, `telemetry/train/<run>.json`: those just measured are written, those of
    runs no longer planned removed (a run skipped as complete keeps the times of the run that made it): only
    files this wrote, whose record names the run of their name. A symlinked folder is refused (`writable`)."""
    from lmgeo.core.paths import writable
    from lmgeo.core.store import atomic_write

    folder = writable(layout.telemetry / "train", layout.root)
    folder.mkdir(parents=True, exist_ok=True)
    for run, times in measured.items():
        atomic_write(folder / f"{run}.json", json.dumps({"run": run, **times._asdict()}, sort_keys=True) + "\n")
    for stale in folder.glob("*.json"):
        if stale.stem not in planned and _written_here(stale):
            stale.unlink()


def _written_here(path: Path) -> bool:
    try:
        return json.loads(path.read_text()).get("run") == path.stem
    except (OSError, ValueError, AttributeError):
        return False
