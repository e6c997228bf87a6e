"""The background folder's CPU priority (issue 12: right after a bulk upsert the folder
fell behind while queries ran). Its thread runs at the process's own niceness: +5 counted
against every process on a shared machine, not only this one's writers, and folded 1.5-4x
fewer rows per second under a query pass (benchmarks/retrieval_folding.py, docs/indexes.md)."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from indexes import Dataset, IndexSpec
from tests.test_retrieval import ASCHEMA, anti_data, anti_table


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_the_folder_thread_runs_at_the_process_priority():
    lab, x, rnd = anti_data(3000)
    ds = Dataset.create("nice", ASCHEMA, "id", {"v": IndexSpec("hnsw", metric="l2")}, fold_rows=500)
    try:
        seen: list[int] = []
        done = threading.Event()
        real = ds._fold_some

        def spy() -> int:  # runs on the folder thread: read its own niceness
            if not seen:
                seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
                done.set()
            return real()

        ds._fold_some = spy  # type: ignore[method-assign]
        ds.upsert(anti_table(range(3000), lab, x, rnd))
        assert done.wait(30), "the folder never ran"
        assert seen == [os.getpriority(os.PRIO_PROCESS, 0)]
        assert ds.wait_folded(60)
    finally:
        ds.close()
