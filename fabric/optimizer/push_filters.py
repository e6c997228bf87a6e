"""Move each conjunct of a filter as close to its source as the source allows.

A ``Filter`` is split into conjuncts. A conjunct over one source travels down to that
source's ``Scan``, whose planning view answers ``supports_filter`` on the unqualified
conjunct:

- EXACT: the conjunct goes into ``Scan.exact`` and nothing is kept above;
- INEXACT: it goes into ``Scan.inexact`` *and* a Filter directly above re-checks it;
- UNSUPPORTED: a Filter directly above the scan applies it.

A filter is never dropped (fail closed). A conjunct over derived columns goes down with
each replaced by the expression computing it when the scan takes that (``_inlined``),
else it stops above the ``Derive`` that computes them; conjuncts over two sources become join conditions of the
inner join that brings them together (or stay above a left join); conjuncts over the
nullable side of a left join stay above it; constant conjuncts stay where they are.
Single-source conjuncts inside an inner join's ``on`` move down the same way.

    Filter: m.status = 'active' and c.code = 'X'           Join: inner on c.merchant_id = m.id
      Join: inner on c.merchant_id = m.id          ->        Scan: m <- ... exact=[status = 'active']
        Scan: m <- mysql://shop/merchants                    Scan: c <- ... exact=[code = 'X']
        Scan: c <- mongo://crm/coupons
"""

from __future__ import annotations

import dataclasses
from typing import Any

from connectors.base import Pushdown
from dsl.ast import Column, Expr, Literal, and_all, conjuncts, sources_of, unqualify
from dsl.ast import replace as replace_expr
from fabric.optimizer._util import aliases, ask_filter, derived_names, filters_before_latest
from fabric.plan.nodes import Derive, Filter, Join, Plan, Scan, Sort


def push_filters(plan: Plan, catalog: Any) -> Plan:
    """Push every filter conjunct as deep as its sources allow (see module docstring)."""
    return _visit(plan, catalog)


def _visit(node: Plan, catalog: Any) -> Plan:
    if isinstance(node, Filter):
        child = _visit(node.input, catalog)
        remaining: list[Expr] = []
        for c in conjuncts(node.predicate):
            pushed = _push(child, c, catalog)
            if pushed is None:
                remaining.append(c)
            else:
                child = pushed
        return _wrap(child, remaining) if remaining else child
    if isinstance(node, Join):
        left, right = _visit(node.left, catalog), _visit(node.right, catalog)
        keep: list[Expr] = []
        for c in conjuncts(node.on):
            srcs = sources_of(c)
            if srcs and srcs <= aliases(
                right
            ):  # filtering the right side first is safe for inner and left
                right = _push_or_wrap(right, c, catalog)
            elif srcs and node.how == "inner" and srcs <= aliases(left):
                left = _push_or_wrap(left, c, catalog)
            else:
                keep.append(c)
        on = _all(keep) if keep else Literal(True, "bool")
        return dataclasses.replace(node, left=left, right=right, on=on)
    children = node.children()
    if not children:
        return node
    new = tuple(_visit(c, catalog) for c in children)
    return node if all(a is b for a, b in zip(new, children)) else node.with_children(*new)


def _push(node: Plan, c: Expr, catalog: Any) -> Plan | None:
    """``node`` with ``c`` applied inside it, or None when ``c`` must stay above ``node``."""
    srcs = sources_of(c)
    if not srcs or not srcs <= aliases(node):
        return None
    if isinstance(node, Scan):
        return _into_scan(node, c, catalog)
    if isinstance(node, Filter):
        inner = _push(node.input, c, catalog)
        if inner is None:
            return _wrap(node, [c])
        return Filter(inner, node.predicate)
    if isinstance(node, Derive):
        if {col.qualified for col in c.columns()} & derived_names(node):
            inlined = _inlined(node, c, catalog)
            if inlined is None:
                return _wrap(node, [c])
            return Derive(_push_or_wrap(node.input, inlined, catalog), node.items)
        return Derive(_push_or_wrap(node.input, c, catalog), node.items)
    if isinstance(node, Sort):
        return Sort(_push_or_wrap(node.input, c, catalog), node.keys)
    if isinstance(node, Join):
        if srcs <= aliases(node.left):
            return dataclasses.replace(node, left=_push_or_wrap(node.left, c, catalog))
        if node.how != "inner":
            return (
                None  # the nullable side of a left join: filtering it first would change the result
            )
        if srcs <= aliases(node.right):
            return dataclasses.replace(node, right=_push_or_wrap(node.right, c, catalog))
        if c in conjuncts(node.on):
            return node
        return dataclasses.replace(node, on=_all([*conjuncts(node.on), c]))
    return None  # Project, Aggregate, Limit, VectorSearch, UserFunction, EncryptedScore


def _inlined(derive: Derive, c: Expr, catalog: Any) -> Expr | None:
    """``c`` over ``derive``'s columns with each replaced by the expression computing it
    (``cntrycode in {{session.codes}}`` -> ``substring(c.c_phone, 1, 2) in ...``: TPC-H
    Q22's customers), when that reads only columns from below and the scan under the
    Filter / Derive chain takes it (EXACT or INEXACT: the source then evaluates it as the
    fabric would, ``Pushdown``'s contract); else None (``c`` stays above the Derive)."""
    items = {name: e for name, e, _ in derive.items}
    inlined = replace_expr(
        c, lambda e: None, pre=lambda e: items.get(e.qualified) if isinstance(e, Column) else None
    )
    if {col.qualified for col in inlined.columns()} & derived_names(derive):
        return None
    scan: Plan = derive.input
    while isinstance(scan, Filter | Derive | Sort):
        scan = scan.input
    if not isinstance(scan, Scan) or scan.aggregate is not None:
        return None
    answer = ask_filter(catalog, scan.uri, unqualify(inlined))
    return inlined if answer in (Pushdown.EXACT, Pushdown.INEXACT) else None


def _into_scan(scan: Scan, c: Expr, catalog: Any) -> Plan:
    if scan.aggregate is not None:  # a filter over the groups (HAVING) stays above them
        return _wrap(scan, [c])
    if not filters_before_latest(scan, {col.name for col in c.columns()}):
        # a latest_by source is the table of each key's newest record, and a filter on
        # another column is a filter of that table: the source would apply it before
        # keeping the newest record, and answer with an older record that passes it
        return _wrap(scan, [c])
    uq = unqualify(c)
    if uq in scan.exact:
        return scan
    if uq in scan.inexact:
        return _wrap(scan, [c])
    answer = ask_filter(catalog, scan.uri, uq)
    if answer is Pushdown.EXACT:
        return dataclasses.replace(scan, exact=(*scan.exact, uq))
    if answer is Pushdown.INEXACT:
        return _wrap(dataclasses.replace(scan, inexact=(*scan.inexact, uq)), [c])
    return _wrap(scan, [c])


def _push_or_wrap(node: Plan, c: Expr, catalog: Any) -> Plan:
    pushed = _push(node, c, catalog)
    return pushed if pushed is not None else _wrap(node, [c])


def _wrap(node: Plan, items: list[Expr]) -> Plan:
    """A Filter of ``items`` directly above ``node``, merged into an existing Filter."""
    if isinstance(node, Filter):
        existing = conjuncts(node.predicate)
        new = [c for c in items if c not in existing]
        return node if not new else Filter(node.input, _all([*existing, *new]))
    predicate = and_all(list(dict.fromkeys(items)))
    assert predicate is not None
    return Filter(node, predicate)


def _all(items: list[Expr]) -> Expr:
    e = and_all(items)
    assert e is not None, "a conjunction of nothing"
    return e
