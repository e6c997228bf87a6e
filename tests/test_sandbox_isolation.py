"""Isolation between a snippet and the host, and between bindings (issue 13).

Each test checks the side effect of an attack (a listener that must receive nothing, a
marker file that must not exist, another binding's rows that must not be readable, a
sibling worker that must stay alive), not only the error class.
"""

import contextlib
import os
import socket
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest

from fabric.sandbox import SandboxError, SandboxLimits, SandboxPool, SandboxViolation

LIMITS = SandboxLimits(cpu_seconds=2.0, wall_seconds=5.0, memory_bytes=256 << 20,
                       output_bytes=1 << 20, max_rows=5000)  # fmt: skip
TABLE = pa.table({"id": list(range(100))})


def _workers(pool: SandboxPool) -> list:
    assert pool.wait_ready(60)  # all but the first start in the background
    return list(pool._idle.queue)


class _Listener:
    """A TCP listener on the host's 127.0.0.1 that records every connection it accepts."""

    def __init__(self) -> None:
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(8)
        self.srv.settimeout(0.1)
        self.port = self.srv.getsockname()[1]
        self.accepted: list = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.srv.accept()
                self.accepted.append(conn)
            except TimeoutError:
                pass

    def close(self) -> None:
        time.sleep(0.2)  # a connection still in flight would be accepted by now
        self.stop.set()
        self.thread.join()
        self.srv.close()
        for conn in self.accepted:
            conn.close()


# Finding 1: a pyarrow compute UDF that Acero runs on its CPU-pool thread, which tries to
# connect to the host's loopback and to create a file.  Needs real builtins (the static
# check and the restricted-Python layer are off): only the OS layers stand.
THREAD_ESCAPE = """
import ctypes, os, struct, threading, time
import pyarrow as pa
import pyarrow.compute as pc
libc = ctypes.CDLL(None, use_errno=True)

def run(table, port, marker):
    notes = []
    def udf(ctx, x):
        notes.append(f"tid={threading.get_native_id()} pid={os.getpid()}")
        fd = libc.socket(2, 1, 0)
        if fd < 0:
            notes.append(f"socket errno={ctypes.get_errno()}")
        else:
            addr = struct.pack("<HH4s8x", 2, ((port & 255) << 8) | (port >> 8), bytes([127, 0, 0, 1]))
            rc = libc.connect(fd, addr, len(addr))
            notes.append(f"connect rc={rc} errno={ctypes.get_errno()}")
        try:
            with open(marker, "w") as f:
                f.write("escaped")
            notes.append("marker written")
        except OSError as e:
            notes.append(f"open errno={e.errno}")
        return pc.greater_equal(x, 0)
    name = f"probe_{time.monotonic_ns()}"
    pc.register_scalar_function(udf, name, {"summary": "p", "description": "p"},
                                {"x": pa.int64()}, pa.bool_())
    table.filter(pc.Expression._call(name, [pc.field("id")]))
    return pa.table({"note": notes})
"""


@pytest.mark.parametrize(
    "skip",
    [(), ("seccomp",), ("network_namespace", "chroot", "drop_privileges")],
    ids=["all_os_layers", "network_namespace_alone", "seccomp_alone"],
)
def test_a_udf_on_a_pyarrow_pool_thread_cannot_reach_the_host(tmp_path, skip):
    listener = _Listener()
    marker = tmp_path / "escaped.txt"
    os.chmod(tmp_path, 0o777)  # writable by the worker's uid, if the uid layer is on
    try:
        with SandboxPool(
            size=1,
            limits=LIMITS,
            _static_checks=False,
            _restricted_python=False,
            _skip_layers=skip,
        ) as pool:
            out = pool.run(
                THREAD_ESCAPE,
                TABLE,
                params={"port": listener.port, "marker": str(marker)},
                binding="thread_escape",
            )
    finally:
        listener.close()
    notes = out["note"].to_pylist()
    tids = [n for n in notes if n.startswith("tid=")]
    assert tids, notes
    tid, pid = (int(x.split("=")[1]) for x in tids[0].split())
    assert tid != pid, f"the UDF ran on the main thread; the test proves nothing: {notes}"
    assert listener.accepted == [], notes
    assert not marker.exists(), notes


