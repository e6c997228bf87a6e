"""Runtime Python layer of a worker: curated builtins, an allowlist import hook, module views.

Snippets see fresh, read-mostly views of the allowed modules (public names only, no file
or raw-memory functions, no submodules outside the allowlist) and builtins without
eval/exec/open/__import__/globals/vars.  Anything refused is recorded in a ``Guard`` so
the call is reported as a violation even if the snippet catches the exception.
"""

from __future__ import annotations

import builtins
import difflib
import importlib
import sys
from types import FrameType, ModuleType

from dsl.errors import FabricError

from .policy import (
    ALLOWED_DUNDER_METHODS,
    ALLOWED_MODULES,
    FORBIDDEN_BUILTINS,
    HIDDEN_NAMES,
    attribute_forbidden,
    importable,
)

SNIPPET_FILE = "<pushdown>"
IMPORTABLE: frozenset[str] = importable(ALLOWED_MODULES)
ALLOWED: frozenset[str] = ALLOWED_MODULES

_SAFE_BUILTIN_NAMES = (
    "abs", "all", "any", "ascii", "bin", "bool", "bytearray", "bytes", "callable", "chr",
    "classmethod", "complex", "dict", "divmod", "enumerate", "filter", "float", "format",
    "frozenset", "hash", "hex", "id", "int", "isinstance", "issubclass", "iter", "len",
    "list", "map", "max", "min", "next", "object", "oct", "ord", "pow", "property", "range",
    "repr", "reversed", "round", "set", "slice", "sorted", "staticmethod", "str", "sum",
    "super", "tuple", "type", "zip", "aiter", "anext", "None", "True", "False",
    "Ellipsis", "NotImplemented", "__build_class__",
)  # fmt: skip

_FILTERED: dict[str, dict[str, object]] = {}


class SandboxBlocked(FabricError, PermissionError):
    """Raised into the snippet when the runtime layer refuses something."""


class Guard:
    """Collects what the runtime layer refused during one call, with the snippet line."""

    def __init__(self) -> None:
        self.violations: list[tuple[str, int | None]] = []

    def refuse(self, what: str) -> SandboxBlocked:
        self.violations.append((what, snippet_line()))
        return SandboxBlocked(what)


def snippet_line(tb=None) -> int | None:
    """Innermost line of the snippet on the current stack (or in traceback ``tb``)."""
    line = None
    if tb is not None:
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == SNIPPET_FILE:
                line = tb.tb_lineno
            tb = tb.tb_next
        return line
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename == SNIPPET_FILE:
            return frame.f_lineno
        frame = frame.f_back
    return None


def prepare(allowed: frozenset[str] = ALLOWED_MODULES) -> None:
    """Import the allowed modules and compute their public views (before lockdown)."""
    global IMPORTABLE, ALLOWED
    ALLOWED, IMPORTABLE = allowed, importable(allowed)
    for name in sorted(IMPORTABLE):
        importlib.import_module(name)
    for name in IMPORTABLE:
        _FILTERED[name] = _public_names(name)
    for modname, fn in (("numpy.random", "seed"), ("numpy.random", "set_state"),
                        ("random", "seed"), ("random", "setstate")):  # fmt: skip
        if modname in _FILTERED and fn in _FILTERED[modname]:
            _FILTERED[modname][fn] = _marks_reseed(_FILTERED[modname][fn])


def _public_names(name: str) -> dict[str, object]:
    hidden = HIDDEN_NAMES.get(name, frozenset())
    out: dict[str, object] = {}
    for key, value in vars(sys.modules[name]).items():
        if key.startswith("_") or key in hidden:
            continue
        if isinstance(value, type) and issubclass(value, type):
            continue  # a metaclass creates classes without check_class
        if isinstance(value, ModuleType):
            if value.__name__ in IMPORTABLE and value.__name__.startswith(name + "."):
                out[key] = _Submodule(value.__name__)
            continue
        out[key] = value
    return out


_RESEED = [False]


def _marks_reseed(fn):
    """Wrap a global-RNG seeding function: the next call gets fresh entropy again."""

    def wrapper(*args, **kwargs):
        _RESEED[0] = True
        return fn(*args, **kwargs)

    return wrapper


class _Submodule:
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


# Dunder names Python itself puts into a class's namespace.
_CLASS_AUTO_KEYS: frozenset[str] = frozenset(
    {"__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__annotations__",
     "__firstlineno__", "__static_attributes__", "__orig_bases__", "__classcell__"}
)  # fmt: skip


