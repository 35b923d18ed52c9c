"""OpenAPI 3.1 document generated from the route table and the msgspec wire types.

Nothing here is hand-written JSON schema: every body schema comes from
``msgspec.json.schema_components`` over the same structs the server decodes with, so the
document cannot drift from what the server accepts. The route table (:data:`Op`) carries
what msgspec cannot know: method, path, query parameters and status codes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from dsec.control.api.types import PROJECT_PATTERN, SNAPSHOT_PATTERN, ApiError
from dsec.edge.spec import MAX_PATH_BYTES

__all__ = ["FILE_PATH", "IDEMPOTENCY_KEY", "KEY_ID", "PROJECT_PATH", "SANDBOX_ID",
           "SESSION_ID", "SNAPSHOT_ID", "Op", "Param", "build_openapi", "path_param_schema"]

Body = type | Literal["binary"] | None

# Patterns and limits the server enforces on identifiers and paths, as JSON schema. The
# server's own checks are dsec.ids (parse_sandbox_id, parse_project_path), the shared
# exec/path validators in dsec.edge.spec and the IAM rules; tests/control/test_openapi.py
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


def path_param_schema(path: str, name: str) -> dict[str, Any]:
    """The schema of path parameter ``name`` of route ``path`` (by what it names)."""
    if name == "path":
        return PROJECT_PATH
    if name == "port":
        return {"type": "integer", "minimum": 1, "maximum": 65535}
    for prefix, schema in (("/v1/sandboxes/", SANDBOX_ID), ("/v1/snapshots/", SNAPSHOT_ID),
                           ("/v1/keys/", KEY_ID), ("/v1/sessions/", SESSION_ID)):
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


_ERROR_CODES = {400: "bad input", 401: "missing or invalid API key",
                403: "role not sufficient", 404: "not found (or not visible to this key)",
                409: "conflict", 413: "body too large", 429: "rate limit or quota",
                503: "no capacity, or a node the request needs is unreachable (retry)",
                504: "request timeout"}


def build_openapi(ops: list[Op], *, version: str) -> dict[str, Any]:
    types: list[Any] = [ApiError]
    for op in ops:
        for t in (op.request, op.response):
            if isinstance(t, type) or (t is not None and t != "binary"):
                types.append(t)
    schemas, components = msgspec.json.schema_components(
        types, ref_template="#/components/schemas/{name}")
    ref = dict(zip([id(t) for t in types], schemas))

    def content(t: Body, media: str) -> dict[str, Any]:
        if t == "binary":
            return {"application/octet-stream": {"schema": {"type": "string",
                                                            "format": "binary"}}}
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
            if code in (401, 403) and not op.auth:
                continue
            responses[str(code)] = {"description": what,
                                    "content": {"application/json": {"schema": ref[id(ApiError)]}}}
        entry: dict[str, Any] = {"operationId": op.operation_id, "summary": op.summary,
                                 "tags": [op.tag], "parameters": params,
                                 "responses": responses}
        if op.request is not None:
            entry["requestBody"] = {"required": op.body_required,
                                    "content": content(op.request, "application/json")}
        if not op.auth:
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
                                           "description": "dsk_<id>_<secret> API key"}},
        },
        "security": [{"apiKey": []}],
    }


def _path_params(path: str) -> list[Param]:
    out = []
    for seg in path.split("/"):
        if seg.startswith("{") and seg.endswith("}"):
            out.append(Param(seg[1:-1].removesuffix(":path"), {"type": "string"}, True))
    return out
