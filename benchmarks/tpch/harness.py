"""What benchmarks/tpch.py and tests/test_tpch.py share: open the fabric over the loaded
data, build the DuckDB reference over the same rows, turn a query's parameters into the
session values its binding declares, and compare two answers.

Comparison: the same column names in the same order and the same number of rows; values
exact for DECIMAL, integers, strings and dates, 1e-9 relative for doubles; in order only
on the columns the query orders by (rows tied on those may come in any order). A DECIMAL
column answered as a double is reported as a type error even when the numbers agree: the
engine has to keep decimal semantics.
"""

from __future__ import annotations

import datetime as dt
import math
import os
from collections.abc import Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import yaml

from benchmarks.tpch import load
from benchmarks.tpch.queries import QUERIES, Query

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "fabric.yaml"
QUERY_DIR = HERE / "queries"


def binding_file(name: str) -> Path:
    return QUERY_DIR / f"{name}.yaml"


def binding_name(name: str) -> str:
    return f"tpch_{name}"


def open_fabric(data: load.Data):
    """The fabric over benchmarks/tpch/fabric.yaml (which lists queries/), as a user opens it."""
    import fabric

    os.environ.update(data.env)
    return fabric.open(str(CONFIG), ingest=False, watch=False)


def compile_binding(fab, name: str):
    """The compiled binding of queries/<name>.yaml (raises the error a user would see)."""
    from fabric.api import UnknownBindingError

    try:
        return fab.binding(binding_name(name))
    except UnknownBindingError:
        # the file did not parse: raise its own diagnostics rather than "no such binding"
        from dsl.errors import DslError

        mine = [d for d in fab.diagnostics if d.span and Path(str(d.span.file)).stem == name]
        if mine:
            raise DslError(mine) from None
        raise


def run_binding(fab, compiled, session: Mapping[str, Any], analyze: bool = False):
    """One query: ``fab.query`` (with ``analyze``, the executor as ``explain(analyze=True)``
    runs it, which also returns the table)."""
    if not analyze:
        return fab.query(compiled.name, session=session)
    from fabric.execute import execute

    params = compiled.bind(session)
    return execute(compiled.plan, params, fab.catalog, binding=compiled.name, analyze=True)


def reference(data: load.Data):
    """DuckDB over the same rows as local tables (the answer key, and the speed floor)."""
    import duckdb

    con = duckdb.connect()
    for name, table in data.tables.items():
        con.register(f"_{name}", table)
        con.execute(f"CREATE TABLE {name} AS SELECT * FROM _{name}")
        con.unregister(f"_{name}")
    return con


def run_reference(con, q: Query, params: Mapping[str, Any]) -> pa.Table:
    return con.sql(q.sql, params=dict(params)).to_arrow_table()


def declared_session(name: str) -> dict[str, str]:
    doc = yaml.safe_load(binding_file(name).read_text())
    return {k: str(v) for k, v in (doc.get("session") or {}).items()}


def session_values(name: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """The query's parameters as the session values its binding declares (an `interval`
    DELTA is a number of days; a `decimal` is a Decimal; a `float` a float)."""
    types = declared_session(name)
    out: dict[str, Any] = {}
    for key, value in params.items():
        t = types.get(key, "")
        if t == "interval":
            out[key] = dt.timedelta(days=int(value))
        elif t.startswith("decimal"):
            out[key] = Decimal(str(value))
        elif t == "float":
            out[key] = float(value)
        else:
            out[key] = value
    return out


# ------------------------------------------------------------------ comparison


def _family(t: pa.DataType) -> str:
    if pa.types.is_decimal(t):
        return "int" if t.scale == 0 else "decimal"
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "str"
    if pa.types.is_date(t):
        return "date"
    if pa.types.is_timestamp(t):
        return "timestamp"
    return str(t)


def _close(a: Any, b: Any, exact: bool) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, float) or isinstance(b, float) or not exact:
        fa, fb = float(a), float(b)
        if math.isnan(fa) or math.isnan(fb):
            return math.isnan(fa) and math.isnan(fb)
        return fa == fb or abs(fa - fb) <= 1e-9 * max(abs(fa), abs(fb))
    return a == b


def _sort_key(row: tuple) -> tuple:
    out = []
    for v in row:
        if v is None:
            out.append((0, ""))
        elif isinstance(v, float | Decimal | int):
            out.append((1, f"{float(v):.9g}"))
        else:
            out.append((2, str(v)))
    return tuple(out)