def check_class(cls: type, guard: Guard) -> type:
    """Refuse a class the snippet made whose namespace holds a special name outside the
    small allowed set, however the name was built (``type(name, bases, {"_" + ...: ...})``):
    ``__array_interface__`` and friends make numpy or pyarrow read any address.  Reads the
    created class's own ``__dict__``, so a dict subclass hiding its keys does not help."""
    for key in type.__dict__["__dict__"].__get__(cls):
        if not isinstance(key, str):
            raise guard.refuse(f"a class attribute named {key!r} is not allowed")
        if key.startswith("__") and key not in ALLOWED_DUNDER_METHODS | _CLASS_AUTO_KEYS:
            raise guard.refuse(
                f"a class with the special attribute {key!r} is not allowed in pushdown python"
            )
    return cls


class _TypeGate:
    """What a snippet gets for ``type`` and for any metaclass it reaches (``type(int)``,
    ``type(fractions.Fraction)``): ``type(x)`` as usual, ``isinstance``/``issubclass`` as
    with the metaclass, but every class it creates goes through ``check_class``."""

    __slots__ = ("_gates", "_guard", "_meta")

    def __init__(self, meta: type, gates: dict, guard: Guard):
        self._meta, self._gates, self._guard = meta, gates, guard

    def __call__(self, *args, **kwargs):
        if self._meta is type and len(args) == 1 and not kwargs:
            t = type(args[0])
            return self._gate(t) if issubclass(t, type) else t
        return check_class(self._meta(*args, **kwargs), self._guard)

    def _gate(self, meta: type) -> _TypeGate:
        if meta not in self._gates:
            self._gates[meta] = _TypeGate(meta, self._gates, self._guard)
        return self._gates[meta]

    def __instancecheck__(self, obj) -> bool:
        return isinstance(obj, self._meta)

    def __subclasscheck__(self, cls) -> bool:
        return issubclass(cls, self._meta)

    def __repr__(self) -> str:
        return repr(self._meta)

    def __mro_entries__(self, bases):
        raise self._guard.refuse("subclassing 'type' (a metaclass) is not allowed")


def _type_gate(guard: Guard) -> _TypeGate:
    gates: dict[type, _TypeGate] = {}
    gates[type] = _TypeGate(type, gates, guard)  # so that ``type(int) is type`` holds
    return gates[type]


def _update_wrapper_gate(fn, guard: Guard):
    """``functools.update_wrapper``/``wraps`` copy attributes by the names they are given:
    only the default names (never ones built at run time, like ``__array_interface__``)."""
    import functools

    def gated(*args, **kwargs):
        for key, default in (("assigned", functools.WRAPPER_ASSIGNMENTS),
                             ("updated", functools.WRAPPER_UPDATES)):  # fmt: skip
            if key in kwargs and tuple(kwargs[key]) != tuple(default):
                raise guard.refuse(f"functools.{fn.__name__}({key}=...) is not allowed")
        if len(args) > (2 if fn.__name__ == "update_wrapper" else 1):
            raise guard.refuse(f"functools.{fn.__name__} with assigned/updated is not allowed")
        return fn(*args, **kwargs)

    return gated


_GATED: dict[tuple[str, str], object] = {
    ("functools", "update_wrapper"): _update_wrapper_gate,
    ("functools", "wraps"): _update_wrapper_gate,
}


