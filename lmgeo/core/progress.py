"""Progress of a long loop: a live bar on an interactive terminal, plain log lines otherwise.

DVC and CI capture output, where carriage-return redraws turn into noise; there each advance becomes
one self-contained line such as ``fit: 3/12 shards done (gpt2-adamw-s0.final/layer=1) [12.3s, 37s left]``.
A training loop uses the same class for steps (``unit="steps"``, with ``min_interval_s`` so a
10 000-step run does not print 10 000 lines).
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import Any, TextIO


class Progress:
    """Counts ``done`` out of ``total`` and shows it on ``stream`` (stderr by default)."""

    def __init__(
        self,
        total: int,
        label: str,
        *,
        unit: str = "shards",
        stream: TextIO | None = None,
        min_interval_s: float = 0.0,
    ) -> None:
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        self.total = total
        self.label = label
        self.unit = unit
        self.done = 0
        self._stream = stream if stream is not None else sys.stderr
        self._min_interval_s = min_interval_s
        self._start = time.monotonic()
        self._last_line = -float("inf")
        self._last_done_s = 0.0  # elapsed time at the last advance: the estimate of the time left is taken then
        self._live = _LiveBar(self._stream, total, label, unit) if _is_tty(self._stream) else None

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self._start

    def advance(self, n: int = 1, detail: str = "") -> None:
        """Record ``n`` more units done; ``detail`` (e.g. the shard key or the loss) is shown with it."""
        self.done += n
        self._last_done_s = self.elapsed_s
        if self._live is not None:
            self._live.update(completed=self.done, detail=detail, left=self._left())
            return
        now = time.monotonic()
        if self.done >= self.total or now - self._last_line >= self._min_interval_s:
            self._last_line = now
            self._stream.write(self.line(detail) + "\n")
            self._stream.flush()

    def refresh(self) -> None:
        """Redraw the live bar (its clock moves while nothing completes); a no-op for plain lines."""
        if self._live is not None:
            self._live.update(left=self._left())

    def _left(self) -> str:
        left = time_left_s(self.done, self.total, self._last_done_s, self.elapsed_s)
        return "" if left is None else f"{format_duration(left)} left"

    def line(self, detail: str = "") -> str:
        shown = f" ({detail})" if detail else ""
        left = self._left()
        clock = f"{self.elapsed_s:.1f}s" + (f", {left}" if left and self.done < self.total else "")
        return f"{self.label}: {self.done}/{self.total} {self.unit} done{shown} [{clock}]"

    def close(self) -> None:
        if self._live is not None:
            self._live.close()
            self._live = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def time_left_s(done: int, total: int, done_at_s: float, now_s: float) -> float | None:
    """Seconds left, from the items finished so far: they took ``done_at_s`` (the elapsed time when the last of
    them finished) for ``done`` items, so the other ``total - done`` take as long each, less what has passed since
    (the estimate counts down between completions). None before the first item finishes: nothing to go by."""
    if done <= 0:
        return None
    return max(0.0, done_at_s / done * (total - done) - (now_s - done_at_s))


def format_duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``: a time left as a person reads it."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def _is_tty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class _LiveBar:
    """One rich progress bar, redrawn only when we say so (no background refresh thread)."""

    def __init__(self, stream: TextIO, total: int, label: str, unit: str) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
        )
        from rich.progress import Progress as RichProgress

        self._bar = RichProgress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(unit),
            TimeElapsedColumn(),
            TextColumn("{task.fields[left]}"),
            TextColumn("{task.fields[detail]}"),
            console=Console(file=stream, force_terminal=True),
            auto_refresh=False,
        )
        self._task = self._bar.add_task(label, total=total, detail="", left="")
        self._bar.start()

    def update(self, **fields: Any) -> None:
        self._bar.update(self._task, **fields)
        self._bar.refresh()

    def refresh(self) -> None:
        self._bar.refresh()

    def close(self) -> None:
        self._bar.stop()


class StepClock:
    """Wall-clock times of a loop's steps, taken by its caller between steps: telemetry, never a result
    (a result holds no time, so the same code and params give the same bytes)."""

    def __init__(self) -> None:
        self._marks = [time.perf_counter()]

    def tick(self) -> None:
        """A step ended."""
        self._marks.append(time.perf_counter())

    @property
    def step_times(self) -> list[float]:
        return [b - a for a, b in zip(self._marks, self._marks[1:])]

    @property
    def wall_time_s(self) -> float:
        return self._marks[-1] - self._marks[0]
