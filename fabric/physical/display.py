"""The physical plan as indented text: what ``explain`` shows before anything runs.

Every line names the engine of its part; the logical nodes keep their headers, so
``explain(analyze=True)`` appends actual rows and times to the same lines::

    Physical plan: 3 source units on the scan pool (m after loc, c after m)
    DuckDB query over 2 inputs:
      Limit: 10
        Join: inner on c.merchant_id = m.id
          Join: inner on m.geo_hash = loc.cell
            Source unit loc [scan pool]:
              pyarrow Derive: loc.cell = geo_hash(loc.lat, loc.lon, 6)
                Scan: loc <- kafka://bus/t projection=[lat, lon] ...
            Source unit m [scan pool, after loc: dynamic filter keys]:
              Scan: m <- mysql://shop/merchants ...

A key-only pre-scan (``semijoin_reduce``) is shown below the first unit waiting for its
keys, as ``Key-only pre-scan o#keys [scan pool; after c: dynamic filter keys]:`` and its
Scan (projection: the key column alone).
"""

from __future__ import annotations

from collections.abc import Callable

from fabric.physical.nodes import (
    CkksScore,
    DuckDBRegion,
    DuckDBStep,
    Physical,
    PhysicalPlan,
    PyArrowStep,
    SandboxCall,
    SourceUnit,
    StagesFirst,
    StageTable,
)
from fabric.plan.nodes import Plan, Stage

Annotate = Callable[[Plan], "str | None"]


def render(pp: PhysicalPlan, annotate: Annotate | None = None) -> str:
    """The text of ``pp``; ``annotate(logical node) -> str | None`` appends run-time facts."""
    lines = [summary(pp)]
    _node(pp.root, 0, lines, annotate)
    return "\n".join(lines)


def summary(pp: PhysicalPlan) -> str:
    n = len(pp.units)
    if n == 0:
        return "Physical plan: no source units"
    units = [pp.units[a] for a in pp.order]
    if all(u.placement == "inline" for u in units):
        where = "inline on the caller's thread"
    else:
        free = [u.alias for u in units if not u.deps]
        where = "on the scan pool"
        if len(free) > 1:
            where += f" ({', '.join(free)} in parallel)"
    waits = [f"{u.alias} after {', '.join(sorted(u.deps))}" for u in units if u.deps]
    tail = f"; {'; '.join(waits)}" if waits else ""
    return f"Physical plan: {n} source unit{'s' * (n != 1)} {where}{tail}"


def _line(indent: int, text: str, node: Plan | None, annotate: Annotate | None) -> str:
    extra = annotate(node) if annotate is not None and node is not None else None
    return "  " * indent + text + (f"  [{extra}]" if extra else "")


def _node(p: Physical, indent: int, lines: list[str], annotate: Annotate | None) -> None:
    if isinstance(p, SourceUnit):
        _unit(p, indent, lines, annotate, "Source unit")
        return
    if isinstance(p, DuckDBRegion):
        n = len(p.inputs)
        lines.append("  " * indent + f"DuckDB query over {n} input{'s' * (n != 1)}:")
        inputs = {id(i.logical): i for i in p.inputs}

        def region(node: Plan, depth: int) -> None:
            inp = inputs.get(id(node))
            if inp is not None:
                _node(inp, depth, lines, annotate)
                return
            lines.append(_line(depth, node.header(), node, annotate))
            for c in node.children():
                region(c, depth + 1)

        region(p.logical, indent + 1)
        return
    if isinstance(p, StagesFirst):
        lines.append(
            _line(indent, p.logical.header() + " (run first, in order)", p.logical, annotate)
        )
        for st in p.stages:
            _node(st, indent + 1, lines, annotate)
        _node(p.input, indent + 1, lines, annotate)
        return
    if isinstance(p, PyArrowStep) and isinstance(p.logical, Stage):
        text = p.logical.header()  # the stage's result is its input's
    elif isinstance(p, PyArrowStep):
        text = f"pyarrow {p.logical.header()}"
    elif isinstance(p, DuckDBStep):
        text = f"DuckDB {p.logical.header()} ({p.why})"
    elif isinstance(p, SandboxCall):
        text = f"sandbox {p.logical.header()}"
    elif isinstance(p, CkksScore):
        text = f"CKKS {p.logical.header()}"
    elif isinstance(p, StageTable):
        text = p.logical.header()
    else:  # pragma: no cover - every node kind is listed above
        text = type(p).__name__
    lines.append(_line(indent, text, p.logical, annotate))
    for c in p.children():
        _node(c, indent + 1, lines, annotate)


def _unit(
    p: SourceUnit, indent: int, lines: list[str], annotate: Annotate | None, kind: str
) -> None:
    where = "scan pool" if p.placement == "pool" else "inline"
    facts = [where]
    if p.deps:
        facts.append(f"after {', '.join(sorted(p.deps))}: dynamic filter keys")
    if p.requires:
        facts.append(f"after stage {', '.join(sorted(p.requires))}")
    lines.append("  " * indent + f"{kind} {p.alias} [{'; '.join(facts)}]:")
    depth = indent + 1
    for step, engine in zip(p.chain, p.engines):
        label = "DuckDB" if engine == "duckdb" else engine
        lines.append(_line(depth, f"{label} {step.header()}", step, annotate))
        depth += 1
    lines.append(_line(depth, p.leaf.header(), p.leaf, annotate))
    for pre in p.prescans:  # key-only pre-scans (semijoin_reduce), run before this unit
        _unit(pre, depth + 1, lines, annotate, "Key-only pre-scan")
