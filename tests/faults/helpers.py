"""The fault-injection suite (issue 14), against the real servers:

- ``test_fault_oversized.py``: a 2 MB message among 2,000 (finding 1);
- ``test_fault_bad_messages.py``: 20k messages, ~1 % invalid of seven kinds (finding 2);
- ``test_fault_topic_recreated.py``: topic deleted + re-created under a checkpoint (noida-db,
  Tansu) and under a running ingestor (finding 3);
- ``test_fault_checkpoint.py``: damaged checkpoint files, newest or all (finding 4), file modes;
- ``test_fault_full_disk.py``: ENOSPC on the state directory, errors that stand (finding 5);
- ``test_fault_broker_kill.py``: kill -9 of a private noida-db mid-ingest;
- kill -9 of the fabric mid-ingest: ``tests/test_ingest.py::test_kill_9_mid_ingest_then_restart_converges_exactly``
  and ``test_repeated_kill_9_every_checkpoint_holds_exactly_its_offsets``.

What every fault test checks, against the real broker:

- ``replica(bootstrap, topic)``: the state a full replica of the topic holds, read with a
  bare consumer (tombstones applied, per key the latest value; the invalid messages with
  their partition/offset): the oracle the dataset is compared with after the fault;
- ``Watch``: polls the tracker while the fault lasts and records every moment the source
  said ``fresh`` while the dataset did not hold what the broker holds (it must be none);
- ``assert_replica``: every key exactly once with its latest value, nothing else;
- ``dlq``: the dead-letter records by (partition, offset).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from connectors._util import schema_from_spec
from fabric.freshness import FreshnessTracker
from indexes.dataset import Dataset
from tests.test_ingest import INDEXES, NOIDA, SCHEMA, _start_noida, doc

__all__ = ["INDEXES", "NOIDA", "SCHEMA", "doc"]


def new_dataset(indexes: dict | None = None) -> Dataset:
    return Dataset.create(
        "docs", schema_from_spec(SCHEMA), "id", INDEXES if indexes is None else indexes
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def private_noida(tmp: Path) -> Iterator[PrivateBroker]:
    """A noida-db of this test's own on a free port (the shared one is never killed)."""
    b = PrivateBroker(free_port(), tmp / "noida", tmp / "noida.log")
    b.start()
    try:
        yield b
    finally:
        b.kill()


@dataclass
class PrivateBroker:
    port: int
    data: Path
    log: Path
    proc: Any = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = _start_noida(self.port, self.data, self.log)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def create_topic(bootstrap: str, name: str, partitions: int = 1, **config: str) -> str:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, partitions, 1, config=config)])[name].result(30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        t = admin.list_topics(name, timeout=10).topics.get(name)
        if t is not None and t.error is None and len(t.partitions) == partitions:
            return name
        time.sleep(0.1)
    raise TimeoutError(f"topic {name} not ready")


def delete_topic(bootstrap: str, name: str, wait_gone: bool = True) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    with contextlib.suppress(Exception):
        admin.delete_topics([name], operation_timeout=30)[name].result(30)
    deadline = time.monotonic() + 30
    while wait_gone and time.monotonic() < deadline:
        if name not in admin.list_topics(timeout=10).topics:
            return
        time.sleep(0.1)


def produce(
    bootstrap: str,
    topic: str,
    items: list[tuple[str | None, bytes | None]],
    partition: int | None = None,
    **config: Any,
) -> list[tuple[int, int]]:
    """Produce in order; returns (partition, offset) of each (delivery reports, acks=all)."""
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "acks": "all", **config})
    where: list[tuple[int, int] | None] = [None] * len(items)

    def cb(err: Any, msg: Any, i: int) -> None:
        assert err is None, err
        where[i] = (msg.partition(), msg.offset())

    for i, (k, v) in enumerate(items):
        kw = {} if partition is None else {"partition": partition}
        while True:
            try:
                p.produce(
                    topic,
                    key=None if k is None else k.encode(),
                    value=v,
                    on_delivery=lambda e, m, i=i: cb(e, m, i),
                    **kw,
                )
                break
            except BufferError:
                p.poll(0.1)
        if i % 2000 == 0:
            p.poll(0)
    assert p.flush(60) == 0
    assert all(w is not None for w in where)
    return where  # type: ignore[return-value]


def docs(keys: range | list[str], gen: int = 0) -> list[tuple[str, bytes]]:
    return [(f"k{k}" if isinstance(k, int) else k, json.dumps(doc(f"k{k}" if isinstance(k, int) else k, gen * 1_000_000 + (k if isinstance(k, int) else 0))).encode()) for k in keys]  # fmt: skip


