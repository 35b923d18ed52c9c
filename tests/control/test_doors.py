"""One set of rules at every door: each exec and file limit, sent past its bound through
REST, through the Aether gateway and to the edge directly (raw bodies, as an attacker
sends them: an ``ExecRequest`` past a limit cannot even be built, and neither the SDK nor
EdgeClient would send one), is refused by every door as a 4xx ``invalid_argument`` with
the very same message, which never echoes a large value. And a value at the bound passes
every door."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest

from dsec.aether import connect
from dsec.cluster.local import LocalCluster
from dsec.edge.service import EdgeClient
from dsec.errors import DsecError
from dsec.wire.spec import (
    MAX_ARG_BYTES,
    MAX_ARGV_BYTES,
    MAX_ARGV_ITEMS,
    MAX_CWD_BYTES,
    MAX_ENV_ITEMS,
    MAX_EXEC_TIMEOUT_S,
    MAX_OUTPUT_CAP_BYTES,
    MAX_PATH_BYTES,
    MAX_STDIN_BYTES,
    MAX_USER_BYTES,
    ExecRequest,
    ExecResult,
    FileInfo,
)


@pytest.fixture(scope="module")
def cluster(module_cluster_store: str | None) -> Iterator[LocalCluster]:
    with LocalCluster(edges=1, store=module_cluster_store) as cl:
        yield cl


@pytest.fixture(scope="module")
def sid(cluster: LocalCluster) -> str:
    r = httpx.post(f"{cluster.url}/v1/sandboxes", json={},
                   headers={"authorization": f"Bearer {cluster.api_key}"})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def _on_loop(cluster: LocalCluster, coro: Any) -> Any:
    return cluster._on_loop(coro, timeout=60)


Raw = dict[str, Any]


def _raw(**fields: Any) -> Raw:
    """An exec request body built field by field, never checked on this side."""
    return fields


def _rest_body(req: Raw) -> dict[str, Any]:
    body = dict(req)
    stdin = body.pop("stdin", None)
    if stdin is not None:
        body["stdin"] = base64.b64encode(stdin).decode()
        body["stdin_encoding"] = "base64"
    if "argv" in body and not body["argv"]:
        del body["argv"]
    return body


def _rest_answer(r: httpx.Response) -> tuple[str, int, str]:
    return ("rest", r.status_code, r.json().get("message", "") if r.status_code >= 400
            else "ok")


def _aether_doors(cluster: LocalCluster, op: str, gateway_body: Raw, edge_body: Raw,
                  reply: Any) -> list[tuple[str, int, str]]:
    """(door, status, message) of ``api.<op>`` at the gateway and ``edge.<op>`` at the
    edge itself, each sent as a raw body on a connection of its own."""
    async def one(door: str) -> tuple[str, int, str]:
        if door == "gateway":
            assert cluster.gateway is not None
            conn = await connect(cluster.gateway, token=cluster.api_key)
            method, body = f"api.{op}", gateway_body
        else:
            client = await EdgeClient.connect(f"unix:{cluster.state_dir}/edges/edge-0.sock")
            conn, method, body = client.conn, f"edge.{op}", edge_body
        try:
            await conn.call(method, body, response_type=reply, timeout=60)
            return door, 200, "ok"
        except DsecError as exc:
            return door, exc.http_status, exc.message
        finally:
            await conn.close()
    return [_on_loop(cluster, one("gateway")), _on_loop(cluster, one("edge"))]


def _doors_exec(cluster: LocalCluster, sid: str,
                req: Raw | ExecRequest) -> list[tuple[str, int, str]]:
    """(door, status-or-0, message) of an exec through REST, the gateway and the edge."""
    if isinstance(req, ExecRequest):
        req = msgspec.to_builtins(req)
        if "stdin" in req:
            req["stdin"] = base64.b64decode(req["stdin"])
    r = httpx.post(f"{cluster.url}/v1/sandboxes/{sid}/exec", json=_rest_body(req),
                   headers={"authorization": f"Bearer {cluster.api_key}"}, timeout=60)
    body = {"id": sid, "req": req}
    return [_rest_answer(r), *_aether_doors(cluster, "exec", body, body, ExecResult)]


def _same_refusal(results: list[tuple[str, int, str]], needle: str) -> None:
    statuses = {door: status for door, status, _ in results}
    messages = {door: msg for door, _, msg in results}
    assert set(statuses.values()) == {400}, results
    assert len(set(messages.values())) == 1, messages     # word for word, every door
    msg = next(iter(messages.values()))
    assert needle in msg, msg
    assert len(msg) < 400, f"the refusal echoes the value: {len(msg)} chars"


BIG = "a" * 100_000
# (name, request past the limit, needle of the message, request just at the limit)
EXEC_LIMITS: list[tuple[str, Raw, str, ExecRequest | None]] = [
    ("argv bytes", _raw(argv=("true",) + (BIG,) * 11), f"{MAX_ARGV_BYTES}-byte limit",
     ExecRequest(argv=("true",) + (BIG,) * 10)),
    ("one argument", _raw(argv=("true", "a" * (MAX_ARG_BYTES + 1))),
     f"argv[1] is {MAX_ARG_BYTES + 1} bytes", ExecRequest(argv=("true", "a" * MAX_ARG_BYTES))),
    ("shell string", _raw(shell="#" + "a" * MAX_ARG_BYTES),
     f"shell is {MAX_ARG_BYTES + 1} bytes", None),
    ("argv count", _raw(argv=("true",) + ("a",) * MAX_ARGV_ITEMS),
     f"argv has {MAX_ARGV_ITEMS + 1} entries",
     ExecRequest(argv=("true",) + ("a",) * (MAX_ARGV_ITEMS - 1))),
    ("NUL in argv", _raw(argv=("echo", "a\0b")), "argv[1] contains a NUL", None),
    ("env count", _raw(argv=("true",), env={f"K{i}": "" for i in range(
        MAX_ENV_ITEMS + 1)}), f"env has {MAX_ENV_ITEMS + 1} entries", None),
    ("env bytes", _raw(argv=("true",), env={f"K{i}": BIG for i in range(11)}),
     "argv+env is", None),
    ("env name", _raw(argv=("true",), env={"A=B": "c"}), "env name 'A=B'", None),
    ("stdin", _raw(argv=("true",), stdin=b"x" * (MAX_STDIN_BYTES + 1)),
     f"stdin is {MAX_STDIN_BYTES + 1} bytes", ExecRequest(argv=("true",),
                                                          stdin=b"x" * MAX_STDIN_BYTES)),
    ("cwd", _raw(argv=("true",), cwd="/" + "d" * MAX_CWD_BYTES),
     f"cwd is {MAX_CWD_BYTES + 1} bytes", None),
    ("user", _raw(argv=("true",), user="u" * (MAX_USER_BYTES + 1)),
     f"user is {MAX_USER_BYTES + 1} bytes", None),
    ("output cap", _raw(argv=("true",), output_cap_bytes=MAX_OUTPUT_CAP_BYTES + 1),
     "output_cap_bytes=1073741825 must be within", ExecRequest(
         argv=("true",), output_cap_bytes=MAX_OUTPUT_CAP_BYTES)),
    ("timeout zero", _raw(argv=("true",), timeout_s=0.0), "timeout_s=0.0 must be", None),
    ("timeout huge", _raw(argv=("true",), timeout_s=MAX_EXEC_TIMEOUT_S + 1),
     f"up to {MAX_EXEC_TIMEOUT_S:g}", ExecRequest(argv=("true",), timeout_s=MAX_EXEC_TIMEOUT_S)),
    ("neither argv nor shell", _raw(), "exactly one of argv", None),
]


@pytest.mark.store_kinds("sqlite")   # limits of the doors, whatever the store
@pytest.mark.parametrize("name,bad,needle,ok", EXEC_LIMITS, ids=[x[0] for x in EXEC_LIMITS])
def test_every_exec_limit_is_the_same_at_every_door(
        cluster: LocalCluster, sid: str, name: str, bad: Raw, needle: str,
        ok: ExecRequest | None) -> None:
    _same_refusal(_doors_exec(cluster, sid, bad), needle)
    if ok is not None:
        assert [s for _, s, _ in _doors_exec(cluster, sid, ok)] == [200, 200, 200], name


def _doors_read(cluster: LocalCluster, sid: str, path: str,
                rest: bool = True) -> list[tuple[str, int, str]]:
    out: list[tuple[str, int, str]] = []
    if rest:
        out.append(_rest_answer(httpx.get(
            f"{cluster.url}/v1/sandboxes/{sid}/files/stat", params={"path": path},
            headers={"authorization": f"Bearer {cluster.api_key}"}, timeout=60)))
    body = {"id": sid, "path": path}
    return [*out, *_aether_doors(cluster, "stat", body, body, FileInfo)]


def test_a_70000_character_path_is_a_short_4xx_at_every_door(cluster: LocalCluster,
                                                            sid: str) -> None:
    # (no HTTP client sends a 70 kB URL: REST gets one just past the limit)
    _same_refusal(_doors_read(cluster, sid, "/" + "p" * 70_000, rest=False),
                  f"path is 70001 bytes long, over the {MAX_PATH_BYTES}-byte limit")
    _same_refusal(_doors_read(cluster, sid, "/" + "p" * MAX_PATH_BYTES),
                  f"path is {MAX_PATH_BYTES + 1} bytes long, over the {MAX_PATH_BYTES}")
    _same_refusal(_doors_read(cluster, sid, "/tmp/a\0b"), "contains a NUL character")
    # at the limit: an ordinary answer (here: no such file), not a refusal of the path
    at_limit = [s for _, s, _ in _doors_read(cluster, sid, "/" + "p" * (MAX_PATH_BYTES - 1))]
    assert at_limit == [404, 404, 404]


def test_every_file_operation_checks_the_path_at_the_gateway_and_the_edge(
        cluster: LocalCluster, sid: str) -> None:
    long = "/" + "q" * 70_000

    async def run() -> list[str]:
        assert cluster.gateway is not None
        conn = await connect(cluster.gateway, token=cluster.api_key)
        edge = await EdgeClient.connect(f"unix:{cluster.state_dir}/edges/edge-0.sock")
        k = {"id": sid, "path": long}
        calls = [conn.call("api.read_file", k), conn.call("api.write_file", {**k, "data": b""}),
                 conn.call("api.list_dir", k), conn.call("api.mkdir", k),
                 conn.call("api.remove", k),
                 *(edge.conn.call(f"edge.{op}", body) for op, body in (
                     ("read_file", {"id": sid, "path": long}),
                     ("write_file", {"id": sid, "path": long, "data": b""}),
                     ("list_dir", {"id": sid, "path": long}),
                     ("mkdir", {"id": sid, "path": long}),
                     ("remove", {"id": sid, "path": long})))]
        try:
            res = await asyncio.gather(*calls, return_exceptions=True)
        finally:
            await conn.close()
            await edge.close()
        return [f"{type(r).__name__}: {getattr(r, 'message', r)}" for r in res]
    for line in _on_loop(cluster, run()):
        assert line.startswith("InvalidArgument: path is 70001 bytes long"), line
        assert len(line) < 300, line


@pytest.mark.store_kinds("sqlite")   # bodies through the doors, whatever the store (~10 s)
def test_file_sizes_a_door_accepts_arrive_whole(cluster: LocalCluster, sid: str) -> None:
    """REST takes 256 MiB uploads, but the apiserver's link to the edge (and the
    gateway) carry 16 MiB frames: a 20 MiB file used to fail half way with an internal
    'edge.write_file ... max_frame' 413. Contents now travel in 8 MiB pieces."""
    from dsec.wire.spec import FILE_CHUNK_BYTES, MAX_FILE_READ_BYTES
    big = bytes(range(256)) * ((20 << 20) // 256) + b"tail"
    h = {"authorization": f"Bearer {cluster.api_key}"}
    r = httpx.put(f"{cluster.url}/v1/sandboxes/{sid}/files", params={"path": "/tmp/big"},
                  content=big, headers=h, timeout=120)
    assert r.status_code == 204, r.text
    r = httpx.get(f"{cluster.url}/v1/sandboxes/{sid}/files", params={"path": "/tmp/big"},
                  headers=h, timeout=120)
    assert r.status_code == 200 and r.content == big
    part = httpx.get(f"{cluster.url}/v1/sandboxes/{sid}/files",
                     params={"path": "/tmp/big", "offset": FILE_CHUNK_BYTES - 3,
                             "length": 10}, headers=h).content
    assert part == big[FILE_CHUNK_BYTES - 3:FILE_CHUNK_BYTES + 7]
    for transport in ("aether", "http"):
        with cluster.client(protocol=transport, session_lease_s=None) as c:
            sb = c.sandboxes.get(sid)
            sb.files.write(f"/tmp/{transport}", big)
            assert sb.files.read(f"/tmp/{transport}") == big
            sb.files.write(f"/tmp/{transport}", b"!", append=True)
            assert sb.files.stat(f"/tmp/{transport}").size == len(big) + 1
    # past the one-read limit: a clear 413 (offset/length read it in parts)
    huge = b"z" * (MAX_FILE_READ_BYTES + 1)
    assert httpx.put(f"{cluster.url}/v1/sandboxes/{sid}/files", params={"path": "/tmp/huge"},
                     content=huge, headers=h, timeout=300).status_code == 204
    r = httpx.get(f"{cluster.url}/v1/sandboxes/{sid}/files", params={"path": "/tmp/huge"},
                  headers=h, timeout=300)
    assert r.status_code == 413 and "offset/length" in r.json()["message"], r.text
    r = httpx.get(f"{cluster.url}/v1/sandboxes/{sid}/files",
                  params={"path": "/tmp/huge", "offset": MAX_FILE_READ_BYTES}, headers=h)
    assert r.status_code == 200 and r.content == b"z"


# ------------------------------------------------------- one answer, whatever the door
def _rest(cluster: LocalCluster, method: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.request(method, f"{cluster.url}{path}", timeout=60,
                         headers={"authorization": f"Bearer {cluster.api_key}"}, **kw)


def _gw(cluster: LocalCluster, method: str, body: dict[str, Any], rtype: Any) -> Any:
    """One raw gateway call (no SDK), acting with the cluster's admin key."""
    async def run() -> Any:
        assert cluster.gateway is not None
        conn = await connect(cluster.gateway, token=cluster.api_key)
        try:
            return await conn.call(method, body,
                                   response_type=rtype, timeout=60)
        finally:
            await conn.close()
    return _on_loop(cluster, run())


