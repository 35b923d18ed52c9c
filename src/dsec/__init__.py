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
    # Redundant aliases mark these as re-exports for type checkers; at runtime
    # they are loaded lazily by __getattr__ below.
    from dsec.client.build import BuiltImage as BuiltImage
    from dsec.client.build import Image as Image
    from dsec.client.core import AsyncClient as AsyncClient
    from dsec.client.core import AsyncSandbox as AsyncSandbox
    from dsec.client.core import Snapshot as Snapshot
    from dsec.client.sync import Client as Client
    from dsec.client.sync import Sandbox as Sandbox
    from dsec.cluster.local import LocalCluster as LocalCluster
    from dsec.wire.spec import ExecResult as ExecResult
    from dsec.wire.spec import FileInfo as FileInfo
    from dsec.wire.spec import SandboxEvent as SandboxEvent
    from dsec.wire.spec import SandboxInfo as SandboxInfo

__version__ = "0.1.0"

_LAZY = {
    "Image": "dsec.client.build",
    "BuiltImage": "dsec.client.build",
    "Client": "dsec.client.sync",
    "Sandbox": "dsec.client.sync",
    "AsyncClient": "dsec.client.core",
    "AsyncSandbox": "dsec.client.core",
    "Snapshot": "dsec.client.core",
    "LocalCluster": "dsec.cluster.local",
    "ExecResult": "dsec.wire.spec",
    "FileInfo": "dsec.wire.spec",
    "SandboxEvent": "dsec.wire.spec",
    "SandboxInfo": "dsec.wire.spec",
}

# Computed so that _LAZY and dsec.errors.__all__ stay the single source of the names.
__all__ = sorted([*_LAZY, *_errors_all, "__version__"])  # noqa: PLE0605


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'dsec' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value
