"""Errors raised by a sandboxed pushdown call; each names the binding and the snippet line."""

from __future__ import annotations

from dsl.errors import Diagnostic, Span


class SandboxError(Exception):
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
        self.binding, self.detail, self.span = binding, detail, span
        self.source_line, self.hint = source_line, hint
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
