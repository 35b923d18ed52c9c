"""The one exception tree of dsec.

Every error a user can see derives from :class:`DsecError`. Each class carries a stable
machine ``code`` (sent on the wire by Aether error frames and REST error bodies, so the
receiving side re-raises the same class) and the HTTP status the apiserver answers with::

    DsecError
    ├── InvalidArgument            the caller sent something we cannot accept     400
    │   ├── UnknownMethod          no handler for an Aether method                400
    │   ├── MethodNotAllowed       an HTTP method the route does not declare      405
    │   ├── CannotRun              exec named a program, user or cwd the sandbox
    │   │                          does not have (foreground: exit 127/126)       400
    │   └── Unsatisfiable          more than any node could ever hold (not "full now")
    ├── Unauthenticated            missing or wrong API key                       401
    ├── PermissionDenied           key is valid, role is not enough               403
    ├── NotFound                                                                  404
    │   ├── SandboxNotFound
    │   ├── ImageNotFound
    │   ├── ProjectNotFound
    │   └── BlobNotFound           a blob store has no object under that key
    ├── Conflict                   the object is not in a state that allows it    409
    │   ├── InvalidTransition      lifecycle table says no (names sandbox/event/state)
    │   │   └── SandboxLost        written off with its node (node expired, or it
    │   │                          restarted without the sandbox)
    │   ├── WrongNode              sandbox id belongs to another edge
    │   └── InUse                  e.g. removing an image a sandbox still uses
    ├── Compacted                  a watch asked for history that is gone         410
    ├── PayloadTooLarge                                                           413
    ├── ResourceExhausted                                                         429/503
    │   ├── CapacityExceeded       edge admission: carries what was short
    │   ├── QuotaExceeded          a project (or ancestor) quota would be broken
    │   ├── NoCapacity             placement found no node after its retries
    │   └── RateLimited            per-key rate limit; carries retry_after
    ├── Unavailable                a part of the cluster the request needs cannot
    │   │                          be reached right now; retry later              503
    │   ├── EdgeUnreachable        the apiserver's link to the sandbox's node failed
    │   │                          (never the caller's own connection)
    │   └── BlobUnavailable        a blob store did not answer (connect, 5xx, timeout,
    │                              short body) after bounded retries
    ├── Timeout                                                                   504
    │   └── RequestTimeout         the *request* deadline (not a command timeout)
    ├── ProtocolError              the Aether/HTTP conversation broke
    │   ├── LocalProtocolError     we produced something invalid (our bug)
    │   └── RemoteProtocolError    the peer sent something invalid (its bug/corruption)
    ├── TransportError             the caller's own connection failed
    │   ├── ConnectFailed          could not connect: nothing was sent
    │   ├── ConnectionLost         pending calls on a connection that died: the
    │   │   │                      request may have been carried out
    │   │   └── Overloaded         a server refused the connection: at its limits  503
    │   └── StreamReset            one duplex stream was reset (the connection lives)
    ├── SandboxError               the sandbox or its backend failed             500
    │   └── BackendError
    ├── ImageError                 layer store / build / import problems         400
    │   ├── CorruptLayer
    │   └── UnsafeArchive          tar member escaping, device node, ...
    └── InternalError              an unexpected bug on the remote side          500

Retryable, for a caller: ``TransportError`` (its own connection), ``RequestTimeout``,
``Unavailable`` and ``RateLimited``; the SDK retries creates on them with one
``Idempotency-Key``. ``detail["may_have_run"]`` on an exec error says whether the
command may have started before the failure (``ConnectFailed``: never).

Keep "we broke it" apart from "the peer broke it" (CONVENTIONS.md #10) and map lower
layer exceptions at each boundary with ``raise X(...) from exc``.
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "BackendError",
    "BlobNotFound",
    "BlobUnavailable",
    "BuildStepFailed",
    "CannotRun",
    "CapacityExceeded",
    "Compacted",
    "Conflict",
    "ConnectFailed",
    "ConnectionLost",
    "CorruptLayer",
    "DsecError",
    "EdgeUnreachable",
    "ImageError",
    "ImageNotFound",
    "InUse",
    "InternalError",
    "InvalidArgument",
    "InvalidTransition",
    "LocalProtocolError",
    "MethodNotAllowed",
    "NoCapacity",
    "NotFound",
    "Overloaded",
    "PayloadTooLarge",
    "PermissionDenied",
    "ProjectNotFound",
    "ProtocolError",
    "QuotaExceeded",
    "RateLimited",
    "RemoteProtocolError",
    "RequestTimeout",
    "ResourceExhausted",
    "SandboxError",
    "SandboxLost",
    "SandboxNotFound",
    "StreamReset",
    "Timeout",
    "TransportError",
    "Unauthenticated",
    "Unavailable",
    "UnknownMethod",
    "UnsafeArchive",
    "Unsatisfiable",
    "WrongNode",
    "error_class",
    "error_from_wire",
]

_REGISTRY: dict[str, type[DsecError]] = {}


class DsecError(Exception):
    """Root of every dsec error. ``detail`` holds machine-readable extras (JSON-able)."""

    code: ClassVar[str] = "dsec_error"
    http_status: ClassVar[int] = 500

    def __init__(self, message: str, **detail: Any) -> None:
        super().__init__(message)
        self.message = message
        self.detail: dict[str, Any] = detail

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        code = cls.__dict__.get("code")
        if code is not None:
            if code in _REGISTRY and _REGISTRY[code] is not cls:
                raise TypeError(f"error code {code!r} is used by {_REGISTRY[code].__name__}")
            _REGISTRY[code] = cls

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.code, self.message, self.detail))


_REGISTRY[DsecError.code] = DsecError


def _rebuild(code: str, message: str, detail: dict[str, Any]) -> DsecError:
    return error_from_wire(code, message, detail)


def error_class(code: str) -> type[DsecError]:
    """The class registered for ``code``; unknown codes map to :class:`DsecError`."""
    return _REGISTRY.get(code, DsecError)


def error_from_wire(code: str, message: str, detail: dict[str, Any] | None = None) -> DsecError:
    """Rebuild an error sent by a peer as the same class it had on the other side."""
    cls = error_class(code)
    err = cls.__new__(cls)
    DsecError.__init__(err, message, **(detail or {}))
    return err


class InvalidArgument(DsecError, ValueError):
    code = "invalid_argument"
    http_status = 400


class UnknownMethod(InvalidArgument):
    code = "unknown_method"


class MethodNotAllowed(InvalidArgument):
    """The REST route exists but not with this HTTP method (``detail["allow"]``: the
    methods it does declare, also sent as the ``Allow`` header)."""

    code = "method_not_allowed"
    http_status = 405


class CannotRun(InvalidArgument):
    """An exec could not start its command: the program, the user or the working
    directory does not exist in the sandbox (``detail``: ``exit_code`` 127 or 126, what a
    foreground exec reports for the same mistake). A caller mistake, so 4xx; not a
    :class:`NotFound`, which callers read as "the sandbox (or file) is gone"."""

    code = "cannot_run"


class Unsatisfiable(InvalidArgument):
    """A sandbox larger than any node's whole capacity: waiting or retrying cannot help
    (unlike ``CapacityExceeded``/``NoCapacity``, which mean "full right now")."""

    code = "unsatisfiable"


class Unauthenticated(DsecError):
    code = "unauthenticated"
    http_status = 401


class PermissionDenied(DsecError):
    code = "permission_denied"
    http_status = 403


class NotFound(DsecError, LookupError):
    code = "not_found"
    http_status = 404


class SandboxNotFound(NotFound):
    code = "sandbox_not_found"


class ImageNotFound(NotFound):
    code = "image_not_found"


class ProjectNotFound(NotFound):
    code = "project_not_found"


class BlobNotFound(NotFound):
    """A blob store has no object under the key (``detail``: ``store``, ``key``): not
    retryable, the layer was never pushed there (or was deleted)."""

    code = "blob_not_found"


class Conflict(DsecError):
    code = "conflict"
    http_status = 409


class InvalidTransition(Conflict):
    code = "invalid_transition"


class SandboxLost(InvalidTransition):
    """The sandbox was written off with its node: the node stopped heartbeating and was
    expired, or it restarted without the sandbox. It will not come back."""

    code = "sandbox_lost"


class WrongNode(Conflict):
    code = "wrong_node"


class InUse(Conflict):
    code = "in_use"


class Compacted(DsecError):
    code = "compacted"
    http_status = 410


class PayloadTooLarge(InvalidArgument):
    code = "payload_too_large"
    http_status = 413


class ResourceExhausted(DsecError):
    code = "resource_exhausted"
    http_status = 503


class CapacityExceeded(ResourceExhausted):
    code = "capacity_exceeded"


class QuotaExceeded(ResourceExhausted):
    code = "quota_exceeded"
    http_status = 429


class NoCapacity(ResourceExhausted):
    code = "no_capacity"


class RateLimited(ResourceExhausted):
    code = "rate_limited"
    http_status = 429


class Unavailable(DsecError):
    """Something the request needs cannot be reached right now; the same request may
    succeed later (the SDK retries creates on it)."""

    code = "unavailable"
    http_status = 503


class EdgeUnreachable(Unavailable):
    """The apiserver could not use its link to the sandbox's node (``detail``: ``node``,
    and ``may_have_run`` for an exec). Not the caller's connection: that one is fine."""

    code = "edge_unreachable"


