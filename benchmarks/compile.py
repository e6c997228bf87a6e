"""Binding compilation cost: cold compile vs cached lookup + session binding.

For the seed-scenario bindings (tests/fixtures/dsl, planned offline against declared
schemas, so no server is needed) it measures, per binding:

- parse:     YAML text -> BindingSpec (PyYAML composer with positions + the Lark expression parser)
- build:     BindingSpec -> logical plan with every semantic check
- optimize:  fabric.optimizer.optimize(plan, catalog)
- cold:      build + optimize (what a first use or an edit costs once the file is parsed)
- cold+parse: parse + build + optimize
- cached:    Fabric.binding(name).bind(session) on the JIT cache (every query pays this)

and the compact text form (compile_text, cold and cached). Targets from issue #3:
cached lookup + binding < 50 us; cold compile < 5 ms for a 3-source binding.

    .venv/bin/python benchmarks/compile.py [--repeat 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fabric  # noqa: E402
from dsl.loader import load_text  # noqa: E402
from dsl.parser import parse_binding_text  # noqa: E402
from fabric.optimizer import optimize  # noqa: E402
from fabric.plan.builder import build  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "dsl"


class FakeCiphertext:
    size = 3

    def serialize(self) -> bytes:
        return b""


CASES = {
    "nearby_offers": ("nearby_offers.yaml", {"user_id": 42}),
    "market_open_news": (
        "market_open_news.yaml",
        {"query_vec": np.ones(4, dtype=np.float32), "symbols": ["AAPL", "MSFT"]},
    ),
    "top_category_last_week": ("top_category_last_week.yaml", {"user_id": 7}),
    "risk_check": ("risk_check.yaml", {"ctx": FakeCiphertext(), "policy": "default"}),
}
TEXT = (
    "session user_id: int from kafka://bus/location_stream as loc latest_by user_id "
    "where loc.user_id = {{session.user_id}} derive cell = geo_hash(loc.lat, loc.lon, 6) "
    "join mysql://shop/merchants as m on m.geo_hash = loc.cell where m.status = 'active' "
    "join mongo://crm/coupons as c on c.merchant_id = m.id where c.expires_at > now() "
    "select m.name, c.discount, c.code order by c.discount desc limit 10"
)


def timed(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def stats(samples: list[float]) -> tuple[float, float]:
    s = sorted(samples)
    return statistics.median(s), s[min(len(s) - 1, int(len(s) * 0.95))]


def fmt(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us:8.1f} us" if us < 1000 else f"{us / 1000:8.2f} ms"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args(argv)
    n = args.repeat
    fab = fabric.open(FIXTURES / "fabric.yaml", offline=True, watch=False, ingest=False)
    cat = fab.catalog
    rows = []
    for name, (file, session) in CASES.items():
        text = (FIXTURES / file).read_text()
        spec = load_text(text, file)[0]
        plan = build(spec, cat)  # warm the catalog views (resolved once per fabric)
        parse = timed(lambda text=text, file=file: load_text(text, file), n)
        b = timed(lambda spec=spec: build(spec, cat), n)
        o = timed(lambda plan=plan: optimize(plan, cat), n)
        cold = timed(lambda spec=spec: optimize(build(spec, cat), cat), n)
        cold_parse = timed(
            lambda text=text, file=file: optimize(build(load_text(text, file)[0], cat), cat), n
        )
        fab.binding(name).bind(session)
        cached = timed(lambda name=name, session=session: fab.binding(name).bind(session), n * 50)
        rows.append((name, len(spec.sources), parse, b, o, cold, cold_parse, cached))
    # compact text form
    session = {"user_id": 42}
    t_cold = timed(lambda: optimize(build(parse_binding_text(TEXT), cat), cat), n)
    fab.compile_text(TEXT, session)
    t_cached = timed(lambda: fab.compile_text(TEXT, session).bind(session), n * 50)
    fab.close()

    head = f"{'binding':<24}{'src':>4}  {'parse':>11}  {'build':>11}  {'optimize':>11}  {'cold':>11}  {'cold+parse':>11}  {'cached+bind':>11}"
    print(f"Binding compile times, median (p95 below), {n} runs each ({n * 50} for cached)")
    print(head)
    print("-" * len(head))
    for name, nsrc, *cols in rows:
        med = [fmt(stats(c)[0]) for c in cols]
        p95 = [fmt(stats(c)[1]) for c in cols]
        print(f"{name:<24}{nsrc:>4}  " + "  ".join(f"{m:>11}" for m in med))
        print(f"{'  p95':<24}{'':>4}  " + "  ".join(f"{p:>11}" for p in p95))
    print(
        f"{'text form (3 sources)':<24}{3:>4}  {'':>11}  {'':>11}  {'':>11}  {'':>11}  "
        f"{fmt(stats(t_cold)[0]):>11}  {fmt(stats(t_cached)[0]):>11}"
    )
    print(
        f"{'  p95':<24}{'':>4}  {'':>11}  {'':>11}  {'':>11}  {'':>11}  "
        f"{fmt(stats(t_cold)[1]):>11}  {fmt(stats(t_cached)[1]):>11}"
    )
    three = [r for r in rows if r[1] == 3]
    if three:
        cold_ms = stats(three[0][5])[0] * 1e3
        cached_us = max(stats(r[7])[0] for r in rows) * 1e6
        print()
        print(
            f"targets: cached lookup + bind < 50 us -> worst median {cached_us:.1f} us "
            f"({'met' if cached_us < 50 else 'MISSED'}); "
            f"cold compile of the 3-source binding < 5 ms -> {cold_ms:.2f} ms "
            f"({'met' if cold_ms < 5 else 'MISSED'}), with YAML parsing "
            f"{stats(three[0][6])[0] * 1e3:.2f} ms"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
