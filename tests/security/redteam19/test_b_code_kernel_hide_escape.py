"""Red team B (issue 19, ``sb.run_code`` x judge set-ups): a hidden agent runs code in
the judge's kernel and reads what ``hide`` keeps from it.

``ExecRequest.hide`` (Landlock) keeps a command's whole process tree out of top-level
entries of the root, even as root: the agent's execs run with ``hide=["judge"]`` so
they never read the judge's tests. The judge uses ``run_code``: its kernel is a
long-lived process started by the judge's own exec (no ``hide``), listening on
``/tmp/.dsec-code/<hash>/sock``. Landlock does not govern ``connect(2)`` to a pathname
Unix socket, so the agent (root, hidden from /judge) connects to that socket and has
the judge's unhidden kernel run its code: it reads /judge. Shown with the kernel's own
client (``kernel.py run``), as any agent could.
"""

from __future__ import annotations

import json

import httpx

from dsec.client.code import KERNEL_DIR, KERNEL_PATH
from tests.build.conftest import Debian, debian, debian_mirror  # noqa: F401 (fixtures)


def test_b_a_hidden_agent_cannot_use_the_judges_kernel(debian: Debian) -> None:  # noqa: F811
    cl = debian.cluster
    with cl.client() as client, client.sandboxes.create(image=debian.image,
                                                       detached=True) as sb:
        assert sb.exec(["sh", "-c", ("mkdir -p /judge && echo TOP-SECRET > "
                        "/judge/answers")]).exit_code == 0
        assert sb.run_code("1 + 1").text == "2"          # the judge's kernel is up

        def agent(argv: list[str], stdin: str = "") -> dict[str, object]:
            r = httpx.post(f"{cl.url}/v1/sandboxes/{sb.id}/exec",
                           headers={"authorization": f"Bearer {cl.api_key}"},
                           json={"argv": argv, "hide": ["judge"], "stdin": stdin,
                                 "timeout_s": 60}, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()  # type: ignore[no-any-return]
        direct = agent(["sh", "-c", "cat /judge/answers"])
        assert "TOP-SECRET" not in str(direct["stdout"]), direct   # hide holds directly
        via = agent(["python3", KERNEL_PATH, "run", KERNEL_DIR, "30"],
                    json.dumps({"code": "open('/judge/answers').read()"}))
        assert "TOP-SECRET" not in str(via["stdout"]), (
            f"the hidden agent read /judge through the judge's run_code kernel: {via}")
