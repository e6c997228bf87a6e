"""A Kafka topic as a directly scanned source (``kafka`` kind), through confluent-kafka.

Connection options: ``bootstrap`` (required), ``schemas`` (``{topic: {column: type}}``;
otherwise inferred from up to ``sample`` (200) messages), ``timestamp_field`` (a JSON
field holding the event time; default: the message timestamp), ``timeout`` (10 s:
every broker round trip: metadata, watermarks, a consume without progress; a query's
larger budget never stretches it), ``security`` (SASL/TLS librdkafka settings), ``config``
(extra librdkafka settings; both reach every client through ``client_config``), ``end``
(``high_watermark`` or ``eof``), ``cache`` (true), ``cache_max_messages`` (1,000,000)
and ``cache_max_bytes`` (256 MiB).

A scan is bounded: it captures the high watermark of every partition when it starts
(``end: eof`` instead reads each partition until the broker says it is at its end, for
brokers whose listed high watermarks are wrong, such as Tansu) and returns exactly the
messages below those offsets, so a busy topic cannot make a scan endless. Nothing joins
a consumer group and nothing is committed (``assign()`` only).

By default a scan reads the topic through the connection's *tail cache* (``_Tail``):
the decoded Arrow rows of the topic with partition/offset/timestamp, kept in memory,
caught up at each scan from the cached positions to the watermarks captured at its
start, so a repeated scan decodes only the new messages; time range, filters,
``latest_by`` and projection then run on the cached Arrow data with pyarrow. Deleted or
recreated topics, moved low watermarks and added partitions are reconciled at every
scan; a topic over the bounds is streamed instead (the scan's ``request.metrics.cache``
says which).
Without the cache (``cache: false``, or over the bounds) a new consumer reads every
partition from its low watermark; with ``time_range`` it seeks with
``offsets_for_times`` and also checks every record's time, so a broker whose time index
is wrong (Tansu) gives a slower but still exact answer. JSON values are decoded into the
schema; bad messages are skipped and counted (``request.metrics.bad_records``, reported
in ``res.stats``), never fatal. Filters that
pyarrow can evaluate are applied here (EXACT), before ``latest_by`` (which keeps the
newest record per key: greatest timestamp, then partition and offset).
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from connectors._util import flat_options, schema_from_spec, typed_params
from connectors.arrow_expr import canonical_floats, to_arrow, utcnow
from connectors.base import (
    Capability,
    Connection,
    Pushdown,
    ScanRequest,
    Source,
    SourceError,
    Statistics,
    UnknownObjectError,
    Watermark,
    check_columns,
)
from connectors.json_decode import decode_json_messages, infer_schema
from connectors.s3 import arrow_filter_ok
from dsl.ast import and_all

__all__ = ["KafkaConnection", "KafkaSource", "decode_json_messages"]

# ------------------------------------------------------------------------------ tail cache

_ZERO_ID = "AAAAAAAAAAAAAAAAAAAAAA"  # the all-zero topic id of brokers without topic ids
_BAD_BYTES = 100  # what one remembered bad message is charged against cache_max_bytes


@dataclass(frozen=True)
class _Snapshot:
    """What one scan sees of a tail: immutable Arrow data plus the offsets it stops at."""

    table: pa.Table  # schema + __partition, __offset, __ts; may hold offsets >= end
    end: Mapping[int, int]  # per partition: the scan returns offsets below this
    masked: bool  # some partition holds rows at or beyond ``end`` (a concurrent catch-up)
    bad: tuple[tuple[int, int, float, str], ...]  # (partition, offset, ts, reason)
    newest: float | None
    caught_up: int  # messages read from the broker by this scan's catch-up
    resets: int


def _with_meta(schema: pa.Schema) -> pa.Schema:
    """``schema`` plus the message columns __partition, __offset and __ts."""
    return (
        schema.append(pa.field("__partition", pa.int32()))
        .append(pa.field("__offset", pa.int64()))
        .append(pa.field("__ts", pa.float64()))
    )


def _decode(
    values: list[Any], meta: list[tuple[int, int, float]], schema: pa.Schema
) -> tuple[pa.Table, list[tuple[int, str]]]:
    """The JSON messages ``values`` as a table of ``_with_meta(schema)`` (bad ones left
    out) and the bad ones as (index into ``values``, reason)."""
    batch, errs = decode_json_messages(values, schema)
    if errs:
        bad = {i for i, _ in errs}
        meta = [x for i, x in enumerate(meta) if i not in bad]
    arrays = [
        *batch.columns,
        pa.array([x[0] for x in meta], pa.int32()),
        pa.array([x[1] for x in meta], pa.int64()),
        pa.array([x[2] for x in meta], pa.float64()),
    ]
    return pa.Table.from_arrays(arrays, schema=_with_meta(schema)), errs


class _Recreated(Exception):
    """The log is shorter than the cache (``end: eof`` catch-up): reset and read again."""


class _Overflow(Exception):
    """The topic does not fit in the cache bounds; the scan streams instead."""


class _Tail:
    """The decoded contents of one topic, kept in memory and caught up on demand.

    One long-lived consumer, ``assign()``-ed to every partition (no group, no commits),
    keeps prefetching in librdkafka's background thread. A snapshot first reads the
    topic's partitions, topic id and watermarks (one metadata and one ListOffsets round
    trip), resets or trims what the broker no longer has, then consumes from the cached
    positions to the high watermarks captured at that moment (``end: eof``: a consumer
    opened for the catch-up reads from the cached positions until the broker reports
    each partition's end), decodes only the new messages and appends them. Catch-ups are
    serialized by a lock; scans filter the immutable snapshot outside it, concurrently.
    A compacted topic (``cleanup.policy`` with ``compact``) is not cached: compaction
    removes records the cache would keep returning.
    """

    def __init__(self, conn: KafkaConnection, topic: str, schema: pa.Schema):
        # a proxy: no reference cycle, so a forgotten connection is freed (and its tails
        # closed by the connection's finalizer) at once rather than by the cyclic GC,
        # which may free a librdkafka handle at an arbitrary point
        self.conn: KafkaConnection = weakref.proxy(conn)
        self.topic = topic
        self.schema = schema
        self.full = _with_meta(schema)
        self.lock = threading.Lock()
        self.consumer: Any = None
        self.closed = False
        self.topic_id: str | None = None
        self.max_messages = conn.cache_max_messages
        self.policy: str | None = None  # cleanup.policy, read once
        self.last_reset = ""
        self._clear()
        self.resets = 0

    def _clear(self) -> None:
        self.pos: dict[int, int] = {}  # next offset to read per partition
        self.first: dict[int, int] = {}  # lowest offset the cache may hold per partition
        self.chunks: list[pa.Table] = []
        self.table: pa.Table | None = None  # concatenation of chunks, rebuilt lazily
        self.rows = 0
        self.nbytes = 0
        self.bad: list[tuple[int, int, float, str]] = []
        self.newest: float | None = None

    def reset(self, why: str) -> None:
        """Forget everything (topic recreated, offsets went backwards)."""
        self._clear()
        self.topic_id = None
        self.resets += 1
        self.last_reset = why
        if self.consumer is not None:
            with contextlib.suppress(Exception):
                self.consumer.unassign()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self._clear()
            if self.consumer is not None:
                with contextlib.suppress(Exception):
                    self.consumer.close()
                self.consumer = None

    # -------------------------------------------------------------- broker state

    def _describe(self, timeout: float) -> tuple[list[int], str | None]:
        from confluent_kafka import KafkaError, KafkaException, TopicCollection

        fut = self.conn.admin().describe_topics(
            TopicCollection([self.topic]), request_timeout=timeout
        )[self.topic]
        try:
            d = fut.result(timeout + 1)
        except KafkaException as exc:
            if exc.args and exc.args[0].code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                self.reset("topic deleted")
                raise SourceError(
                    self.conn.uri(self.topic),
                    "the topic no longer exists",
                    hint="recreate the topic or remove the binding that reads it",
                ) from exc
            raise
        tid = str(d.topic_id) if d.topic_id is not None else None
        return sorted(p.id for p in d.partitions), (None if tid == _ZERO_ID else tid)

    def _cleanup_policy(self, timeout: float) -> str:
        from confluent_kafka.admin import ConfigResource

        try:
            fut = self.conn.admin().describe_configs(
                [ConfigResource("topic", self.topic)], request_timeout=timeout
            )
            entry = next(iter(fut.values())).result(timeout + 1).get("cleanup.policy")
        except Exception:  # a broker without DescribeConfigs: Kafka's default
            return "delete"
        return str(entry.value) if entry is not None and entry.value else "delete"

    def _reconcile(self, timeout: float) -> dict[int, int]:
        """Check the topic against the cache; returns the per-partition end offsets."""
        from confluent_kafka import TopicPartition

        if self.policy is None:
            self.policy = self._cleanup_policy(timeout)
        if "compact" in self.policy:
            raise _Overflow(
                f"cleanup.policy={self.policy}: compaction removes records a cache would keep"
            )
        parts, tid = self._describe(timeout)
        if tid is not None and self.topic_id is not None and tid != self.topic_id:
            self.reset("topic recreated (new topic id)")
        if any(p not in parts for p in self.pos):
            self.reset("partitions disappeared (topic recreated)")
        self.topic_id = tid
        marks = self.conn.list_offsets(self.topic, parts, timeout)
        if not self.conn.read_to_eof and any(
            hi < self.pos.get(p, 0) for p, (lo, hi) in marks.items()
        ):
            self.reset("offsets went backwards (topic recreated)")
        trim = {p: lo for p, (lo, hi) in marks.items() if p in self.first and lo > self.first[p]}
        if trim:  # retention / delete_records removed messages the cache still holds
            self._trim(trim)
        todo = sum(max(hi - max(lo, self.pos.get(p, lo)), 0) for p, (lo, hi) in marks.items())
        if self.rows + len(self.bad) + max(todo, 0) > self.max_messages:
            raise _Overflow(
                f"{self.rows + len(self.bad) + todo} messages > cache_max_messages {self.max_messages}"
            )
        new = [p for p in parts if p not in self.pos]
        for p in new:
            self.pos[p] = self.first[p] = marks[p][0]
        if new and not self.conn.read_to_eof:
            if self.consumer is None:
                self.consumer = self.conn.consumer(tail=True)
            self.consumer.incremental_assign(
                [TopicPartition(self.topic, p, self.pos[p]) for p in new]
            )
        return {p: hi for p, (lo, hi) in marks.items()}

    def _trim(self, low: Mapping[int, int]) -> None:
        table = self.concat()
        keep = None
        for p, lo in low.items():
            m = pc.or_(
                pc.not_equal(table["__partition"], p), pc.greater_equal(table["__offset"], lo)
            )
            keep = m if keep is None else pc.and_(keep, m)
            self.first[p] = lo
            if self.pos[p] < lo:
                self.pos[p] = lo  # the consumer resets itself (auto.offset.reset=earliest)
        table = table.filter(keep)
        self.bad = [b for b in self.bad if b[1] >= low.get(b[0], -1)]
        self.chunks, self.table = [table], table
        self.rows, self.nbytes = table.num_rows, table.nbytes + _BAD_BYTES * len(self.bad)
        self.newest = pc.max(table["__ts"]).as_py() if table.num_rows else None

    # -------------------------------------------------------------- catch-up

    def _catch_up(self, end: dict[int, int], timeout: float) -> int:
        """Consume up to ``end`` (or each partition's end of log with ``end: eof``)."""
        from confluent_kafka import TopicPartition

        eof_mode = self.conn.read_to_eof
        if eof_mode:
            # a consumer per catch-up, closed at its end: librdkafka 2.16 crashes when a
            # topic a live consumer was ever assigned is deleted on Tansu (the broker
            # end: eof is for), so nothing stays attached to the topic between scans
            c = self.conn.consumer(tail=True)
            try:
                c.assign([TopicPartition(self.topic, p, o) for p, o in self.pos.items()])
                return self._consume(c, set(self.pos), end, timeout)
            finally:
                c.close()
        need = {p for p in self.pos if self.pos[p] < end[p]}
        return self._consume(self.consumer, need, end, timeout) if need else 0

    def _consume(self, c: Any, need: set[int], end: dict[int, int], timeout: float) -> int:
        from confluent_kafka import KafkaError

        eof_mode = self.conn.read_to_eof
        read = 0
        deadline = time.monotonic() + max(timeout, 1.0)
        while need:
            msgs = c.consume(num_messages=10_000, timeout=0)  # what is already fetched
            if not msgs:
                m = c.poll(0.05)  # returns as soon as one message or event arrives
                msgs = [m] if m is not None else []
            if not msgs:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"no messages for {timeout:.0f} s from partitions {sorted(need)} "
                        f"(cached up to offsets {[self.pos[p] for p in sorted(need)]})"
                    )
                continue
            deadline = time.monotonic() + max(timeout, 1.0)
            values, meta = [], []
            for m in msgs:
                p = m.partition()
                err = m.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        if p in self.pos:
                            if eof_mode and m.offset() < self.pos[p]:
                                raise _Recreated(
                                    f"partition {p} ends at {m.offset()} < {self.pos[p]}"
                                )
                            if m.offset() > self.pos[p]:  # a gap at the end (markers, compaction)
                                self.pos[p] = m.offset()
                            if eof_mode:
                                need.discard(p)
                        continue
                    if err.fatal():
                        raise RuntimeError(str(err))
                    continue  # transient or stale (e.g. before a reset): the deadline bounds us
                off = m.offset()
                if p not in self.pos or off < self.pos[p]:
                    continue  # re-delivered after a seek (Tansu returns whole batches)
                self.pos[p] = off + 1
                values.append(m.value())
                meta.append((p, off, m.timestamp()[1] / 1000))
            if values:
                read += len(values)
                self._append(values, meta)
            if not eof_mode:
                need = {p for p in need if self.pos[p] < end[p]}
        if eof_mode:
            end.update(self.pos)
        return read

    def _append(self, values: list[Any], meta: list[tuple[int, int, float]]) -> None:
        table, errs = _decode(values, meta, self.schema)
        self.bad.extend((*meta[i], why) for i, why in errs)
        if table.num_rows:
            mx = pc.max(table["__ts"]).as_py()
            self.newest = mx if self.newest is None else max(self.newest, mx)
        self.chunks.append(table)
        self.table = None
        self.rows += table.num_rows
        self.nbytes += table.nbytes + _BAD_BYTES * len(errs)
        if self.rows + len(self.bad) > self.max_messages:  # end: eof (the listed ends are low)
            raise _Overflow(f"more than cache_max_messages {self.max_messages} messages")
        if self.nbytes > self.conn.cache_max_bytes:
            self.max_messages = max(self.rows + len(self.bad) - 1, 0)
            raise _Overflow(
                f"{self.nbytes} bytes decoded > cache_max_bytes {self.conn.cache_max_bytes}"
            )

    def concat(self) -> pa.Table:
        if self.table is None:
            table = pa.concat_tables(self.chunks) if self.chunks else self.full.empty_table()
            if len(self.chunks) > 32:  # many small catch-ups: keep the chunk count low
                table = table.combine_chunks()
                self.chunks = [table]
            self.table = table
        return self.table

    def snapshot(self, timeout: float) -> _Snapshot:
        """Catch up to the broker's current end and return what a scan must read.

        Raises ``_Overflow`` (cache dropped, stream instead), ``SourceError`` for a
        deleted topic, or the broker's error (the cache is kept for the next try)."""
        with self.lock:
            if self.closed:
                raise SourceError(self.conn.uri(self.topic), "the connection is closed")
            try:
                end = self._reconcile(timeout)
                try:
                    read = self._catch_up(end, timeout)
                except _Recreated as why:
                    self.reset(f"offsets went backwards: {why}")
                    end = self._reconcile(timeout)
                    read = self._catch_up(end, timeout)
            except _Overflow:
                self._clear()
                self.topic_id = None
                if self.consumer is not None:
                    with contextlib.suppress(Exception):
                        self.consumer.unassign()
                raise
            return _Snapshot(
                table=self.concat(),
                end=dict(end),
                masked=any(self.pos[p] > end[p] for p in end),
                bad=tuple(self.bad),
                newest=self.newest,
                caught_up=read,
                resets=self.resets,
            )


class KafkaSource(Source):
    capabilities = frozenset(
        {Capability.PROJECTION, Capability.LIMIT, Capability.LATEST_BY, Capability.TIME_RANGE}
    )

    def __init__(
        self, uri: str, conn: KafkaConnection, topic: str, partitions: list[int], schema: pa.Schema
    ):
        super().__init__(uri)
        self.conn = conn
        self.topic = topic
        self.partitions = partitions
        self._schema = schema
        self._last_wm: Watermark | None = None

    def schema(self) -> pa.Schema:
        return self._schema

    def supports_filter(self, expr: Any) -> Pushdown:
        return Pushdown.EXACT if arrow_filter_ok(expr, self._schema) else Pushdown.UNSUPPORTED

    # ----------------------------------------------------------------- offsets

    def _offsets(self, consumer: Any, timeout: float) -> dict[int, tuple[int, int]]:
        from confluent_kafka import TopicPartition

        out = {}
        for p in self.partitions:
            out[p] = consumer.get_watermark_offsets(
                TopicPartition(self.topic, p), timeout=timeout, cached=False
            )
        return out

    def statistics(self) -> Statistics:
        try:
            marks = self.conn.list_offsets(self.topic, self.partitions, self.conn.timeout)
        except Exception as exc:
            raise self.conn.error(exc, self.topic) from exc
        return Statistics(row_count=sum(h - lo for lo, h in marks.values()), exact=False)

    def watermark(self) -> Watermark:
        """Lag 0 (a scan reads up to the current end) and the newest message time.

        With the cache this is a catch-up of the tail (one metadata and one ListOffsets
        request when nothing is new). Without it: the last complete scan's answer while
        the watermarks have not moved, else the last message of each partition."""
        tail = self.conn.tail(self.topic, self._schema)
        if tail is not None:
            try:
                snap = tail.snapshot(self.conn.timeout)
            except _Overflow:
                pass
            except SourceError:
                raise
            except Exception as exc:
                raise self.conn.error(exc, self.topic) from exc
            else:
                return Watermark(
                    event_time=snap.newest,
                    lag_messages=0,
                    detail={"kind": "tail cache", "end_offsets": dict(snap.end)},
                )
        try:
            marks = self.conn.list_offsets(self.topic, self.partitions, self.conn.timeout)
        except Exception as exc:
            raise self.conn.error(exc, self.topic) from exc
        ends = {p: h for p, (lo, h) in marks.items()}
        if self._last_wm is not None and self._last_wm.detail.get("high") == ends:
            return Watermark(
                event_time=self._last_wm.event_time, lag_messages=0, detail=self._last_wm.detail
            )
        from confluent_kafka import TopicPartition

        newest = None
        with self.conn.consumer() as c:
            try:
                tps = [
                    TopicPartition(self.topic, p, h - 1) for p, (lo, h) in marks.items() if h > lo
                ]
                if tps:
                    c.assign(tps)
                    deadline = time.monotonic() + self.conn.timeout
                    seen = 0
                    while seen < len(tps) and time.monotonic() < deadline:
                        m = c.poll(0.2)
                        if m is None or m.error():
                            continue
                        seen += 1
                        ts = m.timestamp()[1] / 1000
                        newest = ts if newest is None else max(newest, ts)
            except Exception as exc:
                raise self.conn.error(exc, self.topic) from exc
        self._last_wm = Watermark(
            event_time=newest, lag_messages=0, detail={"kind": "bounded scan", "high": ends}
        )
        return self._last_wm

    # ----------------------------------------------------------------- scan

    def scan(self, request: ScanRequest) -> Iterator[pa.RecordBatch]:
        cols = list(request.columns) if request.columns is not None else self._schema.names
        check_columns(self.uri, cols, self._schema.names)
        params = typed_params(request.filters, request.params, self._schema, self.uri)
        pred = and_all(list(request.filters))
        expr = (
            to_arrow(pred, params, now=utcnow(), schema=self._schema) if pred is not None else None
        )
        timeout = self.conn.request_timeout(request.timeout)
        tail = self.conn.tail(self.topic, self._schema)
        if tail is None:
            return self._scan_stream(request, cols, expr, "off (cache: false)")
        try:
            snap = tail.snapshot(timeout)
        except _Overflow as why:
            return self._scan_stream(request, cols, expr, f"off ({why})")
        except SourceError:
            raise
        except Exception as exc:
            raise self.conn.error(exc, self.topic) from exc
        return self._scan_cached(snap, request, cols, expr)

    def _scan_cached(
        self, snap: _Snapshot, request: ScanRequest, cols: list[str], expr: Any
    ) -> Iterator[pa.RecordBatch]:
        """Filters, time range, latest_by, projection and limit on the cached Arrow data."""
        table = snap.table
        lo_t, hi_t = request.time_range or (None, None)
        tsf = self.conn.timestamp_field(self.topic)
        bad = [
            b
            for b in snap.bad
            if b[1] < snap.end.get(b[0], 0)
            and (
                tsf is not None
                or ((lo_t is None or b[2] >= lo_t) and (hi_t is None or b[2] <= hi_t))
            )
        ]
        if snap.masked:
            table = table.filter(_below(table, snap.end))
        if tsf is None and (lo_t is not None or hi_t is not None):
            ts = table["__ts"]
            mask = pc.and_kleene(
                pc.greater_equal(ts, lo_t) if lo_t is not None else pc.is_valid(ts),
                pc.less_equal(ts, hi_t) if hi_t is not None else pc.is_valid(ts),
            )
            table = table.filter(mask)
        m = request.metrics  # this scan's own: the source is shared by concurrent queries
        m.records, m.bad_records = table.num_rows + len(bad), 0
        m.cache = "hit" if snap.caught_up == 0 else "caught up"
        m.bad_samples.clear()  # a retried scan (connectors.ratelimit) counts afresh
        m.bad(len(bad), ({"partition": p, "offset": off, "reason": why} for p, off, _, why in bad))
        m.extra.update(
            partitions=len(snap.end),
            end_offsets=dict(snap.end),
            cache_read=snap.caught_up,
            cache_resets=snap.resets,
        )
        if tsf is not None and (lo_t is not None or hi_t is not None):
            table = _event_time_filter(table, tsf, lo_t, hi_t)
        if expr is not None:
            table = table.filter(expr)
        if request.latest_by:
            table = latest(table, list(request.latest_by))
        table = table.select(cols)
        if request.limit is not None:
            table = table.slice(0, request.limit)
        m.rows = table.num_rows
        out_schema = pa.schema([self._schema.field(c) for c in cols])
        batches = [
            pa.RecordBatch.from_arrays(b.columns, schema=out_schema)
            for b in table.to_batches(max_chunksize=request.batch_size)
        ]
        return iter(batches or [pa.RecordBatch.from_pylist([], schema=out_schema)])

    def _scan_stream(
        self, request: ScanRequest, cols: list[str], expr: Any, note: str
    ) -> Iterator[pa.RecordBatch]:
        """The uncached scan: a new consumer reads every partition from its low watermark."""
        from confluent_kafka import KafkaError, TopicPartition

        lo_t, hi_t = request.time_range or (None, None)
        tsf = self.conn.timestamp_field(self.topic)
        timeout = self.conn.request_timeout(request.timeout)
        sm = request.metrics  # this scan's own: the source is shared by concurrent queries
        sm.records, sm.bad_records, sm.rows, sm.cache = 0, 0, 0, note
        sm.bad_samples.clear()  # a retried scan (connectors.ratelimit) counts afresh
        sm.extra["partitions"] = len(self.partitions)
        newest: float | None = None
        out_schema = pa.schema([self._schema.field(c) for c in cols])
        keep: list[pa.RecordBatch] = []  # latest_by needs everything before it can answer
        left = request.limit
        with self.conn.consumer() as c:
            try:
                marks = self._offsets(c, timeout)
                start = {p: lo for p, (lo, h) in marks.items()}
                if lo_t is not None and tsf is None:
                    asked = [TopicPartition(self.topic, p, int(lo_t * 1000)) for p in start]
                    for tp in c.offsets_for_times(asked, timeout=timeout):
                        lo, h = marks[tp.partition]
                        start[tp.partition] = h if tp.offset < 0 else max(lo, tp.offset)
                if self.conn.read_to_eof:  # the broker's listed high watermarks are not trusted
                    end = {p: 2**63 - 1 for p in marks}
                    todo = set(start)
                else:
                    end = {p: h for p, (lo, h) in marks.items()}
                    todo = {p for p in start if start[p] < end[p]}
                reached: dict[int, int] = {}
                sm.extra["end_offsets"] = reached
                if todo:
                    c.assign([TopicPartition(self.topic, p, start[p]) for p in todo])
                deadline = time.monotonic() + max(timeout, 1.0)
                while todo:
                    # consume() waits its whole timeout unless it fills num_messages, so
                    # take what is fetched, then wait for the next message only
                    msgs = c.consume(num_messages=min(request.batch_size, 10_000), timeout=0)
                    if not msgs:
                        m = c.poll(0.1)
                        msgs = [m] if m is not None else []
                    if not msgs:
                        if time.monotonic() > deadline:
                            raise TimeoutError(
                                f"no messages for {timeout:.0f} s from partitions {sorted(todo)} "
                                f"(expected up to offsets {[end[p] for p in sorted(todo)]})"
                            )
                        continue
                    deadline = time.monotonic() + max(timeout, 1.0)
                    values, meta = [], []
                    for m in msgs:
                        if m.error():
                            if m.error().code() == KafkaError._PARTITION_EOF:
                                todo.discard(
                                    m.partition()
                                )  # the broker has nothing more (its end may be below ours)
                                continue
                            raise RuntimeError(str(m.error()))
                        p, off = m.partition(), m.offset()
                        if p not in todo or off >= end[p]:
                            continue
                        reached[p] = off + 1
                        if off >= end[p] - 1:
                            todo.discard(p)
                        ts = m.timestamp()[1] / 1000
                        if tsf is None and (
                            (lo_t is not None and ts < lo_t) or (hi_t is not None and ts > hi_t)
                        ):
                            continue
                        values.append(m.value())
                        meta.append((p, off, ts))
                    if not values:
                        continue
                    sm.records += len(values)
                    table, errs = _decode(values, meta, self._schema)
                    if errs:
                        sm.bad(
                            len(errs),
                            (
                                {"partition": meta[i][0], "offset": meta[i][1], "reason": why}
                                for i, why in errs
                            ),
                        )
                    if tsf is not None and (lo_t is not None or hi_t is not None):
                        table = _event_time_filter(table, tsf, lo_t, hi_t)
                    if table.num_rows:
                        mx = pc.max(table.column("__ts")).as_py()
                        newest = mx if newest is None else max(newest, mx)
                    if expr is not None:
                        table = table.filter(expr)
                    if request.latest_by:
                        keep.extend(table.to_batches())
                        continue
                    table = table.select(cols)
                    if left is not None:
                        table = table.slice(0, left)
                        left -= table.num_rows
                    sm.rows += table.num_rows
                    for b in table.to_batches(max_chunksize=request.batch_size):
                        yield pa.RecordBatch.from_arrays(b.columns, schema=out_schema)
                    if left is not None and left <= 0:
                        break
            except (KeyError, ValueError):
                raise
            except Exception as exc:
                raise self.conn.error(exc, self.topic) from exc
        if request.time_range is None and request.limit is None:  # saw every message
            self._last_wm = Watermark(
                event_time=newest,
                lag_messages=0,
                detail={
                    "kind": "bounded scan",
                    "end_offsets": sm.extra.get("end_offsets", {}),
                    "high": {p: h for p, (lo, h) in marks.items()},
                },
            )
        if request.latest_by:
            table = latest(
                pa.Table.from_batches(keep, schema=_with_meta(self._schema)),
                list(request.latest_by),
            ).select(cols)
            if left is not None:
                table = table.slice(0, left)
            sm.rows = table.num_rows
            yield from (
                pa.RecordBatch.from_arrays(b.columns, schema=out_schema)
                for b in table.to_batches(max_chunksize=request.batch_size)
            )
        elif sm.rows == 0:
            yield pa.RecordBatch.from_pylist([], schema=out_schema)


def _below(table: pa.Table, end: Mapping[int, int]) -> Any:
    """Mask of the rows below each partition's end offset."""
    keep = None
    for p, e in end.items():
        m = pc.and_(pc.equal(table["__partition"], p), pc.less(table["__offset"], e))
        keep = m if keep is None else pc.or_(keep, m)
    return keep if keep is not None else pa.array([False] * table.num_rows)


def _event_time_filter(
    table: pa.Table, tsf: str, lo_t: float | None, hi_t: float | None
) -> pa.Table:
    """Rows whose ``tsf`` (a timestamp column) lies in [lo_t, hi_t], epoch seconds."""
    if not pa.types.is_timestamp(table.schema.field(tsf).type):
        return table
    secs = pc.divide(pc.cast(pc.cast(table.column(tsf), pa.int64()), pa.float64()), 1e6)
    mask = pc.and_kleene(
        pc.greater_equal(secs, lo_t) if lo_t is not None else pc.is_valid(secs),
        pc.less_equal(secs, hi_t) if hi_t is not None else pc.is_valid(secs),
    )
    return table.filter(mask)


def latest(table: pa.Table, keys: list[str]) -> pa.Table:
    """The newest row per key: greatest ``__ts``, then greatest offset within a partition."""
    if table.num_rows == 0:
        return table
    table = table.sort_by(
        [("__ts", "ascending"), ("__partition", "ascending"), ("__offset", "ascending")]
    )
    table = table.append_column("__row", pa.array(range(table.num_rows), pa.int64()))
    group = table.select(["__row"])
    for i, k in enumerate(keys):  # a float key as SQL compares it: -0.0 = 0.0, one NaN
        col = table.column(k)
        group = group.append_column(
            f"__k{i}", canonical_floats(col) if pa.types.is_floating(col.type) else col
        )
    picked = group.group_by([f"__k{i}" for i in range(len(keys))], use_threads=False).aggregate(
        [("__row", "max")]
    )
    idx = pc.sort_indices(picked.column("__row_max"))
    return table.take(pc.take(picked.column("__row_max"), idx)).drop_columns(["__row"])


#: every option a kafka connection understands (top level or under ``options:``)
OPTION_KEYS = (
    "kind",
    "description",
    "schemas",
    "options",
    "bootstrap",
    "group_prefix",
    "format",
    "security",
    "timeout",
    "connect_timeout",
    "query_timeout",
    "timestamp_field",
    "sample",
    "end",
    "cache",
    "cache_max_messages",
    "cache_max_bytes",
    "config",
)


def client_config_problem(settings: Mapping[str, Any]) -> str | None:
    """What librdkafka says of ``settings`` (``security:`` / ``config:`` of a connection),
    or None when it accepts them: a client is built (it connects to nothing) and dropped."""
    from confluent_kafka import KafkaException, Producer

    try:
        Producer({"bootstrap.servers": "127.0.0.1:1", "log_level": 0, **settings})
    except (KafkaException, TypeError, ValueError) as exc:
        err = exc.args[0] if exc.args else exc
        return err.str() if hasattr(err, "str") else str(err)
    return None


class KafkaConnection(Connection):
    """One Kafka cluster: scans of its topics, and the one factory of every librdkafka
    client the fabric makes for it (scan and tail consumers, ingestion consumers, the
    dead-letter producer, admin clients), so ``security:`` (SASL/TLS) and ``config:``
    reach all of them the same way (``client_config``)."""

    kind = "kafka"

    def __init__(self, name: str, options: Mapping[str, Any]):
        nested = options.get("options")
        if isinstance(nested, Mapping):
            unknown = [str(k) for k in nested if k not in OPTION_KEYS or k == "options"]
            if unknown:
                from dsl.errors import did_you_mean

                raise ValueError(
                    f"connection {name!r}: unknown kafka option(s) {', '.join(unknown)} under "
                    f"'options:'; "
                    + did_you_mean(
                        unknown[0], [k for k in OPTION_KEYS if k != "options"], "options"
                    )
                    + " (librdkafka settings go under 'config:', SASL/TLS under 'security:')"
                )
        options = flat_options(options, {"connect_timeout": "timeout", "query_timeout": "timeout"})
        super().__init__(name, options)
        if str(options.get("format", "json")).lower() != "json":
            raise ValueError(
                f"connection {name!r}: only JSON message values are supported (format: json), got {options['format']!r}"
            )
        if not options.get("bootstrap"):
            raise ValueError(
                f"connection {name!r}: a kafka connection needs 'bootstrap' (e.g. 127.0.0.1:9092)"
            )
        for key in ("security", "config"):
            if options.get(key) is not None and not isinstance(options.get(key), Mapping):
                raise ValueError(
                    f"connection {name!r}: {key!r} must be a mapping of librdkafka settings"
                )
        self.bootstrap = str(options["bootstrap"])
        self.timeout = float(options.get("timeout", 10))
        if self.timeout <= 0:
            raise ValueError(f"connection {name!r}: 'timeout' must be > 0 s, got {self.timeout}")
        self.sample = int(options.get("sample", 200))
        self.schemas: Mapping[str, Any] = options.get("schemas") or {}
        end = options.get("end", "high_watermark")
        if end not in ("high_watermark", "eof"):
            raise ValueError(
                f"connection {name!r}: 'end' must be high_watermark or eof, got {end!r}"
            )
        self.read_to_eof = end == "eof"
        self.cache = _flag(options.get("cache", True), name, "cache")
        self.cache_max_messages = int(options.get("cache_max_messages", 1_000_000))
        self.cache_max_bytes = int(options.get("cache_max_bytes", 256 * 2**20))
        self._lock = threading.Lock()
        self._admin: Any = None
        self._tails: dict[tuple[str, str], _Tail] = {}
        self._closed = False
        weakref.finalize(self, _close_tails, self._tails)

    def uri(self, obj: str = "") -> str:
        return f"kafka://{self.name}/{obj}"

    def timestamp_field(self, topic: str) -> str | None:
        tf = self.options.get("timestamp_field")
        if isinstance(tf, Mapping):
            return tf.get(topic)
        return tf

    def request_timeout(self, budget: float | None = None) -> float:
        """Seconds one broker round trip (metadata, watermarks, a consume without progress)
        may take: the connection's ``timeout``, or less when the query's ``budget`` is
        smaller; a query's larger budget never stretches it (a broker that is down fails
        the scan after ``timeout``, not after the query's budget)."""
        return min(budget, self.timeout) if budget else self.timeout

    def error(self, exc: BaseException, obj: str = "") -> SourceError:
        err: Any = exc.args[0] if exc.args else None
        text = err.str() if hasattr(err, "str") else str(exc)
        return SourceError(
            self.uri(obj),
            f"{type(exc).__name__}: {text} (connection timeout {self.timeout:g} s)",
            hint=f"check that the Kafka broker at {self.bootstrap} is running and reachable, "
            f"or raise connections.{self.name}.timeout",
            retriable=True,
        )

    def client_config(self, role: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """librdkafka settings of every client of this connection: the connection's
        defaults (bootstrap, socket timeouts from ``timeout``), then ``security:`` and
        ``config:``, then what the client's role needs (``role``: group id, commit
        mode...), which the user's settings cannot break."""
        ms = int(self.timeout * 1000)
        cfg = {
            "bootstrap.servers": self.bootstrap,
            "socket.timeout.ms": max(ms, 10),
            "socket.connection.setup.timeout.ms": max(ms, 1000),
            "reconnect.backoff.max.ms": 1000,
            "log_level": 0,
        }
        cfg.update(self.options.get("security") or {})  # e.g. security.protocol, sasl.*
        cfg.update(self.options.get("config") or {})
        if role and "logger" in role and "log_level" not in (self.options.get("config") or {}):
            cfg["log_level"] = 6  # a client with a Python logger gets librdkafka's default
        cfg.update(role or {})
        return cfg

    def new_consumer(self, role: Mapping[str, Any]) -> Any:
        """A bare ``confluent_kafka.Consumer`` (``role`` holds at least ``group.id``)."""
        from confluent_kafka import Consumer

        return Consumer(self.client_config(role))

    def new_producer(self, role: Mapping[str, Any] | None = None) -> Any:
        """A ``confluent_kafka.Producer`` (the dead-letter producer of ingestion)."""
        from confluent_kafka import Producer

        return Producer(self.client_config(role))

    def new_admin(self) -> Any:
        """An ``AdminClient`` of its own (``admin()`` is the shared one)."""
        from confluent_kafka.admin import AdminClient

        return AdminClient(self.client_config())

    def consumer(self, tail: bool = False) -> Any:
        """A consumer that never joins its (unique) group: callers ``assign()``.

        ``tail=True``: the bare long-lived consumer of a tail cache; otherwise one wrapped
        to be closed by a ``with`` block."""
        role: dict[str, Any] = {
            "group.id": f"fabric-{'tail' if tail else 'scan'}-{uuid.uuid4().hex[:12]}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "auto.offset.reset": "earliest",
            # end: eof asks the broker for its end at every scan, which a broker
            # answers after at most this long when it has nothing new
            "fetch.wait.max.ms": 20 if tail and self.read_to_eof else 100,
        }
        if tail:  # an idle tail prefetches at most this much (outside cache_max_bytes)
            role["queued.max.messages.kbytes"] = (self.options.get("config") or {}).get(
                "queued.max.messages.kbytes", 16_384
            )
        c = self.new_consumer(role)
        return c if tail else _Closing(c)

    def admin(self) -> Any:
        """The connection's shared AdminClient (thread-safe; metadata and offsets)."""
        with self._lock:
            if self._admin is None:
                self._admin = self.new_admin()
            return self._admin

    def list_offsets(
        self, topic: str, partitions: list[int], timeout: float
    ) -> dict[int, tuple[int, int]]:
        """``{partition: (low, high)}`` watermarks in one ListOffsets round trip per end."""
        from confluent_kafka import TopicPartition
        from confluent_kafka.admin import OffsetSpec

        if not partitions:
            return {}
        adm = self.admin()
        ends = []
        for spec in (OffsetSpec.earliest(), OffsetSpec.latest()):
            futs = adm.list_offsets(
                {TopicPartition(topic, p): spec for p in partitions}, request_timeout=timeout
            )
            ends.append(futs)
        low, high = (
            {tp.partition: f.result(timeout + 1).offset for tp, f in e.items()} for e in ends
        )
        return {p: (low[p], high[p]) for p in partitions}

    def tail(self, topic: str, schema: pa.Schema) -> _Tail | None:
        """The tail cache of ``topic`` decoded into ``schema`` (None with ``cache: false``)."""
        if not self.cache:
            return None
        key = (topic, schema.to_string(show_schema_metadata=False))
        with self._lock:
            if self._closed:  # used after close(): scan without a cache
                return None
            t = self._tails.get(key)
            if t is None:
                t = self._tails[key] = _Tail(self, topic, schema)
            return t

    def close(self) -> None:
        """Stop every tail (closes their consumers) and drop the caches."""
        with self._lock:
            self._closed = True
            self._admin = None
        _close_tails(self._tails)

    def _metadata(self, topic: str | None = None) -> Any:
        """Cluster metadata. Always of every topic: a metadata request naming a topic
        creates it on brokers with auto-creation on (noida-db), so asking whether a
        mistyped topic exists would create it."""
        try:
            return self.admin().list_topics(timeout=self.timeout)
        except Exception as exc:
            raise self.error(exc, topic or "") from exc

    def ping(self) -> None:
        self._metadata()

    def list_objects(self) -> list[str]:
        return sorted(t for t in self._metadata().topics if not t.startswith("__"))

    def source(self, obj: str, options: Mapping[str, Any] | None = None) -> KafkaSource:
        md = self._metadata(obj).topics.get(obj)
        if md is None or md.error is not None or not md.partitions:
            raise UnknownObjectError(self.uri(obj), self.list_objects())
        partitions = sorted(md.partitions)
        declared = (options or {}).get("schema") or self.schemas.get(obj)
        src = KafkaSource(self.uri(obj), self, obj, partitions, pa.schema([]))
        if declared:
            src._schema = schema_from_spec(declared)
        else:
            src._schema = self._infer(src)
        return src

    def _infer(self, src: KafkaSource) -> pa.Schema:
        import json

        docs: list[Any] = []
        raw = pa.schema([pa.field("__raw", pa.string())])
        probe = KafkaSource(src.uri, self, src.topic, src.partitions, raw)
        # read values without decoding: a scan with a one-column schema that keeps no fields
        from confluent_kafka import TopicPartition

        with self.consumer() as c:
            try:
                marks = probe._offsets(c, self.timeout)
                tps = [
                    TopicPartition(src.topic, p, lo)
                    for p, (lo, h) in marks.items()
                    if h > lo or self.read_to_eof
                ]
                ends = {p: h for p, (lo, h) in marks.items()}
                if tps:
                    c.assign(tps)
                todo = {tp.partition for tp in tps}
                deadline = time.monotonic() + self.timeout
                while todo and len(docs) < self.sample and time.monotonic() < deadline:
                    for m in c.consume(num_messages=self.sample, timeout=0.5):
                        if m.error():
                            todo.discard(m.partition())
                            continue
                        if not self.read_to_eof and m.offset() >= ends[m.partition()] - 1:
                            todo.discard(m.partition())
                        try:
                            d = json.loads(m.value())
                        except (TypeError, ValueError):
                            continue
                        if isinstance(d, dict):
                            docs.append(d)
            except Exception as exc:
                raise self.error(exc, src.topic) from exc
        tsf = self.timestamp_field(src.topic)
        if not docs:
            raise SourceError(
                src.uri,
                "cannot infer a schema: the topic has no JSON object messages yet",
                hint=f"declare it under connections.{self.name}.schemas.{src.topic} in fabric.yaml",
            )
        return infer_schema(docs[: self.sample], timestamp_fields=[tsf] if tsf else [])


def _close_tails(tails: dict[tuple[str, str], _Tail]) -> None:
    items = list(tails.values())
    tails.clear()
    for t in items:
        t.close()


def _flag(v: Any, name: str, key: str) -> bool:
    if isinstance(v, bool):
        return v
    if str(v).lower() in ("true", "yes", "on", "1"):
        return True
    if str(v).lower() in ("false", "no", "off", "0"):
        return False
    raise ValueError(f"connection {name!r}: {key!r} must be true or false, got {v!r}")


class _Closing:
    def __init__(self, consumer: Any):
        self.c = consumer

    def __enter__(self) -> Any:
        return self.c

    def __exit__(self, *exc: Any) -> None:
        self.c.close()
