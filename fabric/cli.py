"""The ``fabric`` command: validate, explain, query, serve, demo.

fabric validate [PATH ...] [--config fabric.yaml] [--offline]
fabric explain NAME [--session k=v ...] [--analyze] [--logical] [--config fabric.yaml]
fabric query NAME [--session k=v ...] [--format table|json] [--catch-up S] [--config fabric.yaml]
fabric query --text "from mysql://shop/merchants as m select m.name limit 5"

``query`` and ``explain --analyze`` read Kafka-fed datasets as the broker has them now: they
ingest from the last checkpoint to the broker's end (up to ``--catch-up`` seconds, default
10) before answering, and print each source's freshness (measured against the broker) to
stderr; the binding's ``on_stale`` decides what a source still behind does. ``--catch-up
0`` answers from the last checkpoint without ingesting (the lag still comes from the broker).
fabric serve ...   (fabric.server)
fabric mcp ...     (fabric.service.mcp)
fabric demo ...    (fabric.demo)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dsl.errors import Diagnostic, DslError, Span


def _print_diagnostics(diags: Sequence[Diagnostic], out: Any) -> None:
    """Print ``diags``, filling missing underlined lines from their files (each read once)."""
    from dsl.parser import attach_source

    texts: dict[str, str] = {}
    for f in {d.span.file for d in diags if d.span is not None and d.source_line is None}:
        with contextlib.suppress(OSError):
            texts[f] = Path(f).read_text()
    for d in attach_source(DslError(diags), texts).diagnostics:
        print(d.format(), file=out)


def _config_path(arg: str | None) -> Path | None:
    if arg:
        return Path(arg)
    p = Path("fabric.yaml")
    return p if p.exists() else None


def _open(args: argparse.Namespace, *, watch: bool = False, reads: bool = False):
    """The fabric of ``--config``; ``reads``: the command reads data, so Kafka-fed datasets
    are ingested up to the broker's end first (``--catch-up`` seconds at most)."""
    import fabric

    path = _config_path(args.config)
    if path is None:
        raise DslError.at(
            "no fabric.yaml here", Span("fabric.yaml", 1, 1), "pass --config path/to/fabric.yaml"
        )
    offline = getattr(args, "offline", False)
    wait = getattr(args, "catch_up", None)
    ingest = reads and not offline and wait != 0
    fab = fabric.open(path, ingest=ingest, watch=watch, offline=offline)
    if ingest and not fab.catch_up(wait):
        print(
            f"fabric: not caught up with the broker after {fab.catch_up_timeout(wait):g} s; "
            "answering with what is ingested (see freshness below)",
            file=sys.stderr,
        )
    return fab


def _print_freshness(res: Any) -> None:
    """One line per source read, on stderr: status, lag against the source, error."""
    for alias, f in (res.freshness or {}).items():
        text = f"freshness: {alias} {f.get('uri')} {f.get('status')}"
        if f.get("flagged"):
            text += " (flagged)"
        if f.get("lag_messages") is not None:
            text += f", lag {f['lag_messages']} messages"
        if f.get("lag_seconds") is not None:
            text += f", {f['lag_seconds']:g} s"
        if f.get("error"):
            text += f"; {f['error']}"
        print(text, file=sys.stderr)


def _session(args: argparse.Namespace, compiled: Any) -> dict[str, Any]:
    from dsl.types import parse_cli_value

    out: dict[str, Any] = {}
    for item in args.session or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"fabric: --session takes key=value, got {item!r}")
        t = compiled.session.get(key) if compiled is not None else None
        if t is None:
            try:
                out[key] = json.loads(value)
            except json.JSONDecodeError:
                out[key] = value
        else:
            out[key] = parse_cli_value(t, value)
    return out


# ------------------------------------------------------------------ commands


def cmd_validate(args: argparse.Namespace) -> int:
    from dsl import loader
    from fabric.config import load_config

    diags: list[Diagnostic] = []
    config_path = _config_path(args.config)
    n_bindings = 0
    if config_path is None:
        if not args.paths:
            print(
                "fabric validate: no fabric.yaml here and no binding files given", file=sys.stderr
            )
            print("  hint: fabric validate agents/*.yaml --config fabric.yaml", file=sys.stderr)
            return 2
        # syntax and shape only: no catalog to check sources and columns against
        for f in _expand(args.paths):
            try:
                n_bindings += len(loader.load_file(f, str(f)))
            except DslError as e:
                diags.extend(e.diagnostics)
        mode = "syntax only (no fabric.yaml: sources and columns not checked)"
    else:
        try:
            config = load_config(config_path)
        except DslError as e:
            _print_diagnostics(e.diagnostics, sys.stdout)
            print(f"{len(e.diagnostics)} problem(s) in {config_path}", file=sys.stderr)
            return 1
        if args.paths:
            import dataclasses

            files = _expand(args.paths)
            config = dataclasses.replace(config, bindings=tuple(str(f.resolve()) for f in files))
        import fabric

        with fabric.open(config, ingest=False, watch=False, offline=args.offline) as fab:
            diags = fab.validate()
            n_bindings = len(fab.bindings.names())
        mode = "offline (declared schemas)" if args.offline else "against the live catalog"
    if diags:
        _print_diagnostics(diags, sys.stdout)
        print(f"{len(diags)} problem(s)", file=sys.stderr)
        return 1
    print(f"OK: {n_bindings} binding(s) valid, {mode}")
    return 0


