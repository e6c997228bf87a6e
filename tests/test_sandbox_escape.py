"""The escape corpus: hostile snippets, each contained with the right error class.

Three pools run the corpus:
- ``full``: every layer, the way the fabric runs snippets;
- ``nostatic``: the static check is switched off, so the runtime Python layer and the OS
  layers must hold;
- ``osonly``: the static check and the restricted-Python layer are off (the snippet has
  real builtins and can import what the worker has loaded), so only the OS layers
  (network namespace, rlimits, chroot, dropped privileges, seccomp) stand.
After every hostile snippet the next ordinary call on the same pool must succeed.
"""

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow as pa
import pytest

from fabric.sandbox import (
    SandboxLimits,
    SandboxMemoryError,
    SandboxPool,
    SandboxTimeout,
    SandboxViolation,
)

V, T, M = SandboxViolation, SandboxTimeout, SandboxMemoryError
LIMITS = SandboxLimits(cpu_seconds=1.0, wall_seconds=3.0, memory_bytes=256 << 20,
                       output_bytes=1 << 20, max_rows=5000)  # fmt: skip
TABLE = pa.table({"id": list(range(100)), "name": [f"n{i}" for i in range(100)]})
NORMAL = "import pyarrow.compute as pc\ndef run(table):\n    return table.filter(pc.less(table['id'], 10))\n"


def body(*lines: str, imports: str = "") -> str:
    return imports + "def run(table):\n" + "".join(f"    {line}\n" for line in lines)


