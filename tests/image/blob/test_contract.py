"""The BlobStore contract on every backend against its real server: one instance shared
by many threads reads exact bytes; credentials never show in what a failure says."""

from __future__ import annotations

import concurrent.futures
import os
import random

import httpx
import pytest

from dsec.errors import BlobUnavailable, PermissionDenied
from dsec.image.blob import open_blobstore
from dsec.image.blob.http import HttpBlobStore
from dsec.image.blob.retry import RetryPolicy


@pytest.mark.parametrize("backend", ["file", "s3", "http"])
def test_one_instance_many_threads_exact_bytes(backend: str, request: pytest.FixtureRequest,
                                               tmp_path: os.PathLike[str]) -> None:
    url = {"file": lambda: f"file://{tmp_path}/b",
           "s3": lambda: request.getfixturevalue("s3_url"),
           "http": lambda: request.getfixturevalue("http_dir")[1]}[backend]()
    store = open_blobstore(url)
    data = os.urandom(1 << 20)
    store.put_bytes("obj", data)
    rng = random.Random(3)
    ranges = [(o, rng.randrange(1, 70_000)) for o in
              (rng.randrange(0, (1 << 20) - 70_000)
               for _ in range(32 if backend == "s3" else 160))]   # moto: ~50 ms a GET
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda r: store.get_range("obj", *r), ranges))
    assert all(g == data[o:o + n] for g, (o, n) in zip(got, ranges, strict=True))


def test_http_token_is_sent_and_never_said() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization", ""))
        return httpx.Response(503 if len(seen) < 3 else 403)
    store = HttpBlobStore(base_url="http://blob.test/x", token="s3cr3t-token",
                          transport=httpx.MockTransport(handler),
                          retry=RetryPolicy(attempts=2, initial_s=0.0, max_s=0.0))
    with pytest.raises(BlobUnavailable) as ei:
        store.get_range("k", 0, 10)
    with pytest.raises(PermissionDenied) as pd:
        store.get_range("k", 0, 10)
    assert seen == ["Bearer s3cr3t-token"] * 3
    for exc in (ei.value, pd.value):
        assert "s3cr3t" not in str(exc) + repr(exc.detail)
