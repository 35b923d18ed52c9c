"""Moving layers between nodes through the control plane (issue 16; docs/layers.md).

Edges never dial each other: to put a layer on a node that lacks it, the control plane
asks a node holding it for the layer's chain (``layer_chain``: it and every layer below,
lowest first) and, for each layer the target lacks, relays the holder's ``layer_get``
duplex stream into the target's ``layer_put`` one chunk (1 MiB) at a time, under
Aether's per-stream credit on both links (so at most a window per stream is buffered
here, whatever the layer's size). The target checks everything (size, chunks, sha256;
:mod:`dsec.edge.layers`); this side only cuts a stalled holder off and resets the other
stream when one fails, so the target drops its temp file.

Fetches coalesce: one relay per (node, digest) at a time in this apiserver; a second
create wanting the same layer on the same node waits for the first (and a second
replica's relay is answered by the edge's own coalescing without a byte read twice).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from dsec.edge.client import EdgeClient
from dsec.errors import (
    CorruptLayer,
    DsecError,
    ImageNotFound,
    ProtocolError,
    RequestTimeout,
    StreamReset,
    TransportError,
)
from dsec.image.manifest import LayerManifest
from dsec.image.transfer import CHUNK_BYTES, decode_manifest
from dsec.wire import ops
from dsec.wire.layers import (
    MAX_CHAIN,
    LayerFetched,
    LayerGrant,
    LayerPut,
    LayerRef,
    LayerStored,
)

__all__ = ["LayerMeaning", "LayerMover", "MoveStats", "relay"]

_enc = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class LayerMeaning:
    """What a layer *is*, in the control plane's words (its records of the snapshot
    taken, or its own store's manifest of the image built/pulled): its kind, what it
    stands on, whose it is. A layer's digest pins its bytes only; everything else a
    holder's manifest says is the holder's word, so a fetch publishes the layer on the
    receiver with this meaning and the holder's bytes, never the holder's manifest (red
    team 16 F1: a compromised holder slipped a layer of its own under a victim's
    snapshot by editing the snapshot's ``stack``)."""

    kind: str
    parent: str | None = None
    stack: tuple[str, ...] = ()
    namespace: str | None = None
    labels: dict[str, str] = field(default_factory=dict)

    def below(self) -> tuple[str, ...]:
        return (*self.stack, *((self.parent,) if self.parent else ()))


def meant_manifest(digest: str, meaning: LayerMeaning, held: LayerManifest) -> LayerManifest:
    """The manifest the receiver stores: the authority's meaning; from the holder only
    what describes the bytes (their size, which the sha256 over exactly that many bytes
    checks, and descriptive counts). No name, tag or owner: a copied layer is held by
    digest (docs/layers.md)."""
    return LayerManifest(
        digest=digest, kind=meaning.kind,  # type: ignore[arg-type]
        size_bytes=held.size_bytes, created=held.created, namespace=meaning.namespace,
        labels=dict(meaning.labels), parent=meaning.parent, stack=meaning.stack,
        content_bytes=held.content_bytes, entries=held.entries,
        compression=held.compression, skipped=dict(held.skipped))

def granted_manifest(digest: str, meaning: LayerMeaning,
                     pushed: LayerManifest) -> LayerManifest | None:
    """The manifest a node with a blob store gets for a layer it may read lazily
    (``layer_grant``; red team 17 F1): the control plane's meaning, and from the
    control plane's own record of the push the size and the chunk table's sha256 - the
    hashes every chunk is checked against are bound to the digest by whoever pushed
    it, never by the blob store. None: the layer cannot be read lazily (a snapshot,
    or never pushed with a recorded chunk table)."""
    if meaning.kind == "snapshot" or pushed.kind == "snapshot" or pushed.chunk_table is None:
        return None
    return msgspec.structs.replace(meant_manifest(digest, meaning, pushed),
                                   chunk_table=pushed.chunk_table)


log = logging.getLogger(__name__)


async def relay(src: EdgeClient, dst: EdgeClient, raw_manifest: bytes, digest: str, *,
                idle_timeout_s: float = 30.0, chunk_bytes: int = CHUNK_BYTES) -> LayerStored:
    """Copy one layer from ``src`` to ``dst`` (both hold what is below it on ``dst``
    already). Returns what ``dst`` answered; raises what either side raised."""
    put = dst.tunnel(ops.LAYER_PUT, LayerPut(manifest=raw_manifest))
    get = src.tunnel(ops.LAYER_GET, LayerRef(digest=digest))
    get.close_write()
    try:
        while True:
            try:
                async with asyncio.timeout(idle_timeout_s):
                    data = await get.recv(chunk_bytes)
            except TimeoutError:
                raise CorruptLayer(
                    f"layer {digest}: its holder sent nothing for {idle_timeout_s:g}s; the "
                    "transfer was cut off", digest=digest) from None
            if not data:
                break
            try:
                await put.send(data)
            except StreamReset:
                break   # the receiver answered early (it had the layer) or refused: result()
        put.close_write()
        stored: LayerStored = await put.result()
    except BaseException:
        put.reset("abandoned by the relay")
        get.reset("abandoned by the relay")
        raise
    get.reset("done")           # a no-op when the holder already answered
    return stored


def _check_kind(digest: str, top: LayerMeaning, kind: str | None) -> None:
    if kind == "snapshot" and top.kind != "snapshot":
        raise ImageNotFound(f"{digest} is a {top.kind} layer, not a snapshot", ref=digest)
    if kind == "image" and top.kind == "snapshot":
        raise ImageNotFound(f"no image {digest}: it is a snapshot; start from it "
                            "with snapshot=", ref=digest)


@dataclass(slots=True)
class MoveStats:
    """Counters of one apiserver's relays (the bench reads them)."""

    layers: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass
class LayerMover:
    """Fetch a layer and its chain onto a node from a holder, coalescing per (node,
    digest). The cluster's view comes in as functions: ``link(node)`` the node's
    client (None: unknown), ``holders(digest)`` healthy nodes holding it, ``nodes()``
    every healthy node (asked when no heartbeat names a holder yet), ``holds(node,
    digest)`` what the node reported (heartbeat) or was given since, ``note(node,
    digest)`` to record a layer now held."""

    link: Callable[[str], EdgeClient | None]
    holders: Callable[[str], Sequence[str]]
    nodes: Callable[[], Sequence[str]]
    holds: Callable[[str, str], bool]
    note: Callable[[str, str], None]
    #: a layer was copied onto a node (it has it by digest only, without a name)
    copied: Callable[[str, str], None] = lambda node, digest: None
    #: what a layer is, from the control plane's records (None: it has none, and the
    #: layer does not move). Unset (None) only in relay unit tests: the holder's chain.
    meaning: Callable[[str], LayerMeaning | None] | None = None
    #: [lazy3] whether a node reads layers lazily from the cluster's blob store
    #: (Heartbeat.lazy): such a node is granted pushed layers, not sent their bytes
    lazy: Callable[[str], bool] = lambda node: False
    #: [lazy3] the control plane's own manifest of a layer it pushed (its chunk table
    #: recorded), or None
    pushed: Callable[[str], LayerManifest | None] = lambda digest: None
    idle_timeout_s: float = 30.0
    stats: MoveStats = field(default_factory=MoveStats)
    _inflight: dict[tuple[str, str], asyncio.Future[LayerStored]] = field(
        default_factory=dict)

    def _edge(self, node: str) -> EdgeClient:
        e = self.link(node)
        if e is None:
            raise ImageNotFound(f"node {node!r} is not an edge of this cluster", node=node)
        return e

    async def fetch(self, node: str, digest: str, *, source: str | None = None,
                    kind: str | None = None) -> LayerFetched:
        """Put ``digest`` and everything below it on ``node``. ``source``: the holder to
        copy from (default: any healthy holder but ``node``). ``kind``: "snapshot" to
        require the layer be one, "image" to require it not be (a create naming an image
        digest must not boot a snapshot's files the caller was never shown)."""
        out = LayerFetched(node=node, digest=digest)
        if self.holds(node, digest):
            out.present.append(digest)
            return out
        if self.meaning is not None and self.lazy(node):
            # A node with a blob store reads pushed layers lazily: the control plane
            # grants it their manifests (lowest first) and relays only what was never
            # pushed - a snapshot's own layer, whose image layers stay remote.
            with contextlib.suppress(ImageNotFound):
                meant = self._chain(digest)
                _check_kind(digest, meant[-1][1], kind)
                await self._grant(node, meant, out)
                if digest in out.remote:
                    return out
        sources = [source] if source is not None else [
            n for n in self.holders(digest) if n != node]
        dst = self._edge(node)
        if not sources:
            # Heartbeats lag (a second): a layer made since the last one (a build into a
            # store a node shares, a snapshot) is not known to be anywhere yet. Ask: the
            # node itself first (one small call), then every other healthy node.
            try:
                await dst.call(ops.LAYER_CHAIN, LayerRef(digest=digest))
            except ImageNotFound:
                sources = [n for n in self.nodes() if n != node]
            else:
                self.note(node, digest)
                out.present.append(digest)
                return out
        if not sources:
            raise ImageNotFound(f"layer {digest} is on no healthy node of this cluster",
                                ref=digest)
        if self.meaning is not None:
            return await self._fetch_meant(node, digest, dst, sources, kind, out)
        last: DsecError | None = None
        for src_node in sources:
            src = self._edge(src_node)
            try:
                chain = await src.call(ops.LAYER_CHAIN, LayerRef(digest=digest))
            except (ImageNotFound, TransportError, ProtocolError, RequestTimeout) as exc:
                last = exc      # pruned since its heartbeat, or unreachable: the next one
                continue
            manifests = [decode_manifest(raw) for raw in chain.manifests]
            if not manifests or manifests[-1].digest != digest:
                raise CorruptLayer(f"node {src_node} answered another chain for {digest}",
                                   digest=digest, node=src_node)
            top = manifests[-1]
            if kind == "snapshot" and top.kind != "snapshot":
                raise ImageNotFound(f"{digest} is a {top.kind} layer, not a snapshot",
                                    ref=digest)
            if kind == "image" and top.kind == "snapshot":
                raise ImageNotFound(f"no image {digest}: it is a snapshot; start from it "
                                    "with snapshot=", ref=digest)
            for m, raw in zip(manifests, chain.manifests, strict=True):
                if self.holds(node, m.digest):
                    out.present.append(m.digest)
                    continue
                stored = await self._one(node, dst, src, raw, m.digest)
                if stored.already:
                    out.present.append(m.digest)
                else:
                    out.copied.append(m.digest)
                    out.bytes += stored.size_bytes
            return out
        raise ImageNotFound(f"layer {digest} is on no healthy node of this cluster (asked "
                            f"{', '.join(sorted(sources))})", ref=digest) from last

    def _chain(self, digest: str) -> list[tuple[str, LayerMeaning]]:
        """``digest`` and every layer below it by the control plane's records, lowest
        first (the order they are published in)."""
        assert self.meaning is not None
        out: list[tuple[str, LayerMeaning]] = []
        done: set[str] = set()
        visiting: set[str] = set()

        def visit(d: str) -> None:
            if d in done:
                return
            if d in visiting:
                raise CorruptLayer(f"layer chain of {digest} loops at {d}", digest=digest)
            if len(done) >= MAX_CHAIN:
                raise CorruptLayer(f"layer {digest} stands on more than {MAX_CHAIN} layers",
                                   digest=digest)
            assert self.meaning is not None
            m = self.meaning(d)
            if m is None:
                raise ImageNotFound(
                    f"layer {d} is not one this cluster recorded making (no snapshot taken "
                    "through it, no image in its store): a layer moves only with the "
                    "control plane's record of what it is"
                    + ("" if d == digest else f" (it is below {digest})"), ref=d)
            visiting.add(d)
            for b in m.below():
                visit(b)
            visiting.discard(d)
            done.add(d)
            out.append((d, m))

        visit(digest)
        return out

    async def _grant(self, node: str, chain: list[tuple[str, LayerMeaning]],
                     out: LayerFetched) -> None:
        """Grant ``node`` the pushed layers at the bottom of ``chain`` it lacks, up to
        the first one that cannot be read lazily (what stands on that must be relayed
        after it); each granted layer goes to ``out.remote``."""
        send: list[bytes] = []
        want: list[str] = []
        for d, meaning in chain:
            if self.holds(node, d):
                out.present.append(d)
                continue
            pushed = self.pushed(d)
            m = granted_manifest(d, meaning, pushed) if pushed is not None else None
            if m is None:
                break
            send.append(_enc.encode(m))
            want.append(d)
        if not send:
            return
        got = await self._edge(node).call(ops.LAYER_GRANT, LayerGrant(manifests=send))
        for d in got.digests:
            if d in want and d not in out.remote:
                out.remote.append(d)
                # there by digest only, like a copy; never a holder others copy from
                self.copied(node, d)

    async def _fetch_meant(self, node: str, digest: str, dst: EdgeClient,
                           sources: Sequence[str], kind: str | None,
                           out: LayerFetched) -> LayerFetched:
        chain = self._chain(digest)
        _check_kind(digest, chain[-1][1], kind)
        last: DsecError | None = None
        for src_node in sources:
            src = self._edge(src_node)
            try:
                for d, meaning in chain:
                    if d in out.present or d in out.copied or d in out.remote:
                        continue
                    if self.holds(node, d):
                        out.present.append(d)
                        continue
                    got = await src.call(ops.LAYER_CHAIN, LayerRef(digest=d))
                    if not got.manifests:
                        raise CorruptLayer(f"node {src_node} answered no manifest for {d}",
                                           digest=d, node=src_node)
                    held = decode_manifest(got.manifests[-1], digest=d)
                    raw = _enc.encode(meant_manifest(d, meaning, held))
                    stored = await self._one(node, dst, src, raw, d)
                    if stored.already:
                        out.present.append(d)
                    else:
                        out.copied.append(d)
                        out.bytes += stored.size_bytes
                return out
            except (ImageNotFound, TransportError, ProtocolError, RequestTimeout) as exc:
                last = exc      # pruned since its heartbeat, or unreachable: the next one
                continue
        raise ImageNotFound(f"layer {digest} is on no healthy node of this cluster (asked "
                            f"{', '.join(sorted(sources))})", ref=digest) from last

    async def _one(self, node: str, dst: EdgeClient, src: EdgeClient, raw: bytes,
                   digest: str) -> LayerStored:
        key = (node, digest)
        running = self._inflight.get(key)
        if running is not None:
            # the first one's copy: for this caller the layer was already on its way
            return msgspec.structs.replace(await asyncio.shield(running), already=True)
        fut: asyncio.Future[LayerStored] = asyncio.get_running_loop().create_future()
        self._inflight[key] = fut
        t0 = time.monotonic()
        try:
            stored = await relay(src, dst, raw, digest, idle_timeout_s=self.idle_timeout_s)
        except BaseException as exc:
            fut.set_exception(exc if isinstance(exc, Exception) else CorruptLayer(
                f"the fetch of {digest} onto {node} was cancelled", digest=digest))
            with contextlib.suppress(BaseException):
                fut.exception()
            raise
        finally:
            self._inflight.pop(key, None)
        fut.set_result(stored)
        self.note(node, digest)
        if not stored.already:
            self.copied(node, digest)
            self.stats.layers += 1
            self.stats.bytes += stored.size_bytes
            self.stats.seconds += time.monotonic() - t0
            log.info("layer %s copied onto %s (%d bytes)", digest, node, stored.size_bytes)
        return stored
