"""Run one Kafka -> dataset ingestor as a process (operations, and the kill -9 tests).

    python -m fabric.ingest --bootstrap 127.0.0.1:9092 --topic news --dataset news \\
        --key id --schema '{"id": "str", "n": "int"}' --indexes '{"n": "btree"}' \\
        --state-dir .fabric/state/news [--exit-when-caught-up]

It prints one JSON object per line on stdout: ``started`` (with the offsets it resumes
from), ``batch`` (running totals), ``checkpoint`` (offsets saved), ``done``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from connectors._util import schema_from_spec
from fabric.ingest import checkpoint
from fabric.ingest.kafka import IngestOptions, KafkaIngestor


def say(event: str, **kw: object) -> None:
    print(json.dumps({"event": event, "t": time.time(), **kw}), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m fabric.ingest", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--schema", required=True, help='JSON object {column: type}, e.g. {"id": "str"}')
    p.add_argument("--indexes", default="{}", help="JSON object {column: hnsw|btree|inverted}")
    p.add_argument("--state-dir", required=True)
    p.add_argument("--group", help="consumer group (default fabric.ingest.<dataset>)")
    p.add_argument("--batch-size", type=int, default=5000)
    p.add_argument("--checkpoint-interval", type=float, default=10.0)
    p.add_argument("--dead-letter", default="topic")
    p.add_argument(
        "--pause", type=float, default=0.0, help="seconds to sleep after each batch (tests)"
    )
    p.add_argument("--exit-when-caught-up", action="store_true")
    p.add_argument("--timeout", type=float, default=None)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    from indexes.dataset import Dataset

    try:
        schema = schema_from_spec(json.loads(a.schema))
        indexes = json.loads(a.indexes)
    except ValueError as exc:
        print(f"fabric.ingest: --schema/--indexes: {exc}", file=sys.stderr)
        return 2
    state_dir = Path(a.state_dir)
    loaded = checkpoint.load(state_dir, lambda c: Dataset.load(str(c.dataset_dir)))
    ck, recovery = loaded.checkpoint, loaded.report()
    if recovery is not None:
        say("recovery", message=recovery)
    ds = loaded.value if ck else Dataset.create(a.dataset, schema, a.key, indexes)
    opts = IngestOptions(
        bootstrap=a.bootstrap,
        topic=a.topic,
        group_id=a.group or f"fabric.ingest.{a.dataset}",
        batch_size=a.batch_size,
        checkpoint_interval=a.checkpoint_interval,
        dead_letter=a.dead_letter,
    )
    ing = KafkaIngestor(
        a.dataset,
        ds,
        opts,
        state_dir=state_dir,
        start_offsets=ck.offsets if ck else None,
        resume=ck.meta if ck else None,
        recovery=recovery,
        on_checkpoint=lambda c: say(
            "checkpoint", seq=c.seq, offsets=c.offsets, applied=ing.stats.applied
        ),
    )
    say(
        "started",
        start_offsets=ing.start_offsets,
        count=ds.count(),
        checkpoint=ck.seq if ck else None,
    )
    last = -1

    def done(i: KafkaIngestor) -> bool:
        nonlocal last
        if i.stats.applied != last:
            last = i.stats.applied
            say(
                "batch",
                applied=i.stats.applied,
                dead_letters=i.stats.dead_letters,
                offsets=i.next_offsets,
            )
            if a.pause:
                time.sleep(a.pause)
        return a.exit_when_caught_up and i.caught_up()

    ok = ing.run_until(done, a.timeout)
    ing.stop(checkpoint_now=True)
    say("done", caught_up=ok, count=ds.count(), offsets=ing.next_offsets, stats=vars(ing.stats))
    return 0 if ok or not a.exit_when_caught_up else 1


if __name__ == "__main__":
    raise SystemExit(main())
