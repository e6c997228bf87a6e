"""Per-call resource limits of a pushdown snippet (safe defaults, overridable per binding)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

MiB = 1 << 20


@dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: float = 2.0
    wall_seconds: float = 5.0
    memory_bytes: int = 512 * MiB  # address space the snippet may add on top of the worker's own
    output_bytes: int = 64 * MiB  # Arrow IPC size of the returned table
    max_rows: int = 10_000_000
    max_recursion: int = 200  # Python frames the snippet may stack

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) <= 0:
                raise ValueError(
                    f"SandboxLimits.{f.name} must be positive, got {getattr(self, f.name)!r}"
                )

    def overridden(self, overrides: dict[str, Any] | None) -> SandboxLimits:
        """These limits with a binding's ``limits:`` mapping applied (unknown keys rejected)."""
        if not overrides:
            return self
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(
                f"unknown sandbox limit(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return replace(self, **overrides)
