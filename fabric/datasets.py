"""Materialize the datasets declared in fabric.yaml, and run their Kafka ingestion.

``DatasetManager`` creates each dataset (or loads it from its newest checkpoint under the
state directory, ``.fabric/state/<name>`` next to fabric.yaml by default) and, for
``from: kafka://<connection>/<topic>``, runs a ``KafkaIngestor`` in a consumer group named
``<group_prefix>.<config name>.<dataset>`` (config name: the directory holding fabric.yaml).

A dataset fed from a table, collection or file (``from: mysql://... | mongo://... |
s3://... | file://...``) is materialized by a ``Refresher`` (``refresh: {mode: full |
append | changes, every, cursor}``); one without ``from:`` is filled through upsert. Both
are checkpointed in the same state store as Kafka-fed ones, so a reopen (and the CLI)
sees them.

``FabricService`` is what ``fabric serve`` runs: the manager, a ``FreshnessTracker`` that
knows which bindings read which sources, and a ``SignalEmitter`` pushing transitions and
heartbeats to the configured targets.

Source names in the tracker (and so in ``/v1/freshness``): a dataset's name (``news``) for
a materialized dataset (bindings read it as ``dataset://news``), the URI otherwise.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from dsl.errors import did_you_mean
from fabric import embed
from fabric.freshness import FreshnessTracker
from fabric.ingest import checkpoint
from fabric.ingest.kafka import IngestOptions, KafkaIngestor
from fabric.signals import SignalEmitter, Thresholds

log = logging.getLogger("fabric.datasets")


@dataclass(frozen=True)
class DatasetDecl:
    """What the manager needs of one ``datasets:`` entry (fabric.config.DatasetConfig maps onto it)."""

    name: str
    schema: pa.Schema
    key: str
    indexes: Mapping[str, Any] = field(
        default_factory=dict
    )  # column -> 'btree' | {'kind': 'hnsw', ...}
    from_uri: str | None = None  # kafka://<connection>/<topic>, or None (filled through upsert)
    #: fabric.config.RefreshConfig of a dataset fed from a table, collection or file
    refresh: Any = None
    #: fabric.embed.EmbedSpec: vector columns computed from text as rows arrive
    embed: tuple[Any, ...] = ()
    #: ``retention:`` seconds and ``time_column``: rows older are deleted (expire_rows)
    retention_seconds: float | None = None
    time_column: str | None = None

    def kafka_feed(self) -> tuple[str, str] | None:
        """(connection, topic) when fed from Kafka."""
        if not self.from_uri or not self.from_uri.startswith("kafka://"):
            return None
        conn, _, topic = self.from_uri[len("kafka://") :].partition("/")
        if not conn or not topic:
            raise ValueError(
                f"dataset {self.name}: from {self.from_uri!r} must look like kafka://<connection>/<topic>"
            )
        return conn, topic

    @classmethod
    def from_config(cls, d: Any) -> DatasetDecl:
        if not d.key:
            raise ValueError(
                f"dataset {d.name}: a materialized dataset needs 'key:' (the column rows are upserted by)"
            )
        indexes = {i.column: {"kind": i.kind, **_index_options(i.options)} for i in d.indexes}
        return cls(
            d.name,
            d.schema,
            d.key,
            indexes,
            d.from_uri,
            getattr(d, "refresh", None),
            tuple(getattr(d, "embed", ())),
            getattr(d, "retention_seconds", None),
            getattr(d, "time_column", None),
        )

    def refreshed_from(self) -> tuple[str, str] | None:
        """(connection, object) when materialized from a non-Kafka source."""
        if not self.from_uri or self.kafka_feed() is not None:
            return None
        conn, _, obj = self.from_uri.split("://", 1)[1].partition("/")
        return conn, obj


def _index_options(opts: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in opts.items() if k in ("metric", "M", "ef_construction", "ef")}


#: seconds between retention passes (``retention:``): a row is removed at most this long
#: after it expires
RETENTION_INTERVAL = 10.0


def expire_rows(ds: Any, column: str, seconds: float, now: Any = None) -> int:
    """``retention:``: delete the rows of ``ds`` whose ``column`` (a timestamp or a date)
    is older than ``now - seconds`` (``now``: the current time); a null time never
    expires. One write-locked step (``Dataset.delete_where``), so a row rewritten with a
    newer time meanwhile stays. Returns the rows deleted. A local dataset's manager and
    every shard of a sharded one (fabric.ray.shards) run it every ``RETENTION_INTERVAL``."""
    import datetime as dt

    from dsl.ast import Binary, Column, Param

    now = now or dt.datetime.now(dt.UTC)
    cutoff: Any = now - dt.timedelta(seconds=seconds)
    if pa.types.is_date(ds.schema.field(column).type):
        cutoff = cutoff.date()
    where = Binary("<", Column(column), Param("__fabric_expire_before"))
    return int(ds.delete_where(where, {"__fabric_expire_before": cutoff}))


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name) or "fabric"


class DatasetManager:
    def __init__(
        self,
        decls: Iterable[DatasetDecl],
        *,
        connections: Mapping[str, Mapping[str, Any]] | None = None,
        state_dir: str | Path = ".fabric/state",
        tracker: FreshnessTracker | None = None,
        config_name: str = "fabric",
        group_prefix: str = "fabric",
        batch_size: int = 5000,
        checkpoint_interval: float = 10.0,
        thresholds: Mapping[str, Thresholds] | None = None,
        connection_factory: Callable[[str], Any] | None = None,
    ):
        self.decls = {d.name: d for d in decls}
        self.connections = {k: dict(v) for k, v in (connections or {}).items()}
        #: name -> the open ``connectors`` connection (``Catalog.connection`` in a Fabric,
        #: so scans, ingestion and validation share one Kafka client factory)
        self.connection_factory = connection_factory or self._open_connection
        self._opened: dict[str, Any] = {}
        self.state_dir = Path(state_dir)
        self.tracker = tracker
        self.config_name = _safe(config_name)
        self.group_prefix = group_prefix
        self.batch_size = batch_size
        self.checkpoint_interval = checkpoint_interval
        self.thresholds = dict(thresholds or {})
        self.datasets: dict[str, Any] = {}
        #: executor: ray's scan hook (fabric.ray.RayExecutor.scan): a refresh's scan of its
        #: source goes through it (None: read here; also when the hook keeps it local)
        self.scan_hook: Callable[[Any, Any], Any] | None = None
        self.ingestors: dict[str, KafkaIngestor] = {}
        self.refreshers: dict[str, Refresher] = {}
        self._saved_version: dict[str, int] = {}  # Dataset.version when last checkpointed
        self._meta: dict[str, Mapping[str, Any]] = {}  # the loaded checkpoint's meta
        self._persister: threading.Thread | None = None
        self._expirer: threading.Thread | None = None  # retention: (expire)
        self._stop = threading.Event()
        self._offsets: dict[str, dict[int, int]] = {}
        self._resume: dict[str, dict[str, Any]] = {}  # the checkpoint meta each was loaded from
        self._recovery: dict[str, str] = {}  # why a dataset is replayed or rebuilt (checkpoints)
        self._saved_at: dict[str, float | None] = {}  # when the loaded checkpoint was written
        self._locks: dict[str, Any] = {}
        for d in self.decls.values():  # fail early, before anything starts
            feed = d.kafka_feed()
            if feed and feed[0] not in self.connections:
                raise ValueError(
                    f"dataset {d.name}: unknown connection {feed[0]!r} in {d.from_uri}; "
                    + did_you_mean(feed[0], self.connections, "connections")
                )

    # ------------------------------------------------------------------ datasets

    def open(self) -> DatasetManager:
        """Create or load every dataset (no ingestion yet)."""
        for d in self.decls.values():
            if d.name not in self.datasets:
                self.datasets[d.name] = ds = self._load_or_create(d)
                self._saved_version[d.name] = ds.version
                ds.computed = embed.filler(d.embed, d.schema)  # every write path passes here
            if d.refreshed_from() is not None and d.name not in self.refreshers:
                self.refreshers[d.name] = Refresher(self, d, self._meta.get(d.name, {}))
        return self

    def _load_or_create(self, d: DatasetDecl) -> Any:
        from indexes.dataset import Dataset

        sdir = self.state_dir / d.name
        # a damaged checkpoint falls back to the previous one, else to a rebuild (named)
        loaded = checkpoint.load(sdir, lambda c: Dataset.load(str(c.dataset_dir)))
        ck, ds = loaded.checkpoint, loaded.value
        report = loaded.report()
        if report is not None:
            log.error("dataset %s: %s", d.name, report)
            if ck is None and d.from_uri is None:
                raise ValueError(
                    f"dataset {d.name}: {report}; it has no 'from:' source, so it cannot be "
                    f"rebuilt: restore {sdir} from a backup, or move it away to start empty"
                )
            self._recovery[d.name] = report
        if ck is not None:
            if ds.schema.remove_metadata() == d.schema.remove_metadata() and ds.key == d.key:
                self._offsets[d.name] = dict(ck.offsets)
                self._meta[d.name] = dict(ck.meta)
                self._resume[d.name] = dict(ck.meta)
                self._saved_at[d.name] = float(ck.meta.get("saved_at") or 0.0) or None
                log.info("dataset %s: loaded checkpoint %s (%d rows)", d.name, ck.path, ds.count())
                return ds
            if d.from_uri is None:
                raise ValueError(
                    f"dataset {d.name}: the saved copy in {sdir} has a different schema or key than fabric.yaml; "
                    f"it is not fed from Kafka, so it cannot be rebuilt: restore the old declaration, "
                    f"or move {sdir} away to start empty"
                )
            aside = sdir.with_name(f"{d.name}.replaced-{int(time.time())}")
            log.warning(
                "dataset %s: schema/key changed; moving %s to %s and reloading from %s",
                d.name,
                sdir,
                aside,
                d.from_uri,
            )
            shutil.move(str(sdir), str(aside))
        return Dataset.create(d.name, d.schema, d.key, dict(d.indexes))

    def _open_connection(self, name: str) -> Any:
        """The connection ``name`` of ``connections`` (opened once; closed by ``stop``)."""
        from connectors.base import open_connection

        if name not in self._opened:
            self._opened[name] = open_connection(name, {"kind": "kafka", **self.connections[name]})
        return self._opened[name]

    def source(self, uri: str) -> Any:
        """The ``connectors`` source of a non-Kafka ``from:`` URI."""
        conn, _, obj = uri.split("://", 1)[1].partition("/")
        return self.connection_factory(conn).source(obj)

    def dataset(self, name: str) -> Any:
        try:
            return self.datasets[name]
        except KeyError:
            raise KeyError(
                f"unknown dataset {name!r}; " + did_you_mean(name, self.decls, "datasets")
            ) from None

    # ------------------------------------------------------------------ broker checks

    def topic_problem(self, name: str) -> str | None:
        """Why the topic feeding dataset ``name`` cannot be read (it does not exist, the
        broker does not answer), with the nearest existing topic names; None if it can."""
        feed = self.decls[name].kafka_feed()
        if feed is None:
            return None
        conn_name, topic = feed
        try:
            conn = self.connection_factory(conn_name)
            topics = conn.list_objects()
        except Exception as exc:
            return f"{exc}"
        if topic in topics:
            return None
        from fabric.catalog import nearest

        return f"{self.decls[name].from_uri} does not exist; {nearest(topic, topics, 'topics')}"

    def broker_lag(self, name: str) -> dict[str, Any]:
        """The lag of dataset ``name`` measured against the broker now: its next offsets
        (the ingestor's, or the loaded checkpoint's when nothing ingests it here) against
        every partition's watermarks, bounded by the connection's timeout. ``error`` is set
        when the topic cannot be read or when messages are pending but their age is not
        known (nothing ingests here and no checkpoint says when the data was saved)."""
        d = self.decls[name]
        feed = d.kafka_feed()
        assert feed is not None
        conn_name, topic = feed
        ing = self.ingestors.get(name)
        nxt = dict(ing.next_offsets) if ing is not None else dict(self._offsets.get(name, {}))
        try:
            conn = self.connection_factory(conn_name)
            md = conn._metadata(topic).topics.get(topic)
            if md is None or md.error is not None or not md.partitions:
                return {
                    "lag_messages": None,
                    "lag_seconds": None,
                    "error": self.topic_problem(name),
                }
            marks = conn.list_offsets(topic, sorted(md.partitions), conn.timeout)
        except Exception as exc:
            return {"lag_messages": None, "lag_seconds": None, "error": str(exc)}
        lag = sum(max(0, hi - max(nxt.get(p, lo), lo)) for p, (lo, hi) in marks.items())
        out: dict[str, Any] = {"lag_messages": lag, "lag_seconds": 0.0 if lag == 0 else None}
        if lag:
            # pending messages are at most as old as the data held: the newest event
            # applied here, else when the loaded checkpoint was written
            applied = self.tracker.lag(name) if self.tracker is not None else None
            ref = (applied[3] if applied else None) or self._saved_at.get(name)
            if ref:
                out["lag_seconds"] = max(0.0, time.time() - ref)
                out["event_time"] = ref
            else:
                out["error"] = (
                    f"{lag} messages of {d.from_uri} are not applied yet and nothing held "
                    "tells their age"
                )
        return out

    def refresh_freshness(self, name: str) -> dict[str, Any] | None:
        """Freshness of a refreshed dataset: its refresh watermark against the source's."""
        r = self.refreshers.get(name)
        return None if r is None else r.freshness()

    def group_id(self, name: str, connection: str | None = None) -> str:
        """The consumer group of dataset ``name``: its Kafka connection's
        ``group_prefix`` (else ingest's), the config name, the dataset. ``connection``:
        the connection feeding it, for a dataset this manager does not hold (sharded)."""
        if connection is None and name in self.decls:
            feed = self.decls[name].kafka_feed()
            connection = feed[0] if feed else None
        conn = self.connections.get(connection or "", {})
        return f"{conn.get('group_prefix') or self.group_prefix}.{self.config_name}.{name}"

    # ------------------------------------------------------------------ ingestion

    def start(self) -> DatasetManager:
        """Open the datasets, start one ingestor per Kafka-fed dataset, refresh the
        datasets fed from tables, collections and files that are due (then on their
        ``every`` schedule), and checkpoint upserted datasets every
        ``checkpoint_interval`` seconds."""
        self.open()
        for d in self.decls.values():  # say it at once: a typo in from: is otherwise silent
            if d.kafka_feed() is not None and d.name not in self.ingestors:
                problem = self.topic_problem(d.name)
                if problem is not None:
                    log.error("dataset %s: %s; fix from: in fabric.yaml", d.name, problem)
        for r in self.refreshers.values():
            r.start()
        if self._persister is None and self.checkpoint_interval:
            self._persister = threading.Thread(
                target=self._persist_loop, name="fabric-persist", daemon=True
            )
            self._persister.start()
        if self._expirer is None and any(d.retention_seconds for d in self.decls.values()):
            self._expirer = threading.Thread(
                target=self._retention_loop, name="fabric-retention", daemon=True
            )
            self._expirer.start()
        for d in self.decls.values():
            feed = d.kafka_feed()
            if feed is None or d.name in self.ingestors:
                continue
            conn, topic = feed
            kconn = self.connection_factory(conn)  # security:/config: reach every client
            opts = IngestOptions(
                bootstrap=kconn.bootstrap,
                topic=topic,
                group_id=self.group_id(d.name),
                batch_size=self.batch_size,
                checkpoint_interval=self.checkpoint_interval,
                connection=kconn,
            )
            if self.tracker is not None:
                self.tracker.register_source(d.name, self.thresholds.get(d.name), uri=d.from_uri)
            sdir: Path | None = self.state_dir / d.name
            if not self._lock(d.name):
                log.warning(
                    "dataset %s: another process holds %s and writes its checkpoints; "
                    "this one ingests into memory only (from the latest checkpoint)",
                    d.name,
                    sdir,
                )
                sdir = None
            ing = KafkaIngestor(
                d.name,
                self.datasets[d.name],
                opts,
                tracker=self.tracker,
                state_dir=sdir,
                start_offsets=self._offsets.get(d.name),
                resume=self._resume.get(d.name),
                recovery=self._recovery.get(d.name),
                dead_letter_dir=self.state_dir / d.name,
            )
            self.ingestors[d.name] = ing.start()
        return self

    def wait_caught_up(self, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        return all(
            i.wait_caught_up(max(0.0, deadline - time.monotonic())) for i in self.ingestors.values()
        )

    def save(self, name: str, meta: Mapping[str, Any] | None = None) -> checkpoint.Checkpoint:
        """Checkpoint a dataset filled through upsert or refreshed from its source (Kafka-fed
        ones checkpoint themselves), in the same store: ``<state>/<name>/ckpt-<seq>``."""
        if name in self.ingestors:
            raise ValueError(
                f"dataset {name} is fed from Kafka; its ingestor writes its checkpoints"
            )
        if not self._lock(name):
            raise RuntimeError(
                f"dataset {name}: another process holds {self.state_dir / name} and writes "
                "its checkpoints; changes made here stay in this process"
            )
        ds = self.dataset(name)
        version = ds.version
        ck = checkpoint.write(self.state_dir / name, ds.save, {}, {"dataset": name, **(meta or {})})
        self._saved_version[name] = version
        return ck

    def dirty(self) -> list[str]:
        """Datasets not fed from a source whose rows changed since their last checkpoint."""
        return [
            n
            for n, ds in self.datasets.items()
            if self.decls[n].from_uri is None and ds.version != self._saved_version.get(n)
        ]

    def forget_changes(self, name: str) -> None:
        """Rows written to dataset ``name`` since its last checkpoint are not persisted
        (a ``fabric load`` that failed part way: the checkpoint stays as it was)."""
        self._saved_version[name] = self.dataset(name).version

    def persist(self) -> list[str]:
        """Checkpoint every dirty upserted dataset this process may write; returns them."""
        done = []
        for name in self.dirty():
            try:
                self.save(name)
                done.append(name)
            except RuntimeError as exc:
                log.warning("%s", exc)
                self._saved_version[name] = self.datasets[name].version  # warn once
        return done

    def expire(self, now: Any = None) -> dict[str, int]:
        """Apply ``retention:`` to every dataset declaring it (``expire_rows``); the rows
        deleted per dataset."""
        out = {}
        for name, d in self.decls.items():
            if d.retention_seconds is not None and d.time_column and name in self.datasets:
                out[name] = expire_rows(
                    self.datasets[name], d.time_column, d.retention_seconds, now
                )
        return out

    def _retention_loop(self) -> None:
        while not self._stop.wait(RETENTION_INTERVAL):
            try:
                self.expire()
            except Exception:  # keep trying: the next pass deletes what this one did not
                log.exception("applying retention failed")

    def _persist_loop(self) -> None:
        while not self._stop.wait(self.checkpoint_interval):
            try:
                self.persist()
            except Exception:  # keep trying; a full disk must not stop the fabric
                log.exception("persisting upserted datasets failed")

    def stop(self, checkpoint_now: bool = True) -> None:
        self._stop.set()
        for r in self.refreshers.values():
            r.stop()
        if self._persister is not None:
            self._persister.join(30)
            self._persister = None
        if self._expirer is not None:
            self._expirer.join(30)
            self._expirer = None
        for ing in self.ingestors.values():
            ing.stop(checkpoint_now=checkpoint_now)
        self.ingestors.clear()
        if checkpoint_now:
            try:
                self.persist()
            except Exception:
                log.exception("persisting upserted datasets at stop failed")
        for f in self._locks.values():
            f.close()  # releases the flock
        self._locks.clear()
        for c in self._opened.values():
            c.close()
        self._opened.clear()

    def _lock(self, name: str) -> bool:
        """One checkpoint writer per state directory (an advisory ``flock`` on ``.lock``)."""
        if name in self._locks:
            return True
        d = self.state_dir / name
        d.mkdir(parents=True, exist_ok=True)
        f = open(d / ".lock", "a+")  # noqa: SIM115 (held until stop())
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            return False
        self._locks[name] = f
        return True


class Refresher:
    """Keeps one dataset materialized from a table, collection or file (``refresh:``).

    ``full``: scan the whole source; upsert every row and delete the keys it no longer
    has. ``append``: scan the rows whose cursor column is >= the largest value held (the
    filter is pushed to the source when it can take it; the boundary value is read again
    so rows sharing it are not missed, and upserts by key make that idempotent).
    ``changes`` (MongoDB): the collection's change stream is opened, the collection read
    in full, and the stream then applied as it comes (inserts/updates/replaces upserted,
    deletes by key); after a stream error it is reopened and the collection read again. After each refresh the
    dataset and the refresh watermark are checkpointed in the dataset's state directory
    (the same store Kafka-fed datasets use), so a reopen starts from them.

    Freshness (``freshness()``): the refresh watermark (when the last refresh started:
    everything the source held then is in the dataset) against the source's own
    watermark (``Source.watermark()``; S3/file: newest object modification, SQL/Mongo:
    query time). If the source has not changed since the refresh started, the lag is 0;
    otherwise the dataset is as old as its last refresh.
    """

    def __init__(self, manager: DatasetManager, decl: DatasetDecl, meta: Mapping[str, Any]):
        self.manager = manager
        self.decl = decl
        cfg = decl.refresh
        self.mode: str = getattr(cfg, "mode", "full")
        self.every: float | None = getattr(cfg, "every_seconds", None)
        self.cursor: str | None = getattr(cfg, "cursor", None)
        saved = dict(meta.get("refresh") or {})
        self.started_at: float | None = saved.get("started_at")  # the refresh watermark
        self.finished_at: float | None = saved.get("finished_at")
        self.cursor_value: Any = _from_json(saved.get("cursor_value"))
        self.last_error: str | None = None
        self.refreshes = 0
        self.last: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stream: Any = None
        self._loaded = threading.Event()  # changes: the first full read is done (or failed)

    @property
    def dataset(self) -> Any:
        return self.manager.datasets[self.decl.name]

    def due(self) -> bool:
        """Refresh at start: never refreshed, no schedule (once per open), or its time."""
        if self.started_at is None or self.every is None:
            return True
        return time.time() - self.started_at >= self.every

    def start(self, wait: float = 60.0) -> None:
        """Refresh now if due, then keep refreshing on schedule; ``changes``: open the change
        stream, read the collection fully, then follow the stream (waits up to ``wait``
        seconds for that first read)."""
        if self._thread is not None:
            return
        if self.mode != "changes" and self.due():
            self._refresh_logged()
        if self.mode == "changes" or self.every is not None:
            self._thread = threading.Thread(
                target=self._loop, name=f"fabric-refresh-{self.decl.name}", daemon=True
            )
            self._thread.start()
        if self.mode == "changes":
            self._loaded.wait(wait)

    def stop(self) -> None:
        self._stop.set()
        if self._stream is not None:
            with contextlib.suppress(Exception):
                self._stream.close()
        if self._thread is not None:
            self._thread.join(30)
            self._thread = None

    def _loop(self) -> None:
        if self.mode == "changes":
            self._follow_changes()
            return
        assert self.every is not None
        while not self._stop.wait(self.every):
            self._refresh_logged()

    def _refresh_logged(self) -> None:
        try:
            self.refresh()
        except Exception as exc:  # the dataset keeps serving; freshness reports the error
            self.last_error = f"refresh from {self.decl.from_uri} failed: {exc}"
            log.warning("dataset %s: %s", self.decl.name, self.last_error)

    # ---------------------------------------------------------------- one refresh

    def refresh(self) -> dict[str, Any]:
        """Read the source (all of it, or past the cursor) into the dataset; checkpoint."""
        from connectors.base import ScanRequest

        with self._lock:
            started = time.time()
            src = self.manager.source(self.decl.from_uri or "")
            have = src.schema().names
            computed = {e.into for e in self.decl.embed}  # embedded at upsert when absent
            names = [c for c in self.decl.schema.names if c in have or c not in computed]
            missing = [c for c in names if c not in have]
            if missing:
                raise ValueError(
                    f"{self.decl.from_uri} has no column(s) {', '.join(missing)} declared in "
                    f"the schema of dataset {self.decl.name}; it has {', '.join(src.schema().names)}"
                )
            request = ScanRequest(columns=tuple(names), timeout=None)
            incremental = self.mode == "append" and self.cursor_value is not None
            pushed = False
            if incremental:
                request, pushed = self._cursor_request(src, request)
            remote = self.manager.scan_hook(src, request) if self.manager.scan_hook else None
            batches = list(src.scan(request)) if remote is None else remote[0]
            table = (
                pa.Table.from_batches(batches)
                if batches or remote is None
                else pa.schema([src.schema().field(c) for c in names]).empty_table()
            )
            if incremental and not pushed:  # the source could not take the filter
                table = table.filter(
                    pc.greater_equal(table[self.cursor], pa.scalar(self.cursor_value))
                )
            ds = self.dataset
            table = table.select(names)
            deleted = 0
            if self.mode in ("full", "changes"):
                key = self.decl.key
                new = set(table.column(key).to_pylist())
                old = set(ds.to_table([key]).column(key).to_pylist()) if ds.count() else set()
                gone = list(old - new)
                if gone:
                    deleted = ds.delete(gone)
            if table.num_rows:
                ds.upsert(table)
            if self.cursor is not None and table.num_rows:
                mx = pc.max(table[self.cursor]).as_py()
                if mx is not None and (self.cursor_value is None or mx > self.cursor_value):
                    self.cursor_value = mx
            self.started_at, self.finished_at = started, time.time()
            self.last_error = None
            self.refreshes += 1
            self.last = {
                "mode": "append"
                if incremental
                else ("full" if self.mode != "append" else "append (first: full)"),
                "rows_read": table.num_rows,
                "deleted": deleted,
                "pushed_cursor": pushed,
                "seconds": round(self.finished_at - started, 3),
            }
            self._checkpoint()
            self._observe(self._measure())
            return self.last

    def _cursor_request(self, src: Any, request: Any) -> tuple[Any, bool]:
        import dataclasses

        from connectors.base import Pushdown
        from dsl.ast import Binary, Column, Param

        expr = Binary(">=", Column(self.cursor or ""), Param("__fabric_cursor"))
        try:
            if src.supports_filter(expr) is Pushdown.UNSUPPORTED:
                return request, False
        except Exception:
            return request, False
        return (
            dataclasses.replace(
                request, filters=(expr,), params={"__fabric_cursor": self.cursor_value}
            ),
            True,
        )

    def _checkpoint(self) -> None:
        try:
            self.manager.save(self.decl.name, self.checkpoint_meta())
        except RuntimeError as exc:  # another process writes this state directory
            log.info("%s", exc)

    def checkpoint_meta(self) -> dict[str, Any]:
        """What a checkpoint keeps of the refresh (its watermark and cursor), read back
        as ``meta`` when the dataset is loaded (a sharded dataset's shards keep it too)."""
        return {
            "from": self.decl.from_uri,
            "refresh": {
                "mode": self.mode,
                "started_at": self.started_at,
                "finished_at": self.finished_at,
                "cursor": self.cursor,
                "cursor_value": _to_json(self.cursor_value),
            },
        }

    # ---------------------------------------------------------------- change streams

    def _follow_changes(self) -> None:
        """Apply the Mongo collection's change stream (resuming after errors)."""
        conn_name, coll_name = self.decl.refreshed_from() or ("", "")
        backoff = 0.5
        while not self._stop.is_set():
            try:
                conn = self.manager.connection_factory(conn_name)
                coll = conn.db[coll_name]
                with coll.watch(full_document="updateLookup", max_await_time_ms=200) as stream:
                    self._stream = stream
                    # the stream is open before the full read, so no change falls between
                    # them (one seen by both is applied twice: idempotent by key)
                    self.refresh()
                    self._loaded.set()
                    while not self._stop.is_set() and stream.alive:
                        change = stream.try_next()
                        if change is None:
                            continue
                        self._apply_change(change)
                        backoff = 0.5
            except Exception as exc:
                if self._stop.is_set():
                    return
                self.last_error = f"change stream of {self.decl.from_uri}: {exc}"
                log.warning("dataset %s: %s", self.decl.name, self.last_error)
                self._loaded.set()  # open() does not wait for a source that is down
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)

    def _apply_change(self, change: Mapping[str, Any]) -> None:
        op = change.get("operationType")
        key = self.decl.key
        with self._lock:
            if op in ("insert", "update", "replace") and change.get("fullDocument"):
                doc = change["fullDocument"]
                row = {c: _mongo_value(doc.get(c)) for c in self.decl.schema.names}
                self.dataset.upsert(pa.Table.from_pylist([row], schema=self.decl.schema))
            elif op == "delete":
                dk = change.get("documentKey") or {}
                if key == "_id":
                    self.dataset.delete([_mongo_value(dk.get("_id"))])
                else:  # find the row by its _id, kept as a column or not at all
                    self._delete_by_id(dk.get("_id"))
            else:
                return
            self.started_at = time.time()  # everything up to this change is applied
            self.refreshes += 1

    def _delete_by_id(self, oid: Any) -> None:
        if "_id" in self.decl.schema.names:
            t = self.dataset.to_table(["_id", self.decl.key])
            mask = pc.equal(t["_id"], str(oid))
            keys = t.filter(mask).column(self.decl.key).to_pylist()
            if keys:
                self.dataset.delete(keys)
        else:
            self.last_error = (
                f"a delete in {self.decl.from_uri} could not be applied: the dataset has no "
                "_id column to find the row by (declare _id: str in its schema)"
            )

    # ---------------------------------------------------------------- freshness

    def _observe(self, f: Mapping[str, Any]) -> None:
        """Tell the tracker (``/v1/freshness``, signals) what ``freshness()`` found."""
        tracker = self.manager.tracker
        if tracker is None:
            return
        from connectors.base import Watermark

        now = time.time()
        lag = f.get("lag_seconds")
        tracker.observe_watermark(
            self.decl.name,
            Watermark(
                observed_at=now,
                event_time=None if lag is None else now - lag,
                detail={"kind": "refresh", **f.get("refresh", {})},
            ),
        )
        if f.get("error"):
            tracker.record_error(self.decl.name, str(f["error"]), kind="refresh")
        else:
            tracker.clear_error(self.decl.name, kind="refresh")

    def freshness(self) -> dict[str, Any]:
        """``{lag_messages: None, lag_seconds, event_time, error?, refresh}`` (see class)."""
        out = self._measure()
        self._observe(out)
        return out

    def _measure(self) -> dict[str, Any]:
        now = time.time()
        out: dict[str, Any] = {
            "lag_messages": None,
            "lag_seconds": None,
            "event_time": self.started_at,
            "refresh": {"mode": self.mode, "every": self.every, **self.last},
        }
        if self.started_at is None:
            out["error"] = self.last_error or f"never refreshed from {self.decl.from_uri}"
            return out
        if self.mode == "changes" and self._thread is not None and self.last_error is None:
            out["lag_seconds"] = 0.0  # the change stream applies as it comes
            return out
        try:
            src_time = self.manager.source(self.decl.from_uri or "").watermark().event_time
        except Exception as exc:
            src_time = None
            out["error"] = f"source watermark: {exc}"
        unchanged = src_time is not None and src_time <= self.started_at
        out["lag_seconds"] = 0.0 if unchanged else max(0.0, now - self.started_at)
        out["source_watermark"] = src_time
        if self.last_error:
            out["error"] = self.last_error
        return out


