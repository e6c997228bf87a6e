"""The ring buffer: the last N finished spans, always kept in memory."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from opentelemetry.sdk.trace import SpanProcessor


class RingBuffer(SpanProcessor):
    """A SpanProcessor keeping the last ``capacity`` finished spans in memory."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._spans: deque[Any] = deque(maxlen=capacity)
        self.dropped = 0
        self._lock = threading.Lock()

    # SpanProcessor
    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def _on_ending(self, span: Any) -> None:  # the SDK calls this on newer versions
        pass

    def on_end(self, span: Any) -> None:
        with self._lock:
            if len(self._spans) == self.capacity:
                self.dropped += 1
            self._spans.append(span)

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

    # reading
    def spans(self) -> list[Any]:
        with self._lock:
            return list(self._spans)

    def __len__(self) -> int:
        return len(self._spans)
