"""The management plane's core: pure logic objects plus the state store.

* :mod:`~dsec.control.iam` - principals, API keys, roles on the project tree.
* :mod:`~dsec.control.quota` - nested quotas and the incremental usage index.
* :mod:`~dsec.control.registry` - versioned event log and sandbox records.
* :mod:`~dsec.control.placement` - k-choice placement with an in-flight overlay.
* :mod:`~dsec.control.watcher` - heartbeats, node expiry/eviction, preemption.
* :mod:`~dsec.control.store` - the :class:`StateStore` interface and its SQLite backend.

None of these import asyncio, sockets or subprocesses; the apiserver feeds them events
and carries out what they return (docs/control.md shows the wiring).
"""
