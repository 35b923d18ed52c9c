"""dsec's E2B layer at the wire: E2B's control statuses and JSON error bodies, the
X-API-KEY / X-Access-Token rules, Connect-RPC's envelopes and error forms, and
``dsec up --e2b`` itself. (tests/e2b/test_sdk.py drives the same through the stock SDK.)"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time

import httpx
import pytest

from dsec import LocalCluster
from dsec.bench._e2b_calls import E2BTarget
from dsec.control.e2b import connect as rpc
from dsec.errors import InvalidArgument


def _env(obj: dict, flags: int = 0) -> bytes:  # type: ignore[type-arg]
    data = json.dumps(obj).encode()
    return struct.pack(">BI", flags, len(data)) + data


def _frames(body: bytes) -> list[tuple[int, dict]]:  # type: ignore[type-arg]
    out = []
    while body:
        flags, n = struct.unpack(">BI", body[:5])
        out.append((flags, json.loads(body[5:5 + n])))
        body = body[5 + n:]
    return out


def test_envelopes_round_trip_and_refuse_bad_framing() -> None:
    assert rpc.decode_envelope(_env({"a": 1}), limit=100) == {"a": 1}
    assert _frames(rpc.end_stream()) == [(2, {})]
    assert _frames(rpc.end_stream(("not_found", "x"))) == [
        (2, {"error": {"code": "not_found", "message": "x"}})]
    for bad in (b"\x00\x00", _env({"a": 1}, flags=1), _env({"a": 1})[:-1],
                _env({"a": "x" * 200}), struct.pack(">BI", 0, 2) + b"[]"):
        with pytest.raises(InvalidArgument):
            rpc.decode_envelope(bad, limit=100)


@pytest.fixture
def api(e2b_target: E2BTarget):  # type: ignore[no-untyped-def]
    with httpx.Client(base_url=e2b_target.url, timeout=30,
                      headers={"x-api-key": e2b_target.api_key}) as c:
        yield c


def _create(api: httpx.Client, **body: object) -> str:
    return str(_created(api, **body)["sandboxID"])


def _created(api: httpx.Client, **body: object) -> dict[str, str]:
    r = api.post("/v2/sandboxes", json={"templateID": "e2b-base", "timeout": 120, **body})
    assert r.status_code == 201, r.text
    got = r.json()
    key = api.headers["x-api-key"]
    # per-sandbox tokens, never the caller's key (red team 21, B8)
    assert got["envdVersion"] and got["envdAccessToken"].startswith("dse2b1.envd.")
    assert got["trafficAccessToken"].startswith("dse2b1.traffic.")
    assert key not in got["envdAccessToken"] + got["trafficAccessToken"]
    return got  # type: ignore[no-any-return]


def test_access_tokens_open_one_sandbox_and_one_door(
        api: httpx.Client, e2b_target: E2BTarget, e2b_cluster: LocalCluster) -> None:
    """The envd token works on its sandbox's envd (and code interpreter), the traffic
    token on its code interpreter only; neither on another sandbox, nor as an API key on
    the control REST or dsec's REST; a revoked key's tokens stop working."""
    a, b = _created(api), _created(api)
    url, sid = e2b_target.url, a["sandboxID"]
    try:
        def stat(sandbox: str, token: str) -> httpx.Response:
            return httpx.post(f"{url}/filesystem.Filesystem/Stat", json={"path": "/"},
                              headers={"e2b-sandbox-id": sandbox, "x-access-token": token})

        assert stat(sid, a["envdAccessToken"]).status_code == 200
        assert httpx.get(f"{url}/health", headers={
            "e2b-sandbox-id": sid, "x-access-token": a["envdAccessToken"]}
            ).status_code == 204
        r = stat(b["sandboxID"], a["envdAccessToken"])        # another sandbox
        assert r.status_code == 401 and "not valid for sandbox" in r.json()["message"]
        r = stat(sid, a["trafficAccessToken"])                # the traffic token: no envd
        assert r.status_code == 401 and "not accepted here" in r.json()["message"]
        code = {"e2b-sandbox-id": sid, "e2b-sandbox-port": "49999"}
        for tok in (a["trafficAccessToken"], a["envdAccessToken"]):
            r = httpx.get(f"{url}/contexts",
                          headers={**code, "e2b-traffic-access-token": tok})
            assert r.status_code == 200 and r.json() == [], r.text
        r = httpx.get(f"{url}/contexts", headers={
            **code, "e2b-sandbox-id": b["sandboxID"],
            "e2b-traffic-access-token": a["trafficAccessToken"]})
        assert r.status_code == 401
        for tok in (a["envdAccessToken"], a["trafficAccessToken"]):
            r = httpx.get(f"{url}/sandboxes", headers={"x-api-key": tok})
            assert r.status_code == 401 and "not an API key" in r.json()["message"]
            r = httpx.get(f"{e2b_cluster.url}/v1/sandboxes",
                          headers={"authorization": f"Bearer {tok}"})
            assert r.status_code == 401
        # GET /sandboxes/{id} answers the envd token too, not the key
        detail = api.get(f"/sandboxes/{sid}").json()
        assert detail["envdAccessToken"].startswith("dse2b1.envd.")
        assert stat(sid, detail["envdAccessToken"]).status_code == 200
        # a token is its key: revoked, the key's tokens stop working
        key = e2b_cluster.create_key(f"e2b-revoked-{os.getpid()}", "default", "member")
        kid = key.split("_")[1]
        with httpx.Client(base_url=url, timeout=30, headers={"x-api-key": key}) as other:
            c = _created(other)
        try:
            assert stat(c["sandboxID"], c["envdAccessToken"]).status_code == 200
            r = httpx.delete(f"{e2b_cluster.url}/v1/keys/{kid}",
                             headers={"authorization": f"Bearer {e2b_cluster.api_key}"})
            assert r.status_code == 204, r.text
            assert stat(c["sandboxID"], c["envdAccessToken"]).status_code == 401
        finally:
            api.delete(f"/sandboxes/{c['sandboxID']}")
    finally:
        api.delete(f"/sandboxes/{sid}")
        api.delete(f"/sandboxes/{b['sandboxID']}")


def test_control_statuses_and_error_bodies(api: httpx.Client, e2b_target: E2BTarget) -> None:
    sid = _create(api, metadata={"k": "v"})
    assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
    r = api.post(f"/sandboxes/{sid}/pause")
    assert r.status_code == 409 and r.json() == {
        "code": 409, "message": f"sandbox {sid} is already paused"}
    assert api.post(f"/v2/sandboxes/{sid}/connect", json={}).status_code == 201  # resumed
    assert api.post(f"/v2/sandboxes/{sid}/connect", json={}).status_code == 200
    assert api.post(f"/sandboxes/{sid}/timeout", json={"timeout": 0}).status_code == 400
    assert api.delete(f"/sandboxes/{sid}").status_code == 204
    for method, path in (("DELETE", f"/sandboxes/{sid}"), ("GET", f"/sandboxes/{sid}"),
                         ("POST", f"/sandboxes/{sid}/pause")):
        r = api.request(method, path)
        assert r.status_code == 404 and r.json()["code"] == 404, (method, r.text)
    r = api.post("/v2/sandboxes", json={"templateID": "e2b-base", "imagee": 1})
    assert r.status_code == 400 and "unknown field 'imagee'" in r.json()["message"]
    for bad, words in (({"autoPause": "yes"}, "autoPause must be true or false"),
                       ({"autoResume": True}, 'autoResume must be {"enabled"')):
        r = api.post("/v2/sandboxes", json={"templateID": "e2b-base", **bad})
        assert r.status_code == 400 and words in r.json()["message"], r.text
    r = api.get("/v2/sandboxes", params={"order": "asc", "nextToken": "k:x:y"})
    assert r.status_code == 400 and "nextToken is not one" in r.json()["message"]
    r = api.get("/v2/sandboxes", params={"order": "sideways"})
    assert r.status_code == 400 and "must be asc or desc" in r.json()["message"]
    r = api.post("/v2/sandboxes", json={"templateID": "no-such-image"})
    assert r.status_code == 404 and "no-such-image" in r.json()["message"]
    r = api.get("/v2/sandboxes", params={"startedAfter": "x"})
    assert r.status_code == 400 and "startedAfter" in r.json()["message"]
    r = api.get("/v2/sandboxes", params={"sortBy": "x"})
    assert r.status_code == 400 and "'sortBy' is not supported" in r.json()["message"]
    r = api.get("/templates")
    assert r.status_code == 501 and "not served by dsec's E2B layer" in r.json()["message"]
    r = httpx.get(f"{e2b_target.url}/v2/sandboxes")
    assert r.status_code == 401 and r.json()["code"] == 401
    # dsec's own Bearer form works too; a key of another project lists nothing of ours
    r = httpx.get(f"{e2b_target.url}/v2/sandboxes",
                  headers={"authorization": f"Bearer {e2b_target.stranger_key}"})
    assert r.status_code == 200 and r.json() == []


def test_envd_auth_and_connect_errors(api: httpx.Client, e2b_target: E2BTarget) -> None:
    sid = _create(api)
    try:
        url = e2b_target.url
        hdr = {"e2b-sandbox-id": sid, "e2b-sandbox-port": "49983"}
        stat = f"{url}/filesystem.Filesystem/Stat"
        r = httpx.post(stat, json={"path": "/"}, headers=hdr)             # no token
        assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
        r = httpx.post(stat, json={"path": "/"},
                       headers={**hdr, "x-access-token": e2b_target.stranger_key})
        assert r.status_code == 404 and r.json()["code"] == "not_found"   # not theirs
        r = httpx.post(stat, json={"path": "/"},
                       headers={**hdr, "x-access-token": e2b_target.reader_key})
        assert r.status_code == 200 and r.json()["entry"]["type"] == "FILE_TYPE_DIRECTORY"
        r = httpx.post(f"{url}/filesystem.Filesystem/MakeDir", json={"path": "/tmp/x"},
                       headers={**hdr, "x-access-token": e2b_target.reader_key})
        assert r.status_code == 403 and r.json()["code"] == "permission_denied"
        ok = {**hdr, "x-access-token": e2b_target.api_key}
        r = httpx.post(stat, json={"path": "/nope"}, headers=ok)
        assert r.status_code == 404 and r.json()["code"] == "not_found"
        r = httpx.post(f"{url}/process.Process/Start", headers={
            **ok, "content-type": "application/connect+json"}, content=_env({
                "process": {"cmd": "/bin/sh", "args": ["-c", "echo hi; exit 2"]}}))
        frames = _frames(r.content)
        assert r.status_code == 200 and frames[-1] == (2, {})
        assert "start" in frames[0][1]["event"]
        assert frames[-2][1]["event"]["end"]["exitCode"] == 2
        # an error inside a stream: still 200, the end-of-stream envelope carries it
        r = httpx.post(f"{url}/process.Process/Start", headers={
            **ok, "content-type": "application/connect+json"}, content=_env({
                "process": {"cmd": "/bin/sh"}}, flags=1))
        assert r.status_code == 200 and _frames(r.content)[-1][1]["error"]["code"] == \
            "invalid_argument"
        r = httpx.post(f"{url}/filesystem.Filesystem/Nope", json={}, headers=ok)
        assert r.status_code == 501 and r.json()["code"] == "unimplemented"
        r = httpx.get(f"{url}/health", headers=ok)
        assert r.status_code == 204
    finally:
        api.delete(f"/sandboxes/{sid}")
    r = httpx.get(f"{url}/health", headers=ok)
    assert r.status_code == 502 and "was not found" in r.json()["message"]


def test_dsec_up_e2b_serves_the_stock_sdk(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`dsec up --e2b` (a real process): the URL in local.json, the SDK against it."""
    from e2b import Sandbox
    state = str(tmp_path / "st")
    p = subprocess.Popen([sys.executable, "-c", "from dsec.cli.main import main; main()",
                          "up", "--state-dir", state, "--listen", "127.0.0.1:0", "--quiet",
                          "--e2b", "127.0.0.1:0"], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with open(os.path.join(state, "local.json")) as f:
                    local = json.load(f)
                if local["pid"] == p.pid:
                    break
            except (OSError, ValueError):
                pass
            assert p.poll() is None, p.stderr.read() if p.stderr else b""
            assert time.monotonic() < deadline, "dsec up --e2b did not start"
            time.sleep(0.05)
        opts = {"api_url": local["e2b"], "sandbox_url": local["e2b"],
                "api_key": local["api_key"]}
        sb = Sandbox.create("base", **opts)          # simulated backend: its base image
        assert sb.sandbox_id in [s.sandbox_id for s in Sandbox.list(**opts).next_items()]
        assert sb.kill() is True and Sandbox.kill(sb.sandbox_id, **opts) is False
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0


def test_gzip_inflation_is_bounded_and_checked() -> None:
    """A gzip bomb stops at max_upload (413) having inflated at most one piece past it;
    a cut or foreign stream is a 400."""
    import asyncio
    import gzip as gz

    from dsec.control.e2b.app import _INFLATE_PIECE, _Counted, _E2BError, _gunzip

    async def feed(data: bytes, limit: int) -> tuple[int, _E2BError | None]:
        async def src():  # type: ignore[no-untyped-def]
            for i in range(0, len(data), 65536):
                yield data[i:i + 65536]
        seen = 0
        try:
            async for piece in _Counted(_gunzip(src()), limit).chunks():
                assert len(piece) <= _INFLATE_PIECE
                seen += len(piece)
        except _E2BError as exc:
            return seen, exc
        return seen, None

    bomb = gz.compress(b"\0" * (64 << 20))            # 64 MiB of zeros in ~64 KiB
    seen, err = asyncio.run(feed(bomb, 4 << 20))
    assert err is not None and err.status == 413 and seen <= 4 << 20
    text = os.urandom(3000)
    assert asyncio.run(feed(gz.compress(text), 1 << 20)) == (3000, None)
    for bad, words in ((gz.compress(text)[:-20], "ended before its end"),
                       (b"not gzip at all", "not valid gzip"),
                       (gz.compress(text) * 2, "after the end")):
        _, err = asyncio.run(feed(bad, 1 << 20))
        assert err is not None and err.status == 400 and words in err.message, err


def test_gzip_upload_and_refused_encodings(api: httpx.Client, e2b_target: E2BTarget) -> None:
    import gzip as gz
    sid = _create(api)
    try:
        hdr = {"e2b-sandbox-id": sid, "x-access-token": e2b_target.api_key,
               "content-type": "application/octet-stream"}
        files = f"{e2b_target.url}/files"
        r = httpx.post(files, params={"path": "/tmp/g"}, content=gz.compress(b"x" * 9999),
                       headers={**hdr, "content-encoding": "gzip"})
        assert r.status_code == 200, r.text
        assert httpx.get(files, params={"path": "/tmp/g"}, headers=hdr).content == \
            b"x" * 9999
        r = httpx.post(files, params={"path": "/tmp/g"}, content=b"garbage",
                       headers={**hdr, "content-encoding": "gzip"})
        assert r.status_code == 400 and "not valid gzip" in r.json()["message"]
        assert httpx.get(files, params={"path": "/tmp/g"}, headers=hdr).content == \
            b"x" * 9999                          # a refused upload changed nothing
        r = httpx.post(files, params={"path": "/tmp/g"}, content=b"x",
                       headers={**hdr, "content-encoding": "br"})
        assert r.status_code == 400 and "'br' is not accepted" in r.json()["message"]
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_code_interpreter_port_at_the_wire(api: httpx.Client, e2b_target: E2BTarget) -> None:
    """Port 49999: auth, the context id's form, an unknown context, an image without
    python3 (the exact error), a language other than python."""
    sid = _create(api)
    try:
        url = e2b_target.url
        hdr = {"e2b-sandbox-id": sid, "e2b-sandbox-port": "49999"}
        r = httpx.post(f"{url}/execute", json={"code": "1"}, headers=hdr)
        assert r.status_code == 401
        ok = {**hdr, "e2b-traffic-access-token": e2b_target.api_key}
        r = httpx.post(f"{url}/execute", json={"code": "1"},
                       headers={**hdr, "x-access-token": e2b_target.stranger_key})
        assert r.status_code == 404                 # another project's: not found
        r = httpx.post(f"{url}/execute", json={"code": "1"}, headers=ok)
        assert r.status_code == 400 and "run_code needs python3" in r.json()["message"]
        r = httpx.post(f"{url}/execute", json={"code": "1", "language": "r"}, headers=ok)
        assert r.status_code == 400 and "language 'r' is not supported" in r.text
        r = httpx.post(f"{url}/execute", json={"code": "1", "context_id": "../../x"},
                       headers=ok)
        assert r.status_code == 400 and "is not one this layer made" in r.text
        r = httpx.post(f"{url}/contexts/ctx-0123456789abcdef/restart", headers=ok)
        assert r.status_code == 404 and "not found" in r.text
        assert httpx.get(f"{url}/contexts", headers=ok).json() == []
        # a sandbox process forging a context record names only a kernel of its own
        # sandbox; a malformed one is not listed
        httpx.post(f"{url}/files", params={"path": "/tmp/.dsec-e2b-contexts/ctx-"
                                           "0123456789abcdef.json"}, content=b"{nope",
                   headers={"e2b-sandbox-id": sid, "x-access-token": e2b_target.api_key,
                            "content-type": "application/octet-stream"})
        assert httpx.get(f"{url}/contexts", headers=ok).json() == []
    finally:
        api.delete(f"/sandboxes/{sid}")