def compare(expected: pa.Table, got: pa.Table, order: tuple[str, ...] = ()) -> tuple[str, str]:
    """('ok' | 'types' | 'wrong', what differs)."""
    if got.column_names != expected.column_names:
        return "wrong", f"columns {got.column_names}, expected {expected.column_names}"
    if got.num_rows != expected.num_rows:
        return "wrong", f"{got.num_rows} rows, expected {expected.num_rows}"
    type_notes = []
    exact = []
    for f_exp, f_got in zip(expected.schema, got.schema):
        fe, fg = _family(f_exp.type), _family(f_got.type)
        numeric = {"int", "decimal", "float"}
        if (
            fe != fg
            and not (fe == "float" and fg in numeric)
            and not (fe == "int" and fg == "decimal")
        ):
            type_notes.append(f"{f_exp.name}: {f_got.type}, expected {f_exp.type}")
        exact.append(fe in ("decimal", "int", "str", "date") and fg == fe)
    erows = list(zip(*[c.to_pylist() for c in expected.columns])) if expected.num_rows else []
    grows = list(zip(*[c.to_pylist() for c in got.columns])) if got.num_rows else []
    names = expected.column_names
    if order:
        idx = [names.index(c) for c in order]

        # rows tied on the order keys may come in any order: sort within ties
        def tie_sorted(rows):
            return sorted(
                range(len(rows)),
                key=lambda i: (
                    _tie_group(rows, i, idx),
                    _sort_key(rows[i]),
                ),
            )

        eo, go = tie_sorted(erows), tie_sorted(grows)
        erows, grows = [erows[i] for i in eo], [grows[i] for i in go]
    else:
        erows, grows = sorted(erows, key=_sort_key), sorted(grows, key=_sort_key)
    for r, (er, gr) in enumerate(zip(erows, grows)):
        for c, (ev, gv) in enumerate(zip(er, gr)):
            if not _close(ev, gv, exact[c]):
                return "wrong", (
                    f"row {r} column {names[c]}: got {gv!r}, expected {ev!r}"
                    f" ({got.schema.field(c).type} vs {expected.schema.field(c).type})"
                )
    if type_notes:
        return "types", "; ".join(type_notes)
    return "ok", ""


def _tie_group(rows: list[tuple], i: int, idx: list[int]) -> int:
    """Position of the first row with the same order-key values as row i (rows are in the
    answer's order, so equal keys are adjacent)."""
    key = tuple(rows[i][j] for j in idx)
    k = i
    while k > 0 and tuple(rows[k - 1][j] for j in idx) == key:
        k -= 1
    return k


def all_queries() -> list[str]:
    return sorted(QUERIES)


# ------------------------------------------------------------------ rows needed per source

_STOP = ("group by", "order by", "limit", "having")


def _top_level(sql: str) -> list[tuple[int, int]]:
    """(start, end) of the depth-0 stretches of sql (outside parentheses and strings)."""
    out, depth, start, i, quote = [], 0, 0, 0, False
    while i < len(sql):
        ch = sql[i]
        if quote:
            quote = ch != "'"
        elif ch == "'":
            quote = True
        elif ch == "(":
            if depth == 0:
                out.append((start, i))
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                start = i + 1
        i += 1
    out.append((start, len(sql)))
    return out


def main_block(sql: str) -> str:
    """The FROM ... WHERE ... of the query's main block (inside a derived table when the main
    FROM is one): the rows the answer is computed from, before grouping."""
    low = sql.lower()
    for a, b in _top_level(low):
        k = low.find("from ", a, b)
        if k < 0:
            continue
        rest = low[k + 5 :].lstrip()
        if rest.startswith("("):
            open_at = low.index("(", k)
            depth = 0
            for j in range(open_at, len(low)):
                depth += low[j] == "("
                depth -= low[j] == ")"
                if depth == 0:
                    return main_block(sql[open_at + 1 : j])
        end = len(sql)
        for a2, b2 in _top_level(low):
            if b2 <= k:
                continue
            for stop in _STOP:
                s = low.find(stop, max(a2, k), b2)
                if s >= 0:
                    end = min(end, s)
        return sql[k:end]
    raise ValueError("no FROM in the query")


