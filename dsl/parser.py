"""Parse binding expressions and the compact text form with one LALR grammar.

``parse_expr("status = 'active'", file=..., line=..., col=...)`` returns a ``dsl.ast``
node whose spans point into the file the text came from. YAML scalars that span several
lines pass a ``positions`` table (file line/column per character) instead.

Syntax errors become ``DslError`` with the position, the source line underlined and the
expected tokens in plain words.
"""

from __future__ import annotations

import datetime as dt
import decimal
import functools
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import (
    UnexpectedCharacters,
    UnexpectedEOF,
    UnexpectedInput,
    UnexpectedToken,
    VisitError,
)

from dsl import ast as A
from dsl.errors import Diagnostic, DslError, Span
from dsl.options import (
    check_uri,
    default_alias,
    make_freshness,
    make_limits,
    make_nearest,
    make_rank,
    make_search,
)
from dsl.spec import (
    BindingSpec,
    DeriveItem,
    JoinSpec,
    Name,
    PushdownSpec,
    SelectItem,
    SessionParam,
    SourceSpec,
)
from dsl.types import CAST_TYPES, CalendarInterval, ValueType, make_type, stage_param

STARTS = ("expr_start", "select_start", "sort_start", "exprs_start", "type_start", "binding_start")


# ------------------------------------------------------------------ positions


class PosMap:
    """Maps a character offset in a parsed text to a (line, col) in its file.

    Without ``positions`` the text is assumed to start at (line, col) and its later
    lines to start at column 1 (``Span.shifted`` semantics)."""

    __slots__ = ("col", "file", "line", "line_starts", "positions", "text")

    def __init__(
        self,
        file: str,
        text: str,
        line: int = 1,
        col: int = 1,
        positions: Sequence[tuple[int, int]] | None = None,
    ):
        self.file, self.text, self.line, self.col, self.positions = file, text, line, col, positions
        self.line_starts: list[int] | None = None

    def at(self, offset: int) -> tuple[int, int]:
        if self.positions is not None:
            if not self.positions:
                return self.line, self.col
            if offset < len(self.positions):
                return self.positions[offset]
            ln, c = self.positions[-1]
            return ln, c + offset - len(self.positions) + 1
        if "\n" not in self.text:
            return self.line, self.col + offset
        if self.line_starts is None:
            self.line_starts = [0] + [i + 1 for i, ch in enumerate(self.text) if ch == "\n"]
        import bisect

        i = bisect.bisect_right(self.line_starts, offset) - 1
        c = offset - self.line_starts[i]
        return (self.line, self.col + c) if i == 0 else (self.line + i, 1 + c)

    def span(self, start: int, end: int) -> Span:
        ln, c = self.at(start)
        eln, ec = self.at(max(end - 1, start))
        return Span(self.file, ln, c, eln, ec + 1 if end > start else ec)


class _Ctx(threading.local):
    pos: PosMap | None = None


_ctx = _Ctx()


def _sp(meta: Any) -> Span | None:
    pos = _ctx.pos
    if pos is None or getattr(meta, "empty", True):
        return None
    return pos.span(meta.start_pos, meta.end_pos)


def _tsp(tok: Token) -> Span | None:
    pos = _ctx.pos
    if pos is None or tok.start_pos is None or tok.end_pos is None:
        return None
    return pos.span(tok.start_pos, tok.end_pos)


# ------------------------------------------------------------------ literals

_INTERVAL_PART = re.compile(
    r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(milliseconds?|ms|seconds?|secs?|s|minutes?|mins?|m|hours?|hrs?|h|days?|d|weeks?|w|months?|mons?|years?|yrs?|y)(?![a-z])\s*",
    re.I,
)
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_interval(text: str, span: Span | None) -> dt.timedelta | CalendarInterval:
    """``'5 minutes'``, ``'1 hour 30 minutes'``, ``'500 ms'``, ``'2 days'``; with months or
    years (``'3 months'``, ``'1 year'``) a ``CalendarInterval`` (a month has no fixed length)."""
    pos, total, months = 0, 0.0, 0
    while pos < len(text):
        m = _INTERVAL_PART.match(text, pos)
        if not m or m.end() == pos:
            raise DslError.at(
                f"cannot read interval '{text}'",
                span,
                "write e.g. interval '5 minutes', '1 hour 30 minutes', '500 ms', '2 days'",
            )
        unit = m.group(2).lower()
        if unit.startswith(("mon", "y")):
            n = float(m.group(1))
            if n != int(n):
                raise DslError.at(
                    f"cannot read interval '{text}': months and years must be whole numbers",
                    span,
                    "write e.g. interval '3 months' or '1 year'",
                )
            months += int(n) * (12 if unit.startswith("y") else 1)
        else:
            key = "ms" if unit.startswith(("milli", "ms")) else unit[0]
            total += float(m.group(1)) * _UNIT_SECONDS[key]
        pos = m.end()
    if pos == 0:
        raise DslError.at("empty interval", span, "write e.g. interval '5 minutes'")
    if months:
        return CalendarInterval(months, dt.timedelta(seconds=total))
    return dt.timedelta(seconds=total)


