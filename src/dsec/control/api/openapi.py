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

from dsec.control.api.types import ApiError

__all__ = ["Op", "Param", "build_openapi"]

Body = type | Literal["binary"] | None


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


_ERROR_CODES = {400: "bad input", 401: "missing or invalid API key",
                403: "role not sufficient", 404: "not found (or not visible to this key)",
                409: "conflict", 413: "body too large", 429: "rate limit or quota",
                503: "no capacity", 504: "request timeout"}


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
                   "schema": {"type": "string", "minLength": 1}}
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
            entry["requestBody"] = {"required": True, "content": content(op.request,
                                                                         "application/json")}
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
