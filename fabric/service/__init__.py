"""One fabric for many agents: query serving over Arrow Flight and HTTP, per-agent tokens,
the ``fabric.connect`` client (docs/service.md).

- ``auth``: the ``agents:`` section of fabric.yaml (tokens, bindings, flags, pins, limits)
  and the fair scheduler that shares query workers between agents.
- ``core``: ``QueryService``, the one place a request is authorized and run.
- ``flight``: the Arrow Flight server; ``http``: the HTTP JSON / Arrow IPC routes.
- ``client``: ``connect("grpc://host:port", token=...)``.
"""
