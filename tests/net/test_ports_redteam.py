"""Red team 14 on exposed ports (REDTEAM-14.md items 3, 4, 5; tests from branch rt14,
tests/redteam_net/test_ports_*.py, kept as regression tests): a real container sandbox
behind the apiserver's proxy, a real browser-like cookie jar (httpx), and the cluster's
own PortProxy.

- 3: every port is served from the apiserver's origin, so a sandbox's page must not set
  cookies (or any origin-wide header) there, and must run in an opaque origin
  (``Content-Security-Policy: sandbox``) so its script cannot read another port.
- 4: no spelling of the caller's API key the apiserver accepts reaches the sandbox.
- 5: one sandbox's (one tenant's) idle tunnels cannot make another's port answer 503;
  an idle tunnel is reclaimed.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from dsec.cluster.local import LocalCluster
from dsec.control.proxy import PortProxy
from tests.gcscan import live_instances

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

T = 20.0

EVIL = ("HTTP/1.1 200 OK\\r\\nContent-Type: text/html\\r\\n"
        "Set-Cookie: dsec_token=planted; Path=/v1/proxy/\\r\\n"
        "Set-Cookie: session=attacker; Path=/\\r\\n"
        "Set-Cookie2: old=1\\r\\n"
        "Clear-Site-Data: \\\"cookies\\\"\\r\\n"
        "Strict-Transport-Security: max-age=31536000\\r\\n"
        "Service-Worker-Allowed: /\\r\\n"
        "Access-Control-Allow-Origin: null\\r\\n"
        "Access-Control-Allow-Credentials: true\\r\\n"
        "Content-Length: 46\\r\\n\\r\\n"
        "<script>fetch('/v1/proxy/VICTIM/8000/')</script>")

SCRIPT_ONLY = ("HTTP/1.1 200 OK\\r\\nContent-Type: text/html\\r\\n"
               "Content-Length: 46\\r\\n\\r\\n"
               "<script>fetch('/v1/proxy/VICTIM/8000/')</script>")

REPLY = "HTTP/1.1 200 OK\\r\\nContent-Length: 2\\r\\n\\r\\nok"


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(edges=1, backend="container") as cl:
        yield cl


def _proxy(cluster: LocalCluster) -> PortProxy:
    svc = cluster.runtime.service
    found = [o for o in live_instances(PortProxy) if o.service is svc]
    assert len(found) == 1, found
    return found[0]


def _serve_raw(sb: object, port: int, reply: str, log: str = "/dev/null") -> None:
    """nc in a loop inside ``sb``, answering every connection with ``reply`` (printf
    escapes) and appending what arrived to ``log``."""
    r = sb.exec("setsid sh -c 'while true; do printf \"" + reply + "\" | "  # type: ignore[attr-defined]
                f"nc -l -p {port} >> {log}; done' >/dev/null 2>&1 &", timeout=10)
    assert r.exit_code == 0, r


def _read_until(sb: object, path: str, needle: str, timeout_s: float = 10.0) -> str:
    """The file at ``path`` inside ``sb`` once it holds ``needle`` (or as it is at the
    deadline: the caller asserts)."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen: str = sb.exec(f"cat {path}", timeout=10).stdout.decode(  # type: ignore[attr-defined]
            errors="replace")
        if needle in seen or time.monotonic() > deadline:
            return seen
        time.sleep(0.1)


def _httpd(sb: object, body: str, port: int = 8000) -> None:
    r = sb.exec(f"mkdir -p /tmp/w{port} && echo {body} > /tmp/w{port}/index.html && "  # type: ignore[attr-defined]
                f"httpd -p 127.0.0.1:{port} -h /tmp/w{port}", timeout=10)
    assert r.exit_code == 0, r


def _get_until_up(client: httpx.Client, url: str, **kw: object) -> httpx.Response:
    for _ in range(50):
        resp = client.get(url, **kw)  # type: ignore[arg-type]
        if resp.status_code == 200:
            return resp
        time.sleep(0.1)
    return resp


