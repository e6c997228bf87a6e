"""Indexed datasets sharded across Ray actors.

``ShardedDataset(cluster, name, schema, key, indexes, shards=N, state_dir=..., kafka=...)``
runs N ``ShardActor`` actors, each holding its own ``indexes.dataset.Dataset`` (with its
own HNSW / B-tree / inverted indexes and statistics):

- **Sharding by key hash.** Fed from Kafka, shard ``i`` owns the partitions
  ``p % N == i``: the producer's partitioner already hashed each key to one partition,
  so every key lives in exactly one shard. Each shard runs one consumer for its
  partitions, all in one consumer group (``<prefix>.<dataset>``), with the existing
  checkpoint scheme in ``<state_dir>/shard-<i>`` (a snapshot plus the offsets it holds,
  written atomically; fabric.ingest.checkpoint). Filled by ``upsert``, rows go to shard
  ``crc32(key) % N``.
- **Restart from the checkpoint.** The actors are created with ``max_restarts=-1``: a
  shard process that dies is started again by Ray, loads its newest checkpoint and
  resumes its partitions at the checkpoint's offsets, so nothing is lost; upserts by key
  make a replayed message land on the same row, so nothing is doubled.
- **Scatter / gather top-k.** ``search`` sends the query to every shard at once (one
  actor call each), each shard plans its own retrieval (its cost model, its statistics)
  and returns its k best with ``_distance``; the driver keeps the k smallest distances
  (ties by key). ``last_shard_ms`` has each shard's own time.
- **Freshness aggregated.** ``freshness()`` is fresh only if every shard is caught up
  and within ``max_lag`` messages; the lag is the sum over shards.

Actors ask for no CPU (``num_cpus=0``): they mostly wait on the broker and on queries,
and must not hold the CPUs the scan tasks need.
"""

from __future__ import annotations

import contextlib
import copy
import time
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from connectors.dataset import DatasetSource
from fabric.datasets import Refresher

__all__ = [
    "ShardActor",
    "ShardedDataset",
    "ShardedExplain",
    "ShardedRefresher",
    "ShardedSource",
    "aggregate_freshness",
    "merge_statistics",
    "open_sharded",
    "sharded_freshness",
]