def _host_netns() -> str:
    return os.readlink("/proc/self/ns/net")


def test_every_thread_of_every_worker_is_confined():
    with SandboxPool(size=2, limits=LIMITS) as pool:
        workers = _workers(pool)
        assert len(workers) == 2
        for w in workers:
            tids = os.listdir(f"/proc/{w.pid}/task")
            assert len(tids) > 1  # pyarrow's threads exist: the check below means something
            for tid in tids:
                with open(f"/proc/{w.pid}/task/{tid}/status") as f:
                    status = dict(
                        line.split(":", 1) for line in f.read().splitlines() if ":" in line
                    )
                assert status["Seccomp"].strip() == "2", (w.pid, tid, status["Seccomp"])
                assert status["NoNewPrivs"].strip() == "1", (w.pid, tid)
                assert os.readlink(f"/proc/{w.pid}/task/{tid}/ns/net") != _host_netns(), tid
                uids = status["Uid"].split()
                assert uids[0] != "0" and len(set(uids)) == 1, (tid, uids)
        assert all(v == "active" for v in pool.layers.values()), pool.layers


def test_a_worker_that_claims_layers_it_lacks_is_refused():
    """Fail closed: the pool checks every thread itself and runs nothing on such a worker."""
    evil = str(Path(__file__).parent / "sandbox_corpus" / "evil_worker.py")
    with pytest.raises(SandboxError, match="refusing to run snippets") as ei:
        SandboxPool(size=1, _worker_argv=[sys.executable, evil, "liar"])
    msg = str(ei.value)
    assert "seccomp failed: thread" in msg and "Seccomp: 0" in msg
    assert "network_namespace failed" in msg and "drop_privileges failed" in msg


# Finding 4: fcntl(F_SETOWN, sibling) + F_SETSIG(SIGKILL) + O_ASYNC on a pipe: the kernel
# would send SIGKILL to the sibling worker on the next I/O.
SIGIO_KILL = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)

def run(table, sibling):
    notes = []
    fds = [int(sys.argv[sys.argv.index(o) + 1]) for o in ("--in", "--out")]
    try:
        r, w = os.pipe()
        fds.append(r)
    except OSError as e:
        w = None
        notes.append(f"pipe errno={e.errno}")
    for fd in fds:
        rc = [libc.fcntl(fd, 8, sibling), libc.fcntl(fd, 10, 9)]  # F_SETOWN, F_SETSIG=SIGKILL
        flags = libc.fcntl(fd, 3)
        rc.append(libc.fcntl(fd, 4, flags | 0o20000))  # F_SETFL O_ASYNC
        notes.append(f"fd {fd}: {rc} errno={ctypes.get_errno()}")
    if w is not None:
        os.write(w, b"x")
    return pa_table(notes)

def pa_table(notes):
    import pyarrow as pa
    return pa.table({"note": notes})
"""


def _alive(worker) -> bool:
    return worker.proc.poll() is None


@pytest.mark.parametrize(
    ("skip", "killed"),
    [
        ((), False),
        (("seccomp",), False),  # the per-worker uid alone: the kernel's SIGIO check fails
        (("seccomp", "drop_privileges"), True),  # control: both off, the attack is real
    ],
    ids=["all_os_layers", "own_uid_alone", "control_without_both"],
)
def test_a_worker_cannot_signal_its_sibling(skip, killed):
    with SandboxPool(
        size=2, limits=LIMITS, _static_checks=False, _restricted_python=False, _skip_layers=skip
    ) as pool:
        attacker, sibling = _workers(pool)
        out = pool.run(SIGIO_KILL, TABLE, params={"sibling": sibling.pid}, binding="sigio")
        notes = out["note"].to_pylist()
        for _ in range(4):  # I/O on the attacker's pipes, each of which would fire SIGIO
            with contextlib.suppress(SandboxError):
                pool.run("def run(table):\n    return table\n", TABLE, binding="after")
        time.sleep(0.2)
        assert _alive(sibling) is not killed, notes
        assert _alive(attacker), notes
        if not skip:
            assert all("[-1, -1, -1] errno=1" in n for n in notes if n.startswith("fd")), notes


# Finding 3: residue of one binding's call in the shared-memory regions of a worker that
# then runs another binding's snippet.
SECRETS = pa.table({
    "id": list(range(100)),
    "secret": [f"SECRET-{i:03d}-{'x' * 40}" for i in range(100)],
})  # fmt: skip
IDENTITY = "def run(table):\n    return table\n"

PARENT_WALK = """
import pyarrow as pa
def run(table):
    buf = table.column("id").chunks[0].buffers()[1]
    while buf.parent is not None:
        buf = buf.parent
    data = buf.to_pybytes()
    return pa.table({"size": [len(data)], "hits": [data.count(b"SECRET-")]})
