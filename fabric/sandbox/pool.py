"""A pool of warm, locked-down worker processes that run pushdown snippets.

``SandboxPool.run`` sends the table to an idle worker as Arrow IPC, waits for the result
under the call's CPU-time and wall-clock limits (enforced from here, not trusted to the
worker), validates what comes back and returns a ``pyarrow.Table``.  A worker that
violated a limit, crashed or timed out is killed and replaced; the pool carries on.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import logging
import mmap
import os
import queue
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from .errors import (
    ERROR_CLASSES,
    SandboxError,
    SandboxRuntimeError,
    SandboxTimeout,
    SandboxViolation,
)
from .limits import SandboxLimits
from .oslayers import verify_threads
from .policy import ALLOWED_MODULES, resolve_modules
from .protocol import (
    MAX_HEADER_BYTES,
    PREFIX,
    DecodeBomb,
    check_decoded_size,
    encode,
    ipc_bytes,
    ipc_into,
)
from .static import check_snippet

log = logging.getLogger("fabric.sandbox")
_WARNED: set[str] = set()
_PROJECT_ROOT = str(Path(__file__).resolve().parents[2])
_BOOT = str(Path(__file__).resolve().with_name("boot.py"))
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")
F_SETPIPE_SZ = 1031
GRACE_SECONDS = 0.5  # after a limit signal, time the worker has to report the snippet line
TICK_SECONDS = 0.02  # how often CPU time is checked while waiting for a worker


class _WorkerGone(Exception):
    pass


class _Expired(Exception):
    pass


class _Worker:
    """One worker process and the fabric's end of its two pipes."""

    def __init__(
        self,
        argv: Sequence[str],
        env: dict[str, str],
        start_timeout: float,
        shm_bytes: int = 0,
        jail: str | None = None,
    ):
        self.shm_in = self.shm_out = None
        self.in_dirty = 0  # bytes of the input region the last request may have written
        self.in_bytes: np.ndarray | None = None
        shm_fds: list[int] = []
        if shm_bytes:
            # two shared-memory regions (memfd): tables in and out without pipe copies
            for name in ("fabric-sandbox-in", "fabric-sandbox-out"):
                fd = os.memfd_create(name, os.MFD_CLOEXEC)
                os.ftruncate(fd, shm_bytes)
                shm_fds.append(fd)
            self.shm_in = mmap.mmap(shm_fds[0], shm_bytes)
            self.in_bytes = np.frombuffer(self.shm_in, dtype=np.uint8)
            self.shm_out = mmap.mmap(shm_fds[1], shm_bytes, prot=mmap.PROT_READ)
            argv = [*argv, "--shm", f"{shm_fds[0]},{shm_fds[1]},{shm_bytes}"]
        p2c_r, p2c_w = os.pipe()
        c2p_r, c2p_w = os.pipe()
        for fd in (p2c_w, c2p_w):
            try:
                import fcntl

                fcntl.fcntl(fd, F_SETPIPE_SZ, 1 << 20)
            except OSError:
                pass  # pipes stay at the default size: slower for big tables, still correct
        self.proc = subprocess.Popen(
            [*argv, "--in", str(p2c_r), "--out", str(c2p_w)],
            pass_fds=(p2c_r, c2p_w, *shm_fds),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            cwd=_PROJECT_ROOT,
            close_fds=True,
        )
        for fd in (p2c_r, c2p_w, *shm_fds):
            os.close(fd)
        self.rfd, self.wfd, self.pid = c2p_r, p2c_w, self.proc.pid
        assert self.proc.stderr is not None
        self.stderr = self.proc.stderr
        for fd in (self.rfd, self.wfd, self.stderr.fileno()):
            os.set_blocking(fd, False)
        self.rpoll, self.wpoll = select.poll(), select.poll()
        self.rpoll.register(self.rfd, select.POLLIN)
        self.wpoll.register(self.wfd, select.POLLOUT)
        deadline = time.monotonic() + start_timeout
        try:
            header, _ = self.recv(lambda: deadline, lambda: None, max_payload=0)
        except (_WorkerGone, _Expired) as exc:
            detail = self.stderr_tail()
            self.kill()
            raise SandboxError(
                "(pool start-up)",
                f"a sandbox worker failed to start ({type(exc).__name__}); "
                f"its stderr: {detail or '(empty)'}",
            ) from None
        claimed = header.get("layers", {})
        try:
            self.layers = verify_threads(self.pid, claimed, jail)
        except OSError as exc:  # the worker died or /proc cannot be read: nothing is verified
            self.kill()
            raise SandboxError(
                "(pool start-up)", f"could not verify the sandbox worker's threads: {exc}"
            ) from None
        failed = {k: v for k, v in self.layers.items() if v.startswith("failed")}
        if failed:  # fail closed: a thread outside a layer the worker claims is an escape
            self.kill()
            raise SandboxError(
                "(pool start-up)",
                "refusing to run snippets: a sandbox worker has a thread outside its layers ("
                + "; ".join(f"{k} {v}" for k, v in failed.items())
                + ")",
                hint="report this as a bug; the pool runs no snippet on such a worker",
            )
        self.base_vsz = self.vsz()

    # process facts, read from /proc by the fabric (the worker cannot lie about them)
    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK

    def vsz(self) -> int:
        with open(f"/proc/{self.pid}/statm", "rb") as f:
            return int(f.read().split()[0]) * _PAGE

    # framed I/O with deadlines --------------------------------------------------------
    def send(self, parts, deadline, check) -> None:
        for part in parts:
            view = memoryview(part).cast("B")
            while view:
                try:
                    view = view[os.write(self.wfd, view) :]
                    continue
                except BlockingIOError:
                    pass
                except (BrokenPipeError, OSError):
                    raise _WorkerGone from None
                self._wait(self.wpoll, deadline, check)

    def recv(self, deadline, check, max_payload: int) -> tuple[dict, bytes | bytearray]:
        hlen, plen = PREFIX.unpack(self._read(PREFIX.size, deadline, check))
        if hlen > MAX_HEADER_BYTES:
            raise ValueError(f"a {hlen}-byte header")
        if plen > max_payload:
            raise OverflowError(plen)
        try:
            header = json.loads(self._read(hlen, deadline, check))
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"a header that is not JSON ({exc})") from None
        if not isinstance(header, dict):
            raise ValueError("a header that is not a JSON object")
        shm = header.get("shm")
        if shm is not None and self.shm_out is not None:
            if not isinstance(shm, int) or shm < 0 or shm > len(self.shm_out):
                raise ValueError(f"shared-memory size {shm!r}")
            if shm > max_payload:
                raise OverflowError(shm)
            return header, self.shm_out[:shm]  # a copy: the worker cannot change it under us
        return header, self._read(plen, deadline, check) if plen else b""

    def request(self, header: dict, table: pa.Table) -> list:
        """Frame a call; the table goes through shared memory when it fits."""
        if self.shm_in is not None:
            size = ipc_into(pa.py_buffer(self.shm_in), table)
            # the region holds only this call's table: zero what earlier calls left after it
            written = len(self.shm_in) if size is None else size  # a failed write is partial
            if self.in_dirty > written and self.in_bytes is not None:
                self.in_bytes[written : self.in_dirty] = 0
            self.in_dirty = written
            if size is not None:
                return encode({**header, "shm": size})
        return encode(header, ipc_bytes(table))  # no region, or larger than it: by pipe

    def _read(self, n: int, deadline, check) -> bytearray:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            try:
                k = os.readv(self.rfd, [view[got:]])
            except BlockingIOError:
                k = -1
            if k == 0:
                raise _WorkerGone
            if k > 0:
                got += k
            else:
                self._wait(self.rpoll, deadline, check)
        return buf

    @staticmethod
    def _wait(poller, deadline, check) -> None:
        left = deadline() - time.monotonic()
        if left > 0:
            poller.poll(min(left, TICK_SECONDS) * 1000)
        check()

    def stderr_tail(self) -> str:
        try:
            data = self.stderr.read(65536) or b""
        except (OSError, ValueError):
            data = b""
        return data.decode(errors="replace").strip()[-1500:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        for fd in (self.rfd, self.wfd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.stderr.close()
        self.in_bytes = None
        for region in (self.shm_in, self.shm_out):
            if region is not None:
                region.close()


class _Watch:
    """The call's CPU-time and wall-clock limits, enforced from the fabric's side."""

    def __init__(self, worker: _Worker, limits: SandboxLimits):
        self.worker, self.limits = worker, limits
        self.cpu0 = worker.cpu_seconds()
        self.deadline = time.monotonic() + limits.wall_seconds
        self.next_cpu_check = time.monotonic() + TICK_SECONDS
        self.fired: str | None = None

    def remaining_deadline(self) -> float:
        return self.deadline

    def check(self) -> None:
        now = time.monotonic()
        if self.fired:
            if now >= self.deadline:
                raise _Expired(self.fired)
            return
        if now >= self.deadline:
            self._fire("wall-clock", signal.SIGUSR1)
        elif now >= self.next_cpu_check:
            self.next_cpu_check = now + TICK_SECONDS
            try:
                used = self.worker.cpu_seconds() - self.cpu0
            except OSError:
                return  # the worker is gone; the read will see EOF
            if used > self.limits.cpu_seconds:
                self._fire("CPU-time", signal.SIGXCPU)

    def _fire(self, kind: str, signum: int) -> None:
        """Ask the worker to stop and report its line; it is killed after a grace period."""
        self.fired = kind
        self.deadline = time.monotonic() + GRACE_SECONDS
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.worker.pid, signum)


class SandboxPool:
    """Warm sandbox workers; ``run`` is thread-safe (each concurrent call gets its own worker).

    ``layers`` maps each isolation layer to ``"active"`` or ``"unavailable: <reason>"``.
    The underscore options exist for tests: they switch layers off to show the others hold.
    """

    def __init__(
        self,
        size: int = 2,
        *,
        limits: SandboxLimits | None = None,
        start_timeout: float = 60.0,
        cpu_budget: int = 600,
        acquire_timeout: float = 60.0,
        transport: str = "shm",
        allowed_modules: Sequence[str] | None = None,
        _static_checks: bool = True,
        _restricted_python: bool = True,
        _skip_layers: Sequence[str] = (),
        _worker_argv: Sequence[str] | None = None,
    ):
        if size < 1:
            raise ValueError(f"SandboxPool size must be at least 1, got {size}")
        self.size = size
        self.limits = limits or SandboxLimits()
        self.start_timeout, self.acquire_timeout = start_timeout, acquire_timeout
        self.cpu_budget = cpu_budget
        if transport not in ("shm", "pipe"):
            raise ValueError(f"SandboxPool transport must be 'shm' or 'pipe', got {transport!r}")
        self.transport = transport
        self.allowed_modules = resolve_modules(allowed_modules)
        self._static = _static_checks
        self._static_cache: dict[tuple, list] = {}
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._lock = threading.Lock()
        self._live = 0
        # fair queuing between bindings (``_acquire``)
        self._cv = threading.Condition()
        self._tickets = itertools.count()
        self._waiting: dict[str, collections.deque[int]] = {}
        self._running: collections.Counter[str] = collections.Counter()
        self._served: dict[str, int] = {}
        self._closed = False
        self._jail: str | None = None
        self._argv = list(_worker_argv or [sys.executable, "-s", _BOOT])
        if os.geteuid() == 0:
            self._jail = tempfile.mkdtemp(prefix="fabric-sandbox-jail-")
            os.chmod(self._jail, 0o555)
            self._argv += ["--jail", self._jail, "--own-uid"]
        self._argv += [
            "--max-memory",
            str(self.limits.memory_bytes),
            "--cpu-budget",
            str(cpu_budget),
        ]
        if self.allowed_modules != ALLOWED_MODULES:
            self._argv += ["--modules", ",".join(sorted(self.allowed_modules))]
        # a pool dropped without close() still stops its workers and removes the jail
        weakref.finalize(self, _close_idle, self._idle, self._jail)
        if not _restricted_python:
            self._argv.append("--no-restricted-python")
        if _skip_layers:
            self._argv += ["--skip-layers", ",".join(_skip_layers)]
        self._env = {
            "PATH": os.defpath,
            "PYTHONPATH": _PROJECT_ROOT,
            "PYTHONDONTWRITEBYTECODE": "1",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "ARROW_DEFAULT_MEMORY_POOL": "system",
            "LANG": "C.UTF-8",
        }  # the fabric's own environment (secrets!) is not passed on
        self.layers: dict[str, str] = {}
        first = self._spawn()
        assert first is not None
        self.layers = dict(first.layers)
        self._warn_layers()
        self._idle.put(first)
        # the other workers start in the background, side by side: the pool (and so the
        # first query, which waits for ``shared_pool``) is ready with its first worker
        # instead of after ``size`` serial starts of 1-3 s each (benchmarks/sandbox_start.py)
        self._starting = [
            threading.Thread(target=self._replace, daemon=True, name="sandbox-start")
            for _ in range(size - 1)
        ]
        for t in self._starting:
            t.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the workers started in the background at construction are up (or
        failed to start: the next ``run`` starts one and reports why); True if they are."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._starting:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._starting)

    @classmethod
    def from_config(cls, config: Any) -> SandboxPool:
        """A pool for ``fabric.yaml``'s ``sandbox:`` section (``fabric.config.SandboxConfig``):
        ``workers``, default limits, ``allowed_imports`` (replaces the allowlist)."""
        return cls(
            size=getattr(config, "workers", 2) or 2,
            limits=SandboxLimits.from_settings(config),
            allowed_modules=getattr(config, "allowed_imports", None) or None,
        )

    # worker lifecycle -----------------------------------------------------------------
    def _spawn(self) -> _Worker | None:
        """Start a worker if the pool has room for one (checked and counted atomically)."""
        return self._start() if self._reserve() else None

    def _reserve(self) -> bool:
        with self._lock:
            if self._live >= self.size:
                return False
            self._live += 1
            return True

    def _start(self) -> _Worker:
        """Start a worker in a slot ``_reserve`` counted (given back if the start fails)."""
        try:
            shm = self.limits.output_bytes if self.transport == "shm" else 0
            return _Worker(self._argv, self._env, self.start_timeout, shm, self._jail)
        except BaseException:
            with self._lock:
                self._live -= 1
            raise

    def _put_idle(self, worker: _Worker) -> None:
        self._idle.put(worker)
        with self._cv:
            self._cv.notify_all()

    def _warn_layers(self) -> None:
        for name, state in self.layers.items():
            msg = f"sandbox layer '{name}' is {state}"
            if state != "active" and msg not in _WARNED:
                _WARNED.add(msg)
                log.warning("%s; the other layers still apply", msg)

    def _acquire(self, binding: str) -> _Worker:
        """A worker for ``binding``, fairly: a free worker goes to the waiting binding with
        the fewest calls running, then the one served longest ago, then the earliest
        caller.  A binding flooding the pool thus delays another one by at most the time
        until the next worker is free, not by its whole backlog (issue 13, finding 6)."""
        deadline = time.monotonic() + self.acquire_timeout
        with self._cv:
            ticket = next(self._tickets)
            waiting = self._waiting.setdefault(binding, collections.deque())
            waiting.append(ticket)
            try:
                while True:
                    if self._closed:
                        raise SandboxError("(pool)", "the sandbox pool is closed")
                    if self._next_turn() == (binding, ticket):
                        try:
                            worker: _Worker | None = self._idle.get_nowait()
                            break
                        except queue.Empty:
                            pass
                        if self._reserve():
                            worker = None  # started below, outside the lock
                            break
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise SandboxError(
                            "(pool)",
                            f"no sandbox worker became free within {self.acquire_timeout}s",
                            hint="raise SandboxPool(size=...) or lower the snippets' limits",
                        )
                    self._cv.wait(min(left, 0.5))
                self._running[binding] += 1
                self._served[binding] = ticket
            finally:
                waiting.remove(ticket)
                if not waiting:
                    del self._waiting[binding]
                self._cv.notify_all()
        if worker is None:
            try:
                worker = self._start()
            except BaseException:
                self._done(binding)
                raise
        return worker

    def _next_turn(self) -> tuple[str, int] | None:
        """(binding, ticket) of the caller who gets the next free worker."""
        if not self._waiting:
            return None
        binding = min(
            self._waiting,
            key=lambda b: (self._running[b], self._served.get(b, -1), self._waiting[b][0]),
        )
        return binding, self._waiting[binding][0]

    def _done(self, binding: str) -> None:
        with self._cv:
            self._running[binding] -= 1
            if self._running[binding] <= 0:
                del self._running[binding]
            self._cv.notify_all()

    def _fit(self, worker: _Worker) -> bool:
        """Recycle a worker that used half its lifetime CPU budget or grew its memory a lot."""
        try:
            return (
                worker.cpu_seconds() < self.cpu_budget / 2
                and worker.vsz() < worker.base_vsz + self.limits.memory_bytes // 2
            )
        except OSError:
            return False

    def _release(self, worker: _Worker, healthy: bool, binding: str) -> None:
        if healthy and not self._closed:
            self._idle.put(worker)
            self._done(binding)
            return
        worker.kill()
        with self._lock:
            self._live -= 1
        self._done(binding)
        if not self._closed:
            threading.Thread(target=self._replace, daemon=True, name="sandbox-respawn").start()

    def _replace(self) -> None:
        try:
            worker = self._spawn()
        except Exception as exc:  # the next run() retries the spawn and reports it
            log.error("could not replace a sandbox worker: %s", exc)
            return
        if worker is None:
            return
        self._put_idle(worker)
        if self._closed:  # closed while it was starting
            self.close()

    def close(self) -> None:
        """Stop the idle workers (busy ones stop when their call ends) and remove the jail."""
        self._closed = True
        _close_idle(self._idle, self._jail)
        with self._cv:
            self._cv.notify_all()

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # the call ---------------------------------------------------------------------------
    def run(
        self,
        snippet: str,
        table: pa.Table,
        *,
        params: dict | None = None,
        limits: SandboxLimits | None = None,
        binding: str,
        snippet_origin: tuple = ("<pushdown>", 1),
        ceiling: SandboxLimits | None = None,
    ) -> pa.Table:
        """Run ``snippet``'s ``run(table, **params)`` in a worker and return its table.

        ``snippet_origin`` is ``(file, line)`` or ``(file, line, col)`` of the snippet's first
        character in the binding file; errors point there.  Raises a ``SandboxError``
        subclass naming ``binding`` and the binding-file line that was running.

        ``limits`` (a binding's) may only lower ``ceiling`` (the operator's, by default the
        pool's limits; memory never above the pool's, which is a hard limit of the worker):
        a field above it runs at the ceiling, and a warning says so once.
        """
        ceiling = ceiling or self.limits
        if ceiling.memory_bytes > self.limits.memory_bytes:
            ceiling = replace(ceiling, memory_bytes=self.limits.memory_bytes)
        origin = _Origin(snippet, binding, *snippet_origin)
        limits, over = (limits or ceiling).capped(ceiling)
        if over:
            self._warn_capped(origin, over)
        origin.limits = limits
        if self._static:
            self._check(snippet, origin)
        if isinstance(table, pa.RecordBatch):
            table = pa.Table.from_batches([table])
        if not isinstance(table, pa.Table):
            raise TypeError(f"SandboxPool.run needs a pyarrow.Table, got {type(table).__name__}")
        header = {"source": snippet, "params": params or {}, "limits": asdict(limits)}
        worker = self._acquire(binding)
        healthy = False
        try:
            reply, payload = self._call(worker, worker.request(header, table), limits, origin)
            if reply.get("status") != "ok":
                cls = ERROR_CLASSES.get(str(reply.get("kind")), SandboxViolation)
                healthy = cls is SandboxRuntimeError and self._fit(worker)
                raise origin.error(cls, str(reply.get("message"))[:2000], reply.get("line"))
            result = _parse_result(payload, limits, origin)  # a worker sending bad data is replaced
            healthy = self._fit(worker)
            return result
        finally:
            self._release(worker, healthy, binding)

    @staticmethod
    def _warn_capped(origin: _Origin, over: list) -> None:
        for name, asked, cap in over:
            asked, cap = (f"{v:g}" if isinstance(v, float) else str(v) for v in (asked, cap))
            msg = (
                f"{origin.file}:{origin.line}: binding '{origin.binding}' asks for sandbox "
                f"limit {name}={asked}, above the operator's ceiling of {cap} (sandbox: in "
                f"fabric.yaml); it runs with {cap}"
            )
            if msg not in _WARNED:
                _WARNED.add(msg)
                log.warning("%s", msg)

    def _check(self, snippet: str, origin: _Origin) -> None:
        key = (snippet, origin.file, origin.line, origin.col)
        diags = self._static_cache.get(key)
        if diags is None:
            diags = check_snippet(
                snippet,
                file=origin.file,
                line=origin.line,
                col=origin.col,
                allowed_modules=self.allowed_modules,
            )
            if len(self._static_cache) > 256:
                self._static_cache.clear()
            self._static_cache[key] = diags
        if diags:
            d = diags[0]
            more = f" (and {len(diags) - 1} more problem(s))" if len(diags) > 1 else ""
            raise SandboxViolation(origin.binding, d.message + more, d.span, d.source_line, d.hint)

    def _call(
        self, worker: _Worker, request, limits: SandboxLimits, origin: _Origin
    ) -> tuple[dict, bytes | bytearray]:
        watch = _Watch(worker, limits)
        try:
            worker.send(request, watch.remaining_deadline, watch.check)
            reply, payload = worker.recv(watch.remaining_deadline, watch.check, limits.output_bytes)
        except _Expired as exc:
            raise origin.error(
                SandboxTimeout,
                f"exceeded its {exc} limit and did not stop; the worker was killed",
                None,
            ) from None
        except _WorkerGone:
            raise self._died(worker, watch, limits, origin) from None
        except OverflowError as exc:
            raise origin.error(
                SandboxViolation,
                f"sent {exc} bytes of output, over the limit of {limits.output_bytes}",
                None,
            ) from None
        except ValueError as exc:
            raise origin.error(
                SandboxViolation, f"the worker sent a malformed reply ({exc})", None
            ) from None
        if watch.fired:
            if reply.get("kind") == "timeout":
                return reply, b""
            raise origin.error(
                SandboxTimeout, f"exceeded its {watch.fired} limit", reply.get("line")
            )
        return reply, payload

    def _died(
        self, worker: _Worker, watch: _Watch, limits: SandboxLimits, origin: _Origin
    ) -> SandboxError:
        try:
            code = worker.proc.wait(2)
        except subprocess.TimeoutExpired:
            code = None
        if watch.fired:
            return origin.error(
                SandboxTimeout, f"exceeded its {watch.fired} limit; the worker was stopped", None
            )
        if code is not None and code < 0 and -code in (signal.SIGXCPU, signal.SIGKILL):
            return origin.error(
                SandboxTimeout, "exceeded its CPU-time limit (killed by the kernel)", None
            )
        tail = worker.stderr_tail().splitlines()
        how = (
            f"signal {signal.Signals(-code).name}"
            if code is not None and code < 0
            else f"exit code {code}"
        )
        return origin.error(
            SandboxViolation,
            f"the sandbox worker crashed ({how})" + (f": {tail[-1]}" if tail else ""),
            None,
        )


class _Origin:
    """Where the snippet sits in its binding file: maps snippet lines to file lines."""

    def __init__(
        self, snippet: str, binding: str, file: str = "<pushdown>", line: int = 1, col: int = 1
    ):
        self.snippet, self.binding, self.file, self.line, self.col = (
            snippet,
            binding,
            file,
            line,
            col,
        )
        self.limits: SandboxLimits | None = None

    def error(self, cls: type[SandboxError], detail: str, snippet_line: int | None) -> SandboxError:
        from dsl.errors import Span

        if cls is SandboxTimeout and self.limits is not None:
            detail += (
                f" (limits: {self.limits.cpu_seconds:g} s CPU, "
                f"{self.limits.wall_seconds:g} s wall-clock)"
            )
        if not isinstance(snippet_line, int) or snippet_line < 1:
            return cls(self.binding, detail, Span(self.file, self.line, self.col))
        lines = self.snippet.splitlines()
        text = lines[snippet_line - 1] if snippet_line <= len(lines) else ""
        indent = len(text) - len(text.lstrip())
        span = Span(self.file, self.line + snippet_line - 1, self.col + indent)
        return cls(self.binding, detail, span, " " * (self.col - 1) + text)


def _parse_result(payload: bytes | bytearray, limits: SandboxLimits, origin: _Origin) -> pa.Table:
    """Trust nothing from the worker: pre-check, parse, fully validate and re-check the caps."""
    try:
        _check_ipc_messages(payload, limits.max_rows)
        table = pa.ipc.open_stream(pa.py_buffer(payload)).read_all()
        table.validate()
        # before full validation and before anyone decodes it: a 45 MiB dictionary can
        # decode to terabytes, and validating a million views of one string takes hours
        check_decoded_size(table, limits.output_bytes)
        table.validate(full=True)
    except DecodeBomb as exc:
        raise origin.error(
            SandboxViolation,
            f"returned a table that would decode past the output limit of "
            f"{limits.output_bytes} bytes: {exc}",
            None,
        ) from None
    except Exception as exc:
        raise origin.error(
            SandboxViolation, f"returned malformed Arrow data ({exc})", None
        ) from None
    if table.num_rows > limits.max_rows:
        raise origin.error(
            SandboxViolation,
            f"returned {table.num_rows} rows, over the limit of {limits.max_rows}",
            None,
        )
    return table


def _close_idle(idle: queue.Queue, jail: str | None) -> None:
    while True:
        try:
            idle.get_nowait().kill()
        except queue.Empty:
            break
    if jail:
        shutil.rmtree(jail, ignore_errors=True)


_SHARED: SandboxPool | None = None
_SHARED_LOCK = threading.Lock()


def shared_pool(
    size: int = 2,
    limits: SandboxLimits | None = None,
    allowed_modules: Sequence[str] | None = None,
) -> SandboxPool:
    """The process-wide pool the fabric's executor uses (started on first use, closed at exit).

    The first call's settings win; later calls get the same pool.
    """
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None or _SHARED._closed:
            import atexit

            _SHARED = SandboxPool(size=size, limits=limits, allowed_modules=allowed_modules or None)
            atexit.register(_SHARED.close)
        return _SHARED


def _check_ipc_messages(payload: bytes | bytearray, max_rows: int) -> None:
    """Refuse compressed bodies (a decompression bomb would allocate in the fabric), message
    kinds other than schema/batches, and declared row counts over the cap, before reading.

    Reads the few flatbuffer fields needed from each message's metadata
    (Message.header_type/header, RecordBatch.length/compression, DictionaryBatch.data).
    """
    rows = 0
    for message in pa.ipc.MessageReader.open_stream(pa.py_buffer(payload)):
        meta = message.metadata.to_pybytes()
        root = _fb_deref(meta, 0)
        kind = _fb_scalar(meta, root, 1, "<B", 0)
        if kind == 1:  # Schema
            continue
        if kind not in (2, 3):
            raise ValueError(f"unexpected IPC message type {kind}")
        batch = _fb_field(meta, root, 2)
        if batch is None:
            raise ValueError("IPC message without a header")
        batch = _fb_deref(meta, batch)
        if kind == 2:  # DictionaryBatch: its RecordBatch is field 1
            inner = _fb_field(meta, batch, 1)
            if inner is None:
                raise ValueError("dictionary batch without data")
            batch = _fb_deref(meta, inner)
        if _fb_field(meta, batch, 3) is not None:
            raise ValueError("compressed IPC buffers are not accepted from a sandbox worker")
        if kind == 3:
            rows += _fb_scalar(meta, batch, 0, "<q", 0)
            if rows > max_rows:
                raise ValueError(f"batches declare {rows} rows, over the limit of {max_rows}")


def _fb_deref(buf: bytes, pos: int) -> int:
    return pos + struct.unpack_from("<I", buf, pos)[0]


def _fb_field(buf: bytes, table: int, index: int) -> int | None:
    """Position of field ``index`` of the flatbuffer table at ``table`` (None if absent)."""
    vtable = table - struct.unpack_from("<i", buf, table)[0]
    vt_size = struct.unpack_from("<H", buf, vtable)[0]
    if 4 + 2 * index + 2 > vt_size:
        return None
    offset = struct.unpack_from("<H", buf, vtable + 4 + 2 * index)[0]
    return table + offset if offset else None


def _fb_scalar(buf: bytes, table: int, index: int, fmt: str, default: int) -> int:
    pos = _fb_field(buf, table, index)
    return default if pos is None else struct.unpack_from(fmt, buf, pos)[0]
