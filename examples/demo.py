"""``fabric demo``: the seed scenarios, end to end, on embedded defaults or real servers.

1. E-commerce  "what offers are near me?"       Kafka + MySQL + MongoDB
2. Finance     "how did the US market open?"    Kafka-fed news dataset (HNSW + B-tree + inverted), sandboxed post-processing
3. Analytics   "which category did I spend most on last week?"   MySQL + CSV in S3
4. Risk        encrypted [intent, risk, urgency] scored against policies under CKKS
5. Incident    the news stream lags 10^5 messages: data_stale, the scheduler parks agents, data_fresh releases them

Without options the demo needs no root and no servers installed: SQLite stands in for
MySQL, a local directory for S3, and it starts noida-db (Kafka protocol) and SecantusDB
(MongoDB protocol) itself as child processes on free ports, stopped and removed with
their temporary directory when it ends (also on Ctrl-C). ``--servers`` runs the same
bindings against the servers scripts/services starts.

Every answer is checked against an independent computation over the same generated
data (DuckDB or numpy), and the demo exits non-zero if one differs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from fabric.progress import Progress

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "seed" / "fabric.yaml"  # --servers
LOCAL_CONFIG = ROOT / "examples" / "seed" / "fabric.local.yaml"  # embedded defaults


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.2f}"
    if isinstance(v, dt.datetime):
        return v.strftime("%Y-%m-%d %H:%M:%S")
    s = str(v)
    return s if len(s) <= 60 else s[:57] + "..."


def show(table: pa.Table, limit: int = 10) -> None:
    rows = [[_fmt(v) for v in r.values()] for r in table.slice(0, limit).to_pylist()]
    head = table.column_names
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(head)]
    print("    " + "  ".join(h.ljust(w) for h, w in zip(head, widths)))
    print("    " + "  ".join("-" * w for w in widths))
    for r in rows:
        print("    " + "  ".join(c.ljust(w) for c, w in zip(r, widths)))
    if table.num_rows > limit:
        print(f"    ... {table.num_rows - limit} more rows")


def title(text: str) -> None:
    print("\n" + "=" * 78 + f"\n{text}\n" + "=" * 78)


class Check:
    def __init__(self) -> None:
        self.failures: list[str] = []

    def __call__(self, ok: bool, what: str) -> None:
        print(f"  [{'ok' if ok else 'MISMATCH'}] {what}")
        if not ok:
            self.failures.append(what)


def ecommerce(fab: Any, data: dict[str, pa.Table], env: dict[str, str], check: Check) -> None:
    from examples.ecommerce.agent import last_location, move, reference, same_offers

    title(
        "1. E-commerce: what offers are near me?  (Kafka location + MySQL merchants + MongoDB coupons)"
    )
    user = 3

    def run(label: str) -> pa.Table:
        t0 = time.perf_counter()
        res = fab.query("nearby_offers", session={"user_id": user})
        ms = (time.perf_counter() - t0) * 1000
        print(f"\n  {label}: {res.table.num_rows} offers in {ms:.0f} ms")
        show(res.table, 5)
        src = res.stats.get("sources", {})
        print(
            "  rows fetched per source: "
            + ", ".join(f"{a}={s.get('rows')}" for a, s in src.items())
        )
        return res.table

    last = last_location(data, user)
    got = run(f"user {user} at ({last['lat']:.4f}, {last['lon']:.4f})")
    check(
        same_offers(got, reference(data, last["lat"], last["lon"])),
        "offers equal a DuckDB reference over the same data (discounts of the top 10)",
    )

    # the user moves: a new location arrives on the stream, the next query follows it
    moved = move(env, data, user)
    got2 = run(f"user {user} moved to ({moved['lat']:.4f}, {moved['lon']:.4f})")
    check(
        got2.num_rows > 0 and same_offers(got2, reference(data, moved["lat"], moved["lon"])),
        "after the move, offers equal the reference for the new location",
    )
    check(got.to_pylist() != got2.to_pylist(), "the answer followed the user's new location")
    print("\n  explain analyze (last query):")
    print(
        "    "
        + fab.explain("nearby_offers", session={"user_id": user}, analyze=True).replace(
            "\n", "\n    "
        )
    )


def finance(fab: Any, data: dict[str, pa.Table], check: Check, progress: Progress) -> None:
    from examples.finance.agent import distances, reference
    from examples.seed.data import hash_embed

    title(
        "2. Finance: how did the US market open today?  (Kafka-fed news: HNSW + B-tree + inverted)"
    )
    ds = fab.dataset("news")
    t0 = time.time()
    want = data["news"].num_rows
    with progress.step("ingesting the news topic into the dataset", total=want) as step:
        while ds.count() < want and time.time() - t0 < 60:
            step.update(ds.count())
            time.sleep(0.2)
    print(f"  news dataset holds {ds.count()} documents (ingested from Kafka in the background)")
    q = hash_embed(["how did the US market open today"])[0]
    symbols = ["AAPL", "NVDA", "SPY"]
    t0 = time.perf_counter()
    with progress.step("first query (it waits for a sandbox worker if none is up yet)"):
        res = fab.query("market_open_news", session={"query_vec": q, "symbols": symbols})
    cold = (time.perf_counter() - t0) * 1000
    t0 = time.perf_counter()
    fab.query("market_open_news", session={"query_vec": q, "symbols": symbols})
    warm = (time.perf_counter() - t0) * 1000
    print(
        f"  {res.table.num_rows} rows in {cold:.1f} ms "
        "(nearest 20 among today's news on the symbols, one per symbol kept by the sandboxed snippet)"
    )
    print(
        "  the sandbox's worker processes for pushdown.python start once per process, in "
        "the background since the fabric opened (the first query waits only if the first "
        f"worker is not up yet: docs/sandbox.md); the same query again: {warm:.1f} ms"
    )
    show(res.table)
    print("  freshness: " + ", ".join(f"{a}: {f.get('status')}" for a, f in res.freshness.items()))
    # reference: exact nearest neighbours over the same documents, then the snippet's rule
    check(
        np.allclose(
            distances(data, q, res.table["id"].to_pylist()),
            reference(data, q, symbols),
            atol=1e-5,
        ),
        "results equal exact nearest neighbours + the snippet's rule",
    )
    print("\n  explain analyze:")
    text = fab.explain(
        "market_open_news", session={"query_vec": q, "symbols": symbols}, analyze=True
    )
    print("    " + text.replace("\n", "\n    "))


def analytics(fab: Any, data: dict[str, pa.Table], check: Check) -> None:
    from examples.analytics.agent import reference

    title("3. Analytics: which category did I spend most on last week?  (MySQL orders + CSV in S3)")
    for user in (3, 17):
        t0 = time.perf_counter()
        res = fab.query("top_category_last_week", session={"user_id": user})
        print(f"\n  user {user}: {(time.perf_counter() - t0) * 1000:.0f} ms")
        show(res.table)
        got = [(r["category"], round(r["spent"], 6), r["orders"]) for r in res.table.to_pylist()]
        check(got == reference(data, user), f"user {user}: equals the DuckDB reference")


def risk(fab: Any, ring: Any, data: dict[str, pa.Table], check: Check) -> None:
    from examples.risk.agent import BOUND, reference

    title("4. Risk: encrypted context [intent, risk, urgency] scored under CKKS")
    plain = [0.7, 0.2, 0.9]
    ctx = ring.encrypt(plain)
    t0 = time.perf_counter()
    res = fab.query("risk_check", session={"ctx": ctx})
    ms = (time.perf_counter() - t0) * 1000
    print(
        f"  the fabric scored {res.table.num_rows} policies on ciphertexts in {ms:.0f} ms; "
        f"it holds the public context only (secret key: {fab.has_secret_key() if hasattr(fab, 'has_secret_key') else 'no'})"
    )
    plain_scores = reference(data, plain)
    for i, row in enumerate(res.table.to_pylist()):
        score = float(np.ravel(ring.decrypt(res.table.column("risk")[i]))[0])
        ref = plain_scores[row["policy"]]
        flag = "ABOVE" if score > row["threshold"] else "below"
        print(
            f"    {row['policy']:<20} risk={score:+.5f} (plain check {ref:+.5f})  threshold {row['threshold']:.2f} -> {flag}"
        )
        check(
            abs(score - ref) < BOUND,
            f"{row['policy']}: decrypted score within {BOUND:g} of the plain computation",
        )


SCENARIOS = ["ecommerce", "finance", "analytics", "risk", "incident"]
BINDING_FILES = {
    "ecommerce": "nearby_offers.yaml",
    "finance": "market_open_news.yaml",
    "analytics": "top_category.yaml",
    "risk": "risk_check.yaml",
}
EPILOG = """examples:
  fabric demo                    all five scenarios on embedded defaults (SQLite, a local
                                 directory, noida-db and SecantusDB started by the demo)
  fabric demo --only finance     one scenario; loads only what it reads
  fabric demo --servers          the same against the servers scripts/services starts