"""

RAW_READ = """
import gc
import pyarrow as pa
def run(table):
    hits, size = 0, 0
    for ch in [o for o in gc.get_objects() if type(o).__name__ == "_Channel"]:
        for region in (ch.shm_in, ch.shm_out):
            if region is not None:
                data = region[:]
                size += len(data)
                hits += data.count(b"SECRET-")
    return pa.table({"size": [size], "hits": [hits]})
"""


def _secret_call_then(pool: SandboxPool, probe: str) -> dict:
    big = pa.table({"id": list(range(3000)), "pad": ["p" * 50] * 3000})
    pool.run(IDENTITY, big, binding="warm")  # a bigger table first: its bytes lie further out
    out = pool.run(IDENTITY, SECRETS, binding="x_private")
    assert out.equals(SECRETS)
    return pool.run(probe, pa.table({"id": [1, 2, 3]}), binding="y_other").to_pylist()[0]


def test_another_binding_cannot_walk_buffer_parents_to_earlier_rows():
    with SandboxPool(size=1, limits=LIMITS) as pool:
        got = _secret_call_then(pool, PARENT_WALK)
    assert got["hits"] == 0, got
    assert got["size"] < 4096, got  # only this call's own message, not the whole region


def test_no_rows_of_an_earlier_call_remain_in_the_shared_regions():
    """Even with real builtins (only the OS layers on), the regions hold no residue."""
    with SandboxPool(size=1, limits=LIMITS, _static_checks=False, _restricted_python=False) as p:
        got = _secret_call_then(p, RAW_READ)
    assert got["size"] == 2 * LIMITS.output_bytes, got  # it did read both regions
    assert got["hits"] == 0, got


# Finding 2: a class with a dunder key built at run time, then numpy reads the address it
# names.  Each variant reaches a metaclass a different way.
def _raw_memory(make_class: str, imports: str = "") -> str:
    return (
        "import numpy as np\nimport pyarrow as pa\n" + imports + "def run(table):\n"
        "    k = '_' + '_array_interface' + '_' + '_'\n"
        "    iface = {'shape': (16,), 'typestr': '|u1', 'data': (id(table), False), 'version': 3}\n"
        f"    X = {make_class}\n"
        "    a = np.asarray(X())\n"
        "    return pa.table({'leak': [a.tobytes()]})\n"
    )


RAW_MEMORY = [
    ("type_three_args", _raw_memory("type('X', (), {k: iface})")),
    ("type_of_a_class", _raw_memory("type(int)('X', (), {k: iface})")),
    ("type_of_type", _raw_memory("type(type(1))('X', (), {k: iface})")),
    (
        "abc_metaclass_of_fraction",
        _raw_memory("type(fractions.Fraction)('X', (), {k: iface})", "import fractions\n"),
    ),
    ("dict_subclass_hiding_keys", _raw_memory(
        "type('X', (), type('D', (dict,), {'keys': lambda self: []})({k: iface}))")),
    ("alias_of_type", _raw_memory("t('X', (), {k: iface})").replace("    X =", "    t = type\n    X =")),
]  # fmt: skip


RAW_MEMORY.append((
    "update_wrapper_copies_a_built_name",
    "import functools\nimport numpy as np\nimport pyarrow as pa\ndef run(table):\n"
    "    k = '_' + '_array_interface' + '_' + '_'\n"
    "    class W:\n        pass\n"
    "    w = W()\n"
    "    functools.update_wrapper(w, np.zeros(4), assigned=(k,), updated=())\n"
    "    return pa.table({'leak': [np.asarray(w).tobytes()]})\n",
))  # fmt: skip


@pytest.fixture(scope="module", params=[True, False], ids=["all_layers", "without_static_check"])
def gate_pool(request):
    with SandboxPool(size=1, limits=LIMITS, _static_checks=request.param) as pool:
        yield pool


@pytest.mark.parametrize(("case_id", "src"), RAW_MEMORY, ids=[c[0] for c in RAW_MEMORY])
def test_a_class_with_a_run_time_dunder_key_is_refused(gate_pool, case_id, src):
    with pytest.raises(SandboxViolation, match="not allowed") as ei:
        gate_pool.run(src, TABLE, binding=case_id, snippet_origin=("agents/evil.yaml", 10, 7))
    assert ei.value.span.file == "agents/evil.yaml"
    assert gate_pool.run(IDENTITY, TABLE, binding="after").num_rows == 100


def test_type_still_works_for_ordinary_snippets(gate_pool):
    src = (
        "import fractions\nimport pyarrow as pa\n"
        "class Row:\n    def __init__(self, v):\n        self.v = v\n"
        "    def __repr__(self):\n        return f'Row({self.v})'\n"
        "def run(table):\n"
        "    checks = [type(1) is int, type(int) is type, isinstance(Row, type),\n"
        "              issubclass(Row, object), type(Row(1)) is Row, repr(Row(2)) == 'Row(2)',\n"
        "              isinstance(fractions.Fraction, type(fractions.Fraction)),\n"
        "              type(table) is pa.Table]\n"
        "    return pa.table({'ok': checks})\n"
    )
    out = gate_pool.run(src, TABLE, binding="ordinary")
    assert out["ok"].to_pylist() == [True] * 8


# Finding 6: a binding flooding the pool must not make another binding wait for its backlog.
# ~0.2 s of CPU per call (well under LIMITS): long enough that six of them form a backlog
# even when threads start slowly on a loaded machine
HOSTILE_SLOW = (
    "def run(table):\n    n = 0\n    for i in range(3000000):\n        n += i\n    return table\n"
)


def test_a_flooding_binding_does_not_starve_another():
    order: list[str] = []
    lock = threading.Lock()
    with SandboxPool(size=1, limits=LIMITS) as pool:

        def call(name: str, src: str) -> None:
            with contextlib.suppress(SandboxError):
                pool.run(src, TABLE, binding=name)
            with lock:
                order.append(name)

        flood = [threading.Thread(target=call, args=("hostile", HOSTILE_SLOW)) for _ in range(6)]
        for t in flood:
            t.start()
        for _ in range(3000):  # until the backlog is queued behind the running call
            if sum(len(q) for q in list(pool._waiting.values())) >= 4:
                break
            time.sleep(0.01)
        with lock:
            done_before = len(order)
        waiting_then = sum(len(q) for q in list(pool._waiting.values()))
        benign = threading.Thread(target=call, args=("benign", IDENTITY))
        benign.start()
        for t in [*flood, benign]:
            t.join(60)
    assert waiting_then >= 3, (waiting_then, order)  # there was a backlog to jump
    # served after at most the one hostile call that held the worker when it arrived
    assert order.index("benign") <= done_before + 1, (done_before, order)


# Finding 7: results whose encodings expand to terabytes once decoded.
BOMB_LIMITS = SandboxLimits(cpu_seconds=5.0, wall_seconds=20.0, memory_bytes=512 << 20,
                            output_bytes=64 << 20)  # fmt: skip
BOMBS = [
    (
        "dictionary_45MiB_to_200TB",
        "import pyarrow as pa\ndef run(table):\n"
        "    d = pa.array([b'x' * (40 << 20)])\n"
        "    idx = pa.Array.from_buffers(pa.int8(), 5_000_000, [None, pa.py_buffer(bytes(5_000_000))])\n"
        "    return pa.table({'bomb': pa.DictionaryArray.from_arrays(idx, d)})\n",
    ),
    (
        "run_end_encoded",
        "import pyarrow as pa\ndef run(table):\n"
        "    ree = pa.RunEndEncodedArray.from_arrays(pa.array([5_000_000], pa.int32()),\n"
        "                                            pa.array([b'x' * (40 << 20)]))\n"
        "    return pa.table({'bomb': ree})\n",
    ),
    (
        "list_of_dictionary",
        "import pyarrow as pa\ndef run(table):\n"
        "    d = pa.array(['y' * (8 << 20)])\n"
        "    idx = pa.Array.from_buffers(pa.int8(), 4_000_000, [None, pa.py_buffer(bytes(4_000_000))])\n"
        "    inner = pa.DictionaryArray.from_arrays(idx, d)\n"
        "    return pa.table({'bomb': pa.ListArray.from_arrays(pa.array([0, 4_000_000], pa.int32()), inner)})\n",
    ),
    (
        "string_views_of_one_buffer",
        "import numpy as np\nimport pyarrow as pa\ndef run(table):\n"
        "    n = 1_000_000\n"
        "    data = pa.py_buffer(b'z' * (16 << 20))\n"
        "    views = np.zeros((n, 4), np.int32)\n"
        "    views[:, 0] = 16 << 20\n"
        "    views[:, 1] = 0x7a7a7a7a\n"
        "    arr = pa.Array.from_buffers(pa.string_view(), n, [None, pa.py_buffer(views.tobytes()), data])\n"
        "    return pa.table({'bomb': arr})\n",
    ),
    (
        "list_of_nulls",
        "import pyarrow as pa\ndef run(table):\n"
        "    inner = pa.Array.from_buffers(pa.null(), 1 << 40, [None])\n"
        "    return pa.table({'bomb': pa.LargeListArray.from_arrays(pa.array([0, 1 << 40], pa.int64()), inner)})\n",
    ),
]  # fmt: skip


@pytest.fixture(scope="module")
def bomb_pool():
    with SandboxPool(size=1, limits=BOMB_LIMITS) as pool:
        yield pool


@pytest.mark.parametrize(("case_id", "src"), BOMBS, ids=[c[0] for c in BOMBS])
def test_results_that_decode_past_the_output_limit_are_refused(bomb_pool, case_id, src):
    with pytest.raises(SandboxViolation, match="would decode past the output limit"):
        bomb_pool.run(src, TABLE, binding=case_id)


def test_ordinary_encoded_results_still_pass(bomb_pool):
    src = (
        "import pyarrow as pa\nimport pyarrow.compute as pc\ndef run(table):\n"
        "    s = pc.cast(table['id'], pa.string())\n"
        "    ree = pc.run_end_encode(pa.array([1, 1, 2]))\n"
        "    return pa.table({'d': pc.dictionary_encode(s), 'v': s.cast(pa.string_view()),\n"
        "                     'l': pa.array([[i % 3] for i in range(100)])})\n"
    )
    out = bomb_pool.run(src, TABLE, binding="encoded")
    assert out["d"].type == pa.dictionary(pa.int32(), pa.string())
    assert out["d"].to_pylist() == [str(i) for i in range(100)]


# Finding 14: a snippet's exception text (and its own source line) must not reach the
# operator's terminal with control characters in it.
def test_control_characters_from_a_snippet_are_escaped(gate_pool):
    forged = "\x1b[2K\r\x1b[32magents/ok.yaml:1:1: all checks passed\x1b[0m\x07\u202e\nfake line"
    src = f"def run(table):\n    raise ValueError({forged!r} + '\x1b]0;title\x07')\n"
    src = src.replace("ValueError(", "ValueError('\x1b[1A' + ", 1)  # a raw ESC in the source too
    with pytest.raises(SandboxError) as ei:
        gate_pool.run(src, TABLE, binding="ctl", snippet_origin=("agents/ctl.yaml", 3, 7))
    for text in (str(ei.value), ei.value.diagnostic.format()):
        assert not any(ch in text for ch in "\x1b\x07\r\u202e"), repr(text)
        assert "\\x1b[2K\\x0d" in text and "\\u202e\\x0afake line" in text
        assert "\\x1b[1A" in text  # the source line shown under the error is escaped as well
    assert ei.value.span.file == "agents/ctl.yaml"
