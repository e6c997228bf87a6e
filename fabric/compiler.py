"""Just-in-time compilation of bindings, the compiled-plan cache and hot reload.

A binding compiles on first use: spec -> ``fabric.plan.builder.build`` (checks) ->
``fabric.optimizer.optimize`` -> ``fabric.physical.plan`` (which engine runs each part)
-> an immutable ``CompiledBinding`` holding the logical and the physical plan. Compiled bindings are
cached by (content hash, name, catalog version); a query holds on to the object it got,
so a recompilation never changes a plan under a running query.

``BindingFiles`` owns the binding files of a fabric: it indexes binding names, compiles
lazily, and (``watch()``) polls the files every ~200 ms. An edited file is re-parsed and
its bindings recompiled at once; if the edit is broken, the last good plan keeps serving
and the problem is exposed in ``diagnostics`` (and logged as a warning).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsl import loader
from dsl.errors import Diagnostic, DslError, Span, did_you_mean
from dsl.parser import attach_source, parse_binding_text
from dsl.spec import BindingSpec, SessionParam
from dsl.types import SessionError, ValueType, bind_session, infer_type
from fabric.physical import PhysicalError, PhysicalPlan
from fabric.physical import plan as physical_plan
from fabric.plan.builder import build
from fabric.plan.nodes import Plan

log = logging.getLogger("fabric.compiler")


@dataclass(frozen=True)
class CompiledBinding:
    """A binding ready to run: its optimized plan, the logical plan it came from, the
    physical plan the executor runs (built once here), and the session types to bind.
    Immutable: a reload makes a new object."""

    name: str
    plan: Plan
    logical_plan: Plan
    session: Mapping[str, ValueType]
    source_file: str
    content_hash: str
    catalog_version: int
    spec: BindingSpec = field(repr=False, compare=False)
    session_spans: Mapping[str, Span] = field(default_factory=dict, repr=False, compare=False)
    texts: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)
    physical: PhysicalPlan | None = field(default=None, repr=False, compare=False)

    def bind(self, values: Mapping[str, Any] | None) -> dict[str, Any]:
        """Check the session values against the declared types; the executor's params."""
        try:
            return bind_session(self.session, values, binding=self.name, spans=self.session_spans)
        except SessionError as e:
            raise attach_source(e, dict(self.texts)) from None

    @property
    def runnable(self) -> PhysicalPlan | Plan:
        """What ``fabric.execute.execute`` runs: the physical plan (else the optimized one)."""
        return self.physical if self.physical is not None else self.plan

    def explain(self, optimized: bool = True, *, physical: bool | None = None) -> str:
        """The physical plan (what runs where, before anything runs); ``physical=False``:
        the optimized logical plan; ``optimized=False``: the logical plan as built."""
        if not optimized:
            return self.logical_plan.explain()
        if physical is False or self.physical is None:
            return self.plan.explain()
        return self.physical.explain()


