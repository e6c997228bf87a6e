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

Broker down: the loop keeps running (the dataset keeps serving reads), the source is
marked stale with the error, librdkafka reconnects with backoff, and consumption resumes
from the in-memory positions. The ingestor assigns every partition itself (the dataset is
a full replica of the topic; a group rebalance would split partitions between processes)
and commits to its group, so tools that read group lag see it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
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
    consumer_config: Mapping[str, Any] = field(default_factory=dict)
    #: the ``connectors.kafka.KafkaConnection`` that makes every client (consumer, lag
    #: consumer, dead-letter producer, admin) with the connection's security/config;
    #: None: a plain one for ``bootstrap``
    connection: Any = field(default=None, compare=False)

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


class DeadLetterSink:
    """``<topic>.dlq`` on the same cluster (headers carry where and why), or a JSON-lines file."""

    def __init__(self, options: IngestOptions, dataset: str):
        self.options = options
        self.dataset = dataset
        self.mode = options.dead_letter
        self.recent: deque[dict[str, Any]] = deque(maxlen=100)
        self._producer: Producer | None = None
        self._failed: list[dict[str, Any]] = []
        self._log_path: Path | None = None
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
        headers: list[tuple[str, str | bytes | None]] = [
            (f"fabric.{k}", str(v).encode()) for k, v in record.items() if k != "at"
        ]

        def delivered(err: Any, _m: Any, record: dict[str, Any] = record, msg: Any = msg) -> None:
            if err is not None:
                record = {**record, "dlq_error": str(err)}
                self._failed.append({"record": record, "msg": msg})

        self._producer.produce(
            self.options.dlq_topic,
            value=msg.value(),
            key=msg.key(),
            headers=headers,
            on_delivery=delivered,
        )

    def flush(self, timeout: float = 10.0) -> None:
        """Before offsets are committed: every dead letter is delivered or logged."""
        if self._producer is not None:
            left = self._producer.flush(timeout)
            if left:
                log.warning("%d dead letters not delivered to %s", left, self.options.dlq_topic)
        for item in self._failed:
            path = Path(".fabric") / "dead-letters.jsonl"
            self._write_log(item["record"], item["msg"], path)
        self._failed.clear()

    def _write_log(self, record: dict[str, Any], msg: Any, path: Path | None = None) -> None:
        path = path or self._log_path
        assert path is not None
        path.parent.mkdir(parents=True, exist_ok=True)
        value = msg.value()
        key = msg.key()
        line = {
            **record,
            "key": None if key is None else key.decode("utf-8", "replace"),
            "value": None if value is None else value[:65536].decode("utf-8", "replace"),
        }
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


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
    ):
        self.source = source
        self.dataset = dataset
        self.options = options
        self.tracker = tracker
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self.on_checkpoint = on_checkpoint
        self.next_offsets: dict[int, int] = dict(start_offsets or {})
        self.start_offsets = dict(self.next_offsets)
        self.decoder = JsonDecoder(dataset.schema)
        self.parse_key = key_parser(dataset.schema.field(dataset.key).type, dataset.name)
        self.dlq = DeadLetterSink(options, dataset.name)
        self.stats = IngestStats()
        self.lag_messages: int | None = None  # measured, then moved down by what is applied
        self._exact_lag: int | None = None  # the last measurement, None once a batch is applied
        self.partitions: list[int] = []
        self._assigned: set[int] = set()
        self.last_error: str | None = None
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

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> KafkaIngestor:
        self._thread = threading.Thread(
            target=self._run_safely, name=f"fabric-ingest-{self.source}", daemon=True
        )
        self._thread.start()
        self._lag_thread = threading.Thread(
            target=self._lag_loop, name=f"fabric-lag-{self.source}", daemon=True
        )
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

    def caught_up(self) -> bool:
        """The last watermark measurement, taken after the last batch, found no lag."""
        return self._exact_lag == 0 and self.last_error is None

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
                self._error(f"{type(exc).__name__}: {exc}")
                log.exception("ingest %s: step failed; retrying in %.1fs", self.source, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
                err = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
                if isinstance(err, KafkaError) and err.fatal():
                    self._reopen()

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
            self._error(f"kafka: {err.str()}")
        else:
            log.info("ingest %s: kafka: %s", self.source, err.str())

    def _error(self, message: str) -> None:
        self.stats.errors += 1
        self.last_error = message
        if self.tracker is not None:
            self.tracker.record_error(self.source, message)

    # ------------------------------------------------------------------ the loop

    def step(self) -> int:
        """One poll + apply + (maybe) lag measurement and checkpoint; returns messages applied."""
        assert self._consumer is not None
        msgs = self._poll()
        if any(map(Message.error, msgs)):  # (a KafkaError is truthy)
            good = [m for m in msgs if m.error() is None]
        else:
            good = msgs
        if len(good) < len(msgs):
            for m in msgs:
                err = m.error()
                if err is not None and err.code() != KafkaError._PARTITION_EOF:
                    self._error(f"kafka: {err.str()}")
        n = self._apply(good) if good else 0
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
            self.checkpoint()
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
        for p, o in ends.items():
            if o > self.next_offsets.get(p, -1):
                self.next_offsets[p] = o
        self._commit()
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
                self.tracker.record_dead_letters(self.source, dead)
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
            except Exception as exc:  # keep measuring; report
                self._error(f"lag measurement: {type(exc).__name__}: {exc}")
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
                new = sorted(t.partitions)
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
            self._error(f"kafka: {exc}")
            self._lag_backoff = min(self._lag_backoff * 2, 5.0)
            self._next_lag = now + self._lag_backoff
            return
        self._lag_backoff = self.options.lag_interval
        self._next_lag = time.monotonic() + self.options.lag_interval
        self.lag_messages = total
        if gen == self._gen:  # no batch applied meanwhile: an exact reading
            self._exact_lag = total
        if self.last_error is not None:
            log.info("ingest %s: broker reachable again", self.source)
            self.last_error = None
            if self.tracker is not None:
                self.tracker.clear_error(self.source)
        if self.tracker is not None:
            self.tracker.update_lag(self.source, total, {"partitions": detail})
        with self._applied_cond:
            self._applied_cond.notify_all()

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
            },
        )
        self._dirty = False
        self._last_ckpt = time.monotonic()
        self.stats.checkpoints += 1
        self.stats.last_checkpoint_at = time.time()
        if self.on_checkpoint is not None:
            self.on_checkpoint(ck)
        return ck