class BlobUnavailable(Unavailable):
    """A blob store could not serve a request after bounded retries: connection refused or
    reset, timeout, a 5xx, or a body shorter/longer than asked (``detail``: ``store``,
    ``key``, ``attempts``). Retryable later; never a partial answer served as data."""

    code = "blob_unavailable"


class Timeout(DsecError, TimeoutError):
    code = "timeout"
    http_status = 504


class RequestTimeout(Timeout):
    code = "request_timeout"


class ProtocolError(DsecError):
    code = "protocol_error"
    http_status = 502


class LocalProtocolError(ProtocolError):
    code = "local_protocol_error"


class RemoteProtocolError(ProtocolError):
    code = "remote_protocol_error"


class TransportError(DsecError, ConnectionError):
    code = "transport_error"
    http_status = 502


class ConnectFailed(TransportError):
    """The connection could not be opened: the request was never sent."""

    code = "connect_failed"


class ConnectionLost(TransportError):
    """The connection died with the request on it: the peer may have carried it out."""

    code = "connection_lost"


class Overloaded(ConnectionLost):
    """A listener refused or closed the connection because it is at one of its limits
    (connections per listener or per peer, file descriptors, buffered bytes). Nothing on
    it was processed; retry later, with backoff."""

    code = "overloaded"
    http_status = 503


class StreamReset(TransportError):
    """One duplex Aether stream ended abruptly: the peer cancelled it, its call ended
    while data was still flowing, or this side reset it. The connection and its other
    streams carry on; bytes not yet delivered on this stream are lost."""

    code = "stream_reset"


class SandboxError(DsecError):
    code = "sandbox_error"
    http_status = 500


class BackendError(SandboxError):
    code = "backend_error"


class ImageError(DsecError):
    code = "image_error"
    http_status = 400


class BuildStepFailed(ImageError):
    """An image build step's command failed (``dsec.client.build``): the message names
    the step, its exit code and the tail of its output; nothing was tagged."""

    code = "build_step_failed"


class CorruptLayer(ImageError):
    code = "corrupt_layer"


class UnsafeArchive(ImageError):
    code = "unsafe_archive"


class InternalError(DsecError):
    code = "internal_error"
    http_status = 500
