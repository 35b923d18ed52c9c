"""SDK internals: the async core, the sync shell and the transports.
Import the public names from :mod:`dsec` (``from dsec import Client``); ``LocalCluster``
(which runs servers, so it is no part of the SDK) lives in :mod:`dsec.cluster.local`."""

from dsec.client.core import AsyncClient, AsyncSandbox, Snapshot
from dsec.client.sync import Client, Sandbox

__all__ = ["AsyncClient", "AsyncSandbox", "Client", "Sandbox", "Snapshot"]
