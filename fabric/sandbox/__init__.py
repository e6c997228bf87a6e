"""Pushdown sandboxes: user Python that runs next to the data, in isolated worker processes.

    from fabric.sandbox import SandboxPool, SandboxLimits, check_snippet
    diags = check_snippet(src, file="agents/news.yaml", line=14, col=7)   # at compile time
    with SandboxPool(size=2) as pool:
        out = pool.run(src, table, params={"k": 5}, limits=SandboxLimits(),
                       binding="market_open_news", snippet_origin=("agents/news.yaml", 14, 7))

See docs/sandbox.md for the isolation layers.
"""

from .errors import (
    SandboxError,
    SandboxMemoryError,
    SandboxRuntimeError,
    SandboxTimeout,
    SandboxViolation,
)
from .limits import SandboxLimits
from .policy import ALLOWED_MODULES
from .pool import SandboxPool, shared_pool
from .static import check_snippet, snippet_params

__all__ = [
    "ALLOWED_MODULES",
    "SandboxError",
    "SandboxLimits",
    "SandboxMemoryError",
    "SandboxPool",
    "SandboxRuntimeError",
    "SandboxTimeout",
    "SandboxViolation",
    "check_snippet",
    "shared_pool",
    "snippet_params",
]
