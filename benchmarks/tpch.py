"""TPC-H, all 22 queries, across five real servers: the fabric vs DuckDB federated vs DuckDB local.

Data (benchmarks/tpch/load.py, tpchgen-cli, loaded once and kept by content hash):
lineitem as 4 Parquet files in S3, orders + customer in MariaDB, part + partsupp +
supplier in PostgreSQL, nation in MongoDB, region as a Kafka topic.

Per query, interleaved round by round in one process window:
  fabric    the binding benchmarks/tpch/queries/qNN.yaml through the fabric
  federated DuckDB 1.4 attaching the same MariaDB / PostgreSQL / S3 with its mysql,
            postgres and httpfs extensions (its own venv, .services/tpch-peer, made on
            first use; it has no MongoDB or Kafka scanner, so nation and region are local)
  local     DuckDB on local tables holding the same rows (the floor)
  baseline  (--baseline) the fabric as it was before the speed work of 2026-12-01 23:xx:
            Parquet decoded by pyarrow (parquet_reader: pyarrow) and exists-stage key
            pushes without their cost gate (EXISTS_SHARE 1.0); or, with --without R1,R2,
            the fabric without those optimizer rules (its rows fetched are logged)
and prints p50 of each, the ratios, the fabric's rows fetched / rows needed per source
(res.stats vs DuckDB counting the rows of each table the answer is computed from; the
rows of a key-only pre-scan of a table, one key column, are printed apart after it as
"o 1103/601=1.8x (+11730 keys)" and not counted in the ratio), and whether each answer equals DuckDB local's (for the spec's validation parameters and for
--seeds random parameter sets). Geomeans at the bottom.

    .venv/bin/python benchmarks/tpch.py                       # SF 0.1, 5 rounds, 2 seeds
    .venv/bin/python benchmarks/tpch.py --sf 0.01 --repeat 3 --queries q01,q06
    .venv/bin/python benchmarks/tpch.py --no-peer --markdown /tmp/tpch.md
    .venv/bin/python benchmarks/tpch.py --baseline --seeds 1    # before/after in one run
    .venv/bin/python benchmarks/tpch.py --without backward_keys --queries q03   # one rule's A/B
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.tpch import harness as H  # noqa: E402
from benchmarks.tpch import load  # noqa: E402
from benchmarks.tpch.peer import Peer, encode  # noqa: E402
from benchmarks.tpch.queries import QUERIES, Vocab  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:160]


def _geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _fmt(ms: float | None) -> str:
    return "-" if ms is None else (f"{ms:.0f}" if ms >= 10 else f"{ms:.1f}")


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


class Row:
    def __init__(self, name: str):
        self.name = name
        self.fabric: list[float] = []
        self.peer: list[float] = []
        self.local: list[float] = []
        self.base: list[float] = []
        self.verdict = "-"  # ok | types | wrong | error
        self.why = ""
        self.peer_verdict = "-"
        self.fetched: dict[str, int] = {}
        self.needed: dict[str, int] = {}
        self.keys: dict[str, int] = {}  # alias -> rows of its key-only pre-scans

    @staticmethod
    def p50(xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None


def run(args: argparse.Namespace) -> list[Row]:
    data = load.prepare(args.sf)
    fab = H.open_fabric(data)
    ref = H.reference(data)
    need_con = H.needed_connection(data)
    vocab = Vocab.of(data.tables)
    peer = None
    tmp = Path(tempfile.mkdtemp(prefix="tpch_"))
    if not args.no_peer:
        import pyarrow.ipc as ipc

        files = {}
        for t in ("nation", "region"):
            files[t] = str(tmp / f"{t}.arrow")
            with ipc.new_file(files[t], data.tables[t].schema) as w:
                w.write_table(data.tables[t])
        log("starting the DuckDB federated peer (first run installs its venv)")
        peer = Peer()
        info = peer.call(
            op="setup",
            mariadb_url=data.mariadb_url,
            pg_url=data.pg_url,
            s3_endpoint=data.s3_endpoint,
            s3_access_key=data.s3_access_key,
            s3_secret_key=data.s3_secret_key,
            bucket=load.BUCKET,
            prefix=data.s3_prefix,
            **files,
        )
        log(f"peer: DuckDB {info['duckdb']} with mysql, postgres, httpfs")
    base = None
    if args.without:
        base = H.open_fabric(data)
        base.compiler.optimize = _without(args.without.split(","))
    elif args.baseline:
        base = H.open_fabric(data)
        base.catalog.connection("lake").parquet_reader = "pyarrow"  # type: ignore[attr-defined]
    rows: list[Row] = []
    names = args.queries.split(",") if args.queries else H.all_queries()
    try:
        for name in names:
            rows.append(_one(name, args, data, fab, ref, need_con, vocab, peer, tmp, base))
    finally:
        if peer is not None:
            peer.close()
        fab.close()
        if base is not None:
            base.close()
    return rows


def _without(names: list[str]):
    """An optimize function running every rule of fabric.optimizer.RULES but ``names``."""
    import fabric.optimizer as opt

    known = {r.__name__ for r in opt.RULES}
    unknown = sorted(set(names) - known)
    if unknown:
        raise SystemExit(f"--without: no optimizer rule {unknown}; the rules: {sorted(known)}")
    rules = tuple(r for r in opt.RULES if r.__name__ not in names)

    def optimize(plan, catalog):
        return opt.optimize(plan, catalog, rules=rules)

    return optimize


def _baseline_compile(base, name: str):
    """The binding compiled as before the exists-push cost gate."""
    import importlib

    df = importlib.import_module("fabric.optimizer.dynamic_filters")
    share, df.EXISTS_SHARE = df.EXISTS_SHARE, 1.0
    try:
        return H.compile_binding(base, name)
    finally:
        df.EXISTS_SHARE = share


def _one(name, args, data, fab, ref, need_con, vocab, peer, tmp, base=None) -> Row:
    import pyarrow.ipc as ipc

    q = QUERIES[name]
    row = Row(name)
    compiled = base_compiled = None
    try:
        compiled = H.compile_binding(fab, name)
        if base is not None:
            base_compiled = (
                H.compile_binding(base, name) if args.without else _baseline_compile(base, name)
            )
    except Exception as exc:
        row.verdict, row.why = "error", _short(exc)
    # correctness: validation parameters + seeded random ones, fabric and peer vs local
    for seed in [None, *range(1, args.seeds + 1)]:
        params = q.params(args.sf, seed, vocab)
        expected = H.run_reference(ref, q, params)
        label = "validation" if seed is None else f"seed {seed}"
        if compiled is not None and row.verdict in ("-", "ok", "types"):
            try:
                res = H.run_binding(fab, compiled, H.session_values(name, params))
                verdict, why = H.compare(expected, res.table, q.order)
            except Exception as exc:
                verdict, why = "error", _short(exc)
                if args.verbose:
                    traceback.print_exc()
            if verdict != "ok" or row.verdict == "-":
                if verdict != "ok":
                    why = f"{label}: {why}"
                row.verdict, row.why = verdict, why
        if peer is not None and row.peer_verdict in ("-", "ok", "types"):
            out = str(tmp / f"{name}.arrow")
            try:
                peer.call(
                    op="run", sql=q.sql, params={k: encode(v) for k, v in params.items()}, out=out
                )
                with ipc.open_file(out) as f:
                    pv, pwhy = H.compare(expected, f.read_all(), q.order)
            except Exception as exc:
                pv, pwhy = "error", _short(exc)
            if pv != "ok" or row.peer_verdict == "-":
                row.peer_verdict = pv if pv == "ok" else f"{pv}: {label}: {pwhy}"
    # timing: the validation parameters, the three engines interleaved round by round
    params = q.params(args.sf, None, vocab)
    session = H.session_values(name, params)
    fabric_ok = compiled is not None and row.verdict in ("ok", "types", "wrong")
    res = base_res = None
    for r in range(args.repeat + 1):  # round 0 warms caches and connections, not counted
        order = ["fabric", "peer", "local"] + (["base"] if base_compiled is not None else [])
        order = order[r % len(order) :] + order[: r % len(order)]
        for engine in order:
            t0 = time.perf_counter()
            if engine == "base" and fabric_ok:
                base_res = H.run_binding(base, base_compiled, session)
                if r:
                    row.base.append((time.perf_counter() - t0) * 1000)
            elif engine == "fabric" and fabric_ok:
                try:
                    res = H.run_binding(fab, compiled, session)
                except Exception as exc:
                    row.verdict, row.why, fabric_ok = "error", _short(exc), False
                    continue
                if r:
                    row.fabric.append((time.perf_counter() - t0) * 1000)
            elif engine == "peer" and peer is not None and not row.peer_verdict.startswith("error"):
                ms = peer.call(
                    op="run", sql=q.sql, params={k: encode(v) for k, v in params.items()}
                )["ms"]
                if r:
                    row.peer.append(ms)
            elif engine == "local":
                H.run_reference(ref, q, params)
                if r:
                    row.local.append((time.perf_counter() - t0) * 1000)
    if res is not None:
        row.fetched, row.keys = H.fetched_rows(res.stats.get("sources", {}))
        row.needed = H.needed_rows(need_con, q, params, list(row.fetched))
    if base_res is not None and args.without:
        b = Row(name)
        b.fetched, b.keys = H.fetched_rows(base_res.stats.get("sources", {}))
        b.needed = row.needed
        log(f"{name}: without {args.without}: {_sources(b)}")
    log(
        f"{name}: {row.verdict} fabric {_fmt(Row.p50(row.fabric))} ms, "
        f"federated {_fmt(Row.p50(row.peer))} ms, local {_fmt(Row.p50(row.local))} ms"
        + (f"  ({row.why})" if row.why else "")
    )
    return row


def _sources(row: Row) -> str:
    parts = []
    for a, n in row.fetched.items():
        need = row.needed.get(a)
        if need is None:
            text = f"{a} {n}"
        else:
            text = f"{a} {n}/{need}" + (f"={n / need:.1f}x" if need else "")
        if a in row.keys:  # never hidden: the key-only pre-scans' rows, counted apart
            text += f" (+{row.keys[a]} keys)"
        parts.append(text)
    return ", ".join(parts)


def table(rows: list[Row], sf: float, markdown: bool = False) -> str:
    head = [
        "query",
        "fabric",
        "fabric p50 ms",
        "federated p50 ms",
        "local p50 ms",
        "fabric/federated",
        "fabric/local",
        "federated",
        "rows fetched/needed per source",
    ]
    with_base = any(r.base for r in rows)
    if with_base:
        head[2:2] = ["baseline p50 ms", "baseline/federated"]
    body = []
    for r in rows:
        f, p, lo = Row.p50(r.fabric), Row.p50(r.peer), Row.p50(r.local)
        line = [
            r.name,
            r.verdict,
            _fmt(f),
            _fmt(p),
            _fmt(lo),
            _ratio(f, p),
            _ratio(f, lo),
            r.peer_verdict.split(":")[0],
            _sources(r),
        ]
        if with_base:
            b = Row.p50(r.base)
            line[2:2] = [_fmt(b), _ratio(b, p)]
        body.append(line)
    right = [r for r in rows if r.verdict == "ok"]
    gm = [
        "geomean (fabric right)",
        f"{len(right)}/{len(rows)} ok",
        _fmt(_geomean([Row.p50(r.fabric) for r in right])),
        _fmt(_geomean([Row.p50(r.peer) for r in right])),
        _fmt(_geomean([Row.p50(r.local) for r in right])),
        _fmt_ratio(
            _geomean([Row.p50(r.fabric) / Row.p50(r.peer) for r in right if r.fabric and r.peer])
        ),
        _fmt_ratio(
            _geomean([Row.p50(r.fabric) / Row.p50(r.local) for r in right if r.fabric and r.local])
        ),
        "",
        "",
    ]
    if with_base:
        gm[2:2] = [
            _fmt(_geomean([Row.p50(r.base) for r in right])),
            _fmt_ratio(
                _geomean([Row.p50(r.base) / Row.p50(r.peer) for r in right if r.base and r.peer])
            ),
        ]
    body.append(gm)
    last = [
        "geomean (every query, DuckDB)",
        "",
        "",
        _fmt(_geomean([Row.p50(r.peer) for r in rows])),
        _fmt(_geomean([Row.p50(r.local) for r in rows])),
        "",
        "",
        "",
        "",
    ]
    if with_base:
        last[2:2] = ["", ""]
    body.append(last)
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in b) + " |" for b in body]
    else:
        widths = [max(len(str(x[i])) for x in [head, *body]) for i in range(len(head))]
        lines = [
            "  ".join(str(c).ljust(w) for c, w in zip(x, widths)).rstrip() for x in [head, *body]
        ]
        lines.insert(1, "-" * len(lines[0]))
    out = [f"TPC-H SF {sf:g}", *lines, ""]
    # the goals of issue 11: geomean <= 1.0x federated, no query above 2x, fetched <= 2x needed
    slow = [
        f"{r.name} {Row.p50(r.fabric) / Row.p50(r.peer):.1f}x"
        for r in right
        if r.fabric and r.peer and Row.p50(r.fabric) > 2 * Row.p50(r.peer)
    ]
    over = [
        f"{r.name}.{a} {n / r.needed[a]:.0f}x"
        for r in rows
        for a, n in r.fetched.items()
        if r.needed.get(a) and n > 2 * r.needed[a]
    ]
    out.append(f"above 2x federated: {len(slow)} ({', '.join(slow) or 'none'})")
    out.append(f"sources fetching > 2x the rows needed: {len(over)} ({', '.join(over) or 'none'})")
    out.append("")
    for r in rows:
        if r.verdict != "ok":
            out.append(f"{r.name} fabric {r.verdict}: {r.why}")
        if r.peer_verdict not in ("ok", "-"):
            out.append(f"{r.name} federated {r.peer_verdict}")
    return "\n".join(out)


def _fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sf", type=float, default=0.1)
    ap.add_argument(
        "--repeat", type=int, default=5, help="timed rounds per query (after 1 warm-up)"
    )
    ap.add_argument("--seeds", type=int, default=2, help="random parameter sets checked per query")
    ap.add_argument("--queries", default="", help="comma list, e.g. q01,q06 (default: all 22)")
    ap.add_argument("--no-peer", action="store_true", help="skip DuckDB federated")
    ap.add_argument("--markdown", default="", help="also write the table as Markdown to this file")
    ap.add_argument(
        "--baseline",
        action="store_true",
        help="also time the fabric as before the 2026-12-01 speed work (pyarrow Parquet "
        "reader, exists pushes without their cost gate), interleaved",
    )
    ap.add_argument(
        "--without",
        default="",
        help="also time the fabric without these optimizer rules (comma list), interleaved",
    )
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    rows = run(args)
    print(table(rows, args.sf))
    if args.markdown:
        Path(args.markdown).write_text(table(rows, args.sf, markdown=True) + "\n")


if __name__ == "__main__":
    main()
