"""Operating-system layers of a sandbox worker, applied before any user code is loaded.

Order: network namespace (entered by ``boot.py`` while the process has one thread),
resource limits, chroot into an empty read-only directory, dropped privileges (a uid of
its own per worker), seccomp filter (synchronised onto every thread with TSYNC).  Each
layer that cannot be applied on this machine is reported as ``unavailable: <reason>`` and
the others still apply; the pool then checks every thread from ``/proc``
(``verify_threads``) and refuses a worker with a thread that escaped a layer.
"""

from __future__ import annotations

import errno
import os
import resource
import signal

try:  # imported now: after chroot nothing can be loaded from disk
    import pyseccomp
except ImportError:  # reported as an unavailable layer
    pyseccomp = None

PROT_EXEC = 0x4

UID_BASE = 1_900_000_000  # worker uid = UID_BASE + its pid: unique among live workers
SHARED_UID = 65534  # nobody: the fallback where a user namespace does not map UID_BASE+pid

LAYER_NAMES = ("network_namespace", "rlimits", "chroot", "drop_privileges", "seccomp")

# The seccomp filter is an allow list: every other system call fails with EPERM.  Measured
# with strace on real workers running benign and failing snippets after lockdown (reads and
# writes on the pipes, memory management, futexes, per-call limits); the read-only file
# calls keep Python's error paths ordinary (ENOENT inside the empty chroot); the time and
# identity calls are harmless.  Calls with arguments that matter are conditional below.
ALLOWED_SYSCALLS = (
    "read", "readv", "write", "writev", "pread64", "close", "lseek",
    "brk", "munmap", "mremap", "madvise", "msync", "mincore",
    "futex", "sched_yield", "sched_getaffinity", "getcpu", "restart_syscall",
    "rt_sigreturn", "rt_sigprocmask", "sigaltstack",
    "getrusage", "times", "getrlimit", "sysinfo", "uname",
    "clock_gettime", "clock_getres", "gettimeofday", "time", "nanosleep", "clock_nanosleep",
    "getrandom", "getpid", "gettid", "getppid", "getuid", "geteuid", "getgid", "getegid",
    "getgroups", "getresuid", "getresgid",
    "fstat", "newfstatat", "stat", "lstat", "statx", "getdents64", "readlink", "readlinkat",
    "access", "faccessat", "faccessat2", "getcwd",
    "exit", "exit_group",
)  # fmt: skip
# open/openat only without any of these flags (no writes, no creation, no O_TMPFILE)
OPEN_WRITE_MASK = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND | 0o20000000
F_GETFD, F_GETFL = 1, 3  # the only fcntl commands: no F_SETOWN/F_SETSIG/F_SETFL(O_ASYNC)
NOSYS_SYSCALLS = ("clone3", "openat2")  # glibc falls back to clone/openat, which are filtered


def lockdown(
    jail: str | None,
    uid: int | None,
    gid: int | None,
    nofile: int,
    max_memory: int,
    cpu_budget: int,
    skip: frozenset[str] | set[str] = frozenset(),
    network_namespace: str = "unavailable: the worker was not started through boot.py",
) -> dict[str, str]:
    """Apply every layer it can, in order; returns ``{layer: "active" | "unavailable: ..."}``.

    ``skip`` names layers to leave out (tests use it to show that the others hold alone).
    ``network_namespace`` is the state of the namespace ``boot.py`` entered before any
    thread existed (it cannot be entered here: threads started since would stay outside).
    """
    steps = {
        "rlimits": lambda: _rlimits(nofile, max_memory, cpu_budget),
        "chroot": lambda: _chroot(jail),
        "drop_privileges": lambda: _drop_privileges(uid, gid),
        "seccomp": _seccomp,
    }
    layers: dict[str, str] = {"network_namespace": network_namespace}
    for name, step in steps.items():
        if name in skip:
            layers[name] = "unavailable: disabled by the pool"
        elif name == "chroot" and not jail:
            layers[name] = "unavailable: needs root (no jail directory)"
        elif name == "drop_privileges" and (uid is None or os.geteuid() != 0):
            layers[name] = "unavailable: the fabric does not run as root (no uid to switch to)"
        else:
            try:
                layers[name] = step() or "active"
            except Exception as exc:  # layers are independent: report it, keep the others
                layers[name] = f"unavailable: {type(exc).__name__}: {exc}"
    return layers


def _rlimits(nofile: int, max_memory: int, cpu_budget: int) -> None:
    """Hard limits for the worker's life; the worker lowers the soft CPU/AS limits per call.

    Hard limits cannot be raised again without CAP_SYS_RESOURCE, which the worker loses
    with its privileges; seccomp lets ``prlimit64`` touch only the worker itself.
    """
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past RLIMIT_FSIZE fails with EFBIG
    for res, value in (
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_FSIZE, 0),
        (resource.RLIMIT_NOFILE, nofile),
        (resource.RLIMIT_NPROC, 0),
        (resource.RLIMIT_AS, address_space() + max_memory),
        (resource.RLIMIT_CPU, cpu_budget),
    ):
        resource.setrlimit(res, (value, value))


def address_space() -> int:
    """This process's current virtual size in bytes (what RLIMIT_AS counts)."""
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _chroot(jail: str | None) -> None:
    assert jail is not None
    os.chroot(jail)
    os.chdir("/")