def _to_json(v: Any) -> Any:
    import datetime as dt
    import decimal

    if isinstance(v, dt.datetime):
        return {"datetime": v.isoformat()}
    if isinstance(v, dt.date):
        return {"date": v.isoformat()}
    if isinstance(v, decimal.Decimal):
        return {"decimal": str(v)}
    return v


def _from_json(v: Any) -> Any:
    import datetime as dt
    import decimal

    if isinstance(v, dict):
        if "datetime" in v:
            return dt.datetime.fromisoformat(v["datetime"])
        if "date" in v:
            return dt.date.fromisoformat(v["date"])
        if "decimal" in v:
            return decimal.Decimal(v["decimal"])
    return v


def _mongo_value(v: Any) -> Any:
    """A BSON value as the dataset stores it (ObjectIds as strings)."""
    if type(v).__name__ == "ObjectId":
        return str(v)
    return v


def bindings_from_specs(
    specs: Iterable[Any], dataset_names: Iterable[str], *, recover_after: float = 0.0
) -> tuple[dict[str, list[str]], dict[tuple[str, str], Thresholds]]:
    """binding -> source names, and the bindings' own bounds (``freshness: {max_lag, ...}``),
    recovering with the same stabilization window as the source thresholds."""
    names = set(dataset_names)
    reads: dict[str, list[str]] = {}
    overrides: dict[tuple[str, str], Thresholds] = {}
    for b in specs:
        for s in b.sources:
            src = source_name(s.uri, names)
            reads.setdefault(b.name, []).append(src)
            f = s.freshness
            if f is not None and (f.max_lag_seconds is not None or f.max_lag_messages is not None):
                overrides[(b.name, src)] = Thresholds(
                    lag_messages=f.max_lag_messages,
                    lag_seconds=f.max_lag_seconds,
                    recover_after=recover_after,
                )
    return reads, overrides