def parse_timestamp(text: str, span: Span | None) -> dt.datetime:
    try:
        v = dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise DslError.at(
            f"cannot read timestamp '{text}'",
            span,
            "write an ISO-8601 time, e.g. timestamp '2024-05-01T09:30:00Z'",
        ) from None
    return v.replace(tzinfo=dt.UTC) if v.tzinfo is None else v.astimezone(dt.UTC)


def parse_date(text: str, span: Span | None) -> dt.date:
    try:
        return dt.date.fromisoformat(text.strip())
    except ValueError:
        raise DslError.at(
            f"cannot read date '{text}'", span, "write an ISO-8601 date, e.g. date '1994-01-01'"
        ) from None


def _unquote(tok: str) -> str:
    if tok[0] == "'":
        return tok[1:-1].replace("''", "'")
    body = tok[1:-1]
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t"}.get(m.group(1), m.group(1)), body)


_PARAM = re.compile(r"^\{\{\s*session\.([A-Za-z_][A-Za-z0-9_]*)\s*\}\}$")
_EMBED = re.compile(
    r"^\{\{\s*embed\s*\(\s*session\.([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*\}\}$", re.IGNORECASE
)


def _param(tok: Token) -> A.Expr:
    m = _PARAM.match(str(tok))
    e = _EMBED.match(str(tok))
    if e:  # {{embed(session.q)}}: the fabric embeds the text (fabric.plan.builder types it)
        return A.Call("embed", (A.Param(e.group(1), span=_tsp(tok)),), span=_tsp(tok))
    if not m:
        raise DslError.at(
            f"bad placeholder {tok}", _tsp(tok), "session values are written {{session.<name>}}"
        )
    return A.Param(m.group(1), span=_tsp(tok))


# ------------------------------------------------------------------ tree -> AST

_CMP = {"==": "=", "<>": "!="}