# (id, snippet, expected error) -- run with every layer on
FULL = [
    (
        "subclasses_walk",
        body("for c in ().__class__.__base__.__subclasses__():", "    pass", "return table"),
        V,
    ),
    ("mro_walk", body("base = type(table).mro()[-1]", "return table"), V),
    ("import_os", body("os.system('id')", "return table", imports="import os\n"), V),
    ("import_subprocess", body("subprocess.run(['id'])", imports="import subprocess\n"), V),
    ("dunder_import", body("__import__('os').system('id')", "return table"), V),
    ("builtins_name", body("b = __builtins__", "return table"), V),
    ("globals_builtins", body("return globals()['__builtins__']"), V),
    ("getattr_dunder_literal", body("return getattr(table, '__class__')"), V),
    (
        "getattr_dunder_built",
        body("n = '_' * 2 + 'class' + '_' * 2", "c = getattr(table, n)", "return table"),
        V,
    ),
    (
        "getattr_caught_still_reported",
        body(
            "try:",
            "    getattr(table, '_' * 2 + 'dict' + '_' * 2)",
            "except BaseException:",
            "    pass",
            "return table",
        ),
        V,
    ),
    ("gi_frame", body("g = (x for x in [1])", "f = g.gi_frame", "return table"), V),
    (
        "gen_f_back",
        body("def gen():", "    yield", "g = gen()", "next(g)", "return g.gi_frame.f_back"),
        V,
    ),
    (
        "traceback_tb_frame",
        body(
            "try:",
            "    1 / 0",
            "except Exception as e:",
            "    f = e.__traceback__.tb_frame",
            "return table",
        ),
        V,
    ),
    ("func_globals", body("return run.__globals__['os']"), V),
    ("code_object", body("return run.__code__.co_consts"), V),
    ("sys_modules", body("return sys.modules['os']", imports="import sys\n"), V),
    ("sys_via_datetime", body("return datetime.sys.modules['os']", imports="import datetime\n"), V),
    ("ctypes", body("ctypes.CDLL(None).system(b'id')", imports="import ctypes\n"), V),
    ("open_passwd", body("return open('/etc/passwd').read()"), V),
    (
        "write_file",
        body("with open('/tmp/pwned', 'w') as f:", "    f.write('x')", "return table"),
        V,
    ),
    (
        "socket_loopback",
        body("socket.create_connection(('127.0.0.1', 9))", imports="import socket\n"),
        V,
    ),
    ("os_fork", body("os.fork()", imports="import os\n"), V),
    ("exec_call", body("exec('import os')", "return table"), V),
    ("eval_call", body("return eval('1 + 1')"), V),
    ("compile_call", body("c = compile('1', 'x', 'eval')", "return table"), V),
    (
        "pickle",
        body("return pickle.loads(b'cos\\nsystem\\n(S\\'id\\'\\ntR.')", imports="import pickle\n"),
        V,
    ),
    ("marshal", body("return marshal.loads(b'')", imports="import marshal\n"), V),
    (
        "signal_handler",
        body(
            "signal.signal(signal.SIGXCPU, signal.SIG_IGN)",
            "while True:",
            "    pass",
            imports="import signal\n",
        ),
        V,
    ),
    ("format_dunder", body("return '{0.__class__}'.format(table)"), V),
    ("format_built_string", body("f = '{0.' + 'x}'", "return f.format(table)"), V),
    ("str_format_unbound", body("return str.format('{0}', table)"), V),
    ("class_array_interface", "class X:\n    __array_interface__ = {}\n" + body("return table"), V),
    (
        "metaclass",
        "class M(type):\n    pass\nclass X(metaclass=M):\n    pass\n" + body("return table"),
        V,
    ),
    ("vars_call", body("return vars(table)"), V),
    ("breakpoint_call", body("breakpoint()"), V),
    ("relative_import", "from . import secrets\n" + body("return table"), V),
    ("import_star", "from os import *\n" + body("return table"), V),
    (
        "hidden_numpy_ctypeslib",
        body("return np.ctypeslib.as_array(0, (8,))", imports="import numpy as np\n"),
        V,
    ),
    (
        "hidden_numpy_as_strided",
        body(
            "return np.lib.stride_tricks.as_strided(np.zeros(1), (10 ** 6,), (8,))",
            imports="import numpy as np\n",
        ),
        V,
    ),
    (
        "hidden_pyarrow_foreign_buffer",
        body("b = pa.foreign_buffer(4096, 4096)", "return table", imports="import pyarrow as pa\n"),
        V,
    ),
    (
        "hidden_pyarrow_lib",
        body(
            "b = pa.lib.foreign_buffer(4096, 4096)",
            "return table",
            imports="import pyarrow as pa\n",
        ),
        V,
    ),
    (
        "register_udf",
        body(
            "pc.register_scalar_function(None, 'f', {}, {}, None)",
            "return table",
            imports="import pyarrow.compute as pc\n",
        ),
        V,
    ),
    (
        "numpy_file_io",
        body("np.save('/tmp/x.npy', np.zeros(3))", "return table", imports="import numpy as np\n"),
        V,
    ),
    ("infinite_loop", body("while True:", "    pass"), T),
    (
        "busy_numpy_loop",
        body(
            "while True:", "    np.sort(np.random.random(100000))", imports="import numpy as np\n"
        ),
        T,
    ),
    (
        "catch_the_timeout",
        body(
            "while True:",
            "    try:",
            "        while True:",
            "            pass",
            "    except BaseException:",
            "        pass",
        ),
        T,
    ),
    ("deep_recursion", body("def f(n):", "    return f(n + 1)", "return f(0)"), M),
    ("memory_bomb_bytearray", body("x = bytearray(8 * 1024 ** 3)", "return table"), M),
    (
        "memory_bomb_numpy",
        body("a = np.ones((40000, 40000))", "return table", imports="import numpy as np\n"),
        M,
    ),
    ("memory_bomb_string", body("s = 'x' * (2 ** 34)", "return table"), M),
    (
        "memory_growth",
        body("hoard = []", "while True:", "    hoard.append(bytearray(32 * 1024 * 1024))"),
        M,
    ),
    (
        "memory_bomb_arrow",
        body("return pa.array([b'x' * 1024] * (1 << 20))", imports="import pyarrow as pa\n"),
        M,
    ),
    (
        "output_flood",
        body("return pa.table({'x': [b'x' * (4 << 20)]})", imports="import pyarrow as pa\n"),
        V,
    ),
    (
        "row_flood",
        body("return pa.table({'x': list(range(100_000))})", imports="import pyarrow as pa\n"),
        V,
    ),
    (
        "malformed_arrow",
        body(
            "offsets = pa.py_buffer(bytes(4) + bytes([255, 255, 0, 0]) + bytes(4))",
            "a = pa.Array.from_buffers(pa.string(), 2, [None, offsets, pa.py_buffer(b'ab')])",
            "return pa.table({'s': a})",
            imports="import pyarrow as pa\n",
        ),
        V,
    ),
    ("not_a_table", body("return [1, 2, 3]"), V),
    ("slow_wall_clock", body("n = 0", "while True:", "    n += 1"), T),
]