def test_info_is_one_answer_at_every_door(cluster: LocalCluster) -> None:
    """``/v1/info`` and ``api.info`` used to be built apart: the gateway's said a
    hard-coded version and no gateway address, so an SDK asking it could not tell."""
    from dsec.wire.api import Info
    rest = msgspec.json.decode(_rest(cluster, "GET", "/v1/info").content, type=Info)
    gw = _gw(cluster, "api.info", {}, Info)
    assert rest.gateway == cluster.gateway and rest.gateway is not None
    assert gw == rest


def test_stats_at_every_door(cluster: LocalCluster, sid: str) -> None:
    """A sandbox's resource use was served by the edge only: no REST route, no gateway
    method, no SDK call."""
    from dsec.wire.spec import SandboxStats
    # something to measure (the simulated backend's memory is its files' bytes), so the
    # test does not lean on what the tests before it wrote
    with cluster.client(session_lease_s=None) as c:
        c.sandboxes.get(sid).files.write("/workspace/stats-probe", b"x" * 100)
    r = _rest(cluster, "GET", f"/v1/sandboxes/{sid}/stats")
    assert r.status_code == 200, r.text
    rest = msgspec.json.decode(r.content, type=SandboxStats)
    gw = _gw(cluster, "api.stats", {"id": sid}, SandboxStats)
    for st in (rest, gw):
        assert st.memory_bytes > 0 and st.pids >= 1, st
    for transport in ("aether", "http"):
        with cluster.client(protocol=transport, session_lease_s=None) as c:
            st = c.sandboxes.get(sid).stats()
            assert isinstance(st, SandboxStats) and st.memory_bytes > 0
    # an id no sandbox has: the same 404 as for another project's (ids never leak)
    assert _rest(cluster, "GET", "/v1/sandboxes/sb-000000000000-edge-0/stats"
                 ).status_code == 404


