"""The ``fabric`` command: validate, explain, query, load, materialize, init, serve, demo.

fabric validate [PATH ...] [--config fabric.yaml] [--offline]
fabric explain NAME [--session k=v ...] [--analyze] [--logical] [--config fabric.yaml]
fabric query NAME [--session k=v ...] [--format table|json] [--catch-up S] [--config fabric.yaml]
fabric query --text "from mysql://shop/merchants as m select m.name limit 5"
fabric load DATASET FILE|URI [--vectors COL=F.npy] [--ignore-extra]   (fabric.load)
fabric materialize DATASET [--binding NAME --session k=v]

``query`` and ``explain --analyze`` read Kafka-fed datasets as the broker has them now: they
ingest from the last checkpoint to the broker's end (up to ``--catch-up`` seconds, default
10) before answering, and print each source's freshness (measured against the broker) to
stderr; the binding's ``on_stale`` decides what a source still behind does. ``--catch-up
0`` answers from the last checkpoint without ingesting (the lag still comes from the broker).
fabric serve ...   (fabric.server)
fabric mcp ...     (fabric.service.mcp)
fabric demo ...    (examples.demo)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dsl.errors import Diagnostic, DslError


def _count(n: int, noun: str) -> str:
    """'1 problem', '2 problems'."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _file_of(file: str, base: Path | None = None) -> Path:
    """The file a diagnostic names, absolute: a relative name is from the working
    directory, else from ``base`` (the config's directory: the catalog names binding
    files relative to it)."""
    p = Path(file)
    if not p.is_absolute() and not p.exists() and base is not None and (base / p).exists():
        p = base / p
    return p.resolve()


