"""The fabric's error root and the errors users most often catch, in one import.

``FabricError`` is defined in ``dsl.errors`` (a module without project imports, so the
sibling packages ``connectors``, ``indexes`` and ``crypto`` subclass it without importing
``fabric``) and re-exported here. Every user-facing error class in the packages is a
subclass and keeps its builtin kind (``ValueError``, ``LookupError``, ...);
tests/test_errors.py walks the packages to keep it so."""

from __future__ import annotations

from connectors.base import SourceError, UnknownColumnError, UnknownObjectError
from dsl.errors import DslError, FabricError

__all__ = [
    "DslError",
    "FabricError",
    "SourceError",
    "UnknownColumnError",
    "UnknownObjectError",
]
