"""``fabric mcp``: every binding an agent may run as an MCP tool (the ``mcp`` SDK).

A tool's name and description are the binding's; its input schema is the binding's
session declaration as JSON Schema (``fabric.service.schema``; pinned values left out).
A call returns the rows, freshness and stats as JSON text and as structured content.

    fabric mcp --config fabric.yaml                  # stdio, an embedded fabric
    fabric mcp --connect grpc://host:8815            # stdio, in front of a fabric serve
    fabric mcp --http --port 8790 --config fabric.yaml   # streamable HTTP at /mcp
    fabric serve --config fabric.yaml   # with agents:, also at http://host:port/mcp

The token is the same as for Flight and HTTP: over stdio from ``--token-env`` (default
``FABRIC_TOKEN``), checked when the server starts; over HTTP each request's
``Authorization: Bearer <token>`` (401 without one, before any MCP message is read).
``fabric serve`` mounts the HTTP app next to its query routes (``mount``), in front of the
same ``QueryService`` as Flight and HTTP JSON: one queue, one set of metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from fabric.service import wire
from fabric.service.errors import ServiceError, Unauthenticated


class EmbeddedTools:
    """Tools of a fabric in this process, authorized by ``QueryService``."""

    def __init__(self, fab: Any = None, *, service: Any = None):
        from fabric.service.core import QueryService

        self.service = service if service is not None else QueryService(fab)

    def check(self, authorization: str | None) -> None:
        self.service.agent(authorization)

    def tools(self, authorization: str | None) -> list[dict[str, Any]]:
        return self.service.bindings(self.service.agent(authorization))

    def call(self, authorization: str | None, name: str, args: dict[str, Any]) -> Any:
        return self.service.query(self.service.agent(authorization), name, args)


class RemoteTools:
    """Tools of a served fabric (``fabric.connect``): the server authorizes each call."""

    def __init__(self, url: str):
        self.url = url
        self._clients: dict[str | None, Any] = {}

    def _client(self, authorization: str | None) -> Any:
        from fabric.service.client import connect

        if authorization not in self._clients:
            token = (authorization or "").partition(" ")[2].strip() or None
            self._clients[authorization] = connect(self.url, token)
        return self._clients[authorization]

    def check(self, authorization: str | None) -> None:
        self._client(authorization).bindings()

    def tools(self, authorization: str | None) -> list[dict[str, Any]]:
        return self._client(authorization).bindings()

    def call(self, authorization: str | None, name: str, args: dict[str, Any]) -> Any:
        return self._client(authorization).query(name, args)


def result_json(res: Any) -> dict[str, Any]:
    return {
        "binding": res.binding,
        "columns": res.table.column_names,
        "rows": [wire.encode_value(r) for r in res.table.to_pylist()],
        "freshness": json.loads(wire.dumps(res.freshness)),
        "stats": json.loads(wire.dumps(res.stats)),
    }


def build_server(backend: Any, stdio_authorization: str | None = None) -> Any:
    import anyio
    import mcp_types as types
    from mcp.server.lowlevel import Server

    def auth(ctx: Any) -> str | None:
        request = getattr(ctx, "request", None)
        if request is not None and hasattr(request, "headers"):
            return request.headers.get("authorization")
        return stdio_authorization

    async def list_tools(ctx: Any, params: Any) -> Any:
        entries = await anyio.to_thread.run_sync(backend.tools, auth(ctx))
        return types.ListToolsResult(
            tools=[
                types.Tool(
                    name=b["name"],
                    description=b["description"] or f"the binding {b['name']}",
                    input_schema=b["schema"] or {"type": "object"},
                )
                for b in entries
            ]
        )

    async def call_tool(ctx: Any, params: Any) -> Any:
        args = wire.decode_session(params.arguments or {})
        try:
            res = await anyio.to_thread.run_sync(backend.call, auth(ctx), params.name, args)
        except ServiceError as e:
            text = f"{e.kind}: {e}"
            return types.CallToolResult(
                content=[types.TextContent(type="text", text=text)], is_error=True
            )
        body = result_json(res)
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=json.dumps(body, default=str))],
            structured_content=body,
        )

    return Server(
        "agent-data-fabric",
        instructions="Each tool runs one binding of the fabric with the given session values; "
        "results carry the rows, each source's freshness and the query's stats.",
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )


class Authorized:
    """An ASGI app behind the fabric's token check: an HTTP request without a valid token is
    answered 401 (403 for a token the service refuses) before ``inner`` reads any of it."""

    def __init__(self, backend: Any, inner: Any):
        self.backend = backend
        self.inner = inner

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            import anyio
            from starlette.responses import JSONResponse

            headers = {k.decode().lower(): v.decode() for k, v in scope.get("headers", [])}
            try:
                await anyio.to_thread.run_sync(self.backend.check, headers.get("authorization"))
            except ServiceError as e:
                status = 401 if isinstance(e, Unauthenticated) else e.http_status
                await JSONResponse({"error": str(e), "kind": e.kind}, status)(scope, receive, send)
                return
        await self.inner(scope, receive, send)

    def lifespan(self) -> Any:
        """The MCP session manager's lifetime (its task group), for an app mounting this."""
        return self.inner.router.lifespan_context(self.inner)