def content_hash(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def _optimize(plan: Plan, catalog: Any) -> Plan:
    from fabric.optimizer import optimize

    return optimize(plan, catalog)


def _physical(plan: Plan, catalog: Any) -> PhysicalPlan | None:
    """The physical plan; None when the plan cannot run (the query says why, as before)."""
    try:
        return physical_plan(plan, catalog)
    except PhysicalError:
        return None


class Compiler:
    """spec -> CompiledBinding, cached by (content hash, name, catalog version)."""

    def __init__(
        self,
        catalog: Any,
        optimize: Callable[[Plan, Any], Plan] | None = None,
        max_entries: int = 1024,
    ):
        self.catalog = catalog
        self.optimize = optimize or _optimize
        self._cache: dict[tuple[str, str, int], CompiledBinding] = {}
        self._lock = threading.Lock()
        self.max_entries = max_entries
        self.compilations = 0  # how many times a plan was actually built (tests, benchmarks)

    def compile(
        self, spec: BindingSpec, digest: str, texts: Mapping[str, str] | None = None
    ) -> CompiledBinding:
        version = self.catalog.version
        key = (digest, spec.name, version)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        try:
            logical = build(spec, self.catalog)
        except DslError as e:
            raise attach_source(e, dict(texts or {})) from None
        plan = self.optimize(logical, self.catalog)
        compiled = CompiledBinding(
            spec.name,
            plan,
            logical,
            spec.session_types,
            spec.file,
            digest,
            version,
            spec,
            spec.session_spans,
            dict(texts or {}),
            _physical(plan, self.catalog),
        )
        with self._lock:
            self.compilations += 1
            if len(self._cache) >= self.max_entries:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = compiled
        return compiled

    def compile_text(
        self, text: str, session: Mapping[str, Any] | None = None, *, python: str | None = None
    ) -> CompiledBinding:
        """The compact text form. Without ``session`` declarations in the text, the types are
        inferred from the given session values."""
        digest = content_hash(text + "\0" + (python or ""))
        inferred = ""
        if session:
            try:
                inferred = ",".join(f"{k}:{infer_type(v)}" for k, v in sorted(session.items()))
            except TypeError:
                inferred = ""
        key = (digest + inferred, "query", self.catalog.version)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        spec = parse_binding_text(text, python=python)
        if not spec.session and session:
            try:
                params = tuple(SessionParam(k, infer_type(v)) for k, v in session.items())
            except TypeError as e:
                raise DslError.at(str(e), Span("<text>", 1, 1)) from None
            spec = dataclasses.replace(spec, session=params)
        return self.compile(spec, digest + inferred, {"<text>": text})

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()


# ------------------------------------------------------------------ binding files


@dataclass
class _FileState:
    path: Path
    display: str
    mtime_ns: int = -1
    size: int = -1
    digest: str = ""
    text: str = ""
    specs: dict[str, BindingSpec] = field(default_factory=dict)
    problems: list[Diagnostic] = field(default_factory=list)


class BindingFiles:
    """The binding files of one fabric: names -> specs -> compiled bindings, hot reloaded."""

    def __init__(
        self, compiler: Compiler, discover: Callable[[], list[Path]], root: Path | None = None
    ):
        self.compiler = compiler
        self.discover = discover
        self.root = root
        self._files: dict[Path, _FileState] = {}
        self._owner: dict[str, Path] = {}
        self._compiled: dict[str, CompiledBinding] = {}
        self._compile_problems: dict[str, list[Diagnostic]] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.reloads = 0
        self.scan()

    # ---- discovery and parsing
    def _display(self, p: Path) -> str:
        if self.root is not None:
            try:
                return str(p.resolve().relative_to(self.root.resolve()))
            except ValueError:
                pass
        return str(p)

    def scan(self) -> list[str]:
        """Re-read new, changed and deleted files; returns the names of bindings that changed."""
        changed: list[str] = []
        with self._lock:
            paths = self.discover()
            present = set(paths)
            for p in list(self._files):
                if p not in present:
                    gone = self._files.pop(p)
                    for name in gone.specs:
                        if self._owner.get(name) == p:
                            self._owner.pop(name, None)
                            self._compiled.pop(name, None)
                            changed.append(name)
            for p in paths:
                try:
                    stat = p.stat()
                except OSError:
                    continue
                st = self._files.get(p)
                if st is not None and st.mtime_ns == stat.st_mtime_ns and st.size == stat.st_size:
                    continue
                if st is None:
                    st = self._files[p] = _FileState(p, self._display(p))
                changed.extend(self._reload(st, stat.st_mtime_ns, stat.st_size))
        return changed

    def _reload(self, st: _FileState, mtime_ns: int, size: int) -> list[str]:
        try:
            text = st.path.read_text()
        except OSError as e:
            st.problems = [
                Diagnostic(f"cannot read binding file: {e.strerror}", Span(st.display, 1, 1))
            ]
            return []
        st.mtime_ns, st.size = mtime_ns, size
        digest = content_hash(text)
        if digest == st.digest:
            return []
        first_load = not st.digest
        try:
            specs = {s.name: s for s in loader.load_text(text, st.display)}
        except DslError as e:
            st.problems = e.diagnostics
            if not first_load:
                log.warning(
                    "binding file %s is broken; still serving its last good plans:\n%s",
                    st.display,
                    e.format(),
                )
            return []
        st.problems = []
        old = st.specs
        st.text, st.digest, st.specs = text, digest, specs
        changed = []
        for name in set(old) - set(specs):
            if self._owner.get(name) == st.path:
                self._owner.pop(name, None)
                self._compiled.pop(name, None)
                self._compile_problems.pop(name, None)
                changed.append(name)
        for name, spec in specs.items():
            other = self._owner.get(name)
            if other is not None and other != st.path:
                st.problems.append(
                    Diagnostic(
                        f"binding '{name}' is also defined in {self._files[other].display}",
                        spec.name_span,
                        "binding names must be unique across files",
                    )
                )
                continue
            self._owner[name] = st.path
            changed.append(name)
            if not first_load or name in self._compiled:
                self._recompile(name, st)
        if not first_load:
            self.reloads += 1
        return changed

    def _compile(self, name: str, st: _FileState) -> CompiledBinding:
        """Compile ``name`` from its file; its problems are recorded (and the DslError raised)
        or cleared, and a success replaces the served plan."""
        try:
            compiled = self.compiler.compile(st.specs[name], st.digest, {st.display: st.text})
        except DslError as e:
            self._compile_problems[name] = e.diagnostics
            raise
        self._compile_problems.pop(name, None)
        self._compiled[name] = compiled
        return compiled

    def _recompile(self, name: str, st: _FileState) -> None:
        try:
            self._compile(name, st)
        except DslError as e:
            if name in self._compiled:
                log.warning(
                    "binding %s: the edit does not compile; still serving its last good plan:\n%s",
                    name,
                    e.format(),
                )

    # ---- lookup
    def names(self) -> list[str]:
        return sorted(self._owner)

    def get(self, name: str) -> CompiledBinding:
        cb = self._compiled.get(name)
        if cb is not None and cb.catalog_version == self.compiler.catalog.version:
            return cb
        with self._lock:
            path = self._owner.get(name)
            if path is None:
                if cb is not None:
                    return cb
                raise LookupError(self._unknown(name))
            try:
                return self._compile(name, self._files[path])
            except DslError:
                if cb is not None:
                    return cb
                raise

    def _unknown(self, name: str) -> str:
        names = self.names()
        if not names:
            return (
                f"unknown binding '{name}': no bindings are loaded (check bindings: in fabric.yaml)"
            )
        return f"unknown binding '{name}'; {did_you_mean(name, names, 'bindings')}"

    def spec(self, name: str) -> BindingSpec:
        path = self._owner.get(name)
        if path is None:
            raise LookupError(self._unknown(name))
        return self._files[path].specs[name]

    # ---- diagnostics
    @property
    def diagnostics(self) -> list[Diagnostic]:
        with self._lock:
            out = [d for st in self._files.values() for d in st.problems]
            for probs in self._compile_problems.values():
                out.extend(probs)
            return out

    def validate(self) -> list[Diagnostic]:
        """Re-scan and compile every binding; every problem found."""
        self.scan()
        with self._lock:
            for name, path in list(self._owner.items()):
                with contextlib.suppress(DslError):  # recorded in _compile_problems
                    self._compile(name, self._files[path])
            return self.diagnostics

    # ---- watching
    def watch(self, interval: float = 0.2) -> None:
        if self._thread is not None:
            return
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(interval):
                try:
                    self.scan()
                except Exception:
                    log.exception("binding watcher failed; retrying")

        self._thread = threading.Thread(target=loop, name="fabric-binding-watcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        t, self._thread = self._thread, None
        if t is not None:
            t.join(timeout=2)
