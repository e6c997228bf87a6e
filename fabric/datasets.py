"""Materialize the datasets declared in fabric.yaml, and run their Kafka ingestion.

``DatasetManager`` creates each dataset (or loads it from its newest checkpoint under the
state directory, ``.fabric/state/<name>`` next to fabric.yaml by default) and, for
``from: kafka://<connection>/<topic>``, runs a ``KafkaIngestor`` in a consumer group named
``<group_prefix>.<config name>.<dataset>`` (config name: the directory holding fabric.yaml).

``FabricService`` is what ``fabric serve`` runs: the manager, a ``FreshnessTracker`` that
knows which bindings read which sources, and a ``SignalEmitter`` pushing transitions and
heartbeats to the configured targets.

Source names in the tracker (and so in ``/v1/freshness``): a dataset's name (``news``) for
a materialized dataset (bindings read it as ``dataset://news``), the URI otherwise.
"""

from __future__ import annotations

import fcntl
import logging
import re
import shutil
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from dsl.errors import did_you_mean
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
        return cls(d.name, d.schema, d.key, indexes, d.from_uri)


def _index_options(opts: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in opts.items() if k in ("metric", "M", "ef_construction", "ef")}


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
        self.ingestors: dict[str, KafkaIngestor] = {}
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
                self.datasets[d.name] = self._load_or_create(d)
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
            if ck is None and d.kafka_feed() is None:
                raise ValueError(
                    f"dataset {d.name}: {report}; it is not fed from Kafka, so it cannot be "
                    f"rebuilt: restore {sdir} from a backup, or move it away to start empty"
                )
            self._recovery[d.name] = report
        if ck is not None:
            if ds.schema.remove_metadata() == d.schema.remove_metadata() and ds.key == d.key:
                self._offsets[d.name] = dict(ck.offsets)
                self._resume[d.name] = dict(ck.meta)
                self._saved_at[d.name] = float(ck.meta.get("saved_at") or 0.0) or None
                log.info("dataset %s: loaded checkpoint %s (%d rows)", d.name, ck.path, ds.count())
                return ds
            if d.kafka_feed() is None:
                raise ValueError(
                    f"dataset {d.name}: the saved copy in {sdir} has a different schema or key than fabric.yaml; "
                    f"it is not fed from Kafka, so it cannot be rebuilt: restore the old declaration, "
                    f"or move {sdir} away to start empty"
                )
            aside = sdir.with_name(f"{d.name}.replaced-{int(time.time())}")
            log.warning(
                "dataset %s: schema/key changed; moving %s to %s and rebuilding from %s",
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
        return None

    def group_id(self, name: str) -> str:
        return f"{self.group_prefix}.{self.config_name}.{name}"

    # ------------------------------------------------------------------ ingestion

    def start(self) -> DatasetManager:
        """Open the datasets and start one ingestor per Kafka-fed dataset."""
        self.open()
        for d in self.decls.values():
            feed = d.kafka_feed()
            if feed is None or d.name in self.ingestors:
                continue
            conn, topic = feed
            copts = self.connections[conn]
            kconn = self.connection_factory(conn)  # security:/config: reach every client
            opts = IngestOptions(
                bootstrap=kconn.bootstrap,
                topic=topic,
                group_id=f"{copts.get('group_prefix') or self.group_prefix}.{self.config_name}.{d.name}",
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

    def save(self, name: str) -> checkpoint.Checkpoint:
        """Checkpoint a dataset filled through upsert (Kafka-fed ones checkpoint themselves)."""
        if name in self.ingestors:
            raise ValueError(
                f"dataset {name} is fed from Kafka; its ingestor writes its checkpoints"
            )
        return checkpoint.write(
            self.state_dir / name, self.dataset(name).save, {}, {"dataset": name}
        )

    def stop(self, checkpoint_now: bool = True) -> None:
        for ing in self.ingestors.values():
            ing.stop(checkpoint_now=checkpoint_now)
        self.ingestors.clear()
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


def nearest(word: str, choices: Iterable[str], what: str) -> str:
    """'nearest existing <what>: a, b, c (N in all)': the closest few names, not all."""
    import difflib

    names = sorted(set(choices))
    close = difflib.get_close_matches(word, names, n=3, cutoff=0.5)
    if not names:
        return f"there are no {what}"
    if not close:
        close = names[:3]
    return f"nearest existing {what}: {', '.join(close)} ({len(names)} in all)"


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
