"""The agent data fabric: declarative bindings compiled to Arrow plans.

    import fabric
    fab = fabric.open("fabric.yaml")
    res = fab.query("nearby_offers", session={"user_id": 42})

The public names are imported lazily (PEP 562), so ``import fabric.plan.nodes`` and the
other submodules stay cheap and free of import cycles.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CompiledBinding",
    "Diagnostic",
    "DslError",
    "Fabric",
    "FabricConfig",
    "SessionError",
    "UnknownBindingError",
    "connect",
    "load_config",
    "open",
]

_LAZY = {
    "open": "fabric.api",
    "connect": "fabric.service.client",
    "Fabric": "fabric.api",
    "UnknownBindingError": "fabric.api",
    "CompiledBinding": "fabric.compiler",
    "FabricConfig": "fabric.config",
    "load_config": "fabric.config",
    "Diagnostic": "dsl.errors",
    "DslError": "dsl.errors",
    "SessionError": "dsl.types",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'fabric' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value