def test_mkdir_parents_is_honoured_at_every_door(cluster: LocalCluster, sid: str) -> None:
    """REST forced ``parents=True`` while the gateway and the edge honoured it."""
    r = _rest(cluster, "POST", f"/v1/sandboxes/{sid}/files/mkdir",
              params={"path": "/tmp/np-rest/a/b", "parents": "false"})
    assert r.status_code == 404, r.text
    assert "parent of /tmp/np-rest/a/b does not exist" in r.json()["message"]
    with pytest.raises(DsecError, match="parent of /tmp/np-gw/a/b does not exist"):
        _gw(cluster, "api.mkdir", {"id": sid, "path": "/tmp/np-gw/a/b", "parents": False},
            None)
    assert _rest(cluster, "POST", f"/v1/sandboxes/{sid}/files/mkdir",
                 params={"path": "/tmp/np-rest/a/b"}).status_code == 204   # default: parents
    for transport in ("aether", "http"):
        with cluster.client(protocol=transport, session_lease_s=None) as c:
            sb = c.sandboxes.get(sid)
            with pytest.raises(DsecError, match="does not exist"):
                sb.files.mkdir(f"/tmp/np-{transport}/x/y", parents=False)
            sb.files.mkdir(f"/tmp/np-{transport}/x/y")
            assert sb.files.stat(f"/tmp/np-{transport}/x/y").type == "dir"


