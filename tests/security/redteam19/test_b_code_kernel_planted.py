"""Red team B (issue 19, ``sb.run_code``): a sandbox user plants the code kernel.

The kernel lives at a fixed, predictable path in the world-writable /tmp
(``/tmp/.dsec-code/<hash of the kernel source>/kernel.py``, its socket beside it) and
``run_code`` trusts whatever is there: ``test -f kernel.py || install``, then
``python3 kernel.py run``. Code that ran in the sandbox first as ANY user (the agent,
``nobody``) creates that directory and a ``kernel.py`` of its own; the next
``run_code`` (the judge's, as root, the exec's default user) executes the agent's file
as root and returns whatever it prints as the "result". The same holds for the socket:
in an agent-owned directory the agent swaps ``sock`` for its own listener and receives
the judge's code. ``mkdir -p`` with umask 077 does nothing to a directory that exists.
"""

from __future__ import annotations

import json

from dsec.client.code import KERNEL_DIR, KERNEL_PATH
from tests.build.conftest import Debian, debian, debian_mirror  # noqa: F401 (fixtures)

FAKE = ("import json, os\n"
        "open('/tmp/kernel-ran-as', 'w').write(str(os.getuid()))\n"
        "print(json.dumps({'results': [{'data': {'text/plain': 'FORGED'}, "
        "'is_main_result': True}]}))\n")


def test_b_an_agent_cannot_plant_the_judges_code_kernel(debian: Debian) -> None:  # noqa: F811
    client = debian.cluster.client()
    with client.sandboxes.create(image=debian.image, detached=True) as sb:
        # the agent goes first, as an unprivileged user
        r = sb.exec(["sh", "-c", (f"mkdir -p {KERNEL_DIR} && chmod 0777 {KERNEL_DIR} && "
                     f"cat > {KERNEL_PATH}")], stdin=FAKE, user="65534")
        assert r.exit_code == 0, r.stderr
        # the judge (root, the default user) evaluates
        ex = sb.run_code("import os\nos.getuid()")
        ran_as = sb.exec(["sh", "-c", "cat /tmp/kernel-ran-as 2>/dev/null || true"])
        assert ex.text == "0", (
            f"run_code answered {ex.text!r}: the agent's planted kernel answered for the "
            f"judge; it ran as uid {ran_as.stdout.decode()!r}; "
            f"{json.dumps({'stdout': ex.stdout, 'error': str(ex.error)})}")
        assert ran_as.stdout == b"", ran_as.stdout
