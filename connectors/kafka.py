"""A Kafka topic as a directly scanned source (``kafka`` kind), through confluent-kafka.

Connection options: ``bootstrap`` (required), ``schemas`` (``{topic: {column: type}}``;
otherwise inferred from up to ``sample`` (200) messages), ``timestamp_field`` (a JSON
field holding the event time; default: the message timestamp), ``timeout`` (10 s:
metadata and watermark requests), ``config`` (extra librdkafka settings).

A scan is bounded: it captures the high watermark of every partition when it starts
(``end: eof`` instead reads each partition until the broker says it is at its end, for
brokers whose listed high watermarks are wrong, such as Tansu),
``assign()``s all partitions (librdkafka fetches them concurrently; no consumer group is
joined and nothing is committed), and stops each partition at that offset, so a busy
topic cannot make a scan endless. With ``time_range`` it seeks with
``offsets_for_times`` and also checks every record's time, so a broker whose time index
is wrong (Tansu) gives a slower but still exact answer. JSON values are decoded into the
schema; bad messages are skipped and counted (``last_scan``), never fatal. Filters that
pyarrow can evaluate are applied here on every batch (EXACT), before ``latest_by``
(which keeps the newest record per key: greatest timestamp, then offset).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from connectors._util import flat_options, schema_from_spec, typed_params
from connectors.arrow_expr import to_arrow, utcnow
from connectors.base import (
    Connection,
    Pushdown,
    ScanRequest,
    Source,
    SourceError,
    Statistics,
    UnknownObjectError,
    Watermark,
)
from connectors.json_decode import decode_json_messages, infer_schema
from connectors.s3 import arrow_filter_ok
from dsl.ast import and_all

__all__ = ["KafkaConnection", "KafkaSource", "decode_json_messages"]

_META = ("__partition", "__offset", "__ts")


class KafkaSource(Source):
    capabilities = frozenset({"projection", "limit", "latest_by", "time_range"})

    def __init__(
        self, uri: str, conn: KafkaConnection, topic: str, partitions: list[int], schema: pa.Schema
    ):
        super().__init__(uri)
        self.conn = conn
        self.topic = topic
        self.partitions = partitions
        self._schema = schema
        self.last_scan: dict[str, Any] = {}
        self.errors: list[
            tuple[int, int, str]
        ] = []  # (partition, offset, reason) of the last scan, first 100
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
        with self.conn.consumer() as c:
            try:
                marks = self._offsets(c, self.conn.timeout)
            except Exception as exc:
                raise self.conn.error(exc, self.topic) from exc
        return Statistics(row_count=sum(h - lo for lo, h in marks.values()), exact=False)

    def watermark(self) -> Watermark:
        """Newest message time (reads the last message of each partition) and lag 0."""
        if self._last_wm is not None:
            return self._last_wm
        from confluent_kafka import TopicPartition

        newest = None
        with self.conn.consumer() as c:
            try:
                marks = self._offsets(c, self.conn.timeout)
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
        return Watermark(event_time=newest, lag_messages=0, detail={"kind": "bounded scan"})

    # ----------------------------------------------------------------- scan

    def scan(self, request: ScanRequest) -> Iterator[pa.RecordBatch]:
        from confluent_kafka import KafkaError, TopicPartition

        cols = list(request.columns) if request.columns is not None else self._schema.names
        unknown = [c for c in cols if c not in self._schema.names]
        if unknown:
            raise KeyError(
                f"{self.uri} has no column {', '.join(unknown)}; existing: {', '.join(self._schema.names)}"
            )
        params = typed_params(request.filters, request.params, self._schema, self.uri)
        pred = and_all(list(request.filters))
        expr = to_arrow(pred, params, now=utcnow()) if pred is not None else None
        lo_t, hi_t = request.time_range or (None, None)
        tsf = self.conn.timestamp_field(self.topic)
        timeout = request.timeout or self.conn.timeout
        stats: dict[str, Any] = {
            "messages": 0,
            "bad_messages": 0,
            "rows": 0,
            "partitions": len(self.partitions),
        }
        self.last_scan, self.errors = stats, []
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
                stats["end_offsets"] = reached
                if todo:
                    c.assign([TopicPartition(self.topic, p, start[p]) for p in todo])
                deadline = time.monotonic() + max(timeout, 1.0)
                while todo:
                    msgs = c.consume(num_messages=min(request.batch_size, 10_000), timeout=0.5)
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
                    stats["messages"] += len(values)
                    batch, errs = decode_json_messages(values, self._schema)
                    if errs:
                        stats["bad_messages"] += len(errs)
                        room = 100 - len(self.errors)
                        self.errors.extend(
                            (meta[i][0], meta[i][1], why) for i, why in errs[: max(room, 0)]
                        )
                        bad = {i for i, _ in errs}
                        meta = [x for i, x in enumerate(meta) if i not in bad]
                    table = pa.Table.from_batches([batch], schema=self._schema)
                    table = table.append_column(
                        "__partition", pa.array([x[0] for x in meta], pa.int32())
                    )
                    table = table.append_column(
                        "__offset", pa.array([x[1] for x in meta], pa.int64())
                    )
                    table = table.append_column(
                        "__ts", pa.array([x[2] for x in meta], pa.float64())
                    )
                    if tsf is not None and (lo_t is not None or hi_t is not None):
                        t = (
                            pc.cast(table.column(tsf), pa.int64())
                            if pa.types.is_timestamp(table.schema.field(tsf).type)
                            else None
                        )
                        if t is not None:
                            secs = pc.divide(pc.cast(t, pa.float64()), 1e6)
                            mask = pc.and_kleene(
                                pc.greater_equal(secs, lo_t)
                                if lo_t is not None
                                else pc.is_valid(secs),
                                pc.less_equal(secs, hi_t)
                                if hi_t is not None
                                else pc.is_valid(secs),
                            )
                            table = table.filter(mask)
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
                    stats["rows"] += table.num_rows
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
                detail={"kind": "bounded scan", "end_offsets": stats.get("end_offsets", {})},
            )
        if request.latest_by:
            full = (
                self._schema.append(pa.field("__partition", pa.int32()))
                .append(pa.field("__offset", pa.int64()))
                .append(pa.field("__ts", pa.float64()))
            )
            table = latest(
                pa.Table.from_batches(keep, schema=full), list(request.latest_by)
            ).select(cols)
            if left is not None:
                table = table.slice(0, left)
            stats["rows"] = table.num_rows
            yield from (
                pa.RecordBatch.from_arrays(b.columns, schema=out_schema)
                for b in table.to_batches(max_chunksize=request.batch_size)
            )
        elif stats["rows"] == 0:
            yield pa.RecordBatch.from_pylist([], schema=out_schema)


def latest(table: pa.Table, keys: list[str]) -> pa.Table:
    """The newest row per key: greatest ``__ts``, then greatest offset within a partition."""
    if table.num_rows == 0:
        return table
    table = table.sort_by(
        [("__ts", "ascending"), ("__partition", "ascending"), ("__offset", "ascending")]
    )
    table = table.append_column("__row", pa.array(range(table.num_rows), pa.int64()))
    picked = table.group_by(keys, use_threads=False).aggregate([("__row", "max")])
    idx = pc.sort_indices(picked.column("__row_max"))
    return table.take(pc.take(picked.column("__row_max"), idx)).drop_columns(["__row"])


class KafkaConnection(Connection):
    kind = "kafka"

    def __init__(self, name: str, options: Mapping[str, Any]):
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
        self.bootstrap = str(options["bootstrap"])
        self.timeout = float(options.get("timeout", 10))
        self.sample = int(options.get("sample", 200))
        self.schemas: Mapping[str, Any] = options.get("schemas") or {}
        end = options.get("end", "high_watermark")
        if end not in ("high_watermark", "eof"):
            raise ValueError(
                f"connection {name!r}: 'end' must be high_watermark or eof, got {end!r}"
            )
        self.read_to_eof = end == "eof"

    def uri(self, obj: str = "") -> str:
        return f"kafka://{self.name}/{obj}"

    def timestamp_field(self, topic: str) -> str | None:
        tf = self.options.get("timestamp_field")
        if isinstance(tf, Mapping):
            return tf.get(topic)
        return tf

    def error(self, exc: BaseException, obj: str = "") -> SourceError:
        return SourceError(
            self.uri(obj),
            f"{type(exc).__name__}: {exc}",
            hint=f"check that the Kafka broker at {self.bootstrap} is running and reachable",
            retriable=True,
        )

    def _config(self) -> dict[str, Any]:
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
        return cfg

    def consumer(self) -> Any:
        from confluent_kafka import Consumer

        cfg = self._config()
        cfg.update(
            {
                "group.id": f"fabric-scan-{uuid.uuid4().hex[:12]}",
                "enable.auto.commit": False,
                "enable.partition.eof": True,
                "auto.offset.reset": "earliest",
                "fetch.wait.max.ms": 100,
            }
        )
        return _Closing(Consumer(cfg))

    def _metadata(self, topic: str | None = None) -> Any:
        from confluent_kafka.admin import AdminClient

        try:
            return AdminClient(self._config()).list_topics(topic=topic, timeout=self.timeout)
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


def _quiet(*_: Any) -> None:
    pass


class _Closing:
    def __init__(self, consumer: Any):
        self.c = consumer

    def __enter__(self) -> Any:
        return self.c

    def __exit__(self, *exc: Any) -> None:
        self.c.close()