def fetched_rows(sources: Mapping[str, Any]) -> tuple[dict[str, int], dict[str, int]]:
    """Rows fetched per source alias from a result's ``stats["sources"]``, and apart from
    them the rows of each alias's key-only pre-scans (``o#keys``, ``o#keys2``: one key
    column of the same table, fabric/optimizer/semijoin_reduce.py), summed per alias."""
    full: dict[str, int] = {}
    keys: dict[str, int] = {}
    for a, st in sources.items():
        n = int(st.get("rows", 0))
        base, sep, _ = a.partition("#keys")
        if sep:
            keys[base] = keys.get(base, 0) + n
        else:
            full[a] = n
    return full, keys


def needed_rows(con, q: Query, params: Mapping[str, Any], aliases: list[str]) -> dict[str, int]:
    """Per source alias of the main block: how many rows of that table the answer needs (the
    distinct rows of it in the main block's join, after every filter). `con` is
    `needed_connection()`; aliases not in the main block (stage sources) are left out."""
    import re

    core = main_block(q.sql)
    prefix = ""
    if q.sql.lower().startswith("with"):  # keep the CTEs the main block reads
        low = q.sql.lower()
        prefix = q.sql[
            : next(low.find("select", a, b) for a, b in _top_level(low) if "select" in low[a:b])
        ]
    used = {k: v for k, v in params.items() if f"${k}" in prefix + core}
    out: dict[str, int] = {}
    for a in aliases:
        if not re.search(rf"\b\w+ {re.escape(a)}\b", core):
            continue
        sql = f"{prefix}select count(distinct {a}.__rid) {core}"
        try:
            out[a] = int(con.sql(sql, params=used).fetchall()[0][0])
        except Exception:  # the alias is only inside a subquery of the main block
            continue
    return out


def needed_connection(data: load.Data):
    """DuckDB over the same rows, each table with a row id (`__rid`) to count rows needed."""
    import duckdb

    con = duckdb.connect()
    for name, table in data.tables.items():
        con.register(f"_{name}", table)
        con.execute(f"CREATE TABLE {name} AS SELECT *, row_number() OVER () AS __rid FROM _{name}")
        con.unregister(f"_{name}")
    return con


# ------------------------------------------------------------------ the compact text form


def _items(v: Any) -> list[str]:
    if v is None:
        return []
    if isinstance(v, list):
        return [str(x) for x in v]
    return [str(v)]


def _where(v: Any) -> str:
    parts = _items(v)
    return " and ".join(f"({p})" for p in parts) if len(parts) > 1 else (parts[0] if parts else "")


def _body(doc: Mapping[str, Any]) -> str:
    """from/join clauses .. limit of a binding or a stage, in the text form."""
    out = []
    for i, (alias, src) in enumerate(doc["sources"].items()):
        join = src.get("join")
        how, on = "", None
        if isinstance(join, Mapping):
            # PyYAML reads the key `on` as the YAML 1.1 boolean True
            how, on = ("left " if join.get("how") == "left" else ""), join.get("on", join.get(True))
        elif join is not None:
            on = join
        head = (
            f"from {src['from']} as {alias}"
            if i == 0
            else f"{how}join {src['from']} as {alias} on {on}"
        )
        out.append(head)
        if src.get("where") is not None:
            out.append(f"where {_where(src['where'])}")
        if src.get("derive"):
            out.append("derive " + ", ".join(f"{k} = {v}" for k, v in src["derive"].items()))
    if doc.get("select"):
        out.append("select " + ", ".join(_items(doc["select"])))
    if doc.get("group_by"):
        out.append("group by " + ", ".join(_items(doc["group_by"])))
    if doc.get("having"):
        out.append(f"having {doc['having']}")
    if doc.get("order_by"):
        out.append("order by " + ", ".join(_items(doc["order_by"])))
    if doc.get("limit") is not None:
        out.append(f"limit {doc['limit']}")
    return " ".join(out)


def text_form(name: str) -> str:
    """queries/<name>.yaml written in the compact text form (docs/bindings.md), which must
    express everything the YAML form can: the same query, one string."""
    doc = yaml.safe_load(binding_file(name).read_text())
    out = [f"binding {doc['binding']}_text"]
    if doc.get("session"):
        out.append("session " + ", ".join(f"{k}: {v}" for k, v in doc["session"].items()))
    if doc.get("stages"):
        out.append("with " + ", ".join(f"{k} as ({_body(v)})" for k, v in doc["stages"].items()))
    out.append(_body(doc))
    return " ".join(out)
