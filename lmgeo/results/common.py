"""What Study A's and Study B's results share: the rows the report reads, missing values, the metrics'
rounding, the Markdown cells and tables, and the figures' axes, grid and saving."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lmgeo.core.store import atomic_path

if TYPE_CHECKING:  # matplotlib loads only where a figure is drawn (not in `aggregate`)
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.text import Text

Row = dict[str, Any]
Tables = dict[str, list[Row]]


def none_if_nan(x: float) -> float | None:
    return None if math.isnan(x) else x


def finite(values: Sequence[float | None]) -> np.ndarray:
    """The measured values of `values` (None, NaN and ±inf dropped), as floats."""
    arr = np.array([v for v in values if v is not None], dtype=float)
    return arr[np.isfinite(arr)]


def measured(record: dict[str, float | None], decimals: int) -> dict[str, float]:
    """The DVC metrics of `record` that were measured (finite), rounded to `decimals` places: a value then
    takes a fixed width in `dvc metrics show` and `dvc exp show` (their 5 significant digits would print
    -0.0051649), and equal inputs give identical bytes."""
    return {k: round(float(v), decimals) for k, v in record.items() if v is not None and math.isfinite(v)}


# ---------------------------------------------------------------------------------------- markdown
def num(x: Any, digits: int = 3) -> str:
    """`digits` significant digits, but whole numbers in full where those would need an exponent (99.9 → 100)."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    if not isinstance(x, float):
        return str(x)
    short = f"{x:.{digits}g}"
    return f"{x:.0f}" if "e+" in short and abs(x) < 1e6 else short


def interval(mean: Any, low: Any, high: Any, digits: int = 3) -> str:
    """`mean [low, high]`; the mean alone where there is no interval (one seed)."""
    if low is None and high is None:
        return num(mean, digits)
    return f"{num(mean, digits)} [{num(low, digits)}, {num(high, digits)}]"


FOLD_ROWS = 12  # a table of more rows than this is folded (`<details>`): the report reads in a minute


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]], what: str | None = None) -> str:
    """The rows as a Markdown table; one of more than `FOLD_ROWS` rows folded into a `<details>` block (GitHub
    and `html.to_html` render it closed) whose summary line says what it is: `what` (plain text), or its
    columns."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(v if isinstance(v, str) else num(v) for v in row) + " |" for row in rows]
    table = "\n".join(lines) + "\n"
    if len(rows) <= FOLD_ROWS:
        return table
    shown = what or "The table of " + ", ".join(h.replace("`", "") for h in header)
    return f"{fold_summary(shown, len(rows))}\n\n{table}\n</details>\n"


def fold_summary(what: str, rows: int) -> str:
    """The opening of a folded table: `<details>` and its summary line, `what` escaped as HTML."""
    import html

    return f"<details>\n<summary>{html.escape(what, quote=False)} ({rows} rows)</summary>"


def median(values: Sequence[float | None]) -> float | None:
    found = finite(values)
    return float(np.median(found)) if found.size else None


# ----------------------------------------------------------------------------------------- figures
@dataclass(frozen=True)
class Axis:
    """A plotted quantity: the column it reads and the label its axis carries."""

    column: str
    label: str
    log: bool = False


def axis_labels(fig: Figure) -> list[dict[str, Any]]:
    """Title, x and y label of every panel that has data (colour bars excluded), as drawn, and whether all
    three lie inside the figure (a long label is cut off at the edge, unreadable)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    box = fig.bbox

    def inside(text: Text) -> bool:
        extent = text.get_window_extent(renderer)
        return not text.get_text() or (
            extent.x0 >= box.x0 - 1 and extent.x1 <= box.x1 + 1 and extent.y0 >= box.y0 - 1 and extent.y1 <= box.y1 + 1
        )

    return [
        {
            "title": ax.get_title(),
            "x": ax.get_xlabel(),
            "y": ax.get_ylabel(),
            "inside": all(inside(t) for t in (ax.title, ax.xaxis.label, ax.yaxis.label)),
        }
        for ax in fig.axes
        if ax.has_data() and not hasattr(ax, "_colorbar")
    ]


def panel_grid(rows: int, cols: int, width: float = 4.0, height: float = 3.0) -> tuple[Figure, np.ndarray]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * cols, height * rows), layout="constrained")
    axes = np.array([[fig.add_subplot(rows, cols, r * cols + c + 1) for c in range(cols)] for r in range(rows)])
    return fig, axes