def test_replies_have_one_shape_at_every_door(cluster: LocalCluster, sid: str) -> None:
    """``events``, ``list_dir`` and ``nodes`` answered a bare list through the gateway and
    an ``{"items": [...]}`` record through REST: one record type per reply now."""
    from dsec.wire.api import EventList, FileList, NodeList
    for method, path, body, rtype in (
            ("api.events", f"/v1/sandboxes/{sid}/events", {"id": sid}, EventList),
            ("api.list_dir", f"/v1/sandboxes/{sid}/files/list?path=/",
             {"id": sid, "path": "/"}, FileList),
            ("api.nodes", "/v1/nodes", {}, NodeList)):
        rest = msgspec.json.decode(_rest(cluster, "GET", path).content, type=rtype)
        gw = _gw(cluster, method, body, rtype)
        assert type(gw) is rtype and gw.items, (method, gw)
        if rtype is not NodeList:   # nodes carry live usage figures that move
            assert gw == rest, method


def test_the_gateway_takes_the_key_once_per_connection(cluster: LocalCluster,
                                                        sid: str) -> None:
    """The API key rides on the connection (``aether.auth``), not in every body: a body
    naming one is refused like any unknown field, and a key revoked while its connection
    is open stops working on that connection's next call."""
    from dsec.wire.api import Info
    r = _rest(cluster, "POST", "/v1/keys", json={"name": "gw-once", "project": "default",
                                                  "role": "member"})
    assert r.status_code == 201, r.text
    key, key_id = r.json()["api_key"], r.json()["key_id"]

    async def run() -> list[str]:
        assert cluster.gateway is not None
        conn = await connect(cluster.gateway, token=key)
        out = []
        try:
            for body in ({"id": sid, "key": key}, {"id": sid}):
                try:
                    await conn.call("api.get", body, timeout=30)
                    out.append("ok")
                except DsecError as exc:
                    out.append(f"{exc.code}: {exc.message}")
            info = await conn.call("api.info", {}, response_type=Info, timeout=30)
            out.append(f"principal {info.principal}")
            async with httpx.AsyncClient() as http:   # (this loop serves the apiserver)
                r = await http.delete(f"{cluster.url}/v1/keys/{key_id}", headers={
                    "authorization": f"Bearer {cluster.api_key}"})
                assert r.status_code == 204, r.text
            try:
                await conn.call("api.get", {"id": sid}, timeout=30)
                out.append("ok")
            except DsecError as exc:
                out.append(exc.code)
        finally:
            await conn.close()
        return out
    unknown, ok, who, revoked = _on_loop(cluster, run())
    assert unknown.startswith("invalid_argument") and "key" in unknown, unknown
    assert ok == "ok" and who.startswith("principal ") and revoked == "unauthenticated"


