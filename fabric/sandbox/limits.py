"""Per-call resource limits of a pushdown snippet (safe defaults; a binding may lower them).

The operator's limits (``sandbox:`` in fabric.yaml, the pool's) are ceilings: a binding's
``pushdown.limits`` may only lower them (``SandboxLimits.capped``).
"""

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

    @classmethod
    def from_settings(cls, settings: Any, base: SandboxLimits | None = None) -> SandboxLimits:
        """Limits from any object with optional ``cpu_seconds``, ``wall_seconds``,
        ``memory_mb``, ``output_mb`` (a binding's ``pushdown.limits``, the plan's
        ``SandboxLimitsSpec``, ``fabric.yaml``'s ``sandbox:``); ``None`` keeps ``base``."""
        out = base or cls()
        changes: dict[str, Any] = {}
        for name, field_name, scale in (
            ("cpu_seconds", "cpu_seconds", 1),
            ("wall_seconds", "wall_seconds", 1),
            ("memory_mb", "memory_bytes", MiB),
            ("output_mb", "output_bytes", MiB),
            ("memory_bytes", "memory_bytes", 1),
            ("output_bytes", "output_bytes", 1),
            ("max_rows", "max_rows", 1),
        ):
            value = getattr(settings, name, None)
            if value is not None:
                changes[field_name] = value * scale
        return replace(out, **changes) if changes else out

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

    def capped(self, ceiling: SandboxLimits) -> tuple[SandboxLimits, list[tuple[str, Any, Any]]]:
        """These limits lowered to ``ceiling`` field by field, and ``(field, asked, ceiling)``
        for every field that asked for more than the ceiling allows."""
        over = [
            (f.name, getattr(self, f.name), getattr(ceiling, f.name))
            for f in fields(self)
            if getattr(self, f.name) > getattr(ceiling, f.name)
        ]
        if not over:
            return self, []
        return replace(self, **{name: cap for name, _, cap in over}), over
