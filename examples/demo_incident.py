"""The incident scenario of ``fabric demo``, on real components end to end.

A fabric ingests the ``headlines`` topic into an indexed dataset and pushes its
freshness signals over UDP to the reference scheduler (examples/scheduler), which runs
GPU agents: two read ``market_headlines`` (the lagging stream), two read other data.
A burst of 10^5 messages lands on the topic faster than ingestion applies them: the
fabric emits ``data_stale`` naming ``market_headlines``, the scheduler parks its agents
and gives their GPUs to the others; when ingestion has caught up (below half the
threshold: hysteresis) ``data_fresh`` releases them. Then every key is checked to be in
the dataset exactly once.
"""

from __future__ import annotations

import datetime as dt
import itertools
import shutil
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "incident" / "fabric.yaml"
BURST = 100_000


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _headlines(n: int, start: int = 0) -> pa.Table:
    now = dt.datetime.now(dt.UTC)
    syms = ["AAPL", "MSFT", "NVDA", "SPY"]
    return pa.table(
        {
            "id": [f"h{i:07d}" for i in range(start, start + n)],
            "published_at": pa.array([now] * n, pa.timestamp("us", tz="UTC")),
            "symbol": [syms[i % 4] for i in range(start, start + n)],
            "body": [
                f"{syms[i % 4]} moves at the open, update {i}" for i in range(start, start + n)
            ],
        }
    )


def run(
    env: dict[str, str],
    check: Any,
    *,
    cleanup_topic: bool = False,
    progress: Any = None,
    record: list[dict[str, Any]] | None = None,
) -> None:
    """The scenario; ``record`` (a list) gets a sample per signal and per catch-up poll:
    ``{"t": seconds since start, "lag": messages or None, "event": data_stale/... or None,
    "agents": {name: "GPU 0" | "waiting" | "parked"}}`` (examples/incident/plot.py)."""
    import os

    from fabric.progress import Progress

    progress = progress or Progress()

    sys.path.insert(0, str(ROOT))
    from examples.demo import title
    from examples.scheduler.scheduler import Scheduler, listen_udp
    from examples.seed.load import produce

    title("5. Incident: the headline stream falls 10^5 messages behind  (signals -> GPU scheduler)")
    topic = f"fabric_demo_headlines_{uuid.uuid4().hex[:6]}"
    port = _free_udp_port()
    t0 = time.time()
    timeline: list[str] = []

    def log(msg: str) -> None:
        timeline.append(f"t={time.time() - t0:5.1f}s  {msg}")
        print("  " + timeline[-1])

    sched = Scheduler(gpus=2, log=log)
    stop = threading.Event()
    listen_udp(sched, "127.0.0.1", port, stop)
    events: list[Mapping[str, Any]] = []
    peak = [0]  # the largest lag any signal reported
    orig = sched.on_signal

    def on_signal(event: Mapping[str, Any]) -> None:
        lag = event.get("lag_messages")
        if isinstance(lag, int) and lag > peak[0]:
            peak[0] = lag
        if event.get("event") in ("data_stale", "data_fresh"):
            events.append(event)
            log(
                f"signal  {event['event']} ({event.get('scope', 'source')}) "
                f"source={event.get('source')} bindings={event.get('bindings')} "
                f"lag={event.get('lag_messages')} messages"
            )
        orig(event)
        if record is not None:
            kind = event.get("event")
            scoped = kind if event.get("scope", "source") == "source" else None
            record.append(_sample(sched, t0, lag, scoped if kind != "heartbeat" else None))

    sched.on_signal = on_signal  # type: ignore[method-assign]
    for name, binding in [
        ("analyst-1", "market_headlines"),
        ("analyst-2", "market_headlines"),
        ("shopper-1", "nearby_offers"),
        ("shopper-2", "top_category_last_week"),
    ]:
        sched.add_agent(name, [binding])
    produce(env["FABRIC_KAFKA_BOOTSTRAP"], topic, _headlines(1_000), "id", recreate=True)
    state = tempfile.mkdtemp(prefix="fabric-incident-")
    os.environ.update(
        {
            "FABRIC_HEADLINES_TOPIC": topic,
            "FABRIC_SCHEDULER_PORT": str(port),
            "FABRIC_STATE_DIR": state,
        }
    )
    try:
        _incident(env, check, topic, sched, events, timeline, log, stop, t0, peak, progress, record)
    finally:
        stop.set()
        shutil.rmtree(state, ignore_errors=True)  # the dataset's checkpoints (~30 MB)
        if cleanup_topic:  # on the shared servers: do not leave 10^5 messages behind
            _delete_topic(env["FABRIC_KAFKA_BOOTSTRAP"], topic)


def _sample(sched: Any, t0: float, lag: Any, event: str | None) -> dict[str, Any]:
    held = sched.holding()
    parked = set(sched.parked())
    agents = {
        name: f"GPU {held[name]}" if name in held else "parked" if name in parked else "waiting"
        for name in sched.agents
    }
    lag = lag if isinstance(lag, int) else None
    return {"t": time.time() - t0, "lag": lag, "event": event, "agents": agents}


def _delete_topic(bootstrap: str, topic: str) -> None:
    from confluent_kafka.admin import AdminClient

    try:
        for f in AdminClient({"bootstrap.servers": bootstrap}).delete_topics([topic]).values():
            f.result(timeout=10)
    except Exception as e:  # the demo's answer stands; say what is left behind
        print(f"  (could not delete the demo topic {topic}: {e})")