def _drop_privileges(uid: int | None, gid: int | None) -> str | None:
    """Switch to ``uid``/``gid``; where a user namespace maps no such id (a container with a
    narrow uid map), to the shared ``nobody`` id instead, and say so in the layer's state
    (``verify_threads`` then expects that id)."""
    assert uid is not None and gid is not None
    os.setgroups([])
    state = None
    try:
        os.setresgid(gid, gid, gid)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        uid = gid = SHARED_UID
        os.setresgid(gid, gid, gid)
        state = f"active: shared uid {SHARED_UID} (uid {UID_BASE}+pid is not mapped here)"
    os.setresuid(uid, uid, uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise OSError(errno.EPERM, "setresuid did not take effect")
    return state


def _seccomp() -> None:
    if pyseccomp is None:
        raise RuntimeError("the pyseccomp package (libseccomp) is not installed")
    sc = pyseccomp
    flt = sc.SyscallFilter(defaction=sc.ERRNO(errno.EPERM))
    # onto every thread of the process (pyarrow's pool, jemalloc's), not only this one
    flt.set_attr(sc.Attr.CTL_TSYNC, 1)
    for name in ALLOWED_SYSCALLS:
        _add(flt, sc.ALLOW, name)
    for name in NOSYS_SYSCALLS:
        _add(flt, sc.ERRNO(errno.ENOSYS), name)
    # resource limits: only this process's own (pid 0); hard limits cannot be raised anyway
    _add(flt, sc.ALLOW, "prlimit64", sc.Arg(0, sc.EQ, 0))
    _add(flt, sc.ALLOW, "open", sc.Arg(1, sc.MASKED_EQ, OPEN_WRITE_MASK, 0))
    _add(flt, sc.ALLOW, "openat", sc.Arg(2, sc.MASKED_EQ, OPEN_WRITE_MASK, 0))
    for cmd in (F_GETFD, F_GETFL):
        _add(flt, sc.ALLOW, "fcntl", sc.Arg(1, sc.EQ, cmd))
    # memory, but never executable: injected machine code cannot be made runnable
    _add(flt, sc.ALLOW, "mmap", sc.Arg(2, sc.MASKED_EQ, PROT_EXEC, 0))
    _add(flt, sc.ALLOW, "mprotect", sc.Arg(2, sc.MASKED_EQ, PROT_EXEC, 0))
    _add(flt, sc.ALLOW, "pkey_mprotect", sc.Arg(2, sc.MASKED_EQ, PROT_EXEC, 0))
    flt.load()


def _add(flt, action: int, name: str, *args) -> None:
    sc = pyseccomp
    if sc.resolve_syscall(sc.Arch.NATIVE, name) == -1:  # not a syscall libseccomp knows
        return
    flt.add_rule(action, name, *args)


def worker_uid(pid: int) -> int:
    """The uid (and gid) a worker runs as: one of its own, so that no kernel permission check
    between two workers (signals, ptrace, /proc) can pass on a shared uid."""
    return UID_BASE + pid


def verify_threads(pid: int, layers: dict[str, str], jail: str | None) -> dict[str, str]:
    """Check from the fabric's side, on every thread of worker ``pid``, each layer the
    worker reports active; returns the layers with a failed check replaced by
    ``"failed: <what>"``.  Reads /proc, which the worker cannot write.
    """
    out = dict(layers)
    host_net = os.readlink("/proc/self/ns/net")
    expect_id = str(worker_uid(pid))
    tids = sorted(os.listdir(f"/proc/{pid}/task"), key=int)

    def fail(layer: str, what: str) -> None:
        if out.get(layer, "").startswith("active"):
            out[layer] = f"failed: {what}"

    if layers.get("drop_privileges", "").startswith(f"active: shared uid {SHARED_UID} "):
        expect_id = str(SHARED_UID)

    for tid in tids:
        base = f"/proc/{pid}/task/{tid}"
        with open(f"{base}/status") as f:
            status = dict((k, v.strip()) for k, v in (ln.split(":", 1) for ln in f if ":" in ln))
        if layers.get("seccomp") == "active":
            if status.get("Seccomp") != "2":
                fail("seccomp", f"thread {tid} has Seccomp: {status.get('Seccomp')}")
            if status.get("NoNewPrivs") != "1":
                fail("seccomp", f"thread {tid} has NoNewPrivs: {status.get('NoNewPrivs')}")
        if (
            layers.get("network_namespace") == "active"
            and os.readlink(f"{base}/ns/net") == host_net
        ):
            fail("network_namespace", f"thread {tid} is in the fabric's network namespace")
        if layers.get("drop_privileges", "").startswith("active"):
            for key in ("Uid", "Gid"):
                ids = status.get(key, "").split()
                if ids != [expect_id] * 4:
                    fail("drop_privileges", f"thread {tid} has {key}: {' '.join(ids)}")
            if status.get("Groups", "") != "" or int(status.get("CapEff", "1"), 16) != 0:
                fail("drop_privileges", f"thread {tid} keeps groups or capabilities")
        if layers.get("chroot") == "active" and jail:
            root = os.readlink(f"{base}/root")
            if os.path.realpath(root) != os.path.realpath(jail):
                fail("chroot", f"thread {tid} has its root at {root}")
    if layers.get("rlimits") == "active":
        with open(f"/proc/{pid}/limits") as f:
            text = f.read()
        for name in ("Max processes", "Max core file size", "Max file size"):
            row = next((ln for ln in text.splitlines() if ln.startswith(name)), "")
            if row[len(name) :].split()[:2] != ["0", "0"]:
                fail("rlimits", f"{name} is not 0")
    return out
