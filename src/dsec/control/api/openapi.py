"""OpenAPI 3.1 document generated from the operation catalogue and the msgspec types.

Every REST operation is documented from its catalogue row (:func:`doc_of`: method, path,
operation id, summary, status, query parameters, body and reply types), and every body
schema comes from ``msgspec.json.schema_components`` over the same structs the server
decodes with, so the document cannot drift from what the server accepts. What a row
cannot say (the bounds a query parameter is checked against, for clients and the
schemathesis test) is :data:`QUERY_DOCS`, by parameter name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from dsec.errors import InternalError
from dsec.image.manifest import MAX_REF_LEN
from dsec.wire.api import (
    PRINCIPAL_PATTERN,
    PROJECT_PATTERN,
    SNAPSHOT_PATTERN,
    ApiError,
    ExecManyBody,
    ExecOutput,
)
from dsec.wire.calls import MAX_GENERATION, ExecMany
from dsec.wire.ops import Op as CatalogueOp
from dsec.wire.outcome import Batch
from dsec.wire.spec import MAX_PATH_BYTES, TIER_BACKENDS, ExecResult

__all__ = [
    "FILE_PATH",
    "IDEMPOTENCY_KEY",
    "KEY_ID",
    "PROJECT_PATH",
    "QUERY_DOCS",
    "SANDBOX_ID",
    "SESSION_ID",
    "SNAPSHOT_ID",
    "Op",
    "Param",
    "build_openapi",
    "doc_of",
    "path_param_schema",
]

Body = type | Literal["binary", "text"] | None

# Patterns and limits the server enforces on identifiers and paths, as JSON schema. The
# server's own checks are dsec.ids (parse_sandbox_id, parse_project_path), the shared
# exec/path validators in dsec.wire.spec and the IAM rules; tests/control/test_openapi.py
# sends values on both sides of each bound and checks the server agrees.
_NODE = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
SANDBOX_ID: dict[str, Any] = {"type": "string", "pattern": rf"^sb-[0-9a-f]{{12}}-{_NODE}$"}
SNAPSHOT_ID: dict[str, Any] = {
    "type": "string", "pattern": SNAPSHOT_PATTERN,
    "description": "sha256:<hex>, or a unique prefix of at least 12 hex digits"}
KEY_ID: dict[str, Any] = {"type": "string", "pattern": r"^[0-9a-f]{16}$",
                          "description": "the 16 hex digits after dsk_"}
SESSION_ID: dict[str, Any] = {"type": "string", "pattern": r"^ses-[0-9a-f]{16}$"}
PROJECT_PATH: dict[str, Any] = {"type": "string", "pattern": PROJECT_PATTERN,
                                "description": "'/'-separated lowercase names, 1-16 levels"}
FILE_PATH: dict[str, Any] = {"type": "string", "minLength": 1, "maxLength": MAX_PATH_BYTES,
                             "description": "a path inside the sandbox: at most "
                                            f"{MAX_PATH_BYTES} UTF-8 bytes, no NUL"}
IDEMPOTENCY_KEY: dict[str, Any] = {"type": "string", "minLength": 1, "maxLength": 255,
                                   "pattern": "^[\\x20-\\x7e]+$",
                                   "description": "1-255 printable ASCII characters"}


# An id the server checks with dsec.wire.spec.check_id (1..N printable characters, no
# '/'), documented as its printable-ASCII part: every value of the document is one the
# server takes, and the rest (non-ASCII printable) the server refuses or does not find
# (404), which is a rejection either way. '%', '?' and '#' are left out of the document
# (they would change the URL they travel in unless a client escapes them).
_SEGMENT = r"[\x20-\x22\x24\x26-\x2e\x30-\x3e\x40-\x7e]"
NODE_ID: dict[str, Any] = {"type": "string", "pattern": rf"^{_SEGMENT}{{1,255}}$",
                           "description": "a node id"}
PIN_NODE: dict[str, Any] = {"type": "string", "pattern": rf"^{_SEGMENT}{{1,128}}$",
                            "description": "a node id (at most 128 characters)"}
LAYER_DIGEST: dict[str, Any] = {"type": "string", "pattern": r"^sha256:[0-9a-f]{64}$",
                                "description": "a layer's full digest"}
JOIN_TOKEN_ID: dict[str, Any] = {"type": "string", "pattern": r"^[0-9a-f]{12}$",
                                 "description": "a join token's id (its first part)"}
# dsec.image.manifest.parse_ref: sha256:<12-64 hex>, or [project/]name[:tag]
_PART_RE = PROJECT_PATTERN.removeprefix("^").removesuffix("$")
IMAGE_REF: dict[str, Any] = {
    "type": "string", "maxLength": MAX_REF_LEN,
    "pattern": (r"^(?:sha256:[0-9a-f]{12,64}|(?!sha256:)(?:" + _PART_RE + r"/)?"
                r"[a-z0-9][a-z0-9._-]{0,127}(?::[A-Za-z0-9_][A-Za-z0-9._-]{0,127})?)$"),
    "description": "[project/]name[:tag] or sha256:<digest or a 12+ hex prefix>"}


def path_param_schema(path: str, name: str) -> dict[str, Any]:
    """The schema of path parameter ``name`` of route ``path`` (by what it names)."""
    if name == "path":
        return PROJECT_PATH
    if name == "port":
        return {"type": "integer", "minimum": 1, "maximum": 65535}
    if name == "ref":
        return IMAGE_REF
    if name == "image":
        return LAYER_DIGEST
    if name == "node":
        return PIN_NODE
    for prefix, schema in (("/v1/sandboxes/", SANDBOX_ID), ("/v1/snapshots/", SNAPSHOT_ID),
                           ("/v1/keys/", KEY_ID), ("/v1/sessions/", SESSION_ID),
                           ("/v1/nodes/", NODE_ID), ("/v1/cluster/nodes/", NODE_ID),
                           ("/v1/cluster/tokens/", JOIN_TOKEN_ID)):
        if path.startswith(prefix):
            return schema
    return {"type": "string", "minLength": 1}


@dataclass(frozen=True, slots=True)
class Param:
    """A query parameter. ``schema`` is a JSON-schema fragment for a scalar."""

    name: str
    schema: dict[str, Any]
    required: bool = False
    description: str = ""


@dataclass(frozen=True, slots=True)
class Op:
    method: str
    path: str                       # OpenAPI form: /v1/sandboxes/{id}
    operation_id: str
    summary: str
    request: Body = None
    response: Body = None
    status: int = 200
    params: tuple[Param, ...] = ()
    tag: str = "sandboxes"
    auth: bool = True
    response_media: str = "application/json"
    headers: tuple[Param, ...] = field(default=())
    body_required: bool = True      # False: an empty body is valid (an empty file)
    # No API key, but a credential in the body (a join token, a signature): 401/403 are
    # documented answers though ``auth`` is False.
    body_credential: bool = False
    # No API key, but an optional bearer token of its own (``/metrics``: the metrics
    # token, 401 when wrong; 403 from a non-loopback client without one): the scheme
    # it names, documented as optional security, with its 401/403.
    token_scheme: str | None = None


# Every route may answer these (431 and 413 come from the HTTP limits in front of the
# routes, dsec.control.api.http_limits, before any route is chosen).
_ERROR_CODES = {400: "bad input", 401: "missing or invalid API key",
                403: "role not sufficient", 404: "not found (or not visible to this key)",
                409: "conflict", 413: "body too large", 429: "rate limit or quota",
                431: "request line and headers too large (http_limits.max_header_bytes)",
                503: "no capacity, or a node the request needs is unreachable (retry)",
                504: "request timeout"}


def build_openapi(ops: list[Op], *, version: str) -> dict[str, Any]:
    types: list[Any] = [ApiError]
    for op in ops:
        for t in (op.request, op.response):
            if isinstance(t, type) or (t is not None and t not in ("binary", "text")):
                types.append(t)
    schemas, components = msgspec.json.schema_components(
        types, ref_template="#/components/schemas/{name}")
    ref = dict(zip([id(t) for t in types], schemas))

    def content(t: Body, media: str) -> dict[str, Any]:
        if t == "binary":
            return {"application/octet-stream": {"schema": {"type": "string",
                                                            "format": "binary"}}}
        if t == "text":
            return {media: {"schema": {"type": "string"}}}
        return {media: {"schema": ref[id(t)]}}

    paths: dict[str, dict[str, Any]] = {}
    for op in ops:
        params = [{"name": p.name, "in": "path", "required": True,
                   "schema": path_param_schema(op.path, p.name)}
                  for p in _path_params(op.path)]
        params += [{"name": p.name, "in": "query", "required": p.required, "schema": p.schema,
                    **({"description": p.description} if p.description else {})}
                   for p in op.params]
        params += [{"name": p.name, "in": "header", "required": p.required,
                    "schema": p.schema,
                    **({"description": p.description} if p.description else {})}
                   for p in op.headers]
        responses: dict[str, Any] = {}
        if op.response is None:
            responses[str(op.status)] = {"description": "done"}
        else:
            responses[str(op.status)] = {"description": "success",
                                         "content": content(op.response, op.response_media)}
        for code, what in _ERROR_CODES.items():
            if code in (401, 403) and not (op.auth or op.body_credential or op.token_scheme):
                continue
            responses[str(code)] = {"description": what,
                                    "content": {"application/json": {"schema": ref[id(ApiError)]}}}
        entry: dict[str, Any] = {"operationId": op.operation_id, "summary": op.summary,
                                 "tags": [op.tag], "parameters": params,
                                 "responses": responses}
        if op.request is not None:
            entry["requestBody"] = {"required": op.body_required,
                                    "content": content(op.request, "application/json")}
        if op.token_scheme is not None:     # optional: {} is "no credential"
            entry["security"] = [{}, {op.token_scheme: []}]
        elif not op.auth:
            entry["security"] = []
        paths.setdefault(op.path.replace(":path}", "}"), {})[op.method.lower()] = entry
    return {
        "openapi": "3.1.0",
        "info": {"title": "dsec API", "version": version,
                 "description": "Elastic sandboxes for agentic RL. Every error body is "
                                "ApiError {code, message, request_id}."},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer",
                                           "description": "dsk_<id>_<secret> API key"},
                                **{op.token_scheme: _TOKEN_SCHEMES[op.token_scheme]
                                   for op in ops if op.token_scheme is not None}},
        },
        "security": [{"apiKey": []}],
    }


_TOKEN_SCHEMES: dict[str, dict[str, Any]] = {
    "metricsToken": {"type": "http", "scheme": "bearer",
                     "description": "the metrics token (RestConfig.metrics_token, dsec up: "
                                    "$DSEC_METRICS_TOKEN); without one configured, "
                                    "/metrics answers loopback clients only (403)"}}


def _path_params(path: str) -> list[Param]:
    out = []
    for seg in path.split("/"):
        if seg.startswith("{") and seg.endswith("}"):
            out.append(Param(seg[1:-1].removesuffix(":path"), {"type": "string"}, True))
    return out


# The documentation of each query parameter a row names, by name: the bounds the
# server checks (the request type's __post_init__ or the policy), for clients and for
# the schemathesis test. Required or not comes from the request type (a field without a
# default); a row naming a parameter missing here fails at start (doc_of).
_NAME = r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$"
QUERY_DOCS: dict[str, Param] = {p.name: p for p in (
    Param("path", FILE_PATH),
    Param("offset", {"type": "integer", "minimum": 0}),
    Param("length", {"type": "integer", "minimum": 0}),
    Param("mode", {"type": "integer", "minimum": 0, "maximum": 4095}),
    Param("append", {"type": "boolean"}),
    Param("recursive", {"type": "boolean"}),
    Param("parents", {"type": "boolean", "default": True},
          description="create missing parents too (false: 404 when the parent is missing)"),
    Param("project", PROJECT_PATH),
    Param("label", {"type": "string", "pattern": "^[^=]+=.*$"},
          description="key=value, repeatable"),
    Param("state", {"enum": ["creating", "destroyed", "destroying", "failed", "paused",
                             "pausing", "resuming", "running"]}),
    Param("limit", {"type": "integer", "minimum": 1, "maximum": 1000}),
    Param("cursor", {"type": "string"}),
    Param("node", {"type": "string", "pattern": r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$"},
          description="only the sandboxes on this node"),
    Param("isolation", {"enum": list(TIER_BACKENDS)},
          description="only the sandboxes of this isolation tier"),
    Param("strip", {"type": "array", "items": {"type": "string", "minLength": 1}},
          description="path patterns left out (reuse safety), repeatable"),
    Param("sandbox_id", SANDBOX_ID),
    Param("lease_s", {"type": "number", "minimum": 5, "maximum": 86400}),
    # not SESSION_ID: the apiserver takes any string here today (it becomes the
    # dsec.io/session label), and the document says what the server checks
    Param("session", {"type": "string"}, description="the client session lease the "
          "sandbox lives under (the SDK sets it)"),
    Param("name", {"type": "string", "minLength": 1},
          description="[project/]name: a project's name needs member there, a bare "
                      "(cluster-wide) name a superuser"),
    Param("kind", {"enum": ["base", "workspace", "toolkit"]}),
    Param("tag", {"type": "string", "pattern": _NAME}),
    Param("expect_generation", {"type": "integer", "minimum": 0, "maximum": MAX_GENERATION},
          description="compare-and-set: update only if the live policy still has the "
                      "generation network_get gave (409 otherwise)"),
    Param("principal", {"type": "string", "pattern": PRINCIPAL_PATTERN},
          description="whose keys (default: the caller's own)"),
    Param("nodes", {"type": "boolean"},
          description="also revoke the nodes that joined with the token"),
    # issue 19: streamed files, watches
    Param("size", {"type": "integer", "minimum": 0, "maximum": 1 << 40},
          description="the upload's size in bytes, when known: refused up front if the "
                      "disk cannot take it, and the write fails unless exactly this much "
                      "arrives"),
    Param("timeout_s", {"type": "number", "exclusiveMinimum": 0, "maximum": 86400},
          description="end the watch after this many seconds"),
    # red team 21: file calls as a sandbox user
    Param("user", {"type": "string", "pattern": r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}"
                                                 r"(:[0-9]{1,10})?$"},
          description="the sandbox user (name or uid[:gid], from the sandbox's "
                      "/etc/passwd) the file call runs as: the kernel checks it with "
                      "that user's rights and what it makes is theirs (container "
                      "tiers; 400 elsewhere). Absent: root"),
)}


# The REST (JSON) form of a request or reply that holds exec records (dsec.wire.jsonform
# converts between them); tests/test_catalogue.py checks every such type is listed.
_JSON_FORMS: dict[Any, Any] = {ExecMany: ExecManyBody, Batch[ExecResult]: Batch[ExecOutput]}


def doc_of(row: CatalogueOp[Any, Any], *, request: Body | None = None,
           response: Body | None = None, media: str = "application/json",
           headers: tuple[Param, ...] = ()) -> Op:
    """A REST row's documented operation, from the row: method, path, operation id,
    summary, status, tag; its query parameters (each row's, documented by
    :data:`QUERY_DOCS`, required when the request field has no default); the body's
    schema (the request type, the named field's type, or raw bytes) and the reply's (the
    reply type, raw bytes, or none). ``request``/``response`` override the body and reply
    schema where REST carries a JSON form of its own (exec's ``ExecBody``)."""
    from dsec.wire.rest import query_fields

    rest = row.rest
    if rest is None:
        raise InternalError(f"operation {row.name!r} has no REST binding to document")
    fields = {f.name: f for f in msgspec.structs.fields(row.request)}
    params = []
    for name, param in rest.query.items():
        doc = QUERY_DOCS.get(param)
        if doc is None:
            raise InternalError(f"query parameter {param!r} of {row.name} is not documented "
                                "(dsec.control.api.openapi.QUERY_DOCS)")
        f = fields[name]
        required = f.default is msgspec.NODEFAULT and f.default_factory is msgspec.NODEFAULT
        params.append(Param(param, doc.schema, required, doc.description))
    assert set(query_fields(row)) == {p.name for p in params}
    body: Body = None
    if rest.body == "*":
        body = row.request
    elif rest.body is not None:
        t = msgspec.inspect.type_info(row.request)
        assert isinstance(t, msgspec.inspect.StructType)
        ft = next(f.type for f in t.fields if f.name == rest.body)
        if isinstance(ft, msgspec.inspect.BytesType):
            body = "binary"
        else:
            assert isinstance(ft, msgspec.inspect.StructType), (row.name, ft)
            body = ft.cls
    reply: Body = {"json": row.reply, "raw": "binary", "ndjson": row.reply,
                   "empty": None}[rest.reply]
    # exec records inside a body or reply travel in their JSON form (wire.jsonform)
    if body is row.request and row.request in _JSON_FORMS:
        body = _JSON_FORMS[row.request]
    if rest.reply == "json" and row.reply in _JSON_FORMS:
        reply = _JSON_FORMS[row.reply]
    return Op(rest.method, rest.path, rest.operation_id, row.summary,
              body if request is None else request, reply if response is None else response,
              rest.status, params=tuple(params), tag=rest.tag, response_media=media,
              headers=headers, body_required=rest.body is not None and body != "binary")
