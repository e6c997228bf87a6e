"""A sandbox worker process: ``python -s fabric/sandbox/boot.py --in FD --out FD ...``.

Started by ``SandboxPool`` (never forked from the fabric) through ``boot.py``, which enters
the network namespace while the process has one thread.  It imports pyarrow, numpy and
the allowed modules, locks itself down (``oslayers.lockdown``), reports ``ready`` with
the active layers, then serves calls: Arrow IPC table in, snippet run under the runtime
layer, Arrow IPC table out.  Errors are reported with the snippet line that was running.
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import resource
import signal
import sys
import types
import warnings
from typing import Any

# Single-threaded numeric libraries: thread creation is blocked once locked down.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402

from . import oslayers, policy, protocol, restricted  # noqa: E402
from .restricted import SNIPPET_FILE, Guard, snippet_line  # noqa: E402


class _Limit(BaseException):
    """Raised into the running snippet by SIGXCPU (CPU) or SIGUSR1 (wall clock, from the fabric)."""


class _State:
    in_snippet = False
    limit_hit: str | None = None


def _on_limit_signal(signum, frame) -> None:
    if not _State.in_snippet:
        return
    _State.limit_hit = "CPU-time" if signum == signal.SIGXCPU else "wall-clock"
    raise _Limit(_State.limit_hit)


class _Channel:
    def __init__(self, rfd: int, wfd: int, shm: str | None):
        self.r = os.fdopen(rfd, "rb", buffering=0)
        self.wfd = wfd
        self.shm_in = self.shm_out = None
        if shm:  # "in_fd,out_fd,size": shared-memory regions made by the fabric
            in_fd, out_fd, size = (int(x) for x in shm.split(","))
            self.shm_in = mmap.mmap(in_fd, size, prot=mmap.PROT_READ)
            self.shm_out = mmap.mmap(out_fd, size)
            os.close(in_fd)
            os.close(out_fd)
            self.out_buf = pa.py_buffer(self.shm_out)
            self.out_bytes = np.frombuffer(self.shm_out, dtype=np.uint8)
        self.out_dirty = 0  # bytes of the output region the last reply may have written

    def wipe_output(self) -> None:
        """Zero what the previous reply left in the output region (the fabric has copied it
        out before sending this call): no snippet sees another call's result there."""
        if self.out_dirty:
            self.out_bytes[: self.out_dirty] = 0
            self.out_dirty = 0

    def read_exact(self, n: int) -> memoryview | None:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.r.readinto(view[got:])
            if not k:
                return None
            got += k
        return view

    def recv(self) -> tuple[dict, memoryview] | None:
        prefix = self.read_exact(protocol.PREFIX.size)
        if prefix is None:
            return None
        hlen, plen = protocol.PREFIX.unpack(prefix)
        head = self.read_exact(hlen)
        payload = self.read_exact(plen) if plen else memoryview(b"")
        if head is None or payload is None:
            return None
        header = json.loads(bytes(head))
        if "shm" in header and self.shm_in is not None:
            # a buffer over exactly this call's bytes: walking ``.parent`` from a column
            # ends here, not at the whole region (the fabric zeroes the rest of it)
            return header, pa.py_buffer(memoryview(self.shm_in)[: header["shm"]])
        return header, payload

    def send(self, header: dict, payload=b"") -> None:
        for part in protocol.encode(header, payload):
            view = memoryview(part).cast("B")
            while view:
                view = view[os.write(self.wfd, view) :]


def _prewarm(allowed: frozenset[str]) -> None:
    """Start pyarrow's thread pool and load what pyarrow/numpy import lazily, before lockdown.

    After the chroot nothing new can be loaded from disk, so common operations are run
    once here (a lazily imported module would otherwise fail inside a snippet).
    """
    import datetime
    import decimal
    import statistics

    import numpy as np
    import numpy.ma
    import pyarrow.compute as pc

    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    t = pa.table({"k": [1, 2, 1], "v": [1.0, 2.0, 3.0], "s": ["a", "b", "c"]})
    t.group_by("k").aggregate([("v", "sum"), ("s", "count_distinct")])
    t.join(t, "k")
    t.sort_by([("v", "descending")]).to_pylist()
    pc.match_substring_regex(t["s"], "a|b")
    pc.value_counts(t["k"])
    pc.strftime(pc.cast(pa.array([0], pa.int64()), pa.timestamp("s")), "%Y")
    for arr in (
        np.zeros(3),
        np.arange(3),
        np.array(["x"]),
        np.array(["2024-01-01"], "datetime64[s]"),
        np.ma.masked_array([1, 2], mask=np.array([False, True])),
    ):
        pa.array(arr)
    pa.table({"x": np.zeros(3)}).column("x").to_numpy()
    np.asarray(t["v"])
    rng = np.random.default_rng(0)
    np.linalg.norm(rng.random((3, 3)), axis=1)
    np.percentile(np.arange(10), 50)
    np.unique(np.array([1, 1, 2]), return_counts=True)
    np.histogram(np.arange(10))
    np.fft.fft(np.zeros(4))
    datetime.datetime.strptime("2024-01-02", "%Y-%m-%d").strftime("%c")
    statistics.median([1, 2, 3])
    statistics.fmean([1.0, 2.0])
    decimal.Decimal("1.1").quantize(decimal.Decimal("0.1"))
    "x".encode("idna")
    restricted.prepare(allowed)


