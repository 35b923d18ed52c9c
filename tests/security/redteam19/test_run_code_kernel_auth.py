"""``sb.run_code``'s kernel answers only its caller (fix of red team 19 B1/B2), tested
with the attacks the red team's repros stand for, aimed at the REAL kernel directory
(which an agent finds with ``ls /tmp`` once the judge made it):

- a hidden root agent (``hide=["judge"]``) and an unprivileged one (``nobody``) run the
  kernel's own client against it with a guessed token: refused, /judge unread;
- the hidden root agent swaps the kernel's socket for its own listener (root passes the
  directory's 0700): the judge's next ``run_code`` refuses (the listener cannot prove the
  token for its pid) and the listener receives neither the code nor the token.
"""

from __future__ import annotations

import json

import httpx
import pytest

from dsec.client.code import KERNEL_DIR, KERNEL_SOURCE
from dsec.errors import CannotRun
from tests.build.conftest import Debian, debian, debian_mirror  # noqa: F401 (fixtures)

# the agent's listener: takes the kernel's socket path, records what a client sends
FAKE = r"""
import json, os, socket, sys
d = sys.argv[1]
p = os.path.join(d, "sock")
os.unlink(p)
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(p); srv.listen(4)
if os.fork():
    sys.exit(0)
fd = os.open(os.devnull, os.O_RDWR)
for i in (0, 1, 2):
    os.dup2(fd, i)
srv.settimeout(120)
c, _ = srv.accept()
c.settimeout(5)
got = b""
try:
    got += c.recv(65536)
    c.sendall(json.dumps({"proof": "0" * 64}).encode() + b"\n")
    while True:
        b = c.recv(65536)
        if not b:
            break
        got += b
except OSError:
    pass
open("/tmp/stolen.new", "wb").write(got)
os.rename("/tmp/stolen.new", "/tmp/stolen")
"""


def test_only_the_caller_reaches_its_run_code_kernel(debian: Debian) -> None:  # noqa: F811
    cl = debian.cluster
    with cl.client() as client, client.sandboxes.create(image=debian.image,
                                                       detached=True) as sb:
        assert sb.exec(["sh", "-c", ("mkdir -p /judge && echo TOP-SECRET > "
                        "/judge/answers")]).exit_code == 0
        assert sb.run_code("1 + 1").text == "2"

        def agent(argv: list[str], stdin: str = "", **kw: object) -> dict[str, object]:
            r = httpx.post(f"{cl.url}/v1/sandboxes/{sb.id}/exec",
                           headers={"authorization": f"Bearer {cl.api_key}"},
                           json={"argv": argv, "stdin": stdin, "timeout_s": 60, **kw},
                           timeout=120)
            assert r.status_code == 200, r.text
            return r.json()  # type: ignore[no-any-return]
        found = agent(["sh", "-c", f"ls -d {KERNEL_DIR}-*"], hide=["judge"])
        dirs = str(found["stdout"]).split()
        assert len(dirs) == 1 and dirs[0].startswith(KERNEL_DIR + "-"), found
        d = dirs[0]
        guess = json.dumps({"token": "0" * 64, "code": "open('/judge/answers').read()"})
        for who in ({"hide": ["judge"]}, {"user": "65534"}):
            via = agent(["python3", "-c", KERNEL_SOURCE, "run", d, "30"], guess, **who)
            assert "TOP-SECRET" not in str(via["stdout"]), (who, via)
            assert via["exit_code"] == 92, (who, via)    # refused, not "no kernel"
        assert sb.run_code("1 + 2").text == "3"          # the judge's kernel is intact

        # the hidden root agent swaps the socket for its own listener
        swapped = agent(["python3", "-c", FAKE, d], hide=["judge"])
        assert swapped["exit_code"] == 0, swapped
        with pytest.raises(CannotRun, match="not this kernel"):
            sb.run_code("'judge-code-marker'")
        stolen = sb.exec(["sh", "-c", ("for i in $(seq 100); do test -f /tmp/stolen && "
                          "break; sleep 0.1; done; cat /tmp/stolen")]).stdout.decode()
        assert "hello" in stolen, stolen                 # it was the listener we reached
        assert "judge-code-marker" not in stolen and '"token"' not in stolen, stolen
