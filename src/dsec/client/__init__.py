"""SDK internals: the async core, the sync shell, transports and LocalCluster.
Import the public names from :mod:`dsec` (``from dsec import Client``)."""

from dsec.client.core import AsyncClient, AsyncSandbox, Snapshot
from dsec.client.local import LocalCluster
from dsec.client.sync import Client, Sandbox

__all__ = ["AsyncClient", "AsyncSandbox", "Client", "LocalCluster", "Sandbox", "Snapshot"]