# ------------------------------------------------------------------ 3: one origin
def test_a_sandbox_page_sets_no_cookie_or_origin_wide_header_and_runs_sandboxed(
        cluster: LocalCluster) -> None:
    """rt14 test_ports_origin (1): the sandbox's Set-Cookie (and every other header that
    acts on the apiserver's whole origin) is dropped; the page carries CSP sandbox
    without allow-same-origin; the token cookie is scoped to the exact port path."""
    with cluster.client(protocol="http") as c:
        victim = c.sandboxes.create()
        evil = c.sandboxes.create()
        try:
            _httpd(victim, "victim-secret")
            _serve_raw(evil, 8000, EVIL.replace("VICTIM", victim.id))
            v = victim.ports.expose_info(8000)
            e = evil.ports.expose_info(8000)
            with httpx.Client(timeout=T) as browser:  # one cookie jar: one user's browser
                first = _get_until_up(browser, v.url)
                assert first.text == "victim-secret\n"
                page = _get_until_up(browser, e.url)
                assert page.status_code == 200 and "<script>" in page.text, page.text
                # the victim's cookie is still the real token (nothing planted over it)
                again = browser.get(v.url.split("?")[0])
                assert again.status_code == 200 and again.text == "victim-secret\n"
            cookies = page.headers.get_list("set-cookie")
            # the only cookie is the proxy's own token cookie, at exactly this port
            assert len(cookies) == 1, cookies
            assert cookies[0].startswith(f"dsec_token={e.token};"), cookies
            assert f"Path=/v1/proxy/{evil.id}/8000/;" in cookies[0], cookies
            assert first.headers["set-cookie"].count(f"Path=/v1/proxy/{victim.id}/8000/;")
            for h in ("set-cookie2", "clear-site-data", "strict-transport-security",
                      "service-worker-allowed", "access-control-allow-origin",
                      "access-control-allow-credentials"):
                assert h not in page.headers, (h, page.headers)
            csp = page.headers.get_list("content-security-policy")
            assert any(p.split()[0] == "sandbox" for p in csp), csp
            assert not any("allow-same-origin" in p for p in csp), csp
            # every answer through the proxy, not only HTML
            assert "sandbox" in first.headers["content-security-policy"]
        finally:
            victim.kill()
            evil.kill()


def test_a_sandbox_page_runs_in_an_opaque_origin(cluster: LocalCluster) -> None:
    """rt14 test_ports_origin (2): a page of sandbox E (another tenant's link) opened
    after sandbox V's: E's page is served with CSP sandbox (no allow-same-origin), so
    in a browser its script's origin is opaque: its fetch of V's port is cross-origin,
    goes without V's SameSite=Lax cookie and its answer is unreadable."""
    with cluster.client(protocol="http") as c:
        victim = c.sandboxes.create()
        evil = c.sandboxes.create()
        try:
            _httpd(victim, "victim-secret")
            _serve_raw(evil, 8001, SCRIPT_ONLY.replace("VICTIM", victim.id))
            v = victim.ports.expose_info(8000)
            e = evil.ports.expose_info(8001)
            with httpx.Client(timeout=T) as browser:
                assert _get_until_up(browser, v.url).text == "victim-secret\n"
                page = _get_until_up(browser, e.url)
                assert page.status_code == 200 and "<script>" in page.text, page.text
            csp = page.headers.get("content-security-policy", "")
            assert csp.split()[0] == "sandbox" and "allow-same-origin" not in csp, (
                f"sandbox {evil.id}'s page is served in the apiserver's origin (CSP {csp!r})")
        finally:
            victim.kill()
            evil.kill()


def test_a_service_worker_script_is_refused(cluster: LocalCluster) -> None:
    """A browser fetching a service-worker script (``Service-Worker: script``) through a
    port is refused: a worker on the apiserver's origin would see every port."""
    with cluster.client(protocol="http") as c:
        sb = c.sandboxes.create()
        try:
            _httpd(sb, "sw")
            url = sb.ports.expose(8000)
            assert _get_until_up(httpx.Client(timeout=T), url).status_code == 200
            r = httpx.get(url, headers={"service-worker": "script"}, timeout=T)
            assert r.status_code == 403 and "service worker" in r.text, r.text
        finally:
            sb.kill()


# ------------------------------------------------------------------ 4: credentials
@pytest.mark.parametrize("spelling", ["{key}", "Bearer  {key}", "bearer {key}",
                                      "BEARER   {key}", "Basic {key}"])
