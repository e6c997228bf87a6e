"""SandboxPool: normal snippets, limits, error positions, concurrency, hostile workers."""

import json
import sys
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from fabric.sandbox import (
    SandboxError,
    SandboxLimits,
    SandboxMemoryError,
    SandboxPool,
    SandboxRuntimeError,
    SandboxTimeout,
    SandboxViolation,
)

EVIL = str(Path(__file__).parent / "sandbox_corpus" / "evil_worker.py")
FAST = SandboxLimits(cpu_seconds=1.0, wall_seconds=3.0)


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(size=2, limits=FAST) as p:
        yield p


@pytest.fixture(scope="module")
def news():
    n = 1000
    rng = np.random.default_rng(7)
    return pa.table({
        "id": pa.array(range(n), pa.int64()),
        "score": pa.array(rng.random(n)),
        "body": pa.array([f"AAPL up {i} pct; contact ceo{i}@corp.com" if i % 3 == 0 else f"MSFT flat {i}" for i in range(n)]),
        "meta": pa.array([json.dumps({"lang": "en" if i % 2 else "de", "n": i}) for i in range(n)]),
    })  # fmt: skip


def test_layers_all_active_as_root(pool):
    assert set(pool.layers) == {
        "network_namespace",
        "rlimits",
        "chroot",
        "drop_privileges",
        "seccomp",
        "restricted_python",
    }
    assert all(v == "active" for v in pool.layers.values()), pool.layers


def test_filter_and_rank_with_pyarrow_compute_and_params(pool, news):
    src = (
        "import pyarrow.compute as pc\n"
        "def run(table, k, min_score=0.0):\n"
        "    t = table.filter(pc.greater_equal(table['score'], min_score))\n"
        "    idx = pc.select_k_unstable(t, k, [('score', 'descending')])\n"
        "    return t.take(idx).select(['id', 'score'])\n"
    )
    out = pool.run(src, news, params={"k": 5, "min_score": 0.2}, binding="top")
    expected = (
        news.filter(pc.greater_equal(news["score"], 0.2))
        .sort_by([("score", "descending")])
        .slice(0, 5)
    )
    assert out.column("id").to_pylist() == expected.column("id").to_pylist()
    assert out.schema.names == ["id", "score"]


def test_numpy_re_json_entities(pool, news):
    src = (
        "import re, json\n"
        "import numpy as np\n"
        "import pyarrow as pa\n"
        "EMAIL = re.compile(r'[\\w.]+@[\\w.]+')\n"
        "def run(table, lang):\n"
        "    rows = []\n"
        "    for body, meta in zip(table['body'].to_pylist(), table['meta'].to_pylist()):\n"
        "        if json.loads(meta)['lang'] == lang:\n"
        "            rows.append(','.join(EMAIL.findall(body)))\n"
        "    z = np.asarray(table['score'])\n"
        "    return pa.table({'emails': rows, 'zmax': [float(np.max((z - z.mean()) / z.std()))] * len(rows)})\n"
    )
    out = pool.run(src, news, params={"lang": "de"}, binding="entities")
    import re

    want = [
        ",".join(re.findall(r"[\w.]+@[\w.]+", b))
        for b, m in zip(news["body"].to_pylist(), news["meta"].to_pylist())
        if json.loads(m)["lang"] == "de"
    ]
    assert out["emails"].to_pylist() == want
    z = news["score"].to_numpy()
    assert out["zmax"][0].as_py() == pytest.approx(float(np.max((z - z.mean()) / z.std())))


def test_group_by_and_record_batch_result(pool, news):
    src = (
        "import pyarrow as pa\nimport pyarrow.compute as pc\n"
        "def run(table):\n"
        "    t = table.append_column('sym', pc.utf8_slice_codeunits(table['body'], 0, 4))\n"
        "    g = t.group_by('sym').aggregate([('score', 'mean'), ('id', 'count')])\n"
        "    return g.sort_by('sym').to_batches()[0]\n"
    )
    out = pool.run(src, news, binding="agg")
    assert out["sym"].to_pylist() == ["AAPL", "MSFT"]
    assert out["id_count"].to_pylist() == [334, 666]


def test_runtime_error_names_binding_and_file_line(pool, news):
    src = "def run(table):\n    x = 1\n    return table['nope']\n"
    with pytest.raises(SandboxRuntimeError) as ei:
        pool.run(src, news, binding="market_open_news", snippet_origin=("agents/news.yaml", 14, 7))
    err = ei.value
    assert err.binding == "market_open_news"
    assert (err.span.file, err.span.line, err.span.col) == ("agents/news.yaml", 16, 11)
    assert str(err).startswith(
        "agents/news.yaml:16:11: pushdown python of binding 'market_open_news'"
    )
    assert "return table['nope']" in str(err)