@dataclass
class Replica:
    rows: dict[str, dict]  # key -> the latest valid value
    invalid: set[tuple[int, int]] = field(default_factory=set)  # (partition, offset)
    messages: int = 0


def replica(
    bootstrap: str, topic: str, valid: Callable[[bytes], dict | None], timeout: float = 60
) -> Replica:
    """What a full replica of the topic holds; ``valid(value)`` -> the row or None (invalid)."""
    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"replica-{time.time()}",
            "enable.partition.eof": True,
            "auto.offset.reset": "earliest",
        }
    )
    md = c.list_topics(topic, timeout=10).topics[topic]
    parts = sorted(md.partitions)
    ends = {}
    for p in parts:
        _, hi = c.get_watermark_offsets(TopicPartition(topic, p), timeout=10, cached=False)
        ends[p] = hi
    c.assign([TopicPartition(topic, p, 0) for p in parts])
    out = Replica({})
    done = {p for p in parts if ends[p] == 0}
    deadline = time.monotonic() + timeout
    try:
        while len(done) < len(parts) and time.monotonic() < deadline:
            for m in c.consume(2000, 0.5):
                if m.error() is not None:
                    continue
                out.messages += 1
                if m.offset() + 1 >= ends[m.partition()]:
                    done.add(m.partition())
                key = None if m.key() is None else m.key().decode()
                if m.value() is None:
                    if key is None:
                        out.invalid.add((m.partition(), m.offset()))
                    else:
                        out.rows.pop(key, None)
                    continue
                row = valid(m.value())
                if row is None or row.get("id") is None:
                    out.invalid.add((m.partition(), m.offset()))
                else:
                    out.rows[row["id"]] = row
    finally:
        c.close()
    assert len(done) == len(parts), f"could not read {topic} to its end"
    return out


def json_row(value: bytes) -> dict | None:
    try:
        d = json.loads(value)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(d, dict) or not isinstance(d.get("id"), str):
        return None
    n = d.get("n")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int)):
        return None
    return d


def held(ds: Dataset) -> dict[str, int | None]:
    t = ds.to_table(["id", "n"])
    ids, ns = t.column("id").to_pylist(), t.column("n").to_pylist()
    assert len(ids) == len(set(ids)), "a key is present more than once"
    return dict(zip(ids, ns))


def assert_replica(ds: Dataset, rep: Replica) -> None:
    got = held(ds)
    missing = set(rep.rows) - set(got)
    extra = set(got) - set(rep.rows)
    wrong = [k for k, r in rep.rows.items() if k in got and got[k] != r.get("n")]
    assert not (missing or extra or wrong), (
        f"{len(missing)} missing (e.g. {sorted(missing)[:3]}), {len(extra)} extra "
        f"(e.g. {sorted(extra)[:3]}), {len(wrong)} with a stale value (e.g. {wrong[:3]})"
    )
    assert ds.count() == len(rep.rows)


def dlq(
    bootstrap: str, topic: str, expect: int, timeout: float = 30
) -> dict[tuple[int, int], dict]:
    """Dead letters of ``topic``: (partition, offset) -> headers (+ '_bytes': value size)."""
    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"dlq-{time.time()}",
            "auto.offset.reset": "earliest",
        }
    )
    c.subscribe([topic + ".dlq"])
    out: dict[tuple[int, int], dict] = {}
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and len(out) < expect:
            m = c.poll(0.5)
            if m is None or m.error():
                continue
            h = {k: v.decode() for k, v in m.headers()}
            h["_bytes"] = len(m.value() or b"")
            out[(int(h["fabric.partition"]), int(h["fabric.offset"]))] = h
    finally:
        c.close()
    return out


class Watch:
    """Polls ``tracker.source(name)`` every ``every`` s on a thread: records each status
    seen and every moment it said ``fresh`` while ``complete()`` (evaluated after the
    snapshot, so data can only have grown since) was False."""

    def __init__(
        self,
        tracker: FreshnessTracker,
        name: str,
        complete: Callable[[], bool],
        every: float = 0.05,
    ):
        self.tracker, self.name, self.complete, self.every = tracker, name, complete, every
        self.statuses: list[str] = []
        self.lies: list[dict] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watch:
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            f = self.tracker.source(self.name)
            if not self.statuses or self.statuses[-1] != f.status:
                self.statuses.append(f.status)
            if f.status == "fresh" and not self.complete():
                self.lies.append({"t": time.monotonic(), **f.to_dict()})

    def seen(self, status: str) -> bool:
        return status in self.statuses


def wait_for(cond: Callable[[], bool], timeout: float, what: str | Callable[[], str]) -> None:
    """``what``: a text, or a function giving it (evaluated at the timeout, with the state then)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(
        f"timed out after {timeout}s waiting for {what if isinstance(what, str) else what()}"
    )