def _incident(
    env: dict[str, str],
    check: Any,
    topic: str,
    sched: Any,
    events: list[Mapping[str, Any]],
    timeline: list[str],
    log: Any,
    stop: threading.Event,
    t0: float,
    peak: list[int],
    progress: Any,
    record: list[dict[str, Any]] | None = None,
) -> None:
    import fabric
    from examples.seed.load import produce

    with fabric.open(CONFIG) as fab:
        ds = fab.dataset("headlines")
        while ds.count() < 1_000 and time.time() - t0 < 60:
            time.sleep(0.1)
        log(
            f"fabric ingesting {topic}: {ds.count()} headlines; GPUs held (agent: GPU, 2 GPUs "
            f"for 4 agents, a parked agent's GPU goes to a waiting one): {sched.holding()}"
        )
        res = fab.query("market_headlines", session={"symbol": "NVDA"})
        log(
            f"market_headlines answers {res.table.num_rows} rows, freshness {res.freshness['h']['status']}"
        )
        log(f"burst: producing {BURST:,} messages")
        burst = threading.Thread(
            target=produce,
            args=(env["FABRIC_KAFKA_BOOTSTRAP"], topic, _headlines(BURST, 1_000), "id"),
            kwargs={"recreate": False, "flush_every": BURST},
        )
        burst.start()
        while burst.is_alive() and not events:
            time.sleep(0.05)
        # Queries while the burst lands: each answer's label must agree with the lag it
        # reports against the binding's bound (max_lag_messages: 1000). Ingestion can drain
        # the lag between the data_stale signal and a query, so the demo samples until one
        # answer is taken above the bound (or the lag is gone) rather than trusting one.
        seen: list[tuple[str, int]] = []
        until = time.time() + 10
        while time.time() < until:
            f = fab.query("market_headlines", session={"symbol": "NVDA"}).freshness["h"]
            seen.append((f["status"], int(f["lag_messages"] or 0)))
            if (f["lag_messages"] and f["lag_messages"] > 1000) or not burst.is_alive():
                break
        status, lag = seen[-1]
        log(f"a query during the lag is flagged: status={status} lag_messages={lag}")
        wrong = [s for s in seen if s[1] > 1000 and s[0] != "stale"]
        check(
            not wrong,
            f"every answer above the bound is flagged stale (on_stale: flag); "
            f"{len(seen)} sampled, mislabelled: {wrong[:3]}",
        )
        with progress.step(f"producing the burst of {BURST:,} messages"):
            burst.join()
        log("burst produced")
        deadline = time.time() + 180
        total = BURST + 1_000
        with progress.step("ingestion catching up", total=total) as step:
            while time.time() < deadline and not (
                ds.count() >= total and events and events[-1]["event"] == "data_fresh"
            ):
                for src in fab.freshness().get("sources", {}).values():  # the peak lag
                    lag = src.get("lag_messages")
                    if isinstance(lag, int) and lag > peak[0]:
                        peak[0] = lag
                    if record is not None and isinstance(lag, int):
                        record.append(_sample(sched, t0, lag, None))
                step.update(ds.count())
                time.sleep(0.2)
        log(
            f"caught up: {ds.count():,} headlines; GPUs held: {sched.holding()}; "
            f"parked: {sched.parked()}; peak lag {peak[0]:,} messages"
        )
        snap = fab.freshness()
        total = ds.count()
    stop.set()
    kinds = [e["event"] for e in events if e.get("scope", "source") == "source"]
    check("data_stale" in kinds, "the fabric pushed data_stale when the lag crossed 1000 messages")
    check(
        any(
            e["event"] == "data_stale" and "market_headlines" in e.get("bindings", [])
            for e in events
        ),
        "data_stale named the affected binding (market_headlines)",
    )
    check(
        "data_fresh" in kinds and kinds.index("data_fresh") > kinds.index("data_stale"),
        "data_fresh followed once ingestion caught up",
    )
    # hysteresis: stale above 1000, fresh again only at <= 500 held for recover_after. One
    # data_stale over the burst unless the producer itself paused that long (lag 0: the data
    # was fresh then, as seen on a machine under load 28), so each signal is checked against
    # the lag it reports rather than counted
    source_events = [e for e in events if e.get("scope", "source") == "source"]
    off = [
        (e["event"], e.get("lag_messages"))
        for e in source_events
        if (
            e["event"] == "data_stale"
            and not ((e.get("lag_messages") or 0) > 1000 or (e.get("lag_seconds") or 0) > 30)
        )
        or (e["event"] == "data_fresh" and not (e.get("lag_messages") or 0) <= 500)
    ]
    alternating = all(a["event"] != b["event"] for a, b in itertools.pairwise(source_events))
    n = kinds.count("data_stale")
    check(
        not off and alternating,
        f"no flapping: {n} data_stale event{'' if n == 1 else 's'} for the source, each above "
        f"1000 messages (or 30 s), each data_fresh at <= 500 (hysteresis)"
        + (f": {off}" if off else ""),
    )
    check(
        any("park    analyst" in t for t in timeline)
        and any("release analyst" in t for t in timeline),
        "the scheduler parked the analysts while stale and released them when fresh",
    )
    check(total == BURST + 1_000, f"every headline is in the dataset exactly once ({total:,})")
    print(
        "  /v1/freshness now: "
        + ", ".join(
            f"{n}: {s.get('state')} lag={s.get('lag_messages')}"
            for n, s in snap.get("sources", {}).items()
        )
    )
