"""The REST/HTTP JSON connector (connectors/rest.py) against a real local HTTP server.

The conformance suite runs over the 200 merchants served by ``tests.rest_api``; the
other tests provoke paging of every kind, transient failures (503, 429 with
Retry-After), exhausted retries, a deadline shorter than Retry-After, auth from ``${ENV}``
with the token masked, a next link to another host, and a whole binding through
``fabric.open`` (pushed filters, a filter the API cannot take applied by the fabric).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import fabric
from connectors.base import Pushdown, ScanRequest, Source, SourceError
from connectors.rest import RestConfigError, RestConnection
from dsl.ast import Binary, Column, InList, Like, Literal, Param
from tests.connectors import data
from tests.connectors.conformance import ConnectorConformance, fabric_scan
from tests.rest_api import ENDPOINT, MerchantsAPI, running

TOKEN = "s3cr3t-marker-rest-token"


@pytest.fixture(scope="module")
def api() -> Iterator[MerchantsAPI]:
    with running(token=TOKEN) as a:
        yield a


def connect(api: MerchantsAPI, **extra: Any) -> RestConnection:
    endpoints = extra.pop("endpoints", None) or {"merchants": ENDPOINT}
    opts = {
        "kind": "rest",
        "base_url": api.url,
        "headers": {"Authorization": f"Bearer {TOKEN}"},
        "retries": {"max": 3, "base": 0.01, "max_delay": 0.05},
        "endpoints": endpoints,
        **extra,
    }
    return RestConnection("crm", opts)


def open_source(conn: RestConnection, obj: str = "merchants") -> Source:
    return conn.source(obj, {"schema": data.SCHEMA})


_UNDOCUMENTED = "the API documents no query parameter for it; the fabric applies it"


class TestRestConformance(ConnectorConformance):
    unsupported = dict.fromkeys(
        [
            "not_between",
            "not_in",
            "like",
            "not_like",
            "ilike",
            "like_param_underscore",
            "is_null",
            "is_not_null",
            "and_or",
            "not",
            "not_or",
            "timestamp_now",
            "eq_null_param",
            "string_range",
            "arithmetic",
            "lower",
            "keyword_match",
        ],
        _UNDOCUMENTED,
    )

    @pytest.fixture
    def source(self, api: MerchantsAPI) -> Source:
        return open_source(connect(api))


# ------------------------------------------------------------------ paging


@pytest.mark.parametrize(
    "endpoint",
    [
        {
            "path": "/v1/offset",
            "records": "data",
            "paging": {"kind": "offset", "param": "offset", "size_param": "limit", "size": 33},
        },
        {
            "path": "/v1/cursor",
            "records": "items",
            "paging": {"kind": "cursor", "param": "cursor", "next": "next"},
        },
        {"path": "/v1/link", "records": "data", "paging": {"kind": "link"}},
        {"path": "/v1/bare"},
    ],
    ids=["offset", "cursor", "link", "none"],
)
def test_every_paging_kind_reads_every_row(api: MerchantsAPI, endpoint: dict) -> None:
    src = open_source(
        connect(api, endpoints={"merchants": {**endpoint, "filters": ENDPOINT["filters"]}})
    )
    before = len(api.requests())
    out, _, _ = fabric_scan(src, [], columns=["id"])
    assert sorted(out.column("id").to_pylist()) == list(range(1, data.N + 1))
    pages = len(api.requests()) - before
    assert pages > 1 or endpoint["path"] == "/v1/bare"
    # with a pushed filter the pages carry it (Paris: 40 rows)
    out, answers, raw = fabric_scan(
        src, [Binary("=", Column("city"), Param("c"))], {"c": "Paris"}, columns=["id"]
    )
    assert answers == [Pushdown.EXACT] and raw.num_rows == 40


def test_pushed_limit_stops_paging(api: MerchantsAPI) -> None:
    src = open_source(connect(api))
    before = len(api.requests())
    out = list(src.scan(ScanRequest(columns=("id",), limit=7)))
    assert sum(b.num_rows for b in out) == 7
    assert len(api.requests()) - before == 1  # one page of 50 was enough


def test_next_link_to_another_host_is_not_followed(api: MerchantsAPI) -> None:
    src = open_source(
        connect(
            api,
            endpoints={
                "merchants": {"path": "/v1/link", "records": "data", "paging": {"kind": "link"}}
            },
        )
    )
    api.other_origin = "http://127.0.0.2:9"
    try:
        with pytest.raises(SourceError, match=r"leaves .* not followed"):
            list(src.scan(ScanRequest(columns=("id",))))
    finally:
        api.other_origin = None


def test_unsupported_filter_is_applied_by_the_fabric_never_dropped(api: MerchantsAPI) -> None:
    src = open_source(connect(api))
    f = [
        Binary("=", Column("city"), Literal("Berlin", "str")),
        Like(Column("name"), Literal("merchant%", "str")),
    ]
    out, answers, raw = fabric_scan(src, f, columns=["id"])
    assert answers == [Pushdown.EXACT, Pushdown.UNSUPPORTED]
    assert raw.num_rows == 40  # the API applied city ...
    want = sorted(
        r["id"] for r in data.rows() if r["city"] == "Berlin" and r["name"].startswith("merchant")
    )
    assert sorted(out.column("id").to_pylist()) == want  # ... and the fabric the like


def test_a_filter_given_to_scan_unoffered_is_still_applied(api: MerchantsAPI) -> None:
    """A scan asked for filters the endpoint cannot take applies them itself (fail closed)."""
    src = open_source(connect(api))
    f = (InList(Column("status"), (Literal("active", "str"),), negated=True),)
    got = [
        r["id"] for b in src.scan(ScanRequest(columns=("id",), filters=f)) for r in b.to_pylist()
    ]
    want = [r["id"] for r in data.rows() if r["status"] is not None and r["status"] != "active"]
    assert sorted(got) == want


# ------------------------------------------------------------------ retries and rate limits


def test_transient_503_is_retried_and_counted(api: MerchantsAPI) -> None:
    src = open_source(connect(api))
    api.faults[:] = [(503, None), (502, None)]
    req = ScanRequest(
        columns=("id",), filters=(Binary("=", Column("city"), Literal("lyon", "str")),)
    )
    rows = sum(b.num_rows for b in src.scan(req))
    assert rows == 40
    assert req.metrics.retries == 2 and req.metrics.as_dict()["statuses"] == {
        "200": 1,
        "502": 1,
        "503": 1,
    }


def test_429_retry_after_is_honoured(api: MerchantsAPI) -> None:
    src = open_source(connect(api))
    api.faults[:] = [(429, 0.6)]
    before = len(api.requests())
    req = ScanRequest(
        columns=("id",), filters=(Binary("=", Column("city"), Literal("lyon", "str")),)
    )
    assert sum(b.num_rows for b in src.scan(req)) == 40
    times = [t for t, _ in api.requests()[before:]]
    assert len(times) == 2 and times[1] - times[0] >= 0.59  # measured at the server
    assert req.metrics.as_dict()["backoff_wait_ms"] >= 600


def test_retries_exhausted_is_a_retriable_source_error(api: MerchantsAPI) -> None:
    src = open_source(connect(api))
    api.faults[:] = [(503, None)] * 4
    with pytest.raises(SourceError, match=r"HTTP 503 .*after 3 retries") as ei:
        list(src.scan(ScanRequest(columns=("id",))))
    assert ei.value.retriable
    api.faults.clear()


def test_retry_after_beyond_the_deadline_fails_at_once(api: MerchantsAPI) -> None:
    src = open_source(connect(api))
    api.faults[:] = [(429, 30)]
    before = len(api.requests())
    with pytest.raises(
        SourceError, match=r"Retry-After 30 s\) would end after the query's deadline"
    ) as ei:
        list(src.scan(ScanRequest(columns=("id",), timeout=2.0)))
    assert len(api.requests()) - before == 1  # no retry was waited for
    assert ei.value.retriable
    api.faults.clear()


def test_rate_limit_holds_under_8_concurrent_callers(api: MerchantsAPI) -> None:
    """8 threads scan as fast as they can through one connection limited to 10 requests/s
    (burst 2): the server sees at most burst + rate * window requests in any window."""
    import threading

    conn = connect(api, rate_limit={"per_second": 10, "burst": 2})
    src = open_source(conn)
    req_filter = (Binary("=", Column("city"), Literal("lyon", "str")),)
    before = len(api.requests())

    def caller() -> None:
        for _ in range(3):
            assert (
                sum(b.num_rows for b in src.scan(ScanRequest(columns=("id",), filters=req_filter)))
                == 40
            )

    threads = [threading.Thread(target=caller) for _ in range(8)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    times = sorted(t for t, _ in api.requests()[before:])
    assert len(times) == 24
    # 24 requests at 10/s after a burst of 2: at least 2.2 s
    assert elapsed >= 2.1, elapsed
    for i, t in enumerate(times):  # any window of 1 s holds at most 2 + 10 requests
        in_window = sum(1 for u in times[i:] if u - t < 1.0)
        assert in_window <= 12, (in_window, times)
    rate = (len(times) - 2) / (times[-1] - times[0])
    assert rate <= 10.5, rate


def test_bad_rate_limit_option_is_named() -> None:
    with pytest.raises(RestConfigError, match=r"connection 'crm': rate_limit needs per_second"):
        RestConnection(
            "crm", {"kind": "rest", "base_url": "http://127.0.0.1:1", "rate_limit": {"burst": 3}}
        )
    with pytest.raises(RestConfigError, match=r"endpoints.m.paging.kind is 'pages'"):
        RestConnection(
            "crm",
            {
                "kind": "rest",
                "base_url": "http://127.0.0.1:1",
                "endpoints": {"m": {"path": "/m", "paging": {"kind": "pages"}}},
            },
        )


# ------------------------------------------------------------------ auth and masking


def test_wrong_token_is_a_401_whose_echo_is_masked(api: MerchantsAPI) -> None:
    wrong = "Bearer wrong-token-0123456789"
    conn = RestConnection(
        "crm2",
        {
            "kind": "rest",
            "base_url": api.url,
            "headers": {"Authorization": wrong},
            "endpoints": {"merchants": ENDPOINT},
        },
    )
    with pytest.raises(SourceError) as ei:
        list(open_source(conn).scan(ScanRequest(columns=("id",))))
    text = str(ei.value)
    assert "HTTP 401" in text and "auth" in text  # the hint names the headers / auth
    assert "wrong-token-0123456789" not in text and "***" in text


CONFIG = """\
connections:
  crm:
    kind: rest
    base_url: "{url}"
    headers: {{Authorization: "Bearer ${{CRM_TOKEN}}"}}
    rate_limit: {{per_second: 50, burst: 5}}
    retries: {{max: 2, base: 0.01}}
    endpoints:
      merchants:
        path: /v1/merchants
        records: data
        total: meta.total
        paging: {{kind: page, param: page, size_param: per_page, size: 50}}
        filters:
          city: {{"=": city, in: city}}
          score: {{">=": score_ge}}
    schemas:
      merchants: {{id: int, name: str, status: str, rating: float, score: int, created_at: timestamp, city: str}}
