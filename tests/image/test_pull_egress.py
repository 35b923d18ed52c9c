"""The allowed-registries policy on every hop of a pull (red team F16, F6): redirects
and token realms that leave the allowed hosts are refused before they are contacted, a
name that resolves to an internal address is refused unless an operator listed it, and
the address checked is the one connected to. Real sockets on loopback, the real pull
into a real layer store; the only fake is the DNS answer (an injected resolver)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from dsec.errors import PermissionDenied
from dsec.image import LayerStore
from dsec.image.distribution import PinnedBackend
from dsec.image.egress import EgressPolicy
from dsec.image.localregistry import Entry, tar_entries, write_image
from dsec.image.pull import PullOptions, pull_image
from tests.image.registry_server import Listener, Registry

REPO = "team/app"


@pytest.fixture
def layout(tmp_path: object) -> str:
    lay = os.path.join(str(tmp_path), "layout")
    write_image(lay, "1", [tar_entries([Entry("etc", "dir"),
                                        Entry("etc/hello", data=b"hello\n")]),
                           tar_entries([Entry("app", "dir"), Entry("app/x", data=b"x" * 9000)])],
                {"Env": ["A=1"]})
    return lay


@pytest.fixture
def reg(layout: str) -> Iterator[Registry]:
    r = Registry(layout, REPO)
    try:
        yield r
    finally:
        r.close()


@pytest.fixture
def other(layout: str) -> Iterator[Registry]:
    r = Registry(layout, REPO)
    try:
        yield r
    finally:
        r.close()


@pytest.fixture
def trap() -> Iterator[Listener]:
    lst = Listener()
    try:
        yield lst
    finally:
        lst.close()


def _state(store: LayerStore) -> tuple[list[str], dict[str, str]]:
    return [m.digest for m in store.manifests()], store.refs()


def _opts(*registries: str, blob_hosts: tuple[str, ...] = (), **kw: object) -> PullOptions:
    return PullOptions(insecure=True, egress=EgressPolicy(registries=registries,
                                                          blob_hosts=blob_hosts), **kw)  # type: ignore[arg-type]


def test_a_blob_redirect_to_a_host_not_listed_is_refused_and_never_contacted(
        reg: Registry, trap: Listener, store: LayerStore) -> None:
    reg.redirect_blobs = f"http://{trap.host}"
    before = _state(store)
    with pytest.raises(PermissionDenied, match=rf"redirect of registry {reg.host}.*"
                       rf"{trap.host}.*neither an allowed registry nor an allowed blob host"):
        pull_image(store, f"{reg.host}/{REPO}:1", options=_opts(reg.host))
    assert trap.accepted == 0
    assert _state(store) == before
    # a redirect to the cloud metadata address: refused before any connection
    reg.redirect_blobs = "http://169.254.169.254/latest/meta-data"
    with pytest.raises(PermissionDenied, match="169.254.169.254"):
        pull_image(store, f"{reg.host}/{REPO}:1",
                   options=_opts(reg.host))


def test_a_redirect_to_a_listed_blob_host_is_followed_without_the_registry_credentials(
        reg: Registry, other: Registry, store: LayerStore) -> None:
    reg.redirect_blobs = other.url
    reg.token_realm = f"{reg.url}/token"
    reg.creds = ("puller", "pw-1")
    res = pull_image(store, f"{reg.host}/{REPO}:1",
                     options=_opts(reg.host, blob_hosts=(other.host,), creds="puller:pw-1"))
    assert len(res.layers) == 2
    blob_gets = [x for x in other.log if x[1].startswith("/blob/")]
    assert len(blob_gets) == 3                      # config + 2 layers, via the CDN
    # neither the bearer token nor the basic credentials went to the other host
    assert all("Authorization" not in h for _, _, h in other.log)
    token_gets = [h for _, p, h in reg.log if p.startswith("/token")]
    assert token_gets and all(h.get("Authorization", "").startswith("Basic ")
                              for h in token_gets)
    assert all(h.get("Authorization") == f"Bearer {reg.token}"
               for _, p, h in reg.log if p.startswith("/v2/") and "Authorization" in h)


def test_a_token_realm_on_a_host_not_listed_is_refused_and_gets_no_credentials(
        reg: Registry, trap: Listener, store: LayerStore) -> None:
    reg.token_realm = f"http://{trap.host}/token"
    before = _state(store)
    with pytest.raises(PermissionDenied, match=rf"token realm of registry {reg.host}.*"
                       rf"{trap.host}"):
        pull_image(store, f"{reg.host}/{REPO}:1",
                   options=_opts(reg.host, creds="puller:secret-pw"))
    assert trap.accepted == 0
    assert _state(store) == before


def test_a_name_resolving_to_an_internal_address_is_refused_unless_listed(
        reg: Registry, store: LayerStore) -> None:
    """F6: the ref names a host, DNS says loopback. The default policy refuses it at the
    address (never connected: the registry logs no request); an operator's list naming
    the host opens it."""
    calls: list[str] = []

    def resolve(host: str, port: int) -> list[str]:
        calls.append(host)
        return ["127.0.0.1"] if host == "registry.dsec-test.example" else []

    ref = f"registry.dsec-test.example:{reg.port}/{REPO}:1"
    with pytest.raises(PermissionDenied, match="resolves to 127.0.0.1, an internal address"):
        pull_image(store, ref, options=PullOptions(insecure=True, egress=EgressPolicy(),
                                                   resolve=resolve))
    assert reg.log == [] and calls == ["registry.dsec-test.example"]
    res = pull_image(store, ref, options=PullOptions(
        insecure=True, resolve=resolve,
        egress=EgressPolicy(registries=("registry.dsec-test.example:*",))))
    assert len(res.layers) == 2 and reg.log


def test_the_address_checked_is_the_address_connected(reg: Registry) -> None:
    """DNS rebinding: a name whose answer changes between the check and the connect.
    The backend resolves once per connection and connects to the address it checked;
    the socket layer never resolves the name again."""
    answers = [["127.0.0.1"], ["10.0.0.1"]]
    calls = 0

    def resolve(host: str, port: int) -> list[str]:
        nonlocal calls
        calls += 1
        return answers[min(calls - 1, 1)]

    policy = EgressPolicy(registries=("reg.example:*",))
    b = PinnedBackend(policy, what="test", resolve=resolve)
    s = b.connect_tcp("reg.example", reg.port, timeout=5)
    s.close()
    assert calls == 1 and b.connected == [("reg.example", "127.0.0.1", reg.port)]
    # the second answer (an address the policy refuses for a name it does not list)
    b2 = PinnedBackend(EgressPolicy(), what="test", resolve=lambda h, p: ["10.0.0.1"])
    with pytest.raises(PermissionDenied, match="10.0.0.1"):
        b2.connect_tcp("reg.example", reg.port, timeout=5)
    assert b2.connected == []


def test_policy_rules() -> None:
    p = EgressPolicy(registries=("reg.example.com", "127.0.0.1:5000"),
                     blob_hosts=("*.cdn.example.net",))
    p.check_registry("reg.example.com:443")
    with pytest.raises(PermissionDenied):
        p.check_registry("x.cdn.example.net")              # a blob host is no registry
    p.check_host("x.cdn.example.net", 443, what="hop")
    with pytest.raises(PermissionDenied):
        p.check_host("127.0.0.1", 5001, what="hop")
    import ipaddress
    p.check_address("127.0.0.1", 5000, ipaddress.ip_address("127.0.0.1"), what="hop")
    with pytest.raises(PermissionDenied):
        p.check_address("evil.example.org", 80, ipaddress.ip_address("169.254.169.254"),
                        what="hop")
    v6 = EgressPolicy(registries=("[::1]:5000", "[fd00::1]"))
    v6.check_registry("[::1]:5000")
    v6.check_registry("[fd00::1]:443")
    with pytest.raises(PermissionDenied):
        v6.check_registry("[::1]:5001")
    v6.check_host("::1", 5000, what="hop")
    v6.check_address("::1", 5000, ipaddress.ip_address("::1"), what="hop")
    d = EgressPolicy()
    for host in ("localhost", "127.0.0.1", "10.1.2.3", "[::1]", "169.254.169.254"):
        with pytest.raises(PermissionDenied):
            d.check_host(host.strip("[]"), 80, what="hop")
    with pytest.raises(PermissionDenied):                  # IPv4-mapped IPv6 loopback
        d.check_address("x.example", 80, ipaddress.ip_address("::ffff:127.0.0.1"), what="h")
    d.check_host("registry.example.com", 443, what="hop")
    d.check_address("registry.example.com", 443, ipaddress.ip_address("8.8.8.8"), what="h")


def test_docker_hub_refs_speak_to_its_api_host_under_their_own_name() -> None:
    """docker.io/library/python is served by registry-1.docker.io (docker's mapping);
    an operator's list naming docker.io covers that origin, nothing else."""
    import time

    from dsec.image.distribution import RegistryClient
    from dsec.image.registry import parse_registry_ref

    r = parse_registry_ref("docker.io/library/python:3.12")
    with RegistryClient(r, insecure=False, creds=None,
                        policy=EgressPolicy(registries=("docker.io",)), stall_s=5,
                        deadline=time.monotonic() + 5, timeout_s=5) as c:
        assert str(c.origin) == "https://registry-1.docker.io/"
        c._check(c.origin, "registry docker.io")                 # listed by its ref name
        import httpx
        with pytest.raises(PermissionDenied, match="auth.docker.io"):
            c._check(httpx.URL("https://auth.docker.io/token"), "the token realm")
