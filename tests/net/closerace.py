"""A router closed while a refill thread builds slots (run as a script by test_close_race.py,
in a child process: heap corruption aborts the process, which must fail the test, not kill
pytest).

``python -m tests.net.closerace ITERATIONS`` makes a fake internet, then per iteration a
real :class:`Router` and a thread that keeps the pool draining and refilling (``take`` +
``lose`` + ``refill``: every refill rebuilds dropped indices through rtnetlink and
libnftables, outside the router's lock, as ``SandboxNetwork._refill_soon`` does), and
closes the router at a varying moment under it. Every ``setns`` of the process is
recorded with the namespace (nsfs inode) it entered. After each close, namespaces are
opened at once to take the numbers close() freed - as a sandbox's would - and the
iteration checks:

- the refill thread ended with nothing but the router's own "closed" refusals
  (:class:`BackendError`), never another exception;
- no ``setns`` happened after close() returned, and none ever entered a namespace that
  was neither the host's, the router's, nor one the router built (a reused fd number);
- the process's open fds are exactly the ones open before the iteration (nothing leaked,
  nothing closed twice: a second close of a number takes another owner's fd).

Prints ``ok N`` and exits 0, or prints what went wrong and exits 1.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time

from dsec.errors import BackendError
from dsec.net import netns
from dsec.net.router import Router, RouterConfig
from dsec.net.testinternet import start
from dsec.net.uplink import NetnsUplink

_real_setns = netns.setns_net
_real_new = netns.new_netns


class Recorder:
    """Every setns of the process: (after close?, inode entered); and every netns inode
    the router made (its own and its slots')."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.made: set[int] = set()
        self.entered: list[tuple[bool, int, str]] = []
        self.closed = False

    def setns(self, fd: int) -> None:
        try:
            ino = os.fstat(fd).st_ino
        except OSError:
            ino = -1
        with self.lock:
            self.entered.append((self.closed, ino, threading.current_thread().name))
        _real_setns(fd)

    def new(self) -> int:
        fd = _real_new()
        with self.lock:
            self.made.add(os.fstat(fd).st_ino)
        return fd


def _fds() -> set[int]:
    return {int(x) for x in os.listdir("/proc/self/fd")}


def iteration(k: int, inet_fd: int, rec: Recorder, rng: random.Random) -> list[str]:
    errors: list[str] = []
    host = os.stat("/proc/self/ns/net").st_ino
    before = _fds()
    with rec.lock:
        rec.closed = False
        rec.entered.clear()
        rec.made.clear()
    r = Router.create(RouterConfig(pool_min=4, build_batch=4),
                      NetnsUplink(inet_fd, f"crup{os.getpid() % 1000}x{k}"))
    router_ino = os.fstat(r.fd).st_ino
    r.refill()
    stop = threading.Event()
    closing = threading.Event()  # set right before close(): refusals after it are ok

    def hammer() -> None:
        try:
            while not stop.is_set():
                try:
                    slot = r.take()
                    r.lose(slot)      # dropped: the next refill rebuilds the index
                    r.refill()
                except BackendError as exc:
                    if not closing.is_set():
                        errors.append(f"refill failed before close: {exc}")
                        return
        except BaseException as exc:  # noqa: BLE001 - reported by the iteration
            errors.append(f"refill thread died: {type(exc).__name__}: {exc}")

    t = threading.Thread(target=hammer, name="refill")
    t.start()
    time.sleep(rng.uniform(0.0, 0.03))
    closing.set()
    r.close()
    with rec.lock:
        rec.closed = True
    # a sandbox's namespaces take the numbers close() freed
    foreign = [_real_new() for _ in range(16)]
    time.sleep(0.01)
    stop.set()
    t.join(30)
    if t.is_alive():
        errors.append("the refill thread hangs after close")
    for fd in foreign:
        os.close(fd)
    allowed = {host, router_ino} | rec.made
    with rec.lock:
        # the main thread's own setns calls (new_netns for the foreign fds) are this
        # script's; the refill thread's are the router's
        late = [ino for after, ino, who in rec.entered if after and who == "refill"]
        wrong = [ino for _, ino, who in rec.entered if ino not in allowed and who == "refill"]
    if late:
        errors.append(f"{len(late)} setns call(s) after close() returned: {late[:3]}")
    if wrong:
        errors.append(f"setns into a namespace the router never made: {wrong[:3]}")
    after = _fds()
    if after != before:
        errors.append(f"fds changed: leaked {sorted(after - before)[:8]}, "
                      f"closed {sorted(before - after)[:8]}")
    return errors


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    rec = Recorder()
    netns.setns_net = rec.setns
    netns.new_netns = rec.new
    rng = random.Random(1)
    inet = start()
    try:
        for k in range(n):
            errors = iteration(k, inet.fd, rec, rng)
            if errors:
                print(f"iteration {k}: " + "; ".join(errors), flush=True)
                return 1
    finally:
        inet.close()
    print(f"ok {n}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
