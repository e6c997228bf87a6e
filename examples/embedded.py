"""What every example under examples/ shares: its command-line flags, its data, and a
fabric on embedded defaults.

``run_example(scenario, here, args)`` generates the seed data with ``--seed`` and
``--scale`` (``examples/seed/data.py``), starts only the local servers the scenario reads
(noida-db for Kafka, SecantusDB for MongoDB: ``examples.demo_local.LocalStack``, child
processes on free ports, stopped and removed when the block ends), loads the data into
them, SQLite and a local directory, and opens the example's own ``fabric.yaml`` (which
names only the connections that scenario uses) with those addresses.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

NEEDS = {  # scenario -> (kafka, mongo)
    "ecommerce": (True, True),
    "finance": (True, False),
    "analytics": (False, False),
    "risk": (False, False),
}


def parser(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--seed", type=int, default=7, help="seed of the generated data (7)")
    ap.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="size of the generated data, x the default row counts (1.0: 2,000 merchants, "
        "6,000 coupons, 20,000 orders, 2,000 news, 3 risk policies)",
    )
    return ap


def generate(seed: int, scale: float) -> dict[str, pa.Table]:
    from examples.seed.data import generate as gen

    def n(x: int) -> int:
        return max(1, round(x * scale))

    return gen(
        seed,
        users=max(20, n(50)),
        merchants=n(2_000),
        coupons=n(6_000),
        orders=n(20_000),
        products=max(20, n(500)),
        news=max(50, n(2_000)),
        policies=max(3, n(3)),
    )


@contextlib.contextmanager
def embedded(
    scenario: str, here: Path, data: dict[str, pa.Table], **extra_env: str
) -> Iterator[tuple[Any, dict[str, str]]]:
    """(fabric, env) for ``here/fabric.yaml`` over the scenario's data on local servers."""
    import fabric
    from examples.demo_local import LocalStack, load_for
    from fabric.config import load_config

    kafka, mongo = NEEDS[scenario]
    with LocalStack() as stack:
        env = stack.start(kafka=kafka, mongo=mongo)
        load_for({scenario}, env, data, servers=False, news_topic=scenario == "finance")
        env.update(extra_env)
        config = load_config(here / "fabric.yaml", env={**os.environ, **env})
        with fabric.open(config) as fab:
            yield fab, env