class ShardActor:
    """One shard (runs in its own Ray actor process)."""

    def __init__(
        self,
        name: str,
        shard: int,
        schema: pa.Schema,
        key: str,
        indexes: Mapping[str, Any],
        state_dir: str,
        kafka: Mapping[str, Any] | None = None,
        embed: Sequence[Any] = (),
        retention: tuple[float, str] | None = None,
    ):
        import os
        import threading

        from fabric import embed as embedding
        from fabric.ingest import checkpoint
        from indexes.dataset import Dataset

        self.name, self.shard = name, shard
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        loaded = checkpoint.load(self.state_dir, lambda c: Dataset.load(str(c.dataset_dir)))
        ck = loaded.checkpoint
        self.dataset = (
            loaded.value
            if loaded.value is not None
            else Dataset.create(f"{name}#{shard}", schema, key, indexes)
        )
        # embed: (fabric.embed) computed in this shard, in batches, as its rows arrive
        # (its Kafka feed or its part of an upsert), the same filler a local dataset has
        self.dataset.computed = embedding.filler(embed, schema)
        self.resumed = {int(p): int(o) for p, o in (ck.offsets if ck else {}).items()}
        self.meta = dict(ck.meta) if ck else {}  # a refreshed one's watermark and cursor
        # retention: (seconds, time column): this shard expires its own rows on a timer
        self.retention = retention
        self._stop_expiring = threading.Event()
        if retention is not None:
            threading.Thread(target=self._expire_loop, name="shard-retention", daemon=True).start()
        self.loaded_rows = self.dataset.count()
        self.started_at = time.time()
        self.pid = os.getpid()
        self.ingestor: Any = None
        self._last: tuple[pa.Table, Any] | None = None  # the last search's answer (ping)
        self.kafka = kafka
        if kafka is not None:
            from connectors.base import open_connection
            from fabric.ingest.kafka import IngestOptions, KafkaIngestor

            # the fabric's connection, opened here from its name and options, makes this
            # shard's clients: security: (SASL/TLS) and config: as for a local consumer
            conn = kafka.get("connection")
            connection = None if conn is None else open_connection(conn[0], dict(conn[1]))
            opts = IngestOptions(
                bootstrap=kafka["bootstrap"],
                connection=connection,
                topic=kafka["topic"],
                group_id=kafka["group_id"],
                partitions=tuple(kafka["partitions"]),
                checkpoint_interval=float(kafka.get("checkpoint_interval", 10.0)),
                batch_size=int(kafka.get("batch_size", 5000)),
                max_message_bytes=int(kafka.get("max_message_bytes", 1 << 20)),
                # "none", "topic" (<topic>.dlq, shared by the shards) or "log": JSON lines
                # in the shard's own state directory (dead-letters.jsonl)
                dead_letter=_dead_letter(kafka.get("dead_letter", "none"), self.state_dir),
            )
            self.ingestor = KafkaIngestor(
                f"{name}#{shard}",
                self.dataset,
                opts,
                state_dir=self.state_dir,
                start_offsets=self.resumed,
                resume=dict(ck.meta) if ck else None,
            ).start()

    def consumer_config(self) -> dict[str, Any]:
        """The librdkafka settings this shard's consumer is made with (its connection's
        ``client_config`` of the ingestor's role), without the Python callbacks."""
        if self.ingestor is None:
            return {}
        ing = self.ingestor
        cfg = ing.options.connection.client_config(ing._consumer_config())
        return {k: v for k, v in cfg.items() if not callable(v) and k != "logger"}

    def expire(self, now: Any = None) -> int:
        """``retention:`` on this shard's rows now (fabric.datasets.expire_rows)."""
        from fabric.datasets import expire_rows

        if self.retention is None:
            return 0
        return expire_rows(self.dataset, self.retention[1], self.retention[0], now)

    def _expire_loop(self) -> None:
        from fabric.datasets import RETENTION_INTERVAL

        while not self._stop_expiring.wait(RETENTION_INTERVAL):
            with contextlib.suppress(Exception):  # the next pass deletes what this did not
                self.expire()

    def ingest_stats(self) -> dict[str, Any]:
        """The shard's ingestor counters (fabric.ingest.kafka.IngestStats)."""
        if self.ingestor is None:
            return {}
        return dict(vars(self.ingestor.stats))

    def info(self) -> dict[str, Any]:
        return {
            "shard": self.shard,
            "pid": self.pid,
            "rows": self.dataset.count(),
            "loaded_rows": self.loaded_rows,
            "resumed_offsets": self.resumed,
            "partitions": list(self.ingestor.partitions) if self.ingestor else [],
            "meta": self.meta,
        }

    def save(self, meta: Mapping[str, Any]) -> str:
        """Checkpoint this shard's rows with ``meta`` (a dataset refreshed from a table,
        collection or file: the refresh's watermark and cursor; fabric.datasets.Refresher)
        in the shard's state directory, the scheme a Kafka-fed shard uses."""
        from fabric.ingest import checkpoint

        self.meta = {"dataset": f"{self.name}#{self.shard}", **meta}
        return str(checkpoint.write(self.state_dir, self.dataset.save, {}, self.meta).path)

    def upsert(self, table: pa.Table) -> int:
        return self.dataset.upsert(table)

    def delete(self, keys: Sequence[Any]) -> int:
        return self.dataset.delete(keys)

    def ping(self, *args: Any, busy_ms: float = 0.0) -> tuple[Any, float, Any]:
        """A search's call without the search (benchmarks/scale.py): the same arguments
        in, ``busy_ms`` of CPU, and the previous search's answer out (same size)."""
        t0 = time.perf_counter()
        while (time.perf_counter() - t0) * 1000 < busy_ms:
            pass
        table, info = self._last if self._last is not None else (None, None)
        return table, (time.perf_counter() - t0) * 1000, info

    def count(self) -> int:
        return self.dataset.count()

    def flush(self) -> int:
        """Fold the growing segments into the HNSW graphs now; the rows held."""
        self.dataset.flush()
        return self.dataset.count()

    def nbytes(self) -> int:
        return sum(self.dataset.nbytes().values())

    def keys(self) -> list[Any]:
        return self.dataset.to_table([self.dataset.key]).column(0).to_pylist()

    def search(
        self,
        column: str,
        query: Any,
        k: int,
        where: Any = None,
        params: Mapping[str, Any] | None = None,
        columns: Sequence[str] | None = None,
        strategy: str | None = None,
        guards: bool = True,
    ) -> tuple[pa.Table, float, Any]:
        """This shard's k best, its own time (ms) and its retrieval explain."""
        t0 = time.perf_counter()
        table, info = self.dataset.search(
            column, query, k, where, params, columns=columns, strategy=strategy, guards=guards
        )
        info = copy.copy(info)
        info.fallback = None  # the pinned values' posting matrices stay with the shard
        self._last = (table, info)
        return table, (time.perf_counter() - t0) * 1000, info

    def scan(
        self,
        where: Any = None,
        params: Mapping[str, Any] | None = None,
        columns: Sequence[str] | None = None,
        limit: int | None = None,
    ) -> pa.Table:
        return self.dataset.scan(where, params, columns, limit)

    def corpus(self, column: str, tokens: Sequence[str]) -> dict[str, Any]:
        """This shard's BM25 statistics for ``tokens`` (indexes.ranking.corpus_statistics)."""
        from indexes.ranking import corpus_statistics

        with self.dataset.lock.read():
            return corpus_statistics(self.dataset, column, tokens)

    def rank(
        self,
        vector: tuple[str, Any, int] | None,
        text: tuple[str, str, int] | None,
        where: Any,
        params: Mapping[str, Any],
        columns: Sequence[str] | None,
        corpus: Mapping[str, Any] | None,
        strategy: str | None = None,
    ) -> tuple[pa.Table | None, pa.Table | None, Any, Any, float]:
        """Each arm's k best of this shard: the vector arm's rows with ``_distance``, the
        keyword arm's with ``_bm25`` scored with the whole dataset's ``corpus``
        statistics; their explains and this shard's time (ms)."""
        from indexes.ranking import rank

        t0 = time.perf_counter()
        vt = kt = vi = ki = None
        if vector is not None:
            vt, vi = self.dataset.search(
                vector[0], vector[1], vector[2], where, params, columns=columns, strategy=strategy
            )
            vi = copy.copy(vi)
            vi.fallback = None
        if text is not None:
            kt, info = rank(
                self.dataset, text=text, where=where, params=params, columns=columns, corpus=corpus
            )
            ki = info.keyword
        return vt, kt, vi, ki, (time.perf_counter() - t0) * 1000

    def statistics(self) -> dict[str, Any]:
        return self.dataset.statistics()

    def wait_caught_up(self, timeout: float = 30.0) -> bool:
        return True if self.ingestor is None else self.ingestor.wait_caught_up(timeout)

    def freshness(self) -> dict[str, Any]:
        if self.ingestor is None:  # fed through upsert: current; a stopped feed: unknown
            fed = self.kafka is not None
            return {"shard": self.shard, "lag_messages": None if fed else 0, "caught_up": not fed}
        return {
            "shard": self.shard,
            "lag_messages": self.ingestor.lag_messages,
            "caught_up": self.ingestor.caught_up(),
        }

    def checkpoint(self) -> dict[int, int]:
        ck = self.ingestor.checkpoint() if self.ingestor is not None else None
        offsets: Mapping[int, int] = ck.offsets if ck is not None else {}
        return {int(p): int(o) for p, o in offsets.items()}

    def stop(self) -> None:
        self._stop_expiring.set()
        if self.ingestor is not None:
            self.ingestor.stop(checkpoint_now=True)
            self.ingestor = None