def _expand(paths: Sequence[str]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(
                sorted(f for f in p.rglob("*") if f.suffix in (".yaml", ".yml") and f.is_file())
            )
        else:
            out.append(p)
    return out


def cmd_explain(args: argparse.Namespace) -> int:
    with _open(args, reads=args.analyze) as fab:
        compiled = fab.binding(args.name)
        session = _session(args, compiled)
        print(
            fab.explain(
                args.name, session or None, analyze=args.analyze, optimized=not args.logical
            )
        )
    return 0


def cmd_query(args: argparse.Namespace) -> int:
    with _open(args, reads=True) as fab:
        if args.text:
            session = _session(args, None)
            res = fab.query_text(args.text, session or None)
        else:
            if not args.name:
                raise SystemExit("fabric query: give a binding NAME or --text '...'")
            compiled = fab.binding(args.name)
            res = fab.query(args.name, _session(args, compiled))
        table = res.table
        _print_freshness(res)
        if args.format == "json":
            print(json.dumps(table.to_pylist(), default=str, indent=2))
        else:
            print(_table_text(table))
    return 0


def _table_text(table: Any, max_rows: int = 50) -> str:
    cols = table.column_names
    rows = [[_cell(v) for v in r.values()] for r in table.slice(0, max_rows).to_pylist()]
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(cols)]
    line = " | ".join(c.ljust(w) for c, w in zip(cols, widths))
    out = [line, "-+-".join("-" * w for w in widths)]
    out += [" | ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    if table.num_rows > max_rows:
        out.append(f"... {table.num_rows - max_rows} more rows")
    out.append(f"({table.num_rows} row{'s' if table.num_rows != 1 else ''})")
    return "\n".join(out)


def _cell(v: Any) -> str:
    s = "null" if v is None else str(v)
    return s if len(s) <= 60 else s[:57] + "..."


def cmd_delegate(module: str, argv: list[str]) -> int:
    import importlib

    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        print(f"fabric: {module} is not available: {e}", file=sys.stderr)
        return 2
    rc = mod.main(argv)
    return int(rc or 0)


# ------------------------------------------------------------------ entry point


_CATCH_UP = (
    "seconds to ingest Kafka-fed datasets up to the broker's end before reading "
    "(default: the connections' timeout, 10 s; 0: read the last checkpoint, lag still measured)"
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fabric", description="The agent data fabric.")
    sub = p.add_subparsers(dest="command", required=True)

    v = sub.add_parser("validate", help="check binding files (and fabric.yaml)")
    v.add_argument(
        "paths", nargs="*", help="binding files or directories (default: bindings: of fabric.yaml)"
    )
    v.add_argument("--config", help="fabric.yaml (default: ./fabric.yaml if present)")
    v.add_argument(
        "--offline", action="store_true", help="plan against declared schemas; open no connection"
    )
    v.set_defaults(fn=cmd_validate)

    e = sub.add_parser("explain", help="print the plan of a binding")
    e.add_argument("name")
    e.add_argument("--session", action="append", metavar="K=V", help="a session value (repeatable)")
    e.add_argument("--analyze", action="store_true", help="run it and show actual rows and times")
    e.add_argument("--logical", action="store_true", help="the plan before optimization")
    e.add_argument("--config")
    e.add_argument("--offline", action="store_true")
    e.add_argument("--catch-up", type=float, metavar="S", help=_CATCH_UP)
    e.set_defaults(fn=cmd_explain)

    q = sub.add_parser("query", help="run a binding (or --text) and print the result")
    q.add_argument("name", nargs="?")
    q.add_argument("--text", help="a compact text query instead of a binding name")
    q.add_argument("--session", action="append", metavar="K=V")
    q.add_argument("--format", choices=("table", "json"), default="table")
    q.add_argument("--config")
    q.add_argument("--catch-up", type=float, metavar="S", help=_CATCH_UP)
    q.set_defaults(fn=cmd_query)

    sub.add_parser(
        "serve", help="serve freshness signals and metrics (fabric.server)", add_help=False
    )
    sub.add_parser("demo", help="run the seed scenarios end to end (fabric.demo)", add_help=False)
    sub.add_parser(
        "mcp", help="serve the bindings as MCP tools (fabric.service.mcp)", add_help=False
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("serve", "demo", "mcp"):
        module = {"serve": "fabric.server", "demo": "fabric.demo", "mcp": "fabric.service.mcp"}
        return cmd_delegate(module[argv[0]], argv[1:])
    args = _parser().parse_args(argv)
    from connectors.base import SourceError
    from connectors.credentials import mask
    from fabric.execute.errors import QueryError

    try:
        return int(args.fn(args) or 0)
    except DslError as e:
        _print_diagnostics(e.diagnostics, sys.stderr)
        return 1
    except LookupError as e:
        print(f"fabric: {mask(e.args[0] if e.args else e)}", file=sys.stderr)
        return 1
    except NotImplementedError as e:
        print(f"fabric: {e}", file=sys.stderr)
        return 2
    except (QueryError, SourceError) as e:  # a failing source: its message, never a traceback
        print(f"fabric: {mask(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