def _error(kind: str, message: str, line: int | None) -> dict:
    return {"status": "error", "kind": kind, "message": message[:2000], "line": line}


def _classify(exc: BaseException, guard: Guard) -> dict:
    line = snippet_line(exc.__traceback__)
    if _State.limit_hit:
        return _error("timeout", f"exceeded its {_State.limit_hit} limit", line)
    if guard.violations:
        what, at = guard.violations[0]
        return _error("violation", what, at or line)
    if isinstance(exc, RecursionError):
        return _error("memory", "recursion too deep (stack limit)", line)
    if isinstance(exc, MemoryError):
        return _error(
            "memory",
            f"exceeded its memory limit ({type(exc).__name__}{': ' if str(exc) else ''}{exc})",
            line,
        )
    if isinstance(exc, OSError | ImportError):
        return _error("violation", f"the sandbox refused: {type(exc).__name__}: {exc}", line)
    if isinstance(exc, _Limit):
        return _error("timeout", f"exceeded its {exc} limit", line)
    return _error("runtime", f"{type(exc).__name__}: {exc}", line)


class _Limits:
    """Per-call soft limits under the hard limits set at lockdown (the worker may only lower)."""

    def __init__(self) -> None:
        self.statm = os.open("/proc/self/statm", os.O_RDONLY)  # kept open across the chroot
        self.page = os.sysconf("SC_PAGE_SIZE")

    def apply(self, limits: dict) -> None:
        vsz = int(os.pread(self.statm, 64, 0).split()[0]) * self.page
        for res, want in (
            (resource.RLIMIT_AS, vsz + int(limits["memory_bytes"])),
            (resource.RLIMIT_CPU, math.ceil(_cpu_used() + float(limits["cpu_seconds"])) + 1),
        ):
            hard = resource.getrlimit(res)[1]
            soft = want if hard == resource.RLIM_INFINITY else min(want, hard)
            resource.setrlimit(res, (soft, hard))


def _cpu_used() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _serve(ch: _Channel, restricted_python: bool, call_limits: _Limits) -> None:
    code_cache: dict[str, tuple[types.CodeType, bool]] = {}
    shared = restricted.SharedState()
    base_depth = len(_stack_depth())
    while True:
        msg = ch.recv()
        if msg is None:
            return
        header, payload = msg
        limits = header["limits"]
        guard = Guard()
        cached: tuple[types.CodeType, bool] | None = None
        result = None
        _State.limit_hit = None
        reply: dict
        out_payload = b""
        ch.wipe_output()
        try:
            table = pa.ipc.open_stream(payload).read_all()
            src = header["source"]
            cached = code_cache.get(src)
            if cached is None:
                cached = compile(src, SNIPPET_FILE, "exec"), restricted.stores_attributes(src)
                if len(code_cache) > 64:
                    code_cache.clear()
                code_cache[src] = cached
            code = cached[0]
            shared.reset()
            env: dict[str, Any] = (
                restricted.namespace(guard) if restricted_python else {"__name__": "pushdown"}
            )
            call_limits.apply(limits)
            sys.setrecursionlimit(base_depth + 50 + int(limits["max_recursion"]))
            _State.in_snippet = True
            try:
                exec(code, env)
                result = env["run"](table, **(header.get("params") or {}))
            finally:
                _State.in_snippet = False
                sys.setrecursionlimit(base_depth + 1000)
            del table, env
            if guard.violations or _State.limit_hit:
                raise _Limit("late")  # caught by the snippet: still report it
            reply, out_payload = _encode_result(result, limits, ch)
        except BaseException as exc:  # everything the snippet does is reported, never fatal
            _State.in_snippet = False
            reply = _classify(exc, guard)
        if restricted_python:
            changed = shared.tampered(check_classes=True if cached is None else cached[1])
            if changed:
                reply, out_payload = (
                    _error("violation", f"modified shared library state ({changed})", None),
                    b"",
                )
        ch.send(reply, out_payload)


def _bomb_message(exc: Exception, limit: int) -> str:
    return f"returned a table that would decode past the output limit of {limit} bytes: {exc}"