def _shown(file: str, base: Path | None = None) -> str:
    """A file as the user can open it from here: relative to the working directory when
    it is below it, else absolute; ``<doc>``-style names stay as they are."""
    if file.startswith("<"):
        return file
    p = _file_of(file, base)
    try:
        return str(p.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


def _print_diagnostics(diags: Sequence[Diagnostic], out: Any, base: Path | None = None) -> None:
    """Print ``diags`` with their files shown relative to the working directory (``_shown``),
    filling missing underlined lines from their files (each read once)."""
    import dataclasses

    from dsl.parser import attach_source

    diags = [
        d
        if d.span is None
        else dataclasses.replace(
            d, span=dataclasses.replace(d.span, file=_shown(d.span.file, base))
        )
        for d in diags
    ]
    texts: dict[str, str] = {}
    for f in {d.span.file for d in diags if d.span is not None and d.source_line is None}:
        with contextlib.suppress(OSError):
            texts[f] = Path(f).read_text()
    for d in attach_source(DslError(diags), texts).diagnostics:
        print(d.format(), file=out)


def _config_path(arg: str | None) -> Path | None:
    if arg:
        if not Path(arg).is_file():
            raise DslError(
                [
                    Diagnostic(
                        f"no config file {arg}" + (" (a directory)" if Path(arg).is_dir() else ""),
                        None,
                        "pass --config path/to/fabric.yaml, or run `fabric init DIR` for a "
                        "runnable example",
                    )
                ]
            )
        return Path(arg)
    p = Path("fabric.yaml")
    return p if p.exists() else None


def _open(args: argparse.Namespace, *, watch: bool = False, reads: bool = False):
    """The fabric of ``--config``; ``reads``: the command reads data, so Kafka-fed datasets
    are ingested up to the broker's end first (``--catch-up`` seconds at most)."""
    import fabric

    path = _config_path(args.config)
    if path is None:
        raise DslError(
            [
                Diagnostic(
                    f"no fabric.yaml in {Path.cwd()}",
                    None,
                    "pass --config path/to/fabric.yaml, or run `fabric init DIR` for a "
                    "runnable example",
                )
            ]
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


def _print_freshness(res: Any, always: bool = False) -> None:
    """One line per source read, on stderr: status, lag against the source, error (for a
    source with a measured lag or not fresh; every source with ``always``)."""
    for alias, f in (res.freshness or {}).items():
        if not (always or f.get("lag_messages") is not None or f.get("status") != "fresh"):
            continue
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
        if value.startswith("@"):
            out[key] = _session_file(key, value[1:])
        elif value[:1] in ("[", "{"):
            try:
                out[key] = json.loads(value)
            except json.JSONDecodeError as e:
                raise SystemExit(
                    f"fabric: --session {key}=...: not valid JSON ({e.msg} at column "
                    f"{e.colno}); quote the whole value for the shell: --session '{key}=[1, 2]'"
                ) from None
        elif t is None:
            try:
                out[key] = json.loads(value)
            except json.JSONDecodeError:
                out[key] = value
        else:
            out[key] = parse_cli_value(t, value)
    return out


def _session_file(key: str, path: str) -> Any:
    """``--session k=@file``: a value from a .npy file (e.g. a 384-d vector) or a .json file."""
    p = Path(path)
    if not p.is_file():
        raise SystemExit(f"fabric: --session {key}=@{path}: no such file")
    if p.suffix == ".npy":
        import numpy as np

        try:
            return np.load(p, allow_pickle=False).tolist()
        except ValueError as e:
            raise SystemExit(f"fabric: --session {key}=@{path}: not a .npy array ({e})") from None
    try:
        return json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SystemExit(
            f"fabric: --session {key}=@{path}: not JSON ({e}); give a .json or .npy file"
        ) from None


# ------------------------------------------------------------------ commands


def cmd_validate(args: argparse.Namespace) -> int:
    from fabric.config import load_config

    diags: list[Diagnostic] = []
    config_path = _config_path(args.config)
    base = config_path.resolve().parent if config_path is not None else None
    n_bindings = 0
    if config_path is None:
        if not args.paths:
            print(
                "fabric validate: no fabric.yaml here and no binding files given", file=sys.stderr
            )
            print("  hint: fabric validate agents/*.yaml --config fabric.yaml", file=sys.stderr)
            return 2
        # no catalog: syntax, shape and the bindings' own consistency
        own, n_bindings = _self_check(_expand(args.paths))
        diags.extend(own)
        mode = "syntax only, and the bindings' own consistency (no fabric.yaml: sources and columns not checked)"
    else:
        try:
            config = load_config(config_path)
        except DslError as e:
            _print_diagnostics(e.diagnostics, sys.stdout)
            n = _count(len(e.diagnostics), "problem")
            print(f"{n} in {_shown(str(config_path))}", file=sys.stderr)
            return 1
        if args.paths:
            import dataclasses

            files = _expand(args.paths)
            config = dataclasses.replace(config, bindings=tuple(str(f.resolve()) for f in files))
        import fabric

        # the bindings' own consistency first, whether or not the catalog answers
        own, _ = _self_check(config.binding_files())
        own_files = {_file_of(d.span.file, base) for d in own if d.span is not None}
        try:
            # prewarm files are checked by validate(), not run
            opened = fabric.open(
                config, ingest=False, watch=False, offline=args.offline, prewarm=False
            )
            with opened as fab:
                found = fab.validate()
                n_bindings = len(fab.bindings.names())
        except DslError as e:
            found = list(e.diagnostics)
        # a file with problems of its own shows those (the catalog's would repeat them)
        diags = own + [
            d for d in found if d.span is None or _file_of(d.span.file, base) not in own_files
        ]
        mode = "offline (declared schemas)" if args.offline else "against the live catalog"
    if diags:
        _print_diagnostics(diags, sys.stdout, base)
        print(_count(len(diags), "problem"), file=sys.stderr)
        return 1
    print(f"OK: {_count(n_bindings, 'binding')} valid, {mode}")
    return 0


def _self_check(files: Sequence[Path]) -> tuple[list[Diagnostic], int]:
    """Parse each binding file and check its own consistency (dsl.selfcheck): session
    values, aliases, pushdown params; no catalog needed."""
    from dsl import loader, selfcheck

    diags: list[Diagnostic] = []
    n = 0
    for f in files:
        try:
            specs = loader.load_file(f, str(f))
        except DslError as e:
            diags.extend(e.diagnostics)
            continue
        n += len(specs)
        for spec in specs:
            diags.extend(selfcheck.check(spec))
    return diags, n


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
            res = fab.query_text(args.text, session or None, session_id=args.session_id)
        else:
            if not args.name:
                raise SystemExit("fabric query: give a binding NAME or --text '...'")
            compiled = fab.binding(args.name)
            res = fab.query(args.name, _session(args, compiled), session_id=args.session_id)
        table = res.table
        _print_freshness(res)
        _write_result(args, res, table)
    return 0


def _json_value(v: Any) -> Any:
    """JSON for values json does not know: ISO-8601 times, decimals as strings."""
    import datetime as dt
    import decimal

    if isinstance(v, dt.datetime | dt.date | dt.time):
        return v.isoformat()
    if isinstance(v, dt.timedelta):
        return v.total_seconds()
    if isinstance(v, decimal.Decimal):
        return str(v)
    if isinstance(v, bytes):
        return v.hex()
    return str(v)


def _write_result(args: argparse.Namespace, res: Any, table: Any) -> None:
    fmt = args.format
    extra = {}
    if args.freshness:
        extra["freshness"] = res.freshness
    if args.stats:
        extra["stats"] = res.stats
    if fmt in ("arrow", "parquet"):
        out = sys.stdout.buffer if args.output in (None, "-") else open(args.output, "wb")  # noqa: SIM115
        if out is sys.stdout.buffer and sys.stdout.isatty():
            raise SystemExit(
                f"fabric query: --format {fmt} is binary; give --output FILE or pipe it "
                "(fabric query ... --format arrow | python -c ...)"
            )
        try:
            if fmt == "arrow":
                import pyarrow.ipc as ipc

                with ipc.new_stream(out, table.schema) as w:
                    w.write_table(table)
            else:
                import pyarrow.parquet as pq

                pq.write_table(table, out)
        finally:
            if out is not sys.stdout.buffer:
                out.close()
        if extra:
            print(json.dumps(extra, default=_json_value, indent=2), file=sys.stderr)
        return
    text_out = sys.stdout if args.output in (None, "-") else open(args.output, "w")  # noqa: SIM115
    try:
        if fmt == "json":
            rows = table.to_pylist()
            doc: Any = {"rows": rows, **extra} if extra else rows
            print(json.dumps(doc, default=_json_value, indent=2), file=text_out)
        elif fmt == "ndjson":
            for row in table.to_pylist():
                print(json.dumps(row, default=_json_value), file=text_out)
            if extra:
                print(json.dumps(extra, default=_json_value), file=text_out)
        elif fmt == "csv":
            import io

            import pyarrow.csv as pacsv

            buf = io.BytesIO()
            pacsv.write_csv(table, buf)
            text_out.write(buf.getvalue().decode())
        else:
            print(_table_text(table, color=_color(text_out)), file=text_out)
            for name, value in extra.items():
                print(f"{name}: {json.dumps(value, default=_json_value)}", file=text_out)
    finally:
        if text_out is not sys.stdout:
            text_out.close()


def _color(stream: Any) -> bool:
    """Colours only on a terminal, never with NO_COLOR set (https://no-color.org)."""
    import os

    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _bold(text: str, on: bool) -> str:
    return f"\033[1m{text}\033[0m" if on else text


def _table_text(table: Any, max_rows: int = 50, color: bool = False) -> str:
    cols = table.column_names
    rows = [[_cell(v) for v in r.values()] for r in table.slice(0, max_rows).to_pylist()]
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(cols)]
    line = " | ".join(_bold(c.ljust(w), color) for c, w in zip(cols, widths))
    out = [line, "-+-".join("-" * w for w in widths)]
    out += [" | ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    if table.num_rows > max_rows:
        out.append(f"... {table.num_rows - max_rows} more rows")
    out.append(f"({table.num_rows} row{'s' if table.num_rows != 1 else ''})")
    return "\n".join(out)


def _cell(v: Any) -> str:
    import datetime as dt

    s = "null" if v is None else v.isoformat() if isinstance(v, dt.datetime) else str(v)
    return s if len(s) <= 60 else s[:57] + "..."


_INIT_BINDING = """\
binding: top_products
description: The products ordered most, counting only orders of at least min_qty items
session:
  min_qty: int
sources:
  o:
    from: file://local/orders.csv
    where: qty >= {{session.min_qty}}
  p:
    from: file://local/products.parquet
    join: p.id = o.product_id
select: [p.name, p.category, sum(o.qty) as items, count(*) as orders]
group_by: [p.name, p.category]
order_by: items desc
limit: 5
"""

_INIT_README = """\
# A fabric scaffold (written by `fabric init`)

    fabric validate                                   # fabric.yaml and agents/*.yaml
    fabric query top_products --session min_qty=2     # run the binding
    fabric explain top_products --session min_qty=2 --analyze
    fabric query --text "from file://local/products.parquet as p select p.name limit 3"

- `fabric.yaml`: one connection, `local`, a directory of files (`data/`); add MySQL,
  PostgreSQL, MongoDB, Kafka or S3 connections next to it (docs/bindings.md).
- `agents/top_products.yaml`: a binding joining `data/orders.csv` with
  `data/products.parquet`, parameterized by the session value `min_qty`.
- `data/`: deterministic sample data (200 products, 5,000 orders).

The connection's `root` (`data`) is relative to `fabric.yaml`: the directory can be
moved or copied as it is.
"""


def cmd_timeline(args: argparse.Namespace) -> int:
    """The session's queries in order, from a running ``fabric serve`` (its ring buffer)."""
    import json
    import os
    import urllib.error
    import urllib.parse
    import urllib.request

    from fabric.tracing.timeline import render_text

    url = args.url
    if url is None:
        host, port = "127.0.0.1", 8765
        cfg = Path(args.config) if args.config else Path("fabric.yaml")
        if cfg.exists():
            from fabric.config import load_config

            server = load_config(cfg).server
            host, port = server.host, server.port
        url = f"http://{host}:{port}"
    token = args.token or os.environ.get("FABRIC_TOKEN")
    if not token:
        raise SystemExit("fabric timeline: give --token TOKEN or set FABRIC_TOKEN (an agent token)")
    fmt = "html" if args.format == "html" else "json"
    sid = urllib.parse.quote(args.session_id, safe="")
    req = urllib.request.Request(
        f"{url.rstrip('/')}/v1/sessions/{sid}/timeline?format={fmt}",
        headers={"Authorization": f"Bearer {token}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=args.timeout) as r:
            body = r.read()
    except urllib.error.HTTPError as e:
        detail = e.read().decode()[:500]
        raise SystemExit(f"fabric timeline: {url} answered {e.code}: {detail}") from None
    except OSError as e:
        raise SystemExit(
            f"fabric timeline: cannot reach {url} ({e}); start `fabric serve` or pass --url"
        ) from None
    if args.format == "text":
        tl = json.loads(body)
        if not tl["queries"]:
            print(f"fabric timeline: no queries of session {args.session_id!r} are kept")
            return 1
        out = render_text(tl).encode() + b"\n"
    else:
        out = body
    if args.output in (None, "-"):
        sys.stdout.buffer.write(out)
    else:
        Path(args.output).write_bytes(out)
    return 0


def cmd_init(args: argparse.Namespace) -> int:
    import datetime as dt

    import numpy as np
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    root = Path(args.dir)
    if (root / "fabric.yaml").exists() and not args.force:
        print(
            f"fabric init: {root / 'fabric.yaml'} exists; pass --force to overwrite",
            file=sys.stderr,
        )
        return 2
    (root / "agents").mkdir(parents=True, exist_ok=True)
    (root / "data").mkdir(exist_ok=True)
    rng = np.random.default_rng(7)
    cats = ["books", "games", "garden", "kitchen", "toys"]
    products = pa.table(
        {
            "id": pa.array(range(1, 201), pa.int64()),
            "name": [f"product {i:03d}" for i in range(1, 201)],
            "category": [cats[i % len(cats)] for i in range(200)],
        }
    )
    n = 5_000
    start = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    orders = pa.table(
        {
            "id": pa.array(range(1, n + 1), pa.int64()),
            "product_id": pa.array(rng.zipf(1.5, n) % 200 + 1, pa.int64()),
            "qty": pa.array(rng.integers(1, 6, n), pa.int64()),
            "ordered_at": pa.array(
                [start + dt.timedelta(minutes=int(m)) for m in rng.integers(0, 525_600, n)],
                pa.timestamp("us", tz="UTC"),
            ),
        }
    )
    pq.write_table(products, root / "data" / "products.parquet")
    pacsv.write_csv(orders, root / "data" / "orders.csv")
    (root / "fabric.yaml").write_text(
        "# written by `fabric init`: a directory of files (root: relative to this file)\n"
        "connections:\n"
        "  local: {kind: file, root: data}\n"
        "bindings: [agents/]\n"
    )
    (root / "agents" / "top_products.yaml").write_text(_INIT_BINDING)
    (root / "README.md").write_text(_INIT_README)
    print(f"wrote {root}/: fabric.yaml, agents/top_products.yaml, data/ (2 files), README.md")
    print(f"next: cd {root} && fabric query top_products --session min_qty=2")
    return 0


def _dataset_decl(fab: Any, name: str) -> Any:
    """The manager's declaration of dataset ``name`` (unknown: the LookupError naming the
    declared ones)."""
    if fab.service is None:
        raise LookupError("this fabric was opened offline: no datasets are materialized")
    fab.dataset(name)
    return fab.service.manager.decls[name]


def _declared_at(fab: Any, name: str) -> Any:
    cfg = fab.config.datasets.get(name)
    span = getattr(cfg, "span", None)
    if span is None:
        return None
    import dataclasses

    return dataclasses.replace(span, file=_shown(span.file))


def _fill(args: argparse.Namespace, fab: Any, name: str, table: Any, origin: Any) -> int:
    """Check ``table`` against dataset ``name``'s schema, upsert it with a progress bar and
    checkpoint it; nothing is kept unless every row converts and the checkpoint is written."""
    from fabric import load
    from fabric.progress import Progress

    decl = fab.service.manager.decls[name]
    table = load.conform(
        table,
        decl.schema,
        dataset=name,
        origin=origin,
        key=decl.key,
        optional={e.into for e in decl.embed},
        ignore_extra=args.ignore_extra,
        declared_at=_declared_at(fab, name),
    )
    mgr = fab.service.manager
    ds = fab.dataset(name)
    total = table.num_rows
    done = 0

    def report(n: int) -> None:
        nonlocal done
        done = n
        step.update(n)

    try:
        with Progress(sys.stderr).step(f"loading {name} from {origin.name}", total) as step:
            load.write(ds, table, report, args.batch_rows)
        ck = mgr.save(name, {"loaded_from": origin.name, "rows": total})
    except BaseException as e:
        mgr.forget_changes(name)
        if isinstance(e, KeyboardInterrupt | SystemExit):
            print(f"fabric load: interrupted after {done:,} of {total:,} rows", file=sys.stderr)
            raise
        print(
            f"fabric load: {e}\n  {done:,} of {total:,} rows had been written when it failed; "
            f"nothing was saved: dataset {name} is as it was before",
            file=sys.stderr,
        )
        return 1
    print(
        f"loaded {total:,} rows into dataset {name} from {origin.name}: "
        f"{ds.count():,} rows now, checkpoint {_shown(str(ck.path))}"
    )
    return 0


def cmd_load(args: argparse.Namespace) -> int:
    from fabric import load

    with _open(args) as fab:
        name = args.dataset
        decl = _dataset_decl(fab, name)
        if decl.from_uri:
            how = (
                "it is fed continuously from there"
                if decl.kafka_feed()
                else "it is refreshed from there"
            )
            raise SystemExit(
                f"fabric load: dataset {name} has from: {decl.from_uri} and {how}; "
                f"`fabric materialize {name}` fills it from its source (load takes a "
                "dataset declared without from:)"
            )
        optional = {e.into for e in decl.embed}
        if "://" in args.source:
            if args.vectors:
                raise SystemExit("fabric load: --vectors goes with a file, not a source URI")
            table = load.read_source(fab, args.source, decl.schema, optional)
            origin = load.Origin(args.source, "source")
        else:
            table, origin = load.read_file(
                Path(args.source), decl.schema, fmt=args.format, shown=args.source
            )
            vectors = {}
            for item in args.vectors or []:
                col, sep, path = item.partition("=")
                if not sep or not path.endswith(".npy"):
                    raise SystemExit(f"fabric load: --vectors takes COLUMN=FILE.npy, got {item!r}")
                vectors[col] = Path(path)
            table = load.add_vectors(table, vectors, origin)
        return _fill(args, fab, name, table, origin)


def cmd_materialize(args: argparse.Namespace) -> int:
    import fabric
    from fabric import load
    from fabric.progress import Progress

    path = _config_path(args.config)
    if path is None:
        return _open(args).close() or 1  # the "no fabric.yaml" diagnostic
    name = args.dataset
    from fabric.config import load_config

    config = load_config(path)
    d = config.datasets.get(name)
    kafka = d is not None and (d.from_uri or "").startswith("kafka://")
    with fabric.open(config, ingest=kafka and not args.binding, watch=False) as fab:
        decl = _dataset_decl(fab, name)
        mgr = fab.service.manager
        if args.binding:
            if decl.from_uri:
                raise SystemExit(
                    f"fabric materialize: dataset {name} has from: {decl.from_uri}; a "
                    "binding's rows go into a dataset declared without from:"
                )
            compiled = fab.binding(args.binding)
            res = fab.query(args.binding, _session(args, compiled))
            _print_freshness(res)
            return _fill(
                args, fab, name, res.table, load.Origin(f"binding {args.binding}", "source")
            )
        if not decl.from_uri:
            raise SystemExit(
                f"fabric materialize: dataset {name} has no from:; fill it with "
                f"`fabric load {name} FILE` or `fabric materialize {name} --binding NAME`"
            )
        ds = fab.dataset(name)
        if not kafka:
            with Progress(sys.stderr).step(f"refreshing {name} from {decl.from_uri}"):
                info = fab.refresh(name)
            print(
                f"refreshed dataset {name} from {decl.from_uri}: {info['rows_read']:,} rows "
                f"read, {info['deleted']:,} deleted, {ds.count():,} rows now "
                f"({info['mode']}, {info['seconds']:g} s)"
            )
            return 0
        import time

        ing = mgr.ingestors.get(name)
        start = mgr.broker_lag(name).get("lag_messages") or 0
        deadline = time.monotonic() + fab.catch_up_timeout(args.catch_up)
        caught = False
        with Progress(sys.stderr).step(
            f"catching up {name} with {decl.from_uri}", start or None
        ) as step:
            while time.monotonic() < deadline:
                if ing is None or ing.wait_caught_up(min(0.25, deadline - time.monotonic())):
                    caught = True
                    break
                lag = ing.lag_messages
                if lag is not None and start:
                    step.update(max(0, start - lag))
        lag = ing.lag_messages if ing is not None else None
        state = "caught up with" if caught else "not caught up with"
        print(
            f"dataset {name} {state} {decl.from_uri}: {ds.count():,} rows"
            + (f", lag {lag:,} messages" if lag is not None else "")
        )
        return 0 if caught else 1


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


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("agent-data-fabric")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


_EXAMPLES = {
    "fabric": """examples:
  fabric demo                                   the five seed scenarios, no servers needed
  fabric init myfabric && cd myfabric           a runnable scaffold with local data
  fabric validate                               check fabric.yaml and every binding
  fabric query top_products --session min_qty=2
  fabric explain top_products --session min_qty=2 --analyze
  fabric load stock stock.csv                   fill a dataset from a file or a source

`fabric COMMAND --help` shows each command's options and examples; --debug before the
command shows the Python traceback of an unexpected error.""",
    "validate": """examples:
  fabric validate                               fabric.yaml here and its bindings
  fabric validate agents/ --config fabric.yaml  only these binding files
  fabric validate agents/offers.yaml            syntax and the binding's own consistency
  fabric validate --offline                     against declared schemas, no connection""",
    "explain": """examples:
  fabric explain top_products --session min_qty=2
  fabric explain top_products --session min_qty=2 --analyze     run it: rows and times
  fabric explain top_products --logical                         before optimization""",
    "query": """examples:
  fabric query top_products --session min_qty=2
  fabric query top_products --session min_qty=2 --format json --freshness
  fabric query news --session 'symbols=["AAPL", "NVDA"]' --session query_vec=@q.npy
  fabric query --text "from file://data/products.csv as p select p.name limit 5"
  fabric query top_products --format parquet -o out.parquet
  fabric query top_products --format ndjson | head -3

--session k=v takes the session type's text form, JSON ('k=[1, 2]') or @file (a .npy or
.json file: a 384-d vector, a list).""",
    "load": """examples:
  fabric load orders data/orders.parquet          a Parquet file into dataset orders
  fabric load orders data/orders.csv --ignore-extra    skip columns the schema lacks
  fabric load news news.jsonl --vectors embedding=emb.npy   vectors from a .npy matrix
  fabric load merchants mysql://shop/merchants    every row of a source

The dataset is one declared in fabric.yaml without from:. Every row is checked against
its schema before anything is written (a missing or unknown column, a value that does not
convert: file:line:col, the column and the declaration); the rows are then upserted by the
key and checkpointed, so a failure leaves the dataset as it was.""",
    "materialize": """examples:
  fabric materialize merchants         refresh a dataset with from: a table, file or collection
  fabric materialize news              catch a Kafka-fed dataset up with its topic
  fabric materialize top --binding top_products --session min_qty=2   a binding's rows""",
    "init": """examples:
  fabric init myfabric          writes myfabric/fabric.yaml, agents/, data/ and a README
  cd myfabric && fabric query top_products --session min_qty=2""",
}


def _sub(sub: Any, name: str, help: str, **kw: Any) -> argparse.ArgumentParser:
    return sub.add_parser(  # type: ignore[no-any-return]
        name,
        help=help,
        description=help,
        epilog=_EXAMPLES.get(name),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        **kw,
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fabric",
        description="The agent data fabric: bindings compiled to query plans over your sources.",
        epilog=_EXAMPLES["fabric"],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"fabric {_version()}")
    p.add_argument(
        "--debug", action="store_true", help="show the Python traceback of an unexpected error"
    )
    sub = p.add_subparsers(dest="command", required=True)

    v = _sub(sub, "validate", "check binding files (and fabric.yaml)")
    v.add_argument(
        "paths", nargs="*", help="binding files or directories (default: bindings: of fabric.yaml)"
    )
    v.add_argument("--config", help="fabric.yaml (default: ./fabric.yaml if present)")
    v.add_argument(
        "--offline", action="store_true", help="plan against declared schemas; open no connection"
    )
    v.set_defaults(fn=cmd_validate)

    e = _sub(sub, "explain", "print the plan of a binding")
    e.add_argument("name")
    e.add_argument("--session", action="append", metavar="K=V", help="a session value (repeatable)")
    e.add_argument("--analyze", action="store_true", help="run it and show actual rows and times")
    e.add_argument("--logical", action="store_true", help="the plan before optimization")
    e.add_argument("--config")
    e.add_argument("--offline", action="store_true")
    e.add_argument("--catch-up", type=float, metavar="S", help=_CATCH_UP)
    e.set_defaults(fn=cmd_explain)

    q = _sub(sub, "query", "run a binding (or --text) and print the result")
    q.add_argument("name", nargs="?")
    q.add_argument("--text", help="a compact text query instead of a binding name")
    q.add_argument("--session", action="append", metavar="K=V")
    q.add_argument(
        "--format",
        choices=("table", "json", "ndjson", "csv", "arrow", "parquet"),
        default="table",
        help="table (default), json (a list of rows; times in ISO 8601), ndjson, csv, "
        "arrow (an IPC stream) or parquet",
    )
    q.add_argument("--output", "-o", metavar="FILE", help="write the result to FILE")
    q.add_argument(
        "--freshness", action="store_true", help="add each source's freshness to the output"
    )
    q.add_argument(
        "--stats", action="store_true", help="add rows/bytes per source and times to the output"
    )
    q.add_argument("--config")
    q.add_argument("--catch-up", type=float, metavar="S", help=_CATCH_UP)
    q.add_argument(
        "--session-id", help="the session the query belongs to in traces (docs/tracing.md)"
    )
    q.set_defaults(fn=cmd_query)

    t = _sub(sub, "timeline", "a session's queries in order, from a running fabric serve")
    t.add_argument("session_id", help="the session id the agent passed (X-Fabric-Session)")
    t.add_argument("--url", help="fabric serve's URL (default: server: of fabric.yaml)")
    t.add_argument("--token", help="an agent token (default: $FABRIC_TOKEN)")
    t.add_argument("--format", choices=("text", "json", "html"), default="text")
    t.add_argument("--output", "-o", metavar="FILE", help="write to FILE (the html page)")
    t.add_argument("--config")
    t.add_argument("--timeout", type=float, default=10.0)
    t.set_defaults(fn=cmd_timeline)

    i = _sub(sub, "init", "write a runnable scaffold: fabric.yaml, a binding, local data")
    i.add_argument("dir", help="the directory to write (created if missing)")
    i.add_argument("--force", action="store_true", help="overwrite an existing fabric.yaml")
    i.set_defaults(fn=cmd_init)

    ld = _sub(sub, "load", "fill a dataset from a file (Parquet, CSV, JSON lines) or a source")
    ld.add_argument("dataset", help="a dataset of fabric.yaml declared without from:")
    ld.add_argument("source", help="a file, or a source URI (mysql://shop/merchants)")
    ld.add_argument("--format", choices=("parquet", "csv", "jsonl"), help="default: the extension")
    ld.add_argument(
        "--vectors",
        action="append",
        metavar="COL=FILE.npy",
        help="a vector column from a .npy matrix, one row per row of the file (repeatable)",
    )
    ld.add_argument(
        "--ignore-extra", action="store_true", help="skip columns the dataset's schema lacks"
    )
    ld.add_argument("--batch-rows", type=int, default=10_000, help=argparse.SUPPRESS)
    ld.add_argument("--config")
    ld.set_defaults(fn=cmd_load)

    mt = _sub(sub, "materialize", "fill a dataset from its from: source, or from a binding")
    mt.add_argument("dataset")
    mt.add_argument("--binding", help="upsert this binding's rows (dataset without from:)")
    mt.add_argument("--session", action="append", metavar="K=V")
    mt.add_argument("--ignore-extra", action="store_true", help="skip columns the schema lacks")
    mt.add_argument("--batch-rows", type=int, default=10_000, help=argparse.SUPPRESS)
    mt.add_argument("--catch-up", type=float, metavar="S", help=_CATCH_UP)
    mt.add_argument("--config")
    mt.set_defaults(fn=cmd_materialize)

    sub.add_parser(
        "serve", help="serve freshness signals and metrics (fabric.server)", add_help=False
    )
    sub.add_parser(
        "demo",
        help="run the seed scenarios end to end, no servers needed (fabric demo --help)",
        add_help=False,
    )
    sub.add_parser(
        "mcp", help="serve the bindings as MCP tools (fabric.service.mcp)", add_help=False
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(argv)
    except BrokenPipeError:  # `fabric query ... | head`: the reader is gone, say nothing
        import os

        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return 0


def _main(argv: list[str]) -> int:
    debug = False
    if argv and argv[0] == "--debug":
        debug, argv = True, argv[1:]
    if argv and argv[0] in ("serve", "demo", "mcp"):
        module = {"serve": "fabric.server", "demo": "examples.demo", "mcp": "fabric.service.mcp"}
        return cmd_delegate(module[argv[0]], argv[1:])
    args = _parser().parse_args(argv)
    from connectors.base import SourceError
    from connectors.credentials import mask
    from fabric.execute.errors import QueryError

    try:
        return int(args.fn(args) or 0)
    except DslError as e:
        path = getattr(args, "config", None) or "fabric.yaml"
        base = Path(path).resolve().parent if Path(path).is_file() else None
        _print_diagnostics(e.diagnostics, sys.stderr, base)
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
    except (BrokenPipeError, KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:  # unexpected: one line, the traceback behind --debug
        if debug or args.debug:
            raise
        print(
            f"fabric: {type(e).__name__}: {mask(str(e))}\n"
            "  (an unexpected error: run `fabric --debug ...` for the traceback, and please "
            "report it)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
