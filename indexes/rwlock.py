"""A writer-preferring reader-writer lock: queries share, a batch write is exclusive."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class RWLock:
    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False
        self._waiting_writers = 0

    @contextmanager
    def read(self) -> Iterator[None]:
        with self._cond:
            while self._writer or self._waiting_writers:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextmanager
    def write(self, polite: float = 0.0) -> Iterator[None]:
        """Exclusive. ``polite`` (seconds): for up to that long, wait for a moment with no
        reader without holding new readers back (a background job yielding to queries);
        then queue as an ordinary writer."""
        with self._cond:
            if polite > 0:
                deadline = time.monotonic() + polite
                while self._writer or self._readers or self._waiting_writers:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            self._waiting_writers += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._waiting_writers -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()
