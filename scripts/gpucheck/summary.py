"""What one item of the check found, and the JSON and Markdown summaries written after every item (so a
run cut short by its time limit still leaves what it measured)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from lmgeo.commands.bench.render import to_jsonable
from lmgeo.core.store import atomic_write
from scripts.gpucheck.tolerances import TOLERANCES

Status = Literal["pass", "FAIL", "error", "skipped", "measured"]
STATUSES: tuple[Status, ...] = ("pass", "FAIL", "error", "skipped", "measured")
JSON_NAME, MARKDOWN_NAME = "gpu.json", "gpu.md"


@dataclass(frozen=True)
class Outcome:
    """What an item returns: a one-line summary, the figures, and whether the comparison held (None for a
    measurement, which has no bar)."""

    summary: str
    detail: dict[str, Any] = field(default_factory=dict)
    passed: bool | None = None


@dataclass(frozen=True)
class Result:
    section: str
    name: str
    status: Status
    seconds: float
    summary: str
    detail: dict[str, Any] = field(default_factory=dict)


def counts(results: list[Result]) -> dict[str, int]:
    return {status: sum(r.status == status for r in results) for status in STATUSES}


def write(out: Path, header: dict[str, Any], results: list[Result]) -> None:
    """`gpu.json` (everything) and `gpu.md` (for people) under `out`."""
    document = {
        **header,
        "counts": counts(results),
        "tolerances": {k: asdict(v) for k, v in TOLERANCES.items()},
        "results": [asdict(r) for r in results],
    }
    atomic_write(out / JSON_NAME, json.dumps(_json_safe(to_jsonable(document)), indent=2, default=str) + "\n")
    atomic_write(out / MARKDOWN_NAME, markdown(header, results))


def _json_safe(value: Any) -> Any:
    """JSON has no NaN or Infinity: they are written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if hasattr(value, "tolist"):  # numpy arrays
        return _json_safe(value.tolist())
    return value


# -------------------------------------------------------------------------------------- Markdown
def markdown(header: dict[str, Any], results: list[Result]) -> str:
    tally = counts(results)
    lines = [
        f"# GPU check — {header['mode']}",
        "",
        f"`{header['command']}` on {header['device']}, started {header['started_utc']}, at commit "
        f"`{header.get('commit', 'unknown')}`, "
        f"{header.get('wall_s', 0):.0f} s of a {header['budget_s']:.0f} s budget"
        + ("" if header.get("finished") else " (**still running or cut short**: the items below are those done)")
        + ".",
        "",
        "Verdicts: " + ", ".join(f"{n} {s}" for s, n in tally.items() if n) + ".",
        "",
    ]
    if header.get("note"):
        lines += [header["note"], ""]
    lines += _versions(header)
    for section in dict.fromkeys(r.section for r in results):
        lines += [f"## {section}", "", "| item | verdict | result | s |", "|---|---|---|---|"]
        lines += [
            f"| {r.name} | {r.status} | {_cell(r.summary)} | {r.seconds:.1f} |" for r in results if r.section == section
        ]
        lines.append("")
        for r in results:
            if r.section == section:
                for title, table in r.detail.get("tables", {}).items():
                    lines += _table(f"{r.name}: {title}", table)
    lines += _tolerances()
    lines += _problems(results)
    return "\n".join(lines) + "\n"


def _versions(header: dict[str, Any]) -> list[str]:
    versions = ", ".join(f"{k} {v}" for k, v in header.get("versions", {}).items())
    install = header.get("install") or {}
    installed = ", ".join(install.get("installed", [])) or "nothing"
    facts = ", ".join(f"{k} {v}" for k, v in {**header.get("device_facts", {}), **header.get("machine", {})}.items())
    lines = ["## Machine and versions", "", f"- {facts}", f"- {versions}", f"- carried wheels installed: {installed}"]
    if install.get("kernel_wheels"):
        kernels = install["kernel_wheels"]
        lines.append(f"- kernel wheels installed: {', '.join(kernels['installed']) or 'none'} ({kernels['reason']})")
    if install.get("unmet_requirements"):
        lines.append("- unmet requirements: " + "; ".join(install["unmet_requirements"]))
    return lines + [""]


def _tolerances() -> list[str]:
    lines = [
        "## Tolerances (device against the same call on this machine's CPU)",
        "",
        "| quantity | atol | rtol | why |",
        "|---|---|---|---|",
    ]
    lines += [f"| {name} | {t.atol:g} | {t.rtol:g} | {t.why} |" for name, t in TOLERANCES.items()]
    return lines + [""]


def _problems(results: list[Result]) -> list[str]:
    lines = []
    for r in results:
        if r.status in ("FAIL", "error"):
            lines += [f"### {r.status}: {r.section} / {r.name}", "", r.summary, ""]
            if "traceback" in r.detail:
                lines += ["```", r.detail["traceback"], "```", ""]
    return ["## Failures and errors", "", *lines] if lines else []


def _table(title: str, table: dict[str, Any]) -> list[str]:
    lines = [f"**{title}**", "", "| " + " | ".join(table["columns"]) + " |", "|" + "---|" * len(table["columns"])]
    lines += ["| " + " | ".join(_cell(_number(v)) for v in row) + " |" for row in table["rows"]]
    return lines + [""]


def _number(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