def http_app(backend: Any, host: str = "127.0.0.1") -> Authorized:
    """The streamable HTTP app at ``/mcp``, refusing requests without a valid token."""
    return Authorized(backend, build_server(backend).streamable_http_app(host=host))


def mount(service: Any, host: str = "127.0.0.1") -> tuple[Any, Any]:
    """``(route, lifespan)`` serving MCP at ``/mcp`` of ``fabric serve``'s HTTP app, in front
    of its ``QueryService`` (the same tokens, queue and metrics as Flight and HTTP JSON)."""
    from starlette.routing import Route

    app = http_app(EmbeddedTools(service=service), host)

    def lifespan(_app: Any) -> Any:
        return app.lifespan()

    return Route("/mcp", endpoint=app), lifespan


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fabric mcp", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", help="fabric.yaml of an embedded fabric (default ./fabric.yaml)")
    src.add_argument("--connect", metavar="GRPC_URL", help="a fabric serve's Flight address")
    p.add_argument("--http", action="store_true", help="streamable HTTP instead of stdio")
    p.add_argument("--host", default="127.0.0.1", help="HTTP address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8790, help="HTTP port (default 8790; 0: free)")
    p.add_argument(
        "--token-env",
        default="FABRIC_TOKEN",
        help="environment variable holding the agent's token for stdio (default FABRIC_TOKEN)",
    )
    args = p.parse_args(argv)
    fab = None
    if args.connect:
        backend: Any = RemoteTools(args.connect)
    else:
        import fabric

        path = args.config or "fabric.yaml"
        if not os.path.exists(path):
            print(f"fabric mcp: config file {path} not found; pass --config", file=sys.stderr)
            return 2
        try:
            fab = fabric.open(path)
        except Exception as exc:
            from connectors.credentials import mask

            print(f"fabric mcp: {mask(exc)}", file=sys.stderr)
            return 2
        backend = EmbeddedTools(fab)
    try:
        if args.http:
            return _serve_http(backend, args.host, args.port)
        token = os.environ.get(args.token_env)
        authorization = f"Bearer {token}" if token else None
        try:
            backend.check(authorization)
        except ServiceError as e:
            print(f"fabric mcp: {e} (token from ${args.token_env})", file=sys.stderr)
            return 2
        import anyio
        from mcp.server.stdio import stdio_server

        server = build_server(backend, authorization)

        async def run() -> None:
            async with stdio_server() as (read, write):
                await server.run(read, write, server.create_initialization_options())

        anyio.run(run)
        return 0
    finally:
        if fab is not None:
            fab.close()


def _serve_http(backend: Any, host: str, port: int) -> int:
    import socket

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        print(f"fabric mcp: cannot listen on {host}:{port}: {exc}; pick another --port")
        return 2
    sock.listen(128)  # connections wait in the backlog until uvicorn serves them
    h, pt = sock.getsockname()[:2]
    print(f"fabric mcp: listening on http://{h}:{pt}/mcp", flush=True)
    config = uvicorn.Config(http_app(backend, host), log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