def test_timeout_reports_the_running_line(pool, news):
    src = "def run(table):\n    n = 0\n    while True:\n        n += 1\n"
    with pytest.raises(SandboxTimeout) as ei:
        pool.run(
            src,
            news,
            binding="spin",
            snippet_origin=("agents/spin.yaml", 5, 3),
            # CPU fires first, even on a busy machine (an operator ceiling of 60 s wall)
            limits=SandboxLimits(cpu_seconds=1, wall_seconds=60),
            ceiling=SandboxLimits(cpu_seconds=1, wall_seconds=60),
        )
    assert ei.value.span.line in (7, 8)  # the loop line or its body
    assert "CPU-time" in str(ei.value)
    assert pool.run("def run(t):\n    return t\n", news, binding="ok").num_rows == news.num_rows


def test_wall_clock_limit_when_cpu_limit_is_loose(pool, news):
    src = "def run(table):\n    while True:\n        pass\n"
    with pytest.raises(SandboxTimeout, match="wall-clock"):
        pool.run(src, news, binding="slow", limits=SandboxLimits(cpu_seconds=30, wall_seconds=0.5))


def test_per_binding_memory_limit_cannot_exceed_the_pool(pool, news, caplog):
    """The pool's limits are ceilings: asking for more runs at the ceiling, with a warning."""
    src = "def run(t):\n    x = bytearray(FAST_MEMORY + (64 << 20))\n    return t\n"
    src = src.replace("FAST_MEMORY", str(FAST.memory_bytes))
    with pytest.raises(SandboxMemoryError):
        pool.run(src, news, binding="big", limits=SandboxLimits(memory_bytes=FAST.memory_bytes * 2))
    assert "binding 'big' asks for sandbox limit memory_bytes" in caplog.text
    assert "above the operator's ceiling" in caplog.text


def test_limits_overridden_rejects_unknown_keys():
    assert SandboxLimits().overridden({"cpu_seconds": 1}).cpu_seconds == 1
    with pytest.raises(ValueError, match="unknown sandbox limit"):
        SandboxLimits().overridden({"cpu": 1})


def test_input_is_not_modified_and_zero_rows_work(pool, news):
    src = "import pyarrow.compute as pc\ndef run(table):\n    return table.filter(pc.less(table['id'], 0))\n"
    out = pool.run(src, news, binding="empty")
    assert out.num_rows == 0 and out.schema == news.schema


def test_eight_concurrent_calls_one_hostile(news):
    normal = "import pyarrow.compute as pc\ndef run(table, k):\n    return table.filter(pc.equal(pc.bit_wise_and(table['id'], 7), k))\n"
    hostile = "def run(table):\n    while True:\n        pass\n"
    results: dict[int, object] = {}
    with SandboxPool(size=3, limits=FAST) as p:

        def call(i):
            try:
                if i == 3:
                    results[i] = p.run(hostile, news, binding="evil")
                else:
                    results[i] = p.run(normal, news, params={"k": i % 8}, binding=f"b{i}")
            except SandboxError as exc:
                results[i] = exc

        threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert isinstance(results[3], SandboxTimeout)
    for i in (0, 1, 2, 4, 5, 6, 7):
        got = results[i]
        assert isinstance(got, pa.Table), got
        assert got["id"].to_pylist() == [x for x in range(news.num_rows) if x & 7 == i % 8]


@pytest.mark.parametrize(
    ("mode", "error", "needle"),
    [
        ("drip", SandboxTimeout, "wall-clock"),
        ("flood", SandboxViolation, "over the limit"),
        ("garbage", SandboxViolation, "malformed Arrow"),
        ("zstd", SandboxViolation, "compressed IPC buffers are not accepted"),
        ("header", SandboxViolation, "malformed reply"),
        ("die", SandboxViolation, "crashed"),
        ("silent", SandboxTimeout, "wall-clock"),
        ("dictbomb", SandboxViolation, "would decode past the output limit of 1048576 bytes"),
    ],
)
def test_compromised_worker_is_cut_off(mode, error, needle, news):
    """A worker that escaped everything still cannot hang, flood or crash the fabric."""
    limits = SandboxLimits(cpu_seconds=1, wall_seconds=1, output_bytes=1 << 20)
    with SandboxPool(size=1, limits=limits, _worker_argv=[sys.executable, EVIL, mode]) as p:
        (before,) = [w.pid for w in p._idle.queue]
        with pytest.raises(error, match=needle):
            p.run("def run(t):\n    return t\n", news, binding="victim")
        replacement = p._idle.get(timeout=30)  # started in the background
        assert replacement.pid != before and replacement.proc.poll() is None
        p._idle.put(replacement)


@pytest.mark.parametrize("transport", ["pipe", "shm"])
def test_both_transports_round_trip_and_big_inputs_fall_back_to_the_pipe(transport):
    """A table larger than the shared-memory region still goes through (by pipe)."""
    limits = SandboxLimits(cpu_seconds=2, wall_seconds=10, output_bytes=1 << 20)
    big = pa.table({"x": np.arange(400_000, dtype=np.int64)})  # ~3 MiB, region is 1 MiB
    src = "import pyarrow.compute as pc\ndef run(table):\n    return table.filter(pc.less(table['x'], 1000))\n"
    with SandboxPool(size=1, limits=limits, transport=transport) as p:
        assert p.run(src, big, binding="big")["x"].to_pylist() == list(range(1000))
        small = big.slice(0, 5000)
        assert p.run("def run(t):\n    return t\n", small, binding="echo").equals(small)
        with pytest.raises(SandboxViolation, match="over the output limit"):
            p.run("def run(t):\n    return t\n", big, binding="echo_big")