def label_axes(ax: Axes, title: str, x: str, quantity: Axis) -> None:
    ax.set_title(title)
    ax.set_xlabel(x)
    ax.set_ylabel(quantity.label)
    if quantity.log and ax.has_data():
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    if not ax.has_data():
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)


LEGEND_ROW_INCHES = 0.25
LEGEND_COLUMNS = 3  # entries per row: the legend fits one panel's width, so also a figure's one-column variant


def figure_legend(fig: Figure, entries: dict[str, Artist] | None = None, columns: int = LEGEND_COLUMNS) -> None:
    """One legend for all panels, under them: inside a panel it covers curves, and the panels share their
    lines (the same recipes or classes); `entries` (label → handle), where given, instead of the panels' own,
    in `columns` per row (fewer where the labels are long: the legend must fit one panel's width)."""
    if entries is None:
        entries = {}
        for ax in fig.axes:
            for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
                entries.setdefault(label, handle)
    if entries:
        fig.legend(
            entries.values(), entries.keys(), loc="outside lower center", ncols=columns, fontsize=8, frameon=False
        )
        # The legend's rows are added to the figure, not taken from the panels (their labels would not fit).
        fig.set_figheight(fig.get_figheight() + LEGEND_ROW_INCHES * math.ceil(len(entries) / columns))


NARROW = ".narrow"  # a figure's one-column variant for phone-width screens: `<name>.narrow.png`


def stack_panels(figure: Figure) -> bool:
    """Lay the figure's panels out in one column at one panel's width, in reading order, so that at phone
    width its labels are drawn at the size they have on a wide screen; False (figure unchanged) where it has
    one column already."""
    from matplotlib.gridspec import GridSpec

    panels = [ax for ax in figure.axes if ax.get_subplotspec() is not None]
    spec = panels[0].get_subplotspec() if panels else None
    rows, cols = spec.get_gridspec().get_geometry() if spec is not None else (1, 1)
    if cols == 1:
        return False
    width, height = figure.get_size_inches()
    column = GridSpec(len(panels), 1, figure=figure)
    for i, ax in enumerate(panels):
        ax.set_subplotspec(column[i, 0])
    figure.set_size_inches(width / cols, height / rows * len(panels))
    return True


class Figures:
    """Saves figures (and the one-column variant of a multi-column one, which the HTML page shows on
    narrow screens), keeps the labels each one was drawn with, and returns the Markdown that shows it."""

    def __init__(self, directory: Path, link_prefix: Path) -> None:
        self.directory = directory
        self.link_prefix = link_prefix
        self.labels: dict[str, list[dict[str, Any]]] = {}
        self.narrow_labels: dict[str, list[dict[str, Any]]] = {}  # of the one-column variants
        self.text_px: dict[str, float] = {}  # the smallest text's height in the saved image's pixels

    def show(self, figure: Figure | None, name: str, caption: str) -> str:
        """Save `figure` as `name` and return its Markdown: the image, then `caption` (what to see in it)."""
        return self.beside([(figure, name, caption)])

    def beside(self, shown: Sequence[tuple[Figure | None, str, str]]) -> str:
        """Several (figure, name, caption) side by side where the screen is wide enough (one paragraph of
        images, wrapping on a phone), their captions under them in the same order."""
        drawn = [(name, caption) for figure, name, caption in shown if self._save(figure, name)]
        if not drawn:
            return ""
        images = "\n".join(f"![{caption}]({(self.link_prefix / f'{name}.png').as_posix()})" for name, caption in drawn)
        return f"{images}\n\n*{' '.join(caption for _, caption in drawn)}*\n"

    def _save(self, figure: Figure | None, name: str) -> bool:
        if figure is None:
            return False
        self.labels[name] = axis_labels(figure)
        self.text_px[name] = smallest_text_pt(figure) * DPI / 72
        self._write(figure, f"{name}.png")
        if stack_panels(figure):
            self.narrow_labels[name] = axis_labels(figure)
            self._write(figure, f"{name}{NARROW}.png")
        return True

    def _write(self, figure: Figure, file: str) -> None:
        # Replaced, never written through: the old file may be a link into the DVC cache.
        with atomic_path(self.directory / file) as temp:
            figure.savefig(temp, format="png", dpi=DPI, metadata={"Software": None})


DPI = 100  # the saved images' pixels per inch: a label's height on screen is its points · DPI/72 · the image's scale


def smallest_text_pt(fig: Figure) -> float:
    """The font size of the smallest text drawn in `fig` (titles, labels, tick labels, legend), in points."""
    from matplotlib.text import Text

    sizes = [t.get_fontsize() for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    return float(min(sizes)) if sizes else 0.0
