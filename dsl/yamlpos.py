"""YAML with a position for every node, and the strict helpers that validate binding
files and fabric.yaml against them.

PyYAML's composer (libyaml, C) gives every node its line and column; nodes become
``YamlMap`` / ``YamlSeq`` (dict / list with ``.lc`` positions, as ruamel.yaml's round-trip
types have) and ``LiteralStr`` / ``FoldedStr`` for block scalars. Composing is ~100x
faster than ruamel.yaml's round-trip loader (0.07 ms vs ~4 ms for a 3-source binding).

Every error names file, line and column of the offending key or value; expression
scalars are handed to the parser with their file position (and, for scalars spanning
several lines, a per-character position table), so a syntax error inside
``where: stauts = 'active'`` underlines ``stauts`` in the file.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import yaml
from yaml.error import MarkedYAMLError, YAMLError

from dsl.errors import Diagnostic, DslError, Span, did_you_mean

_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _LC:
    """Positions (0-based line, column), as ruamel.yaml's ``.lc``."""

    __slots__ = ("col", "items", "keys", "line", "values")

    def __init__(self, line: int, col: int):
        self.line, self.col = line, col
        self.keys: dict[Any, tuple[int, int]] = {}
        self.values: dict[Any, tuple[int, int]] = {}
        self.items: list[tuple[int, int]] = []

    def key(self, k: Any) -> tuple[int, int]:
        return self.keys[k]

    def value(self, k: Any) -> tuple[int, int]:
        return self.values[k]

    def item(self, i: int) -> tuple[int, int]:
        return self.items[i]


class _FA:
    __slots__ = ("flow",)

    def __init__(self, flow: bool):
        self.flow = flow

    def flow_style(self) -> bool:
        return self.flow


class YamlMap(dict):
    """A YAML mapping with positions: ``.lc.key(k)``, ``.lc.value(k)``, ``.lc.line/col``."""

    lc: _LC
    fa: _FA


class YamlSeq(list):
    """A YAML sequence with positions: ``.lc.item(i)``, ``.lc.line/col``."""

    lc: _LC
    fa: _FA


class LiteralStr(str):
    """A ``|`` block scalar."""


class FoldedStr(str):
    """A ``>`` block scalar."""


Container = YamlMap | YamlSeq


_INT = re.compile(r"^[-+]?[0-9]+$|^0o[0-7]+$|^0x[0-9a-fA-F]+$")
_FLOAT = re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$")
_SPECIAL_FLOAT = {
    ".inf": float("inf"),
    "+.inf": float("inf"),
    "-.inf": float("-inf"),
    ".nan": float("nan"),
}


def _scalar_value(node: yaml.ScalarNode) -> Any:
    """YAML 1.2 core schema (``on``/``yes`` stay strings, ``010`` is ten)."""
    v = node.value
    if node.style == "|":
        return LiteralStr(v)
    if node.style == ">":
        return FoldedStr(v)
    if node.style in ("'", '"'):
        return v
    if v in ("", "~", "null", "Null", "NULL"):
        return None
    if v in ("true", "True", "TRUE"):
        return True
    if v in ("false", "False", "FALSE"):
        return False
    if _INT.match(v):
        return int(v, 0) if v.startswith(("0o", "0x")) else int(v, 10)
    if _FLOAT.match(v):
        return float(v)
    if v.lower() in _SPECIAL_FLOAT:
        return _SPECIAL_FLOAT[v.lower()]
    return v


def _hashable(v: Any) -> Any:
    try:
        hash(v)
        return v
    except TypeError:
        return str(v)


