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

from connectors.base import (
    SourceError,
)
from connectors.dataset import DatasetSource

__all__ = [
    "ShardActor",
    "ShardedDataset",
    "ShardedExplain",
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
    ):
        import os

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
        self.resumed = {int(p): int(o) for p, o in (ck.offsets if ck else {}).items()}
        self.loaded_rows = self.dataset.count()
        self.started_at = time.time()
        self.pid = os.getpid()
        self.ingestor: Any = None
        self._last: tuple[pa.Table, Any] | None = None  # the last search's answer (ping)
        self.kafka = kafka
        if kafka is not None:
            from fabric.ingest.kafka import IngestOptions, KafkaIngestor

            opts = IngestOptions(
                bootstrap=kafka["bootstrap"],
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
        }

    def upsert(self, table: pa.Table) -> int:
        return self.dataset.upsert(table)

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


def shard_of(key: Any, shards: int) -> int:
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
                name, i, schema, key, dict(indexes), str(Path(state_dir) / f"shard-{i}"), feeds[i]
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

    # ---- reads
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
    ``rank:``, BM25) is refused: each shard's term statistics are its own, so its scores
    would not be one dataset's."""

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

    def rank(self, **_kw: Any) -> tuple[pa.Table, Any]:
        raise SourceError(
            self.uri,
            f"ranked retrieval (search: / rank:) over a dataset sharded in {self.dataset.n} "
            "shards is not supported: each shard's BM25 statistics are its own",
            hint="use nearest: on a sharded dataset, or declare it without shards: for ranking",
        )


def open_sharded(
    cluster: Any,
    decl: Any,
    connection: Any,
    *,
    state_dir: str | Path,
    group_id: str,
    ingest: bool = True,
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
            kafka = {
                "bootstrap": connection(conn_name).bootstrap,
                "topic": topic,
                "partitions": parts,
                "group_id": group_id,
                "dead_letter": "log",
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
