"""The dashboard's fixtures: one headless Chromium per test session (Debian's chromium
over the DevTools protocol, :mod:`dsec.bench._browser`), one in-process cluster with two
simulated edges per module, and keys of two projects that must never see each other."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from dsec.bench._browser import Browser, Page, chromium_path
from dsec.cluster.local import LocalCluster


@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    if chromium_path() is None:
        pytest.fail("chromium is not installed: `make setup` installs it (APT_PACKAGES)")
    b = Browser()
    try:
        yield b
    finally:
        b.close()


@dataclass
class Tenants:
    cluster: LocalCluster
    url: str
    admin: str
    a_key: str       # member of teama-<run>
    b_key: str       # member of teamb-<run>
    a_project: str
    b_project: str

    def rest(self, key: str) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"authorization": f"Bearer {key}"},
                            timeout=30)

    def create(self, key: str, project: str, n: int = 1, **spec: Any) -> list[str]:
        with self.rest(key) as c:
            out = []
            for _ in range(n):
                r = c.post("/v1/sandboxes", json={"backend": "simulated", "project": project,
                                                  **spec})
                assert r.status_code == 201, r.text
                out.append(r.json()["id"])
            return out

    def on_loop(self, coro: Any) -> Any:
        """Run ``coro`` on the cluster's event loop (its edges live there)."""
        loop = self.cluster._loop
        assert loop is not None
        return asyncio.run_coroutine_threadsafe(coro, loop).result(30)


@pytest.fixture(scope="module")
def tenants() -> Iterator[Tenants]:
    run = uuid.uuid4().hex[:6]
    c = LocalCluster(edges=2).start()
    try:
        keys = {}
        with httpx.Client(base_url=c.url, headers={"authorization": f"Bearer {c.api_key}"},
                          timeout=30) as admin:
            for who, project in (("alice", f"teama-{run}"), ("bob", f"teamb-{run}")):
                r = admin.post("/v1/keys", json={"name": f"{who}-{run}", "project": project,
                                                 "role": "member"})
                assert r.status_code in (200, 201), r.text
                keys[who] = r.json()["api_key"]
        yield Tenants(c, c.url, c.api_key, keys["alice"], keys["bob"], f"teama-{run}",
                      f"teamb-{run}")
    finally:
        c.stop()


def login(page: Page, url: str, key: str) -> None:
    """Log in through the form, as a person would."""
    page.goto(f"{url}/ui/login")
    page.eval(f"document.getElementById('key').value = {key!r}")
    page.act("document.getElementById('login').click()")