def test_no_spelling_of_the_api_key_reaches_the_sandbox(
        cluster: LocalCluster, spelling: str) -> None:
    """rt14 test_ports_cred_leak: an API key in any spelling the REST API accepts (and
    in any other Authorization scheme, and Proxy-Authorization, and a cookie) is removed
    before the request reaches the sandbox."""
    header = spelling.format(key=cluster.api_key)
    if not spelling.startswith("Basic"):
        # the apiserver takes this spelling as the caller's credential
        r = httpx.get(f"{cluster.url}/v1/sandboxes", headers={"authorization": header},
                      timeout=T)
        assert r.status_code == 200, r.text
    with cluster.client(protocol="http") as c:
        sb = c.sandboxes.create()
        try:
            _serve_raw(sb, 8002, REPLY, "/tmp/req")
            url = sb.ports.expose(8002)
            headers = {"authorization": header, "proxy-authorization": header,
                       "cookie": f"other={cluster.api_key}"}
            resp = _get_until_up(httpx.Client(timeout=T), url, headers=headers)
            assert resp.status_code == 200, resp.text
            # nc answers on connect, before it has read (and logged) the request: the
            # 200 can arrive first, so wait for the log (a fixed read was flaky under load)
            seen = _read_until(sb, "/tmp/req", "GET /")
            assert "GET /" in seen, seen
            # dsk_<16 hex>_<43 chars>: the secret may itself hold '_' (rsplit once
            # took its tail, a letter or two, found in any request: flaky)
            secret = cluster.api_key.split("_", 2)[2]
            assert len(secret) == 43, cluster.api_key
            assert secret not in seen, (
                f"the sandbox received the caller's API key ({spelling.format(key='dsk_…')}):"
                f"\n{seen}")
            assert "dsec_token" not in seen, seen
            # the key alone (no token) still opens the port: it was used, not forwarded
            plain = url.split("?")[0]
            r = httpx.get(plain, headers={"authorization": header}, timeout=T)
            assert r.status_code == (401 if spelling.startswith("Basic") else 200), r.text
        finally:
            sb.kill()


# ------------------------------------------------------------------ 5: starvation
def test_one_sandboxs_idle_tunnels_do_not_starve_another_sandboxs_port(
        cluster: LocalCluster) -> None:
    """rt14 test_ports_starve: CAP idle requests to the hog's port (a body announced and
    never sent) take only the hog's share; the calm sandbox's port answers, and the
    hog's refusals name the share that was hit. With the proxy's idle limit lowered, the
    held tunnels are reclaimed (504) and their places given back."""
    cap = 8
    proxy = _proxy(cluster)
    saved = (proxy.max_tunnels, proxy.idle_s)
    proxy.max_tunnels, proxy.idle_s = cap, 3.0
    with cluster.client(protocol="http") as c:
        hog = c.sandboxes.create()
        calm = c.sandboxes.create()
        held: list[socket.socket] = []
        try:
            _httpd(hog, "hog")
            _httpd(calm, "calm")
            hog_url, calm_url = hog.ports.expose(8000), calm.ports.expose(8000)
            assert _get_until_up(httpx.Client(timeout=T), calm_url).text == "calm\n"
            assert _get_until_up(httpx.Client(timeout=T), hog_url).text == "hog\n"
            host, port = cluster.url.removeprefix("http://").split(":")
            path = hog_url.removeprefix(cluster.url)
            for _ in range(cap):
                s = socket.create_connection((host, int(port)))
                s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n"
                          "Content-Length: 1000000\r\n\r\n".encode())
                held.append(s)
            time.sleep(1.0)
            r = httpx.get(calm_url, timeout=T)
            assert r.status_code == 200 and r.text == "calm\n", (
                f"another sandbox's idle tunnels ({cap}) starved {calm.id}'s port: "
                f"{r.status_code} {r.text[:200]}")
            sb_share = proxy.shares.limits()[0]
            assert proxy.shares.by_sandbox[hog.id] == sb_share < cap
            # the refused ones were told which share they hit
            refused, kept = [], []
            for s in held:
                s.settimeout(0.3)
                try:
                    refused.append(s.recv(4096).decode(errors="replace"))
                except TimeoutError:
                    kept.append(s)
            assert len(refused) == cap - sb_share and len(kept) == sb_share, refused
            assert all(" 429 " in x and f"sandbox '{hog.id}'" in x and
                       "proxy_tunnels_per_sandbox" in x for x in refused), refused
            assert all("content-security-policy: sandbox" in x.lower() for x in refused)
            # idle reclaim: the kept ones end with 504 once idle for idle_s, and their
            # places are given back
            for s in kept:
                s.settimeout(15)
                answer = b""
                while b"moved no byte" not in answer:
                    chunk = s.recv(4096)
                    if not chunk:
                        break
                    answer += chunk
                assert answer.startswith(b"HTTP/1.1 504") and b"proxy_idle_s" in answer, \
                    answer
            deadline = time.monotonic() + 5
            while proxy.shares.by_sandbox.get(hog.id, 0) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert proxy.shares.by_sandbox.get(hog.id, 0) == 0, proxy.shares
            assert httpx.get(hog_url, timeout=T).text == "hog\n"
        finally:
            proxy.max_tunnels, proxy.idle_s = saved
            for s in held:
                s.close()
            hog.kill()
            calm.kill()
