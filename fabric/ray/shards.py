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
import time
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["ShardActor", "ShardedDataset", "aggregate_freshness"]


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
        if kafka is not None:
            from fabric.ingest.kafka import IngestOptions, KafkaIngestor

            opts = IngestOptions(
                bootstrap=kafka["bootstrap"],
                topic=kafka["topic"],
                group_id=kafka["group_id"],
                partitions=tuple(kafka["partitions"]),
                checkpoint_interval=float(kafka.get("checkpoint_interval", 10.0)),
                batch_size=int(kafka.get("batch_size", 5000)),
                dead_letter="none",
            )
            self.ingestor = KafkaIngestor(
                f"{name}#{shard}",
                self.dataset,
                opts,
                state_dir=self.state_dir,
                start_offsets=self.resumed,
                resume=dict(ck.meta) if ck else None,
            ).start()

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
    ) -> tuple[pa.Table, float]:
        t0 = time.perf_counter()
        table, _info = self.dataset.search(
            column, query, k, where, params, columns=columns, strategy=strategy
        )
        return table, (time.perf_counter() - t0) * 1000

    def wait_caught_up(self, timeout: float = 30.0) -> bool:
        return True if self.ingestor is None else self.ingestor.wait_caught_up(timeout)

    def freshness(self) -> dict[str, Any]:
        if self.ingestor is None:
            return {"shard": self.shard, "lag_messages": 0, "caught_up": True}
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
        import ray

        cols = None if columns is None else list(dict.fromkeys([*columns, self.key]))
        q = np.asarray(query, dtype=np.float32)
        parts = ray.get(
            [a.search.remote(column, q, k, where, params, cols, strategy) for a in self.actors]
        )
        self.last_shard_ms = [ms for _, ms in parts]
        tables = [t for t, _ in parts if t.num_rows]
        if not tables:
            return parts[0][0]
        merged = pa.concat_tables(tables)
        order = pc.sort_indices(
            merged, sort_keys=[("_distance", "ascending"), (self.key, "ascending")]
        )
        return merged.take(order[:k])

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
