"""What a served request can fail with, one class per kind; the Flight and HTTP layers map
each kind to their status and the client raises the same class again."""

from __future__ import annotations

from dsl.errors import FabricError


class ServiceError(FabricError):
    """A request refused or failed; ``kind`` names it on the wire."""

    kind = "failed"
    http_status = 500


class Unauthenticated(ServiceError, PermissionError):
    kind = "unauthenticated"
    http_status = 401


class Forbidden(ServiceError, PermissionError):
    kind = "forbidden"
    http_status = 403


class NotFound(ServiceError, LookupError):
    kind = "not_found"
    http_status = 404


class BadRequest(ServiceError, ValueError):
    kind = "bad_request"
    http_status = 400


class Busy(ServiceError):
    kind = "busy"
    http_status = 429


class Failed(ServiceError, RuntimeError):
    kind = "failed"
    http_status = 502


KINDS: dict[str, type[ServiceError]] = {
    c.kind: c for c in (Unauthenticated, Forbidden, NotFound, BadRequest, Busy, Failed)
}