def test_batches_are_one_request_at_both_doors(cluster: LocalCluster, sid: str) -> None:
    """``create_many``/``exec_many`` were gateway-only (the SDK over REST sent one
    request per item): both doors now take one request and answer one ``Batch``, an
    outcome per item in order, a failed item as its error in place."""
    from dsec.wire.outcome import Batch
    from dsec.wire.spec import SandboxInfo
    ghost = "sb-000000000000-edge-0"
    calls = [{"id": sid, "req": {"argv": ["echo", "hi"]}}, {"id": ghost,
                                                            "req": {"argv": ["true"]}}]
    r = _rest(cluster, "POST", "/v1/batch/exec", json={"calls": calls})
    assert r.status_code == 200, r.text
    # each item in /exec's JSON form (wire.jsonform), as the SDK reads it
    from dsec.wire.jsonform import from_json
    assert msgspec.json.decode(r.content)["items"][0]["value"]["stdout"] == "hi\n"
    rest = from_json(msgspec.json.decode(r.content), Batch[ExecResult]).results()
    gw = _gw(cluster, "api.exec_many", {"calls": calls}, Batch[ExecResult]).results()
    for got in (rest, gw):
        assert isinstance(got[0], ExecResult) and got[0].stdout == b"hi\n", got
        assert isinstance(got[1], DsecError) and got[1].code == "sandbox_not_found", got
    assert str(rest[1]) == str(gw[1])                       # the same words
    r = _rest(cluster, "POST", "/v1/batch/create",
              json={"items": [{"labels": {"b": "1"}}, {"cpu_milli": 0}]})
    assert r.status_code == 200, r.text
    made, bad = msgspec.json.decode(r.content, type=Batch[SandboxInfo]).results()
    assert isinstance(made, SandboxInfo) and made.spec.labels["b"] == "1"
    assert isinstance(bad, DsecError) and bad.code == "invalid_argument"
    assert _rest(cluster, "DELETE", f"/v1/sandboxes/{made.id}").status_code == 204
    with cluster.client(protocol="http", session_lease_s=None) as c:
        res = c.sandboxes.exec_many([(sid, "echo a"), (ghost, "true")],
                                    return_exceptions=True)
        assert isinstance(res[0], ExecResult) and res[0].stdout == b"a\n"
        assert isinstance(res[1], DsecError)
        two = c.sandboxes.create_many(2, labels={"many": "http"})
        assert len(two) == 2 and all(s.info.spec.labels["many"] == "http" for s in two)
        for s in two:
            s.kill()