@v_args(meta=True)
class _ToAst(Transformer):
    """Builds ``dsl.ast`` nodes (and spec pieces for the text form) while parsing."""

    # ---- entry points
    def expr_start(self, meta, c):
        return c[0]

    def select_start(self, meta, c):
        return c[0]

    def sort_start(self, meta, c):
        return c[0]

    def exprs_start(self, meta, c):
        return tuple(c)

    def type_start(self, meta, c):
        return c[0]

    # ---- names
    def name(self, meta, c):
        tok = c[0]
        v = str(tok)
        if tok.type == "QUOTED_NAME":
            v = v[1:-1]
        return Name(v, _tsp(tok))

    def column(self, meta, c):
        parts = [n.value for n in c]
        span = _sp(meta)
        if len(parts) == 1:
            return A.Column(parts[0], None, span=span)
        return A.Column(".".join(parts[1:]), parts[0], span=span)

    def star(self, meta, c):
        return A.Star(c[0].value if len(c) == 2 else None, span=_sp(meta))

    def param(self, meta, c):
        return _param(c[0])

    def call(self, meta: Any, c: list[Any]) -> A.Call:
        fname: Name = c[0]
        distinct = c[1] is not None
        args = tuple(a for a in c[2:] if a is not None)
        return A.Call(fname.value.lower(), args, distinct, span=_sp(meta))

    def call_from(self, meta: Any, c: list[Any]) -> A.Call:
        """``extract(year from ts)`` (SQL's form) is ``extract('year', ts)``."""
        fname: Name = c[0]
        if fname.value.lower() not in ("extract", "date_part"):
            raise DslError.at(
                f"'{fname.value}(... from ...)' is not a function call",
                _sp(meta),
                "only extract(<field> from <time>) is written with from; "
                f"write {fname.value}(a, b)",
            )
        unit: Name = c[1]
        return A.Call(
            fname.value.lower(),
            (A.Literal(unit.value.lower(), "str", span=unit.span), c[3]),
            span=_sp(meta),
        )

    # ---- literals
    def int_lit(self, meta, c):
        return A.Literal(int(c[0]), "int", span=_sp(meta))

    def float_lit(self, meta, c):
        text = str(c[0])
        if "e" in text.lower():  # 1.5e3: an approximate (float) literal, as in SQL
            return A.Literal(float(text), "float", span=_sp(meta))
        # 0.06: an exact decimal, as in SQL (0.06 - 0.01 is 0.05, not 0.049999...)
        return A.Literal(decimal.Decimal(text), "decimal", span=_sp(meta))

    def str_lit(self, meta, c):
        return A.Literal(_unquote(str(c[0])), "str", span=_sp(meta))

    def true_lit(self, meta, c):
        return A.Literal(True, "bool", span=_sp(meta))

    def false_lit(self, meta, c):
        return A.Literal(False, "bool", span=_sp(meta))

    def null_lit(self, meta, c):
        return A.Literal(None, "null", span=_sp(meta))

    def interval_lit(self, meta, c):
        span = _sp(meta)
        return A.Literal(parse_interval(_unquote(str(c[1])), span), "interval", span=span)

    def timestamp_lit(self, meta, c):
        span = _sp(meta)
        return A.Literal(parse_timestamp(_unquote(str(c[1])), span), "timestamp", span=span)

    def date_lit(self, meta, c):
        span = _sp(meta)
        return A.Literal(parse_date(_unquote(str(c[1])), span), "date", span=span)

    # ---- case, cast, subqueries
    def when_then(self, meta, c):
        return (c[1], c[3])

    def case(self, meta, c):
        span = _sp(meta)
        operand = c[1]
        pairs = [x for x in c[2:] if isinstance(x, tuple)]
        default = c[-2]
        args: list[A.Expr] = []
        for cond, result in pairs:
            # `case x when 1 then ...` is `case when x = 1 then ...`
            args += [A.Binary("=", operand, cond, span=cond.span) if operand else cond, result]
        if default is not None:
            args.append(default)
        return A.Call("case", tuple(args), span=span)

    def cast(self, meta, c):
        t: ValueType = c[3]
        if t.kind not in CAST_TYPES:
            raise DslError.at(
                f"cannot cast to {t}", _sp(meta), f"cast to one of: {', '.join(CAST_TYPES)}"
            )
        return A.Call("cast", (c[1], A.Literal(str(t), "str")), span=_sp(meta))

    def exists(self, meta, c):
        return A.Exists(c[1].value, c[3], span=_sp(meta))

    def in_stage(self, meta, c):
        return A.Param(stage_param(c[0].value, "list"), span=c[0].span)

    def list_lit(self, meta, c):
        items = [x for x in c if x is not None]
        span = _sp(meta)
        values = []
        for x in items:
            if not isinstance(x, A.Literal) or x.type not in (
                "int",
                "float",
                "decimal",
                "str",
                "bool",
            ):
                raise DslError.at(
                    "a [...] list may hold only constant numbers, strings or booleans",
                    x.span or span,
                )
            values.append(float(x.value) if x.type == "decimal" else x.value)
        return A.Literal(tuple(values), "list", span=span)

    # ---- operators
    def neg(self, meta, c):
        x = c[1]
        if isinstance(x, A.Literal) and x.type in ("int", "float", "decimal"):
            # copy_negate: exact (-x rounds a decimal to the context's 28 digits:
            # -9999999999999999999999999999.999999999 became -1.000...E+28)
            v = x.value.copy_negate() if x.type == "decimal" else -x.value
            return A.Literal(v, x.type, span=_sp(meta))
        return A.Unary("-", x, span=_sp(meta))

    def pos(self, meta, c):
        return c[1]

    def arith(self, meta, c):
        return A.Binary(str(c[1]), c[0], c[2], span=_sp(meta))

    def compare(self, meta, c):
        op = str(c[1])
        return A.Binary(_CMP.get(op, op), c[0], c[2], span=_sp(meta))

    def logical(self, meta, c):
        return A.Binary(str(c[1]).lower(), c[0], c[2], span=_sp(meta))

    def not_(self, meta, c):
        return A.Unary("not", c[1], span=_sp(meta))

    def in_tuple(self, meta, c):
        return tuple(c)

    def in_param(self, meta, c):
        return _param(c[0])

    def in_list(self, meta, c):
        return A.InList(c[0], c[3], c[1] is not None, span=_sp(meta))

    def between(self, meta, c):
        return A.Between(c[0], c[3], c[5], c[1] is not None, span=_sp(meta))

    def like(self, meta, c):
        return A.Like(c[0], c[3], c[1] is not None, False, span=_sp(meta))

    def ilike(self, meta, c):
        return A.Like(c[0], c[3], c[1] is not None, True, span=_sp(meta))

    def is_null(self, meta, c):
        return A.IsNull(c[0], c[2] is not None, span=_sp(meta))

    # ---- lists
    def select_list(self, meta, c):
        return tuple(c)

    def select_item(self, meta, c):
        return SelectItem(c[0], c[2].value if c[2] is not None else None, span=_sp(meta))

    def sort_list(self, meta, c):
        return tuple(c)

    def sort_key(self, meta, c):
        desc = c[1] is not None and str(c[1]).lower() == "desc"
        nulls_first = None if c[3] is None else str(c[3]).lower() == "first"
        return A.SortKey(c[0], desc, nulls_first, span=_sp(meta))

    def type_expr(self, meta, c):
        arg = c[1]
        if isinstance(arg, Token):
            arg = int(arg)
        return make_type(c[0].value, arg, _sp(meta))

    def type_args(self, meta, c):
        args = tuple(int(x) for x in c[1:] if x is not None)
        return make_type(c[0].value, args, _sp(meta))

    # ---- compact text form
    def binding_name(self, meta, c):
        return ("name", c[1])

    def description(self, meta, c):
        return ("description", _unquote(str(c[1])))

    def param_decl(self, meta, c):
        return SessionParam(c[0].value, c[1], span=_sp(meta))

    def session_decl(self, meta, c):
        return ("session", tuple(c[1:]))

    def where_opt(self, meta, c):
        return ("where", c[1])

    def latest_opt(self, meta, c):
        return ("latest_by", tuple(c[1:]))

    def derive_item(self, meta, c):
        return DeriveItem(c[0], c[2])

    def derive_opt(self, meta, c):
        return ("derive", tuple(c[1:]))

    def nearest_opt(self, meta, c):
        k_tok, metric = c[5], c[7]
        return (
            "nearest",
            make_nearest(
                c[1],
                c[3],
                int(k_tok),
                _tsp(k_tok),
                metric.value if metric else None,
                metric.span if metric else None,
                _sp(meta),
            ),
        )

    def option(self, meta: Any, c: list[Any]) -> tuple[str, Any, Span | None]:
        key: Name = c[0]
        v = c[2]
        if isinstance(v, Name):
            val: Any = v.value
            span = v.span
        else:
            span = _tsp(v)
            val = (
                int(v)
                if v.type == "INT"
                else float(v)
                if v.type == "FLOAT"
                else _unquote(str(v))
                if v.type == "STRING"
                else str(v)
            )
        return (key.value, val, span)

    def search_opt(self, meta, c):
        k_tok = c[5]
        return ("search", make_search(c[1], c[3], int(k_tok), _tsp(k_tok), _sp(meta)))

    def rank_opt(self, meta, c):
        return ("rank", make_rank(c[1:], _sp(meta)))

    def freshness_opt(self, meta, c):
        return ("freshness", make_freshness(c[1:], _sp(meta)))

    def _source(
        self, meta, uri_tok: Token, alias: Name | None, opts: list, join: JoinSpec | None
    ) -> SourceSpec:
        uri = str(uri_tok)
        uri_span = _tsp(uri_tok)
        check_uri(uri, uri_span)
        if alias is None:
            alias = Name(default_alias(uri), uri_span)
        kw: dict[str, Any] = {"where": [], "derive": [], "latest_by": []}
        for key, val in opts:
            if key in ("where",):
                kw["where"].append(val)
            elif key in ("derive", "latest_by"):
                kw[key].extend(val)
            else:
                if key in kw:
                    raise DslError.at(
                        f"'{key}' is given twice for source '{alias.value}'", val.span
                    )
                kw[key] = val
        return SourceSpec(
            alias,
            uri,
            uri_span,
            tuple(kw.pop("where")),
            join,
            tuple(kw.pop("latest_by")),
            derive=tuple(kw.pop("derive")),
            span=_sp(meta),
            **kw,
        )

    def from_clause(self, meta, c):
        return ("source", self._source(meta, c[1], c[3], c[4:], None))

    def join_clause(self, meta, c):
        how = "left" if c[0] is not None else "inner"
        on = c[6]
        return ("source", self._source(meta, c[2], c[4], c[7:], JoinSpec(on, how, span=on.span)))

    def with_clause(self, meta, c):
        return ("stages", tuple(c[1:]))

    def stage_def(self, meta: Any, c: list[Any]) -> BindingSpec:
        name: Name = c[0]
        return self._spec(meta, c[2:], name)

    def having_clause(self, meta, c):
        return ("having", (c[1],))

    def select_clause(self, meta, c):
        return ("select", c[1])

    def group_clause(self, meta, c):
        return ("group_by", tuple(c[2:]))

    def order_clause(self, meta, c):
        return ("order_by", c[2])

    def limit_clause(self, meta, c):
        return ("limit", (int(c[1]), int(c[3]) if c[3] is not None else 0))

    def pushdown_clause(self, meta, c):
        code_tok = c[2]
        rest = c[3:]
        limits = [x for x in rest if isinstance(x, tuple)]
        params = tuple(x for x in rest if isinstance(x, Name))
        pos = _ctx.pos
        ln, col = pos.at(code_tok.start_pos + 1) if pos else (1, 1)
        return (
            "pushdown",
            PushdownSpec(
                _unquote(str(code_tok)),
                make_limits(limits),
                params,
                pos.file if pos else "<text>",
                ln,
                col,
                span=_sp(meta),
            ),
        )

    def binding_start(self, meta: Any, c: list[Any]) -> BindingSpec:
        kw: dict[str, Any] = {}
        for item in c:
            if item is not None and item[0] == "name":
                kw["name"] = item[1]
        return self._spec(meta, [x for x in c if x is None or x[0] != "name"], kw.get("name"))

    def _spec(self, meta: Any, c: list[Any], name: Name | None) -> BindingSpec:
        kw: dict[str, Any] = {}
        sources = []
        for item in c:
            if item is None:
                continue
            key, val = item
            if key == "source":
                sources.append(val)
            elif key == "limit":
                kw["limit"], kw["offset"] = val
            else:
                kw[key] = val
        pos = _ctx.pos
        return BindingSpec(
            name=name.value if name else "query",
            sources=tuple(sources),
            file=pos.file if pos else "<text>",
            span=_sp(meta),
            name_span=name.span if name else None,
            **kw,
        )


