"""Simulate the seed incident: the news stream falls 10^5 messages behind, then recovers.

Twelve agents share six GPUs: six read ``market_open_news`` (source ``news``), six read
``nearby_offers`` (source ``loc``). A job is 8 s of GPU work and needs its binding's data
within the bound (1000 messages) when it starts; if the data is behind, the agent waits,
and a GPU it holds sits reserved and idle.

The lag series drives the fabric's real ``FreshnessTracker`` (thresholds, hysteresis and
all) on a simulated clock; its ``data_stale`` / ``data_fresh`` events go to the reference
``Scheduler``. The same run without the signal keeps the scheduler blind.

    python examples/scheduler/simulate.py [--gpus 6] [--burst 100000]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from scheduler import Scheduler

from fabric.freshness import FreshnessTracker
from fabric.signals import Thresholds

BOUND = 1000  # messages: what each job needs before it can start
JOB = 8.0  # GPU seconds per job


@dataclass
class Outcome:
    name: str
    wasted: float = 0.0  # GPU-seconds held by agents waiting on stale data
    useful: float = 0.0  # GPU-seconds of actual work
    jobs: int = 0
    signals: int = 0
    max_parked: int = 0


def lag_series(t: float, burst: int, start: float, produce: float, ingest: float) -> dict[str, int]:
    """news: noise below the bound, then a burst at ``start`` draining at ingest - produce."""
    noise = int(150 + 120 * ((t * 7) % 3))
    news = noise
    if t >= start:
        news = max(noise, int(burst - (t - start) * (ingest - produce)))
    return {"news": news, "loc": int(80 + 60 * ((t * 3) % 2))}


def run(
    use_signal: bool, gpus: int, burst: int, horizon: float = 300.0, dt: float = 0.5
) -> Outcome:
    out = Outcome("with signal" if use_signal else "without signal")
    clock = [0.0]
    tracker = FreshnessTracker(
        Thresholds(lag_messages=BOUND, lag_seconds=30), clock=lambda: clock[0]
    )
    for s in ("news", "loc"):
        tracker.register_source(s)
    tracker.set_bindings({"market_open_news": ["news"], "nearby_offers": ["loc"]})
    sched = Scheduler(gpus, log=lambda _s: None)

    def on_event(ev: dict) -> None:
        out.signals += ev["event"] != "heartbeat"
        if use_signal:
            sched.on_signal(ev)

    tracker.listen(on_event)
    agents = {f"news{i}": "market_open_news" for i in range(6)} | {
        f"shop{i}": "nearby_offers" for i in range(6)
    }
    source_of = {"market_open_news": "news", "nearby_offers": "loc"}
    for name, b in agents.items():
        sched.add_agent(name, [b])
    progress = dict.fromkeys(agents, 0.0)
    t = 0.0
    while t < horizon:
        clock[0] = 1_000_000.0 + t
        lags = lag_series(t, burst, start=60.0, produce=5000, ingest=7000)
        for s, lag in lags.items():
            tracker.record_applied(s, int(7000 * dt), newest_event_time=clock[0] - lag / 5000)
            tracker.update_lag(s, lag)
        for name in list(sched.holding()):
            behind = lags[source_of[agents[name]]] > BOUND
            if progress[name] == 0.0 and behind:  # the job cannot start: the GPU waits with it
                out.wasted += dt
                continue
            progress[name] += dt
            out.useful += dt
            if progress[name] >= JOB:
                progress[name] = 0.0
                out.jobs += 1
                sched.finish(name)
        out.max_parked = max(out.max_parked, len(sched.parked()))
        t += dt
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, default=6)
    p.add_argument(
        "--burst", type=int, default=100_000, help="messages the news stream falls behind"
    )
    a = p.parse_args(argv)
    rows = [run(False, a.gpus, a.burst), run(True, a.gpus, a.burst)]
    print(
        f"incident: news lags {a.burst:,} messages at t=60s, drains at 2,000 msg/s; {a.gpus} GPUs, 12 agents, 300 s"
    )
    print(
        f"{'scenario':<16}{'GPU-s waiting on stale data':>30}{'useful GPU-s':>15}{'jobs done':>12}{'max parked':>12}{'signals':>9}"
    )
    for r in rows:
        print(
            f"{r.name:<16}{r.wasted:>30.1f}{r.useful:>15.1f}{r.jobs:>12}{r.max_parked:>12}{r.signals:>9}"
        )
    saved = rows[0].wasted - rows[1].wasted
    print(
        f"GPU-seconds saved by the signal: {saved:.1f} ({saved / max(rows[0].wasted, 1e-9):.0%} of the waiting)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