def test_a_spec_env_or_labels_past_their_limits_are_refused_at_every_door(
        cluster: LocalCluster) -> None:
    """A sandbox's env rides along with every exec: a 600 kB one was accepted by every
    door, and then every exec in that sandbox failed with E2BIG. Labels had no count limit
    and were checked only by REST's create. Both are rules of SandboxSpec now."""
    from dsec.wire.spec import MAX_LABELS, MAX_SPEC_ENV_BYTES, SandboxInfo

    big_env = {f"K{i}": "v" * 100_000 for i in range(6)}
    many_labels = {f"k{i}": "" for i in range(MAX_LABELS + 1)}

    def doors(fields: Raw) -> list[tuple[str, int, str]]:
        spec = {"backend": "simulated", **fields}
        return [_rest_answer(_rest(cluster, "POST", "/v1/sandboxes", json=fields)),
                *_aether_doors(cluster, "create", {"spec": spec},
                               {"spec": {**spec, "project": "default"}}, SandboxInfo)]

    _same_refusal(doors({"env": big_env}),
                  f"over the {MAX_SPEC_ENV_BYTES}-byte limit")
    _same_refusal(doors({"labels": many_labels}),
                  f"has {MAX_LABELS + 1} entries, over the limit of {MAX_LABELS}")