# ------------------------------------------------------------------ the parser

_TRANSFORMER = _ToAst()
_GRAMMAR = Path(__file__).with_name("grammar.lark")
_lock = threading.Lock()
_parser: Lark | None = None


def _get_parser() -> Lark:
    global _parser
    if _parser is None:
        with _lock:
            if _parser is None:
                _parser = Lark(
                    _GRAMMAR.read_text(),
                    parser="lalr",
                    start=list(STARTS),
                    propagate_positions=True,
                    maybe_placeholders=True,
                    cache=True,
                )
    return _parser


_WORDS = {
    "NAME": "a name",
    "QUOTED_NAME": "a `quoted name`",
    "STRING": "a string",
    "INT": "an integer",
    "FLOAT": "a number",
    "PARAM": "a {{session.<name>}} placeholder",
    "URI": "a source like mysql://shop/merchants",
    "DURATION": "a duration like 5s",
    "COMP_OP": "a comparison",
    "EQ": "'='",
    "PLUS": "'+'",
    "MINUS": "'-'",
    "CONCAT": "'||'",
    "SLASH": "'/'",
    "PERCENT": "'%'",
    "STAR": "'*'",
    "LPAR": "'('",
    "RPAR": "')'",
    "LSQB": "'['",
    "RSQB": "']'",
    "COMMA": "','",
    "DOT": "'.'",
    "COLON": "':'",
    "$END": "end of text",
}
_OPERATORS = {
    "COMP_OP",
    "EQ",
    "PLUS",
    "MINUS",
    "CONCAT",
    "SLASH",
    "PERCENT",
    "STAR",
    "AND",
    "OR",
    "IN",
    "NOT",
    "BETWEEN",
    "LIKE",
    "ILIKE",
    "IS",
}