# (id, snippet, expected error) -- static check OFF: runtime Python layer + OS layers
NOSTATIC = [
    ("import_os", body("os.system('id')", "return table", imports="import os\n"), V),
    ("dunder_import", body("__import__('os').system('id')", "return table"), V),
    ("open_passwd", body("return open('/etc/passwd').read()"), V),
    ("exec_call", body("exec('import os')", "return table"), V),
    ("getattr_dunder_built", body("return getattr(table, '_' * 2 + 'class' + '_' * 2)"), V),
    ("sys_via_datetime", body("return datetime.sys.modules['os']", imports="import datetime\n"), V),
    (
        "hidden_pyarrow_foreign_buffer",
        body("b = pa.foreign_buffer(4096, 4096)", "return table", imports="import pyarrow as pa\n"),
        V,
    ),
    # the attribute-syntax escapes succeed in Python here; the OS layers stop the effect
    (
        "subclasses_to_os_fork",
        body(
            "for c in ().__class__.__base__.__subclasses__():",
            "    try:",
            "        g = c.__init__.__globals__",
            "    except AttributeError:",
            "        continue",
            "    if 'sys' in g:",
            "        g['sys'].modules['os'].fork()",
            "return table",
        ),
        V,
    ),
    (
        "frame_walk_to_os_open_for_write",
        body(
            "def gen():",
            "    yield g.gi_frame.f_back",
            "g = gen()",
            "f = next(g)",
            "while f is not None and 'os' not in f.f_globals:",
            "    f = f.f_back",
            "f.f_globals['os'].open('/owned', 0o101)",
            "return table",
        ),
        V,
    ),
    (
        "traceback_walk_to_kill_parent",
        body(
            "try:",
            "    1 / 0",
            "except Exception as e:",
            "    f = e.__traceback__.tb_frame",
            "while f is not None and 'os' not in f.f_globals:",
            "    f = f.f_back",
            "os = f.f_globals['os']",
            "os.kill(os.getppid(), 15)",
            "return table",
        ),
        V,
    ),
    (
        "real_builtins_import_socket",
        body(
            "for c in ().__class__.__base__.__subclasses__():",
            "    try:",
            "        b = c.__init__.__globals__['__builtins__']",
            "    except (AttributeError, KeyError):",
            "        continue",
            "    imp = b['__import__'] if isinstance(b, dict) else b.__import__",
            "    imp('socket').create_connection(('127.0.0.1', 9))",
            "return table",
        ),
        V,
    ),
    ("infinite_loop", body("while True:", "    pass"), T),
    (
        "memory_bomb_numpy",
        body("a = np.ones((40000, 40000))", "return table", imports="import numpy as np\n"),
        M,
    ),
    ("deep_recursion", body("def f(n):", "    return f(n + 1)", "return f(0)"), M),
    (
        "output_flood",
        body("return pa.table({'x': [b'x' * (4 << 20)]})", imports="import pyarrow as pa\n"),
        V,
    ),
]

_LIBC = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\ndef check(r):\n    if r == -1:\n        e = ctypes.get_errno()\n        raise OSError(e, os.strerror(e))\n    return r\n"

# (id, snippet, expected error, text the error must contain) -- only the OS layers
OSONLY = [
    ("os_fork", body("os.fork()", imports="import os\n"), V, "Operation not permitted"),
    (
        "posix_spawn",
        body("os.posix_spawn('/bin/true', ['true'], {})", imports="import os\n"),
        V,
        "refused",
    ),
    (
        "execv",
        body("os.execv('/bin/sh', ['sh', '-c', 'id'])", imports="import os\n"),
        V,
        "Operation not permitted",
    ),
    ("read_etc_passwd", body("return open('/etc/passwd').read()"), V, "No such file"),
    ("write_file", body("open('/pwned', 'w').write('x')"), V, "Operation not permitted"),
    (
        "unlink",
        body("os.unlink('/etc/passwd')", imports="import os\n"),
        V,
        "Operation not permitted",
    ),
    (
        "kill_parent",
        body("os.kill(os.getppid(), 15)", imports="import os\n"),
        V,
        "Operation not permitted",
    ),
    ("setuid_root", body("os.setuid(0)", imports="import os\n"), V, "Operation not permitted"),
    ("ctypes_socket", _LIBC + body("check(libc.socket(2, 1, 0))"), V, "Operation not permitted"),
    (
        "ctypes_ptrace_parent",
        _LIBC + body("check(libc.ptrace(16, os.getppid(), 0, 0))"),
        V,
        "Operation not permitted",
    ),
    (
        "ctypes_unshare_userns",
        _LIBC + body("check(libc.unshare(0x10000000))"),
        V,
        "Operation not permitted",
    ),
    (
        "ctypes_exec_memory",
        _LIBC
        + body(
            "libc.mmap.restype = ctypes.c_void_p",
            "p = libc.mmap(None, 4096, 7, 0x22, -1, 0)",
            "if p in (None, ctypes.c_void_p(-1).value):",
            "    check(-1)",
        ),
        V,
        "Operation not permitted",
    ),
    (
        "prlimit_other_process",
        body(
            "resource.prlimit(os.getppid(), resource.RLIMIT_CPU, (1, 1))",
            imports="import os, resource\n",
        ),
        V,
        "Operation not permitted",
    ),
    (
        "ignore_limit_signals",
        body(
            "signal.signal(signal.SIGXCPU, signal.SIG_IGN)",
            "signal.signal(signal.SIGUSR1, signal.SIG_IGN)",
            "while True:",
            "    pass",
            imports="import signal\n",
        ),
        V,  # rt_sigaction is not on the seccomp allow list (the watchdog's kill would follow)
        "Operation not permitted",
    ),
    (
        "raise_own_memory_limit",
        body(
            "resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))",
            imports="import resource\n",
        ),
        None,
        "",
    ),
    ("memory_bomb", body("x = bytearray(8 * 1024 ** 3)", "return table"), M, "memory"),
    (
        "python_socket",
        body("socket.socket()", imports="import socket\n"),
        V,
        "Operation not permitted",
    ),
    ("import_new_module", body("import sqlite3", "return table"), V, "sqlite3"),
]


