"""Progress a person can follow: live counters on a terminal, plain lines elsewhere.

`Progress` shows named counters ("releases 2/5", "patches 7/12", with the time
spent) through `rich` while its stream is a terminal; every `line` stays above
them as the step's record. When the stream is not a terminal (CI logs, a pipe,
a test), the counters are not drawn and each `line` is one plain line with the
prefix, so logs read the same as before, one event a line.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TextIO


def is_terminal(stream: TextIO) -> bool:
    """Draw live progress on `stream`? Not for a pipe or file, nor TERM=dumb, nor CI."""
    if os.environ.get("TERM") == "dumb" or os.environ.get("CI"):
        return False
    return hasattr(stream, "isatty") and stream.isatty()


def elapsed(seconds: float) -> str:
    """`42 s`, `3 min 05 s`."""
    whole = int(seconds)
    return f"{whole} s" if whole < 60 else f"{whole // 60} min {whole % 60:02d} s"


@dataclass(frozen=True)
class Counter:
    """A handle on one counter of a `Progress` (what `add` returns)."""

    key: Any
    name: str
    total: int | None  # None: no end known (a pulsing bar, no count)

    def of(self, completed: int) -> str:
        return f"{completed}/{self.total}" if self.total is not None else ""


class Progress:
    """Counters and lines on `stream` (stderr by default), live only on a terminal."""

    def __init__(self, prefix: str, *, stream: TextIO | None = None, live: bool | None = None):
        self.prefix = prefix
        self.stream = stream or sys.stderr
        self.live = is_terminal(self.stream) if live is None else live
        self.started = time.monotonic()
        self._rich: Any = None
        self._plain: dict[Any, int] = {}

    def __enter__(self) -> Progress:
        if self.live:
            from rich.console import Console
            from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._rich = RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.fields[of]}"),
                TimeElapsedColumn(),
                console=Console(file=self.stream),
            )
            self._rich.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._rich is not None:
            self._rich.stop()
            self._rich = None

    def add(self, name: str, total: int | None, completed: int = 0) -> Counter:
        """A counter `completed`/`total` under `name` (drawn only when live)."""
        key: Any = len(self._plain)
        counter = Counter(key, name, total)
        if self._rich is not None:
            key = self._rich.add_task(name, total=total, completed=completed, of=counter.of(0))
            counter = Counter(key, name, total)
        self._plain[key] = completed
        self.update(counter, completed=completed)
        return counter

    def update(
        self, counter: Counter, *, completed: int | None = None, name: str | None = None
    ) -> None:
        if completed is not None:
            self._plain[counter.key] = completed
        if self._rich is not None:
            done = self._plain[counter.key]
            self._rich.update(counter.key, completed=done, description=name, of=counter.of(done))

    def line(self, message: str) -> None:
        """A line that stays: above the live counters, or a plain `prefix: message`."""
        if self._rich is not None:
            self._rich.console.print(message, markup=False, highlight=False)
        else:
            print(f"{self.prefix}: {message}", file=self.stream, flush=True)

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started