# Tokens that start an operand, besides the ones the grammar's `name` rule accepts.
_OPERAND_START = {
    "NAME",
    "INT",
    "FLOAT",
    "STRING",
    "PARAM",
    "LPAR",
    "LSQB",
    "MINUS",
    "PLUS",
    "NOT",
    "NULL",
    "TRUE",
    "FALSE",
    "INTERVAL",
    "TIMESTAMP",
    "DATE",
    "STAR",
    "CASE",
    "CAST",
    "EXISTS",
}


@functools.cache
def _name_tokens() -> frozenset[str]:
    """What the grammar's `name` rule accepts besides NAME: `quoted` names and soft keywords."""
    rules = _get_parser().rules
    return frozenset(r.expansion[0].name for r in rules if r.origin.name == "name") - {"NAME"}


def _expected_words(expected: set[str] | frozenset[str] | None) -> str:
    names = set(expected or ())
    words: list[str] = []
    if {"NAME", "INT", "STRING"} <= names:
        names -= _OPERAND_START | _name_tokens()
        words.append(
            "an expression (a column, a value, a function call or a {{session.<name>}} placeholder)"
        )
    elif "NAME" in names:
        names -= _name_tokens()
    if len(names & _OPERATORS) >= 4:
        names -= _OPERATORS
        words.append("an operator")
    for n in sorted(names, key=lambda n: (n not in _WORDS, n == "$END", n)):
        if n in _WORDS:
            words.append(_WORDS[n])
        elif not n.startswith("__ANON"):
            words.append(f"'{n.lower()}'")
    return ", ".join(dict.fromkeys(words)) or "something else"


