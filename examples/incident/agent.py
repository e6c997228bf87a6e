"""Incident: the headline stream falls 10^5 messages behind.

The fabric ingests the ``headlines`` topic into an indexed dataset and pushes freshness
signals over UDP to the reference GPU scheduler (examples/scheduler/scheduler.py), which
runs four agents on two GPUs: two read ``market_headlines`` (the lagging stream), two read
other data. A burst of 10^5 messages makes the fabric emit ``data_stale`` naming
``market_headlines``; the scheduler parks those agents and gives their GPUs to the
others; when ingestion has caught up, ``data_fresh`` releases them. Checked: the signals
(one data_stale, then data_fresh, no flapping), every answer above the bound flagged
stale, the parking and releasing, and every headline in the dataset exactly once.

    python examples/incident/agent.py [--png incident.png]

``--png`` also draws the lag and the agents' states over time (examples/incident/plot.py;
needs matplotlib: ``pip install 'agent-data-fabric[docs]'``) and prints the file's path.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the checkout (or site-packages) root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv: list[str] | None = None) -> int:
    from examples import demo_incident
    from examples.demo import Check
    from examples.demo_local import LocalStack

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--png", metavar="FILE", help="draw the lag and the agents' states here")
    args = ap.parse_args(argv)
    check = Check()
    record: list[dict] = []
    with LocalStack() as stack:  # noida-db as a child process, removed when done
        env = stack.start(kafka=True, mongo=False)
        os.environ.update(env)  # examples/incident/fabric.yaml reads the addresses from it
        demo_incident.run(env, check, record=record)
    if args.png:
        from examples.incident.plot import plot

        print(f"  wrote {plot(record, args.png)} ({len(record)} samples)")
    return 1 if check.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
