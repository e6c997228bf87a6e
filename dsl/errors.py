"""Diagnostics with positions: every user-facing error points at the user's text.

A ``Span`` is a 1-based line/column range inside a named source (a binding file, an
expression inside one, or a compact text query). ``DslError`` carries one or more
``Diagnostic`` objects; ``format()`` renders them as

    agents/offers.yaml:7:12: unknown column 'stauts' in source 'm'
        where: stauts = 'active'
               ^^^^^^
      hint: did you mean 'status'? Existing columns: id, name, status, geo_hash
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Span:
    """A range in a source text; lines and columns are 1-based, ``end_col`` exclusive."""

    file: str
    line: int
    col: int
    end_line: int | None = None
    end_col: int | None = None

    def shifted(self, line_offset: int, col_offset: int) -> Span:
        """Translate a span inside an embedded text (e.g. a YAML scalar) to the file."""
        first = self.line == 1
        end_first = (self.end_line or self.line) == 1
        return Span(
            self.file,
            self.line + line_offset,
            self.col + (col_offset if first else 0),
            None if self.end_line is None else self.end_line + line_offset,
            None if self.end_col is None else self.end_col + (col_offset if end_first else 0),
        )

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


@dataclass(frozen=True)
class Diagnostic:
    message: str
    span: Span | None = None
    hint: str | None = None
    severity: str = "error"
    source_line: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        # a diagnostic may quote a driver's error or a line of fabric.yaml: mask credentials
        from connectors.credentials import mask

        for name in ("message", "hint", "source_line"):
            value = getattr(self, name)
            if value is not None and mask(value) != value:
                object.__setattr__(self, name, mask(value))

    def format(self) -> str:
        where = f"{self.span}: " if self.span else ""
        out = [
            f"{where}{self.severity}: {self.message}"
            if self.severity != "error"
            else f"{where}{self.message}"
        ]
        if self.span and self.source_line is not None:
            line = self.source_line.rstrip("\n")
            out.append("    " + line)
            start = max(self.span.col - 1, 0)
            if self.span.end_col and (self.span.end_line in (None, self.span.line)):
                width = max(self.span.end_col - self.span.col, 1)
            else:
                width = max(len(line) - start, 1)
            out.append("    " + " " * start + "^" * width)
        if self.hint:
            out.append(f"  hint: {self.hint}")
        return "\n".join(out)

    def to_dict(self) -> dict[str, object]:
        d: dict[str, object] = {"message": self.message, "severity": self.severity}
        if self.span:
            d.update(file=self.span.file, line=self.span.line, column=self.span.col)
        if self.hint:
            d["hint"] = self.hint
        return d


class FabricError(Exception):
    """The root of every error the fabric raises on purpose (``except FabricError``).

    Defined here, in a module with no project imports, so ``dsl``, ``connectors``,
    ``indexes`` and ``crypto`` can subclass it without importing ``fabric``;
    ``fabric.errors`` re-exports it. Subclasses keep their builtin kind as a second base
    (``class PlanError(FabricError, ValueError)``) so ``except ValueError`` still works."""


class DslError(FabricError):
    """One or more diagnostics about a binding, a config file or a query text."""

    def __init__(self, diagnostics: Diagnostic | Sequence[Diagnostic]):
        if isinstance(diagnostics, Diagnostic):
            diagnostics = [diagnostics]
        self.diagnostics: list[Diagnostic] = list(diagnostics)
        super().__init__(self.format())

    @classmethod
    def at(
        cls,
        message: str,
        span: Span | None,
        hint: str | None = None,
        source_line: str | None = None,
    ) -> DslError:
        return cls(Diagnostic(message, span, hint, source_line=source_line))

    @property
    def span(self) -> Span | None:
        return self.diagnostics[0].span if self.diagnostics else None

    def format(self) -> str:
        return "\n".join(d.format() for d in self.diagnostics)


def did_you_mean(word: str, choices: Iterable[str], what: str = "") -> str:
    """'did you mean X? Existing <what>: a, b, c' (the list is always given)."""
    choices = sorted(set(choices))
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    listing = (
        f"existing {what}: {', '.join(choices)}"
        if what
        else f"expected one of: {', '.join(choices)}"
    )
    if close:
        return f"did you mean '{close[0]}'? ({listing})"
    return listing[0].upper() + listing[1:]
