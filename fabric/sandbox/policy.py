"""What a pushdown snippet may use: shared by the static check and the worker's runtime layer."""

from __future__ import annotations

import re

ALLOWED_MODULES: frozenset[str] = frozenset(
    {
        "math", "re", "json", "datetime", "statistics", "collections", "itertools",
        "functools", "heapq", "bisect", "decimal", "fractions", "string", "unicodedata",
        "pyarrow", "pyarrow.compute", "numpy",
    }
)  # fmt: skip

# Pure-computation modules an operator may add (``sandbox: allowed_imports`` in fabric.yaml).
OPTIONAL_MODULES: frozenset[str] = frozenset(
    {"random", "base64", "binascii", "hashlib", "hmac", "difflib", "textwrap", "html", "zlib",
     "calendar", "array", "cmath", "colorsys", "struct"}
)  # fmt: skip
# Deliberately not offered: operator (attrgetter/methodcaller reach dunders by string), typing
# (get_type_hints evaluates strings), dataclasses/enum/copy (generated code, __reduce__),
# numbers/abc (global ABC registries), uuid (runs programs), and anything doing I/O.

# Submodules reachable as attributes of an allowed module (``np.linalg``) and importable.
SAFE_SUBMODULES: frozenset[str] = frozenset(
    {"pyarrow.compute", "pyarrow.types", "numpy.linalg", "numpy.random", "numpy.fft"}
)  # fmt: skip

# Public names removed from allowed modules: file access, raw memory, global registries.
HIDDEN_NAMES: dict[str, frozenset[str]] = {
    "numpy": frozenset(
        {"ctypeslib", "memmap", "load", "save", "savez", "savez_compressed", "loadtxt",
         "savetxt", "genfromtxt", "fromfile", "fromregex", "DataSource", "test",
         "show_config", "show_runtime", "get_include", "lib", "f2py", "distutils",
         "testing", "typing", "rec", "seterrcall", "geterrcall", "from_dlpack"}
    ),
    "pyarrow": frozenset(
        {"foreign_buffer", "memory_map", "create_memory_map", "MemoryMappedFile", "OSFile",
         "PythonFile", "input_stream", "output_stream", "cffi", "jvm", "cuda", "lib", "fs",
         "set_cpu_count", "set_io_thread_count", "set_memory_pool", "jemalloc_set_decay_ms",
         "log_memory_allocations", "enable_signal_handlers", "register_extension_type",
         "unregister_extension_type", "load_library", "default_memory_pool",
         "system_memory_pool", "jemalloc_memory_pool", "mimalloc_memory_pool",
         "logging_memory_pool", "proxy_memory_pool", "total_allocated_bytes",
         "BufferReader", "BufferOutputStream", "FixedSizeBufferWriter", "CompressedInputStream",
         "CompressedOutputStream", "NativeFile", "ipc", "show_versions", "show_info",
         "runtime_info", "get_include", "get_libraries", "get_library_dirs",
         "create_library_symlinks", "_import_from_c"}
    ),
    "pyarrow.compute": frozenset(
        {"register_scalar_function", "register_aggregate_function",
         "register_tabular_function", "register_vector_function", "call_tabular_function"}
    ),
    "string": frozenset({"Formatter"}),
}  # fmt: skip

# Builtins a snippet must not name (the worker does not provide them either).
FORBIDDEN_BUILTINS: frozenset[str] = frozenset(
    {"eval", "exec", "compile", "open", "__import__", "globals", "locals", "vars",
     "breakpoint", "input", "help", "exit", "quit", "setattr", "delattr", "memoryview",
     "copyright", "credits", "license", "__build_class__", "__loader__", "__spec__"}
)  # fmt: skip

# Attribute names that reach interpreter internals without dunders (frames, code objects).
FORBIDDEN_ATTRIBUTES: frozenset[str] = frozenset(
    {"f_back", "f_globals", "f_locals", "f_builtins", "f_code", "f_trace", "f_lasti",
     "mro", "format_map", "with_traceback"}
)  # fmt: skip
FORBIDDEN_ATTRIBUTE_PREFIXES: tuple[str, ...] = ("_", "gi_", "cr_", "ag_", "tb_", "co_", "func_")

# Dunder methods a snippet's own classes may define.
ALLOWED_DUNDER_METHODS: frozenset[str] = frozenset(
    {"__init__", "__repr__", "__str__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__",
     "__ge__", "__hash__", "__len__", "__iter__", "__next__", "__getitem__", "__contains__",
     "__call__", "__bool__", "__post_init__"}
)  # fmt: skip

DUNDER_IN_TEXT = re.compile(r"__[A-Za-z]\w*__")


def attribute_forbidden(name: str) -> bool:
    """True for attribute names a snippet may not read (by syntax or through ``getattr``)."""
    return name in FORBIDDEN_ATTRIBUTES or name.startswith(FORBIDDEN_ATTRIBUTE_PREFIXES)


def resolve_modules(allowed: object = None) -> frozenset[str]:
    """The allowlist for a pool: the default, or an operator's list (validated).

    Raises ``ValueError`` naming the modules that may never be allowed.
    """
    if allowed is None or allowed == () or allowed == []:
        return ALLOWED_MODULES
    names = frozenset(str(m) for m in allowed)  # type: ignore[attr-defined]
    bad = sorted(names - ALLOWED_MODULES - OPTIONAL_MODULES)
    if bad:
        raise ValueError(
            f"module(s) {', '.join(bad)} cannot be allowed in pushdown python; choose from: "
            + ", ".join(sorted(ALLOWED_MODULES | OPTIONAL_MODULES))
        )
    return names


def importable(allowed: frozenset[str]) -> frozenset[str]:
    """Allowed modules plus the safe submodules of allowed packages."""
    return allowed | {s for s in SAFE_SUBMODULES if s.split(".")[0] in allowed}
