"""The OpenAPI document and the server agree: the same routes and methods, a 405 with an
``Allow`` header for every method a path does not declare, and every pattern and limit
the document declares enforced by the server (schemathesis: requests that violate the
schema are refused with a 4xx, every answer is a documented status with a body that
matches its schema, undeclared methods answer 405)."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsec.cluster.local import LocalCluster

METHODS = ("GET", "PUT", "POST", "DELETE", "PATCH")


# The document and the routes agree whatever the store: one kind (schemathesis: ~15 s a run).
pytestmark = pytest.mark.store_kinds("sqlite")


@pytest.fixture(scope="module")
def cluster(module_cluster_store: str | None) -> Iterator[LocalCluster]:
    # a metrics token, so /metrics answers (and documents) 401 for a wrong one
    with LocalCluster(edges=1, store=module_cluster_store,
                      metrics_token="metrics-token-for-the-openapi-test") as cl:
        yield cl


@pytest.fixture(scope="module")
def doc(cluster: LocalCluster) -> dict[str, Any]:
    return dict(httpx.get(f"{cluster.url}/openapi.json").json())


def _concrete(path: str) -> str:
    """A request path for an OpenAPI path template (values matching the patterns)."""
    return (path.replace("/v1/sandboxes/{id}", "/v1/sandboxes/sb-000000000000-edge-0")
            .replace("/v1/snapshots/{id}", "/v1/snapshots/sha256:000000000000")
            .replace("/v1/keys/{id}", "/v1/keys/0000000000000000")
            .replace("/v1/sessions/{id}", "/v1/sessions/ses-0000000000000000")
            .replace("{path}", "default").replace("{ref}", "base"))


def test_the_document_lists_exactly_the_routes_the_server_serves(
        cluster: LocalCluster, doc: dict[str, Any]) -> None:
    from starlette.routing import Mount, Route, WebSocketRoute
    app = cluster.runtime.service and cluster.runtime._uvicorn.config.app.app
    served: set[tuple[str, str]] = set()
    for r in app.routes:
        if isinstance(r, WebSocketRoute):
            continue     # OpenAPI 3.0 has no WebSockets: docs/api.md describes the one
        if isinstance(r, Mount) and r.path == "/ui":
            continue     # the dashboard's HTML pages, not the API (docs/ui.md)
        assert isinstance(r, Route)
        if r.path == "/openapi.json":
            continue                         # the document does not describe itself
        path = re.sub(r"\{(\w+):path\}", r"{\1}", r.path)
        for m in r.methods or ():
            if m != "HEAD":
                served.add((path, m))
    declared = {(p, m.upper()) for p, ops in doc["paths"].items() for m in ops}
    assert served == declared


def _template_re(path: str) -> re.Pattern[str]:
    """A regex for an OpenAPI path template: ``{ref}``/``{path}`` span slashes (image
    refs, project paths), other parameters one segment."""
    out = ""
    for part in re.split(r"(\{\w+\})", path):
        if part.startswith("{"):
            out += ".+" if part in ("{ref}", "{path}") else "[^/]+"
        else:
            out += re.escape(part)
    return re.compile(out + "$")


def test_undeclared_methods_answer_405_with_allow(cluster: LocalCluster,
                                                  doc: dict[str, Any]) -> None:
    h = {"authorization": f"Bearer {cluster.api_key}"}
    templates = [(_template_re(p), {m.upper() for m in ops}) for p, ops in doc["paths"].items()]
    checked = 0
    for path in doc["paths"]:
        url = _concrete(path)
        # every template the concrete path matches (GET /v1/images/tag is getImage)
        allowed = set().union(*(ms for rx, ms in templates if rx.match(url)))
        expect = sorted(allowed | ({"HEAD"} if "GET" in allowed else set()))
        for m in METHODS:
            if m in allowed:
                continue
            r = httpx.request(m, cluster.url + url, headers=h)
            assert r.status_code == 405, (m, path, r.status_code, r.text)
            assert r.json()["code"] == "method_not_allowed"
            assert r.headers["allow"].split(", ") == expect, (m, path)
            checked += 1
    assert checked > 50


# Rejections the server may give a request that violates the document, besides the
# default list: 413 (a body past a route's limit) and 431 (a request line past the HTTP
# limits' 32 KiB, e.g. a path parameter of 4,096 multi-byte characters percent-encoded):
# both documented on every operation.
SCHEMATHESIS_TOML = """
[checks.negative_data_rejection]
expected-statuses = [400, 401, 403, 404, 405, 406, 409, 413, 415, 422, 428, 429, 431, "5XX"]
"""


def test_schemathesis_finds_the_server_and_the_document_in_agreement(
        cluster: LocalCluster, doc: dict[str, Any], tmp_path: Path) -> None:
    """Every operation, with positive and negative data (``--mode all``): the coverage
    phase (values on both sides of each declared bound and pattern, missing required
    parts, undeclared methods) and a bounded fuzzing phase (random schema-valid and
    schema-violating requests). Must find nothing: no 5xx, every violation refused with
    a 4xx, every answer a documented status with a body of its schema and media type,
    undeclared methods 405 (the /metrics token's 401 included)."""
    st = Path(sys.executable).with_name("schemathesis")
    (tmp_path / "schemathesis.toml").write_text(SCHEMATHESIS_TOML)
    checks = ("not_a_server_error,unsupported_method,negative_data_rejection,"
              "status_code_conformance,response_schema_conformance,"
              "content_type_conformance,response_headers_conformance")
    cmd = [str(st), "run", f"{cluster.url}/openapi.json",
           "-H", f"Authorization: Bearer {cluster.api_key}", "--checks", checks,
           "--phases", "coverage,fuzzing", "--mode", "all", "--max-examples", "6",
           "--seed", "1", "--no-color", "--workers", "1", "--generation-database", "none",
           # a watch streams until its directory goes away or its timeout_s: fuzzed
           # without one on a live sandbox it never ends (REST's watch is exercised in
           # tests/test_catalogue.py and tests/client/test_files.py)
           "--exclude-path", "/v1/sandboxes/{id}/files/watch",
           # likewise a run follows its process until it exits: a fuzzed one with stdin
           # kept open (or a terminal) never does (REST's run is exercised in
           # tests/test_catalogue.py and tests/client/test_processes.py)
           "--exclude-path", "/v1/sandboxes/{id}/processes/run"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path,
                       check=False)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    operations = sum(len(ops) for ops in doc["paths"].values()) - 2   # the watch, run
    assert re.search(rf"Tested: {operations}\b", out), out[-3000:]   # every operation ran
    assert "❌" not in out, out[-3000:]


def test_metrics_answers_401_to_a_wrong_token_as_documented(
        cluster: LocalCluster, doc: dict[str, Any]) -> None:
    entry = doc["paths"]["/metrics"]["get"]
    assert {"200", "401", "403"} <= set(entry["responses"])
    assert entry["security"] == [{}, {"metricsToken": []}]
    assert "text/plain" in entry["responses"]["200"]["content"]
    r = httpx.get(f"{cluster.url}/metrics", headers={"authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
    r = httpx.get(f"{cluster.url}/metrics",
                  headers={"authorization": "Bearer metrics-token-for-the-openapi-test"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")


def test_every_rest_row_of_the_catalogue_is_served_as_its_row_says(
        doc: dict[str, Any]) -> None:
    """The REST door and its document come from the operation catalogue: every row with
    a REST binding is one documented operation with the row's method, path, operation
    id, status and summary, and nothing else is (besides /healthz and /metrics)."""
    from dsec.wire.ops import REST_OPS
    declared = {(p, m.upper()): entry for p, ops in doc["paths"].items()
                for m, entry in ops.items()}
    rows = {(re.sub(r"\{(\w+):path\}", r"{\1}", op.rest.path), op.rest.method): op
            for op in REST_OPS if op.rest is not None}
    # besides /healthz, /metrics and the cluster membership routes (dsec.cluster.join:
    # joins by token and the superuser's token/node admin, REST only, no tenant's door)
    assert {k for k in set(declared) - set(rows) if not k[0].startswith("/v1/cluster/")
            } == {("/healthz", "GET"), ("/metrics", "GET")}
    assert set(rows) <= set(declared), sorted(set(rows) - set(declared))
    for key, op in rows.items():
        entry = declared[key]
        assert op.rest is not None
        assert entry["operationId"] == op.rest.operation_id, key
        assert entry["summary"] == op.summary, key
        assert str(op.rest.status) in entry["responses"], key


def test_each_operation_is_documented_from_its_row(doc: dict[str, Any]) -> None:
    """Parameters, body and reply of every REST operation come from its catalogue row:
    the query parameters are exactly the row's, required exactly when the request field
    has no default; the path parameters are the row's; a body is documented exactly
    when the row takes one, a reply exactly when the row answers one."""
    import msgspec

    from dsec.wire.ops import REST_OPS, path_params
    for op in REST_OPS:
        assert op.rest is not None
        path = re.sub(r"\{(\w+):path\}", r"{\1}", op.rest.path)
        entry = doc["paths"][path][op.rest.method.lower()]
        query = {p["name"]: p["required"] for p in entry["parameters"] if p["in"] == "query"}
        fields = {f.name: f for f in msgspec.structs.fields(op.request)}
        want = {param: fields[name].required for name, param in op.rest.query.items()}
        assert query == want, op.name
        assert {p["name"] for p in entry["parameters"] if p["in"] == "path"} == set(
            path_params(op.rest.path)), op.name
        assert ("requestBody" in entry) == (op.rest.body is not None
                                             or op.name in ("image_build", "image_import",
                                                            "file_write_stream")
                                             ), op.name
        ok = entry["responses"][str(op.rest.status)]
        assert ("content" in ok) == (op.rest.reply != "empty"), op.name