def _accepts(e: UnexpectedInput, fallback: Any) -> set[str]:
    ip = getattr(e, "interactive_parser", None)
    if ip is not None:
        try:
            return set(ip.accepts())
        except Exception:
            pass
    return set(fallback or ())


def _token_text(tok: Token) -> str:
    if tok.type == "$END":
        return "end of text"
    return f"'{tok}'"


def _syntax_error(e: UnexpectedInput, pos: PosMap, what: str) -> DslError:
    if isinstance(e, UnexpectedToken):
        tok = e.token
        if tok.type == "$END" or tok.start_pos is None:
            start = len(pos.text.rstrip())
            span = pos.span(start, start + 1)
            msg = f"unexpected end of {what}"
        else:
            span = pos.span(tok.start_pos, tok.end_pos)
            msg = f"unexpected {_token_text(tok)} in {what}"
        accepts = _accepts(e, e.expected)
        hint = "expected " + _expected_words(accepts)
        if tok.type == "NAME":
            import difflib

            keywords = [
                n.lower() for n in accepts if n.isalpha() and n.isupper() and n not in _WORDS
            ]
            close = difflib.get_close_matches(str(tok).lower(), keywords, n=1, cutoff=0.7)
            if close:
                hint = f"did you mean '{close[0]}'? ({hint})"
    elif isinstance(e, UnexpectedCharacters):
        at = e.pos_in_stream or 0
        ch = pos.text[at] if at < len(pos.text) else " "
        span = pos.span(at, at + 1)
        msg = f"unexpected character '{ch}' in {what}"
        if ch == "{":
            hint = "session values are written {{session.<name>}}"
        elif ch in "'\"":
            hint = "this string is not closed"
        else:
            hint = "expected " + _expected_words(_accepts(e, e.allowed))
    elif isinstance(e, UnexpectedEOF):
        start = len(pos.text.rstrip())
        span = pos.span(start, start + 1)
        msg = f"unexpected end of {what}"
        hint = "expected " + _expected_words(set(e.expected))
    else:  # pragma: no cover - lark has no other kinds
        span, msg, hint = pos.span(0, 1), f"cannot parse {what}", None
    return DslError(Diagnostic(msg, span, hint))


