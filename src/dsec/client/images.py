"""``client.images``: the cluster's layer store (list, get, build from a directory or tar,
import, pull from a registry, tag, delete).

Each call is a row of the catalogue (``dsec.wire.ops``): list, get, tag and delete go
through the client's transport; the uploads are raw tar bodies over REST
(``POST /v1/images``), whatever the client's transport (the gateway carries no streams
of that size yet).

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
from typing import IO, Literal

import msgspec

from dsec.client.transport import OpCaller
from dsec.errors import InvalidArgument
from dsec.wire import ops
from dsec.wire.api import (
    ImageList,
    ImagePinList,
    ImagePinView,
    ImagePromoteRequest,
    ImagePruned,
    ImagePullRequest,
    ImagePushed,
    ImagePushRequest,
    ImageTagRequest,
    ImageView,
)
from dsec.wire.calls import Empty, ImagePrune, ImageRef, ImageUpload
from dsec.wire.layers import ImagePin, ImagePinRef, NodePins
from dsec.wire.ops import UploadOp

__all__ = ["AsyncImages", "LayerKind"]

LayerKind = Literal["base", "workspace", "toolkit"]
_CHUNK = 1 << 20


class AsyncImages:
    """``client.images``. Every call is a row of the catalogue through the client
    (:class:`~dsec.client.transport.OpCaller`): list, get, tag and delete through the
    client's transport (REST or the gateway), the uploads (a raw tar stream) over REST."""

    def __init__(self, client: OpCaller) -> None:
        self._c = client

    async def list(self) -> builtins.list[ImageView]:
        """Every layer this key may see: cluster-wide ones and its projects' (each with
        its ``namespace``, ``owner`` and the names pointing at it)."""
        return (await self._c.call(ops.IMAGES, Empty())).items

    async def get(self, ref: str) -> ImageView:
        """One image by ``[project/]name[:tag]`` or digest (``ImageNotFound`` when this
        key may not see it, exactly as when it does not exist)."""
        return await self._c.call(ops.IMAGE_GET, ImageRef(ref=_ref(ref)))

    async def tag(self, source: str, target: str) -> ImageView:
        """Point the name ``target`` at the layer ``source`` names (moving it)."""
        return await self._c.call(ops.IMAGE_TAG, ImageTagRequest(source=source,
                                                                 target=target))

    async def promote(self, req: ImagePromoteRequest) -> ImageView:
        """Name a built image (``dsec.Image.build(client, name=...)`` does it): its step
        layers (the snapshot chain of ``req.top``) on ``req.base`` become the image
        ``req.target`` with the build's config."""
        return await self._c.call(ops.IMAGE_PROMOTE, req)

    async def delete(self, ref: str | ImageView) -> None:
        """Delete a layer and its names (``InUse`` while a sandbox or snapshot uses it)."""
        key = ref.digest if isinstance(ref, ImageView) else ref
        await self._c.call(ops.IMAGE_DELETE, ImageRef(ref=_ref(key)))

    async def prune(self, *, dry_run: bool = False) -> ImagePruned:
        """Remove the layers nothing references - no name, no snapshot or image standing
        on them, not mounted, not held by a build in progress - and say what that freed
        (``dry_run``: only say). A superuser's (``PermissionDenied`` otherwise): the store
        holds every project's layers."""
        return await self._c.call(ops.IMAGE_PRUNE, ImagePrune(dry_run=dry_run))

    async def build(self, source: str | os.PathLike[str], *, name: str,
                    kind: LayerKind = "base", tag: str = "latest") -> ImageView:
        """Build a layer named ``[project/]name:tag`` from a directory (packed as a tar
        here) or from a tar file; returns what the store recorded. Special files go by
        the one rule of every door (device nodes but whiteouts and sockets are left out,
        FIFOs kept): ``skipped`` counts them, here and on the server alike."""
        path = os.fspath(source)
        if kind not in ("base", "workspace", "toolkit"):
            raise InvalidArgument(f"kind={kind!r}: use 'base', 'workspace' or 'toolkit'",
                                  field="kind")
        body = ImageUpload(name=name, kind=kind, tag=tag)
        if os.path.isdir(path):
            with tempfile.TemporaryFile(prefix="dsec-layer-") as f:
                here = await asyncio.to_thread(_pack_dir, path, f)
                f.seek(0)
                view = await self._upload(ops.IMAGE_BUILD, body, f)
            return msgspec.structs.replace(view, skipped=_add_counts(view.skipped, here))
        if os.path.isfile(path):
            # Opening a local file is quick; the reads run in a thread in _upload.
            with open(path, "rb") as f:  # noqa: ASYNC230
                return await self._upload(ops.IMAGE_BUILD, body, f)
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
            return await self._upload(ops.IMAGE_IMPORT,
                                      ImageUpload(name=name, kind="base", tag=tag), f)

    async def pull(self, ref: str, *, name: str | None = None, project: str | None = None,
                   platform: str | None = None, insecure: bool = False,
                   creds: str | None = None) -> ImageView:
        """Pull ``ref`` (``host[:port]/repo[:tag|@sha256:...]``) from an OCI registry into
        the cluster's layer store; returns the image (its top layer; ``labels`` hold its
        config as ``oci.*``). Named ``name`` (``[project/]name[:tag]``) or by its
        registry ref in ``project`` (``project=None`` and no name: cluster-wide, which
        needs a superuser). ``platform``: ``os/arch[/variant]`` from an image index
        (default: the node's); ``insecure``: a plain-HTTP registry; ``creds``:
        ``user:password`` for it. Layers shared with images already pulled are reused."""
        page = await self._c.call(ops.IMAGE_PULL, ImagePullRequest(
            ref=ref, name=name, project=project, platform=platform, insecure=insecure,
            creds=creds))
        if not page.items:
            raise InvalidArgument(f"the server pulled no layer for {ref[:200]!r}")
        return page.items[0]

    async def push(self, ref: str | ImageView, *, verify: bool = False) -> ImagePushed:
        """Push the image (its layer and every layer below it, with chunk tables and
        manifests) to the cluster's blob store, where nodes that lack a layer read it
        lazily; layers already there whole are skipped (``verify``: read them back and
        check every chunk). Needs the write right on the image's namespace."""
        key = ref.digest if isinstance(ref, ImageView) else ref
        return await self._c.call(ops.IMAGE_PUSH, ImagePushRequest(ref=_ref(key),
                                                                  verify=verify))

    async def pin(self, ref: str | ImageView, *, node: str) -> ImagePinView:
        """Keep the image (every layer of it) fully cached on ``node``: its lazily loaded
        layers are fetched whole there and never evicted. The image must be pushed to the
        blob store first (:meth:`push`). A superuser's; stored (survives restarts)."""
        key = ref.digest if isinstance(ref, ImageView) else ref
        return await self._c.call(ops.IMAGE_PIN, ImagePin(node=node, ref=_ref(key)))

    async def unpin(self, image: str, *, node: str) -> None:
        """Stop keeping the image ``image`` (its digest) fully cached on ``node``."""
        await self._c.call(ops.IMAGE_UNPIN, ImagePinRef(node=node, image=image))

    async def pins(self, node: str) -> builtins.list[ImagePinView]:
        """The images pinned on ``node``."""
        page: ImagePinList = await self._c.call(ops.IMAGE_PINS, NodePins(node=node))
        return page.items

    async def _upload(self, op: UploadOp[ImageUpload, ImageList], body: ImageUpload,
                      f: IO[bytes]) -> ImageView:
        async def chunks() -> AsyncIterator[bytes]:
            # 1 MiB reads off the event loop: an image tarball can be hundreds of MiB.
            while block := await asyncio.to_thread(f.read, _CHUNK):
                yield block

        # Not retried: an upload is a stream that was consumed by the first attempt.
        page = await self._c.upload(op, body, chunks())
        if not page.items:
            raise InvalidArgument(f"the server built no layer from the upload for "
                                  f"{body.name!r}")
        return page.items[0]


def _ref(ref: str) -> str:
    """An image ref as the API takes it ([project/]name[:tag] or a digest)."""
    if not isinstance(ref, str) or not ref or ref.startswith("/"):
        raise InvalidArgument(f"image ref {ref!r} must be [project/]name[:tag] or a digest",
                              field="ref")
    return ref


def _pack_dir(root: str, out: IO[bytes]) -> dict[str, int]:
    """Tar ``root``'s contents (paths relative to it, ownership kept as is); files with
    holes go as sparse members, so only their data is uploaded. Returns the special files
    left out (:func:`dsec.image.tree.special_skip`)."""
    from dsec.image.archive import pack_tree
    return pack_tree(root, out)


def _add_counts(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return {k: v for k, v in sorted(out.items()) if v}
