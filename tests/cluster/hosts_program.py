"""The SDK program of issue 16's "same SDK code on one machine and on many": it takes a
client and uses only the public SDK, so it runs unchanged against ``dsec up`` and against
a multi-host cluster (:mod:`dsec.cluster.hosts`). What it saw is returned for asserts."""

from __future__ import annotations

from typing import Any

from dsec import Client


def sdk_program(client: Client, *, n: int = 3) -> dict[str, Any]:
    """Create ``n`` container sandboxes, exec in each, write and read files, pause and
    resume one, snapshot it, destroy them all."""
    seen: dict[str, Any] = {"ids": [], "outputs": [], "files": []}
    boxes = [client.sandboxes.create(image="base", memory="128MiB", ttl=600)
             for _ in range(n)]
    try:
        for i, sb in enumerate(boxes):
            seen["ids"].append(sb.id)
            r = sb.exec(["sh", "-c", f"echo hello-{i} && echo err >&2 && exit 3"], timeout=30)
            seen["outputs"].append((r.exit_code, r.stdout.strip(), r.stderr.strip()))
            sb.files.write(f"/tmp/note-{i}.txt", f"note {i}\n")
            seen["files"].append(sb.files.read_text(f"/tmp/note-{i}.txt"))
        first = boxes[0]
        first.pause()
        seen["paused_state"] = first.refresh().state
        first.resume()
        seen["resumed_state"] = first.refresh().state
        r = first.exec(["cat", "/tmp/note-0.txt"], timeout=30)
        seen["after_resume"] = r.stdout
        snap = first.snapshot()
        seen["snapshot"] = client.snapshots.get(snap.id).id == snap.id
        client.snapshots.delete(snap)
    finally:
        for sb in boxes:
            sb.kill()
    seen["gone"] = [b.refresh().state for b in boxes]
    return seen
