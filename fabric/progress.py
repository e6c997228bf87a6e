"""Progress of long CLI steps (``fabric load``, ``fabric materialize``, ``fabric demo``):
rich on a terminal, plain lines otherwise.

On a terminal (and with rich installed: the ``demo`` extra) a step shows a spinner, a bar
when its size is known (rows loaded, documents ingested), and the time it has taken; the
bar is cleared when the step ends and the step's own result line stays. Anywhere else (a
pipe, a CI log) there are no escape codes: a step prints one line when it starts, and a
long one a line every ``PLAIN_EVERY`` seconds with how far it got.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

PLAIN_EVERY = 10.0  # seconds between the plain progress lines of a long step


class Step:
    """What a running step reports: ``update(done)`` (of ``total``, if it has one)."""

    def __init__(self, report: Callable[[int], None]) -> None:
        self._report = report

    def update(self, done: int) -> None:
        self._report(done)


class Progress:
    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        self.console: Any = None
        if _is_tty(self.stream):
            try:
                from rich.console import Console
            except ImportError:  # without the demo extra: plain lines
                pass
            else:
                self.console = Console(file=self.stream)

    @property
    def rich(self) -> bool:
        return self.console is not None

    @contextlib.contextmanager
    def step(self, description: str, total: int | None = None) -> Iterator[Step]:
        if self.console is None:
            yield from self._plain(description, total)
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )
        from rich.progress import (
            Progress as RichProgress,
        )

        columns: list[Any] = [SpinnerColumn(), TextColumn("{task.description}")]
        if total:
            columns += [BarColumn(), MofNCompleteColumn()]
        columns.append(TimeElapsedColumn())
        with RichProgress(*columns, console=self.console, transient=True) as bar:
            task = bar.add_task(description, total=total)
            yield Step(lambda done: bar.update(task, completed=done))

    def _plain(self, description: str, total: int | None) -> Iterator[Step]:
        t0 = last = time.monotonic()
        print(f"... {description}", file=self.stream, flush=True)

        def report(done: int) -> None:
            nonlocal last
            now = time.monotonic()
            if now - last >= PLAIN_EVERY:
                last = now
                of = f" of {total:,}" if total else ""
                print(
                    f"... {description}: {done:,}{of} after {now - t0:.0f} s",
                    file=self.stream,
                    flush=True,
                )

        yield Step(report)


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
