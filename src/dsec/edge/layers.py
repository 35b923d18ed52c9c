"""The edge's end of layer transfer (issue 16; docs/layers.md "How layers move").

A node hands out the layers of its store (``layer_chain``: what a layer stands on;
``layer_get``: its bytes) and takes in layers another node holds (``layer_put``), always
through the control plane, which relays one duplex stream into the other. Receiving:

1. the manifest is checked (:func:`dsec.image.transfer.decode_manifest`) and the layer
   must fit: at most the store's budget (``--image-store-budget``) and the host
   filesystem's free space less a reserve, else ``CapacityExceeded`` before a byte is read;
2. the bytes go to a scratch file of the store (:meth:`LayerStore.incoming`), each read
   at most :data:`CHUNK_BYTES`, never more in total than the manifest says, hashed as
   they come; a read that waits longer than ``idle_timeout_s`` ends the transfer;
3. the whole file's sha256 must be the digest; only then is it published
   (:meth:`LayerStore.adopt`: rename, manifest, budget prune).

Any refusal removes the scratch file; a kill -9 midway leaves it to the next store
opened on the same root (scratch files are named by their process). Two puts of one
digest at once coalesce: the second waits for the first and answers its manifest.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from dsec.errors import CapacityExceeded, CorruptLayer, ImageNotFound, StreamReset
from dsec.image import diskroom
from dsec.image.manifest import LayerManifest
from dsec.image.transfer import CHUNK_BYTES, LayerCheck, chain_order, decode_manifest
from dsec.wire.layers import MAX_CHAIN, LayerChain, LayerStored

if TYPE_CHECKING:
    from dsec.aether.connection import DuplexStream
    from dsec.image.store import LayerStore

__all__ = ["HOST_RESERVE_BYTES", "EdgeLayers", "find_store"]

log = logging.getLogger(__name__)

HOST_RESERVE_BYTES = 256 << 20
"""Left free on the store's filesystem by a fetch (the state dir's SQLite and journals
live there too)."""

_enc = msgspec.json.Encoder()


def find_store(backends: dict[str, Any]) -> LayerStore | None:
    """The layer store a node's backends mount from (the container backend's
    ``StoreImages``), or None."""
    from dsec.edge.backends.container.images import StoreImages

    for b in backends.values():
        images = getattr(b, "images", None)
        if isinstance(images, StoreImages):
            return images.store
    return None


def held_layers(store: LayerStore) -> list[str]:
    """Digests of every layer stored whole in ``store`` and its names (two listdirs and
    refs.json): what a node reports in its heartbeat so placement prefers it and the
    control plane knows where to fetch from. Layers this node reads lazily from a blob
    store are left out: it could not hand them to another node."""
    return store.stored_digests() + list(store.refs())


class EdgeLayers:
    """Hand out and take in the layers of one node's store."""

    def __init__(self, store: Callable[[], LayerStore | None], *,
                 idle_timeout_s: float = 30.0, chunk_bytes: int = CHUNK_BYTES,
                 free_bytes: Callable[[str], int] | None = None) -> None:
        self._store = store
        self.idle_timeout_s = idle_timeout_s
        self.chunk_bytes = chunk_bytes
        self._free = free_bytes or _free_bytes
        self._receiving: dict[str, asyncio.Future[LayerManifest]] = {}
        self.hits = 0       # layer_put of a layer already stored (the edge's /metrics)
        self.misses = 0     # ... that had to be transferred

    def store(self) -> LayerStore:
        s = self._store()
        if s is None:
            raise ImageNotFound("this node has no layer store (its container backend runs "
                                "without --layer-store), so it holds no layers to move")
        return s

    # ------------------------------------------------------------------ holder
    def chain(self, digest: str) -> LayerChain:
        """The manifests of ``digest`` and every layer below it, lowest first."""
        store = self.store()
        top = store.get(digest)
        below: dict[str, LayerManifest] = {}
        todo = [*top.stack, *((top.parent,) if top.parent else ())]
        while todo:
            d = todo.pop()
            if d in below:
                continue
            if len(below) >= MAX_CHAIN:
                raise CorruptLayer(f"layer {digest} stands on more than {MAX_CHAIN} layers",
                                   digest=digest)
            m = below[d] = store.get(d)
            todo += [*m.stack, *((m.parent,) if m.parent else ())]
        return LayerChain(manifests=[_enc.encode(m) for m in chain_order(top, below)])

    async def send(self, digest: str, stream: DuplexStream) -> None:
        """Write the layer file's bytes to ``stream`` and half-close it."""
        store = self.store()
        store.get(digest)           # ImageNotFound, in the store's words
        try:
            f = await asyncio.to_thread(open, store.layer_path(digest), "rb")
        except FileNotFoundError:
            raise ImageNotFound(f"layer {digest} was removed from this node's store",
                                ref=digest) from None
        try:
            while True:
                data = await asyncio.to_thread(f.read, self.chunk_bytes)
                if not data:
                    break
                await stream.send(data)
        finally:
            f.close()
        stream.close_write()

    # ---------------------------------------------------------------- receiver
    async def receive(self, raw_manifest: bytes, stream: DuplexStream) -> LayerStored:
        """Take in one layer (see the module docstring)."""
        m = decode_manifest(raw_manifest)
        store = self.store()
        if store.has(m.digest) and os.path.exists(store.layer_path(m.digest)):
            store.touch(m.digest)
            self.hits += 1
            return LayerStored(digest=m.digest, size_bytes=m.size_bytes, already=True)
        self.misses += 1
        while (other := self._receiving.get(m.digest)) is not None:
            with contextlib.suppress(Exception):
                got = await asyncio.shield(other)
                return LayerStored(digest=got.digest, size_bytes=got.size_bytes,
                                   already=True)
            # the first receiver failed: this one tries with its own bytes
        fut: asyncio.Future[LayerManifest] = asyncio.get_running_loop().create_future()
        self._receiving[m.digest] = fut
        try:
            got = await self._receive(store, m, stream)
        except BaseException as exc:
            fut.set_exception(exc if isinstance(exc, Exception) else CorruptLayer(
                f"layer {m.digest}: the transfer was cancelled", digest=m.digest))
            fut.exception()     # retrieved: no "never retrieved" warning
            raise
        else:
            fut.set_result(got)
            return LayerStored(digest=got.digest, size_bytes=got.size_bytes)
        finally:
            del self._receiving[m.digest]

    async def _receive(self, store: LayerStore, m: LayerManifest,
                       stream: DuplexStream) -> LayerManifest:
        budget = store.budget_bytes
        if budget is not None and m.size_bytes > budget:
            raise CapacityExceeded(
                f"layer {m.digest} is {m.size_bytes} bytes, over this node's image store "
                f"budget of {budget} bytes; raise --image-store-budget or place elsewhere",
                resource="image_bytes", requested=m.size_bytes, limit=budget)
        # Room is checked against free space less the reserve less what writers of the
        # same filesystem were granted and have not written yet, and this receive's
        # grant is taken in the same step (dsec.image.diskroom): two fetches at once
        # never both count the same free bytes (red team 16 F9: both passed one
        # statvfs and wrote through the reserve to ENOSPC).
        need = m.size_bytes
        grant, room = await diskroom.admit_async(
            store.root,
            lambda r: need if need <= r.free - HOST_RESERVE_BYTES - r.pending else None,
            free=None if self._free is _free_bytes else self._free)
        if grant is None:
            left = room.free - HOST_RESERVE_BYTES - room.pending
            raise CapacityExceeded(
                f"layer {m.digest} is {m.size_bytes} bytes; the layer store's filesystem has "
                f"{room.free} bytes free, keeps {HOST_RESERVE_BYTES} in reserve and "
                f"{room.pending} for writes already admitted (fetches, snapshots); free "
                "space or place elsewhere", resource="disk_bytes", requested=m.size_bytes,
                available=max(0, left))
        check = LayerCheck(m, max_chunk=self.chunk_bytes)
        path: str | None = None
        try:
            path = store.incoming()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                while True:
                    try:
                        async with asyncio.timeout(self.idle_timeout_s):
                            data = await stream.recv(self.chunk_bytes)
                    except TimeoutError:
                        raise CorruptLayer(
                            f"layer {m.digest}: no bytes for {self.idle_timeout_s:g}s after "
                            f"{check.received} of {m.size_bytes} (the holder or the relay "
                            "stalled); refused, nothing kept", digest=m.digest,
                            received=check.received) from None
                    except StreamReset as exc:
                        raise CorruptLayer(
                            f"layer {m.digest}: the transfer was reset after "
                            f"{check.received} of {m.size_bytes} bytes ({exc}); nothing kept",
                            digest=m.digest, received=check.received) from exc
                    if not data:
                        break
                    check.feed(data)
                    await asyncio.to_thread(f.write, data)
                    grant.wrote(len(data))
                check.finish()
                await asyncio.to_thread(_sync, f)
            return await asyncio.to_thread(store.adopt, path, m)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            # the filesystem filled anyway (another writer of it: a build, a snapshot):
            # a capacity refusal, not an internal error; the scratch file goes below
            raise CapacityExceeded(
                f"layer {m.digest}: the layer store's filesystem filled after "
                f"{check.received} of {m.size_bytes} bytes ({exc.strerror}); nothing kept; "
                "free space or place elsewhere", resource="disk_bytes",
                requested=m.size_bytes) from None
        finally:
            grant.release()
            if path is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)


def _sync(f: Any) -> None:
    """Durable before acknowledged: the layer's bytes reach the disk before its
    manifest names it."""
    f.flush()
    os.fsync(f.fileno())


def _free_bytes(root: str) -> int:
    st = os.statvfs(root)
    return st.f_bavail * st.f_frsize