def test_one_snippet_cannot_poison_library_state_for_the_next():
    """Workers are shared between bindings: patched classes are violations, settings reset."""
    t = pa.table({"w": ["a", "b", "b"]})
    count = (
        "import collections\nimport pyarrow as pa\n"
        "def run(table):\n"
        "    top = collections.Counter(table['w'].to_pylist()).most_common(1)[0][0]\n"
        "    return pa.table({'top': [top]})\n"
    )
    with SandboxPool(size=1, limits=FAST) as p:
        patch = (
            "import collections\n"
            "def run(table):\n"
            "    C = collections.Counter\n"
            "    C.most_common = lambda self, n=None: [('evil', 1)]\n"
            "    return table\n"
        )
        with pytest.raises(
            SandboxViolation, match=r"modified shared library state \(collections.Counter\)"
        ):
            p.run(patch, t, binding="poison")
        assert p.run(count, t, binding="victim")["top"].to_pylist() == ["b"]
        with pytest.raises(SandboxViolation, match=r"numpy\.sctypeDict"):
            p.run(
                "import numpy as np\ndef run(table):\n    np.sctypeDict['float64'] = np.int8\n    return table\n",
                t,
                binding="poison2",
            )
        divide = "import decimal\nimport pyarrow as pa\ndef run(table, prec=None):\n    if prec:\n        decimal.getcontext().prec = prec\n    return pa.table({'x': [str(decimal.Decimal(1) / decimal.Decimal(7))]})\n"
        assert p.run(divide, t, params={"prec": 2}, binding="p2")["x"][0].as_py() == "0.14"
        assert p.run(divide, t, binding="p28")["x"][0].as_py() == "0.1428571428571428571428571429"
        np_err = "import numpy as np\nimport pyarrow as pa\ndef run(table, set_raise=False):\n    if set_raise:\n        np.seterr(all='raise')\n    return pa.table({'x': [float(np.float64(1) / np.float64(0))]})\n"
        with pytest.raises(SandboxRuntimeError, match="FloatingPointError"):
            p.run(np_err, t, params={"set_raise": True}, binding="raise")
        assert p.run(np_err, t, binding="after")["x"][0].as_py() == float("inf")


def test_pool_from_fabric_config_narrows_the_allowlist_and_sets_limits():
    from fabric.config import SandboxConfig

    cfg = SandboxConfig(cpu_seconds=1, wall_seconds=3, memory_mb=256, output_mb=8, allowed_imports=("re", "json", "hashlib"), workers=1)  # fmt: skip
    t = pa.table({"s": ["a1", "b22"]})
    with SandboxPool.from_config(cfg) as p:
        assert p.limits == SandboxLimits(cpu_seconds=1, wall_seconds=3, memory_bytes=256 << 20, output_bytes=8 << 20)  # fmt: skip
        src = "import re, hashlib\nimport pyarrow as pa\ndef run(table):\n    return pa.table({'h': [hashlib.sha1(s.encode()).hexdigest()[:6] + re.sub('[a-z]', '', s) for s in table['s'].to_pylist()]})\n"
        with pytest.raises(SandboxViolation, match="import of 'pyarrow' is not allowed"):
            p.run(src, t, binding="h")
    with SandboxPool(size=1, allowed_modules=["re", "hashlib", "pyarrow"]) as p:
        import hashlib

        assert p.run(src, t, binding="h")["h"].to_pylist() == [hashlib.sha1(b"a1").hexdigest()[:6] + "1", hashlib.sha1(b"b22").hexdigest()[:6] + "22"]  # fmt: skip
    with pytest.raises(ValueError, match="os cannot be allowed"):
        SandboxPool(size=1, allowed_modules=["re", "os"])


def test_limits_from_binding_settings():
    from dsl.spec import SandboxLimits as SpecLimits

    base = SandboxLimits()
    got = SandboxLimits.from_settings(SpecLimits(cpu_seconds=0.5, memory_mb=64), base)
    assert got == SandboxLimits(cpu_seconds=0.5, memory_bytes=64 << 20)
    assert SandboxLimits.from_settings(SpecLimits(), base) is base


def test_a_seeded_global_rng_is_not_inherited_by_the_next_call():
    t = pa.table({"a": [1]})
    draw = "import numpy as np\nimport pyarrow as pa\ndef run(table, seed=None):\n    if seed is not None:\n        np.random.seed(seed)\n        np.random.random(5)\n    return pa.table({'x': [float(np.random.random())]})\n"
    with SandboxPool(size=1, limits=FAST) as p:
        first = p.run(draw, t, params={"seed": 42}, binding="seeder")["x"][0].as_py()
        np.random.seed(42)
        np.random.random(5)
        assert first == float(np.random.random())  # seeding works inside a call
        predicted = float(np.random.random())  # what the next draw would be without a reseed
        assert p.run(draw, t, binding="victim")["x"][0].as_py() != predicted