def _dead_letter(how: str, state_dir: Path) -> str:
    return f"log:{state_dir / 'dead-letters.jsonl'}" if how == "log" else how


def aggregate_freshness(shards: Sequence[Mapping[str, Any]], max_lag: int) -> dict[str, Any]:
    """Fresh only if every shard is caught up and within ``max_lag`` messages (an unknown
    lag is not fresh); the lag is the sum over shards."""
    lags = [s.get("lag_messages") for s in shards]
    known = all(lag is not None for lag in lags)
    fresh = known and all(
        s.get("caught_up") and (s.get("lag_messages") or 0) <= max_lag for s in shards
    )
    return {
        "status": "fresh" if fresh else "stale",
        "lag_messages": sum(lag or 0 for lag in lags) if known else None,
        "shards": [dict(s) for s in shards],
    }


def merge_statistics(shards: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One dataset's statistics from its shards' (``indexes.dataset.Dataset.statistics``)."""
    out: dict[str, Any] = {
        "rows": sum(s["rows"] for s in shards),
        "stored_rows": sum(s.get("stored_rows", s["rows"]) for s in shards),
        "indexes": {},
        "shards": [dict(s) for s in shards],
    }
    for c, first in shards[0]["indexes"].items():
        each = [s["indexes"][c] for s in shards]
        if first["kind"] == "btree":
            lo = [e["min"] for e in each if e["min"] is not None]
            hi = [e["max"] for e in each if e["max"] is not None]
            out["indexes"][c] = {
                "kind": "btree",
                "rows": sum(e["rows"] for e in each),
                "nulls": sum(e["nulls"] for e in each),
                "min": min(lo) if lo else None,
                "max": max(hi) if hi else None,
            }
        elif first["kind"] == "inverted":  # terms of shards overlap: the largest is a bound
            out["indexes"][c] = {"kind": "inverted", "terms": max(e["terms"] for e in each)}
        else:
            out["indexes"][c] = {
                **first,
                "in_graph": sum(e["in_graph"] for e in each),
                "growing": sum(e["growing"] for e in each),
            }
    return out


GUARANTEE_ORDER = ("exact", "graph")


class ShardedExplain:
    """What a scatter/gather search did: the shards' explains and times, summed up as
    one ``RetrievalExplain`` reads (``executed`` the strategy every shard ran, else
    ``mixed: ...``; ``guarantee`` the weakest of any shard: exact only if every shard's
    answer was exact)."""

    def __init__(self, shards: list[Any], shard_ms: list[float], elapsed_ms: float):
        self.shards = shards
        self.shard_ms = shard_ms
        self.elapsed_ms = elapsed_ms
        first = shards[0]
        self.column, self.k = first.column, first.k
        self.rows = sum(i.rows for i in shards)
        self.filter = first.filter
        cands = [i.candidates for i in shards]
        self.candidates = None if any(c is None for c in cands) else sum(cands)
        self.candidates_exact = all(i.candidates_exact for i in shards)
        self.chosen = _one_or_mixed([i.chosen for i in shards])
        self.executed = _one_or_mixed([i.executed for i in shards])
        self.forced = all(i.forced for i in shards)
        guards = [i.guard for i in shards if i.guard]
        self.guard = "; ".join(f"shard {n}: {g}" for n, g in enumerate(guards)) or None
        self.guarantee = _weakest([i.guarantee for i in shards])
        self.actual_rows = 0
        self.plan_ms = max(i.plan_ms for i in shards)

    @classmethod
    def of(cls, shards: list[Any], shard_ms: list[float], elapsed_ms: float) -> ShardedExplain:
        return cls(shards, shard_ms, elapsed_ms)

    def lines(self) -> list[str]:
        out = [
            f"ShardedRetrieval: nearest({self.column}) k={self.k} over {self.rows} rows "
            f"in {len(self.shards)} shards ({self.elapsed_ms:.2f} ms; guarantee {self.guarantee})"
        ]
        for n, (i, ms) in enumerate(zip(self.shards, self.shard_ms, strict=True)):
            out.append(f"  shard {n} ({ms:.2f} ms):")
            out += ["    " + ln for ln in i.lines()]
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _one_or_mixed(values: list[str]) -> str:
    seen = list(dict.fromkeys(values))
    return seen[0] if len(seen) == 1 else "mixed: " + ", ".join(seen)


def _weakest(guarantees: list[str]) -> str:
    """exact < graph < unverified: the answer is only as good as its weakest shard's."""
    for g in guarantees:
        if g not in GUARANTEE_ORDER:
            return g
    return "graph" if "graph" in guarantees else "exact"


def _top(tables: Sequence[pa.Table | None], by: str, ascending: bool, key: str, k: int) -> pa.Table:
    """The k best rows of the shards' answers by ``by`` (ties by key)."""
    have = [t for t in tables if t is not None]
    merged = pa.concat_tables([t for t in have if t.num_rows] or have[:1])
    order = pc.sort_indices(
        merged,
        sort_keys=[(by, "ascending" if ascending else "descending"), (key, "ascending")],
    )
    return merged.take(order[:k])


def _fuse(
    v_top: pa.Table | None,
    k_top: pa.Table | None,
    fusion: Any,
    params: Mapping[str, Any],
    key: str,
    want: list[str],
    vector: Any,
    text: Any,
) -> pa.Table:
    """RRF of the merged arms (``indexes.ranking.rank``'s fusion, on keys): the rows
    ``want`` plus ``_distance``, ``_bm25`` and ``_score``, best first."""
    import datetime as dt

    from indexes.ranking import NOW_PARAM, decay_of, rrf

    arms = [t for t in (v_top, k_top) if t is not None]
    keys = sorted({k for t in arms for k in t.column(key).to_pylist()})
    code = {k: i for i, k in enumerate(keys)}  # ties by key, as row ids tie locally
    ranked = [np.array([code[k] for k in t.column(key).to_pylist()], np.int64) for t in arms]
    ids, score = rrf(ranked, fusion.rrf_k)
    rows = pa.concat_tables(
        [
            t.select(
                list(dict.fromkeys([*want, key, *([fusion.recency] if fusion.recency else [])]))
            )
            for t in arms
        ]
    )
    first: dict[int, int] = {}
    for i, k in enumerate(rows.column(key).to_pylist()):
        first.setdefault(code[k], i)
    take = pa.array([first[int(c)] for c in ids], pa.int64())
    picked = rows.take(take)
    if fusion.recency is not None and fusion.half_life_s and len(ids):
        now = params.get(NOW_PARAM)
        if not isinstance(now, dt.datetime):
            now = dt.datetime.now(dt.UTC)
        score = score * decay_of(
            picked.column(fusion.recency), fusion.recency, fusion.half_life_s, now
        )
        order = np.argsort(-score, kind="stable")  # ties keep the fused order
        ids, score, picked = ids[order], score[order], picked.take(pa.array(order))
    limit = fusion.limit or max(
        vector[2] if vector is not None else 0, text[2] if text is not None else 0
    )
    ids, score, picked = ids[:limit], score[:limit], picked.slice(0, limit)
    out = picked.select(want)
    for t, col, typ in ((v_top, "_distance", pa.float32()), (k_top, "_bm25", pa.float64())):
        if t is None:
            continue
        val = dict(zip(t.column(key).to_pylist(), t.column(col).to_pylist(), strict=True))
        out = out.append_column(
            pa.field(col, typ), pa.array([val.get(k) for k in picked.column(key).to_pylist()], typ)
        )
    return out.append_column(pa.field("_score", pa.float64()), pa.array(score, pa.float64()))


class ShardedRankExplain:
    """What a ranked retrieval over shards did: each shard's arms' explains and time, the
    whole dataset's corpus statistics the keyword arm scored with."""

    def __init__(
        self,
        vector: list[Any],
        keyword: list[Any],
        fusion: Any,
        shard_ms: list[float],
        corpus: Mapping[str, Any] | None,
        rows: int,
        elapsed_ms: float,
    ):
        self.vector, self.keyword, self.fusion = vector, keyword, fusion
        self.shard_ms, self.corpus = shard_ms, corpus
        self.rows, self.elapsed_ms = rows, elapsed_ms

    @property
    def executed(self) -> str:
        arms = []
        if self.vector[0] is not None:
            arms.append("vector " + _one_or_mixed([v.executed or v.chosen for v in self.vector]))
        if self.keyword[0] is not None:
            arms.append("keyword " + _one_or_mixed([k.chosen for k in self.keyword]))
        return " + ".join(arms) + (" -> rrf" if self.fusion is not None else "")

    chosen = executed

    @property
    def guarantee(self) -> str:
        gs = [v.guarantee or "" for v in self.vector if v is not None]
        gs += [k.guarantee for k in self.keyword if k is not None]
        bad = [g for g in gs if g != "exact"]
        return bad[0] if bad else "exact"

    def lines(self) -> list[str]:
        n = len(self.shard_ms)
        out = [
            f"ShardedRank: {self.executed} over {n} shards -> {self.rows} rows "
            f"({self.elapsed_ms:.2f} ms; guarantee {self.guarantee})"
        ]
        if self.corpus is not None:
            df = ", ".join(f"{t} (df {d})" for t, d in self.corpus["df"].items()) or "(none)"
            out.append(
                f"  bm25 statistics gathered from {n} shards: {self.corpus['docs']} rows, "
                f"{self.corpus['total_len']} tokens; {df}"
            )
        for i, ms in enumerate(self.shard_ms):
            out.append(f"  shard {i} ({ms:.2f} ms):")
            for arm in (self.vector[i], self.keyword[i]):
                if arm is not None:
                    out += ["    " + ln for ln in arm.lines()]
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


def shard_of(key: Any, shards: int) -> int:
    """The shard holding ``key``, from the key as ``to_pylist`` gives it (a numpy scalar
    is taken as its Python value: ``repr(np.int64(5))`` is not ``repr(5)``)."""
    if isinstance(key, np.generic):
        key = key.item()
    return zlib.crc32(repr(key).encode()) % shards


class ShardedDataset:
    """N ``ShardActor``s on the cluster, used as one dataset (see the module docstring)."""

    def __init__(
        self,
        cluster: Any,
        name: str,
        schema: pa.Schema,
        key: str,
        indexes: Mapping[str, Any],
        *,
        shards: int,
        state_dir: str | Path,
        kafka: Mapping[str, Any] | None = None,
        max_lag: int = 1000,
        embed: Sequence[Any] = (),
        retention: tuple[float, str] | None = None,
    ):
        import ray

        self.cluster, self.name, self.key, self.max_lag = cluster, name, key, max_lag
        self.schema = schema
        self.n = shards
        # the index layout (what indexes.filters.supported asks of a dataset at plan time)
        from indexes.spec import IndexSpec

        specs = {c: IndexSpec.parse(v) for c, v in indexes.items()}
        self.btrees = {c: v for c, v in specs.items() if v.kind == "btree"}
        self.inverted = {c: v for c, v in specs.items() if v.kind == "inverted"}
        self.vectors = {c: v for c, v in specs.items() if v.kind not in ("btree", "inverted")}
        actor = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(ShardActor)
        feeds: list[Mapping[str, Any] | None] = [None] * shards
        if kafka is not None:
            parts = sorted(kafka["partitions"])
            if len(parts) < shards:
                raise ValueError(
                    f"dataset {name}: {shards} shards over a topic of {len(parts)} partitions; "
                    "shards own whole partitions: use at most as many shards as partitions"
                )
            feeds = [
                {
                    **kafka,
                    "group_id": kafka.get("group_id") or f"fabric.{name}",
                    "partitions": [p for p in parts if p % shards == i],
                }
                for i in range(shards)
            ]
        self.actors: list[Any] = [
            actor.options(name=None).remote(
                name,
                i,
                schema,
                key,
                dict(indexes),
                str(Path(state_dir) / f"shard-{i}"),
                feeds[i],
                tuple(embed),
                retention,
            )
            for i in range(shards)
        ]
        self.last_shard_ms: list[float] = []
        self.fed_from_kafka = kafka is not None  # open_sharded: also when not ingested here
        self.ingesting = kafka is not None

    # ---- writes (datasets not fed from Kafka)
    def upsert(self, table: pa.Table) -> int:
        import ray

        owner = np.array([shard_of(k, self.n) for k in table.column(self.key).to_pylist()])
        refs = []
        for i, a in enumerate(self.actors):
            part = table.filter(pa.array(owner == i))
            if part.num_rows:
                refs.append(a.upsert.remote(part))
        return sum(ray.get(refs))

    def delete(self, keys: Sequence[Any]) -> int:
        """Delete rows by key, each by the shard that holds it; returns rows deleted."""
        import ray

        owner: list[list[Any]] = [[] for _ in range(self.n)]
        # routed as upsert routes: the keys as the key column's to_pylist gives them, so
        # a numpy integer or a pandas Timestamp finds the shard its row went to
        typed = pa.array(list(keys), type=self.schema.field(self.key).type).to_pylist()
        for k in typed:
            owner[shard_of(k, self.n)].append(k)
        return sum(
            ray.get([a.delete.remote(ks) for a, ks in zip(self.actors, owner, strict=True) if ks])
        )

    def expire(self, now: Any = None) -> int:
        """``retention:`` applied by every shard now (each also runs it on its own timer,
        fabric.datasets.RETENTION_INTERVAL); the rows deleted."""
        import ray

        return sum(ray.get([a.expire.remote(now) for a in self.actors]))

    def save(self, meta: Mapping[str, Any]) -> list[str]:
        """Every shard checkpoints its rows with ``meta`` (``ShardActor.save``)."""
        import ray

        return list(ray.get([a.save.remote(dict(meta)) for a in self.actors]))

    # ---- reads
    def to_table(self, columns: Sequence[str] | None = None) -> pa.Table:
        """Every shard's rows (``scan`` without a filter), as ``Dataset.to_table``."""
        return self.scan(columns=columns)

    def ping(
        self,
        column: str,
        query: Any,
        k: int,
        where: Any = None,
        params: Mapping[str, Any] | None = None,
        *,
        columns: Sequence[str] | None = None,
        busy_ms: float = 0.0,
    ) -> list[float]:
        """``search``'s scatter/gather without the search (benchmarks/scale.py): every
        shard gets the same call, keeps its CPU busy ``busy_ms`` and returns its previous
        answer, merged as a search merges them; each shard's own ms."""
        import ray

        cols = None if columns is None else list(dict.fromkeys([*columns, self.key]))
        q = np.asarray(query, dtype=np.float32)
        parts = ray.get(
            [
                a.ping.remote(column, q, k, where, params, cols, None, True, busy_ms=busy_ms)
                for a in self.actors
            ]
        )
        tables = [t for t, _, _ in parts if t is not None and t.num_rows]
        if tables:
            merged = pa.concat_tables(tables)
            keys = [("_distance", "ascending"), (self.key, "ascending")]
            merged.take(pc.sort_indices(merged, sort_keys=keys)[:k])
        return [ms for _, ms, _ in parts]

    def count(self) -> int:
        import ray

        return sum(ray.get([a.count.remote() for a in self.actors]))

    def flush(self) -> None:
        import ray

        ray.get([a.flush.remote() for a in self.actors])

    def nbytes(self) -> list[int]:
        """Memory held by each shard (rows and indexes)."""
        import ray

        return list(ray.get([a.nbytes.remote() for a in self.actors]))

    def ingest_stats(self) -> list[dict[str, Any]]:
        """Each shard's ingestor counters (applied, upserted, deleted, dead_letters, ...)."""
        import ray

        return list(ray.get([a.ingest_stats.remote() for a in self.actors]))

    def keys_per_shard(self) -> list[list[Any]]:
        import ray

        return list(ray.get([a.keys.remote() for a in self.actors]))

    def info(self) -> list[dict[str, Any]]:
        import ray

        return list(ray.get([a.info.remote() for a in self.actors]))

    def search(
        self,
        column: str,
        query: Any,
        k: int,
        where: Any = None,
        params: Mapping[str, Any] | None = None,
        *,
        columns: Sequence[str] | None = None,
        strategy: str | None = None,
    ) -> pa.Table:
        """The k nearest rows over every shard: each shard's k best, merged."""
        return self.search_explained(
            column, query, k, where, params, columns=columns, strategy=strategy
        )[0]

    def search_explained(
        self,
        column: str,
        query: Any,
        k: int,
        where: Any = None,
        params: Mapping[str, Any] | None = None,
        *,
        columns: Sequence[str] | None = None,
        strategy: str | None = None,
        guards: bool = True,
    ) -> tuple[pa.Table, ShardedExplain]:
        """``search`` and what each shard did (``ShardedExplain``: the weakest guarantee
        of any shard, each shard's own explain and time)."""
        import ray

        t0 = time.perf_counter()
        cols = None if columns is None else list(dict.fromkeys([*columns, self.key]))
        q = np.asarray(query, dtype=np.float32)
        parts = ray.get(
            [
                a.search.remote(column, q, k, where, params, cols, strategy, guards)
                for a in self.actors
            ]
        )
        self.last_shard_ms = [ms for _, ms, _ in parts]
        tables = [t for t, _, _ in parts if t.num_rows]
        if not tables:
            merged = parts[0][0]
        else:
            merged = pa.concat_tables(tables)
            order = pc.sort_indices(
                merged, sort_keys=[("_distance", "ascending"), (self.key, "ascending")]
            )
            merged = merged.take(order[:k])
        if columns is not None and self.key not in columns:
            merged = merged.select([*columns, "_distance"])
        info = ShardedExplain.of(
            [i for _, _, i in parts], self.last_shard_ms, (time.perf_counter() - t0) * 1000
        )
        info.actual_rows = merged.num_rows
        return merged, info

    def rank(
        self,
        *,
        vector: tuple[str, Any, int] | None = None,
        text: tuple[str, str, int] | None = None,
        fusion: Any = None,
        where: Any = None,
        params: Mapping[str, Any] | None = None,
        columns: Sequence[str] | None = None,
        strategy: str | None = None,
    ) -> tuple[pa.Table, ShardedRankExplain]:
        """Ranked retrieval over every shard, the answer one dataset holding every row
        gives (``indexes.ranking.rank``): BM25 in two rounds -- every shard's N, token
        lengths and document frequencies of the query's tokens are gathered and added up
        first (each row lives in one shard, so the sums are the whole dataset's), then
        every shard scores its rows with those and returns its k best; the global k best
        are among them. A vector arm is each shard's k nearest, merged. Fusion (RRF, the
        recency decay, ``limit``) runs here on the merged arms' global ranks. Ties break
        by key (a local dataset breaks them by row id, the order rows were first
        written in)."""
        import ray

        from indexes.ranking import Fusion, add_corpus, query_tokens

        t0 = time.perf_counter()
        params = dict(params or {})
        if vector is not None and text is not None and fusion is None:
            fusion = Fusion()
        corpus = None
        if text is not None:
            tokens = query_tokens(text[1]) if isinstance(text[1], str) else []
            corpus = add_corpus(ray.get([a.corpus.remote(text[0], tokens) for a in self.actors]))
        want = list(columns) if columns is not None else list(self.schema.names)
        extra = [self.key] + ([fusion.recency] if fusion is not None and fusion.recency else [])
        cols = list(dict.fromkeys([*want, *[c for c in extra if c]]))
        if vector is not None:
            vector = (vector[0], np.asarray(vector[1], dtype=np.float32), vector[2])
        parts = ray.get(
            [
                a.rank.remote(vector, text, where, params, cols, corpus, strategy)
                for a in self.actors
            ]
        )
        self.last_shard_ms = [p[4] for p in parts]
        v_top = k_top = None
        if vector is not None:
            v_top = _top([p[0] for p in parts], "_distance", True, self.key, vector[2])
        if text is not None:
            k_top = _top([p[1] for p in parts], "_bm25", False, self.key, text[2])
        if fusion is None:
            assert k_top is not None
            out = k_top.select([*want, "_bm25"]).append_column(
                pa.field("_score", pa.float64()), k_top.column("_bm25")
            )
        else:
            out = _fuse(v_top, k_top, fusion, params, self.key, want, vector, text)
        info = ShardedRankExplain(
            [p[2] for p in parts],
            [p[3] for p in parts],
            fusion,
            self.last_shard_ms,
            corpus,
            out.num_rows,
            (time.perf_counter() - t0) * 1000,
        )
        return out, info

    def scan(
        self,
        where: Any = None,
        params: Mapping[str, Any] | None = None,
        columns: Sequence[str] | None = None,
        limit: int | None = None,
    ) -> pa.Table:
        """Rows of every shard satisfying ``where``, shard by shard (shard 0's first)."""
        import ray

        parts = ray.get([a.scan.remote(where, params, columns, limit) for a in self.actors])
        out = pa.concat_tables(parts)
        return out if limit is None else out.slice(0, limit)

    def statistics(self) -> dict[str, Any]:
        """The shards' statistics added up: rows, and per B-tree the nulls, the smallest
        min and the largest max (``shards`` holds each shard's own)."""
        import ray

        return merge_statistics(ray.get([a.statistics.remote() for a in self.actors]))

    def wait_caught_up(self, timeout: float = 60.0) -> bool:
        import ray

        return all(ray.get([a.wait_caught_up.remote(timeout) for a in self.actors]))

    def freshness(self) -> dict[str, Any]:
        import ray

        return aggregate_freshness(
            ray.get([a.freshness.remote() for a in self.actors]), self.max_lag
        )

    # ---- lifecycle
    def kill_shard(self, i: int) -> None:
        """Kill shard ``i``'s process (Ray restarts it from its checkpoint)."""
        import ray

        ray.kill(self.actors[i], no_restart=False)

    def close(self) -> None:
        import ray

        for a in self.actors:
            with contextlib.suppress(Exception):  # a dead shard has nothing to stop
                ray.get(a.stop.remote(), timeout=60)
            ray.kill(a, no_restart=True)
        self.actors = []


class ShardedSource(DatasetSource):
    """A sharded dataset as a source (``dataset://<name>``, what ``DatasetSource`` is for
    a local one, whose schema, filters, statistics and scans it shares: the sharded
    dataset answers the same calls, gathering every shard's): ``search`` scatters to every
    shard and merges the global top-k. A scan's rows come shard by shard (no order is
    promised without order_by, as for a local dataset). Ranked retrieval (``search:`` /
    ``rank:``) gathers every shard's BM25 statistics first, so the scores are one
    dataset's (``ShardedDataset.rank``)."""

    dataset: Any  # a ShardedDataset

    def __init__(self, uri: str, dataset: ShardedDataset):
        super().__init__(uri, dataset)  # type: ignore[arg-type]

    def search(  # type: ignore[override]  # the sharded explain, with each shard's
        self,
        column: str,
        query: Any,
        k: int,
        filters: Sequence[Any] = (),
        params: Mapping[str, Any] | None = None,
        columns: Sequence[str] | None = None,
        analyze: bool = False,
        *,
        strategy: str | None = None,
        guards: bool = True,
    ) -> tuple[pa.Table, ShardedExplain]:
        from dsl.ast import and_all

        return self.dataset.search_explained(
            column,
            query,
            k,
            and_all(list(filters)),
            params or {},
            columns=columns,
            strategy=strategy,
            guards=guards,
        )

    def rank(  # type: ignore[override]  # the sharded explain
        self,
        *,
        vector: tuple[str, Any, int] | None = None,
        text: tuple[str, str, int] | None = None,
        fusion: tuple[int, int | None, str | None, float | None] | None = None,
        filters: Sequence[Any] = (),
        params: Mapping[str, Any] | None = None,
        columns: Sequence[str] | None = None,
    ) -> tuple[pa.Table, ShardedRankExplain]:
        """``search:`` / ``rank:`` over every shard (``ShardedDataset.rank``: BM25 with
        the whole dataset's statistics, fusion on the merged arms)."""
        from dsl.ast import and_all
        from indexes.ranking import Fusion

        return self.dataset.rank(
            vector=vector,
            text=text,
            fusion=Fusion(*fusion) if fusion is not None else None,
            where=and_all(list(filters)),
            params=params or {},
            columns=columns,
        )


class ShardedRefresher(Refresher):
    """``refresh:`` of a sharded dataset fed from a table, collection or file: the local
    ``fabric.datasets.Refresher`` (the same read of the source -- as Ray tasks when the
    scan is large --, modes, cursor and freshness) writing to the shards: each refresh's
    rows are split by key, one ``upsert`` call per shard for the whole read (and one
    ``delete`` per shard for the keys gone, mode full), and every shard checkpoints its
    rows with the refresh's watermark and cursor in its own state directory. A reopen
    resumes from the oldest shard's watermark and cursor (none at all if any shard has
    no checkpoint: then it refreshes in full), so no shard is behind what the refresher
    believes."""

    def __init__(self, manager: Any, decl: Any, sharded: ShardedDataset):
        self.sharded = sharded
        metas = [i.get("meta") or {} for i in sharded.info()]
        started = [(m.get("refresh") or {}).get("started_at") for m in metas]
        oldest: Mapping[str, Any] = {}
        times = [float(t) for t in started if t is not None]
        if len(times) == len(metas):
            oldest = metas[times.index(min(times))]
        super().__init__(manager, decl, oldest)

    @property
    def dataset(self) -> Any:
        return self.sharded

    def _checkpoint(self) -> None:
        self.sharded.save(self.checkpoint_meta())


def open_sharded(
    cluster: Any,
    decl: Any,
    connection: Any,
    *,
    state_dir: str | Path,
    group_id: str,
    ingest: bool = True,
    batch_size: int | None = None,
) -> ShardedDataset:
    """The ``ShardedDataset`` of a ``datasets:`` entry with ``shards: N``
    (fabric.config.DatasetConfig): fed from its Kafka topic (``connection(name)`` opens
    the connection; every partition of the topic, shard i owning ``p % N == i``) when
    ``ingest``, else only loaded from the shards' checkpoints. Too many shards for the
    topic's partitions is an error at the dataset's ``shards:`` in fabric.yaml."""
    from dsl.errors import Diagnostic, DslError

    indexes = {i.column: {"kind": i.kind, **_index_options(i.options)} for i in decl.indexes}
    kafka = None
    if decl.from_uri and decl.from_uri.startswith("kafka://"):
        conn_name, _, topic = decl.from_uri[len("kafka://") :].partition("/")
        src = connection(conn_name).source(topic)
        parts = sorted(int(p) for p in src.partitions)
        if len(parts) < decl.shards:
            raise DslError(
                Diagnostic(
                    f"dataset '{decl.name}' has shards: {decl.shards} but its topic {topic} has "
                    f"{len(parts)} partition(s); a shard owns whole partitions",
                    decl.shards_span,
                    f"use shards: {len(parts)} or fewer, or add partitions to {topic}",
                )
            )
        if ingest:
            kconn = connection(conn_name)
            kafka = {
                "bootstrap": kconn.bootstrap,
                # each shard reopens it (one home for every Kafka client's settings:
                # connectors.kafka.KafkaConnection.client_config); no tail cache there
                "connection": (kconn.name, {**kconn.options, "cache": False}),
                "topic": topic,
                "partitions": parts,
                "group_id": group_id,
                "dead_letter": "log",
                **({"batch_size": batch_size} if batch_size else {}),
            }
    ds = ShardedDataset(
        cluster,
        decl.name,
        decl.schema,
        decl.key,
        indexes,
        shards=decl.shards,
        state_dir=state_dir,
        kafka=kafka,
        embed=decl.embed,
        retention=(
            (float(decl.retention_seconds), decl.time_column)
            if decl.retention_seconds is not None and decl.time_column
            else None
        ),
    )
    ds.fed_from_kafka = bool(decl.from_uri and decl.from_uri.startswith("kafka://"))
    return ds


def _index_options(opts: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in opts.items() if k in ("metric", "M", "ef_construction", "ef")}


def sharded_freshness(ds: ShardedDataset, timeout: float = 5.0) -> dict[str, Any]:
    """The executor's freshness of a sharded dataset: the messages its shards have not
    applied, summed (what an answer over every shard misses: a local dataset's lag), and
    an error -- so stale -- when any shard is behind with an unknown lag, does not answer
    within ``timeout`` (restarting), or when a Kafka-fed dataset is not ingested here."""
    import ray

    if ds.fed_from_kafka and not ds.ingesting:
        return {
            "lag_messages": None,
            "error": f"dataset {ds.name} is sharded and not ingested by this fabric (ingest=False)",
        }
    try:
        shards = ray.get([a.freshness.remote() for a in ds.actors], timeout=timeout)
    except Exception as e:
        return {"lag_messages": None, "error": f"a shard of {ds.name} did not answer: {e}"}
    agg = aggregate_freshness(shards, ds.max_lag)
    out: dict[str, Any] = {"lag_messages": agg["lag_messages"], "shards": agg["shards"]}
    unknown = [s["shard"] for s in shards if s.get("lag_messages") is None]
    if unknown:
        out["error"] = f"the lag of shard(s) {unknown} of {ds.name} is not known yet"
    return out
