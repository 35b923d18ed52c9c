"""``client.images``: the cluster's layer store (list, get, build from a directory or tar,
import, tag, delete).

Uploads are raw tar bodies over REST (``POST /v1/images``); the Aether gateway carries
sandbox operations only, so this always uses HTTP, whatever the client's transport.

Names are namespaced per project (docs/images.md, "Names and tenancy"):
``name="teama/tools"`` is project ``teama``'s (building it needs ``member`` there), a bare
``name="tools"`` is cluster-wide (a superuser's). A sandbox's ``image="tools"`` finds
``<its project>/tools`` first, then the cluster-wide ``tools``.
"""

from __future__ import annotations

import asyncio
import builtins
import os
import tempfile
from collections.abc import AsyncIterator
from typing import IO, TYPE_CHECKING, Literal
from urllib.parse import quote

import msgspec

from dsec.errors import InvalidArgument
from dsec.wire.api import ImageList, ImageTagRequest, ImageView

if TYPE_CHECKING:
    from dsec.client.core import AsyncClient
    from dsec.client.transport import HttpTransport

__all__ = ["AsyncImages", "LayerKind"]

LayerKind = Literal["base", "workspace", "toolkit"]
_CHUNK = 1 << 20


class AsyncImages:
    def __init__(self, client: AsyncClient) -> None:
        self._c = client

    def _http(self) -> HttpTransport:
        from dsec.client.transport import HttpTransport
        return HttpTransport(self._c.url, self._c._key, timeout=self._c.timeout,
                             transport=self._c._http_transport)

    async def list(self) -> builtins.list[ImageView]:
        """Every layer this key may see: cluster-wide ones and its projects' (each with
        its ``namespace``, ``owner`` and the names pointing at it)."""
        http = self._http()
        try:
            page: ImageList = await self._c._retry(lambda: http._json(ImageList, "GET", "/v1/images"))
            return page.items
        finally:
            await http.close()

    async def get(self, ref: str) -> ImageView:
        """One image by ``[project/]name[:tag]`` or digest (``ImageNotFound`` when this
        key may not see it, exactly as when it does not exist)."""
        http = self._http()
        try:
            view: ImageView = await self._c._retry(lambda: http._json(
                ImageView, "GET", "/v1/images/" + _path(ref)))
            return view
        finally:
            await http.close()

    async def tag(self, source: str, target: str) -> ImageView:
        """Point the name ``target`` at the layer ``source`` names (moving it)."""
        http = self._http()
        try:
            view: ImageView = await http._json(
                ImageView, "POST", "/v1/images/tag",
                content=msgspec.json.encode(ImageTagRequest(source=source, target=target)),
                headers={"content-type": "application/json"})
            return view
        finally:
            await http.close()

    async def delete(self, ref: str | ImageView) -> None:
        """Delete a layer and its names (``InUse`` while a sandbox or snapshot uses it)."""
        key = ref.digest if isinstance(ref, ImageView) else ref
        http = self._http()
        try:
            await http._req("DELETE", "/v1/images/" + _path(key))
        finally:
            await http.close()

    async def build(self, source: str | os.PathLike[str], *, name: str,
                    kind: LayerKind = "base", tag: str = "latest") -> ImageView:
        """Build a layer named ``[project/]name:tag`` from a directory (packed as a tar
        here) or from a tar file; returns what the store recorded."""
        path = os.fspath(source)
        if kind not in ("base", "workspace", "toolkit"):
            raise InvalidArgument(f"kind={kind!r}: use 'base', 'workspace' or 'toolkit'",
                                  field="kind")
        if os.path.isdir(path):
            with tempfile.TemporaryFile(prefix="dsec-layer-") as f:
                _pack_dir(path, f)
                f.seek(0)
                return await self._upload("/v1/images", f, name=name, kind=kind, tag=tag)
        if os.path.isfile(path):
            # Opening a local file is quick; the reads run in a thread in _upload.
            with open(path, "rb") as f:  # noqa: ASYNC230
                return await self._upload("/v1/images", f, name=name, kind=kind, tag=tag)
        raise InvalidArgument(f"cannot build an image from {path!r}: not a directory or a tar "
                              "file", field="source")

    async def import_oci(self, source: str | os.PathLike[str], *, name: str,
                         tag: str = "latest") -> ImageView:
        """Import an OCI image (``docker save`` tarball or OCI layout tar)."""
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise InvalidArgument(f"cannot import {path!r}: not a file (give a docker save "
                                  "tarball or an OCI layout tar)", field="source")
        # Opening a local file is quick; the reads run in a thread in _upload.
        with open(path, "rb") as f:  # noqa: ASYNC230
            return await self._upload("/v1/images/import", f, name=name, kind="base", tag=tag)

    async def _upload(self, route: str, f: IO[bytes], *, name: str, kind: str,
                      tag: str) -> ImageView:
        http = self._http()

        async def chunks() -> AsyncIterator[bytes]:
            # 1 MiB reads off the event loop: an image tarball can be hundreds of MiB.
            while block := await asyncio.to_thread(f.read, _CHUNK):
                yield block

        try:
            # Not retried: an upload is a stream that was consumed by the first attempt.
            page: ImageList = await http._json(
                ImageList, "POST", route, params={"name": name, "kind": kind, "tag": tag},
                content=chunks(), timeout=None)
        finally:
            await http.close()
        if not page.items:
            raise InvalidArgument(f"the server built no layer from the upload for {name!r}")
        return page.items[0]


def _path(ref: str) -> str:
    """A ref as a URL path tail (its '/' and ':' stay, anything else is escaped)."""
    if not ref or ref.startswith("/"):
        raise InvalidArgument(f"image ref {ref!r} must be [project/]name[:tag] or a digest",
                              field="ref")
    return quote(ref, safe="/:")


def _pack_dir(root: str, out: IO[bytes]) -> None:
    """Tar ``root``'s contents (paths relative to it, ownership kept as is); files with
    holes go as sparse members, so only their data is uploaded."""
    from dsec.image.archive import pack_tree
    pack_tree(root, out)