bindings: [agents/]
"""

BINDING = """\
binding: near
session: {city: str, min: int}
sources:
  m:
    from: rest://crm/merchants
    where: m.city = {{session.city}} and m.score >= {{session.min}} and m.name like 'Merchant 1%'
select: [m.id, m.score]
order_by: [m.id]
"""


def test_binding_over_rest_with_env_token(
    api: MerchantsAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CRM_TOKEN", TOKEN)
    (tmp_path / "agents").mkdir()
    (tmp_path / "fabric.yaml").write_text(CONFIG.format(url=api.url))
    (tmp_path / "agents" / "near.yaml").write_text(BINDING)
    with fabric.open(tmp_path / "fabric.yaml", watch=False, ingest=False) as fab:
        res = fab.query("near", {"city": "Paris", "min": 30})
        want = [
            r["id"]
            for r in data.rows()
            if r["city"] == "Paris"
            and r["score"] is not None
            and r["score"] >= 30
            and r["name"].startswith("Merchant 1")
        ]
        assert res.table.column("id").to_pylist() == want
        n = len(api.requests())
        res = fab.query("near", {"city": "Paris", "min": 30})
        # one page (40 rows < 50): one request; the freshness check reuses its Last-Modified
        assert len(api.requests()) - n == 1, api.requests()[n:]
        assert res.freshness["m"]["status"] == "fresh"  # an old Last-Modified is not lag
        src = res.stats["sources"]["m"]
        assert len(src["exact"]) == 2 and "city" in " ".join(src["exact"]), src
        assert "score" in " ".join(src["exact"]), src
        assert src["residual"], src  # the like is the fabric's
        assert src["source"]["requests"] >= 1
        text = fab.explain("near", {"city": "Paris", "min": 30}, analyze=True)
        assert "requests=" in text and "retries=0" in text, text
    assert TOKEN not in text


def test_a_limit_with_a_filter_applied_here_reads_on(api: MerchantsAPI) -> None:
    """A limit counts the rows kept after the filters the connector applies itself, not
    the records the API sent (the first page of 50 holds 8 'pending' rows)."""
    src = open_source(connect(api))
    others = ("active", "inactive", "ACTIVE", "active ")
    f = (InList(Column("status"), tuple(Literal(s, "str") for s in others), negated=True),)
    got = [
        r["id"]
        for b in src.scan(ScanRequest(columns=("id",), filters=f, limit=12))
        for r in b.to_pylist()
    ]
    want = [r["id"] for r in data.rows() if r["status"] == "pending"]
    assert got == want[:12]
