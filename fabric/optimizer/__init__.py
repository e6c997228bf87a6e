"""Plan optimizer: an ordered tuple of rules, one per file, run to a fixed point.

(Scaffold: the rules arrive with the planner work; until then plans pass unchanged.)
"""

from __future__ import annotations

from typing import Any

from fabric.plan.nodes import Plan


def optimize(plan: Plan, catalog: Any = None) -> Plan:
    return plan
