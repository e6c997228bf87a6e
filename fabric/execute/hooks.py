"""The executor's hooks: sandboxed Python functions and encrypted (CKKS) scoring."""

from __future__ import annotations

import pyarrow as pa

from connectors.base import SourceError
from fabric.execute.errors import QueryError
from fabric.execute.state import RunState
from fabric.plan.nodes import (
    EncryptedScore,
    UserFunction,
)


class Hooks(RunState):
    """``SandboxCall`` through ``catalog.sandbox().run(...)``, ``CkksScore`` through
    ``catalog.crypto_score(node, table, params)``."""

    # ------------------------------------------------------------ hooks
    def _user_function(self, node: UserFunction, table: pa.Table) -> pa.Table:
        factory = getattr(self.catalog, "sandbox", None)
        if not callable(factory):
            raise QueryError(
                self.binding,
                "pushdown.python needs a sandbox, and this catalog has none",
                hint="open the fabric with fabric.open(...) so the sandbox pool is configured",
            )
        sandbox = factory()
        missing = [p for p in node.params if p not in self.params]
        if missing:
            raise QueryError(
                self.binding,
                f"session value(s) {', '.join(missing)} needed by pushdown.python are not bound",
            )
        out = sandbox.run(
            node.code,
            table,
            params={p: self.params[p] for p in node.params},
            limits=node.limits,
            binding=self.binding,
            snippet_origin=(node.file, node.line, node.col),
        )
        return out if isinstance(out, pa.Table) else out.table

    def _encrypted(self, node: EncryptedScore, table: pa.Table) -> pa.Table:
        hook = getattr(self.catalog, "crypto_score", None)
        if not callable(hook):
            raise QueryError(
                self.binding,
                "encrypted scoring needs the CKKS public context, and this catalog has none",
                hint="configure crypto: {public_context: agent.pub} in fabric.yaml",
            )
        try:
            out = hook(node, table, self.params)
        except SourceError as e:
            raise QueryError(self.binding, str(e), uri=e.uri, hint=e.hint) from e
        if isinstance(out, pa.Table):
            return out
        return table.append_column(pa.field(node.name, pa.binary()), pa.array(out, pa.binary()))
