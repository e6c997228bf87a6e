"""Sandbox pool start-up: how long a new process's first pushdown snippet waits.

    .venv/bin/python benchmarks/sandbox_start.py [--sizes 1,2,4] [--repeat 3]

For each pool size, in fresh pools: ``SandboxPool(size)`` returns (what ``shared_pool``
holds its lock for, so what the first query waits for), the first ``run`` after it, and
when every worker is idle. Prints a table with the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import pyarrow as pa

from fabric.sandbox import SandboxPool

SNIPPET = "def run(t):\n    return t\n"


def once(size: int) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    pool = SandboxPool(size=size)
    built = time.perf_counter() - t0
    pool.run(SNIPPET, pa.table({"x": [1, 2, 3]}), binding="bench")
    first = time.perf_counter() - t0
    while pool._idle.qsize() < size and time.perf_counter() - t0 < 60:
        time.sleep(0.005)
    all_idle = time.perf_counter() - t0
    pool.close()
    return built, first, all_idle


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,2,4")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(
        f"{'size':>4}  {'pool built s':>12}  {'first run s':>11}  {'all idle s':>10}  (median of {args.repeat})"
    )
    for size in map(int, args.sizes.split(",")):
        runs = [once(size) for _ in range(args.repeat)]
        med = [statistics.median(r[i] for r in runs) for i in range(3)]
        print(f"{size:>4}  {med[0]:>12.2f}  {med[1]:>11.2f}  {med[2]:>10.2f}")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