def source_name(uri: str, datasets: Iterable[str] = ()) -> str:
    """``dataset://news`` -> ``news``; other URIs stay as they are."""
    if uri.startswith("dataset://"):
        return uri[len("dataset://") :]
    return uri


class FabricService:
    """Datasets + ingestion + freshness tracking + pushed signals: what ``fabric serve`` runs."""

    def __init__(
        self,
        manager: DatasetManager,
        tracker: FreshnessTracker,
        emitter: SignalEmitter | None = None,
        heartbeat: float | None = 5.0,
    ):
        self.manager = manager
        self.tracker = tracker
        self.emitter = emitter
        self.heartbeat = heartbeat
        self.started_at: float | None = None
        self._ready_once: set[str] = set()
        self.server_config: Any = (
            None  # fabric.config.ServerConfig (host, port) when built from config
        )
        if emitter is not None:
            tracker.listen(emitter.emit)

    @classmethod
    def from_config(
        cls,
        cfg: Any,
        *,
        state_dir: str | Path | None = None,
        with_bindings: bool = True,
        connection_factory: Callable[[str], Any] | None = None,
    ) -> FabricService:
        """From a ``fabric.config.FabricConfig``; ``connection_factory(name)`` gives the
        open connection of that name (default: the manager opens its own)."""
        sig = cfg.signals
        ratio = getattr(sig, "hysteresis", 0.5)
        recover = getattr(sig, "recover_after_seconds", 0.0)
        default = Thresholds(
            sig.stale_when.lag_messages,
            sig.stale_when.lag_seconds,
            recover_ratio=ratio,
            recover_after=recover,
        )
        tracker = FreshnessTracker(default)
        decls = [DatasetDecl.from_config(d) for d in cfg.datasets.values()]
        per_source: dict[str, Thresholds] = {}
        for uri, sw in getattr(sig, "sources", {}).items():
            t = Thresholds(
                sw.lag_messages, sw.lag_seconds, recover_ratio=ratio, recover_after=recover
            )
            per_source[uri] = t
            for d in decls:  # a dataset can be named by its URI or by the topic it is fed from
                if uri in (f"dataset://{d.name}", d.from_uri, d.name):
                    per_source[d.name] = t
        root = Path(cfg.root)
        sdir = (
            Path(state_dir)
            if state_dir
            else (cfg.ingest.checkpoint_dir or root / ".fabric" / "state")
        )
        if not Path(sdir).is_absolute():
            sdir = root / sdir
        manager = DatasetManager(
            decls,
            connections={n: dict(c.options) for n, c in cfg.connections.items()},
            state_dir=sdir,
            tracker=tracker,
            config_name=root.name,
            group_prefix=cfg.ingest.group_prefix,
            batch_size=cfg.ingest.batch_size,
            thresholds=per_source,
            connection_factory=connection_factory,
        )
        for d in decls:
            if d.kafka_feed():
                tracker.register_source(d.name, per_source.get(d.name), uri=d.from_uri)
        if with_bindings:
            from dsl.errors import DslError
            from dsl.loader import load_file

            specs = []
            for f in cfg.binding_files():
                try:
                    specs.extend(load_file(f))
                except DslError:  # the file's diagnostic (validate()); the others keep working
                    continue
            reads, overrides = bindings_from_specs(
                specs, [d.name for d in decls], recover_after=recover
            )
            for srcs in reads.values():
                for s in srcs:
                    kafka_fed = s in manager.decls and manager.decls[s].kafka_feed() is not None
                    tracker.register_source(
                        s, per_source.get(s), kind="kafka" if kafka_fed else "live", uri=s
                    )
            tracker.set_bindings(reads, overrides)
        emitter = (
            SignalEmitter(sig.targets, http_timeout=getattr(sig, "timeout_seconds", 2.0))
            if sig.targets
            else None
        )
        svc = cls(manager, tracker, emitter, heartbeat=sig.heartbeat_seconds)
        svc.server_config = getattr(cfg, "server", None)
        return svc

    @classmethod
    def from_config_file(cls, path: str | Path, **kw: Any) -> FabricService:
        from fabric.config import load_config

        return cls.from_config(load_config(Path(path)), **kw)

    def start(self, ingest: bool = True) -> FabricService:
        """Open every dataset; with ``ingest``, start the Kafka ingestors too (``fabric.open``
        in a process that should not consume passes False)."""
        if ingest:
            self.manager.start()
        else:
            self.manager.open()
        self.tracker.start(heartbeat=self.heartbeat)
        self.started_at = time.time()
        return self

    def stop(self) -> None:
        self.tracker.stop()
        self.manager.stop()
        if self.emitter is not None:
            self.emitter.close()

    def readiness(self, wait: float = 0.0) -> dict[str, Any]:
        """What a readiness probe needs: every Kafka-fed dataset's ingestor reads an
        existing topic, has measured its lag against the broker without error, and has
        caught up at least once since it started (a replica still loading its topic is
        not ready). ``wait``: poll up to this many seconds for ready."""
        deadline = time.monotonic() + wait
        while True:
            out: dict[str, Any] = {}
            for name, ing in self.manager.ingestors.items():
                if ing.caught_up():
                    self._ready_once.add(name)
                reason = None
                if ing.last_error is not None:
                    reason = self.manager.topic_problem(name) or ing.last_error
                elif ing.lag_messages is None:
                    reason = "lag not measured yet"
                elif name not in self._ready_once:
                    reason = f"catching up: {ing.lag_messages} messages behind"
                out[name] = {"ready": reason is None, "reason": reason}
            ready = all(v["ready"] for v in out.values())
            if ready or time.monotonic() >= deadline:
                return {"ready": ready, "datasets": out}
            time.sleep(0.1)

    def health(self) -> dict[str, Any]:
        return {
            "datasets": {n: ds.count() for n, ds in self.manager.datasets.items()},
            "ingestors": {
                n: {
                    "group": i.options.group_id,
                    "topic": i.options.topic,
                    **vars(i.stats),
                    "offsets": i.next_offsets,
                }
                for n, i in self.manager.ingestors.items()
            },
            "ingestion": self.readiness(),
            "signals": self.emitter.stats() if self.emitter is not None else {},
            "started_at": self.started_at,
        }
