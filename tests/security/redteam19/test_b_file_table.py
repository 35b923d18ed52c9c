"""Red team B (issue 22 density, ``dsec.nofile``): one sandbox can take the node's whole
file table.

The edge raises its soft ``RLIMIT_NOFILE`` to the hard limit at start and every sandbox
process inherits it (soft = hard, here 20,000; under systemd often 524,288), with
``pids_max`` 1,024 processes by default: nothing bounds the open files of a sandbox but
its memory. Each open file costs it ~300-1,200 bytes of memcg charge (measured below:
struct file, the fd table, the shell), so a 4 GiB sandbox (a sixth of this node, any
member may ask it) holds ~3.5-14 million; ``fs.file-max`` on this 24 GiB node is ~2.47
million and is node-wide: once it is reached every process without
CAP_SYS_ADMIN in the host's user namespace - every other tenant's sandbox, host users -
gets ENFILE on every open/socket/pipe. (Not run to the end here: that would take this
shared machine's file table.) Measured contained: 20,000 files (< 1% of file-max) and
the charge they cost, then the arithmetic. A fix bounds what one sandbox can hold (a
per-sandbox RLIMIT_NOFILE with pids_max x nofile well below the table, or a node
file-max raised past what sandbox memory can reach, checked at edge start).
"""

from __future__ import annotations

import os
import time

import pytest

from dsec.cluster.local import LocalCluster

OPEN = 20_000
# (a failed ``exec N<file`` ends a non-interactive sh: stay below the soft limit)
SCRIPT = ("n=$(ulimit -n); [ $n -gt {n} ] && n={n}; n=$((n-10)); i=3; "
          "while [ $i -lt $n ]; do eval \"exec $i</dev/null\"; i=$((i+1)); done; "
          "ls /proc/$$/fd | wc -l > /tmp/opened; sleep 120")


def test_b_one_4gib_sandbox_cannot_hold_half_the_nodes_file_table() -> None:
    if os.geteuid() != 0:
        pytest.fail("container sandboxes need root (CI runs as root)")
    with open("/proc/sys/fs/file-max") as f:
        file_max = int(f.read())
    with LocalCluster(edges=1, backend="container") as cl, cl.client() as c:
        sb = c.sandboxes.create(memory="4GiB")   # a sixth of this 24 GiB node
        try:
            before = sb.stats().memory_bytes
            sb.processes.start(["sh", "-c", SCRIPT.format(n=OPEN + 3)])
            opened = 0
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                r = sb.exec(["sh", "-c", "cat /tmp/opened 2>/dev/null || echo 0"], timeout=30)
                # the shell's `>` creates the file before wc writes into it: empty means not yet
                opened = int((r.stdout.split() or [b"0"])[0])
                if opened:
                    break
                time.sleep(0.5)
            hard = int(sb.exec(["sh", "-c", "ulimit -Hn"]).stdout)
            st = sb.stats()
            per_file = max(1.0, (st.memory_bytes - before) / max(1, opened))
            by_memory = (st.memory_limit_bytes or 0) / per_file
            by_limits = (st.pids_max or 1 << 22) * hard
            can_hold = min(by_memory, by_limits)
        finally:
            sb.kill()
    assert opened >= 1000, opened
    assert can_hold < file_max / 2, (
        f"one 4 GiB sandbox can hold ~{can_hold:,.0f} open files (memory limit "
        f"{st.memory_limit_bytes:,} B / {per_file:.0f} B per file measured over {opened:,} "
        f"files; pids_max {st.pids_max} x RLIMIT_NOFILE {hard:,} = {by_limits:,}); the "
        f"node's file table (fs.file-max) is {file_max:,} for every tenant")