def _parse(text: str, start: str, what: str, pos: PosMap) -> Any:
    parser = _get_parser()
    prev = _ctx.pos
    _ctx.pos = pos
    try:
        return _TRANSFORMER.transform(parser.parse(text, start=start))
    except VisitError as e:
        if isinstance(e.orig_exc, DslError | RecursionError):
            raise e.orig_exc from None
        raise
    except UnexpectedInput as e:
        raise _syntax_error(e, pos, what) from None
    except RecursionError:
        raise DslError.at(f"{what} is nested too deeply", pos.span(0, 1)) from None
    finally:
        _ctx.pos = prev


def _pos(
    text: str, file: str, line: int, col: int, positions: Sequence[tuple[int, int]] | None
) -> PosMap:
    return PosMap(file, text, line, col, positions)


def parse_expr(
    text: str,
    file: str = "<expr>",
    line: int = 1,
    col: int = 1,
    *,
    positions: Sequence[tuple[int, int]] | None = None,
    what: str = "expression",
) -> A.Expr:
    if not text.strip():
        raise DslError.at(
            f"empty {what}", Span(file, line, col, line, col + 1), "write an expression here"
        )
    return _parse(text, "expr_start", what, _pos(text, file, line, col, positions))


def parse_select(
    text: str,
    file: str = "<expr>",
    line: int = 1,
    col: int = 1,
    *,
    positions: Sequence[tuple[int, int]] | None = None,
) -> tuple[SelectItem, ...]:
    if not text.strip():
        raise DslError.at("empty select item", Span(file, line, col, line, col + 1))
    return _parse(text, "select_start", "select list", _pos(text, file, line, col, positions))


def parse_order_by(
    text: str,
    file: str = "<expr>",
    line: int = 1,
    col: int = 1,
    *,
    positions: Sequence[tuple[int, int]] | None = None,
) -> tuple[A.SortKey, ...]:
    if not text.strip():
        raise DslError.at("empty order_by", Span(file, line, col, line, col + 1))
    return _parse(text, "sort_start", "order_by", _pos(text, file, line, col, positions))


def parse_exprs(
    text: str,
    file: str = "<expr>",
    line: int = 1,
    col: int = 1,
    *,
    positions: Sequence[tuple[int, int]] | None = None,
    what: str = "expression list",
) -> tuple[A.Expr, ...]:
    if not text.strip():
        raise DslError.at(f"empty {what}", Span(file, line, col, line, col + 1))
    return _parse(text, "exprs_start", what, _pos(text, file, line, col, positions))


def parse_type(
    text: str,
    file: str = "<expr>",
    line: int = 1,
    col: int = 1,
    *,
    positions: Sequence[tuple[int, int]] | None = None,
) -> ValueType:
    if not text.strip():
        raise DslError.at(
            "empty type",
            Span(file, line, col, line, col + 1),
            "e.g. int, str, list[str], vector[384]",
        )
    return _parse(text, "type_start", "type", _pos(text, file, line, col, positions))


def parse_binding_text(
    text: str, file: str = "<text>", *, python: str | None = None
) -> BindingSpec:
    """The compact one-line form of a whole binding (see docs/bindings.md).

    ``python`` attaches a ``pushdown.python`` function given separately from Python."""
    try:
        if not text.strip():
            raise DslError.at(
                "empty query text",
                Span(file, 1, 1, 1, 2),
                "start with: from <kind>://<connection>/<object>",
            )
        spec: BindingSpec = _parse(text, "binding_start", "query text", PosMap(file, text))
        if python is not None:
            if spec.pushdown is not None:
                raise DslError.at(
                    "pushdown python is given both in the text and as an argument",
                    spec.pushdown.span,
                )
            import dataclasses

            spec = dataclasses.replace(
                spec, pushdown=PushdownSpec(python, file=file, line=1, col=1)
            )
        return spec
    except DslError as e:
        raise attach_source(e, {file: text}) from None


def attach_source(e: DslError, texts: dict[str, str]) -> DslError:
    """Fill each diagnostic's ``source_line`` from the named texts (for the underline)."""
    out = []
    changed = False
    for d in e.diagnostics:
        if d.span is not None and d.source_line is None and d.span.file in texts:
            lines = texts[d.span.file].splitlines()
            if 0 < d.span.line <= len(lines):
                import dataclasses

                d = dataclasses.replace(d, source_line=lines[d.span.line - 1])
                changed = True
        out.append(d)
    if not changed:
        return e
    try:
        return type(e)(out)  # keep the subclass (SessionError, ...)
    except TypeError:
        return DslError(out)