def namespace(guard: Guard) -> dict[str, object]:
    """Fresh globals for one call: curated builtins plus the allowlist import hook."""
    views: dict[str, ModuleType] = {}

    def view(name: str) -> ModuleType:
        if name not in views:
            mod = ModuleType(name)
            d = mod.__dict__
            for key, value in _FILTERED[name].items():
                d[key] = view(value.name) if isinstance(value, _Submodule) else value
            for (modname, key), gate in _GATED.items():
                if modname == name and key in d:
                    d[key] = gate(d[key], guard)  # type: ignore[operator]
            d["__getattr__"] = _missing(name, guard)
            views[name] = mod
        return views[name]

    def safe_import(name, globals=None, locals=None, fromlist=(), level=0):
        if isinstance(fromlist, list) and level == 0 and name in sys.modules:
            # C code (numpy, pyarrow) called from the snippet imports through the snippet's
            # builtins (PyImport_Import); it takes the module from sys.modules itself, so the
            # snippet calling this directly gets nothing back.
            return None
        if level != 0 or name not in IMPORTABLE:
            raise guard.refuse(
                f"import of '{name}' is not allowed (allowed: {', '.join(sorted(ALLOWED))})"
            )
        for item in fromlist or ():
            if item == "*" or item.startswith("_") or item in HIDDEN_NAMES.get(name, ()):
                raise guard.refuse(f"'from {name} import {item}' is not allowed")
        return view(name) if fromlist else view(name.split(".")[0])

    def safe_getattr(obj, name, *default):
        if not isinstance(name, str) or attribute_forbidden(name) or name == "format":
            raise guard.refuse(f"getattr(..., {name!r}) is not allowed")
        return getattr(obj, name, *default)

    def safe_hasattr(obj, name):
        if not isinstance(name, str) or attribute_forbidden(name) or name == "format":
            raise guard.refuse(f"hasattr(..., {name!r}) is not allowed")
        return hasattr(obj, name)

    def forbidden(name: str):
        def refuse(*args, **kwargs):
            raise guard.refuse(f"'{name}' is not available in pushdown python")

        return refuse

    safe = {name: getattr(builtins, name) for name in _SAFE_BUILTIN_NAMES}
    for name, value in vars(builtins).items():
        if isinstance(value, type) and issubclass(value, BaseException):
            safe[name] = value
    for name in FORBIDDEN_BUILTINS:
        safe[name] = forbidden(name)

    def safe_build_class(*args, **kwargs):
        return check_class(builtins.__build_class__(*args, **kwargs), guard)

    safe.update(
        __import__=safe_import,
        getattr=safe_getattr,
        hasattr=safe_hasattr,
        print=_discard,
        __build_class__=safe_build_class,
        type=_type_gate(guard),
    )
    return {"__builtins__": safe, "__name__": "pushdown"}


def _missing(modname: str, guard: Guard):
    """Module ``__getattr__`` of a view: hidden names are violations, typos get a hint."""
    real = vars(sys.modules[modname])
    hidden = HIDDEN_NAMES.get(modname, frozenset())

    def getattr_(attr: str):
        if attr in real or attr in hidden or attr.startswith("_"):
            raise guard.refuse(f"'{modname}.{attr}' is not available in pushdown python")
        close = difflib.get_close_matches(attr, list(_FILTERED[modname]), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise AttributeError(f"module '{modname}' has no attribute '{attr}'{hint}")

    return getattr_


def _discard(*args, **kwargs) -> None:
    """``print`` in a snippet: output is not collected (the result is the table)."""


_IMMUTABLE_TYPE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE


class SharedState:
    """Library state one snippet could change for the snippets after it in the same worker.

    Workers are shared between bindings, so a snippet that patched, say,
    ``collections.Counter.most_common`` or set ``decimal.getcontext().prec`` would affect
    other agents' results.  Per-call settings (decimal context, numpy error and print
    options) are reset before every call; mutable classes and containers of the allowed
    modules are compared with a snapshot after it, and a change is a violation (the worker
    is then replaced).
    """

    def __init__(self) -> None:
        import numpy as np

        classes: dict[int, type] = {}
        self.containers: list[tuple[str, object, object]] = []
        for modname, names in _FILTERED.items():
            for key, value in names.items():
                if isinstance(value, type):
                    for cls in value.__mro__:
                        if cls is not object and not cls.__flags__ & _IMMUTABLE_TYPE:
                            classes[id(cls)] = cls
                elif isinstance(value, dict | list | set):
                    self.containers.append((f"{modname}.{key}", value, _copy(value)))
        self.classes = [(cls, dict(vars(cls))) for cls in classes.values()]
        self.np_err = np.geterr()
        self.np_print = np.get_printoptions()

    def reset(self) -> None:
        import decimal

        import numpy as np

        decimal.setcontext(decimal.Context())
        if _RESEED[0]:  # a snippet fixed the global RNG state: others must not inherit it
            np.random.seed()
            if "random" in sys.modules:
                sys.modules["random"].seed()
            _RESEED[0] = False
        if np.geterr() != self.np_err:
            np.seterr(**self.np_err)
        if np.get_printoptions() != self.np_print:
            np.set_printoptions(**self.np_print)

    def tampered(self, check_classes: bool) -> str | None:
        """Name of the first shared object that differs from its snapshot, if any."""
        for name, obj, snapshot in self.containers:
            if obj != snapshot:
                return name
        if check_classes:
            for cls, snapshot in self.classes:
                if vars(cls) != snapshot:
                    return f"{cls.__module__}.{cls.__qualname__}"
        return None


def _copy(value):
    return {k: v for k, v in value.items()} if isinstance(value, dict) else type(value)(value)


def stores_attributes(source: str) -> bool:
    """True when the snippet assigns or deletes attributes (``x.a = ...``)."""
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return True
    return any(
        isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store | ast.Del)
        for n in ast.walk(tree)
    )
