"""One error root: every exception class the packages define is a ``FabricError``.

Users catch ``fabric.errors.FabricError`` for anything the fabric raises on purpose; each
class keeps its builtin base (``ValueError``, ``LookupError``, ...) so existing handlers
keep working. Private control-flow exceptions (``_Abort``) are not user-facing."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

from fabric.errors import FabricError

PACKAGES = ("fabric", "dsl", "connectors", "indexes", "crypto")

PENDING: set[str] = set()  # none left


def _modules() -> list[str]:
    names = []
    for pkg in PACKAGES:
        mod = importlib.import_module(pkg)
        names.append(pkg)
        for info in pkgutil.walk_packages(mod.__path__, prefix=f"{pkg}."):
            if not info.name.endswith(".__main__"):  # running it is the CLI
                names.append(info.name)
    return names


def _error_classes() -> dict[str, type[BaseException]]:
    out: dict[str, type[BaseException]] = {}
    for name in _modules():
        try:
            mod = importlib.import_module(name)
        except ImportError as e:  # an optional driver (extra) not installed here
            print(f"skipped {name}: {e}")
            continue
        for attr, obj in vars(mod).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == name
                and not attr.startswith("_")
            ):
                out[f"{name}.{attr}"] = obj
    return out


def test_every_error_class_is_a_fabric_error() -> None:
    classes = _error_classes()
    assert len(classes) >= 25, sorted(classes)  # the walk found the packages' errors
    outside = sorted(
        n for n, c in classes.items() if not issubclass(c, FabricError) and n not in PENDING
    )
    assert not outside, f"not FabricError subclasses: {outside}"


def test_builtin_bases_are_kept() -> None:
    from connectors.base import UnknownColumnError, UnknownObjectError
    from dsl.errors import DslError
    from fabric.plan.nodes import PlanError
    from indexes.spec import DatasetError

    assert issubclass(PlanError, ValueError) and issubclass(DatasetError, ValueError)
    assert issubclass(UnknownObjectError, LookupError)
    assert issubclass(UnknownColumnError, KeyError)
    assert issubclass(DslError, FabricError)


def test_unknown_column_error_names_the_column_and_the_existing_ones() -> None:
    import pyarrow as pa

    from connectors.base import ScanRequest, UnknownColumnError
    from connectors.memory import MemorySource

    src = MemorySource("memory://t/m", pa.table({"id": [1, 2], "city": ["a", "b"]}))
    with pytest.raises(UnknownColumnError) as ei:
        list(src.scan(ScanRequest(columns=("id", "ctiy"))))
    e = ei.value
    assert isinstance(e, FabricError) and isinstance(e, KeyError)
    assert e.columns == ["ctiy"] and e.existing == ["id", "city"]
    assert str(e) == "memory://t/m has no column ctiy; existing: id, city"