class YamlText:
    """One YAML file: its text, documents and position helpers."""

    def __init__(self, text: str, file: str):
        self.text = text
        self.file = file
        self.lines = text.splitlines()
        self._starts: list[int] | None = None

    # ---- loading
    def documents(self) -> list[Any]:
        if "&" in self.text or "*" in self.text:
            self._refuse_aliases()
        try:
            nodes = list(yaml.compose_all(self.text, Loader=_YAML_LOADER))
        except MarkedYAMLError as e:
            raise self._yaml_error(e) from None
        except YAMLError as e:
            raise self.error(f"invalid YAML: {e}", Span(self.file, 1, 1, 1, 2)) from None
        dups: list[Diagnostic] = []
        docs = [self._convert(n, dups) for n in nodes if n is not None]
        if dups:
            raise DslError(dups)
        return [d for d in docs if d is not None]

    def _refuse_aliases(self) -> None:
        """Binding files and fabric.yaml need no anchors or aliases, and an alias can expand
        without bound (a 458-byte 'billion laughs' file names 10^9 nodes; ``&a [*a]`` is
        infinite): refuse them from the event stream, before any node is built."""
        found: list[yaml.Event] = []
        try:
            for ev in yaml.parse(self.text, Loader=_YAML_LOADER):
                if isinstance(ev, yaml.AliasEvent | yaml.NodeEvent) and ev.anchor is not None:
                    found.append(ev)
        except MarkedYAMLError as e:
            raise self._yaml_error(e) from None
        except YAMLError as e:
            raise self.error(f"invalid YAML: {e}", Span(self.file, 1, 1, 1, 2)) from None
        if not found:
            return
        ev = found[0]
        alias = isinstance(ev, yaml.AliasEvent)
        what = f"{'alias' if alias else 'anchor'} '{'*' if alias else '&'}{ev.anchor}'"
        more = f" ({len(found)} anchors and aliases in this file)" if len(found) > 1 else ""
        raise self.error(
            f"invalid YAML: {what}: anchors and aliases are not supported{more}",
            self._span_at(ev.start_mark.line, ev.start_mark.column, len(ev.anchor) + 1),
            "write the value out in full where it is used",
        )

    def _convert(self, node: yaml.Node, dups: list[Diagnostic]) -> Any:
        if isinstance(node, yaml.ScalarNode):
            return _scalar_value(node)
        mark = node.start_mark
        if isinstance(node, yaml.SequenceNode):
            seq = YamlSeq()
            seq.lc, seq.fa = _LC(mark.line, mark.column), _FA(bool(node.flow_style))
            for child in node.value:
                seq.lc.items.append((child.start_mark.line, child.start_mark.column))
                seq.append(self._convert(child, dups))
            return seq
        m = YamlMap()
        m.lc, m.fa = _LC(mark.line, mark.column), _FA(bool(node.flow_style))
        for knode, vnode in node.value:
            if knode.tag == "tag:yaml.org,2002:merge":
                kl, kc = knode.start_mark.line, knode.start_mark.column
                dups.append(
                    self.diagnostic(
                        "invalid YAML: merge keys ('<<') are not supported",
                        self._span_at(kl, kc, 2),
                        "write the keys out in full in this mapping",
                    )
                )
                continue
            key = (
                knode.value
                if isinstance(knode, yaml.ScalarNode)
                else _hashable(self._convert(knode, dups))
            )
            if key in m:
                # YAML splits flow mappings at every comma: {cell: geo_hash(lat, lon, 6)}
                # gives keys 'lon' and '6)'. Such collections are re-read paren-aware
                # (entries()), so a "duplicate" there is not the user's mistake.
                line = (
                    self.lines[knode.start_mark.line]
                    if knode.start_mark.line < len(self.lines)
                    else ""
                )
                head = line[: knode.start_mark.column]
                if not (node.flow_style and "(" in head):
                    kl, kc = knode.start_mark.line, knode.start_mark.column
                    dups.append(
                        self.diagnostic(
                            f"invalid YAML: duplicate key '{key}'",
                            self._span_at(kl, kc, len(str(key))),
                            "each key may appear once",
                        )
                    )
                continue
            m.lc.keys[key] = (knode.start_mark.line, knode.start_mark.column)
            m.lc.values[key] = (vnode.start_mark.line, vnode.start_mark.column)
            m[key] = self._convert(vnode, dups)
        return m

    def _yaml_error(self, e: MarkedYAMLError) -> DslError:
        mark = e.problem_mark or e.context_mark
        span = (
            Span(self.file, mark.line + 1, mark.column + 1, mark.line + 1, mark.column + 2)
            if mark
            else None
        )
        problem = (e.problem or e.context or "invalid YAML").strip()
        hint = None
        line = self.lines[mark.line] if mark and mark.line < len(self.lines) else ""
        if "{{" in line:
            hint = "a value that starts with '{' must be quoted in YAML, e.g. to: \"{{session.query_vec}}\""
        elif "duplicate key" in problem or "found duplicate key" in str(e):
            hint = "each key may appear once"
        elif "\t" in line:
            hint = "YAML indentation must use spaces, not tabs"
        return self.error(f"invalid YAML: {problem}", span, hint)

    # ---- diagnostics
    def error(self, message: str, span: Span | None, hint: str | None = None) -> DslError:
        return DslError(self.diagnostic(message, span, hint))

    def diagnostic(self, message: str, span: Span | None, hint: str | None = None) -> Diagnostic:
        src = (
            self.lines[span.line - 1]
            if span and span.file == self.file and 0 < span.line <= len(self.lines)
            else None
        )
        return Diagnostic(message, span, hint, source_line=src)

    def with_source(self, e: DslError) -> DslError:
        """Fill the underline source line of diagnostics that point into this file."""
        from dsl.parser import attach_source

        return attach_source(e, {self.file: self.text})

    # ---- positions (nodes carry 0-based line/col)
    def _span_at(self, line0: int, col0: int, length: int) -> Span:
        return Span(self.file, line0 + 1, col0 + 1, line0 + 1, col0 + 1 + max(length, 1))

    def key_span(self, m: YamlMap, key: Any) -> Span | None:
        try:
            ln, col = m.lc.key(key)
        except (KeyError, AttributeError, TypeError):
            return self.node_span(m)
        return self._span_at(ln, col, len(str(key)))

    def value_span(self, c: Container, key: Any) -> Span | None:
        try:
            ln, col = c.lc.value(key) if isinstance(c, YamlMap) else c.lc.item(key)
        except (KeyError, AttributeError, TypeError, IndexError):
            return self.node_span(c)
        v = c[key]
        length = self._scalar_len(ln, col, v)
        return self._span_at(ln, col, length)

    def node_span(self, c: Any) -> Span | None:
        lc = getattr(c, "lc", None)
        if lc is None or lc.line is None:
            return None
        return self._span_at(lc.line, lc.col, 1)

    def _scalar_len(self, ln: int, col: int, v: Any) -> int:
        if isinstance(v, Container):
            return 1
        line = self.lines[ln] if ln < len(self.lines) else ""
        rest = line[col:]
        if rest[:1] in ("'", '"'):
            q = rest[0]
            end = rest.find(q, 1)
            while end > 0 and q == "'" and rest[end + 1 : end + 2] == "'":
                end = rest.find(q, end + 2)
            return end + 1 if end > 0 else len(rest.rstrip())
        if rest[:1] in ("|", ">"):
            return 1
        text = str(v)
        if "\n" not in text and rest.startswith(text):
            return len(text)
        cut = rest.find(" #")
        return len((rest if cut < 0 else rest[:cut]).rstrip())

    def _offset(self, ln: int, col: int) -> int:
        if self._starts is None:
            starts = [0]
            for i, ch in enumerate(self.text):
                if ch == "\n":
                    starts.append(i + 1)
            self._starts = starts
        return self._starts[ln] + col if ln < len(self._starts) else len(self.text)

    def _linecol(self, offset: int) -> tuple[int, int]:
        assert self._starts is not None
        i = bisect.bisect_right(self._starts, offset) - 1
        return i + 1, offset - self._starts[i] + 1

    def scalar(self, c: Container, key: Any) -> tuple[str, int, int, list[tuple[int, int]] | None]:
        """The text of a scalar and where it starts: (text, line, col, positions-or-None).

        Single-line plain or quoted scalars give their 1-based start; others (block and
        multi-line scalars) a per-character position table."""
        v = c[key]
        text = (
            v
            if isinstance(v, str)
            else ("true" if v is True else "false" if v is False else str(v))
        )
        try:
            ln, col = c.lc.value(key) if isinstance(c, YamlMap) else c.lc.item(key)
        except (KeyError, AttributeError, TypeError, IndexError):
            return text, 1, 1, None
        line = self.lines[ln] if ln < len(self.lines) else ""
        if isinstance(v, LiteralStr):
            return text, ln + 1, col + 1, self._block_positions(ln, text)
        if isinstance(v, FoldedStr):
            first = self._block_positions(ln, text[:1])
            start = (first[0][0] - 1, first[0][1] - 1) if first else (ln + 1, 0)
            return text, ln + 1, col + 1, self._aligned_positions(start[0], start[1], text)
        quoted = line[col : col + 1] in ("'", '"')
        start_col = col + (1 if quoted else 0)
        if "\n" not in text and line[start_col : start_col + len(text)] == text:
            return text, ln + 1, start_col + 1, None
        return text, ln + 1, start_col + 1, self._aligned_positions(ln, start_col, text)

    def _block_positions(self, ln: int, text: str) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        file_line = ln + 1  # 0-based index of the first content line
        indent = None
        for i in range(file_line, len(self.lines)):
            if self.lines[i].strip():
                indent = len(self.lines[i]) - len(self.lines[i].lstrip(" "))
                break
        indent = indent or 0
        cur, c = file_line, 0
        for ch in text:
            out.append((cur + 1, indent + c + 1))
            if ch == "\n":
                cur, c = cur + 1, 0
            else:
                c += 1
        return out

    def _aligned_positions(self, ln: int, col: int, text: str) -> list[tuple[int, int]]:
        raw = self.text
        j = self._offset(ln, col)
        out: list[tuple[int, int]] = []
        for ch in text:
            while j < len(raw) and raw[j] != ch and raw[j] in " \t\r\n":
                j += 1
            if j < len(raw) and raw[j] == "\\" and ch != "\\":
                j += 1
            out.append(self._linecol(min(j, len(raw) - 1 if raw else 0)))
            if j < len(raw) and raw[j] == ch:
                j += 1
        return out

    # ---- expression collections (flow style is re-read paren-aware)
    def entries(self, c: Container, key: Any, *, mapping: bool) -> list[Entry]:
        """The items of a collection of expressions: a mapping (``derive``) or a scalar /
        list (``where``, ``select``, ``group_by``, ``order_by``).

        YAML splits flow collections at every comma, so ``{cell: geo_hash(lat, lon, 6)}``
        would lose its call; flow collections are therefore re-read from the file text,
        splitting only at top-level commas."""
        v = c[key]
        if isinstance(v, Container) and v.fa.flow_style():
            raw = self._flow_entries(c, key, mapping=mapping)
            if raw is not None:
                return raw
        if mapping:
            if not isinstance(v, YamlMap):
                raise self.error(
                    f"'{key}' must be a mapping (name: expression)", self.value_span(c, key)
                )
            return [Entry(str(k), self.key_span(v, k), *self._scalar_entry(v, k)) for k in v]
        if isinstance(v, YamlSeq):
            return [
                Entry(None, self.value_span(v, i), *self._scalar_entry(v, i)) for i in range(len(v))
            ]
        return [Entry(None, self.value_span(c, key), *self._scalar_entry(c, key))]

    def _scalar_entry(
        self, c: Container, key: Any
    ) -> tuple[str, int, int, list[tuple[int, int]] | None, Any]:
        v = c[key]
        if isinstance(v, Container) or v is None:
            return "", 0, 0, None, v
        text, ln, col, positions = self.scalar(c, key)
        return text, ln, col, positions, None

    def _flow_entries(self, c: Container, key: Any, *, mapping: bool) -> list[Entry] | None:
        try:
            ln, col = c.lc.value(key) if isinstance(c, YamlMap) else c.lc.item(key)
        except (KeyError, AttributeError, TypeError, IndexError):
            return None
        return self._flow_scan(self._offset(ln, col), key, mapping=mapping)

    def _flow_scan(self, start: int, key: Any, *, mapping: bool) -> list[Entry] | None:
        raw = self.text
        if start >= len(raw) or raw[start] not in "{[":
            return None
        close = "}" if raw[start] == "{" else "]"
        items: list[tuple[int, int]] = []
        depth, i, item_start, quote = 0, start + 1, start + 1, ""
        while i < len(raw):
            ch = raw[i]
            if quote:
                if ch == quote:
                    if quote == "'" and raw[i + 1 : i + 2] == "'":
                        i += 1
                    else:
                        quote = ""
                elif ch == "\\" and quote == '"':
                    i += 1
            elif ch in "'\"":
                quote = ch
            elif ch in "([{":
                depth += 1
            elif ch in ")]}":
                if depth == 0:
                    if ch != close:
                        return None
                    items.append((item_start, i))
                    break
                depth -= 1
            elif ch == "," and depth == 0:
                items.append((item_start, i))
                item_start = i + 1
            i += 1
        else:
            return None
        out: list[Entry] = []
        for a, b in items:
            while a < b and raw[a] in " \t\r\n":
                a += 1
            while b > a and raw[b - 1] in " \t\r\n":
                b -= 1
            if a == b:
                continue
            k: str | None = None
            kspan = None
            if mapping:
                sep = self._top_colon(raw, a, b)
                if sep is None:
                    kl, kc = self._linecol(a)
                    raise self.error(
                        f"'{key}' items must be written name: expression",
                        Span(self.file, kl, kc, kl, kc + b - a),
                    )
                k = raw[a:sep].strip()
                kl, kc = self._linecol(a)
                kspan = Span(self.file, kl, kc, kl, kc + len(k))
                a = sep + 1
                while a < b and raw[a] in " \t\r\n":
                    a += 1
            if not mapping and raw[a] == "{":
                sub = self._flow_scan(a, key, mapping=True)
                if sub is not None:
                    out.append(Entry(None, self._span_of(a, b), "", 0, 0, None, None, sub))
                    continue
            text, positions = self._unquote_raw(raw, a, b)
            ln1, col1 = positions[0] if positions else self._linecol(a)
            out.append(
                Entry(
                    k, kspan if mapping else self._span_of(a, b), text, ln1, col1, positions, None
                )
            )
        return out

    def _span_of(self, a: int, b: int) -> Span:
        l1, c1 = self._linecol(a)
        l2, c2 = self._linecol(max(b - 1, a))
        return Span(self.file, l1, c1, l2, c2 + 1)

    @staticmethod
    def _top_colon(raw: str, a: int, b: int) -> int | None:
        depth, quote = 0, ""
        for i in range(a, b):
            ch = raw[i]
            if quote:
                if ch == quote:
                    quote = ""
            elif ch in "'\"":
                quote = ch
            elif ch in "([{":
                depth += 1
            elif ch in ")]}":
                depth -= 1
            elif ch == ":" and depth == 0 and (i + 1 == b or raw[i + 1] in " \t\r\n"):
                return i
        return None

    def _unquote_raw(self, raw: str, a: int, b: int) -> tuple[str, list[tuple[int, int]]]:
        q = raw[a]
        if q in "'\"" and raw[b - 1] == q and b - a >= 2:
            chars, pos, i = [], [], a + 1
            while i < b - 1:
                ch = raw[i]
                if q == "'" and ch == "'" and raw[i + 1] == "'":
                    i += 1
                elif q == '"' and ch == "\\":
                    i += 1
                    ch = raw[i]
                chars.append(ch)
                pos.append(self._linecol(i))
                i += 1
            return "".join(chars), pos
        return raw[a:b], [self._linecol(i) for i in range(a, b)]

    # ---- validation helpers
    def check_keys(
        self, m: YamlMap, allowed: Sequence[str], what: str, required: Iterable[str] = ()
    ) -> None:
        problems = []
        for key in m:
            if key not in allowed:
                problems.append(
                    self.diagnostic(
                        f"unknown key '{key}' in {what}",
                        self.key_span(m, key),
                        did_you_mean(str(key), allowed, "keys"),
                    )
                )
        for key in required:
            if key not in m:
                problems.append(
                    self.diagnostic(
                        f"{what} needs '{key}'",
                        self.node_span(m),
                        f"add '{key}: ...' (keys: {', '.join(allowed)})",
                    )
                )
        if problems:
            raise DslError(problems)

    def mapping(self, c: Container, key: Any, what: str) -> YamlMap:
        v = c[key]
        if not isinstance(v, YamlMap):
            raise self.error(
                f"{what} must be a mapping (key: value lines), got {_kind(v)}",
                self.value_span(c, key),
            )
        return v

    def string(self, c: Container, key: Any, what: str) -> str:
        v = c[key]
        if not isinstance(v, str) or isinstance(v, Container):
            raise self.error(f"{what} must be a string, got {_kind(v)}", self.value_span(c, key))
        return str(v)

    def boolean(self, c: Container, key: Any, what: str) -> bool:
        v = c[key]
        if not isinstance(v, bool):
            raise self.error(f"{what} must be true or false, got {v!r}", self.value_span(c, key))
        return v

    def integer(self, c: Container, key: Any, what: str, minimum: int = 0) -> int:
        v = c[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise self.error(
                f"{what} must be an integer >= {minimum}, got {v!r}", self.value_span(c, key)
            )
        return int(v)

    def items(self, c: Container, key: Any) -> list[tuple[Container, Any]]:
        """A scalar or a list of scalars, as (container, key) pairs for positions."""
        v = c[key]
        if isinstance(v, YamlSeq):
            return [(v, i) for i in range(len(v))]
        return [(c, key)]


@dataclass(frozen=True)
class Entry:
    """One expression item of a collection: optional key, its text and where it is."""

    key: str | None
    span: Span | None
    text: str
    line: int
    col: int
    positions: list[tuple[int, int]] | None
    container: Any = None  # a nested mapping/list where a scalar was expected
    sub: list[Entry] | None = None  # a {name: expr} item inside a flow list


def _kind(v: Any) -> str:
    if isinstance(v, YamlMap):
        return "a mapping"
    if isinstance(v, YamlSeq):
        return "a list"
    if v is None:
        return "nothing"
    return f"{type(v).__name__} {v!r}"
