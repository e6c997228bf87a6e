"""Plan optimizer: an ordered tuple of rules, one per file, run to a fixed point.

Each rule is a plain function ``rule(plan, catalog) -> plan`` (see its module
docstring). ``optimize`` runs ``RULES`` in order, repeatedly, until a whole pass changes
nothing or ``MAX_PASSES`` is reached (after sqlglot's and DataFusion's optimizers), and
raises ``OptimizerError`` naming the rule if one changed the plan's output schema.

The catalog only needs ``source(uri)`` returning a ``connectors.base.Source`` planning
view (schema, supports_filter, capabilities, statistics); no data moves while planning.
Sources and statistics are looked up once per ``optimize`` call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from connectors.base import Source, Statistics
from dsl.errors import FabricError
from fabric.optimizer.backward_keys import backward_keys
from fabric.optimizer.branch_keys import branch_keys
from fabric.optimizer.dynamic_filters import dynamic_filters
from fabric.optimizer.factor_or import factor_or
from fabric.optimizer.join_bounds import join_bounds
from fabric.optimizer.join_order import join_order
from fabric.optimizer.push_aggregate import push_aggregate
from fabric.optimizer.push_exists import push_exists
from fabric.optimizer.push_filters import push_filters
from fabric.optimizer.push_limit import push_limit
from fabric.optimizer.push_projection import push_projection
from fabric.optimizer.reverse_full_keys import reverse_full_keys
from fabric.optimizer.semijoin_reduce import semijoin_reduce
from fabric.optimizer.stage_keys import stage_keys
from fabric.plan.nodes import Plan

Rule = Callable[[Plan, Any], Plan]

RULES: tuple[Rule, ...] = (
    factor_or,
    push_filters,
    push_exists,
    join_order,
    dynamic_filters,
    branch_keys,
    join_bounds,
    stage_keys,
    semijoin_reduce,
    backward_keys,
    reverse_full_keys,
    push_aggregate,
    push_projection,
    push_limit,
)
MAX_PASSES = 10


class OptimizerError(FabricError, RuntimeError):
    """A rule produced an invalid plan (a bug in that rule, not in the binding)."""


def optimize(
    plan: Plan, catalog: Any = None, *, rules: Sequence[Rule] = RULES, max_passes: int = MAX_PASSES
) -> Plan:
    """Apply ``rules`` in order until a fixed point (or ``max_passes`` passes)."""
    view = _PlanningView(catalog) if catalog is not None else None
    for _ in range(max_passes):
        before = plan
        for rule in rules:
            new = rule(plan, view)
            if not new.schema.equals(plan.schema):
                raise OptimizerError(
                    f"optimizer rule {rule.__name__} changed the output schema from "
                    f"[{', '.join(plan.schema.names)}] to [{', '.join(new.schema.names)}]; "
                    "this is a bug in that rule: a rule may rewrite a plan but not its result"
                )
            plan = new
        if plan == before:
            break
    return plan


class _PlanningView:
    """Caches ``catalog.source(uri)`` and each source's statistics for one optimize call."""

    def __init__(self, catalog: Any):
        self._catalog = catalog
        self._sources: dict[str, Any] = {}

    def source(self, uri: str) -> Any:
        if uri not in self._sources:
            self._sources[uri] = _CachedStats(self._catalog.source(uri))
        return self._sources[uri]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._catalog, name)


class _CachedStats:
    def __init__(self, source: Source):
        self._source = source
        self._stats: Statistics | None = None

    def statistics(self) -> Statistics:
        if self._stats is None:
            self._stats = self._source.statistics()
        return self._stats

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)


__all__ = ["MAX_PASSES", "RULES", "OptimizerError", "optimize"]
