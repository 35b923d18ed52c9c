"""``sb.run_code``: a stateful Python interpreter inside a real container sandbox (the
Debian image of this directory's session fixture: python3 from bookworm), through the
sync and async SDK and ``dsec sandbox run-code``."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess

import pytest

from dsec.errors import CannotRun

from .conftest import DSEC, Debian


def test_state_persists_output_results_errors(debian: Debian) -> None:
    client = debian.cluster.client()
    with client.sandboxes.create(image=debian.image, detached=True) as sb:
        first = sb.run_code("x = 41\nprint('hi'); import sys; print('err', file=sys.stderr)")
        assert first.error is None, first.error
        assert (first.stdout, first.stderr, first.text) == ("hi\n", "err\n", None)
        ex = sb.run_code("x + 1")
        assert ex.text == "42" and ex.error is None and ex.results[0].is_main_result
        assert ex.execution_count == first.execution_count + 1
        # rich display data: an object's _repr_png_/_repr_html_, and display() itself
        ex = sb.run_code(
            "class Pic:\n"
            "    def _repr_png_(self): return b'\\x89PNG-bytes'\n"
            "    def _repr_html_(self): return '<b>pic</b>'\n"
            "    def __repr__(self): return 'Pic()'\n"
            "display('side')\n"
            "Pic()")
        assert ex.error is None, ex.error
        side, main = ex.results
        assert side.text == "'side'" and not side.is_main_result
        assert main.text == "Pic()" and main.png == b"\x89PNG-bytes" and main.html == "<b>pic</b>"
        # errors: name, value, the user's traceback only; state survives them
        ex = sb.run_code("def f():\n    return 1 / 0\nf()")
        assert ex.error is not None and ex.error.name == "ZeroDivisionError"
        assert ex.error.value == "division by zero"
        assert "<cell" in ex.error.traceback and "code_kernel" not in ex.error.traceback
        assert sb.run_code("x").text == "41"
        ex = sb.run_code("def broken(:\n  pass")
        assert ex.error is not None and ex.error.name == "SyntaxError"
        # a timeout interrupts the code; the kernel and its state live on
        ex = sb.run_code("import time\nwhile True: time.sleep(0.05)", timeout=1)
        assert ex.timed_out and ex.error is not None and ex.error.name == "KeyboardInterrupt"
        assert sb.run_code("x * 2").text == "82"
        # code that swallows the interrupt: the kernel is killed, said so; a fresh one next
        ex = sb.run_code("import time\nwhile True:\n    try: time.sleep(10)\n"
                         "    except KeyboardInterrupt: pass", timeout=1)
        assert ex.timed_out and ex.error is not None and ex.error.name == "TimeoutError"
        assert "kernel was killed" in ex.error.value
        ex = sb.run_code("x")
        assert ex.error is not None and ex.error.name == "NameError"
        # restart: the variables are gone
        assert sb.run_code("y = 5").error is None
        sb.restart_code()
        ex = sb.run_code("y")
        assert ex.error is not None and ex.error.name == "NameError"
        # the kernel is the sandbox's: another client process (the CLI) sees its state
        sb.run_code("z = 'from the sdk'")
        env = {"DSEC_URL": debian.cluster.url, "DSEC_API_KEY": debian.cluster.api_key}
        p = subprocess.run([*DSEC, "sandbox", "run-code", sb.id, "z.upper()"],
                           capture_output=True, text=True, timeout=120, check=False,
                           env={**os.environ, **env})
        assert p.returncode == 0 and p.stdout == "'FROM THE SDK'\n", p.stderr
        p = subprocess.run([*DSEC, "sandbox", "run-code", sb.id, "nope", "--json"],
                           capture_output=True, text=True, timeout=120, check=False,
                           env={**os.environ, **env})
        assert p.returncode == 1 and json.loads(p.stdout)["error"]["name"] == "NameError"


def test_async_client_and_an_image_without_python(debian: Debian) -> None:
    async def main() -> None:
        async with debian.cluster.async_client() as c:
            sb = await c.sandboxes.create(image=debian.image, detached=True)
            try:
                await sb.run_code("import math; r = 3")
                ex = await sb.run_code("round(math.pi * r ** 2, 2)")
                assert ex.text == "28.27"
            finally:
                await sb.kill()
    asyncio.run(main())
    client = debian.cluster.client()
    with (client.sandboxes.create(image="base", detached=True) as sb,  # busybox: no python
          pytest.raises(CannotRun, match="needs python3")):
        sb.run_code("1")
