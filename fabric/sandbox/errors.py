"""Errors raised by a sandboxed pushdown call; each names the binding and the snippet line."""

from __future__ import annotations

from dsl.errors import Diagnostic, FabricError, Span


def printable(text: str) -> str:
    """``text`` with control and format characters (ESC, BEL, CR, LF, bidi overrides, ...)
    escaped as ``\\x1b``-style sequences: a snippet's exception text or source line must
    not move the operator's cursor, forge diagnostic lines or reorder what they read."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() or ch == " " else _escape(ch) for ch in text)


def _escape(ch: str) -> str:
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


class SandboxError(FabricError):
    """A pushdown snippet failed.  ``span`` points at the binding-file line that was running."""

    kind = "error"

    def __init__(
        self,
        binding: str,
        detail: str,
        span: Span | None = None,
        source_line: str | None = None,
        hint: str | None = None,
    ):
        self.binding, self.detail, self.span = printable(binding), printable(detail), span
        self.source_line = None if source_line is None else printable(source_line)
        self.hint = None if hint is None else printable(hint)
        super().__init__(self.diagnostic.format())

    @property
    def diagnostic(self) -> Diagnostic:
        return Diagnostic(
            f"pushdown python of binding '{self.binding}': {self.detail}",
            self.span,
            self.hint,
            source_line=self.source_line,
        )


class SandboxViolation(SandboxError):
    """The snippet tried something the sandbox forbids, or returned an invalid result."""

    kind = "violation"


class SandboxTimeout(SandboxError):
    """The snippet exceeded its CPU-time or wall-clock limit."""

    kind = "timeout"


class SandboxMemoryError(SandboxError):
    """The snippet exceeded its memory limit (or its stack, by deep recursion)."""

    kind = "memory"


class SandboxRuntimeError(SandboxError):
    """The snippet raised an ordinary exception (a bug in the snippet, not an attack)."""

    kind = "runtime"


ERROR_CLASSES: dict[str, type[SandboxError]] = {
    c.kind: c for c in (SandboxViolation, SandboxTimeout, SandboxMemoryError, SandboxRuntimeError)
}