def _pool(**kw) -> SandboxPool:
    return SandboxPool(size=2, limits=LIMITS, **kw)


@pytest.fixture(scope="module")
def full_pool():
    with _pool() as p:
        yield p


@pytest.fixture(scope="module")
def nostatic_pool():
    with _pool(_static_checks=False) as p:
        yield p


@pytest.fixture(scope="module")
def osonly_pool():
    with _pool(_static_checks=False, _restricted_python=False) as p:
        assert p.layers["restricted_python"].startswith("unavailable")
        yield p


def _limits_for(case_id: str) -> SandboxLimits:
    if case_id == "slow_wall_clock":
        return SandboxLimits(cpu_seconds=30, wall_seconds=0.7, memory_bytes=LIMITS.memory_bytes)
    if case_id.startswith("memory_"):
        # the memory limit is what these cases test: on a loaded machine (load 25 on 2
        # cores) filling 256 MB took longer than the 3 s wall clock, which then fired first
        return dataclasses.replace(LIMITS, wall_seconds=30.0)
    return LIMITS


def _assert_next_call_works(pool: SandboxPool) -> None:
    out = pool.run(NORMAL, TABLE, binding="after")
    assert out["id"].to_pylist() == list(range(10))


def test_corpus_is_big_enough():
    assert len(FULL) >= 40 and len({c[0] for c in FULL}) == len(FULL)


@pytest.mark.parametrize(("case_id", "src", "error"), FULL, ids=[c[0] for c in FULL])
def test_full_layers(full_pool, case_id, src, error):
    with pytest.raises(error) as ei:
        full_pool.run(
            src,
            TABLE,
            binding=f"evil_{case_id}",
            limits=_limits_for(case_id),
            snippet_origin=("agents/evil.yaml", 40, 7),
        )
    err = ei.value
    assert f"binding 'evil_{case_id}'" in str(err)
    assert err.span.file == "agents/evil.yaml" and 40 <= err.span.line < 40 + src.count("\n")
    _assert_next_call_works(full_pool)


@pytest.mark.parametrize(("case_id", "src", "error"), NOSTATIC, ids=[c[0] for c in NOSTATIC])
def test_without_static_check(nostatic_pool, case_id, src, error):
    with pytest.raises(error) as ei:
        nostatic_pool.run(src, TABLE, binding=case_id, limits=_limits_for(case_id))
    assert f"binding '{case_id}'" in str(ei.value)
    _assert_next_call_works(nostatic_pool)


@pytest.mark.parametrize(("case_id", "src", "error", "needle"), OSONLY, ids=[c[0] for c in OSONLY])
def test_os_layers_alone(osonly_pool, case_id, src, error, needle):
    if error is None:  # a legal no-op for the snippet: raising a limit past the hard cap fails
        with pytest.raises(Exception, match="not allowed to raise maximum limit"):
            osonly_pool.run(src, TABLE, binding=case_id)
    else:
        with pytest.raises(error, match=needle):
            osonly_pool.run(src, TABLE, binding=case_id, limits=_limits_for(case_id))
    assert not os.path.exists("/pwned")
    _assert_next_call_works(osonly_pool)


