"""Errors raised while running a plan."""

from __future__ import annotations

from dsl.errors import FabricError


class QueryError(FabricError, RuntimeError):
    """A query failed at run time; names the binding and, when known, the source.

    ``binding``: the binding name; ``alias``/``uri``: the source that failed;
    ``hint``: what would fix it. Credentials in the message and hint are masked."""

    def __init__(
        self,
        binding: str,
        message: str,
        *,
        alias: str | None = None,
        uri: str | None = None,
        hint: str | None = None,
    ):
        from connectors.credentials import mask

        message, hint = mask(message), None if hint is None else mask(hint)
        self.binding = binding
        self.alias = alias
        self.uri = uri
        self.hint = hint
        where = f"binding {binding!r}"
        if alias or uri:
            where += f", source {alias or ''}{' (' + uri + ')' if uri else ''}"
        super().__init__(f"{where}: {message}" + (f"\n  hint: {hint}" if hint else ""))
