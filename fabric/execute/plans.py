"""What the executor keeps per plan, not per query: the physical plan of a logical plan
(``physical``) and, per physical plan, the facts it derives from it once (``PlanCache``).

Both tables are keyed by the plan object's identity and checked through a weak reference,
so a new plan at a freed plan's address gets its own entry, and an entry goes with its
plan (the plans are frozen: nothing is cached on the nodes themselves)."""

from __future__ import annotations

import threading
import weakref
from typing import Any

from dsl.ast import Expr
from fabric.execute.errors import QueryError
from fabric.physical import planner as _planner
from fabric.physical.nodes import PhysicalError, PhysicalPlan
from fabric.plan.nodes import Plan

_physical_plans: dict[int, tuple[weakref.ref[Plan], int, PhysicalPlan]] = {}
_lock = threading.Lock()


def physical(plan: Plan, catalog: Any, binding: str) -> PhysicalPlan:
    """The physical plan of a logical ``plan``, built on first use and kept (in a table
    here, not on the frozen node) while the plan object lives: callers that pass the same
    logical plan again, like the compiler's physical plan, pay for planning once."""
    hit = _physical_plans.get(id(plan))
    if hit is not None and hit[0]() is plan and hit[1] == id(catalog):
        return hit[2]
    try:
        pp = _planner.plan(plan, catalog)
    except _planner.PlanningError as e:
        raise QueryError(binding, e.message, hint=e.hint) from None
    except PhysicalError as e:
        raise QueryError(
            binding, str(e), hint="this is a planner bug; report the binding"
        ) from None
    key = id(plan)

    def forget(_: Any, plans: dict = _physical_plans, lock: Any = _lock) -> None:
        with lock:  # the module's globals may be gone at interpreter exit: bound here
            entry = plans.get(key)
            if entry is not None and entry[0]() is None:
                del plans[key]

    with _lock:
        _physical_plans[key] = (weakref.ref(plan, forget), id(catalog), pp)
    return pp


class PlanCache:
    """What the executor derives from a physical plan once, not per query: per plain
    Project node, its input's column names, their positions, the output names and types,
    and whether that output is the plan's answer as declared (no ``_conform`` then)."""

    __slots__ = ("exprmaps", "in_process", "names", "projects", "search")

    def __init__(self) -> None:
        self.projects: dict[
            int, tuple[list[str], list[int] | None, list[str], list[Any], bool]
        ] = {}
        # per node (by id, the plan keeps its nodes alive): ``_planner.exprmap`` of it
        self.exprmaps: dict[int, dict[Expr, str]] = {}
        self.names: dict[int, list[str]] = {}  # and its schema's names
        # per (catalog, unit alias): whether the unit's source scans in this process
        self.in_process: dict[tuple[int, str], bool] = {}
        # fabric.execute.search.SearchShape of the plan, None: not that shape; False: not
        # looked at yet
        self.search: Any = False


_plan_caches: dict[int, tuple[weakref.ref[PhysicalPlan], PlanCache]] = {}


def plan_cache(pp: PhysicalPlan) -> PlanCache:
    """The ``PlanCache`` of ``pp`` while it lives (keyed by identity, checked through a
    weak reference: a new plan at a freed plan's address gets a new cache)."""
    hit = _plan_caches.get(id(pp))
    if hit is not None and hit[0]() is pp:
        return hit[1]
    cache = PlanCache()
    key = id(pp)

    def forget(_: Any, caches: dict = _plan_caches, lock: Any = _lock) -> None:
        with lock:
            entry = caches.get(key)
            if entry is not None and entry[0]() is None:
                del caches[key]

    with _lock:
        _plan_caches[key] = (weakref.ref(pp, forget), cache)
    return cache
