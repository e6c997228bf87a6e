"""A writer-preferring reader-writer lock: queries share, a batch write is exclusive."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class RWLock:
    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._cond = threading.Condition(self._mutex)
        self._readers = 0
        self._writer = False
        self._waiting_writers = 0
        self._reading = _Reading(self)

    def read(self) -> _Reading:
        """Shared: ``with lock.read(): ...`` (one reusable context object, not a generator:
        every search takes it twice)."""
        return self._reading

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


class _Reading:
    __slots__ = ("_lock",)

    def __init__(self, lock: RWLock) -> None:
        self._lock = lock

    def __enter__(self) -> None:
        lk = self._lock
        with lk._mutex:
            while lk._writer or lk._waiting_writers:
                lk._cond.wait()
            lk._readers += 1

    def __exit__(self, *exc: object) -> None:
        lk = self._lock
        with lk._mutex:
            lk._readers -= 1
            if not lk._readers:
                lk._cond.notify_all()