def _listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.2)
    accepted: list = []
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
                accepted.append(conn)
            except TimeoutError:
                pass

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return srv, accepted, stop, t


CONNECT = (
    "import ctypes, os, struct\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "def run(table, port):\n"
    "    fd = libc.socket(2, 1, 0)\n"
    "    if fd < 0:\n"
    "        raise OSError(ctypes.get_errno(), 'socket: ' + os.strerror(ctypes.get_errno()))\n"
    "    addr = struct.pack('<HH4s8x', 2, ((port & 255) << 8) | (port >> 8), bytes([127, 0, 0, 1]))\n"
    "    if libc.connect(fd, addr, len(addr)) != 0:\n"
    "        raise OSError(ctypes.get_errno(), 'connect: ' + os.strerror(ctypes.get_errno()))\n"
    "    return table\n"
)


@pytest.mark.parametrize(
    ("skip", "needle"),
    [((), "socket: Operation not permitted"),  # seccomp refuses socket()
     (("seccomp",), "connect: Network is unreachable")],  # the empty network namespace alone
)  # fmt: skip
def test_loopback_listener_sees_no_connection(skip, needle):
    srv, accepted, stop, t = _listener()
    port = srv.getsockname()[1]
    try:
        with (
            SandboxPool(
                size=1,
                limits=LIMITS,
                _static_checks=False,
                _restricted_python=False,
                _skip_layers=skip,
            ) as p,
            pytest.raises(SandboxViolation, match=needle),
        ):
            p.run(CONNECT, TABLE, params={"port": port}, binding="exfil")
    finally:
        stop.set()
        t.join()
        srv.close()
    assert accepted == []


def test_a_connect_does_reach_the_listener_without_the_sandbox():
    """Control for the test above: the snippet's connect code itself works."""
    srv, accepted, stop, t = _listener()
    ns: dict = {}
    try:
        exec(CONNECT, ns)
        ns["run"](TABLE, srv.getsockname()[1])
        t.join(0.5)
    finally:
        stop.set()
        t.join()
        srv.close()
    assert len(accepted) == 1
    accepted[0].close()


def test_skipped_layers_are_reported(caplog):
    with SandboxPool(size=1, _skip_layers=("seccomp", "chroot")) as p:
        assert p.layers["seccomp"] == "unavailable: disabled by the pool"
        assert p.layers["chroot"] == "unavailable: disabled by the pool"
        assert p.layers["network_namespace"] == "active"
        assert p.run(NORMAL, TABLE, binding="ok").num_rows == 10


DEGRADED = """
import json, logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
import pyarrow as pa
from fabric.sandbox import SandboxPool, SandboxViolation
with SandboxPool(size=1) as p:
    ok = p.run("def run(t):\\n    return t\\n", pa.table({"a": [1, 2]}), binding="b").num_rows
    try:
        p.run("def run(t):\\n    open('/etc/passwd')\\n", pa.table({"a": [1]}), binding="b", snippet_origin=("x.yaml", 3))
        err = None
    except SandboxViolation as e:
        err = str(e)
    print(json.dumps({"layers": p.layers, "rows": ok, "err": err}))
"""


@pytest.mark.skipif(
    not shutil.which("setpriv") or os.geteuid() != 0, reason="needs root and setpriv"
)
def test_missing_os_layers_are_reported_once_and_the_rest_still_apply():
    """A fabric without capabilities (like a non-root one) loses the uid switch (and, where
    the kernel refuses unprivileged user namespaces, the network namespace and chroot,
    which the worker otherwise gets inside a user namespace of its own: it enters it while
    it has one thread); it says so at start-up and still runs snippets under the others."""
    root = str(Path(__file__).resolve().parents[1])
    proc = subprocess.run(
        ["setpriv", "--bounding-set=-all", "--inh-caps=-all", sys.executable, "-c", DEGRADED],
        capture_output=True, text=True, timeout=120, cwd=root, env={"PYTHONPATH": root, "PATH": os.defpath},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    layers = report["layers"]
    assert layers["drop_privileges"].startswith("unavailable")
    assert layers["seccomp"] == "active" and layers["rlimits"] == "active"
    assert layers["restricted_python"] == "active"
    for name, state in layers.items():
        if state != "active":
            assert proc.stderr.count(f"sandbox layer '{name}' is unavailable") == 1
    assert report["rows"] == 2
    assert "x.yaml:4" in report["err"] and "'open' is not allowed" in report["err"]
