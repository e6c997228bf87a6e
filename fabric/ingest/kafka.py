"""Kafka -> indexed dataset, one consumer group per dataset, exactly-once *state*.

The loop, per batch of up to ``batch_size`` messages:

1. split the batch: tombstones (null value; the message key names the row to delete),
   oversized values, and values to decode (``JsonDecoder``); messages that fail to decode,
   violate the schema or carry no key go to the dead-letter sink with their partition,
   offset and error;
2. per key, only the last operation of the batch counts (an upsert followed by a
   tombstone deletes; a tombstone followed by an upsert inserts);
3. ``dataset.delete(keys)`` and ``dataset.upsert(rows)``: every index holds the data when
   they return;
4. only then: dead letters are flushed, the offsets are committed to the group, and the
   tracker learns the new position;
5. every ``checkpoint_interval`` seconds: ``dataset.save`` + the next offsets per partition,
   atomically (``checkpoint.write``).

Restart (``kill -9`` included): the dataset is loaded from the newest checkpoint and each
partition is assigned at the checkpoint's offset (not the group's committed offset, which
may be ahead: those messages are in no snapshot). Messages between the checkpoint and the
crash are applied again; since every operation is an upsert or delete *by key* and a
partition replays in order, the final state equals the state of one clean pass. With no
checkpoint, ingestion starts at the beginning of each partition.

A batch is never lost: if applying it fails (anything raised), the consumer is rewound to
the next offsets to apply and the batch is read again (after a backoff), the error standing
until a batch applies. Offsets are trusted only for the topic they came from: the topic id
(when the broker has them), the watermarks (the next offset past the end: truncated or
recreated) and a fingerprint of the last message applied per partition (timestamp + CRC of
key and value, re-read from the broker) are checked on start and every
``verify_interval``; a mismatch empties the dataset and re-reads the topic from the
beginning, the source ``rebuilding`` until caught up.

Broker down: the loop keeps running (the dataset keeps serving reads), the source is
marked stale with the error, librdkafka reconnects with backoff, and consumption resumes
from the in-memory positions. The ingestor assigns every partition itself (the dataset is
a full replica of the topic; a group rebalance would split partitions between processes)
and commits to its group, so tools that read group lag see it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa
from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import NewTopic

from fabric.freshness import FreshnessTracker
from fabric.ingest import checkpoint
from fabric.ingest.decode import JsonDecoder

log = logging.getLogger("fabric.ingest")


class DatasetLike(Protocol):
    name: str
    key: str
    schema: pa.Schema

    def upsert(self, table: pa.Table | pa.RecordBatch) -> int: ...
    def delete(self, keys: Any) -> int: ...
    def count(self) -> int: ...
    def save(self, directory: str) -> None: ...
    def to_table(self, columns: Sequence[str] | None = None) -> pa.Table: ...


@dataclass(frozen=True)
class IngestOptions:
    bootstrap: str
    topic: str
    group_id: str
    batch_size: int = 5000
    poll_timeout: float = 0.1
    max_message_bytes: int = 1 << 20
    checkpoint_interval: float = 10.0  # seconds; 0 = only on stop()
    lag_interval: float = 0.5  # seconds between watermark queries
    dead_letter: str = "topic"  # "topic" (<topic>.dlq), "log:<path>" (JSON lines) or "none"
    #: dead letters larger than this go to the topic truncated (with the reason and their
    #: size in headers); the producer's default message.max.bytes is 1,000,000
    dead_letter_max_bytes: int = 900_000
    verify_interval: float = 30.0  # seconds between checks that the topic is the same one
    consumer_config: Mapping[str, Any] = field(default_factory=dict)
    #: the ``connectors.kafka.KafkaConnection`` that makes every client (consumer, lag
    #: consumer, dead-letter producer, admin) with the connection's security/config;
    #: None: a plain one for ``bootstrap``
    connection: Any = field(default=None, compare=False)
    #: only these partitions (a shard of a dataset, fabric.ray.shards); None: every one
    partitions: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.connection is None:
            from connectors.kafka import KafkaConnection

            object.__setattr__(
                self, "connection", KafkaConnection("ingest", {"bootstrap": self.bootstrap})
            )

    @property
    def dlq_topic(self) -> str:
        return f"{self.topic}.dlq"


@dataclass
class IngestStats:
    applied: int = 0  # messages consumed and held by the dataset (incl. tombstones, dead letters)
    upserted: int = 0
    deleted: int = 0
    dead_letters: int = 0
    batches: int = 0
    checkpoints: int = 0
    last_checkpoint_at: float | None = None
    errors: int = 0
    rebuilds: int = 0


class DeadLetterSink:
    """``<topic>.dlq`` on the same cluster (headers carry where and why), or a JSON-lines file.

    Never raises for one message: a value the topic cannot take (over
    ``dead_letter_max_bytes``) is sent truncated, with headers ``fabric.truncated`` (its
    size) and the reason; a record the topic refuses anyway (delivery failed) is written
    to ``<fallback_dir>/dead-letters.jsonl`` (0600; the dataset's state directory), and
    ``problem`` says so until a later dead letter is delivered."""

    #: bytes of a value kept in a truncated dead letter and in the JSON-lines file
    KEEP = 65536

    def __init__(self, options: IngestOptions, dataset: str, fallback_dir: Path | None = None):
        self.options = options
        self.dataset = dataset
        self.mode = options.dead_letter
        self.recent: deque[dict[str, Any]] = deque(maxlen=100)
        self._producer: Producer | None = None
        self._failed: list[dict[str, Any]] = []
        self._log_path: Path | None = None
        self.fallback_path = _fallback_dir(fallback_dir, dataset) / "dead-letters.jsonl"
        self.problem: str | None = None  # the last delivery failure, until one succeeds
        self.delivered = 0
        self.truncated: list[dict[str, Any]] = []  # records sent truncated (for notices)
        if self.mode.startswith("log:"):
            self._log_path = Path(self.mode[4:])
        elif self.mode not in ("topic", "none"):
            raise ValueError(
                f"dataset {dataset}: dead_letter {self.mode!r} is not 'topic', 'none' or 'log:<path>'"
            )

    def _ensure_topic(self) -> None:
        admin = self.options.connection.new_admin()
        fut = admin.create_topics(
            [NewTopic(self.options.dlq_topic, num_partitions=1, replication_factor=1)]
        )
        for f in fut.values():
            try:
                f.result(10)
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise

    def send(self, msg: Any, error: str) -> None:
        record = {
            "dataset": self.dataset,
            "topic": msg.topic(),
            "partition": msg.partition(),
            "offset": msg.offset(),
            "error": error,
            "at": time.time(),
        }
        self.recent.append(record)
        if self.mode == "none":
            return
        if self._log_path is not None:
            self._write_log(record, msg)
            return
        if self._producer is None:
            try:
                self._ensure_topic()
            except Exception as exc:  # fall back to the log below; never stop ingestion
                log.warning("dead-letter topic %s: %s", self.options.dlq_topic, exc)
            self._producer = self.options.connection.new_producer({"linger.ms": 5})
        value = msg.value()
        if value is not None and len(value) > self.options.dead_letter_max_bytes:
            record["truncated"] = len(value)
            value = value[: self.KEEP]
            self.truncated.append(record)
        headers: list[tuple[str, str | bytes | None]] = [
            (f"fabric.{k}", str(v).encode()) for k, v in record.items() if k != "at"
        ]

        def delivered(err: Any, _m: Any, record: dict[str, Any] = record, msg: Any = msg) -> None:
            if err is not None:
                self._failed.append({"record": {**record, "dlq_error": str(err)}, "msg": msg})
            else:
                self.delivered += 1

        for _ in range(3):
            try:
                self._producer.produce(
                    self.options.dlq_topic,
                    value=value,
                    key=msg.key(),
                    headers=headers,
                    on_delivery=delivered,
                )
                break
            except BufferError:  # the local queue is full: deliver some, then again
                self._producer.poll(1.0)
            except KafkaException as exc:  # refused before sending (size, config ...)
                self._failed.append({"record": {**record, "dlq_error": str(exc)}, "msg": msg})
                break
        else:
            self._failed.append(
                {"record": {**record, "dlq_error": "producer queue full"}, "msg": msg}
            )

    def flush(self, timeout: float = 10.0) -> None:
        """Before offsets are committed: every dead letter is delivered or logged (raises
        only if it can be neither: then the batch is not committed and is read again)."""
        if self._producer is not None:
            before = self.delivered
            left = self._producer.flush(timeout)
            if left:
                raise RuntimeError(
                    f"{left} dead letters not delivered to {self.options.dlq_topic} within {timeout}s"
                )
            if self.delivered > before and not self._failed:
                self.problem = None
        if self._failed:
            for item in self._failed:
                self._write_log(item["record"], item["msg"], self.fallback_path)
            first = self._failed[0]["record"]
            self.problem = (
                f"{len(self._failed)} dead letters refused by {self.options.dlq_topic} "
                f"({first['dlq_error']}); written to {self.fallback_path}"
            )
            log.warning("dataset %s: %s", self.dataset, self.problem)
            self._failed.clear()

    def _write_log(self, record: dict[str, Any], msg: Any, path: Path | None = None) -> None:
        path = path or self._log_path
        assert path is not None
        _private_dir(path.parent)
        value = msg.value()
        key = msg.key()
        line = {
            **record,
            "key": None if key is None else key.decode("utf-8", "replace"),
            "value": None if value is None else value[: self.KEEP].decode("utf-8", "replace"),
        }
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a") as f:
            f.write(json.dumps(line) + "\n")


def _private_dir(path: Path) -> None:
    """``path`` and missing parents, created 0700."""
    if not path.is_dir():
        path.mkdir(mode=0o700, parents=True, exist_ok=True)


def _fallback_dir(state_dir: Path | None, dataset: str) -> Path:
    """Where dead letters go when the topic refuses them: the state directory; without
    one, a per-user directory under the system's temp dir (never the working directory)."""
    if state_dir is not None:
        return Path(state_dir)
    import tempfile

    return Path(tempfile.gettempdir()) / f"fabric-{os.getuid()}" / dataset


def fingerprint(msg: Any) -> list[int]:
    """[offset, timestamp, CRC-32 of key and value]: tells this message from any other
    that later holds the same offset (a recreated topic)."""
    key, value = msg.key(), msg.value()
    crc = zlib.crc32(value or b"", zlib.crc32(key or b""))
    return [msg.offset(), msg.timestamp()[1], crc]


def key_parser(t: pa.DataType, dataset: str) -> Callable[[bytes], Any]:
    """Message key bytes -> a value of the key column's type (for tombstones)."""
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return lambda b: b.decode("utf-8")
    if pa.types.is_integer(t):
        return lambda b: int(b.decode("ascii").strip())
    if pa.types.is_binary(t):
        return bytes

    def parse(b: bytes) -> Any:
        return pa.scalar(json.loads(b), t).as_py()

    return parse


class KafkaIngestor:
    """Feeds one dataset from one topic in a background thread (or ``run_until`` in the caller's)."""

    def __init__(
        self,
        source: str,
        dataset: DatasetLike,
        options: IngestOptions,
        *,
        tracker: FreshnessTracker | None = None,
        state_dir: Path | None = None,
        start_offsets: Mapping[int, int] | None = None,
        on_checkpoint: Callable[[checkpoint.Checkpoint], None] | None = None,
        resume: Mapping[str, Any] | None = None,
        recovery: str | None = None,
        dead_letter_dir: Path | None = None,
    ):
        """``resume``: the meta of the checkpoint the dataset was loaded from (its topic id
        and fingerprints are checked against the broker); ``recovery``: why the dataset is
        being rebuilt or replayed (an unusable checkpoint), reported until caught up;
        ``dead_letter_dir``: where refused dead letters go (default ``state_dir``)."""
        self.source = source
        self.dataset = dataset
        self.options = options
        self.tracker = tracker
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self.on_checkpoint = on_checkpoint
        self.next_offsets: dict[int, int] = dict(start_offsets or {})
        self.start_offsets = dict(self.next_offsets)
        resume = resume or {}
        # partition -> fingerprint() of the last message applied (checked against the broker)
        self.fingerprints: dict[int, list[int]] = {
            int(p): list(f) for p, f in (resume.get("fingerprints") or {}).items()
        }
        self.topic_id: str | None = resume.get("topic_id")
        self.decoder = JsonDecoder(dataset.schema)
        self.parse_key = key_parser(dataset.schema.field(dataset.key).type, dataset.name)
        self.dlq = DeadLetterSink(options, dataset.name, dead_letter_dir or self.state_dir)
        self.stats = IngestStats()
        self.lag_messages: int | None = None  # measured, then moved down by what is applied
        self._exact_lag: int | None = None  # the last measurement, None once a batch is applied
        self.partitions: list[int] = []
        self._assigned: set[int] = set()
        self.errors: dict[str, str] = {}  # kind -> message, until that kind succeeds
        self.recovering: str | None = recovery
        self._rebuild: str | None = None  # set by the lag thread: rebuild on the ingest thread
        self._verify_at = 0.0  # monotonic time of the next topic check (0: at once)
        self._suspect_at = 0.0  # the same, when the watermarks look truncated
        self._anchors: dict[int, list[int]] | None = None  # fingerprints at the last check
        # fingerprints when the broker went away: checked first once it is back (a broker
        # killed with -9 may come back without its last messages, and take new ones there)
        self._outage_anchors: dict[int, list[int]] | None = None
        self._consumer: Consumer | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dirty = False
        self._last_ckpt = time.monotonic()
        self._next_lag = 0.0
        self._lag_backoff = options.lag_interval
        self._md_at = 0.0
        self._applied_cond = threading.Condition()
        self._gen = 0  # batches applied; a lag measurement spanning a batch is not exact
        self._repartition = False  # the lag thread saw new partitions: assign them
        self._lag_thread: threading.Thread | None = None
        if tracker is not None:
            tracker.register_source(source, uri=f"kafka://{options.topic}")
            if recovery is not None:
                tracker.begin_recovery(source, recovery)

    @property
    def last_error(self) -> str | None:
        """The most recent error still standing (see ``errors``)."""
        return next(reversed(self.errors.values()), None)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> KafkaIngestor:
        self._thread = threading.Thread(
            target=self._run_safely, name=f"fabric-ingest-{self.source}", daemon=True
        )
        self._lag_thread = threading.Thread(  # (set before the ingest thread looks at it)
            target=self._lag_loop, name=f"fabric-lag-{self.source}", daemon=True
        )
        self._thread.start()
        self._lag_thread.start()
        return self

    def stop(self, checkpoint_now: bool = True, timeout: float = 30.0) -> None:
        self._stop.set()
        for t in (self._thread, self._lag_thread):
            if t is not None:
                t.join(timeout)
        self._thread = self._lag_thread = None
        if checkpoint_now and self._dirty:
            self.checkpoint()
        self._close()

    def run_until(
        self, done: Callable[[KafkaIngestor], bool], timeout: float | None = None
    ) -> bool:
        """Run the loop in this thread until ``done(self)`` or ``timeout``; True if done."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._open()
        while not self._stop.is_set():
            if done(self):
                return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            self.step()
        return False

    #: errors that mean the dataset may be missing data (a checkpoint or dead-letter
    #: problem does not: the rows are there)
    _BLOCKING = ("broker", "consume", "apply", "lag")

    def caught_up(self) -> bool:
        """The last watermark measurement, taken after the last batch, found no lag."""
        return (
            self._exact_lag == 0
            and self._rebuild is None
            and not any(k in self.errors for k in self._BLOCKING)
        )

    def wait_caught_up(self, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        with self._applied_cond:
            while not self.caught_up():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._applied_cond.wait(min(left, 0.1))
        return True

    def _run_safely(self) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            try:
                if self._consumer is None:
                    self._open()
                self.step()
                backoff = 0.5
            except Exception as exc:  # never let the ingest thread die: report, back off, retry
                self._error("apply", f"{type(exc).__name__}: {exc}")
                log.exception(
                    "ingest %s: step failed; reading the batch again in %.1fs", self.source, backoff
                )
                # the consumer is past the batch that failed: rewind it to the next offsets
                # to apply (a reopen assigns there), so the batch is read again, not lost
                self._close()
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)

    # ------------------------------------------------------------------ consumer

    def _consumer_config(self) -> dict[str, Any]:
        return {
            "group.id": self.options.group_id,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "reconnect.backoff.ms": 100,
            "reconnect.backoff.max.ms": 5000,
            "fetch.max.bytes": max(52428800, self.options.max_message_bytes * 2),
            "error_cb": self._on_kafka_error,
            "logger": logging.getLogger("fabric.ingest.librdkafka"),
            **dict(self.options.consumer_config),
        }

    def _open(self) -> None:
        if self._consumer is not None:
            return
        self._consumer = self.options.connection.new_consumer(self._consumer_config())
        self._assigned = set()
        self.partitions = []
        self._measure_lag()  # reads the topic's partitions and assigns them

    def _close(self) -> None:
        if self._consumer is not None:
            try:
                self._consumer.close()
            except Exception as exc:
                log.debug("closing consumer: %s", exc)
            self._consumer = None

    def _reopen(self) -> None:
        self._close()
        self._open()

    def _assign_new(self) -> None:
        """Assign every partition not yet assigned, at its next offset (or the beginning).

        The dataset is a full replica of the topic, so the ingestor assigns all partitions
        itself (no group rebalancing that would split them between processes); the group
        id still names where offsets are committed.
        """
        assert self._consumer is not None
        new = [p for p in self.partitions if p not in self._assigned]
        if not new:
            return
        tps = [
            TopicPartition(self.options.topic, p, self.next_offsets.get(p, OFFSET_BEGINNING))
            for p in new
        ]
        self._consumer.incremental_assign(tps)
        self._assigned.update(new)
        log.info("ingest %s: assigned %s", self.source, [(tp.partition, tp.offset) for tp in tps])

    #: client errors that mean the source is unreachable now (others, such as one idle
    #: connection being closed, are logged; a real outage also fails the next watermark query)
    _DOWN = frozenset(
        {KafkaError._ALL_BROKERS_DOWN, KafkaError._AUTHENTICATION, KafkaError._UNKNOWN_TOPIC}
    )

    def _on_kafka_error(self, err: KafkaError) -> None:
        if err.fatal() or err.code() in self._DOWN:
            self._error("broker", f"kafka: {err.str()}")
        else:
            log.info("ingest %s: kafka: %s", self.source, err.str())

    def _error(self, kind: str, message: str) -> None:
        """``kind`` failed: the error stands until ``_ok(kind)`` (that kind succeeded)."""
        self.stats.errors += 1
        if kind == "broker" and self._outage_anchors is None:
            self._outage_anchors = dict(self.fingerprints)
        self.errors.pop(kind, None)
        self.errors[kind] = message  # the newest last
        if self.tracker is not None:
            self.tracker.record_error(self.source, message, kind=kind)

    def _ok(self, kind: str) -> None:
        if self.errors.pop(kind, None) is not None:
            log.info("ingest %s: %s works again", self.source, kind)
            if self.tracker is not None:
                self.tracker.clear_error(self.source, kind=kind)

    # ------------------------------------------------------------------ the loop

    def step(self) -> int:
        """One poll + apply + (maybe) lag measurement and checkpoint; returns messages applied."""
        assert self._consumer is not None
        if self._rebuild is not None:
            self._rebuild_now(self._rebuild)
            assert self._consumer is not None
        msgs = self._poll()
        if any(map(Message.error, msgs)):  # (a KafkaError is truthy)
            good = [m for m in msgs if m.error() is None]
        else:
            good = msgs
        consume_ok = True
        if len(good) < len(msgs):
            for m in msgs:
                err = m.error()
                if err is not None and err.code() != KafkaError._PARTITION_EOF:
                    consume_ok = False
                    self._error("consume", f"kafka: {err.str()}")
                    if err.code() in (
                        KafkaError._UNKNOWN_TOPIC,
                        KafkaError.UNKNOWN_TOPIC_OR_PART,
                        KafkaError.OFFSET_OUT_OF_RANGE,
                        KafkaError._AUTO_OFFSET_RESET,
                    ):
                        self._verify_at = 0.0  # is it still the same topic? check at once
        n = self._apply(good) if good else 0
        if consume_ok and (n or not msgs):
            self._ok("consume")
        now = time.monotonic()
        if self._repartition:
            self._repartition = False
            self._assign_new()
        # a full batch means behind for sure: the in-loop watermark query (a blocking round
        # trip per partition) is deferred up to 4 intervals; the estimate moves with what
        # is applied meanwhile
        behind = n >= self.options.batch_size and now < self._next_lag + 4 * self._lag_backoff
        if self._lag_thread is None and now >= self._next_lag and not behind:
            self._measure_lag()
        if (
            self.options.checkpoint_interval
            and self._dirty
            and now - self._last_ckpt >= self.options.checkpoint_interval
        ):
            try:
                self.checkpoint()
            except Exception as exc:  # e.g. ENOSPC: the rows are in memory; retry later
                self._last_ckpt = now
                self._error("checkpoint", f"checkpoint to {self.state_dir} failed: {exc}")
                log.warning("ingest %s: checkpoint failed: %s", self.source, exc)
        return n

    def _poll(self) -> list[Any]:
        """Up to ``batch_size`` messages, returned as soon as any are there: wait up to
        ``poll_timeout`` for the first, then take what librdkafka already prefetched
        without waiting. (``consume(n, timeout)`` alone waits the whole timeout unless n
        arrive, which adds up to ``poll_timeout`` to every message's latency when caught
        up; under a backlog both fill the batch at once.)"""
        assert self._consumer is not None
        first = self._consumer.consume(1, self.options.poll_timeout)
        if not first or self.options.batch_size <= 1:
            return first
        return first + self._consumer.consume(self.options.batch_size - 1, 0)

    def _apply(self, msgs: Sequence[Any]) -> int:
        ds = self.dataset
        limit = self.options.max_message_bytes
        values: list[bytes] = []
        where: list[int] = []  # index into msgs of each value to decode
        tombstones: dict[Any, int] = {}  # key -> index of its last tombstone in the batch
        # partition -> offset after its last message in the batch (offset order per partition)
        last: dict[Any, Any] = dict(zip(map(Message.partition, msgs), msgs))
        ends: dict[int, int] = {p: m.offset() + 1 for p, m in last.items()}
        # (type, time) pairs: the max has a real time if any message has one (type 0: none)
        ts_type, ts = max(map(Message.timestamp, msgs))
        newest = ts if ts_type and ts > 0 else 0
        dead = 0
        vals: list[Any] = list(map(Message.value, msgs))
        if None not in vals and max(map(len, vals)) <= limit:  # the common case: all to decode
            values, where = vals, list(range(len(vals)))
        else:
            for i, (m, v) in enumerate(zip(msgs, vals)):
                if v is None:
                    dead += self._tombstone(m, i, tombstones)
                elif len(v) > limit:
                    self.dlq.send(m, f"value of {len(v)} bytes exceeds max_message_bytes={limit}")
                    dead += 1
                else:
                    values.append(v)
                    where.append(i)
        rows: pa.RecordBatch | None = None
        row_msg: list[int] = []
        if values:
            rows, row_msg, bad = self._decode(msgs, values, where)
            dead += bad
        deletes: list[Any] = []
        if tombstones:  # per key, the later of a tombstone and an upsert wins
            keys = rows.column(ds.key).to_pylist() if rows is not None else []
            last_upsert: dict[Any, int] = {}
            for k, i in zip(keys, row_msg):
                last_upsert[k] = i
            deletes = [k for k, i in tombstones.items() if last_upsert.get(k, -1) < i]
            keep = [j for j, k in enumerate(keys) if tombstones.get(k, -1) < row_msg[j]]
            if rows is not None and len(keep) < rows.num_rows:
                rows = rows.take(pa.array(keep, pa.int64()))
                row_msg = [row_msg[j] for j in keep]
        if deletes:
            ds.delete(deletes)
        if rows is not None and rows.num_rows:
            try:
                ds.upsert(rows)  # several versions of a key in one batch: the last one wins
            except Exception as exc:  # a row the decoder let through but the dataset refuses
                dead += self._upsert_row_by_row(rows, msgs, row_msg, exc)
        # the dataset now holds the batch: dead letters out, offsets committed, position advanced
        self.dlq.flush()
        if self.dlq.problem is None:
            self._ok("dead_letter")
        elif self.errors.get("dead_letter") != self.dlq.problem:
            self._error("dead_letter", self.dlq.problem)
        for r in self.dlq.truncated:
            msg = (f"{r['topic']}[{r['partition']}]@{r['offset']}: {r['error']}; dead-lettered to "
                   f"{self.options.dlq_topic} truncated to {DeadLetterSink.KEEP:,} of {r['truncated']:,} bytes")  # fmt: skip
            log.warning("ingest %s: %s", self.source, msg)
            if self.tracker is not None:
                self.tracker.note(self.source, msg)
        self.dlq.truncated.clear()
        for p, o in ends.items():
            if o > self.next_offsets.get(p, -1):
                self.next_offsets[p] = o
                self.fingerprints[p] = fingerprint(last[p])
        self._commit()
        self._ok("apply")
        n = len(msgs)
        st = self.stats
        st.applied += n
        st.upserted += 0 if rows is None else rows.num_rows
        st.deleted += len(deletes)
        st.dead_letters += dead
        st.batches += 1
        self._dirty = True
        self._exact_lag = None
        self._gen += 1
        if self.tracker is not None:
            self.tracker.record_applied(self.source, n, newest / 1000.0 if newest else None)
            if dead:
                self.tracker.record_dead_letters(self.source, dead, self.dlq.recent[-1])
            if self.lag_messages is not None:  # moved by what was applied until measured again
                self.lag_messages = max(0, self.lag_messages - n)
                self.tracker.update_lag(self.source, self.lag_messages)
        with self._applied_cond:
            self._applied_cond.notify_all()
        return n

    def _tombstone(self, m: Any, i: int, tombstones: dict[Any, int]) -> int:
        """Record a delete; returns 1 if the message was dead-lettered instead."""
        k = m.key()
        if k is None:
            self.dlq.send(m, "tombstone without a message key: cannot tell which row to delete")
            return 1
        try:
            tombstones[self.parse_key(k)] = i
        except (ValueError, UnicodeDecodeError, pa.ArrowInvalid) as exc:
            self.dlq.send(
                m, f"tombstone key {k[:64]!r} is not a valid {self.dataset.key!r} value: {exc}"
            )
            return 1
        return 0

    def _decode(
        self, msgs: Sequence[Any], values: list[bytes], where: list[int]
    ) -> tuple[pa.RecordBatch, list[int], int]:
        """Decoded rows, the message index of each row, and how many were dead-lettered."""
        key = self.dataset.key
        batch, errors = self.decoder.decode(values)
        row_msg = where
        if errors:
            bad = {i for i, _ in errors}
            for i, e in errors:
                self.dlq.send(msgs[where[i]], e)
            row_msg = [w for i, w in enumerate(where) if i not in bad]
        dead = len(errors)
        keycol = batch.column(key)
        if keycol.null_count:
            nulls = keycol.is_null().to_pylist()
            for j, isnull in enumerate(nulls):
                if isnull:
                    self.dlq.send(msgs[row_msg[j]], f"missing key field {key!r}")
            dead += keycol.null_count
            keep = [j for j, isnull in enumerate(nulls) if not isnull]
            batch = batch.take(pa.array(keep, pa.int64()))
            row_msg = [row_msg[j] for j in keep]
        return batch, row_msg, dead

    def _upsert_row_by_row(
        self, rows: pa.RecordBatch, msgs: Sequence[Any], row_msg: list[int], exc: Exception
    ) -> int:
        log.warning("ingest %s: batch upsert failed (%s); retrying row by row", self.source, exc)
        dead = 0
        for j in range(rows.num_rows):
            try:
                self.dataset.upsert(rows.slice(j, 1))
            except Exception as e:
                self.dlq.send(msgs[row_msg[j]], f"dataset refused the row: {e}")
                dead += 1
        return dead

    def _commit(self) -> None:
        assert self._consumer is not None
        offs = [TopicPartition(self.options.topic, p, o) for p, o in self.next_offsets.items()]
        try:
            self._consumer.commit(offsets=offs, asynchronous=True)
        except KafkaException as exc:  # e.g. during a rebalance; the checkpoint is the truth
            log.debug("commit: %s", exc)

    # ------------------------------------------------------------------ lag

    def _lag_loop(self) -> None:
        """Measure lag on a consumer of its own, so it keeps moving during a long upsert
        (an HNSW fold, a checkpoint) and a producer outrunning ingestion is seen at once."""
        c: Consumer | None = None
        while not self._stop.wait(self._lag_backoff):
            try:
                if c is None:
                    c = self.options.connection.new_consumer({"group.id": f"{self.options.group_id}.lag",
                                  "logger": logging.getLogger("fabric.ingest.librdkafka")})  # fmt: skip
                self._measure_lag(c)
                self._ok("lag")
            except Exception as exc:  # keep measuring; report
                self._error("lag", f"lag measurement: {type(exc).__name__}: {exc}")
        if c is not None:
            c.close()

    def _measure_lag(self, c: Consumer | None = None) -> None:
        """Watermarks of every partition against the next offsets to apply (see freshness)."""
        in_loop = c is None
        c = c or self._consumer
        assert c is not None
        now = time.monotonic()
        gen, offsets = self._gen, dict(self.next_offsets)
        try:
            if not self.partitions or now - self._md_at > 30:
                md = c.list_topics(self.options.topic, timeout=5)
                t = md.topics.get(self.options.topic)
                if t is None or t.error is not None or not t.partitions:
                    why = (
                        t.error.str() if t is not None and t.error is not None else "no partitions"
                    )
                    raise KafkaException(
                        f"topic {self.options.topic!r} is not available on {self.options.bootstrap} ({why}); "
                        "create it or fix 'from:' in fabric.yaml"
                    )
                only = self.options.partitions
                new = sorted(p for p in t.partitions if only is None or p in only)
                self._md_at = now
                if new != self.partitions:
                    self.partitions = new
                    if in_loop:
                        self._assign_new()
                    else:  # only the ingest thread touches its consumer's assignment
                        self._repartition = True
            total = 0
            detail: dict[str, Any] = {}
            for p in self.partitions:
                low, high = c.get_watermark_offsets(
                    TopicPartition(self.options.topic, p), timeout=2, cached=False
                )
                nxt = offsets.get(p, low)
                lag = max(0, high - max(nxt, low))
                total += lag
                detail[str(p)] = {"low": low, "high": high, "next": nxt, "lag": lag}
        except KafkaException as exc:
            self._error("broker", f"kafka: {exc}")
            self._lag_backoff = min(self._lag_backoff * 2, 5.0)
            self._next_lag = now + self._lag_backoff
            return
        self._lag_backoff = self.options.lag_interval
        self._next_lag = time.monotonic() + self.options.lag_interval
        self._ok("broker")
        if self._outage_anchors is not None:
            self._verify_at = 0.0  # back after an outage: the same messages? check now
        # the end below the next offset: truncated or recreated (noida-db loses acknowledged
        # messages on kill -9) -- or Tansu, whose high watermark lags: the last message
        # applied, read again, tells (at most once per verify_interval when it is there)
        behind = any(d["high"] < offsets.get(int(p), 0) for p, d in detail.items())
        # on the ingest thread only when resuming (before the first batch), else the lag
        # thread's: reading messages again must not stall ingestion
        defer = (
            in_loop and self._lag_thread is not None and not (self.fingerprints or self.topic_id)
        )
        if (
            self._rebuild is None
            and not defer
            and (now >= self._verify_at or (behind and now >= self._suspect_at))
        ):
            self._verify_at = now + self.options.verify_interval
            if behind:
                self._suspect_at = now + self.options.verify_interval
            self._verify(offsets, detail)
        if self._rebuild is not None:  # what was measured counts against an emptied dataset
            total = sum(d["high"] - d["low"] for d in detail.values())
        self.lag_messages = total
        if gen == self._gen and self._rebuild is None:  # no batch applied meanwhile: exact
            self._exact_lag = total
            if total == 0 and self.recovering is not None:
                self._end_recovery()
        if self.tracker is not None:
            self.tracker.update_lag(self.source, total, {"partitions": detail})
        with self._applied_cond:
            self._applied_cond.notify_all()

    # ------------------------------------------------------------------ same topic?

    def _topic_id(self) -> str | None:
        """The broker's topic id, or None when it has none (noida-db: all zeros)."""
        from confluent_kafka import TopicCollection

        admin = self.options.connection.new_admin()
        d = admin.describe_topics(TopicCollection([self.options.topic]), request_timeout=5)[
            self.options.topic
        ].result(6)
        tid = str(d.topic_id) if d.topic_id is not None else None
        return None if tid is None or set(tid) <= {"A", "="} else tid

    def _verify(self, offsets: Mapping[int, int], detail: Mapping[str, Any]) -> None:
        """Is the topic still the one the offsets were applied from? Topic id (if any), then
        per partition the fingerprint of the last message applied, read again. A message
        that cannot be read (deleted by retention, broker busy) proves nothing."""
        try:
            tid = self._topic_id()
        except Exception as exc:  # a broker without DescribeTopics: fingerprints only
            log.debug("describe_topics: %s", exc)
            tid = None
        if tid is not None:
            if self.topic_id is not None and tid != self.topic_id:
                self._request_rebuild(
                    f"topic {self.options.topic!r} was recreated (topic id {self.topic_id} -> {tid})"
                )
                return
            self.topic_id = tid
        fps = dict(self.fingerprints)
        ends = {p: d["high"] for p, d in ((int(k), d) for k, d in detail.items())}
        for p, nxt in offsets.items():
            if p in ends and ends[p] < nxt and fps.get(p, [None])[0] != nxt - 1:
                return self._request_rebuild(  # nothing to read again: trust the watermark
                    f"partition {p} ends at offset {ends[p]} but the dataset holds messages "
                    f"up to {nxt - 1}: the topic was truncated or recreated"
                )
        # which message to read again, per partition: the last applied when the end looks
        # truncated; else the last applied as of the previous check (an "anchor"): a topic
        # re-created in between no longer holds it, even if the ingestor has meanwhile read
        # on from the new topic at the old offsets (its last applied is then the new one's)
        anchors = self._anchors if self._anchors is not None else fps
        outage = self._outage_anchors or {}
        want: dict[int, list[int]] = {}
        for p, f in fps.items():
            if str(p) not in detail:
                continue
            nxt = offsets.get(p, 0)
            if p in outage:
                cand = outage[p]
            else:
                cand = f if ends.get(p, 0) < nxt and f[0] == nxt - 1 else anchors.get(p, f)
            if detail[str(p)]["low"] <= cand[0]:
                want[p] = cand
        if not want:
            self._anchors = fps
            self._outage_anchors = None
            return None
        v = self.options.connection.new_consumer(
            {"group.id": f"{self.options.group_id}.verify", "enable.auto.commit": False,
             "enable.partition.eof": True, "auto.offset.reset": "error",
             "logger": logging.getLogger("fabric.ingest.librdkafka")}
        )  # fmt: skip
        seen: dict[int, list[int] | None] = {}  # None: not there (out of range, at the end)
        try:
            v.assign([TopicPartition(self.options.topic, p, f[0]) for p, f in want.items()])
            deadline = time.monotonic() + 5
            while len(seen) < len(want) and time.monotonic() < deadline:
                for m in v.consume(len(want), 0.5):
                    p = m.partition()
                    if p not in want or p in seen:
                        continue
                    if m.error() is None:
                        seen[p] = fingerprint(m)
                    elif m.error().code() in (
                        KafkaError._PARTITION_EOF,
                        KafkaError._AUTO_OFFSET_RESET,
                        KafkaError.OFFSET_OUT_OF_RANGE,
                    ):
                        seen[p] = None
        finally:
            v.close()
        for p, fp in seen.items():
            if fp is None:
                if ends.get(p, 0) <= want[p][0]:
                    return self._request_rebuild(
                        f"partition {p} ends at offset {ends.get(p)} and no longer holds offset "
                        f"{want[p][0]}, the last applied: the topic was truncated or recreated"
                    )
            elif fp != want[p]:
                return self._request_rebuild(
                    f"partition {p} offset {fp[0]} holds another message than the one applied "
                    f"(timestamp {fp[1]} vs {want[p][1]}): topic {self.options.topic!r} was recreated or truncated"
                )
        self._anchors = fps
        if len(seen) == len(want):  # every one read: the outage left them in place
            self._outage_anchors = None
        return None

    def _request_rebuild(self, reason: str) -> None:
        """From either thread: the ingest thread empties the dataset and re-reads the topic."""
        log.warning("ingest %s: %s; rebuilding the dataset from the beginning", self.source, reason)
        self._rebuild = reason
        self._exact_lag = None
        if self.tracker is not None:
            self.tracker.begin_recovery(self.source, f"{reason}; rebuilding from the beginning")

    def _rebuild_now(self, reason: str) -> None:
        """Empty the dataset and read every partition again from its beginning."""
        ds = self.dataset
        keys = ds.to_table([ds.key]).column(ds.key).to_pylist() if ds.count() else []
        if keys:
            ds.delete(keys)
        self.next_offsets.clear()
        self.fingerprints.clear()
        self._anchors = self._outage_anchors = None
        self.topic_id = None
        self._close()
        self._dirty = True
        self.recovering = reason
        self._rebuild = None
        self.stats.rebuilds += 1
        log.warning(
            "ingest %s: removed %d rows; re-reading %s", self.source, len(keys), self.options.topic
        )
        self._open()

    def _end_recovery(self) -> None:
        reason, self.recovering = self.recovering, None
        log.warning("ingest %s: caught up after: %s", self.source, reason)
        if self.tracker is not None:
            self.tracker.end_recovery(
                self.source, f"caught up ({self.dataset.count()} rows) after: {reason}"
            )

    # ------------------------------------------------------------------ checkpoints

    def checkpoint(self) -> checkpoint.Checkpoint | None:
        """Snapshot + offsets, atomically. Called from the ingest thread (or after stop)."""
        if self.state_dir is None:
            return None
        ck = checkpoint.write(
            self.state_dir,
            self.dataset.save,
            self.next_offsets,
            {
                "topic": self.options.topic,
                "group": self.options.group_id,
                "dataset": self.dataset.name,
                "applied_total": self.stats.applied,
                "topic_id": self.topic_id,
                "fingerprints": {str(p): f for p, f in sorted(self.fingerprints.items())},
            },
        )
        self._ok("checkpoint")
        self._dirty = False
        self._last_ckpt = time.monotonic()
        self.stats.checkpoints += 1
        self.stats.last_checkpoint_at = time.time()
        if self.on_checkpoint is not None:
            self.on_checkpoint(ck)
        return ck
