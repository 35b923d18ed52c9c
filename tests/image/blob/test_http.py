"""The HTTP backend against Debian's nginx on loopback: Range reads checked to the byte,
WebDAV PUT/DELETE, and faults - 5xx, cut and corrupted bodies, a hung server, the server
killed mid-read."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time

import pytest

from dsec.errors import (
    BlobNotFound,
    BlobUnavailable,
    InvalidArgument,
    PermissionDenied,
    RemoteProtocolError,
)
from dsec.image.blob import BlobStore, open_blobstore
from dsec.image.blob.file import FileBlobStore
from dsec.image.blob.http import HttpBlobStore
from dsec.image.blob.retry import RetryPolicy
from dsec.image.chunks import build_chunk_table, verify_chunk
from tests.image.blob.servers import Fault, FaultProxy, Nginx

FAST = RetryPolicy(attempts=4, initial_s=0.01, max_s=0.05, deadline_s=5.0)


def test_put_then_exact_ranges(http_dir: tuple[str, str]) -> None:
    d, url = http_dir
    store = open_blobstore(url)
    assert isinstance(store, BlobStore)
    data = os.urandom(600_000)
    assert store.head("layers/sha256/a") is None
    store.put_bytes("layers/sha256/a", data)           # WebDAV PUT, full path created
    with open(os.path.join(d, "layers/sha256/a"), "rb") as f:
        assert f.read() == data
    assert store.head("layers/sha256/a") == len(data)
    assert store.get_range("layers/sha256/a", 262144, 262144) == data[262144:524288]
    assert store.get_range("layers/sha256/a", 0, 0) == b""
    with pytest.raises(InvalidArgument, match="past its end"):     # clipped 206
        store.get_range("layers/sha256/a", 599_990, 20)
    with pytest.raises(InvalidArgument, match="past its end"):     # 416
        store.get_range("layers/sha256/a", 700_000, 20)
    with pytest.raises(BlobNotFound):
        store.get_range("layers/sha256/b", 0, 1)
    store.delete("layers/sha256/a")
    store.delete("layers/sha256/a")
    assert store.head("layers/sha256/a") is None


def test_serves_what_a_file_store_published(http_dir: tuple[str, str],
                                            tmp_path: os.PathLike[str]) -> None:
    """The usual deployment: push to a directory (file://, NFS), nginx serves it."""
    d, url = http_dir
    FileBlobStore(root=d, group="nogroup").put_bytes("x/y", b"hello world")
    src = os.path.join(str(tmp_path), "src")
    with open(src, "wb") as f:
        f.write(os.urandom(3 << 20))
    store = open_blobstore(url)
    store.put_file("up/big", src)    # a directory nginx (user nobody) creates itself
    with open(src, "rb") as f:
        want = f.read()
    assert store.get_range("up/big", (3 << 20) - 5, 5) == want[-5:]
    assert store.get_range("x/y", 6, 5) == b"world"


def test_url_refuses_credentials() -> None:
    with pytest.raises(InvalidArgument, match="DSEC_BLOB_TOKEN"):
        open_blobstore("http://u:p@127.0.0.1:1/x")
    with pytest.raises(InvalidArgument, match="DSEC_BLOB_TOKEN"):
        open_blobstore("http://127.0.0.1:1/x?token=abc")


def test_read_only_server_says_so(tmp_path: os.PathLike[str]) -> None:
    prefix = tempfile.mkdtemp(prefix="dsec-nginx-ro-")
    ro = Nginx(prefix, dav=False)
    try:
        with open(os.path.join(ro.root, "k"), "wb") as f:
            f.write(b"0123456789")
        store = open_blobstore(ro.url)
        assert store.get_range("k", 2, 3) == b"234"
        with pytest.raises(PermissionDenied, match="read-only"):
            store.put_bytes("k2", b"x")
    finally:
        ro.stop()
        shutil.rmtree(prefix, ignore_errors=True)


def _proxied(nginx: Nginx, url: str, proxies: list[FaultProxy],
             timeout_s: float = 2.0) -> tuple[HttpBlobStore, FaultProxy]:
    proxy = FaultProxy(nginx.port)
    proxies.append(proxy)
    path = url.split(str(nginx.port), 1)[1]
    return HttpBlobStore(base_url=proxy.url + path, retry=FAST, timeout_s=timeout_s,
                         connect_timeout_s=1.0), proxy


def test_5xx_cut_and_stalled_answers_are_retried(
        nginx_server: Nginx, http_dir: tuple[str, str],
        fault_proxy: list[FaultProxy]) -> None:
    d, url = http_dir
    data = os.urandom(262144 * 3)
    FileBlobStore(root=d, group="nogroup").put_bytes("k", data)
    store, proxy = _proxied(nginx_server, url, fault_proxy, timeout_s=0.5)
    proxy.faults.extend([Fault(status=503), Fault(cut_after=5000), Fault(status=502),
                         Fault(stall=True)])
    store_retry = HttpBlobStore(base_url=store.base, retry=RetryPolicy(
        attempts=5, initial_s=0.01, max_s=0.05, deadline_s=5.0), timeout_s=0.5)
    assert store_retry.get_range("k", 262144, 262144) == data[262144:524288]
    assert not proxy.faults
    proxy.faults.extend([Fault(status=503)] * 10)
    t0 = time.monotonic()
    with pytest.raises(BlobUnavailable) as ei:
        store.get_range("k", 0, 262144)
    assert ei.value.detail["attempts"] == 4 and ei.value.detail["status"] == 503
    assert time.monotonic() - t0 < 5.0


def test_corrupted_bytes_fail_the_chunk_check(
        nginx_server: Nginx, http_dir: tuple[str, str], fault_proxy: list[FaultProxy],
        tmp_path: os.PathLike[str]) -> None:
    """A byte flipped on the way (wrong digest): the store hands over what the server
    sent, exactly as long as asked; the chunk table is what refuses it."""
    d, url = http_dir
    src = os.path.join(str(tmp_path), "layer")
    with open(src, "wb") as f:
        f.write(os.urandom(262144 * 2))
    table = build_chunk_table(src)
    FileBlobStore(root=d, group="nogroup").put_file("layer", src)
    store, proxy = _proxied(nginx_server, url, fault_proxy)
    proxy.faults.append(Fault(flip_at=4000))
    bad = store.get_range("layer", 262144, 262144)
    assert len(bad) == 262144 and not verify_chunk(table, 1, bad)
    good = store.get_range("layer", 262144, 262144)
    assert verify_chunk(table, 1, good)


def test_server_killed_mid_read_is_an_error_never_data(
        http_dir: tuple[str, str], fault_proxy: list[FaultProxy]) -> None:
    prefix = tempfile.mkdtemp(prefix="dsec-nginx-kill-")
    server = Nginx(prefix)
    try:
        data = os.urandom(24 << 20)   # more than the socket buffers hold
        with open(os.path.join(server.root, "big"), "wb") as f:
            f.write(data)
        proxy = FaultProxy(server.port)
        fault_proxy.append(proxy)
        fault = Fault(pause_after=1 << 20)
        proxy.faults.append(fault)
        store = HttpBlobStore(base_url=proxy.url, retry=FAST, timeout_s=2.0,
                              connect_timeout_s=0.5)
        out: list[object] = []
        t = threading.Thread(target=lambda: out.append(_try(store, len(data))))
        t.start()
        assert fault.paused.wait(20), "the read never started"
        server.kill()                                 # SIGKILL master + worker
        fault.resume.set()
        t.join(30)
        assert not t.is_alive()
        assert isinstance(out[0], BlobUnavailable), out[0]
        # the server comes back on the same port: the same store object reads again
        server = _restart(prefix, server.port)
        assert store.get_range("big", 5, 10) == data[5:15]
    finally:
        server.stop()
        shutil.rmtree(prefix, ignore_errors=True)


def _try(store: HttpBlobStore, n: int) -> object:
    try:
        return store.get_range("big", 0, n)
    except Exception as exc:  # noqa: BLE001 - the test inspects what came out
        return exc


def _restart(prefix: str, port: int) -> Nginx:
    """nginx again on ``port`` with the same root (its config file is reused)."""
    import subprocess

    from tests.image.blob.servers import NGINX, wait_http
    n = Nginx.__new__(Nginx)
    n.prefix, n.root, n.port = prefix, os.path.join(prefix, "www"), port
    n.url = f"http://127.0.0.1:{port}"
    n.proc = subprocess.Popen([NGINX, "-p", prefix, "-c", os.path.join(prefix, "nginx.conf"),
                               "-e", f"{prefix}/logs/error.log"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              start_new_session=True)
    wait_http(n.url + "/", n.proc, "nginx", timeout=15)
    return n


def test_server_ignoring_range_is_refused() -> None:
    import httpx

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"whole object")
    store = HttpBlobStore(base_url="http://blob.test", transport=httpx.MockTransport(handler))
    with pytest.raises(RemoteProtocolError, match="ignored the Range"):
        store.get_range("k", 2, 3)


_PUTTER = """
import sys
from dsec.image.blob import open_blobstore
open_blobstore(sys.argv[1]).put_file("big", sys.argv[2])
"""


def test_kill_9_mid_put_leaves_no_visible_object(
        nginx_server: Nginx, http_dir: tuple[str, str], tmp_path: os.PathLike[str]) -> None:
    """nginx takes a PUT body into its temp dir and renames it into place only whole."""
    import signal
    import subprocess
    import sys
    d, url = http_dir
    src = os.path.join(str(tmp_path), "layer")
    with open(src, "wb") as f:
        f.truncate(1 << 30)                    # 1 GiB sparse: read fast, sent slowly
    body_tmp = os.path.join(nginx_server.prefix, "tmp", "body")
    before = set(os.listdir(body_tmp)) if os.path.isdir(body_tmp) else set()
    proc = subprocess.Popen([sys.executable, "-c", _PUTTER, url, src])
    try:
        deadline = time.monotonic() + 30
        while not (os.path.isdir(body_tmp) and set(os.listdir(body_tmp)) - before):
            assert proc.poll() is None, "the upload ended before it could be killed"
            assert time.monotonic() < deadline, "nginx never started receiving the body"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    store = open_blobstore(url)
    assert store.head("big") is None and not os.path.exists(os.path.join(d, "big"))
    with pytest.raises(BlobNotFound):
        store.get_range("big", 0, 1)
