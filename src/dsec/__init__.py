"""dsec: elastic sandboxes for agentic reinforcement learning.

The public face::

    from dsec import Client, AsyncClient, Sandbox, LocalCluster, DsecError

    with Client() as client:                      # DSEC_URL/DSEC_API_KEY or `dsec up`
        with client.sandboxes.create(image="base", cpu=1, memory="1GiB") as sb:
            print(sb.exec("echo hi").stdout)

Names are loaded lazily so ``import dsec.<subpackage>`` (and the ``dsec`` CLI) stays fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dsec.errors import *
from dsec.errors import __all__ as _errors_all

if TYPE_CHECKING:
    from dsec.client.core import AsyncClient, AsyncSandbox, Snapshot
    from dsec.client.local import LocalCluster
    from dsec.client.sync import Client, Sandbox
    from dsec.edge.spec import ExecResult, FileInfo, SandboxEvent, SandboxInfo

__version__ = "0.1.0"

_LAZY = {
    "Client": "dsec.client.sync",
    "Sandbox": "dsec.client.sync",
    "AsyncClient": "dsec.client.core",
    "AsyncSandbox": "dsec.client.core",
    "Snapshot": "dsec.client.core",
    "LocalCluster": "dsec.client.local",
    "ExecResult": "dsec.edge.spec",
    "FileInfo": "dsec.edge.spec",
    "SandboxEvent": "dsec.edge.spec",
    "SandboxInfo": "dsec.edge.spec",
}

__all__ = sorted([*_LAZY, *_errors_all, "__version__"])


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'dsec' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value