"""


_STARTED = [time.perf_counter()]  # when main() began (set again there)


def _on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # unwinds through the finally blocks that stop the servers


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="fabric demo",
        description=__doc__.splitlines()[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--servers",
        action="store_true",
        help="run against MariaDB, SeaweedFS S3, noida-db and SecantusDB as scripts/services "
        "starts them (addresses from .services/env or FABRIC_* variables)",
    )
    ap.add_argument(
        "--skip-load",
        action="store_true",
        help="with --servers: reuse data already loaded into the servers",
    )
    ap.add_argument("--only", action="append", choices=SCENARIOS, help="run only this scenario")
    args = ap.parse_args(argv)
    _STARTED[0] = time.perf_counter()
    sys.path.insert(0, str(ROOT))
    only = set(args.only or SCENARIOS)
    if threading_main():
        signal.signal(signal.SIGTERM, _on_sigterm)
    timings: dict[str, float] = {}
    progress = Progress()
    stack = None
    work = Path(tempfile.mkdtemp(prefix="fabric-demo-run-"))
    try:
        from examples.demo_local import DemoSetupError, LocalStack, describe

        t0 = time.perf_counter()
        if args.servers:
            from examples.seed.load import environment

            env = environment()
            env["FABRIC_STATE_DIR"] = str(work / "state")
            config = CONFIG
        else:
            stack = LocalStack()
            try:
                # Kafka always (0.4 s): the news dataset of fabric.yaml ingests from it as
                # soon as the fabric opens; Mongo (2 s) only for the scenario reading it
                with progress.step("starting the local servers"):
                    env = stack.start(kafka=True, mongo="ecommerce" in only)
            except DemoSetupError as e:
                print(f"fabric demo: {e}", file=sys.stderr)
                return 2
            config = LOCAL_CONFIG
            print(
                f"started local servers in {time.perf_counter() - t0:.1f} s: {describe(stack)}",
                flush=True,
            )
        timings["start servers"] = time.perf_counter() - t0
        return _run(args, only, env, config, work, timings, progress)
    except KeyboardInterrupt:
        print("\nfabric demo: interrupted; stopping the local servers", file=sys.stderr)
    finally:
        if stack is not None:
            stack.close()
        shutil.rmtree(work, ignore_errors=True)
    # interrupted: the servers are stopped and the files gone; a query's worker threads may
    # still wait on a source that is no longer there, and the interpreter would join them
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)


def threading_main() -> bool:
    return threading.current_thread() is threading.main_thread()


def _run(
    args: argparse.Namespace,
    only: set[str],
    env: dict[str, str],
    config: Path,
    work: Path,
    timings: dict[str, float],
    progress: Progress,
) -> int:
    import fabric
    from examples.demo_local import Background, load_for, tables_for
    from examples.seed.data import generate

    keys = None
    if "risk" in only:  # CPU in tenseal while the loading waits on the servers
        keys = Background(_agent_keys, work / "agent.pub")
    env["FABRIC_AGENT_PUBLIC_CONTEXT"] = str(work / "agent.pub")
    t0 = time.perf_counter()
    with progress.step("generating the seed data"):
        data = generate()
    timings["generate data"] = time.perf_counter() - t0
    if not args.skip_load or not args.servers:
        t0 = time.perf_counter()
        total = sum(data[name].num_rows for name in tables_for(only))
        with progress.step("loading the seed data", total=total) as step:
            counts = load_for(only, env, data, servers=args.servers, step=step)
        timings["load data"] = time.perf_counter() - t0
        print(
            f"loaded the seed data in {timings['load data']:.1f} s: "
            + ", ".join(f"{k}={v}" for k, v in counts.items())
        )
    ring = None
    if keys is not None:  # the fabric reads the public context on the first encrypted query
        t0 = time.perf_counter()
        with progress.step("generating the agent's CKKS keys"):
            ring = keys.result()
        timings["agent keys (rest)"] = time.perf_counter() - t0
    os.environ.update(env)
    check = Check()
    t0 = time.perf_counter()
    with progress.step("opening the fabric"):
        fab = fabric.open(config)
    timings["open fabric"] = time.perf_counter() - t0
    if "finance" in only:  # its snippet's sandbox workers start while the others run
        threading.Thread(target=fab.catalog.sandbox, daemon=True).start()
    with fab:
        used = {BINDING_FILES[n] for n in only if n in BINDING_FILES}
        problems = [
            p
            for p in fab.validate()
            # with --only, a binding of a scenario not run may name a server not started
            if only == set(SCENARIOS) or p.span is None or Path(p.span.file).name in used
        ]
        print(
            f"validated {_shown(config)}: {len(problems)} problem{'' if len(problems) == 1 else 's'}"
        )
        for p in problems:
            print(p.format())
        for name, fn in (
            ("ecommerce", lambda: ecommerce(fab, data, env, check)),
            ("finance", lambda: finance(fab, data, check, progress)),
            ("analytics", lambda: analytics(fab, data, check)),
            ("risk", lambda: risk(fab, ring, data, check)),
        ):
            if name in only:
                t1 = time.perf_counter()
                fn()
                timings[name] = time.perf_counter() - t1
    if "incident" in only:
        from examples import demo_incident

        t1 = time.perf_counter()
        demo_incident.run(env, check, cleanup_topic=args.servers, progress=progress)
        timings["incident"] = time.perf_counter() - t1
    title("Summary")
    print(
        "  time per step: "
        + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items())
        + f"; total {sum(timings.values()):.1f} s"
        + f" ({time.perf_counter() - _STARTED[0]:.1f} s since the demo started)"
    )
    if check.failures:
        print("  mismatches:\n    " + "\n    ".join(check.failures))
        return 1
    print("  every scenario matched its independent reference")
    return 0


def _agent_keys(public: Path) -> Any:
    """The agent's key ring (its secret key never leaves it), with the public context, the
    evaluation keys for the fabric (~17 MB of Galois keys: most of the time), written to
    ``public``."""
    from crypto import KeyRing

    ring = KeyRing.generate()
    public.write_bytes(ring.public_context())
    return ring


def _shown(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    raise SystemExit(main())