def _encode_result(result, limits: dict, ch: _Channel) -> tuple[dict, bytes]:
    if type(result) is pa.RecordBatch:
        result = pa.Table.from_batches([result])
    if type(result) is not pa.Table:  # exactly: a subclass could run snippet code from here
        return _error(
            "violation", f"run() returned {type(result).__name__}, expected a pyarrow.Table", None
        ), b""
    if result.num_rows > limits["max_rows"]:
        return _error(
            "violation",
            f"returned {result.num_rows} rows, over the limit of {limits['max_rows']}",
            None,
        ), b""
    try:
        result.validate()  # structure only: cheap, and enough to measure the decoded size
        protocol.check_decoded_size(result, limits["output_bytes"])
        result.validate(full=True)  # before this: a million views of one 16 MiB string
    except protocol.DecodeBomb as exc:
        return _error("violation", _bomb_message(exc, limits["output_bytes"]), None), b""
    except Exception as exc:
        return _error("violation", f"returned a malformed Arrow table: {exc}", None), b""
    if result.get_total_buffer_size() > limits["output_bytes"] * 2:
        return _error(
            "violation",
            f"returned {result.get_total_buffer_size()} bytes of Arrow data, over the output limit of {limits['output_bytes']}",
            None,
        ), b""
    if ch.shm_out is not None:
        size = protocol.ipc_into(ch.out_buf, result)
        ch.out_dirty = len(ch.shm_out) if size is None else size  # a failed write is partial
        if size is not None and size <= limits["output_bytes"]:
            return {"status": "ok", "rows": result.num_rows, "shm": size}, b""
    # no region, or larger than it: measured here, sent through the pipe if allowed
    buf = protocol.ipc_bytes(result)
    if buf.size > limits["output_bytes"]:
        return _error(
            "violation",
            f"returned {buf.size} bytes of Arrow IPC, over the output limit of {limits['output_bytes']}",
            None,
        ), b""
    return {"status": "ok", "rows": result.num_rows}, buf


def _stack_depth() -> list[types.FrameType]:
    frames: list[types.FrameType] = []
    f: types.FrameType | None = sys._getframe()
    while f is not None:
        frames.append(f)
        f = f.f_back
    return frames


def main(argv: list[str] | None = None, network_namespace: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -s fabric/sandbox/boot.py")
    ap.add_argument("--in", dest="rfd", type=int, required=True)
    ap.add_argument("--out", dest="wfd", type=int, required=True)
    ap.add_argument("--jail")
    ap.add_argument("--uid", type=int)
    ap.add_argument("--gid", type=int)
    ap.add_argument(
        "--own-uid", action="store_true", help="run as a uid of its own (oslayers.worker_uid)"
    )
    ap.add_argument("--shm", help="in_fd,out_fd,size of the shared-memory regions")
    ap.add_argument("--modules", help="comma-separated allowlist (default: policy.ALLOWED_MODULES)")
    ap.add_argument("--max-memory", type=int, default=1 << 30)
    ap.add_argument("--cpu-budget", type=int, default=600)
    ap.add_argument("--no-restricted-python", action="store_true")
    ap.add_argument("--skip-layers", default="", help="comma-separated layers to skip (tests)")
    args = ap.parse_args(argv)
    ch = _Channel(args.rfd, args.wfd, args.shm)
    _prewarm(frozenset(args.modules.split(",")) if args.modules else policy.ALLOWED_MODULES)
    signal.signal(signal.SIGXCPU, _on_limit_signal)
    signal.signal(signal.SIGUSR1, _on_limit_signal)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    call_limits = _Limits()
    # Nothing may block on stderr (a pipe nobody drains until a crash): warnings are dropped
    # and a full pipe makes a write fail instead of stalling the worker.
    warnings.simplefilter("ignore")
    os.set_blocking(2, False)  # before lockdown: seccomp allows no fcntl(F_SETFL)
    nofile = max(args.rfd, args.wfd, 2) + 8
    uid, gid = args.uid, args.gid
    if args.own_uid:
        uid = gid = oslayers.worker_uid(os.getpid())
    layers = oslayers.lockdown(
        args.jail,
        uid,
        gid,
        nofile,
        args.max_memory,
        args.cpu_budget,
        skip=set(filter(None, args.skip_layers.split(","))),
        **({} if network_namespace is None else {"network_namespace": network_namespace}),
    )
    layers["restricted_python"] = (
        "unavailable: disabled by the pool" if args.no_restricted_python else "active"
    )
    ch.send({"status": "ready", "layers": layers, "pid": os.getpid()})
    _serve(ch, not args.no_restricted_python, call_limits)


if __name__ == "__main__":
    main()
